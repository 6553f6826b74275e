"""Code we did not write, round twenty-nine (tests/zoo29.py; sources and commit there):
intermediates, as their authors capture them, through a Hybrid, an artifact and a Batcher.

- flax's linen guide "Extracting intermediate values": ``SowCNN2`` (a module called twice
  sows two features) hybridized with ``mutable=["intermediates"]`` returns ``(out, sown)`` as
  the guide's ``predict`` does, each call its own two (nothing held from the last call);
  ``capture_intermediates=`` (``True``, ``filter_Dense``, the ``filter_fn`` of the sown
  ``Model``) in ``h.apply`` as the guide's ``predict`` passes it to ``model.apply``; the
  ``perturb`` section's ``loss_fn`` over ``h.apply``, its grads of the perturbations the guide's;
  the features exported as an entry point of their own beside ``predict``, loaded and served.
- flax's nnx integration test: ``Linear`` sets ``self.y = nnx.Intermediate(y)``; after
  ``h(x)`` the Hybrid's module (``h.module``) pops what eager nnx pops; under jax.grad or
  jax.jit the call that would hold ``y`` as a tracer is refused, the held ``y`` left as it was.
- flax's nnx VAE example: ``train_step``'s ``loss_fn`` pops the encoder's ``Loss``; three
  steps over ``h.apply_with_state`` (its ``kl_loss`` read from the new state, popped from the
  state carried on) equal three of the example's own: the losses and the weights.

Not driven: oryx's ``sow``/``reap`` (oryx 0.2.9 imports tensorflow-probability 0.25, which
reads ``jax.interpreters.xla.pytype_aval_mappings``, gone in JAX 0.10: it does not import).
"""

import flax
import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo29
from features import close
from flax import nnx

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each compiles a CNN's or VAE's calls and grads (~1-5 s)

X = jax.random.normal(jax.random.key(1), (2, 8, 8, 1))  # the guide's batch, smaller images


def test_a_module_called_twice_sows_two_features_each_call_as_the_guides_predict():
    variables = zoo29.sow_init(jax.random.key(0), X)
    assert list(variables) == ["params"]  # as the guide says: no 'intermediates' from init
    h = sm.hybridize(zoo29.SowCNN2(), variables, mutable=["intermediates"])
    for x in (X, X + 1):
        out, sown = h(x)
        preds, feats = zoo29.sow_predict(variables, x)
        assert len(sown["intermediates"]["SowCNN"]["features"]) == 2  # the guide's assert
        close((out, sown["intermediates"]["SowCNN"]["features"]), (preds, feats))
    assert h.state == {} and h.trace_count == 1  # each call's own two: none held, no regrowth
    out, sown = jax.jit(lambda x: h(x))(X)  # under the user's jit: returned, not held
    close((out, sown["intermediates"]["SowCNN"]["features"]), zoo29.sow_predict(variables, X))
    out, sown = h.apply(variables, X, mutable="intermediates")  # as predict calls apply
    close((out, sown["intermediates"]["SowCNN"]["features"]), zoo29.sow_predict(variables, X))


def test_capture_intermediates_in_h_apply_as_the_guides_predict_passes_it_to_apply():
    """It was refused ("capture_intermediates= is SurgeryCNN.apply's own keyword"), where
    h.apply of the variables takes apply's mutable= and rngs=; h(x, capture_intermediates=...)
    still is."""
    variables = jax.jit(zoo29.CNN().init)(jax.random.key(0), X)
    h = sm.hybridize(zoo29.CNN(), variables)
    keywords = {"capture_intermediates": True, "mutable": ["intermediates"]}
    got, want = h.apply(variables, X, **keywords), zoo29.CNN().apply(variables, X, **keywords)
    close(got, want)
    assert len(jax.tree.leaves(got[1])) == 5  # two Convs, two Denses, CNN.__call__: one each
    y, fin = zoo29.capture_predict(variables, X)
    ours = jax.jit(lambda v, x: h.apply(v, x, **keywords))(variables, X)  # under the user's jit
    close(ours[0], y)
    assert jax.tree.structure(ours[1]["intermediates"]) == jax.tree.structure(fin)
    assert all(jax.tree.leaves(fin))
    dense = {"capture_intermediates": zoo29.filter_Dense, "mutable": ["intermediates"]}
    close(h.apply(variables, X, **dense), zoo29.CNN().apply(variables, X, **dense))
    encode = {"capture_intermediates": zoo29.filter_encodings}  # no mutable=: apply adds it
    close(h.apply(variables, X, **encode), zoo29.CNN().apply(variables, X, **encode))

    def grads(apply):  # through a captured layer's output
        return jax.grad(lambda v: apply(v, X, **keywords)[1]["intermediates"]["Dense_0"]
                        ["__call__"][0].sum())(variables)  # fmt: skip

    close(grads(h.apply), grads(zoo29.CNN().apply))
    said = r"capture_intermediates= is \w*CNN\.apply.s own keyword(.|\n)*pass it to h\.apply"
    with pytest.raises(sm.ConfigError, match=said):
        h(X, capture_intermediates=True)


