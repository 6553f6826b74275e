"""A Hybrid handed back to itself, and a stateful one under JAX's transforms: an ``on_trace``
callback may read or call the Hybrid from any thread (the trace runs outside the state's lock);
the Hybrid or its model given as an input, or a container holding itself, is a ConfigError
naming its path; an eval-mode call, which keeps the state, runs under ``jax.jit``.

Each call that could hang runs in a thread joined with a timeout, so a regression fails.
"""

import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    STRICT_WARNINGS,
    LinenBatchNorm,
    LinenDropout,
    NnxBatchNorm,
    NnxDropout,
    NnxModes,
    StatefulLinear,
    _rnn_cell,
    bounded,
    keyless,
    rand,
)

import symjax_mlp as sm

X = rand(4, 5)  # (batch, features)


def _linen():
    model = LinenBatchNorm()
    return sm.hybridize(model, model.init(jax.random.key(0), X))


def _nnx():
    return sm.hybridize(NnxBatchNorm(nnx.Rngs(0)))


@pytest.mark.parametrize("make", [_linen, _nnx], ids=["linen", "nnx"])
@pytest.mark.parametrize("touch", ["state", "call", "replace", "module"])
def test_an_on_trace_callback_may_use_its_stateful_hybrid_from_another_thread(make, touch):
    h, fresh = make(), make()
    h(X, train=True)
    seen = []

    @h.on_trace
    def callback(*args, **kwargs):  # as a logger handing work to another thread does
        use = {
            "state": lambda: h.state,
            "call": lambda: h(X, train=True),  # a traced signature: no trace
            "replace": lambda: h.replace(name="twin"),
            "module": lambda: h.module,
        }[touch]
        seen.append(bounded(use, 60))

    out = bounded(lambda: h(X[:3], train=True))
    assert len(seen) == 1
    # as if called one after the other: the callback's call first, then the call that traced
    calls = [X, X, X[:3]] if touch == "call" else [X, X[:3]]
    want = [fresh(x, train=True) for x in calls][-1]
    chex.assert_trees_all_close(out, want)
    chex.assert_trees_all_close(keyless(h.state), keyless(fresh.state))


@pytest.mark.parametrize("make", [_linen, _nnx], ids=["linen", "nnx"])
def test_an_on_trace_callback_calling_its_hybrid_again_is_refused_not_recursed(make):
    h = make()
    h.on_trace(lambda x, **kw: h(x, **kw))  # the very inputs being traced
    with pytest.raises(sm.ConfigError, match=r"on_trace callback called the Hybrid"):
        bounded(lambda: h(X, train=True))
    with pytest.raises(sm.ConfigError, match=r"on_trace callback called the Hybrid"):
        bounded(lambda: h.eager(X))
    assert h.trace_count == 0


def _linen_eval():
    return _linen(), {"train": False}


def _nnx_eval():
    module = NnxModes(nnx.Rngs(0, dropout=1))
    module.eval()
    return sm.hybridize(module), {}


def _nnx_flag():
    return _nnx(), {"train": False}


def _nnx_jit():
    """An ``@nnx.jit`` function of the module (flax's randomness guide decorates its forward
    so): the state it hands back as given was taken as changed, and refused under jax.jit."""
    return sm.hybridize(nnx.jit(lambda m, x: m(x)), _nnx().module), {}  # (train=False)


@pytest.mark.parametrize(
    "make", [_linen_eval, _nnx_eval, _nnx_flag, _nnx_jit], ids=["linen", "nnx", "flag", "nnx.jit"]
)
def test_an_eval_mode_stateful_call_runs_under_jit(make):
    h, settings = make()
    state = keyless(h.state)
    want = h(X, **settings)
    got = jax.jit(lambda x: h(x, **settings))(X)
    chex.assert_trees_all_close(got, want)
    chex.assert_trees_all_close(keyless(h.state), state)
    chex.assert_trees_all_close(jax.jit(lambda x: h(x, **settings))(X + 1), h(X + 1, **settings))


def test_a_linen_model_with_rng_streams_in_eval_mode_under_jit_is_refused_naming_rngs():
    # every call splits a linen model's streams (the reference, tests/helpers.reference_calls,
    # does too), so even its eval-mode call changes the state: the message says so, not only
    # "call it in eval mode"
    model = LinenDropout()
    h = sm.hybridize(model, model.init(jax.random.key(0), X), rngs=1)
    with pytest.raises(sm.ControlFlowError, match=r"linen model's rngs=.*without rngs=.*h\.apply"):
        jax.jit(h)(X)


