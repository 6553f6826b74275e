"""Code we did not write, round thirty (tests/zoo30.py, zoo30b.py, zoo30c.py; sources and
commits there): Keras 3 on the JAX backend, the guides' ``model.stateless_call`` and
``optimizer.stateless_apply`` as pure functions of the variables' values, through a Hybrid, an
artifact, a Batcher and ``symjax-mlp run``.

- "Writing a training loop from scratch in JAX": ``stateless_call`` hybridized over every
  feature equals Keras's own ``model(x)``; the guide's ``train_step`` (``value_and_grad`` of
  ``compute_loss_and_updates``, Adam's ``stateless_apply``) run by ``h.apply`` equals the same
  step under ``jax.jit`` for three steps; a loaded artifact's ``m.apply`` in place of
  ``stateless_call`` under ``jax.grad`` gives the guide's gradients and updates, and under
  ``jax.vmap`` over two models' weights each model's own answers.
- "Multi-GPU distributed training with JAX": its convnet's ``stateless_call(...,
  training=True)`` returns the BatchNormalization statistics and the Dropout seed generator's
  state as Keras returns them, hybridized and exported; its ``@jax.jit`` ``train_step`` run by
  ``h.apply`` equals its own; at inference, every feature and ``symjax-mlp run`` on .npy files.
- "Customizing what happens in fit() with JAX": the ``CustomModel``'s ``train_step``, a
  method, hybridized over the state ``fit`` builds: two steps by ``h.apply`` give the logs
  (its compiled loss and ``mae``) and the state of ``jax.jit(model.train_step)``.
- Found: the guides' state is ``model.trainable_variables`` itself, Keras Variables. JAX 0.10
  refuses them under jit ("Triggering __jax_array__() during abstractification is no longer
  supported"), the guides' own ``jax.jit(train_step)`` included (Keras's, not ours); a Hybrid
  took them at ``hybridize`` and raised that bare ValueError at the first call, naming no
  path. Now a ConfigError at ``hybridize`` (and ``h.apply``) naming the leaf and
  ``v.value``; such an input, ``h(keras.Variable(x))``, is refused as another library's array.
- Found: ``sm.hybridize(model)`` of a Keras model (or a function closing over one) was told
  "write hybridize(lambda _, x: f(x), {})", which bakes its Variables into the program as they
  are (h.params empty); now the refusal names ``stateless_call`` over the variables' values.

``KERAS_BACKEND`` must be set before keras is imported: the ``zoo`` fixture sets it around
that import and restores it, so no other test module's process sees it.
"""

import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from features import close, every_feature

import symjax_mlp as sm


@pytest.fixture(scope="module")
def zoo():
    """``(zoo30, zoo30b, zoo30c)``, imported with ``KERAS_BACKEND=jax`` (restored after)."""
    before = os.environ.get("KERAS_BACKEND")
    os.environ["KERAS_BACKEND"] = "jax"
    try:
        keras = pytest.importorskip("keras")
        modules = tuple(map(importlib.import_module, ("zoo30", "zoo30b", "zoo30c")))
    finally:
        if before is None:
            os.environ.pop("KERAS_BACKEND")
        else:
            os.environ["KERAS_BACKEND"] = before
    if keras.backend.backend() != "jax":  # imported before, under another backend
        pytest.skip(f"keras was imported with the {keras.backend.backend()} backend")
    return modules


def _values(variables):
    return [v.value for v in variables]


def _state(zoo_module):
    """The guide's ``state``: the values of the model's and the optimizer's variables."""
    model, optimizer = zoo_module.model, zoo_module.optimizer
    return (
        _values(model.trainable_variables),
        _values(model.non_trainable_variables),
        _values(optimizer.variables),
    )


def _forward(model, training):
    def forward(variables, x):  # the guides' stateless_call, variables as one tree
        y, non_trainable = model.stateless_call(*variables, x, training=training)
        return (y, non_trainable) if training else y

    return forward