def test_capture_intermediates_in_h_apply_of_variables_holding_the_state_as_model_apply():
    """README's Net (BatchNorm: the Hybrid holds batch_stats): h.apply of variables holding the
    state takes capture_intermediates= beside mutable= as model.apply does; of h.params alone
    (the state the Hybrid's), it is refused, naming that form."""

    class Net(nn.Module):  # README's
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x))
            return nn.Dense(2)(nn.relu(x))

    x, model = jax.random.normal(jax.random.key(1), (4, 8)), Net()
    variables = model.init(jax.random.key(0), x)
    h = sm.hybridize(model, variables)
    keywords = {"capture_intermediates": True, "mutable": ["batch_stats", "intermediates"]}
    got = h.apply({**h.params, **h.state}, x, train=True, **keywords)
    close(got, model.apply(variables, x, train=True, **keywords))
    with pytest.raises(sm.ConfigError, match=r"h\.apply\(variables, x, capture_intermediates="):
        h.apply(h.params, x, capture_intermediates=True)


def test_the_guides_filter_fn_and_sown_c_through_h_apply():
    x = jax.random.uniform(jax.random.key(1), (1, 3))
    params = zoo29.SowModel().init(jax.random.key(0), x)["params"]
    h = sm.hybridize(zoo29.SowModel(), {"params": params})

    def filter_fn(mdl, method_name):  # the guide's lambda
        return isinstance(mdl.name, str) and (mdl.name in {"Dense_0", "Dense_2"})

    preds, feats = h.apply({"params": params}, x, capture_intermediates=filter_fn)
    close((preds, feats), zoo29.filtered_predict(params, x))
    assert sorted(feats["intermediates"]) == ["Dense_0", "Dense_2", "c"]
    flattened_dict = flax.traverse_util.flatten_dict(feats["intermediates"], sep="/")
    close(flattened_dict["c"], zoo29.filtered_predict(params, x)[1]["intermediates"]["c"])


def test_the_perturb_guides_intermediate_grads_over_h_apply():
    x, y = (
        jax.random.normal(jax.random.key(2), (1, 4)),
        jax.random.normal(jax.random.key(3), (1, 2)),
    )
    variables = zoo29.model.init(jax.random.key(1), x)
    params, perturbations = variables["params"], variables["perturbations"]
    h = sm.hybridize(zoo29.model, variables)

    def loss_fn(params, perturbations, x, y):  # the guide's, over h.apply
        y_pred = h.apply({"params": params, "perturbations": perturbations}, x)
        return jnp.mean((y_pred - y) ** 2)

    want = jax.grad(zoo29.loss_fn, argnums=1)(params, perturbations, x, y)
    close(jax.grad(loss_fn, argnums=1)(params, perturbations, x, y), want)
    assert jnp.abs(want["hidden"]).sum() > 0


def test_the_sown_features_export_as_an_entry_point_of_their_own_loaded_and_served(tmp_path):
    """An artifact returns an array or a flat tuple: a Hybrid returning ``(out, sown)`` is
    refused, naming the flat form; the guide's features (a tuple of two) exported beside
    ``predict`` come back equal from the loaded artifact and from a Batcher over that entry."""
    variables = zoo29.sow_init(jax.random.key(0), X)
    sown = sm.hybridize(zoo29.SowCNN2(), variables, mutable=["intermediates"])
    with pytest.raises(sm.SignatureError, match=r"flat tuple(.|\n)*tuple\(jax\.tree\.leaves"):
        sm.export(sown, tmp_path / "refused", example=X)
    assert not (tmp_path / "refused").exists()
    features = sm.hybridize(lambda v, x: zoo29.sow_predict(v, x)[1], variables)
    entries = {"predict": sm.hybridize(zoo29.SowCNN2(), variables), "features": features}
    sm.export(entries, tmp_path / "m", example=X, batch="b")
    m = sm.load(tmp_path / "m", allow={"convolution", "reduce_window"})  # a CNN's ops
    rows = np.asarray(X[:1])
    preds, feats = zoo29.sow_predict(variables, X[:1])
    close(m(rows), preds)
    close(m["features"](rows), feats)
    with sm.serving.Batcher(m["features"], max_batch=4) as b:
        got = [b.submit(np.asarray(X[i : i + 1])).result(30) for i in range(2)]
    close(
        tuple(np.concatenate(f) for f in zip(*got, strict=True)), zoo29.sow_predict(variables, X)[1]
    )


