"""What the user passes in is theirs: nnx objects mutated by a call, and their own keywords.

Models written as Flax's guides and MNIST tutorial write them (an ``nnx.Rngs`` passed to
``__call__``, a ``Variable`` or a sub-module mutated inside), and an equinox-style function
whose state is its own ``state=`` keyword. Each compiled path must leave the outputs and the
passed objects exactly as eager nnx (or the plain function) does.
"""

from __future__ import annotations

import copy
import dataclasses
import decimal
import fractions
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import symjax_mlp as sm

TOL = {"rtol": 1e-5, "atol": 1e-6}
CALLS = 3


class DropoutGuide(nnx.Module):
    """Flax's dropout guide / MNIST tutorial: the rngs passed to ``__call__``."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(5, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs: nnx.Rngs):
        x = self.dropout(nnx.relu(self.linear(x)), rngs=rngs)
        return nnx.Dropout(0.25)(x, rngs=rngs)  # one made in the call, drawing from rngs too


class NormedDropout(nnx.Module):
    """As the dropout guide, with BatchNorm: a stateful model (the Hybrid holds its
    statistics) given the caller's rngs."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs: nnx.Rngs):
        return self.dropout(nnx.relu(self.norm(self.linear(x))), rngs=rngs)


class Count(nnx.Variable):
    pass


class Counted(nnx.Module):
    """A counter the caller owns, mutated in ``__call__``."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x, counter: Count):
        counter[...] += 1
        return self.linear(x) * counter[...]


class Headed(nnx.Module):
    """A sub-module passed in: its BatchNorm statistics move on every call in train mode."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(5, 4, rngs=rngs)

    def __call__(self, x, head: nnx.Module):
        return head(self.linear(x))


def _x(seed=0):
    return jax.random.normal(jax.random.key(seed), (4, 5), jnp.float32)


def _runs(make_model, make_objects, call):
    """Runs ``call(fn, x, objects)`` CALLS times with a compiled Hybrid, its eager path, its
    apply, and the plain module, each on its own model and objects; returns each run's
    outputs and objects after."""
    runs = {}
    for how in ("compiled", "eager", "apply", "flax"):
        model, objects = make_model(), make_objects()
        if how == "flax":
            fn = model
        else:
            h = sm.hybridize(model)
            fn = {"compiled": h, "eager": h.eager}.get(how)
            if how == "apply":

                def fn(*args, h=h, **kwargs):
                    out = h.apply(h.params, *args, **kwargs)
                    return out[0] if h.stateful else out

        outs = [call(fn, _x(i), objects) for i in range(CALLS)]
        runs[how] = (outs, objects)
    return runs


def _assert_same(runs, state_of):
    want_outs, want_objects = runs["flax"]
    for how in ("compiled", "eager", "apply"):
        outs, objects = runs[how]
        chex.assert_trees_all_close(outs, want_outs, **TOL, custom_message=how)
        chex.assert_trees_all_close(
            state_of(objects), state_of(want_objects), **TOL, custom_message=how
        )


def _rng_state(rngs):
    return {"count": rngs.default.count[...], "key": jax.random.key_data(rngs.default.key[...])}


@pytest.mark.parametrize("by", ["place", "keyword"])
def test_rngs_passed_to_call_advances_as_in_eager_nnx(by):
    def call(fn, x, rngs):
        return fn(x, rngs) if by == "place" else fn(x, rngs=rngs)

    runs = _runs(lambda: DropoutGuide(nnx.Rngs(0)), lambda: nnx.Rngs(7), call)
    _assert_same(runs, _rng_state)
    outs, rngs = runs["compiled"]
    assert int(rngs.default.count[...]) == 2 * CALLS  # two dropouts per call
    masks = [np.asarray(o != 0) for o in outs]
    assert not all((m == masks[0]).all() for m in masks[1:])  # a new mask every call


def test_rngs_passed_to_a_stateful_models_call_advances_as_in_eager_nnx():
    runs = _runs(lambda: NormedDropout(nnx.Rngs(0)), lambda: nnx.Rngs(7), lambda f, x, r: f(x, r))
    _assert_same(runs, _rng_state)
    assert int(runs["compiled"][1].default.count[...]) == CALLS


