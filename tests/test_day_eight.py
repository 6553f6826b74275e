"""A researcher's day eight (session 63, Part H): the model gives NaNs, and a sweep runs overnight.

The models of earlier days (``tests/helpers.py``'s zoo, the chapter's MLP) debugged with the
tools JAX's documentation gives for a jitted function, by a user who has not read this
library's code: ``jax_debug_nans``, ``jax.disable_jit()``, ``jax.debug.print`` and
``jax.debug.callback``, ``checkify``, ``jax.checking_leaks()``, ``jax.log_compiles()``,
``chex.assert_max_traces`` and ``jax.profiler.trace``; then a sweep of configs (widths,
learning rates, activations) hybridized, trained a few steps with optax and exported in one
process, in threads too, with ``jax.clear_caches()`` between them. Each must behave as JAX
documents it for a plain ``jax.jit`` function.

Each cheap test is a stumble of that walk (it failed before its fix) or one that held.
"""

from __future__ import annotations

import concurrent.futures
import gc
import gzip
import traceback
import weakref

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ZOO, reference_calls
from jax.experimental import checkify

import symjax_mlp as sm

X = jax.random.normal(jax.random.key(0), (4, 3), jnp.float32)


class _Log(nn.Module):
    """A NaN where the first layer's output is negative: ``jnp.log`` of it."""

    @nn.compact
    def __call__(self, x):
        return jnp.log(nn.Dense(4)(x))


def _runs():
    """A pure model that counts its Python runs, and its hybrid (a budget of one trace)."""
    runs = []

    def forward(params, x):
        runs.append(1)
        return jnp.tanh(x @ params["w"])

    return sm.hybridize(forward, {"w": jnp.ones((3, 2))}, max_traces=1), runs


# -- debugging ----------------------------------------------------------------------------------
def test_a_call_under_disable_jit_runs_op_by_op_neither_logged_nor_counted():
    """Each call under ``jax.disable_jit()`` traced again and was logged as a retrace, so a
    Hybrid with ``max_traces`` raised a RetraceError blaming the inputs ("same signature
    traced again"), and the log grew by one a call."""
    h, runs = _runs()
    expected = h(X)
    with jax.disable_jit():
        for _ in range(3):
            np.testing.assert_allclose(h(X), expected, rtol=1e-6)
        np.testing.assert_allclose(h.apply(h.params, X), expected, rtol=1e-6)
    assert len(runs) == 1 + 4  # the model's Python ran at every call, as JAX runs a jitted fn's
    assert [e.reason for e in h.trace_log] == ["first call"]
    h(X)  # and compiled again afterwards, from the one trace
    assert len(runs) == 5


def _cheap(names):
    """The zoo, those not in ``names`` slow."""
    return [pytest.param(c, id=c.name, marks=() if c.name in names else pytest.mark.slow)
            for c in ZOO]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in ZOO if c.stateful], ids=lambda c: c.name)
def test_a_stateful_model_under_disable_jit_carries_its_state_as_eager_flax(case):
    h = case.hybridize()
    with jax.disable_jit():
        outs = [h(*case.inputs(i), **case.settings("train")) for i in range(2)]
    expected, _ = reference_calls(case, 2, case.settings("train"))
    chex.assert_trees_all_close(outs, expected, atol=1e-5)
    assert len(h.trace_log) == 0


@pytest.mark.slow
def test_train_under_disable_jit_runs_its_steps_op_by_op():
    """``train`` under ``jax.disable_jit()`` raised "train step traced again (trace #2)... Every
    step should see one signature" at its second step: each step ran (and was counted) anew."""
    d = sm.training.load_digits()
    data = sm.training.Dataset(d.x_train[:192], d.y_train[:192], d.x_test[:32], d.y_test[:32], 10)
    compiled = sm.training.train(sm.mlp((8, 10)), data, epochs=1, batch_size=64)
    with jax.disable_jit():
        eager = sm.training.train(sm.mlp((8, 10)), data, epochs=1, batch_size=64)
    assert eager.step == compiled.step == 3 and eager.trace_count == 0
    chex.assert_trees_all_close(eager.params, compiled.params, atol=1e-5)


