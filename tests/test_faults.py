"""Faults: a model that raises a ``BaseException`` under the Batcher, and a program that fails
at run time (RESOURCE_EXHAUSTED) at load's self-test or at a call.

Every wait has a timeout: a regression fails by timeout, it never hangs the suite.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm
import symjax_mlp._runtimes.jax as jax_runtime

WAIT = 10  # seconds: a request that takes longer than this hangs


class Fatal(BaseException):
    """A BaseException of the user's own (not an Exception)."""


def rows(n: int, value: float = 1.0) -> np.ndarray:
    return np.full((n, 3), value, np.float32)


def raising(exc: BaseException):
    """A model that raises ``exc`` for a batch holding a row of 13s, else doubles its input."""

    def model(x):
        if (np.asarray(x) == 13).all(axis=1).any():
            raise exc
        return np.asarray(x) * 2

    return model


BASE_EXCEPTIONS = [SystemExit(3), KeyboardInterrupt(), Fatal("the model gave up")]


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS, ids=lambda e: type(e).__name__)
def test_a_base_exception_of_the_model_fails_its_batch_and_the_batcher_keeps_serving(exc):
    b = sm.serving.Batcher(raising(exc), example=rows(1), max_batch=4)
    try:
        bad = b.submit(rows(1, 13.0))  # run by the batcher's thread
        assert bad.exception(timeout=WAIT) is exc
        later = [b.submit(rows(2)) for _ in range(3)]
        for f in later:
            np.testing.assert_array_equal(f.result(timeout=WAIT), rows(2, 2.0))
        again = b.submit(rows(1, 13.0))
        assert again.exception(timeout=WAIT) is exc
        np.testing.assert_array_equal(b.submit(rows(1)).result(timeout=WAIT), rows(1, 2.0))
        np.testing.assert_array_equal(b(rows(1)), rows(1, 2.0))
    finally:
        b.close(cancel=True, timeout=WAIT)
    assert not b._thread.is_alive()
    stats = b.stats
    assert stats.failed == 2 and stats.completed >= 4


def test_close_after_a_base_exception_leaves_no_future_pending():
    gate = concurrent.futures.Future()

    def model(x):
        if (np.asarray(x) == 13).all(axis=1).any():
            gate.result(timeout=WAIT)  # the queue fills behind this batch
            raise SystemExit(1)
        return np.asarray(x) * 2

    b = sm.serving.Batcher(model, example=rows(1), max_batch=1)
    bad = b.submit(rows(1, 13.0))
    queued = [b.submit(rows(1)) for _ in range(5)]
    gate.set_result(None)
    b.close(timeout=WAIT)  # finishes the queue, then the thread ends
    assert isinstance(bad.exception(timeout=0), SystemExit)
    assert all(f.done() for f in queued), "close() returned with futures pending"
    for f in queued:
        np.testing.assert_array_equal(f.result(timeout=0), rows(1, 2.0))


def test_blocking_calls_queued_behind_a_base_exception_get_it_or_their_result():
    gate = concurrent.futures.Future()

    def model(x):
        x = np.asarray(x)
        if (x == 7).all(axis=1).any():
            gate.result(timeout=WAIT)  # holds the lane: the next calls queue up
        if (x == 13).all(axis=1).any():
            raise Fatal("no")
        return x * 2

    b = sm.serving.Batcher(model, example=rows(1), max_batch=1)
    pool = concurrent.futures.ThreadPoolExecutor(6)
    try:
        with pytest.raises(Fatal):  # a lone call: it runs on this thread
            b(rows(1, 13.0))
        held = b.submit(rows(1, 7.0))
        values = [13.0, 1.0, 13.0, 1.0, 1.0]
        calls = [pool.submit(_outcome, b, v) for v in values]
        gate.set_result(None)
        held.result(timeout=WAIT)
        for value, call in zip(values, calls, strict=True):
            kind, _ = call.result(timeout=2 * WAIT)
            assert kind == ("raised" if value == 13.0 else "ok")
        np.testing.assert_array_equal(b(rows(1)), rows(1, 2.0))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        b.close(cancel=True, timeout=WAIT)