def test_rngs_with_several_streams_advance_as_in_eager_nnx():
    def call(fn, x, rngs):
        return fn(x, rngs)

    runs = _runs(lambda: DropoutGuide(nnx.Rngs(0)), lambda: nnx.Rngs(default=3, dropout=4), call)

    def state(r):
        return {n: s.count[...] for n, s in vars(r).items() if isinstance(s, nnx.RngStream)}

    _assert_same(runs, state)
    assert int(runs["compiled"][1].dropout.count[...]) == 2 * CALLS


def test_a_variable_passed_to_call_comes_back_mutated():
    runs = _runs(
        lambda: Counted(nnx.Rngs(0)),
        lambda: Count(jnp.zeros((), jnp.float32)),
        lambda fn, x, c: fn(x, c),
    )
    _assert_same(runs, lambda c: c[...])
    assert float(runs["compiled"][1][...]) == CALLS


def test_a_module_passed_to_call_comes_back_with_its_new_statistics():
    runs = _runs(
        lambda: Headed(nnx.Rngs(0)),
        lambda: nnx.BatchNorm(4, momentum=0.9, rngs=nnx.Rngs(1)),
        lambda fn, x, head: fn(x, head),
    )

    def stats(head):
        return {"mean": head.mean[...], "var": head.var[...]}

    _assert_same(runs, stats)
    assert not np.allclose(runs["compiled"][1].mean[...], 0.0)


def test_objects_passed_to_call_are_not_retraced_for():
    h, rngs = sm.hybridize(DropoutGuide(nnx.Rngs(0))), nnx.Rngs(7)
    for i in range(CALLS):
        h(_x(i), rngs)
    assert h.trace_count == 1


def test_a_variable_passed_twice_is_refused():
    c = Count(jnp.zeros(()))

    def twice(params, x, a, b):
        a[...] += 1
        b[...] += 1
        return x

    with pytest.raises(sm.SymjaxError, match="more than once"):
        sm.hybridize(twice, {})(_x(), c, c)
    assert float(c[...]) == 0.0


# -- the user's own state= keyword ------------------------------------------------------------
def _step(params, x, state=None):
    """An equinox-style step: its state is its own keyword, with a default."""
    shift = 0.0 if state is None else state["shift"]
    return x * params["w"] + shift


def _step_kwonly(params, x, *, state):
    """As equinox's stateful layers: ``(out, new state)``, the state a required keyword."""
    return x * params["w"] + state["shift"], {"shift": state["shift"] + 1.0}


def _step_positional(params, x, state):
    return _step_kwonly(params, x, state=state)


@pytest.mark.parametrize("fn", [_step, _step_kwonly], ids=["default", "kwonly"])
def test_apply_passes_the_users_state_keyword_to_the_model(fn):
    params, x = {"w": jnp.float32(2.0)}, jnp.arange(3.0)
    state = {"shift": jnp.float32(10.0)}
    h = sm.hybridize(fn, params)
    want = fn(params, x, state=state)
    chex.assert_trees_all_close(h.apply(h.params, x, state=state), want)
    chex.assert_trees_all_close(h(x, state=state), want)
    chex.assert_trees_all_close(h.eager(x, state=state), want)
    grads = jax.grad(lambda p: jax.tree.leaves(h.apply(p, x, state=state))[0].sum())(params)
    chex.assert_trees_all_close(grads, {"w": x.sum()})


def test_an_equinox_style_state_carried_through_apply():
    params, x = {"w": jnp.float32(2.0)}, jnp.arange(3.0)
    h = sm.hybridize(_step_positional, params)
    state = want_state = {"shift": jnp.float32(0.0)}
    for _ in range(CALLS):
        out, state = h.apply(h.params, x, state)
        want, want_state = _step_positional(params, x, want_state)
        chex.assert_trees_all_close((out, state), (want, want_state))


