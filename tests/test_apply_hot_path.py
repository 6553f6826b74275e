"""The hot paths of ``h(x)``, ``h.apply`` and ``h.apply_with_state``: a call whose settings
(bools, strs, None) an earlier call gave, with arrays alone as inputs, reuses that call's static
entries instead of reading its keywords again (the partition, the nnx objects), an nnx module's
modes read at every call; ``h.apply`` walks the params it is given only where jit's C++ dispatch
does not serve the call (it then makes an entry for it), at every call once an entry took a
NumPy array among them (jit's C++ path reads a big-endian one's bytes as native ones) or once a
program C++ does not serve (one with effects) showed it. Every test runs the same calls on a
Hybrid whose hot path is switched off (the slow path, as before) and asserts the same outputs,
new state, errors and traces, bitwise; test-only probes count the slow path's reads and the
params' walks.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import LinenBatchNorm, LinenDropout, NnxBatchNorm, NnxDropout, NnxModes, rand

import symjax_mlp as sm
from symjax_mlp._hybrid import staged
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

#: in the default selection
FAST = ("linen BatchNorm, train=True", "nnx BatchNorm", "nnx Dropout, deterministic=False")


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
    assert reads.count(fast) == (1 if settings else 0)  # an nnx module's keywords too
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


class NnxKeyword(nnx.Module):
    """A BatchNorm switched by ``module.train()``/``eval()`` and a Dropout by a call keyword."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, deterministic: bool = True):
        x = nnx.relu(self.norm(self.dense(x)))
        return self.out(self.drop(x, deterministic=deterministic))


@pytest.fixture
def walks(monkeypatch):
    """``[caller, ...]``: each walk of the params given to ``h.apply`` (``check_given``)."""
    walked, check = [], staged.check_given
    monkeypatch.setattr(staged, "check_given", lambda c, p: walked.append(c) or check(c, p))
    return walked


def _nnx_pair():
    """Two Hybrids of two modules from the same seeds: ``fast``, and ``slow`` with no hot path
    for ``h(x)`` nor ``h.apply``; and their modules."""
    modules = [NnxKeyword(nnx.Rngs(0, dropout=1)) for _ in range(2)]
    fast, slow = (sm.hybridize(m) for m in modules)
    slow._set(_fast=False, _applied=None)
    return fast, slow, modules


@pytest.mark.slow
def test_an_nnx_module_called_with_keywords_answers_as_the_slow_path_and_reads_them_once(reads):
    fast, slow, modules = _nnx_pair()
    calls = [{"deterministic": False}] * 3 + [{"deterministic": True}, {}]
    for i, kw in enumerate(calls):  # train mode: the statistics and the rng count move
        x = rand(4, 5, seed=i)
        chex.assert_trees_all_equal(fast(x, **kw), slow(x, **kw))
        chex.assert_trees_all_equal(fast.state, slow.state)
    for m in modules:
        m.eval()  # the module's modes: read at every call, on the hot path too
    for kw in calls[2:]:
        chex.assert_trees_all_equal(fast(X, **kw), slow(X, **kw))
        chex.assert_trees_all_equal(fast.state, slow.state)
    chex.assert_trees_all_equal(
        fast.apply(fast.params, X, deterministic=False),
        slow.apply(slow.params, X, deterministic=False),
    )
    assert [e.reason for e in fast.trace_log] == [e.reason for e in slow.trace_log]
    assert fast.trace_count == 7  # (deterministic=False, True, none) x (train, eval), apply
    assert reads.count(slow) == 9
    assert reads.count(fast) == 3  # the first call of each keyword setting (and of apply's)


@pytest.mark.slow
def test_an_nnx_keyword_call_refused_or_read_on_the_slow_path_is_so_after_hot_calls(reads):
    fast, slow, _ = _nnx_pair()
    for h in (fast, slow):
        h(X, deterministic=False)
    big = np.asarray(X, dtype=">f4")  # jit's C++ path would read its bytes as native ones
    for args, kw in [((big,), {"deterministic": False}), ((X.tolist(),), {"deterministic": False}),
                     ((X,), {"deterministic": False, "nope": True})]:  # fmt: skip
        errors = []
        for h in (fast, slow):
            with pytest.raises(sm.SymjaxError) as error:
                h(*args, **kw)
            errors.append(str(error.value))
        assert errors[0] == errors[1]
    before = reads.count(fast)
    chex.assert_trees_all_equal(fast(X, deterministic=1), slow(X, deterministic=1))  # an int
    chex.assert_trees_all_equal(fast(X, False), slow(X, False))  # a setting by place
    chex.assert_trees_all_equal(fast.state, slow.state)
    assert reads.count(fast) == before + 2
    assert fast.trace_count == slow.trace_count


