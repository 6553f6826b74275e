"""Code we did not write, round eight: JAX's own notebooks and Flax's linen guides as their
authors wrote them (tests/zoo8.py; sources and commits there), over every feature: hybridize,
``h(x)`` equal to the plain model, its graph, export (a symbolic batch where the model allows
one) + load + call equal, ``jax.grad``/``vmap``/``jacrev(jacrev)`` over the loaded model (an
artifact of ``vjp_order=2``), a Batcher's answers, and the original's own training steps.

- Custom_derivative_rules_for_Python_code.md: ``log1pexp`` (``custom_jvp``), ``f`` by
  ``defjvps``, ``clip_gradient`` (``custom_vjp``) and the implicit ``fixed_point``'s
  ``newton_sqrt`` (``custom_vjp`` over a ``while_loop``: its artifact loads with
  ``allow={'while'}``, the refusal naming it), each the activation of a one-layer net.
- vmapped_log_probs.md: the per-example ``batched_log_joint`` (a symbolic batch of betas), its
  ``elbo`` (a mean over the samples: the Batcher refuses it naming a per-row model) and the
  notebook's own variational steps over ``h.apply``.
- autodiff_cookbook.md: ``predict_dict`` and ``loss2``: per-example grads, Jacobians, the
  reverse-over-reverse ``hvp`` over the loaded model.
- Distributed_arrays_and_automatic_parallelization.md's MLP: 8-way batch, then 4x2
  batch/model sharded, its ``gradfun`` steps over ``h.apply``.
- Flax: state_params.rst (a running mean carried; BatchNorm(axis_name='batch') under
  ``jax.vmap``; both ``update_step`` s over ``h.apply``), lift.md (params per row: a static
  batch), rnncell_upgrade_guide.rst (both ``SimpleLSTM`` s; a carry tuple's refusal now names
  the flat outputs), flax_basics.md (its regression's gd and Adam steps, its modules, its
  jitted ``update_step`` with a static ``apply_fn``; ``h.apply`` of variables holding the held
  state now refused), optax_update_guide.rst (each ``tx``), module_lifecycle.rst (a str mode,
  a ``flax.struct`` closure under ``nn.vmap``), use_checkpointing.md (Orbax-restored params).
"""

import functools
from types import SimpleNamespace

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo8
from features import close, every_feature
from flax import linen as nn

import symjax_mlp as sm


def _dense():
    return {"w": jax.random.normal(jax.random.key(0), (4, 3)) * 0.5, "b": jnp.full((3,), 0.1)}