class _Stateful(nnx.Module):
    """A stateful nnx module whose call takes a ``state`` keyword of its own."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(5, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)

    def __call__(self, x, state=None):
        y = self.norm(self.linear(x))
        return y if state is None else y + state


def test_apply_with_state_carries_a_stateful_models_state_and_leaves_the_keyword_alone():
    h = sm.hybridize(_Stateful(nnx.Rngs(0)))
    plain = _Stateful(nnx.Rngs(0))
    x, shift = _x(), jnp.full((4,), 3.0)
    state = h.state
    for _ in range(CALLS):
        out, state = h.apply_with_state(h.params, state, x, state=shift)
        chex.assert_trees_all_close(out, plain(x, state=shift), **TOL)
    want = nnx.to_pure_dict(nnx.split(plain, nnx.Param, ...)[2])
    chex.assert_trees_all_close(state, want, **TOL)
    out, _ = h.apply(h.params, x, state=shift)  # the held state, and the user's keyword
    chex.assert_trees_all_close(out, _Stateful(nnx.Rngs(0))(x, state=shift), **TOL)
    with pytest.raises(sm.SymjaxError, match="apply"):
        sm.hybridize(_step, {"w": 1.0}).apply_with_state({"w": 1.0}, {}, x)


def test_equinox_params_of_another_module_are_refused_naming_the_module():
    # before: JAX's bare "pytree structure error: different types at key path" from combine
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    h, x = sm.hybridize(mlp), jnp.ones(3)
    wider = eqx.filter(eqx.nn.MLP(3, 2, 5, 1, key=jax.random.key(0)), eqx.is_array)
    with pytest.raises(sm.ConfigError, match=r"MLP: the params given \(a dict\) do not"):
        h.apply({"w": x}, x)
    said = r"^MLP\.replace\(params=\.\.\.\): params\.layers\[0\]\.weight is shaped \(5, 3\)"
    with pytest.raises(sm.ConfigError, match=said):  # (since session 57: at replace)
        h.replace(params=wider)
    np.testing.assert_allclose(h.apply(h.params, x), mlp(x), **TOL)


def test_grads_of_the_gan_generator_through_h_apply_equal_equinox_filter_grad():
    """equinox's DCGAN notebook makes its state as eqx.nn.State(generator), which leaves each
    BatchNorm's bool `first_time` in the model: h.params held them, and jax.grad over h.params
    failed raw ("grad requires real- or complex-valued inputs ... but got bool")."""
    eqx = pytest.importorskip("equinox")
    from helpers import _generator, state_batch

    generator, state = _generator()
    h, x = sm.hybridize(state_batch, generator), jax.random.normal(jax.random.key(0), (4, 4, 1, 1))

    def loss(out):
        return jnp.sum(out[0] ** 2)

    got = jax.jit(jax.grad(lambda p: loss(h.apply(p, x, state))))(h.params)
    want = eqx.filter_jit(eqx.filter_grad(lambda m: loss(state_batch(m, x, state))))(generator)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(h.params))
    got, want = jax.tree.leaves(got), jax.tree.leaves(eqx.filter(want, eqx.is_inexact_array))
    assert len(got) == len(want)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
    arrays = eqx.filter(generator, eqx.is_array)  # the bools given too: taken as held
    chex.assert_trees_all_close(h.replace(params=arrays)(x, state), h(x, state))


def test_a_deepcopy_of_an_equinox_modules_hybrid_is_a_twin_with_its_own_arrays():
    """copy.deepcopy(h) of eqx.filter_vmap(model) copied its static parts too, which replace()
    refused as "a module of another class or size"."""
    eqx = pytest.importorskip("equinox")
    mlp = eqx.filter_vmap(eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0)))
    h, x = sm.hybridize(mlp), jnp.ones((2, 3))
    twin = copy.deepcopy(h)
    assert twin is not h and jax.tree.leaves(twin.params)[0] is not jax.tree.leaves(h.params)[0]
    np.testing.assert_allclose(twin(x), mlp(x), **TOL)


def test_keywords_named_self_params_or_args_are_the_models():
    # before: h(x, self=...) hit Hybrid.__call__'s own self; an equinox model's params=...
    # hit the params of the function that combines its arrays (TypeError: multiple values)
    eqx = pytest.importorskip("equinox")

    class Scaled(eqx.Module):
        w: jax.Array

        def __call__(self, x, params=1.0, **kw):
            return x * self.w * params + sum(kw.values())

    model, x = Scaled(jnp.float32(2)), jnp.ones(3)
    plain = sm.hybridize(lambda p, x, **kw: x * p + kw["self"] + kw["args"], 2.0)
    both = {"self": x, "args": x}  # args: jax.jit's AssertionError, a name of its (*args) too
    for h, kw, want in ((sm.hybridize(model), {"params": 3.0}, x * 6), (plain, both, x * 4)):
        np.testing.assert_allclose(h(x, **kw), want)
        np.testing.assert_allclose(h.eager(x, **kw), want)
        np.testing.assert_allclose(h.apply(h.params, x, **kw), want)
        assert h.graph(x, **kw).primitive_counts


class _Counts(nnx.Module):
    """Adds a variable on its first call and counts its calls in it after (as ``nnx.jit``
    keeps what a call adds); ``drop``: deletes its BatchStat instead."""

    def __init__(self, drop: str = ""):
        self.linear, self.stat = nnx.Linear(5, 4, rngs=nnx.Rngs(0)), nnx.BatchStat(jnp.zeros(()))
        self.drop = drop

    def __call__(self, x):
        if self.drop:
            del self.stat
        elif hasattr(self, "calls"):
            self.calls[...] += 1
        else:
            self.calls = nnx.Intermediate(jnp.zeros(()))
        return self.linear(x)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_variable_an_nnx_call_adds_is_held_and_read_by_the_next_call_as_nnx_jit_does(compiled):
    h, want, x = sm.hybridize(_Counts()).hybridize(compiled), _Counts(), _x()
    h.lower(x)  # traced, not run: the held state keeps its structure
    assert "calls" not in h.state
    for _ in range(CALLS):
        chex.assert_trees_all_close(h(x), nnx.jit(lambda m, x: m(x))(want, x), **TOL)
    assert h.state["calls"] == want.calls[...] == CALLS - 1
    assert h.module.calls[...] == CALLS - 1 and h.trace_count <= 2  # one retrace: the new state


class _Adds(nnx.Module):
    """Holds ``Param`` s only, so its Hybrid carries no state; its call adds a variable."""

    def __init__(self):
        self.linear = nnx.Linear(5, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
        self.seen = nnx.Intermediate(x.sum())
        return self.linear(x)


@pytest.mark.parametrize("entry", ["compiled", "keyword", "eager", "apply"])
def test_a_variable_added_to_an_nnx_module_without_state_is_held_as_nnx_jit_keeps_it(entry):
    """It was refused ("the call added ['seen']") where nnx.jit keeps m.seen: the Hybrid turns
    stateful at the first call that adds one and carries it, as a stateful module's does."""
    h, want, x = sm.hybridize(_Adds()), _Adds(), _x()
    said = r"_Adds: the call added \['seen'\](.|\n)*Call its Hybrid once first, h\(x\)"
    with pytest.raises(sm.ConfigError, match=said):
        h.graph(x)  # a staging holds nothing: refused, the Hybrid left stateless
    run = {"compiled": h, "keyword": lambda x: h(x=x), "eager": h.eager,
           "apply": lambda x: h.apply(h.params, x)}[entry]  # fmt: skip
    for i in range(CALLS):
        got, expected = run(x + i), nnx.jit(lambda m, x: m(x))(want, x + i)
        if entry == "apply":  # (out, new_state), as h.apply of a stateful module returns
            got, state = got
            assert state["seen"] == want.seen[...]
        chex.assert_trees_all_close(got, expected, **TOL)
    assert h.stateful and h.trace_count <= (0 if entry == "eager" else 2)
    held = {} if entry == "apply" else {"seen": want.seen[...]}  # h.apply holds nothing
    chex.assert_trees_all_close(h.state, held)
    assert h.graph(x).primitive_counts["reduce_sum"] == 1  # staged now: the state is held


