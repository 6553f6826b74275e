"""Threads: racing first calls of a Hybrid and of a LoadedModel, loads racing each other, and
an export while another thread calls the model.

``tests/test_hybrid.py`` races eight first calls of one signature; here several signatures
race at once, and the artifact side (load, call, export) is raced too.
"""

import threading

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LinenBatchNorm, rand, small

import symjax_mlp as sm

THREADS = 8
# Four signatures: three batch sizes, and one other dtype.
INPUTS = [rand(1), rand(3, seed=1), rand(64, seed=2), rand(3, seed=3).astype(jnp.bfloat16)]


def race(work, n=THREADS):
    """Runs ``work(i)`` in ``n`` threads released together; returns results, re-raises errors."""
    barrier = threading.Barrier(n)
    results, errors = [None] * n, []

    def run(i):
        barrier.wait()
        try:
            results[i] = work(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def rotated(i):
    """Thread i's order of the signatures: every signature is some thread's first call."""
    return [(i + k) % len(INPUTS) for k in range(len(INPUTS))]


def test_racing_first_calls_of_several_signatures_trace_once_each():
    h, _ = small()

    def work(i):
        return {k: np.asarray(h(INPUTS[k])) for k in rotated(i)}

    results = race(work)
    assert h.trace_count == len(INPUTS), [str(e) for e in h.trace_log]
    signatures = [e.signature for e in h.trace_log]
    assert len(set(signatures)) == len(INPUTS)  # one trace per signature, none twice
    for k, x in enumerate(INPUTS):
        for r in results:
            np.testing.assert_array_equal(r[k], results[0][k])  # identical in every thread
        want = np.asarray(h.eager(x), np.float32)
        tol = 1e-2 if x.dtype == jnp.bfloat16 else 1e-6
        np.testing.assert_allclose(np.asarray(results[0][k], np.float32), want, rtol=tol, atol=tol)


def test_racing_loads_and_first_calls_of_one_artifact(tmp_path):
    h, x = small(seed=4)
    sm.export(h, tmp_path / "m", example=x)
    float_inputs = INPUTS[:3]
    want = [np.asarray(h(x)) for x in float_inputs]
    shared = sm.load(tmp_path / "m")

    def work(i):
        own = sm.load(tmp_path / "m")  # eight loads race too (one module cache, shared)
        order = [k % len(float_inputs) for k in rotated(i)]
        return [(k, np.asarray(m(float_inputs[k]))) for k in order for m in (shared, own)]

    for result in race(work):
        for k, y in result:
            np.testing.assert_array_equal(y, want[k])


@pytest.mark.slow  # processes racing (~5-12 s): CI runs it with `-m slow`
def test_loads_racing_a_replacing_export_see_the_old_or_the_new_artifact(tmp_path):
    """An export swaps a new directory in; a load that read the old manifest and then a new
    file once reported the artifact corrupted (10 of 367 loads). Now it reads the new one."""
    (h1, x), (h2, _) = small(seed=1), small(seed=2)
    sm.export(h1, tmp_path / "m", example=x)
    want = {np.asarray(h(x)).tobytes() for h in (h1, h2)}
    done, seen, errors = threading.Event(), [], []

    def keep_loading(i):
        while not done.is_set() or len(seen) < 100:
            seen.append(np.asarray(sm.load(tmp_path / "m")(x)).tobytes())

    def readers():
        try:
            race(keep_loading, 3)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=readers)
    thread.start()
    try:
        for i in range(20):
            sm.export((h2, h1)[i % 2], tmp_path / "m", example=x, overwrite=True)
    finally:
        done.set()
        thread.join()
    assert not errors, errors
    assert len(seen) >= 100 and set(seen) == want


def test_export_while_another_thread_calls_the_model(tmp_path):
    h, x = small(seed=5)
    want = np.asarray(h(x))
    done, calls, errors = threading.Event(), [], []

    def keep_calling():
        try:
            while not done.is_set() or len(calls) < 20:
                calls.append(np.asarray(h(x)))
        except BaseException as e:
            errors.append(e)

    caller = threading.Thread(target=keep_calling)
    caller.start()
    try:
        for i in range(3):  # export (and replace) while the model is being called
            before = len(calls)
            art = sm.export(h, tmp_path / "m", example=x, overwrite=i > 0)
            assert len(calls) > before  # the calls went on during the export
            np.testing.assert_array_equal(sm.load(art.path)(x), want)
    finally:
        done.set()
        caller.join()
    assert not errors, errors
    assert len(calls) >= 20 and all(np.array_equal(c, want) for c in calls)
    assert h.trace_count == 1  # exporting traces the function, not the Hybrid's cache
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_apply_of_a_donating_hybrid_races_its_stateful_calls():
    # h.apply starts from the held state, which a donating call in another thread consumes:
    # apply runs on a copy ("Array has been deleted" before), and no call's update is lost
    import flax.linen as nn
    import jax

    class Counter(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            n = self.variable("counter", "n", lambda: jnp.zeros((), jnp.int32))
            if train:
                n.value = n.value + 1
            return nn.Dense(2)(x) + n.value

    model, x = Counter(), rand(2, features=3)
    variables = model.init(jax.random.key(0), x)
    h = sm.hybridize(model, variables, donate=True)
    want = np.asarray(model.apply(variables, x))

    def work(i):
        seen = []
        for _ in range(30):
            seen.append(float(np.asarray(h(x, train=True))[0, 0] - want[0, 0]))
            out, _ = h.apply(h.params, x)
            assert np.asarray(out)[0, 0] - want[0, 0] >= seen[-1] - 1e-4
        return seen

    seen = sorted(round(v) for r in race(work) for v in r)
    assert seen == list(range(1, THREADS * 30 + 1))  # each call saw its own count
    assert int(h.state["counter"]["n"]) == THREADS * 30


def test_racing_first_calls_of_a_stateful_hybrid_trace_once_each_and_lose_no_update():
    x = rand(2, 5)
    inputs = (x, jnp.concatenate([x, x]))  # two signatures, one batch statistic: any order
    module = LinenBatchNorm()
    variables = module.init(jax.random.key(0), x)
    h, one_by_one = (sm.hybridize(module, variables, max_traces=2) for _ in range(2))
    seen = []
    h.on_trace(lambda x, **kw: seen.append(h.state))  # runs outside the state's lock

    def work(i):
        for k in rotated(i)[:2]:  # each signature some thread's first call
            h(inputs[k % 2], train=True)

    race(work)  # before: a trace per racing thread, past max_traces
    assert h.trace_count == 2 and len(seen) == 2, [str(e) for e in h.trace_log]
    for i in range(THREADS):
        for k in rotated(i)[:2]:
            one_by_one(inputs[k % 2], train=True)
    chex.assert_trees_all_close(h.state, one_by_one.state, rtol=1e-5, atol=1e-6)


def test_racing_first_calls_of_a_stateful_hybrid_keep_its_trace_budget():
    module = LinenBatchNorm()
    variables = module.init(jax.random.key(0), rand(2, 5))
    for _ in range(3):  # a race: each round may show it
        h = sm.hybridize(module, variables, max_traces=2)

        def work(i, h=h):  # eight signatures racing: two trace, six are refused
            try:
                return h(rand(i + 1, 5), train=True).shape
            except sm.RetraceError as error:
                return str(error)

        said = race(work)
        assert h.trace_count == 2, [str(e) for e in h.trace_log]  # before: up to 8
        assert sum("would exceed max_traces=2" in str(s) for s in said) == THREADS - 2