def test_an_nnx_intermediate_set_in_call_is_popped_from_h_module_as_from_eager_nnx(tmp_path):
    x = jax.random.normal(jax.random.key(1), (8, 12))
    model, want = zoo29.Linear(12, 2, rngs=nnx.Rngs(0)), zoo29.Linear(12, 2, rngs=nnx.Rngs(0))
    h = sm.hybridize(model)
    for i in range(2):
        close(h(x + i), want(x + i))
    intermediates = nnx.pop(h.module, nnx.Intermediate)
    assert "y" in intermediates  # the test's own assert
    close(nnx.to_pure_dict(intermediates), nnx.to_pure_dict(nnx.pop(want, nnx.Intermediate)))
    sm.export(h, tmp_path / "m", example=(x,), batch="b")  # the output alone: y is state
    close(sm.load(tmp_path / "m")(np.asarray(x[:3])), want(x[:3]))


def test_an_nnx_intermediate_set_under_a_jax_transform_is_refused_never_held_as_a_tracer():
    """Called under jax.grad/jax.jit, the Hybrid's call would hold the sown ``y`` as a tracer:
    refused, naming ``state['y']`` and ``h.apply``; the held ``y`` stays the last call's array,
    and grads through ``h.apply`` (which returns the new state) are JAX's of the module."""
    x = jax.random.normal(jax.random.key(1), (8, 12))
    model = zoo29.Linear(12, 2, rngs=nnx.Rngs(0))
    h = sm.hybridize(zoo29.Linear(12, 2, rngs=nnx.Rngs(0)))
    h(x)
    for transform in (jax.grad, jax.jit):
        with pytest.raises(sm.ControlFlowError, match=r"state\['y'\](.|\n)*h\.apply\(h\.params"):
            transform(lambda x: h(x).sum())(x + 1)
        assert isinstance(h.state["y"], jax.Array) and not isinstance(h.state["y"], jax.core.Tracer)
        close(h.state["y"], model(x))
    grads = jax.grad(lambda p: h.apply(p, x)[0].sum())(h.params)
    want = nnx.grad(lambda m: m(x).sum())(model)
    close(grads, nnx.to_pure_dict(want))


def test_the_vae_examples_train_steps_pop_its_loss_as_h_apply_with_state_returns_it():
    def vae():  # the example's, sizes cut (28 x 28 images, 256 hidden, 32 latent)
        return helpers.VAE(din=16, hidden_size=8, latent_size=4, output_shape=(4, 4),
                         rngs=nnx.Rngs(0, noise=1))  # fmt: skip

    x = (jax.random.uniform(jax.random.key(3), (5, 4, 4)) > 0.5).astype(jnp.float32)
    theirs, h, tx = vae(), sm.hybridize(vae()), optax.adam(1e-3)
    optimizer = nnx.Optimizer(theirs, tx, wrt=nnx.Param)
    params, state, opt = h.params, h.state, tx.init(h.params)

    def loss(p, s):
        logits, new = h.apply_with_state(p, s, x)
        encoder = dict(new["encoder"])
        losses = encoder.pop("kl_loss")  # nnx.pop(model, Loss): read, not carried on
        kl_loss = sum(jax.tree_util.tree_leaves(losses), 0.0)
        reconstruction_loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, x))
        return reconstruction_loss + 0.1 * kl_loss, {**new, "encoder": encoder}

    ours, want = [], []
    for _ in range(3):
        (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params, state)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        ours.append(value)
        want.append(zoo29.train_step(theirs, optimizer, x))
    close(ours, want)
    close(params, nnx.to_pure_dict(nnx.state(theirs, nnx.Param)))