@pytest.mark.parametrize("entry", ["compiled", "keyword", "apply"])
def test_a_call_that_turns_stateful_runs_each_on_trace_callback_once_a_trace(entry):
    """The trace that failed as the call added a variable ran the callbacks (it is not
    logged), and so did its retrace: a user counting traces in a callback counted two."""
    h, x, seen = sm.hybridize(_Adds()), _x(), []
    h.on_trace(lambda *args, **kwargs: seen.append(h.trace_count))
    run = {"compiled": h, "keyword": lambda x: h(x=x),
           "apply": lambda x: h.apply(h.params, x)}[entry]  # fmt: skip
    for i in range(2):  # compiled: the second traces again, for the state the first added
        run(x + i)
        assert h.stateful and seen == list(range(h.trace_count))


class _AddsWhenAsked(_Adds):
    def __call__(self, x, keep=False):
        return super().__call__(x) if keep else self.linear(x)


@pytest.mark.parametrize("turn", ["compiled", "eager"])
def test_a_hybrid_that_turns_stateful_keeps_its_traces_and_its_max_traces(turn):
    """The call that turned it stateful started a fresh trace log: the earlier traces vanished
    from trace_count and trace_log, and max_traces counted again from 0."""
    h, x = sm.hybridize(_AddsWhenAsked(), max_traces=2), _x()
    h(x)  # trace #0, stateless
    (h if turn == "compiled" else h.eager)(x, keep=True)  # turns stateful; compiled: trace #1
    assert h.stateful and h.trace_count == len(h.trace_log) == (2 if turn == "compiled" else 1)
    assert h.trace_log[0].reason == "first call"
    if turn == "eager":
        h(x, keep=True)  # trace #1, of the state the eager call added
        assert h.trace_log[1].reason.endswith("grew: the last call added state['seen']")
    with pytest.raises(sm.RetraceError, match=r"trace #2 would exceed max_traces=2"):
        h(x[:2], keep=True)


