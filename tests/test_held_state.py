"""What a Hybrid holds between calls, and what writes reach it.

- An nnx module's ``self.sow(nnx.Intermediate, ...)`` outside ``nnx.capture`` (deprecated in
  flax 0.12.8) appends every call's value: the Hybrid keeps it as ``nnx.jit`` does, so its
  held state grows and each call traces again. Flax's own guide (tests/zoo29b.py's ``MLP``):
  warned once, a :class:`~symjax_mlp.RetraceWarning` naming ``nnx.capture``, whose route
  traces once.
- ``h.params`` and ``h.state`` stay plain dicts (``jax.tree.map`` against a dict, optax and
  ``jax.vmap`` take them as they are; a read-only mapping type would be another pytree node):
  a write into one changes nothing the Hybrid holds, and no door reads it (``h.state`` was the
  dict the Hybrid kept, and baked params were the dict given: h.eager, h.apply, h.module and
  ``h.replace()`` ran the write while ``h(x)`` ran what it held).
- An nnx module trained in place by its own loop after ``sm.hybridize`` (Flax's MNIST
  tutorial, tests/zoo29b.py): ``h(x)`` runs the Variables as of hybridize, as designed (its
  hot path reads no module); every door that would hand those on as the module's refuses,
  naming ``h.refresh()``, and ``h.apply(params, x)`` too once the loop moved the state it
  runs from (it ran the new Params over the old BatchNorm statistics: silent).
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo29
import zoo29b
from flax import nnx

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # (each over 0.5 s: traces, eager calls, a BatchNorm)

TOL = {"atol": 1e-5, "rtol": 1e-5}
#: the guide's x is jnp.ones((10, 20)): every row alike, BatchNorm divides rounding by sqrt(eps)
X = jax.random.normal(jax.random.key(1), (10, 20))


def _warned(call, n):
    """The RetraceWarnings ``n`` calls raised, each call's answer."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        answers = [call() for _ in range(n)]
    return [w for w in said if w.category is sm.RetraceWarning], answers