def test_a_training_mode_stateful_call_under_jit_is_still_refused():
    h = _linen()
    state = keyless(h.state)
    with pytest.raises(sm.ControlFlowError, match=r"changes its state.*eval mode.*h\.apply"):
        jax.jit(lambda x: h(x, train=True))(X)
    chex.assert_trees_all_close(keyless(h.state), state)
    module = NnxModes(nnx.Rngs(0, dropout=1))
    h = sm.hybridize(module)
    with pytest.raises(sm.ControlFlowError, match=r"changes its state"):
        jax.jit(h)(X)


def test_a_state_changed_under_jit_is_named_in_the_refusal():
    """nnx_basics' StatefulLinear counts its calls in any mode: the refusal said to call it in
    eval mode, which it was, without naming what changed."""
    h = sm.hybridize(StatefulLinear(5, 3, rngs=nnx.Rngs(0)))
    with pytest.raises(sm.ControlFlowError, match=r"changes its state \(state\['count'\]\)"):
        jax.jit(h)(X)


@pytest.mark.parametrize("internal", [True, False], ids=["internal", "fallback"])
def test_a_stateful_call_looks_for_tracers_only_under_a_transform(monkeypatch, internal):
    # the hot path of a BatchNorm model: its new state is concrete outside jit/grad/vmap, so no
    # leaf is looked at; under one (or with the trace-state internal off) every leaf still is
    from symjax_mlp import _compat
    from symjax_mlp._hybrid import traced

    monkeypatch.setitem(_compat.INTERNALS, "transformed", internal)
    seen, tracer = [], jax.core.Tracer

    class Counted(type):
        def __instancecheck__(cls, obj):
            seen.append(obj)
            return isinstance(obj, tracer)

    h = _linen()
    h(X, train=True)  # traced
    for module in (jax.core, traced):
        monkeypatch.setattr(module, "Tracer", Counted("Tracer", (), {}), raising=False)
    h(X, train=True)
    assert (seen == []) is internal
    with pytest.raises(sm.ControlFlowError, match=r"changes its state"):
        jax.jit(lambda x: h(x, train=True))(X)
    assert seen


def _own_inputs():
    """``(hybrid, model, input)`` for a linen, an nnx and a plain-function Hybrid."""
    linen, module = sm.mlp((4, 2)), NnxBatchNorm(nnx.Rngs(0))
    yield sm.hybridize(linen, linen.init(jax.random.key(0), X)), linen, X
    yield sm.hybridize(module), module, X
    yield sm.hybridize(lambda p, x: x * p, np.float32(2)), None, X


OWN_INPUTS = {  # (call, the path named, what it is)
    "h(net)": (lambda h, net, x: h(net), r"args\[0\]", "the model"),
    "h(x, net)": (lambda h, net, x: h(x, net), r"args\[1\]", "the model"),
    "h(x, m=(net,))": (lambda h, net, x: h(x, m=(net,)), r"kwargs\['m'\]\[0\]", "the model"),
    "h(h)": (lambda h, net, x: h(h), r"args\[0\]", "the Hybrid itself"),
    "h(x, {'h': h})": (lambda h, net, x: h(x, {"h": h}), r"args\[1\]\['h'\]", "the Hybrid"),
    "h.apply(p, h)": (lambda h, net, x: h.apply(h.params, h), r"args\[0\]", "the Hybrid"),
    "h.graph(x, h)": (lambda h, net, x: h.graph(x, h), r"args\[1\]", "the Hybrid"),
}


@pytest.mark.parametrize("call", OWN_INPUTS)
def test_the_model_or_hybrid_given_as_its_own_input_is_refused_naming_its_path(call):
    fn, path, what = OWN_INPUTS[call]
    for h, net, x in _own_inputs():
        if net is None and what == "the model":
            continue
        with pytest.raises(sm.ConfigError, match=rf"{path} is {what}.*pass only the model's"):
            bounded(lambda: fn(h, net, x))  # noqa: B023
        assert h.trace_count == 0