class _AddsDoubled(_Adds):
    def __init__(self):
        super().__init__()
        self.double = False  # a setting (a bool attribute), read at each call

    def __call__(self, x):
        return super().__call__(x) * (2 if self.double else 1)


def test_a_snapshot_that_turns_stateful_keeps_the_mode_it_was_taken_in():
    """Turned stateful, it followed the module's settings changed after the snapshot."""
    module, x = _AddsDoubled(), _x()
    served = sm.hybridize(module).snapshot()  # what a Batcher serves
    module.double = True
    for _ in range(2):
        chex.assert_trees_all_close(served(x), _Adds()(x), **TOL)


def test_the_retrace_a_grown_state_causes_names_the_variables_the_call_added():
    """It was logged as "same signature traced again (a new jax.jit cache entry)"."""
    h, x = sm.hybridize(_Counts()), _x()
    h(x), h(x), h(x[:2])
    first, grown, shape = (e.reason for e in h.trace_log)
    assert first == "first call" and shape == "args[0].shape changed from (4, 5) to (2, 5)"
    assert grown == "the held state grew: the last call added state['calls']"


def test_a_call_that_removes_an_nnx_variable_is_refused_naming_the_pure_form():
    for run in (lambda h: h(_x()), lambda h: h.eager(_x())):
        with pytest.raises(sm.ConfigError, match=r"not remove or retype them(.|\n)*h\.apply"):
            run(sm.hybridize(_Counts(drop="stat")))


_WIDE = np.dtype(np.longdouble).itemsize > 8  # float128 here; float64 itself on some machines
_ODD = {  # a stranger's NumPy object -> how each door names it
    "void": (np.void(b"abc"), r"args\[1\] is a NumPy scalar, np\.void, of dtype \|V3"),
    "datetime64": (np.datetime64("2020-01-01"), r"scalar, np\.datetime64, of dtype datetime64"),
    "timedelta64": (np.timedelta64(5, "s"), r"scalar, np\.timedelta64, of dtype timedelta64"),
    "0-d void": (np.array(np.void(b"abc")), r"args\[1\] is a NumPy array of dtype \|V3"),
    "longdouble": (np.longdouble(1.5), r"np\.longdouble, of dtype float128.*widest float"),
    "clongdouble array": (np.ones(3, np.clongdouble), r"array of dtype complex256.*complex128"),
    "masked": (np.ma.array([1.0, 2.0, 3.0], mask=[0, 1, 0]), r"args\[1\] is a NumPy masked"),
    "np.str_": (np.str_("abc"), r"args\[1\] is a NumPy str_ \(np\.str_\('abc'\)\), not an array"),
    "matrix": (
        np.ones((1, 3)).view(np.matrix),  # (np.matrix(...) warns: not recommended)
        r"args\[1\] is a np\.matrix, whose \* is a matrix product",
    ),
    "0-d object": (np.array(object()), r"input args\[1\] is a NumPy array of dtype object"),
}