def _outcome(b, value):
    try:
        return "ok", b.run(rows(1, value), timeout=WAIT)
    except Fatal as e:
        return "raised", e
    except TimeoutError as e:
        return "timed out", e


def test_asubmit_gets_a_base_exception_of_the_model_lone_and_batched():
    exc = Fatal("the model gave up")
    b = sm.serving.Batcher(raising(exc), example=rows(1), max_batch=4)

    async def one(value):
        try:
            return await asyncio.wait_for(b.asubmit(rows(1, value)), WAIT)
        except Fatal as e:
            return e

    async def clients():
        lone = await one(13.0)  # alone in its pass: it runs on the loop
        batched = await asyncio.gather(*(one(v) for v in [13.0, 1.0, 13.0]))
        after = await one(1.0)
        return lone, batched, after

    try:
        lone, batched, after = asyncio.run(clients())
        assert lone is exc
        assert batched[0] is exc and batched[2] is exc
        np.testing.assert_array_equal(after, rows(1, 2.0))
    finally:
        b.close(cancel=True, timeout=WAIT)


def test_a_done_callback_raising_a_base_exception_does_not_end_the_batcher():
    gate = concurrent.futures.Future()

    def model(x):
        if (np.asarray(x) == 7).all(axis=1).any():
            gate.result(timeout=WAIT)  # holds the lane: the next requests queue up
        return np.asarray(x) * 2

    def callback(f):
        raise Fatal("a callback gave up")

    b = sm.serving.Batcher(model, example=rows(1), max_batch=1)
    try:
        held = b.submit(rows(1, 7.0))
        queued = [b.submit(rows(1)) for _ in range(3)]
        for f in queued:
            f.add_done_callback(callback)  # not done yet: runs on the batcher's thread
        gate.set_result(None)
        held.result(timeout=WAIT)
        for f in [*queued, b.submit(rows(1))]:
            np.testing.assert_array_equal(f.result(timeout=WAIT), rows(1, 2.0))
    finally:
        b.close(cancel=True, timeout=WAIT)
    assert not b._thread.is_alive()


# -- a program that fails at run time (item 3) -------------------------------------------------
OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4096 bytes."


class Deferred:
    """A result whose program failed after the call returned: reading it raises, as a
    ``jax.Array`` of an asynchronously dispatched program does."""

    def __init__(self, error):
        self.error = error

    def __array__(self, dtype=None, copy=None):
        raise self.error


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    net, x = sm.mlp((4, 2)), jnp.ones((1, 3))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    return sm.export(h, tmp_path_factory.mktemp("faults") / "m", example=x).path


def failing_runner(monkeypatch, deferred: bool):
    """Makes the JAX runtime's programs fail at run time: at the call, or when read."""
    real = jax_runtime.runner
    error = jax.errors.JaxRuntimeError(OOM)

    @functools.wraps(real)
    def runner(*args, **kwargs):
        _, weights = real(*args, **kwargs)

        def run(inputs):
            if deferred:
                return [Deferred(error)]
            raise error

        return run, weights

    monkeypatch.setattr(jax_runtime, "runner", runner)
    return error


@pytest.mark.parametrize("deferred", [False, True], ids=["at-the-call", "when-read"])
def test_a_run_time_failure_at_the_self_test_is_an_artifact_error_naming_it(
    artifact, monkeypatch, deferred
):
    error = failing_runner(monkeypatch, deferred)
    with pytest.raises(sm.ArtifactError) as info:
        sm.load(artifact)
    text = str(info.value)
    assert text.startswith(f'symjax_mlp.load("{artifact}"): its program ran out of memory')
    assert "self-test" in text and "RESOURCE_EXHAUSTED" in text and "fewer rows" in text
    assert "corrupted" not in text  # the files are fine: the device is not
    assert info.value.__cause__ is error