def test_the_guides_sow_outside_capture_grows_the_state_and_warns_once_naming_capture():
    """Each call traced again with no word of why (pytree.md's MLP, called as a module)."""
    x = X
    model, eager = zoo29b.MLP(3, 20, nnx.Rngs(0)), zoo29b.MLP(3, 20, nnx.Rngs(0))
    h = sm.hybridize(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # flax's, of sow outside capture
        said, answers = _warned(lambda: h(x), 5)
        want = [eager(x) for _ in range(5)]
    chex.assert_trees_all_close(answers, want, **TOL)  # as nnx runs it: the state carried on
    sown = nnx.to_pure_dict(nnx.state(eager, nnx.Intermediate))
    chex.assert_trees_all_close(h.state["blocks"][2]["y_mean"], sown["blocks"][2]["y_mean"])
    assert len(h.state["blocks"][0]["y_mean"]) == 5 and h.trace_count == 5
    assert len(said) == 1, [str(w.message) for w in said]
    message = str(said[0].message)
    assert message.startswith("MLP: traced again at each of the last 3 calls because")
    assert "state['blocks'][0]['y_mean'][" in message
    assert "sm.hybridize(lambda m, *a: nnx.capture(m, nnx.Intermediate)(*a), model)" in message
    assert said[0].filename == __file__  # the user's line


def test_the_route_the_warning_names_traces_once_and_answers_the_guides_capture():
    model, x = zoo29b.guide()[0], X  # (its capture: one call made)
    h = sm.hybridize(lambda m, *a: nnx.capture(m, nnx.Intermediate)(*a), zoo29b.guide()[0])
    said, answers = _warned(lambda: h(x), 3)
    for got, got_intms in answers:
        result, intms = nnx.capture(model, nnx.Intermediate)(x)
        chex.assert_trees_all_close(got, result, **TOL)
        chex.assert_trees_all_close(nnx.to_pure_dict(got_intms), nnx.to_pure_dict(intms), **TOL)
    sown = jax.tree.map(np.shape, nnx.to_pure_dict(got_intms))
    assert sown == {"blocks": {i: {"y_mean": ((),)} for i in range(3)}}  # one value a call
    assert (h.trace_count, said) == (1, [])


def test_an_intermediate_set_once_a_call_is_no_growth_and_no_warning():
    """flax's integration test's Linear assigns ``self.y``: added by the first call, then
    replaced; the Hybrid turns stateful once and traces no more."""
    x = jax.random.normal(jax.random.key(1), (8, 12))
    h = sm.hybridize(zoo29.Linear(12, 2, rngs=nnx.Rngs(0)))
    said, _ = _warned(lambda: h(x), 5)
    assert said == [] and h.trace_count <= 2


# -- writes into what a property returned: plain dicts (jax.tree.map and optax take them as
# they are), which no door reads: h(x), h.eager, h.apply, h.module, h.replace() agree ---------

BN_X = jnp.arange(6.0).reshape(3, 2)


def _doors(h, x):
    """What each door answers on ``x`` (an eval BatchNorm's: it moves no state), those that
    hold no new state first (a call held its state anew: the kept dict with it)."""
    return {
        "state": h.state["mean"], "module": h.module(x), "apply": h.apply(h.params, x)[0],
        "replace()": h.replace()(x), "eager": h.eager(x), "h(x)": h(x),
    }  # fmt: skip


def test_a_write_into_h_state_reaches_no_door():
    """h.state was the very dict the Hybrid kept: a write into it showed in h.state, h.module,
    h.eager, h.apply and h.replace(), while h(x) ran the state held (silent)."""
    model = nnx.BatchNorm(2, use_running_average=True, rngs=nnx.Rngs(0))
    h = sm.hybridize(model)
    before = _doors(h, BN_X)
    h.state["mean"] = jnp.full((2,), 100.0)
    state = h.state
    state["mean"] = jnp.full((2,), 100.0)
    chex.assert_trees_all_close(_doors(h, BN_X), before)
    chex.assert_trees_all_close(before["h(x)"], model(BN_X))


def test_a_write_into_baked_params_reaches_no_door():
    """params_as_constants=True: h.params was the dict given, which h.eager, h.graph and
    h.replace() read, while the program held the constants baked (silent)."""
    x = jnp.ones((2, 3))
    h = sm.hybridize(lambda p, x: x @ p["w"], {"w": jnp.ones((3, 2))}, params_as_constants=True)
    want = h(x)
    h.params["w"] = jnp.zeros((3, 2))
    chex.assert_trees_all_close(h.params, {"w": jnp.ones((3, 2))})
    for door in (h, h.eager, h.replace(), h.hybridize(False)):
        chex.assert_trees_all_close(door(x), want)
    assert h.graph(x).flops > 0 and h.replace(params={"w": jnp.zeros((3, 2))})(x).sum() == 0


# -- an nnx module trained in place by the user's own loop (the MNIST tutorial's) ----------------

REFRESH = r"nnx module holds other Variables \({}.*h = h\.refresh\(\)"


def test_after_the_mnist_tutorials_own_loop_each_door_refuses_or_runs_the_module_as_now(tmp_path):
    """h.apply(params, x) of the module's new Params ran them over the BatchNorm statistics
    held as of hybridize, which the loop had moved: an answer neither the module's nor h's
    (silent), where h.state, h.params, export and h.eager refuse."""
    model = zoo29b.CNN(rngs=nnx.Rngs(0))
    optimizer, metrics = zoo29b.make_training(model)
    train_model, eval_model = zoo29b.views(model)
    x = jax.random.uniform(jax.random.key(0), (4, 28, 28, 1))
    batch = {"image": x, "label": jnp.array([1, 2, 3, 4])}
    h = sm.hybridize(eval_model)
    before, rngs = h(x), nnx.Rngs(0)
    for _ in range(2):
        zoo29b.train_step(train_model, optimizer, metrics, rngs, batch)
    zoo29b.eval_step(eval_model, metrics, batch)
    now = eval_model(x)
    assert not np.allclose(now, before, atol=1e-3)
    chex.assert_trees_all_close(h(x), before)  # the Variables as of hybridize, as designed
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    said = REFRESH.format(r"state\['batch_norm1'\]\['mean'\]")
    with pytest.raises(sm.ConfigError, match=rf"^TutorialCNN\.apply: the {said}"):
        h.apply(params, x)  # (its state named: the params are given)
    for door in (lambda: h.state, lambda: h.eager(x)):
        with pytest.raises(sm.ConfigError, match=REFRESH.format("")):
            door()
    with pytest.raises(sm.ConfigError, match=r"nnx module holds other Variables"):
        sm.export(h, tmp_path / "old", example=(x,))
    fresh = h.refresh()
    chex.assert_trees_all_close(fresh(x), now, **TOL)
    chex.assert_trees_all_close(fresh.apply(params, x)[0], now, **TOL)
    sm.export(fresh, tmp_path / "m", example=(x,), batch="b")
    chex.assert_trees_all_close(
        sm.load(tmp_path / "m", allow={"convolution", "reduce_window"})(np.asarray(x[:2])),
        now[:2],
        **TOL,
    )


def test_params_alone_trained_in_place_h_apply_of_them_runs_as_the_module():
    """Its state unmoved (an eval BatchNorm's statistics), h.apply of the Params the user's
    nnx.Optimizer wrote runs from the held state, which is the module's: not refused."""
    model = nnx.Sequential(
        nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
        nnx.BatchNorm(2, use_running_average=True, rngs=nnx.Rngs(0)),
    )
    h = sm.hybridize(model)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    optimizer.update(model, nnx.grad(lambda m: (m(BN_X) ** 2).sum())(model))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out, state = h.apply(params, BN_X)
    chex.assert_trees_all_close(
        (out, state), (model(BN_X), nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))), **TOL
    )
    with pytest.raises(sm.ConfigError, match=REFRESH.replace("Variables", "Params").format("")):
        h.eager(BN_X)