class _Frame:
    """A table (pandas-like) whose ``__array__`` raises: its columns mix types."""

    def __array__(self, dtype=None, copy=None):
        raise ValueError("cannot convert a frame of mixed columns")


class _Objects:
    """An object whose ``__array__`` gives an object array (a column of Python objects)."""

    def __array__(self, dtype=None, copy=None):
        return np.array([1.0, "a", None], dtype=object)


@dataclasses.dataclass
class _Config:
    rate: float = 0.5


class _Pair(NamedTuple):
    a: float
    b: float


_NOT_AN_INPUT = r"args\[1\] is of type {}, which a compiled call can neither trace"
_RAISED_ON = r"args\[1\] is a Python {}, not an array, and the model raised on it"
_ODD_PYTHON = {  # a researcher's Python object passed by mistake -> how each door names it
    "Decimal": (decimal.Decimal("1.5"), _NOT_AN_INPUT.format("Decimal")),
    "Fraction": (fractions.Fraction(3, 2), _NOT_AN_INPUT.format("Fraction")),
    "bytearray": (bytearray(b"abc"), _NOT_AN_INPUT.format("bytearray")),
    "memoryview": (memoryview(b"abc"), _NOT_AN_INPUT.format("memoryview")),
    "range": (range(3), _NOT_AN_INPUT.format("range")),
    "generator": ((v for v in (1.0, 2.0)), _NOT_AN_INPUT.format("generator")),
    "set": ({1.0, 2.0}, _NOT_AN_INPUT.format("set")),
    "dataclass": (_Config(), _NOT_AN_INPUT.format("_Config")),
    "__array__ raises": (_Frame(), _NOT_AN_INPUT.format("_Frame")),
    "__array__ objects": (_Objects(), _NOT_AN_INPUT.format("_Objects")),
    "2**70": (2**70, _RAISED_ON.format(r"int \(1180591620717411303424\)") + r" \(OverflowError"),
    "bytes": (b"abc", _RAISED_ON.format(r"bytes \(b'abc'\)")),
    "str": ("abc", _RAISED_ON.format(r"str \('abc'\)")),
    "namedtuple": (_Pair(1.0, 2.0), _RAISED_ON.format(r"_Pair \(_Pair\(a=1\.0, b=2\.0\)\)")),
    "ragged list": ([np.ones(2), np.ones(3)], r"args\[1\] is a Python list"),
}


@pytest.mark.parametrize("case", [*_ODD, *_ODD_PYTHON])
def test_odd_numpy_objects_are_named_at_every_door(case, tmp_path):
    """h(x, np.void(...)), a datetime64, a float128, h.apply(...) on them raised JAX's raw
    TypeError ('not a valid JAX type'); h.eager(x, masked) computed on the mask's hidden values
    (the compiled call refuses it); timeit(h, x, np.str_(...)) raised device_put's TypeError;
    h.eager(x, np.matrix(...)) computed x * p as a matrix product (h(...): elementwise).
    Each door names the input by path and its type, as for an array of str.

    A Python object too: h.eager(x, Decimal("1.5")) (a Fraction, a set, a range...) raised the
    model's raw TypeError where h(...) names it; export(h, example=(x, "abc")) and
    sm.stage(f)(x, "abc") the model's TypeError where h(x, "abc") names it; every door JAX's
    raw OverflowError for 2**70, and the model's TypeError for a namedtuple."""
    value, says = _ODD[case] if case in _ODD else _ODD_PYTHON[case]
    if "longdouble" in case and not _WIDE:
        pytest.skip("np.longdouble is float64 on this machine: an array JAX takes")
    h, x = sm.hybridize(lambda p, x, s: x * p * s, jnp.float32(2)), np.ones(3, np.float32)
    doors = {
        "h": lambda: h(x, value),
        "eager": lambda: h.eager(x, value),
        "apply": lambda: h.apply(h.params, x, value),
        "graph": lambda: h.graph(x, value),
        "stage": lambda: sm.stage(lambda x, s: x * s)(x, value),
        "timeit": lambda: sm.timeit(h, x, value, calls=1, repeats=1, warmup=1),
        "export": lambda: sm.export(h, tmp_path / "m", example=(x, value), batch=None),
    }
    error = sm.ConfigError if "neither trace" in says else sm.SignatureError
    for call in doors.values():
        with pytest.raises(error, match=says):
            call()