RNG = np.random.RandomState(30)
X = RNG.rand(8, 784).astype(np.float32)  # the guide's flattened digits
Y = np.eye(10, dtype=np.float32)[RNG.randint(0, 10, 8)]  # to_categorical's
IMAGES = (RNG.rand(4, 28, 28, 1) * 255).astype(np.float32)  # the convnet rescales by 1/255
LABELS = RNG.randint(0, 10, 4)  # SparseCategoricalCrossentropy's


@pytest.mark.slow  # every feature: an export of vjp_order=2, Hessians (~5 s)
def test_stateless_call_over_every_feature_equals_keras_own_call(zoo, tmp_path):
    """The guide's model as a pure function of its variables' values, hybridized: every
    feature (graph, export, load, grad, per-row Hessians, a Batcher) equals ``model(x)``."""
    model = zoo[0].model
    h = sm.hybridize(_forward(model, False), _state(zoo[0])[:2])
    every_feature(tmp_path, h, lambda x: model(x), X)


@pytest.mark.slow  # compiles the guide's step twice (~3 s)
def test_the_guides_train_step_through_h_apply_equals_its_own_for_three_steps(zoo):
    """``loss, state = h.apply(state, (x, y))``, the guide's loop with a Hybrid of its
    ``train_step`` in place of ``jax.jit(train_step)``: the same losses, weights and Adam
    state (its iteration count, moments) after three steps; the weights moved."""
    state = _state(zoo[0])
    h = sm.hybridize(zoo[0].train_step, state)
    keras_step = jax.jit(zoo[0].train_step)
    want, got = state, state
    for _ in range(3):
        want_loss, want = keras_step(want, (X, Y))
        got_loss, got = h.apply(got, (X, Y))
        close(got_loss, want_loss)
    close(got, want)
    assert int(got[2][0]) == 3  # Adam's iterations
    assert not np.allclose(got[0][0], state[0][0])
    close(h((X, Y)), keras_step(state, (X, Y)))  # h(data) steps from the held state


@pytest.mark.slow  # an export of vjp_order=1 and the guide's step (~4 s)
def test_a_loaded_models_m_apply_under_grad_and_vmap_as_a_keras_user_calls_it(zoo, tmp_path):
    """A loaded artifact's ``m.apply`` in place of ``model.stateless_call`` in the guide's
    ``compute_loss_and_updates``: ``jax.value_and_grad`` and Adam's ``stateless_apply`` give
    the guide's ``train_step``; ``jax.vmap`` of ``m.apply`` over two models' stacked weights
    (the guide's ``get_model`` twice) answers as each model's own ``model(x)``."""
    g, (trainable, non_trainable, opt) = zoo[0], _state(zoo[0])
    h = sm.hybridize(_forward(g.model, False), (trainable, non_trainable))
    sm.export(h, tmp_path / "m", example=(X,), vjp_order=1)
    m = sm.load(tmp_path / "m")

    def compute_loss(trainable_variables, x, y):
        return g.loss_fn(y, m.apply((trainable_variables, non_trainable), x))

    loss, grads = jax.value_and_grad(compute_loss)(trainable, X, Y)
    new, new_opt = g.optimizer.stateless_apply(opt, grads, trainable)
    want_loss, (want, _, want_opt) = jax.jit(g.train_step)((trainable, non_trainable, opt), (X, Y))
    close((loss, new, new_opt), (want_loss, want, want_opt))

    other = g.get_model()
    stacked = jax.tree.map(lambda *w: jnp.stack(w), trainable, _values(other.trainable_variables))
    both = jax.vmap(lambda t: m.apply((t, non_trainable), X))(stacked)
    close(both, np.stack([g.model(X), other(X)]))


