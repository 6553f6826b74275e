"""``h.apply`` and ``h.apply_with_state`` on the hot path: a call whose settings (bools, strs,
None) an earlier call gave, with arrays alone as inputs, reuses that call's static entries
instead of reading its keywords again (the partition, the nnx objects). Every test runs the same
calls on a Hybrid whose hot path is switched off (the slow path, as before) and asserts the same
outputs and the same new state, bitwise; a test-only probe counts the slow path's reads.
"""

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from helpers import LinenBatchNorm, LinenDropout, NnxBatchNorm, NnxDropout, NnxModes, rand

import symjax_mlp as sm
from symjax_mlp._hybrid.staged import Staged

X = rand(4, 5)


@pytest.fixture
def reads(monkeypatch):
    """``[h, ...]``: the Hybrid of each call that read its keywords (the slow path)."""
    read, partition = [], Staged._partition
    monkeypatch.setattr(
        Staged, "_partition", lambda h, *a, **k: read.append(h) or partition(h, *a, **k)
    )
    return read


def _linen(model, **kw):
    return sm.hybridize(model, model.init(jax.random.key(0), X), **kw)


def _nnx(kind):
    return sm.hybridize(kind(nnx.Rngs(0, dropout=1)))


def _pair(make):
    """Two Hybrids of the same model and seeds: ``fast``, and ``slow`` with no hot path."""
    fast, slow = make(), make()
    slow._set(_applied=None)  # what h.apply did before: every call read as the first
    return fast, slow


MODELS = {
    "linen BatchNorm, train=True": (lambda: _linen(LinenBatchNorm()), {"train": True}),
    "linen Dropout, deterministic=False": (
        lambda: _linen(LinenDropout(), rngs=1),  # its rng streams held
        {"deterministic": False},
    ),
    "nnx BatchNorm": (lambda: _nnx(NnxBatchNorm), {}),
    "nnx BatchNorm and Dropout, rngs": (lambda: _nnx(NnxModes), {}),
    "nnx Dropout, deterministic=False": (lambda: _nnx(NnxDropout), {"deterministic": False}),
}

FAST = ("linen BatchNorm, train=True", "nnx BatchNorm")  # in the default selection


@pytest.mark.parametrize(
    "name",
    [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in MODELS],
)
def test_h_apply_with_settings_seen_answers_as_the_slow_path_and_reads_them_once(name, reads):
    make, settings = MODELS[name]
    fast, slow = _pair(make)
    states = [fast.state, slow.state]
    for i in range(4):  # the state carried by the caller, then h.apply from the held one
        x = rand(4, 5, seed=i)
        got = [
            h.apply_with_state(h.params, s, x, **settings)
            for h, s in zip((fast, slow), states, strict=True)
        ]
        chex.assert_trees_all_equal(got[0], got[1])
        states = [g[1] for g in got]
        chex.assert_trees_all_equal(
            fast.apply(fast.params, x, **settings), slow.apply(slow.params, x, **settings)
        )
    assert reads.count(slow) == 8  # every call
    nnx_settings = settings and name.startswith("nnx")  # read at every call, as by h(x)
    assert reads.count(fast) == (8 if nnx_settings else 1 if settings else 0)
    assert fast.trace_count == slow.trace_count == 1


@pytest.mark.slow
def test_a_setting_changing_between_calls_keys_its_own_entries(reads):
    fast, slow = _pair(lambda: _linen(LinenBatchNorm()))
    for train in (True, False, True, False, None, "no"):  # None and a str: keyed as bools are
        kw = {} if train == "no" else {"train": train}
        got = [h.apply(h.params, X, **kw) for h in (fast, slow)]
        chex.assert_trees_all_equal(got[0], got[1])
    want = LinenBatchNorm().apply(
        fast.variables["params"] | fast.state, X, train=True, mutable=["batch_stats"]
    )
    chex.assert_trees_all_close(fast.apply(fast.params, X, train=True), want)
    assert reads.count(fast) == 3  # train=True, train=False, train=None: once each


@pytest.mark.slow
def test_a_setting_by_place_an_int_or_a_non_array_input_is_read_at_every_call(reads):
    fast, slow = _pair(lambda: _linen(LinenDropout()))  # stateless: h.apply gives out alone
    big = np.asarray(X, dtype=">f4")  # jit's C++ path would read its bytes as native ones
    fast.apply(fast.params, X, deterministic=True)  # the settings kept
    for args, kw in [((X, True), {}), ((X, True), {}), ((X,), {"deterministic": 1})]:
        chex.assert_trees_all_equal(*(h.apply(h.params, *args, **kw) for h in (fast, slow)))
    for bad in (big, X.tolist()):  # refused as on the slow path, in its words
        errors = []
        for h in (fast, slow):
            with pytest.raises(sm.SymjaxError) as error:
                h.apply(h.params, bad, deterministic=True)
            errors.append(str(error.value))
        assert errors[0] == errors[1] and "args[0]" in errors[0]
    assert reads.count(fast) == 1 + 3 + 2  # the first call, then each of these
    chex.assert_trees_all_equal(
        fast.apply(fast.params, X, deterministic=True),
        slow.apply(slow.params, X, deterministic=True),
    )
    assert reads.count(fast) == 6


@pytest.mark.slow
def test_an_nnx_module_switched_to_eval_after_hot_calls_is_applied_in_eval_mode(reads):
    model = NnxModes(nnx.Rngs(0, dropout=1))
    fast, slow = _pair(lambda: sm.hybridize(model))
    trained = [h.apply(h.params, X) for h in (fast, slow)]
    model.eval()  # the module's settings: read at every call, on the hot path too
    got = [h.apply(h.params, X) for h in (fast, slow)]
    chex.assert_trees_all_equal(got[0], got[1])
    chex.assert_trees_all_equal(trained[0], trained[1])
    assert not np.array_equal(got[0][0], trained[0][0])  # eval mode: another answer
    chex.assert_trees_all_equal(got[0][1], fast.state)  # in eval mode the state stays
    assert reads.count(fast) == 0 and fast.trace_count == 2