def test_a_tuple_or_dict_of_arrays_the_model_unpacks_keeps_the_models_own_type_error():
    """h(batch) of a tuple of arrays the model unpacks, whose arrays disagree in a shape (FSDP
    params exported unsharded: dot_general's contracting dimensions 16 and 64): every door
    named the tuple ('args[0] is a Python tuple ... not an array'), the wrong cause. The
    model's TypeError is its own; a tree it takes as an array ({'a': x} @ w) is still named."""
    h = sm.hybridize(lambda p, b: (b[0] @ b[1]) * p, jnp.float32(2))
    g = sm.hybridize(lambda p, b: (b["a"] @ b["b"]) * p, jnp.float32(2))
    x, y = jnp.ones((3, 16)), jnp.ones((4, 2))
    doors = [lambda: h((x, y)), lambda: h.eager((x, y)), lambda: h.apply(h.params, (x, y)),
             lambda: h.graph((x, y)), lambda: sm.stage(lambda b: b[0] @ b[1])((x, y)),
             lambda: g({"a": x, "b": y})]  # fmt: skip
    for call in doors:
        with pytest.raises(TypeError, match=r"^dot_general requires contracting") as e:
            call()
        assert not isinstance(e.value, sm.SymjaxError)
    with pytest.raises(sm.SignatureError, match=r"args\[0\] is a Python dict.*'dict'"):
        sm.hybridize(lambda p, b: b @ p, jnp.ones((16, 2)))({"a": x})


@pytest.mark.parametrize("option", ["rtol", "batches", "timeout"])
def test_verify_refuses_a_numpy_duration_for_a_number(option, tmp_path):
    """np.timedelta64 is a numbers.Integral to Python: verify(rtol=it) raised NumPy's
    UFuncTypeError, batches=(it,) int()'s TypeError: each is refused, before any work."""
    given = {option: np.timedelta64(5, "s") if option != "batches" else (np.timedelta64(5, "s"),)}
    with pytest.raises(sm.ConfigError, match=rf"^verify\({option}=.*np\.timedelta64\(5,'s'\)"):
        sm.verify(tmp_path, **given)


@pytest.mark.slow  # verify runs the artifact in a fresh Python process (~2 s)
def test_verify_takes_a_tolerance_of_any_real_number_type(tmp_path):
    """verify(rtol=Fraction(1, 10**5)) passed its check, then raised NumPy's TypeError
    ('isfinite' not supported) comparing the outputs: a Fraction, a np.float16 are floats."""
    import fractions

    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    art = sm.export(h, tmp_path / "m", example=np.ones((1, 3), np.float32))
    report = sm.verify(art.path, h, rtol=fractions.Fraction(1, 10**5), batches=(1,))
    assert report.ok and type(report.rtol) is float and report.rtol == 1e-5


@pytest.mark.parametrize("where", ["one device", "eight devices"])
def test_params_a_donating_jit_deleted_are_named_not_a_crash(where, tmp_path):
    """Equinox's and JAX's own training steps donate the model (filter_jit(donate="all"),
    donate_argnums=0). Given the arrays a Hybrid holds, h(x) of params on eight devices killed
    the process (SIGSEGV in jaxlib); on one, JAX's raw ValueError; h.eager and export a bare
    RuntimeError."""
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    if where == "eight devices":
        mesh = jax.make_mesh((8,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
        params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.P()))
    h, x = sm.hybridize(lambda p, x: x @ p["w"] + p["b"], params), np.ones((2, 4), np.float32)
    want = h(x)
    jax.jit(lambda p: jax.tree.map(lambda a: a + 1, p), donate_argnums=0)(params)
    says = r"params\['b'\] \(and 1 more\) were deleted: a jit that donates .*h.replace\(params="
    for run in (h, h.eager, lambda x: sm.export(h, tmp_path / "a", example=x)):
        with pytest.raises(sm.ConfigError, match=says):
            run(x)
    fresh = jax.device_put({"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}, h.params["w"].sharding)
    np.testing.assert_array_equal(h.apply(fresh, x), want)  # h.apply runs the params given
    again = h.replace(params=fresh)  # the fix it names
    np.testing.assert_array_equal(again(x), want)