# In a child under a memory limit: walked forever, the walk's paths would take a GiB a second.
_CYCLES = """
import resource
import numpy as np
import symjax_mlp as sm

h = sm.hybridize(lambda p, x: x * p, np.float32(2))
cyclic = {"x": np.ones(2)}
cyclic["me"] = cyclic
nested = [np.ones(2)]
nested.append((nested,))
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), hard))
for call in (lambda: h(cyclic), lambda: h(np.ones(2), y=nested)):
    try:
        call()
    except sm.ConfigError as e:
        print(e)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_an_input_holding_itself_is_refused_not_walked_forever():
    child = [sys.executable, *STRICT_WARNINGS, "-c", _CYCLES]
    done = subprocess.run(child, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout.splitlines()
    assert said[0].startswith("<lambda>: args[0]['me'] is the dict that holds it (a cycle)")
    assert said[1].startswith("<lambda>: kwargs['y'][1][0] is the list that holds it")


@pytest.mark.parametrize("make", [_linen, _nnx], ids=["linen", "nnx"])
def test_replace_with_a_state_not_shaped_as_the_models_is_refused_naming_the_paths(make):
    h = make()
    # before (linen): KeyError: 'batch_stats' at the next call
    for bad in (None, {"bad": np.ones(2)}, {**h.state, "extra": np.ones(2)}):
        with pytest.raises(sm.ConfigError, match=r"replace\(state=...\): .* (missing|unexpected)"):
            h.replace(state=bad)
    twin = h.replace(state=jax.tree.map(lambda a: a + 1, h.state))
    chex.assert_trees_all_close(twin.state, jax.tree.map(lambda a: a + 1, h.state))
    assert twin(X).shape == h(X).shape
    if make is _nnx:  # an nnx.State, as nnx.state(module, nnx.Not(nnx.Param)) gives it
        state = nnx.state(NnxBatchNorm(nnx.Rngs(0)), nnx.Not(nnx.Param))
        chex.assert_trees_all_close(h.replace(state=state)(X), h(X))


@pytest.mark.parametrize("make", [_linen, _nnx], ids=["linen", "nnx"])
def test_apply_with_a_state_not_shaped_as_the_models_is_refused_naming_the_paths(make):
    h = make()
    # before (linen): Python's TypeError ('NoneType' object is not iterable), KeyError
    for bad in (None, {}, {"bad": np.ones(2)}, {**h.state, "extra": np.ones(2)}):
        with pytest.raises(
            sm.ConfigError,
            match=r"apply_with_state\(params, state, ...\): "
            r"the state given does not fit .* (missing|unexpected)",
        ):
            h.apply_with_state(h.params, bad, X)
    out, state = h.apply_with_state(h.params, jax.tree.map(np.asarray, h.state), X)
    chex.assert_trees_all_close((out, state), h.apply(h.params, X))


def test_a_function_of_an_nnx_module_carries_its_state_as_the_modules_own_hybrid():
    """``hybridize(fn, module)`` (nnx_basics' ``forward(model, rngs, x)``): the module's
    BatchStats moved by its calls, as eager nnx moves them; once they were silently dropped."""

    def forward(model, x):
        return model(x, train=True)

    h = sm.hybridize(forward, NnxBatchNorm(nnx.Rngs(0)))
    own, plain = sm.hybridize(NnxBatchNorm(nnx.Rngs(0))), NnxBatchNorm(nnx.Rngs(0))
    for i in range(2):
        chex.assert_trees_all_close(h(rand(4, 5, seed=i)), forward(plain, rand(4, 5, seed=i)))
        own(rand(4, 5, seed=i), train=True)
    assert h.stateful and h.trace_count == 1
    chex.assert_trees_all_equal(h.params, own.params)  # its Param values, as a dict
    chex.assert_trees_all_close(h.state, own.state)
    chex.assert_trees_all_close(h.state, nnx.to_pure_dict(nnx.state(plain, nnx.BatchStat)))


def test_an_nnx_module_with_state_inside_the_params_is_refused_naming_its_path():
    """``hybridize(fn, {"model": module, "scale": w})``: the module was taken as a plain pytree
    of params, and the BatchStats (Dropout's rng counts) its compiled calls moved were dropped,
    silently. Refused at hybridize, naming the path, what it holds, and the fix."""

    def fn(p, x, train=False):
        return p["model"](x, train=train) * p["scale"]

    fix = r"Pass the module as the params, hybridize\(fn, module\).*as arguments"
    with pytest.raises(sm.ConfigError, match=r"params\['model'\] is an nnx NnxBatchNorm holding "
                       r"BatchStat variables.*would drop.*" + fix):  # fmt: skip
        sm.hybridize(fn, {"model": NnxBatchNorm(nnx.Rngs(0)), "scale": np.float32(2)})
    params = [np.float32(2), {"drop": NnxDropout(nnx.Rngs(0))}]
    drop = r"params\[1\]\['drop'\] is an nnx NnxDropout holding RngCount, RngKey variables"
    with pytest.raises(sm.ConfigError, match=drop):
        sm.hybridize(lambda p, x: p[1]["drop"](x), params)


def test_an_nnx_module_of_params_only_inside_the_params_runs_and_differentiates():
    """The refusal above spares a nested module holding Params only: it runs compiled as
    eagerly, and gradients reach its Params and the arrays beside it (h.apply, jax.grad)."""
    lin = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    params = {"model": lin, "scale": np.float32(2)}

    def fn(p, x):
        return p["model"](x) * p["scale"]

    h = sm.hybridize(fn, params)
    chex.assert_trees_all_close(h(X), fn(params, X), rtol=1e-6)
    grads = jax.grad(lambda p: h.apply(p, X).sum())(h.params)
    want = jax.grad(lambda p: fn(p, X).sum())(params)
    chex.assert_trees_all_close(grads["scale"], want["scale"], rtol=1e-5)
    chex.assert_trees_all_close(grads["model"].kernel[...], want["model"].kernel[...], rtol=1e-5)
    assert float(np.abs(grads["model"].kernel[...]).sum()) > 0 and not h.stateful


def test_an_nnx_module_with_state_inside_params_given_later_is_refused_alike():
    """The refusal at hybridize covers the params given afterwards too: ``h.apply(params, x)``
    and ``h.replace(params=...)`` took them unchecked, and dropped the BatchStats (Dropout's
    rng counts) the module's compiled calls moved."""

    def fn(p, x, train=False):
        return p["model"](x, train=train) * p["scale"]

    h = sm.hybridize(fn, {"model": nnx.Linear(5, 5, rngs=nnx.Rngs(0)), "scale": np.float32(2)})
    params = {"model": NnxBatchNorm(nnx.Rngs(0)), "scale": np.float32(2)}
    held = r"params\['model'\] is an nnx NnxBatchNorm holding BatchStat variables.*would drop"
    with pytest.raises(sm.ConfigError, match=r"fn\.apply\(params, \.\.\.\): " + held):
        h.apply(params, X, train=True)
    with pytest.raises(sm.ConfigError, match=r"fn\.replace\(params=\.\.\.\): " + held):
        h.replace(params=params)


def test_a_sharded_state_that_counts_steps_in_a_scan_takes_a_batch_that_does_not_divide():
    """flax's randomness guide's RNNCell counts its steps in an nnx.scan: 3 rows over 8 shards
    were refused as a state depending on the rows (a scan's outputs each taken to depend on
    every operand); now nothing is padded (XLA splits the rows unevenly): a scan carrying a
    sum of the rows holds one device's sum too."""
    fn, cell = _rnn_cell("eval")()
    h, x = sm.hybridize(fn, cell).shard(), jax.random.normal(jax.random.key(0), (3, 5, 3))
    fn, want = _rnn_cell("eval")()
    chex.assert_trees_all_close(h(x), fn(want, x), rtol=1e-5, atol=1e-6)
    assert h.state["count"] == want.count[...] == 5

    one, sums = sm.hybridize(_ScanSum()), sm.hybridize(_ScanSum()).shard()
    chex.assert_trees_all_close(sums(x), one(x), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(sums.state, one.state, rtol=1e-5, atol=1e-6)


class _ScanSum(nnx.Module):
    def __init__(self):
        self.w, self.total = nnx.Param(jnp.ones(())), nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
        self.total[...], y = jax.lax.scan(
            lambda c, r: (c + r.sum(), r * self.w), self.total[...], x
        )
        return y


@pytest.mark.slow  # 1.9 s on the loaded 2-core machine; nnx_array_leaves of the matrix is not slow
def test_an_nnx_module_of_array_leaves_takes_its_float_arrays_as_params_its_count_as_state():
    """nnx's array leaves (examples/nnx_toy_examples/07_array_leaves.py): plain jax arrays as
    weights, no Param. Its float arrays are the params, as its ``nnx.DiffState(0, is_param)``
    trains them (they were state: h.params {}, jax.grad over it {}), its int count the state
    each call raises. A module holding Params keeps a plain float array as state, as nnx."""
    from helpers import ArrayMLP

    model, x = ArrayMLP(1, 4, 1, rngs=nnx.Rngs(0)), np.linspace(0, 1, 6, dtype=np.float32)[:, None]
    h = sm.hybridize(model)
    assert set(h.params) == {"linear1", "linear2"} and set(h.state) == {"count"}
    grads = jax.grad(lambda p: h.apply(p, x)[0].sum())(h.params)  # (out, state): stateful

    def by_hand(p):  # the example's MLP over its arrays
        hidden = jax.nn.relu(x @ p["linear1"]["w"] + p["linear1"]["b"])
        return (hidden @ p["linear2"]["w"] + p["linear2"]["b"]).sum()

    chex.assert_trees_all_close(grads, jax.grad(by_hand)(h.params), rtol=1e-5)
    assert int(h.apply(h.params, x)[1]["count"]) == 1

    class Buffered(nnx.Module):
        def __init__(self):
            self.linear, self.scale = nnx.Linear(1, 1, rngs=nnx.Rngs(0)), jnp.float32(2)

        def __call__(self, x):
            return self.linear(x) * self.scale

    mixed = sm.hybridize(Buffered())
    assert set(mixed.params) == {"linear"} and set(mixed.state) == {"scale"}


def test_a_float_array_leaf_the_call_reassigns_is_refused_naming_a_variable_that_carries_it():
    """An nnx module of no Param takes its float arrays as params (above); a float count its
    call raises would be dropped with what the call wrote (held at 0): refused, naming an int
    array or an nnx.Variable, which are carried as state."""

    class Counted(nnx.Module):
        def __init__(self, count):
            self.count, self.w = count, jnp.ones((3, 2))

        def __call__(self, x):
            self.count += 1
            return x @ self.w

    x = jnp.ones((2, 3))
    with pytest.raises(sm.ConfigError, match=r"^Counted: the call assigned \['count'\].*int array"):
        sm.hybridize(Counted(jnp.zeros(()))).eager(x)
    h = sm.hybridize(Counted(jnp.array(0)))  # as it says
    h(x), h(x)
    assert int(h.state["count"]) == 2 and set(h.params) == {"w"}


def _nnx_modes():
    module = NnxModes(nnx.Rngs(0, dropout=1))
    module.train()  # batch statistics and dropout: every call moves the state
    return sm.hybridize(module), {}


@pytest.mark.parametrize(
    "make",
    [
        lambda: (_linen(), {"train": True}),
        lambda: (_nnx(), {"train": True}),
        lambda: (sm.hybridize(NnxDropout(nnx.Rngs(0, dropout=1))), {"deterministic": False}),
        _nnx_modes,  # h(x): the hot path
    ],
    ids=["linen-batchnorm", "nnx-batchnorm", "nnx-dropout", "nnx-train-mode"],
)
def test_a_stateful_hybrid_is_dispatched_by_jaxs_cpp_path_after_its_first_call(monkeypatch, make):
    # the first call of a signature gives up its trace under the state's lock (to trace
    # unlocked); jaxlib left such a signature on jit's Python path for good: each later call
    # of the Hybrid was dispatched by Python (~10x a stateless call's time), silently
    from jax._src import pjit  # (a probe: each call jit dispatches by Python reads its fast path)

    h, kw = make()
    wide = rand(6, 5)
    for x in (X, wide, X, wide):  # two signatures, each traced once
        h(x, **kw)
    python = []
    fast_path = pjit._get_fastpath_data
    monkeypatch.setattr(pjit, "_get_fastpath_data", lambda *a: python.append(1) or fast_path(*a))
    before = keyless(h.state)
    for _ in range(5):
        h(X, **kw), h(wide, **kw)
    assert python == []
    assert h.trace_count == 2
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), before, keyless(h.state))
    assert any(jax.tree.leaves(moved))  # (the calls ran: the state moved)