def _linen_pair():
    model = LinenBatchNorm()
    fast, slow = (sm.hybridize(model, model.init(jax.random.key(0), X)) for _ in range(2))
    slow._set(_applied=None)
    return fast, slow


def _kernel(params, value):
    params["params"]["Dense_0"]["kernel"] = value  # in place: the same dict, called again


@pytest.mark.slow
def test_h_apply_walks_the_params_where_jit_does_not_serve_the_call_and_names_a_big_endian_one(
    walks,
):
    fast, slow = _linen_pair()
    params = jax.tree.map(lambda a: a, fast.params)  # the caller's dicts, of the same arrays
    kernel = np.asarray(params["params"]["Dense_0"]["kernel"])
    for _ in range(4):
        chex.assert_trees_all_equal(
            fast.apply(params, X, train=True), slow.apply(params, X, train=True)
        )
    assert walks.count("LinenBatchNorm.apply") == 1 + 4  # fast's first call; every slow one
    _kernel(params, kernel)  # a NumPy array: a new entry of jit's, the params walked
    chex.assert_trees_all_equal(
        fast.apply(params, X, train=True), slow.apply(params, X, train=True)
    )
    _kernel(params, kernel.astype(">f4"))  # the same numbers, big-endian: served, [0., 0.]
    errors = []
    for h in (fast, slow):
        with pytest.raises(sm.SignatureError, match=r"params\['params'\]\['Dense_0'\]") as e:
            h.apply(params, X, train=True)
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    grads = [  # params traced: the slow path's walk, the same gradient
        jax.grad(lambda p, h=h: h.apply(p, X, train=True)[0].sum())(fast.params)
        for h in (fast, slow)
    ]
    chex.assert_trees_all_equal(grads[0], grads[1])
    assert fast.trace_count == slow.trace_count


@pytest.mark.slow
def test_h_apply_under_disable_jit_names_a_param_jit_cannot_take_as_the_slow_path(walks):
    fast, slow = _linen_pair()
    for h in (fast, slow):
        h.apply(h.params, X, train=True)  # its settings kept, an entry of jit's made
    errors = []
    for h in (fast, slow):
        params = jax.tree.map(lambda a: a, h.params)
        _kernel(params, "kernel")
        with jax.disable_jit(), pytest.raises(sm.ConfigError) as e:  # op by op: the model's
            h.apply(params, X, train=True)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "params['params']['Dense_0']['kernel'] is a str" in errors[0]


@pytest.mark.slow
def test_h_apply_under_disable_jit_runs_the_model_once_a_call():
    runs = []

    def model(p, x):
        runs.append(x.shape)  # op by op: the model's Python runs at every call, once
        return jnp.tanh(x * p["w"]).cumsum(axis=-1)

    h = sm.hybridize(model, {"w": jnp.float32(2)})
    h.apply(h.params, X)  # traced: an entry of jit's made
    runs.clear()
    with jax.disable_jit():
        for n in (2, 3, 4):  # new shapes: no op of them run before
            np.testing.assert_allclose(
                h.apply(h.params, X[:, :n]), model(h.params, X[:, :n]), rtol=1e-6
            )
    assert runs == [(4, 2), (4, 2), (4, 3), (4, 3), (4, 4), (4, 4)]  # (and model's own)


@pytest.mark.slow
def test_a_program_with_an_effect_runs_once_a_call_and_is_walked_without_an_attempt(
    walks, monkeypatch
):
    ran, tried, no_tracing = [], [], jax.no_tracing
    monkeypatch.setattr(jax, "no_tracing", lambda on: tried.append(on) or no_tracing(on))

    def model(p, x):
        jax.debug.callback(lambda: ran.append(1))  # an effect: jit's C++ path never serves it
        return x * p["w"]

    h, x = sm.hybridize(model, {"w": jnp.float32(2)}), jnp.asarray(X)  # (NumPy: not served)
    for i in range(4):
        np.testing.assert_array_equal(h.apply({"w": jnp.float32(i)}, x), X * i)
    assert len(ran) == 4 and h.trace_count == 1  # none run twice
    assert len(tried) == 3  # the first call (traced), then two not served: walked since
    assert len(walks) == 4


@pytest.mark.slow
def test_h_apply_without_settings_is_served_after_its_first_call_and_after_a_users_jit(walks):
    h, x = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.float32(2)}), jnp.ones(3)
    for _ in range(3):  # its first call given up (not served): jit's entry dropped, made anew
        np.testing.assert_array_equal(h.apply(h.params, x), 2 * x)
    assert len(walks) == 1
    np.testing.assert_array_equal(jax.jit(lambda y: h.apply(h.params, x) + y)(1.0), 3 * x)
    walked = len(walks)  # (a call inside a trace: never C++'s, walked)
    for _ in range(3):
        np.testing.assert_array_equal(h.apply(h.params, x), 2 * x)
    assert len(walks) == walked + 1  # the first (the entry dropped in the trace), then served