def test_a_run_time_failure_at_a_call_is_a_symjax_error_naming_it(artifact):
    m = sm.load(artifact)
    error = jax.errors.JaxRuntimeError(OOM)

    def run(inputs):
        raise error

    m._run = run  # the program, as the runtime prepared it, fails as it is called
    x = np.ones((5, 3), np.float32)
    with pytest.raises(sm.SymjaxError) as info:
        m(x)
    assert isinstance(info.value, sm.ArtifactError)
    text = str(info.value)
    assert text.startswith(f'symjax_mlp.load("{artifact}"): its program ran out of memory')
    assert "RESOURCE_EXHAUSTED" in text and "float32[5, 3]" in text and "fewer rows" in text
    assert "corrupted" not in text
    assert info.value.__cause__ is error


def test_a_repeated_call_runs_the_program_straight_and_still_names_a_failure(artifact, monkeypatch):
    """A call of arrays of a (shape, dtype) that ran before goes to the program itself (no
    checks again): a failure there is the same ArtifactError, and other inputs are checked."""
    error, real = jax.errors.JaxRuntimeError(OOM), jax_runtime.runner

    def runner(*args, **kwargs):
        run, weights = real(*args, **kwargs)

        def program(*inputs):  # what the repeated call runs: it fails
            raise error

        run.direct = program, run.direct[1]
        return run, weights

    monkeypatch.setattr(jax_runtime, "runner", runner)
    # (rows its self-test did not use: load's self-test calls it as a user does)
    m, x = sm.load(artifact), np.ones((13, 3), np.float32)
    first = m(x)  # checked, through the runtime's own call
    assert first.shape[0] == 13
    with pytest.raises(sm.ArtifactError) as info:
        m(x)
    assert str(info.value).startswith(f'symjax_mlp.load("{artifact}"): its program ran out')
    assert "float32[13, 3]" in str(info.value) and info.value.__cause__ is error
    with pytest.raises(sm.SignatureError, match="float64"):
        m(x.astype(np.float64))
    assert m(x[:11]).shape[0] == 11  # another shape: checked and run as a first call