ACTIVATIONS = {
    "log1pexp": zoo8.log1pexp,
    "defjvps_f": lambda z: zoo8.sqrt_ratio(jnp.abs(z)),  # the notebook's f is on R+
    "clip_sin": zoo8.clip_sin,
    "newton_sqrt": lambda z: jax.vmap(jax.vmap(zoo8.newton_sqrt))(jnp.abs(z) + 1.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_custom_derivative_rules_hybridize_export_and_differentiate_as_written(name, tmp_path):
    """Each of the notebook's custom rules as a net's activation: the Hybrid, the loaded model
    (batch symbolic, vjp_order=2) and its grads, per-row grads and Hessians (jacrev of jacrev:
    ``jax.hessian`` is forward over reverse, which a ``custom_vjp`` refuses in JAX itself, the
    notebook's own limitation) equal the plain function's: the custom rules ran, not autodiff's
    (clip_sin's clipped, the implicit fixed point's)."""
    fn, p = zoo8.custom_dense(ACTIVATIONS[name]), _dense()
    x = jax.random.normal(jax.random.key(1), (5, 4)) + 1.0
    h = sm.hybridize(fn, p)
    allow = {"while"} if name == "newton_sqrt" else None
    if allow:
        sm.export(h, tmp_path / "refused", example=(x,))
        with pytest.raises(sm.ArtifactError, match=r"allow=\{'while'\}"):
            sm.load(tmp_path / "refused")
    every_feature(tmp_path, h, lambda r: fn(p, r), x, allow=allow)
    if name == "clip_sin":  # the custom VJP is what grad runs: its cotangents clipped
        big = jnp.full((1, 4), 3.0)
        g = jax.grad(lambda r: (100.0 * sm.load(tmp_path / "m")(r)).sum())(big)
        close(g, jax.grad(lambda r: (100.0 * fn(p, r)).sum())(big))
        assert np.abs(g).max() <= 0.75 * np.abs(p["w"]).sum(1).max() + 1e-6


@pytest.mark.slow
def test_vmapped_log_probs_per_example_and_its_elbo_steps(tmp_path):
    """vmapped_log_probs: ``batched_log_joint`` (``jax.vmap`` of the jitted ``log_joint``) is a
    model of betas, one log-prob per row: every feature, batch symbolic. Its ``elbo`` over
    ``h.apply`` takes the notebook's own steps (``value_and_grad`` of ``elbo``, the step size
    0.01, ``normal_sample``'s keys), equal; its artifact (a mean over samples) answers any
    number of samples, and a Batcher refuses it naming a per-row model."""
    beta = jnp.asarray(np.random.RandomState(0).randn(6, zoo8.num_features), jnp.float32)
    h = sm.hybridize(lambda p, b: zoo8.batched_log_joint(b), {})
    every_feature(tmp_path / "lj", h, zoo8.batched_log_joint, beta, rtol=1e-4, atol=1e-3)
    p = {"loc": jnp.zeros(zoo8.num_features), "log_scale": jnp.zeros(zoo8.num_features)}
    he = sm.hybridize(lambda p, eps: zoo8.elbo(p["loc"], p["log_scale"], eps), p)
    key, beta_loc, beta_log_scale, step_size = jax.random.key(10003), p["loc"], p["log_scale"], 0.01
    for _ in range(3):
        key, epsilon = zoo8.normal_sample(key, (8, zoo8.num_features))
        elbo_val, (beta_loc_grad, beta_log_scale_grad) = zoo8.elbo_val_and_grad(
            beta_loc, beta_log_scale, epsilon
        )
        beta_loc += step_size * beta_loc_grad
        beta_log_scale += step_size * beta_log_scale_grad
        val, g = jax.value_and_grad(he.apply)(p, epsilon)
        p = jax.tree.map(lambda a, d: a + step_size * d, p, g)
        close(val, elbo_val, rtol=1e-5, atol=1e-3)
    close(p, {"loc": beta_loc, "log_scale": beta_log_scale})
    he = he.replace(params=p)
    sm.export(he, tmp_path / "elbo", example=(epsilon,), batch="b")
    m = sm.load(tmp_path / "elbo")
    close(
        m(np.asarray(epsilon[:5])),
        zoo8.elbo(beta_loc, beta_log_scale, epsilon[:5]),
        rtol=1e-5,
        atol=1e-3,
    )
    with pytest.raises(sm.ConfigError, match="one output row per input row"):
        sm.serving.Batcher(m, max_batch=4)


@pytest.mark.slow
def test_the_autodiff_cookbooks_predict_and_hvp_over_the_loaded_model(tmp_path):
    """autodiff_cookbook: ``predict_dict`` on its toy inputs, every feature (batch symbolic);
    its reverse-over-reverse ``hvp`` of a loaded model's summed output equals the plain one's;
    ``jax.grad(loss2)`` through ``h.apply`` equals the cookbook's."""
    params = zoo8.cookbook_params()
    h = sm.hybridize(zoo8.predict_dict, params)
    ref = lambda r: zoo8.predict_dict(params, r)  # noqa: E731
    m = every_feature(tmp_path, h, ref, zoo8.inputs)
    v = jnp.ones(3)
    close(zoo8.hvp(lambda r: m(r[None]).sum(), zoo8.inputs[0], v),
           zoo8.hvp(lambda r: ref(r[None]).sum(), zoo8.inputs[0], v))  # fmt: skip
    close(jax.jacrev(lambda r: m(r))(zoo8.inputs), jax.jacrev(ref)(zoo8.inputs))

    def loss2(params_dict):  # the cookbook's loss2, over h.apply
        preds = h.apply(params_dict, zoo8.inputs)
        label_probs = preds * zoo8.targets + (1 - preds) * (1 - zoo8.targets)
        return -jnp.sum(jnp.log(label_probs))

    close(jax.grad(loss2)(params), jax.grad(zoo8.loss2)(params))


def _state_params_tx():
    return optax.sgd(learning_rate=0.02)  # state_params.rst's tx


@pytest.mark.slow
def test_state_params_bias_adder_trains_as_its_update_step_and_refuses_export_naming_a_step(
    tmp_path,
):
    """state_params.rst's ``BiasAdderWithRunningMean``: its running mean (initialized (4,),
    written (1, 4)) is carried across ``h(x)`` calls as linen's ``mutable`` gives it; the guide's
    ``update_step`` with an ``apply_fn`` over ``h.apply`` (the state given by ``h.replace``)
    takes its steps, equal; export refuses its cross-call state naming a step function."""
    model, x = zoo8.BiasAdderWithRunningMean(), jax.random.normal(jax.random.key(1), (3, 4))
    variables = model.init(jax.random.key(0), jnp.ones((3, 4)))
    h, v = sm.hybridize(model, variables), variables
    for _ in range(3):
        want, updated = model.apply(v, x, mutable=["batch_stats"])
        v = {**v, **updated}
        close(h(x), want)
    close(h.state, {"batch_stats": v["batch_stats"]})
    tx = _state_params_tx()
    state, params = flax.core.pop(variables, "params")
    step = zoo8.make_update_step(tx)
    opt_state, h = tx.init(params), sm.hybridize(model, variables)
    ours = (opt_state, params, state)
    for _ in range(3):
        opt_state, params, state = step(model.apply, x, opt_state, params, state)
        held = h.replace(state=dict(ours[2]))

        def apply_fn(v, x, mutable, held=held):
            return held.apply({"params": v["params"]}, x)

        ours = step(apply_fn, x, *ours)
    close(ours, (opt_state, params, state))
    with pytest.raises(sm.ConfigError, match=r"batch_stats.*Export one step"):
        sm.export(h, tmp_path / "m", example=(x,))


def _vmap_update_steps(model, variables, X, Y, train):
    """Two of state_params.rst's vmapped ``update_step`` s over ``model.apply`` (``train``
    bound) and over ``h.apply`` (the state held given by ``h.replace``): equal; returns the
    trained ``(params, state)``."""
    tx = _state_params_tx()
    state, params = flax.core.pop(variables, "params")
    step, h = zoo8.make_vmap_update_step(tx), sm.hybridize(model, variables)
    opt_state = tx.init(params)
    ours = (opt_state, params, state)
    for _ in range(2):
        apply = functools.partial(model.apply, train=train)
        opt_state, params, state, loss = step(apply, X, Y, opt_state, params, state)
        held = h.replace(state=dict(ours[2]))

        def apply_fn(v, x, mutable, held=held):
            return held.apply({"params": v["params"]}, x, train=train)

        *ours, our_loss = step(apply_fn, X, Y, *ours)
        close(our_loss, loss)
    close(tuple(ours), (opt_state, params, state))
    return params, state


@pytest.mark.slow
def test_state_params_vmapped_batchnorm_mlp_as_its_update_step(tmp_path):
    """state_params.rst's ``MLP`` (``BatchNorm(axis_name='batch')``) of one example (100,):
    eval mode over every feature (batch symbolic: rows of 100); train mode called plainly is
    refused naming the vmap that binds 'batch'; ``jax.vmap(h, axis_name='batch')`` in train mode
    gives linen's outputs and running stats; the guide's vmapped ``update_step`` over
    ``h.apply`` takes its steps (sgd 0.02), equal, as written (its ``apply_fn`` is called without
    ``train=True``: BatchNorm normalizes by its running stats, which never change, the guide's
    own quirk) and with ``train=True`` bound; the trained Hybrid exports as linen."""
    model = zoo8.StateMLP(hidden_size=10, out_size=1)
    variables = model.init(jax.random.key(0), jnp.ones((100,)))
    key1, key2 = jax.random.split(jax.random.key(0), num=2)
    X, Y = jax.random.normal(key1, (8, 100)), jax.random.normal(key2, (8, 1))
    h = sm.hybridize(model, variables)
    close(h(X[0]), model.apply(variables, X[0]))
    every_feature(tmp_path / "eval", h, lambda r: model.apply(variables, r), X)
    with pytest.raises(sm.ConfigError, match=r"axis name 'batch'.*jax\.vmap"):
        h(X, train=True)
    out = jax.vmap(lambda r: h(r, train=True), axis_name="batch")(X)
    want, updated = jax.vmap(
        lambda r: model.apply(variables, r, train=True, mutable=["batch_stats"]),
        axis_name="batch",
        out_axes=(0, None),
    )(X)
    close(out, want)
    close(h.state, dict(updated))
    for train in (False, True):  # the guide's apply_fn is called as written: train=False
        params, state = _vmap_update_steps(model, variables, X, Y, train)
    trained = h.replace(params={"params": params}, state=dict(state))
    sm.export(trained, tmp_path / "m", example=(X,))
    close(sm.load(tmp_path / "m")(np.asarray(X)), model.apply({"params": params, **state}, X))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ManualVmapMLP", "LinenVmapMLP"])
def test_the_lifting_guides_per_row_mlps_export_their_static_batch(name, tmp_path):
    """lift.md: an MLP per row of ``xs``, by a manual ``jax.vmap`` of ``init``/``apply`` inside
    ``self.param`` or by ``nn.vmap(variable_axes={'params': 0})``: its params fix the rows (3),
    so export's default symbolic batch is refused naming ``batch=None``, which exports, loads,
    differentiates and serves (one request of 3 rows) as linen."""
    model, xs = getattr(zoo8, name)(), jnp.ones((3, 4))
    variables = model.init(jax.random.key(0), xs)
    x = jax.random.normal(jax.random.key(1), (3, 4))
    h = sm.hybridize(model, variables)
    with pytest.raises(sm.SignatureError, match="batch=None"):
        sm.export(h, tmp_path / "b", example=(x,))
    every_feature(tmp_path, h, lambda r: model.apply(variables, r), x, batch=None)


def test_the_lifting_guides_stateful_vmap_fails_in_flax_itself():
    """lift.md's ``LinenStatefulVmapMLP``: Flax's own ``init``, as written (no ``train``) or
    with ``train=False``, raises a TypeError: the guide's own limitation (nn.vmap warns that it
    ignores keyword arguments and passes no ``train`` on), said here, not ours to hybridize."""
    xs = jnp.ones((3, 4))
    with pytest.raises(TypeError, match="train"):
        zoo8.LinenStatefulVmapMLP().init(jax.random.key(0), xs)
    with (
        pytest.warns(RuntimeWarning, match="kwargs are not supported in vmap"),
        pytest.raises(TypeError, match=r"StatefulMLP.*train"),
    ):
        zoo8.LinenStatefulVmapMLP().init(jax.random.key(0), xs, train=False)


_LSTM_ALLOW = frozenset({"dynamic_update_slice", "real_dynamic_slice"})  # a scan's


@pytest.mark.slow
def test_the_rnncell_upgrade_guides_simple_lstms_overevery_feature(tmp_path):
    """rnncell_upgrade_guide.rst (New side), batch 4, seq_len 5, in 6, out 8 (cut from 32, 10,
    64, 128): the idiomatic ``SimpleLSTM`` (its carry made inside) over every feature, batch
    symbolic; the first ``SimpleLSTM`` takes its carry from ``initialize_carry`` and returns
    ``(carry, ys)``: the Hybrid equals linen; export refuses the carry tuple naming a function of
    its arrays returning the leaves of its tree (before: the recipe left the returned carry
    out, refused in turn), which (the refusal's recipe) exports with a symbolic batch, loads,
    and equals linen, its grads through carry and inputs too."""
    batch_size, seq_len, in_features, out_features = 4, 5, 6, 8
    x = jax.random.normal(jax.random.key(1), (batch_size, seq_len, in_features))
    model = zoo8.SimpleLSTM(features=out_features)
    variables = model.init(jax.random.key(0), x)
    h = sm.hybridize(model, variables)
    ref = lambda r: model.apply(variables, r)  # noqa: E731
    every_feature(tmp_path / "idiomatic", h, ref, x, allow=_LSTM_ALLOW)
    model = zoo8.CarrySimpleLSTM()
    carry = zoo8.CarrySimpleLSTM.initialize_carry((batch_size,), out_features)
    variables = model.init(jax.random.key(0), carry, x)
    h = sm.hybridize(model, variables)
    close(h(carry, x), model.apply(variables, carry, x))
    assert h.graph(carry, x).flops > 0
    with pytest.raises(sm.SignatureError, match=r"tuple of 2 arrays.*tuple\(jax\.tree\.leaves"):
        sm.export(h, tmp_path / "refused", example=(carry, x))
    leaves, tree = jax.tree.flatten(carry)  # the refusal's recipe, as it says, outputs wrapped

    def flat_apply(params, *xs):
        return tuple(jax.tree.leaves(h.apply(params, jax.tree.unflatten(tree, xs[:2]), *xs[2:])))

    flat = sm.hybridize(flat_apply, h.params)
    sm.export(flat, tmp_path / "carry", example=(*leaves, x), vjp_order=1)
    m = sm.load(tmp_path / "carry", allow=_LSTM_ALLOW)
    c3 = jax.tree.map(lambda a: a[:3] + 0.5, carry)

    def loss(c0, c1, r, f=m):  # the loaded model's outputs: the carry's arrays, then ys
        out = jax.tree.leaves(f(c0, c1, r))
        return out[-1].sum() + out[0].sum()

    close(m(*c3, x[:3]), tuple(jax.tree.leaves(model.apply(variables, c3, x[:3]))))

    def ref(c0, c1, r):
        return model.apply(variables, (c0, c1), r)

    close(jax.grad(loss, (0, 1, 2))(*c3, x[:3]), jax.grad(loss, (0, 1, 2))(*c3, x[:3], f=ref))


def test_a_carry_input_refusal_names_the_flat_outputs_a_carry_model_needs(tmp_path):
    """A model taking a carry tuple and returning ``(carry, y)`` (rnncell_upgrade_guide's first
    ``SimpleLSTM``): the refusal of the tuple input names wrapping the call's outputs in
    ``tuple(jax.tree.leaves(...))`` too (before: its recipe, followed, was refused again for
    the returned tree); the rnncell test follows it to an export."""
    h = sm.hybridize(lambda p, c, x: ((c[0] * p, c[1]), x + c[1]), jnp.float32(2.0))
    carry, x = (jnp.ones((2, 3)), jnp.zeros((2, 3))), jnp.ones((2, 3))
    with pytest.raises(sm.SignatureError, match=r"tuple\(jax\.tree\.leaves\(h\.apply") as e:
        sm.export(h, tmp_path / "refused", example=(carry, x))
    assert "jax.tree.unflatten(tree, xs[:2]), *xs[2:]), h.params) with example=" in str(e.value)


@pytest.mark.slow
def test_flax_basics_linear_regression_trains_as_written_over_h_apply():
    """flax_basics: ``nn.Dense(features=5)`` init on one sample (10,); its jitted ``mse``
    (``jax.vmap`` of ``model.apply`` per sample) with ``h.apply`` for ``model.apply`` takes its
    gradient-descent steps (0.3) and its Adam steps, equal to the guide's own."""
    model = nn.Dense(features=5)
    key1, key2 = jax.random.split(jax.random.key(0))
    params = model.init(key2, jax.random.normal(key1, (10,)))
    true_params, x_samples, y_samples = zoo8.regression_data()
    h = sm.hybridize(model, params)
    mse, ours = zoo8.make_mse(model), zoo8.make_mse(SimpleNamespace(apply=h.apply))
    close(ours(true_params, x_samples, y_samples), mse(true_params, x_samples, y_samples))
    learning_rate, theirs, mine = 0.3, params, params
    for _ in range(3):
        loss_val, grads = jax.value_and_grad(mse)(theirs, x_samples, y_samples)
        theirs = zoo8.update_params(theirs, learning_rate, grads)
        our_val, our_grads = jax.value_and_grad(ours)(mine, x_samples, y_samples)
        mine = zoo8.update_params(mine, learning_rate, our_grads)
        close(our_val, loss_val)
    close(mine, theirs)
    tx = optax.adam(learning_rate=learning_rate)
    states = [tx.init(theirs), tx.init(mine)]
    for _ in range(3):
        for i, loss in enumerate((mse, ours)):
            p = (theirs, mine)[i]
            _, grads = jax.value_and_grad(loss)(p, x_samples, y_samples)
            updates, states[i] = tx.update(grads, states[i])
            p = optax.apply_updates(p, updates)
            theirs, mine = (p, mine) if i == 0 else (theirs, p)
    close(mine, theirs)


BASICS = {
    "ExplicitMLP": lambda: zoo8.ExplicitMLP(features=[3, 4, 5]),
    "SimpleMLP": lambda: zoo8.SimpleMLP(features=[3, 4, 5]),
    "SimpleDense": lambda: zoo8.SimpleDense(features=3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", BASICS)
def test_flax_basics_modules_overevery_feature(name, tmp_path):
    """flax_basics' ``ExplicitMLP`` (setup's list of layers), ``SimpleMLP`` (compact, named)
    and ``SimpleDense`` (``self.param`` s), on its ``random.uniform`` (4, 4) inputs."""
    key1, key2 = jax.random.split(jax.random.key(0), 2)
    x = jax.random.uniform(key1, (4, 4))
    model = BASICS[name]()
    params = model.init(key2, x)
    h = sm.hybridize(model, params)
    every_feature(tmp_path, h, lambda r: model.apply(params, r), x)


@pytest.mark.slow
def test_flax_basics_bias_adder_and_its_jitted_update_step_with_h_apply_static(tmp_path):
    """flax_basics' ``BiasAdderWithRunningMean``: ``h(val * ones)`` for its 1., 2., 3. carries
    the running mean as its loop of ``mutable=['batch_stats']``; its ``update_step``, jitted
    with ``tx`` and ``apply_fn`` static, runs with ``h.apply`` as its ``apply_fn`` (a hashable
    static argument; ``{'params': params, **state}`` and ``mutable=`` as model.apply takes them)
    and gives the guide's three steps; ``h.apply_with_state`` runs from a state given."""
    model, x = zoo8.BasicsBiasAdder(), jnp.ones((10, 5))
    key1, _ = jax.random.split(jax.random.key(0), 2)
    variables = model.init(key1, x)
    h = sm.hybridize(model, variables)
    for val in [1.0, 2.0, 3.0]:
        x = val * jnp.ones((10, 5))
        y, updated_state = model.apply(variables, x, mutable=["batch_stats"])
        _old_state, params = flax.core.pop(variables, "params")  # the guide: old_state
        variables = flax.core.freeze({"params": params, **updated_state})
        close(h(x), y)
    close(h.state, dict(updated_state))
    x = jnp.ones((10, 5))
    variables = model.init(jax.random.key(0), x)
    state, params = flax.core.pop(variables, "params")
    tx = optax.sgd(learning_rate=0.02)
    h = sm.hybridize(model, variables)
    theirs = ours = (tx.init(params), params, state)
    for _ in range(3):
        theirs = zoo8.basics_update_step(tx, model.apply, x, *theirs)
        ours = zoo8.basics_update_step(tx, h.apply, x, *ours)
    close(ours, theirs)
    other = {"batch_stats": {"mean": jnp.full((5,), 7.0)}}
    out, state = h.apply_with_state({"params": params}, other, x)
    want = model.apply({"params": params, **other}, x, mutable=["batch_stats"])
    close((out, state), want)


def test_h_apply_of_variables_holding_the_state_runs_as_model_apply_from_that_state():
    """flax_basics' ``update_step`` calls ``apply_fn({'params': params, **state}, x,
    mutable=list(state.keys()))``: ``h.apply`` given those variables runs as linen's
    ``model.apply`` (jitted) does, from the given batch_stats: ``(out, updates)`` bitwise;
    without ``mutable=``, Flax's refusal to write an immutable collection. Before: a
    ConfigError naming ``h.apply_with_state``. The held state is kept; ``h.apply_with_state``
    given a state twice (in the params too) is refused."""
    model, x = zoo8.BasicsBiasAdder(), jnp.ones((10, 5))
    variables = model.init(jax.random.key(0), x)
    h, other = sm.hybridize(model, variables), {"batch_stats": {"mean": jnp.full((5,), 7.0)}}
    given = {"params": variables["params"], **other}
    want = jax.jit(model.apply, static_argnames="mutable")(given, x, mutable=("batch_stats",))
    chex.assert_trees_all_equal(h.apply(given, x, mutable=["batch_stats"]), want)
    with pytest.raises(flax.errors.ModifyScopeVariableError):
        h.apply(given, x)
    chex.assert_trees_all_equal(h.state, {"batch_stats": variables["batch_stats"]})
    with pytest.raises(sm.ConfigError, match=r"\['batch_stats'\].*h\.apply_with_state"):
        h.apply_with_state(given, other, x)


@pytest.mark.slow
def test_h_apply_of_variables_holding_the_state_draws_from_the_rngs_given_as_model_apply():
    """A model with Dropout and BatchNorm, as flax_basics' ``update_step`` would step it:
    ``h.apply({'params': p, **state}, x, mutable=[...], rngs={'dropout': key})`` is
    ``model.apply``'s result bitwise, another key another mask; without ``rngs=`` a
    ConfigError naming ``rngs=`` (Flax's InvalidRngError), never the Hybrid's held key, which
    no such call advances: each step of a loop drew the same mask."""

    class DropoutBatchNorm(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
            return nn.Dropout(0.5, deterministic=not train)(x)

    model, x = DropoutBatchNorm(), jax.random.normal(jax.random.key(9), (4, 3))
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    h = sm.hybridize(model, variables, rngs={"dropout": jax.random.key(2)})
    jitted = jax.jit(model.apply, static_argnames="mutable")
    outs = []
    for seed in (5, 6):
        rngs = {"dropout": jax.random.key(seed)}
        outs.append(h.apply(variables, x, mutable=["batch_stats"], rngs=rngs))
        chex.assert_trees_all_equal(
            outs[-1], jitted(variables, x, mutable=("batch_stats",), rngs=rngs)
        )
    assert (outs[0][0] != outs[1][0]).any()
    with pytest.raises(
        sm.ConfigError, match=r'needs PRNG for "dropout".*rngs=\{\'dropout\': key\}'
    ):
        h.apply(variables, x, mutable=["batch_stats"])


@pytest.mark.slow
def test_h_apply_of_variables_holding_the_state_under_grad_and_without_mutable():
    """``h.apply({'params': p, **state}, x, mutable=[...])`` under ``jax.value_and_grad``
    (jitted): the loss, output, updates and grad bitwise model.apply's; without ``mutable=``,
    ``out`` alone, as Flax returns it, of a model that writes no collection (BatchNorm's
    running average), from the given statistics."""
    model, x = zoo8.BasicsBiasAdder(), jnp.ones((10, 5))
    variables = model.init(jax.random.key(0), x)
    h, other = sm.hybridize(model, variables), {"batch_stats": {"mean": jnp.full((5,), 7.0)}}
    params, jitted = variables["params"], jax.jit(model.apply, static_argnames="mutable")

    def step(apply, mutable):
        def loss(params):
            y, state = apply({"params": params, **other}, x, mutable=mutable)
            return ((x - y) ** 2).sum(), (y, state)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    chex.assert_trees_all_equal(step(h.apply, ["batch_stats"]), step(jitted, ("batch_stats",)))
    norm = nn.BatchNorm(use_running_average=True)
    variables = norm.init(jax.random.key(0), x)
    given = {"params": variables["params"], "batch_stats": other["batch_stats"] | {"var": x[0]}}
    out = sm.hybridize(norm, variables).apply(given, x)
    chex.assert_trees_all_equal(out, jax.jit(norm.apply)(given, x))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`flax.traverse_util.Traversal` will be deprecated")
@pytest.mark.parametrize("name", ["sgd", "chain", "adam_decay", "clip", "schedule", "masked"])
def test_the_optax_update_guides_transformations_step_over_h_apply(name, tmp_path):
    """optax_update_guide.rst: its testsetup's ``nn.Dense(1)`` on an image batch, each section's
    ``tx`` in its ``train_step``; the guide's ``loss`` is a stub (0.), so ours is a squared
    error of ``model.apply``, and the same over ``h.apply``: two steps' params equal; the
    trained Hybrid exports (batch symbolic) and loads as linen. Adam with decayed weights passes
    ``params`` to ``tx.update``, as the guide's note there says. The guide's masks use
    ``ModelParamTraversal``, which Flax warns it will deprecate (the guide's own; ignored)."""
    batch = {"image": jax.random.normal(jax.random.key(1), (2, 28, 28, 1)), "label": jnp.ones(2)}
    model = nn.Dense(1)
    variables = model.init(jax.random.key(0), batch["image"])
    h = sm.hybridize(model, variables)

    def loss_of(apply):
        return lambda params, batch: jnp.mean(
            (apply({"params": params}, batch["image"])[..., 0, 0, 0] - batch["label"]) ** 2
        )

    params = variables["params"]
    tx = zoo8.optax_guide_txs(params)[name]
    theirs = ours = (params, tx.init(params))
    with_params = name == "adam_decay"  # the guide's note there
    steps = [
        zoo8.make_optax_train_step(tx, loss_of(f), with_params) for f in (model.apply, h.apply)
    ]
    for _ in range(2):
        theirs, ours = steps[0](*theirs, batch), steps[1](*ours, batch)
    close(ours, theirs)
    trained = h.replace(params={"params": ours[0]})
    sm.export(trained, tmp_path / "m", example=(batch["image"],))
    x = np.asarray(batch["image"][:1])
    close(sm.load(tmp_path / "m")(x), model.apply({"params": theirs[0]}, x))


LIFECYCLE = {
    "LifecycleMLP": lambda: zoo8.LifecycleMLP(hidden_size=4, out_size=5),
    "CompactScaledMLP": lambda: zoo8.CompactScaledMLP(hidden_size=4, out_size=5),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LIFECYCLE)
def test_the_module_lifecycle_mlps_overevery_feature(name, tmp_path):
    """module_lifecycle.rst's setup ``MLP`` and ``CompactScaledMLP`` (a ``scale`` param shaped
    by the inputs' features, ``x *= scale[None]``), on its (3, 2) inputs."""
    model, x = LIFECYCLE[name](), jax.random.normal(jax.random.key(1), (3, 2))
    variables = model.init(jax.random.key(0), jax.numpy.ones((3, 2)))
    h = sm.hybridize(model, variables)
    every_feature(tmp_path, h, lambda r: model.apply(variables, r), x)


@pytest.mark.slow
def test_the_module_lifecycles_mode_string_and_partial_closure(tmp_path):
    """module_lifecycle.rst: ``CorrectModule``'s str ``mode`` (its variables from
    ``nn.init(init_fn, mdl)``) is a static setting: ``h(x, 'encode')`` and ``h(z, 'decode')``
    equal linen's and each mode exports (``kwargs``) and loads as linen; ``Foo``'s ``nn.vmap``
    of a method given a ``flax.struct`` ``Partial`` (params per row: 3) exports its static
    batch, refusing a symbolic one naming ``batch=None``."""
    mdl, x = zoo8.CorrectModule(), jax.random.normal(jax.random.key(1), (3, 2))
    variables = nn.init(zoo8.init_fn, mdl)(jax.random.key(0))
    h = sm.hybridize(mdl, variables)
    z = h(x, "encode")
    close(z, mdl.apply(variables, x, "encode"))
    close(h(z, "decode"), mdl.apply(variables, z, "decode"))
    for mode, inputs in (("encode", x), ("decode", z)):
        sm.export(h, tmp_path / mode, example=(inputs,), kwargs={"mode": mode})
        got = sm.load(tmp_path / mode)(np.asarray(inputs[:2]))
        close(got, mdl.apply(variables, inputs[:2], mode))
    foo = zoo8.Foo()
    variables = foo.init(jax.random.key(0), jax.numpy.ones((3, 2)))
    assert variables["params"]["Dense_0"]["kernel"].shape == (3, 2, 2)  # the guide's own check
    h = sm.hybridize(foo, variables)
    with pytest.raises(sm.SignatureError, match="batch=None"):
        sm.export(h, tmp_path / "foo_b", example=(x,))
    every_feature(tmp_path / "foo", h, lambda r: foo.apply(variables, r), x, batch=None)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")
def test_the_checkpointing_guides_restored_train_state_hybridizes_and_exports(tmp_path):
    """use_checkpointing.md: its bundle saved with ``orbax.checkpoint.PyTreeCheckpointer`` and
    ``save_args_from_target``, restored raw and into its target (a zeroed ``TrainState``): the
    Hybrid of ``nn.Dense(3)`` over either restored params equals the saved state's
    ``apply_fn``; exported (batch symbolic), loaded, a Batcher's rows and grads equal. Orbax
    warns of the guide's restore without sharding info (the guide's own; ignored)."""
    import orbax.checkpoint
    from flax.training import orbax_utils

    ckpt, model, variables, x1, tx = zoo8.checkpoint_bundle()
    orbax_checkpointer = orbax.checkpoint.PyTreeCheckpointer()
    save_args = orbax_utils.save_args_from_target(ckpt)
    orbax_checkpointer.save(tmp_path / "single_save", ckpt, save_args=save_args)
    raw_restored = orbax_checkpointer.restore(tmp_path / "single_save")
    empty_state = zoo8.train_state.TrainState.create(
        apply_fn=model.apply,
        params=jax.tree_util.tree_map(np.zeros_like, variables["params"]),
        tx=tx,
    )
    empty_config = {"dimensions": np.array([0, 0])}
    target = {"model": empty_state, "config": empty_config, "data": [jnp.zeros_like(x1)]}
    state_restored = orbax_checkpointer.restore(tmp_path / "single_save", item=target)
    state = ckpt["model"]
    x = jax.random.normal(jax.random.key(2), (4, 5))
    for params in (raw_restored["model"]["params"], state_restored["model"].params):
        h = sm.hybridize(model, {"params": params})
        close(h(x), state.apply_fn({"params": state.params}, x))
    ref = lambda r: state.apply_fn({"params": state.params}, r)  # noqa: E731
    every_feature(tmp_path / "m", h, ref, x)


@pytest.mark.slow
def test_the_distributed_arrays_mlp_trains_sharded_over_h_apply(tmp_path):
    """Distributed_arrays_and_automatic_parallelization's MLP (layer sizes 8, 16, 16, 16, 4 and
    batch 16, cut from 784, 8192 x3, 10 and 8192): its batch sharded 8 ways over the 8 CPU
    devices, params replicated, then 4-way batch and 2-way model parallel (its W2/b2, W3
    shardings): the Hybrid of its ``predict`` equals it, its ``gradfun`` over ``h.apply`` takes
    its steps (1e-5, 3 of its 30), equal; the trained Hybrid exports and loads as the source.
    Its meshes have ``AxisType.Auto`` axes: ``jax.make_mesh`` makes Explicit ones in the
    installed JAX, under which the notebook's own ``gradfun`` raises ShardingTypeError
    (contracting dims sharded over 'model'), the notebook's limitation there."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    params, batch = zoo8.init_model(jax.random.key(0), [8, 16, 16, 16, 4], 16)
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
    batch = jax.device_put(batch, NamedSharding(mesh, P("batch")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    h = sm.hybridize(zoo8.dist_predict, params)
    close(h(batch[0]), zoo8.dist_predict(params, batch[0]))

    def h_loss(params, batch):
        inputs, targets = batch
        return jnp.mean(jnp.sum((h.apply(params, inputs) - targets) ** 2, axis=-1))

    gradfun, ours = jax.jit(jax.grad(zoo8.dist_loss)), jax.jit(jax.grad(h_loss))
    mesh = jax.make_mesh((4, 2), ("batch", "model"), axis_types=(AxisType.Auto,) * 2)
    batch = jax.device_put(batch, NamedSharding(mesh, P("batch", None)))
    replicated_sharding = NamedSharding(mesh, P())
    (W1, b1), (W2, b2), (W3, b3), (W4, b4) = params
    params = (
        (jax.device_put(W1, replicated_sharding), jax.device_put(b1, replicated_sharding)),
        (jax.device_put(W2, NamedSharding(mesh, P(None, "model"))),
         jax.device_put(b2, NamedSharding(mesh, P("model")))),
        (jax.device_put(W3, NamedSharding(mesh, P("model", None))),
         jax.device_put(b3, replicated_sharding)),
        (jax.device_put(W4, replicated_sharding), jax.device_put(b4, replicated_sharding)),
    )  # fmt: skip
    theirs = mine = list(params)
    step_size = 1e-5
    for _ in range(3):
        grads, our_grads = gradfun(theirs, batch), ours(mine, batch)
        theirs = [
            (W - step_size * dW, b - step_size * db)
            for (W, b), (dW, db) in zip(theirs, grads, strict=True)
        ]
        mine = [
            (W - step_size * dW, b - step_size * db)
            for (W, b), (dW, db) in zip(mine, our_grads, strict=True)
        ]
    close(mine, theirs)
    trained = h.replace(params=[tuple(np.asarray(a) for a in layer) for layer in mine])
    sm.export(trained, tmp_path / "m", example=(np.asarray(batch[0]),))
    got = sm.load(tmp_path / "m")(np.asarray(batch[0][:3]))
    close(got, zoo8.dist_predict(theirs, batch[0][:3]))