def test_debug_nans_points_at_the_models_own_line():
    """Held: ``jax_debug_nans`` raises FloatingPointError at the model's ``jnp.log``, through
    ``h(x)`` and ``h.apply``, as for a plain jitted function."""
    model = _Log()
    h = sm.hybridize(model, model.init(jax.random.key(0), X))
    assert np.isnan(h(X)).any()
    with jax.debug_nans(True):
        for call in (lambda: h(X), lambda: h.apply(h.params, X)):
            with pytest.raises(FloatingPointError, match="nan") as raised:
                call()
            frames = traceback.extract_tb(raised.value.__traceback__)
            assert any(f.filename == __file__ and f.name == "__call__" for f in frames)


@pytest.mark.slow
def test_debug_nans_on_a_loaded_model_names_the_artifact(tmp_path):
    """A loaded artifact's NaN under ``jax.debug_nans(True)`` raised JAX's message for a jitted
    function whose de-optimized run found none ("consider opening a bug report at
    https://github.com/jax-ml/jax"): an artifact has no op by op run to point at."""
    model = _Log()
    h = sm.hybridize(model, model.init(jax.random.key(63), X))  # weights of this test only
    loaded = sm.load(sm.export(h, tmp_path / "nan", example=X).path)
    assert np.isnan(loaded(X)).any()
    with jax.disable_jit():  # held: the artifact runs (a program, with no ops to run one by one)
        np.testing.assert_allclose(loaded(X), h(X), rtol=1e-5, equal_nan=True)
    with jax.debug_nans(True):
        for _ in range(2):
            with pytest.raises(FloatingPointError, match="no line of your model") as raised:
                loaded(X)
            assert str(tmp_path / "nan") in str(raised.value)


def test_debug_print_and_callback_run_at_every_call_and_export_refuses_them():
    """Held: ``jax.debug.print``/``callback`` run at every call (a ``print`` only at a trace),
    and export refuses the callback an artifact cannot carry, as README's table says."""
    seen = []

    def forward(params, x):
        y = x @ params["w"]
        jax.debug.callback(lambda s: seen.append(float(s)), y.sum())
        return y

    h = sm.hybridize(forward, {"w": jnp.ones((3, 2))})
    for _ in range(3):
        h(X)
    h.apply(h.params, X)
    jax.effects_barrier()
    assert len(seen) == 4 and len(h.trace_log) == 2
    with pytest.raises(sm.ConfigError, match="debug_callback"):
        sm.export(h, "unused", example=X)


def test_checkify_runs_the_checks_of_h_and_of_h_apply():
    """Held: a ``checkify.check`` inside the model, functionalized by ``checkify.checkify``
    around ``h`` or ``h.apply``, as around a jitted function; ``float_checks`` find the NaN."""

    def forward(params, x):
        y = x @ params["w"]
        checkify.check(jnp.all(y < 10.0), "too big: {m}", m=y.max())
        return y

    h = sm.hybridize(forward, {"w": jnp.ones((3, 2))})
    err, _ = checkify.checkify(h)(X)
    assert err.get() is None
    assert "too big" in checkify.checkify(h)(X * 100)[0].get()
    assert "too big" in checkify.checkify(h.apply)(h.params, X * 100)[0].get()
    nan = checkify.checkify(h.apply, errors=checkify.float_checks)(h.params, X * jnp.nan)
    assert "nan generated" in nan[0].get()


def test_log_compiles_and_chex_count_one_trace_a_signature(caplog):
    """Held: ``jax.log_compiles`` logs the Hybrid's one compile per input signature, and
    ``chex.assert_max_traces`` on the model's function sees one trace of it."""

    @chex.assert_max_traces(n=1)
    def forward(params, x):
        return jnp.tanh(x @ params["w"])

    chex.clear_trace_counter()
    h = sm.hybridize(forward, {"w": jnp.ones((3, 2))})
    with caplog.at_level("WARNING", logger="jax"), jax.log_compiles():
        for _ in range(3):
            h(X)
    compiled = [r for r in caplog.messages if r.startswith("Finished XLA compilation of jit(")]
    assert sum("forward" in r for r in compiled) == 1, compiled


@pytest.mark.parametrize("case", _cheap({"fn_kwargs"}))
def test_checking_leaks_finds_none_in_the_zoo(case):
    """Held: ``jax.checking_leaks()`` around each zoo model's compiled call."""
    h = case.hybridize()
    with jax.checking_leaks():
        h(*case.inputs(0), **case.settings("train"))