@pytest.mark.slow  # compiles the convnet's training call, exports it (~6 s)
def test_batchnorm_and_dropout_state_comes_back_as_keras_returns_it(zoo, tmp_path):
    """The convnet's ``stateless_call(..., training=True)``: its outputs (Dropout's mask drawn
    from the seed generator's state) and the new non-trainable values (BatchNormalization's
    moving statistics, the seed state advanced), hybridized and from a loaded artifact, are
    Keras's; fed back, the next call is Keras's next call (a new mask)."""
    model = zoo[1].model
    variables = _state(zoo[1])[:2]
    forward = _forward(model, True)
    h = sm.hybridize(forward, variables)
    flat = sm.hybridize(lambda v, x: tuple(jax.tree.leaves(forward(v, x))), variables)
    sm.export(flat, tmp_path / "m", example=(IMAGES,))  # an artifact returns a flat tuple
    m = sm.load(tmp_path / "m", allow={"convolution"})
    want = forward(variables, IMAGES)
    assert not np.allclose(want[1][0], variables[1][0])  # a moving mean moved
    assert int(want[1][-1][1]) != int(variables[1][-1][1])  # the seed state advanced
    close(h(IMAGES), want, rtol=1e-4, atol=1e-5)
    close(m(IMAGES), tuple(jax.tree.leaves(want)), rtol=1e-4, atol=1e-5)
    after = (variables[0], want[1])
    want_next = forward(after, IMAGES)
    assert not np.allclose(want_next[0], want[0])  # another mask
    close(h.apply(after, IMAGES), want_next, rtol=1e-4, atol=1e-5)
    close(m.apply(after, IMAGES), tuple(jax.tree.leaves(want_next)), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # compiles the convnet's step twice (~15 s on two cores)
def test_the_convnets_jitted_train_step_through_h_apply_equals_its_own(zoo):
    """The guide's ``@jax.jit`` ``train_step`` (BatchNormalization and Dropout in training)
    hybridized whole: two steps by ``h.apply`` give its losses, weights, statistics, seed
    state and Adam state."""
    state = _state(zoo[1])
    h = sm.hybridize(zoo[1].train_step, state)
    want, got = state, state
    for _ in range(2):
        want_loss, want = zoo[1].train_step(want, IMAGES, LABELS)
        got_loss, got = h.apply(got, IMAGES, LABELS)
        close(got_loss, want_loss, rtol=1e-4, atol=1e-5)
    close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # every feature of a convnet: Hessians of 784 pixels (~10 s)
def test_the_convnet_at_inference_over_every_feature_and_symjax_mlp_run(zoo, tmp_path):
    """The convnet at inference (moving statistics, no dropout): every feature equals
    ``model(x)``; the artifact run by ``symjax-mlp run`` on .npy files answers the same."""
    from symjax_mlp.cli import main

    model = zoo[1].model
    h = sm.hybridize(_forward(model, False), _state(zoo[1])[:2])
    allow = {"convolution"}  # what an MLP's artifact never needs, a convnet's does
    every_feature(tmp_path, h, lambda x: model(x), IMAGES, allow=allow, rtol=1e-4, atol=1e-4)
    np.save(tmp_path / "x.npy", IMAGES[:3])
    argv = ["run", str(tmp_path / "m"), "--input", str(tmp_path / "x.npy"), "--allow", *allow]
    assert main([*argv, "--output", str(tmp_path / "y.npy")]) == 0
    close(np.load(tmp_path / "y.npy"), model(IMAGES[:3]), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # keras's import and its model (~10 s on two cores)
def test_keras_variables_as_params_or_inputs_are_refused_naming_them_and_their_values(zoo):
    """The guides' state, ``model.trainable_variables`` itself: a ConfigError at
    ``hybridize`` (and ``h.apply``) naming the leaf and ``v.value``, where a Hybrid took them
    and the first call raised JAX's bare ValueError ("Triggering __jax_array__() during
    abstractification is no longer supported"), as ``jax.jit`` of the guide's step does; a
    Keras Variable as an input is refused as another library's array."""
    import keras

    model = zoo[0].model
    forward = _forward(model, False)
    raw = (model.trainable_variables, model.non_trainable_variables)
    with pytest.raises(ValueError, match="__jax_array__"):  # Keras's own guide, JAX 0.10
        jax.jit(forward)(raw, X)
    with pytest.raises(sm.ConfigError) as e:
        sm.hybridize(forward, raw)
    said = str(e.value)
    assert said.startswith("forward: params[0][0] is a keras.src.backend"), said
    assert "[v.value for v in model.trainable_variables]" in said, said
    h = sm.hybridize(forward, (_values(raw[0]), []))
    with pytest.raises(sm.ConfigError, match=r"forward.apply: params\[0\]\[0\] is a keras"):
        h.apply(raw, X)
    with pytest.raises(sm.ConfigError, match=r"args\[0\] is a keras.*another library's array"):
        h(keras.Variable(X))
    close(h(X), model(X))  # the values: Keras's own answer


def test_a_leaf_jax_converts_no_more_is_refused_at_hybridize_not_at_the_first_call():
    """Any object with a ``__jax_array__`` (JAX 0.10 refuses them all, ``jnp.sin`` too) among
    the params or inputs: a ConfigError naming it, not JAX's bare ValueError from the call."""

    class Wrapped:
        def __init__(self, a):
            self.a = a

        def __jax_array__(self):
            return self.a

    with pytest.raises(sm.ConfigError, match=r"params\['w'\] is a test_authors_round30.*Wrapped"):
        sm.hybridize(lambda p, x: x * p["w"], {"w": Wrapped(jnp.ones(3))})
    h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.ones(3)})
    with pytest.raises(sm.ConfigError, match=r"args\[0\] is of type Wrapped"):
        h(Wrapped(jnp.ones(3)))