# The real thing: XLA out of memory under RLIMIT_AS, in a child process. On CPU the program
# fails at the call when XLA runs it inline (a cheap one: broadcasts, copies), else when its
# result is read; and jaxlib's (0.10.2) np.asarray of a result it could not allocate aborts the
# process (SIGABRT, "Check failed: buffer_.IsConcrete()"): only block_until_ready raises. The
# limit is on address space, and glibc's arenas reserve 64 MiB each: the results are larger.
_UNDER_A_LIMIT = """
import json, resource, sys
import jax, numpy as np
import symjax_mlp as sm

def limited(headroom_mib):  # what is mapped now, and this much more
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (headroom_mib << 20), HARD))

def caught(f):
    try:
        f()
        return {"raised": None}
    except Exception as e:
        cause = e.__cause__
        return {"raised": type(e).__name__, "symjax": isinstance(e, sm.SymjaxError), "text": str(e),
                "cause": None if cause is None else type(cause).__name__}

HARD, said = resource.getrlimit(resource.RLIMIT_AS)[1], {}
costly_static, cheap_static, cheap, costly = sys.argv[1:5]
x = np.ones((N, 1), np.float32)
for name, art in (("self-test", costly_static), ("cheap self-test", cheap_static),
                  ("cheap call", cheap), ("costly call", costly)):
    m = sm.load(art, self_test="self-test" not in name)
    kept = m(x).block_until_ready()  # compiled and checked, its (N, N) result held
    limited(200 if "self-test" in name else 30)  # room for the self-test's vectors (in and
    # out, 137 MiB), not for another (N, N) result
    if "self-test" in name:
        said[name] = caught(lambda: sm.load(art))
    elif name == "cheap call":
        said[name] = caught(lambda: m(x))
    else:
        y = m(x)  # returns: the program runs after
        said[name] = caught(lambda: jax.block_until_ready(y))
    resource.setrlimit(resource.RLIMIT_AS, (HARD, HARD))
    del kept, m
print(json.dumps(said))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or jax.default_backend() != "cpu",
    reason="XLA's CPU client under RLIMIT_AS, read from /proc/self/status (Linux)",
)
@pytest.mark.slow  # processes under RLIMIT_AS (~5-12 s): CI runs it with `-m slow`
def test_out_of_memory_for_real_at_the_self_test_at_a_call_and_when_read(tmp_path):
    """Under RLIMIT_AS, XLA's RESOURCE_EXHAUSTED: at load's self-test (its results not yet
    allocated when the call returns) an ArtifactError naming it, never the process aborted
    by np.asarray of the failed results; at a call XLA runs inline an ArtifactError naming
    it (jaxlib raises a ValueError there); where the program runs after the call returns, a
    JaxRuntimeError from jax.block_until_ready, as LoadedModel documents."""
    n = 6_000  # a (6000, 6000) float32 result: 137 MiB
    x = np.ones((n, 1), np.float32)

    def export(f, name, **kw):
        return str(sm.export(sm.hybridize(f, {}), tmp_path / name, example=x, **kw).path)

    costly_static = export(lambda _, x: jnp.broadcast_to(x, (n, n)) * x.T, "s1", batch=None)
    cheap_static = export(lambda _, x: jnp.broadcast_to(x, (n, n)), "s2", batch=None)
    cheap = export(lambda _, x: jnp.broadcast_to(x, (x.shape[0], x.shape[0])), "cheap")
    costly = export(lambda _, x: jnp.broadcast_to(x, (x.shape[0], x.shape[0])) * x.T, "costly")
    code = f"N = {n}\n" + textwrap.dedent(_UNDER_A_LIMIT)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    arts = [costly_static, cheap_static, cheap, costly]
    done = subprocess.run([sys.executable, "-c", code, *arts], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]  # -6: SIGABRT
    said = json.loads(done.stdout.splitlines()[-1])
    oom = "RESOURCE_EXHAUSTED: Out of memory allocating 144000000 bytes"
    for name, art, cause in (("self-test", costly_static, "JaxRuntimeError"),
                             ("cheap self-test", cheap_static, "ValueError")):  # fmt: skip
        at_load = said[name]
        assert at_load["raised"] == "ArtifactError" and at_load["cause"] == cause, said
        assert at_load["text"].startswith(
            f'symjax_mlp.load("{art}"): its program ran out of memory on its self-test vectors, '
            "at load"
        )
        assert oom in at_load["text"] and "float32[6000, 1]: call it on fewer" in at_load["text"]
    at_call = said["cheap call"]
    assert at_call["raised"] == "ArtifactError" and at_call["symjax"], at_call
    assert at_call["text"].startswith(f'symjax_mlp.load("{cheap}"): its program ran out of memory')
    assert oom in at_call["text"] and "float32[6000, 1]: call it on fewer rows" in at_call["text"]
    assert said["costly call"] == {"raised": "JaxRuntimeError", "symjax": False, "cause": None,
                                   "text": f"{oom}."}  # fmt: skip


def test_numpy_out_of_memory_comparing_the_self_test_is_an_artifact_error(tmp_path, monkeypatch):
    """The self-test compares the outputs in float64 (twice their bytes): NumPy's MemoryError
    there is an ArtifactError saying so, not a MemoryError out of load."""
    from symjax_mlp import _selftest

    art = sm.chapter.export_mlp(tmp_path / "mlp")

    def no_memory(got, want, *tolerance):
        raise MemoryError("Unable to allocate 1.07 GiB for an array")

    monkeypatch.setattr(_selftest, "difference", no_memory)
    with pytest.raises(sm.ArtifactError, match="ran out of memory reading or comparing") as e:
        sm.load(art.path)
    assert "1.07 GiB" in str(e.value) and "self_test=False" in str(e.value)
    assert isinstance(e.value.__cause__, MemoryError)
    sm.load(art.path, self_test=False)  # the fix it names