@pytest.mark.slow
def test_profiler_trace_records_the_compiled_calls(tmp_path):
    """Held: ``jax.profiler.trace`` around calls writes the trace TensorBoard and Perfetto read,
    the Hybrid's program and a ``TraceAnnotation`` of the caller's among its events."""
    h, _ = _runs()
    h(X)
    with jax.profiler.trace(tmp_path), jax.profiler.TraceAnnotation("day_eight_step"):
        jax.block_until_ready(h(X))
    (found,) = tmp_path.glob("plugins/profile/*/*.trace.json.gz")
    text = gzip.decompress(found.read_bytes()).decode()
    assert "day_eight_step" in text and "forward" in text


# -- the sweep ------------------------------------------------------------------------------------
_ACTS = {"relu": nn.relu, "tanh": nn.tanh, "gelu": nn.gelu}
_Y = jnp.array([0, 1, 2, 1])


class _Net(nn.Module):
    width: int
    act: str

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(_ACTS[self.act](nn.Dense(self.width)(x)))


def _config(i: int, steps: int = 2):
    """Config ``i`` (width, learning rate, activation) hybridized and trained ``steps`` steps
    of adam through ``h.apply``: the trained Hybrid and its last loss."""
    width, lr, act = (4, 8, 16)[i % 3], (1e-3, 1e-2, 1e-1)[i % 3], tuple(_ACTS)[i % 3]
    model = _Net(width, act)
    h = sm.hybridize(model, model.init(jax.random.key(i), X))
    tx = optax.adam(lr)

    @jax.jit
    def step(params, opt):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(h.apply(p, X), _Y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    params, opt = h.params, tx.init(h.params)
    for _ in range(steps):
        params, opt, value = step(params, opt)
    return h.replace(params=params), float(value)


def test_a_sweep_frees_each_config_and_survives_clear_caches(tmp_path):
    """Held: each config's Hybrids are freed when dropped (their arrays with them); a live
    Hybrid and a loaded model answer as before after ``jax.clear_caches()``."""
    kept, _ = _config(0)
    sm.export(kept, tmp_path / "kept", example=X)
    loaded = sm.load(tmp_path / "kept")
    answer = np.asarray(kept(X))
    gc.collect()
    before = len(jax.live_arrays())
    dropped = []
    for i in (1, 2):
        h, loss = _config(i)
        assert np.isfinite(loss)
        dropped.append(weakref.ref(h))
        if i == 1:
            jax.clear_caches()
        del h
    gc.collect()
    assert [r() for r in dropped] == [None] * len(dropped)
    assert len(jax.live_arrays()) <= before
    np.testing.assert_allclose(kept(X), answer, rtol=1e-6)
    np.testing.assert_allclose(loaded(X), answer, rtol=1e-5, atol=1e-6)


def test_a_retrace_after_clear_caches_says_so():
    """A Hybrid with a budget retraced after ``jax.clear_caches()`` raised a RetraceError whose
    reason was "same signature traced again (a new jax.jit cache entry)", and told the user to
    fix their shapes."""
    h, _ = _runs()
    h(X)
    jax.clear_caches()
    with pytest.raises(sm.RetraceError, match=r"jax\.clear_caches\(\) emptied JAX's caches"):
        h(X)


def test_a_sweep_in_threads_gives_each_config_its_own_answer():
    """Held: configs hybridized and called in a thread pool, each against its own flax apply."""

    def run(i):
        model = _Net((4, 8, 16)[i % 3], tuple(_ACTS)[i % 3])
        variables = model.init(jax.random.key(i), X)
        x = X + i
        return np.asarray(sm.hybridize(model, variables)(x)), np.asarray(model.apply(variables, x))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for got, expected in pool.map(run, range(4)):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_long_sweep_keeps_its_memory_bounded(tmp_path):
    """Held: 40 configs trained and exported, ``jax.clear_caches()`` every 10: no Hybrid
    outlives its config, and the process holds no more arrays than after a first config and
    export (which leave two more than before: copies of ``X`` and the labels, the constants
    each config's step closes over, referred to by no Python object)."""
    h, _ = _config(40)
    sm.export(h, tmp_path / "first", example=X)
    del h
    gc.collect()
    before, refs = len(jax.live_arrays()), []
    for i in range(40):
        h, _ = _config(i, steps=3)
        sm.export(h, tmp_path / f"c{i}", example=X)
        refs.append(weakref.ref(h))
        del h
        if i % 10 == 9:
            jax.clear_caches()
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(jax.live_arrays()) <= before