@pytest.mark.slow  # keras's import (the fixture's, ~10 s on two cores)
def test_a_keras_model_without_params_is_refused_naming_its_stateless_call(zoo):
    """``sm.hybridize(model)`` of a Keras model, a function closing over one, or its bound
    ``stateless_call``: the ConfigError names Keras's Variables and the guide's route, where it
    said "for a function without params write hybridize(lambda _, x: f(x), {})", which bakes
    the weights as they are into the program (h.params empty, later training unseen)."""
    model = zoo[0].model
    layer = model.layers[1]
    for fn, kind in ((model, "Functional"), (lambda x: model(x), "Functional"),
                     (model.stateless_call, "Functional"), (layer, "Dense")):  # fmt: skip
        with pytest.raises(sm.ConfigError) as e:
            sm.hybridize(fn)
        said = str(e.value)
        assert f"a Keras {kind} holds its weights as Keras Variables" in said, said
        assert "model.stateless_call(*v, x)[0]" in said, said


@pytest.mark.slow  # a fit of one batch and the guide's step compiled twice (~3 s)
def test_a_custom_models_train_step_method_through_h_apply_equals_keras_jit(zoo):
    """The guide's ``CustomModel.train_step`` (a bound method, ``self.optimizer`` and
    ``self.metrics`` inside) hybridized over the state its ``fit`` built (the guide's "just
    use fit as usual", one batch): two steps by ``h.apply`` give the logs and the state that
    ``jax.jit(model.train_step)`` gives; the Adam step count and the metrics' totals moved."""
    model = zoo[2].make_model()
    x, y = RNG.rand(64, 32).astype(np.float32), RNG.rand(64, 1).astype(np.float32)
    model.fit(x[:32], y[:32], epochs=1, batch_size=32, verbose=0)
    state = (_values(model.trainable_variables), _values(model.non_trainable_variables),
             _values(model.optimizer.variables), _values(model.metrics_variables))  # fmt: skip
    h = sm.hybridize(model.train_step, state)
    keras_step = jax.jit(model.train_step)
    want, got = state, state
    for rows in (slice(0, 32), slice(32, 64)):
        want_logs, want = keras_step(want, (x[rows], y[rows]))
        got_logs, got = h.apply(got, (x[rows], y[rows]))
        close(got_logs, want_logs)
    close(got, want)
    assert set(got_logs) == {"loss", "compile_metrics"} and "mae" in got_logs["compile_metrics"]
    assert int(got[2][0]) == int(state[2][0]) + 2  # Adam's iterations
    assert not np.allclose(got[3], state[3])
