"""Serving: the micro-batcher, the latency mode, the HTTP server and the serving benchmark.

Behaviour only (what runs where, which rows come back, what is refused), never speed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import json
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ZOO, NnxModes, keyless, zoo_artifact

import symjax_mlp as sm
from symjax_mlp.serving._model import refuse_outputs

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Gated:
    """A model whose calls wait for ``open``: holds the lane busy while requests queue up."""

    def __init__(self, fn):
        self.fn = fn
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.threads: list[int] = []
        self.sizes: list[int] = []

    def __call__(self, *xs):
        self.threads.append(threading.get_ident())
        self.entered.set()
        assert self.open.wait(30), "the test never opened the gate"
        self.sizes.append(xs[0].shape[0])
        return self.fn(*xs)

    def hold(self):
        self.open.clear()
        self.entered.clear()

    def busy(self, b, x):
        """Holds the gate and submits ``x`` to ``b``: returns its future once it runs (in the
        model, the lane busy), so that what is submitted next queues up."""
        self.hold()
        first = b.submit(x)
        assert self.entered.wait(30)
        return first


@contextlib.contextmanager
def no_compiles():
    """Collects the XLA compilations that happen inside the block."""
    seen: list[str] = []

    def listen(event, duration_secs, **kwargs):
        if event == COMPILE_EVENT:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _run_clients(client, n, *, timeout):
    """Runs ``client(j)`` for j in 0..n-1, each on its own thread, and waits for them."""
    threads = [threading.Thread(target=client, args=(j,)) for j in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def rows(n, features=512, seed=0):
    return np.random.default_rng(seed).standard_normal((n, features), np.float32)


def refusing_nan(h):
    """``h``, raising for a batch with a NaN in it (a model error for one request's batch)."""

    def picky(xs):
        if np.isnan(xs).any():
            raise FloatingPointError("a NaN row")
        return h(xs)

    return picky


def nan_row():
    x = rows(1)
    x[0, 0] = np.nan
    return x


def busy_then_queue(b, gate, first, queued):
    """Runs ``first`` (held in the model), queues ``queued`` behind it, then opens the gate."""
    f0 = gate.busy(b, first)
    futures = [b.submit(x) for x in queued]
    assert b.stats.queue_depth == len(queued)
    gate.open.set()
    return f0, futures


# -- the batcher -------------------------------------------------------------------------------
def test_a_lone_request_runs_at_once_on_the_calling_thread(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=8) as b:
        gate.threads.clear()
        y = b(rows(1))
        assert gate.threads == [threading.get_ident()]  # no hand-off to another thread
        np.testing.assert_allclose(y, np.asarray(h(rows(1))), rtol=1e-6)
        f = b.submit(rows(1))
        assert isinstance(f, concurrent.futures.Future)
        f.result(30)
        assert gate.threads[-1] != threading.get_ident()  # submit hands it to the thread
        s = b.stats
        assert (s.requests, s.completed, s.batches, s.rows) == (2, 2, 2, 2)
        assert f.timing.batch_requests == 1 and f.timing.bucket == 1
        assert f.timing.queued >= 0 and f.timing.compute > 0 and f.timing.total >= f.timing.compute


def test_requests_arriving_while_busy_are_merged_into_the_next_batch(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=8) as b:
        gate.sizes.clear()
        queued = [rows(n, seed=n) for n in (1, 2, 3, 1)]  # 7 rows: one batch at bucket 8
        f0, futures = busy_then_queue(b, gate, rows(1), queued)
        results = [f.result(30) for f in futures]
        f0.result(30)
        assert gate.sizes == [1, 8]  # the first alone, the four others merged and padded
        for f, q, y in zip(futures, queued, results, strict=True):
            assert y.shape == (q.shape[0], 2)  # padding rows never come back
            t = f.timing
            assert (t.batch_requests, t.batch_rows, t.bucket, t.rows) == (4, 7, 8, q.shape[0])
        assert b.stats.padded_rows == 1
        assert b.stats.batches_by_bucket[8] == 1


def test_batched_rows_equal_the_same_rows_run_alone(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=8) as b:
        queued = [rows(n, seed=10 + n) for n in (2, 1, 3)]
        f0, futures = busy_then_queue(b, gate, rows(1, seed=1), queued)
        results = [f.result(30) for f in futures]
        f0.result(30)
    offset = 0
    for q, y in zip(queued, results, strict=True):
        alone = np.asarray(h(q))  # its own batch size: XLA may pick another kernel
        np.testing.assert_allclose(y, alone, rtol=1e-5, atol=1e-6)
        same_bucket = np.zeros((8, 512), np.float32)  # the same program, the rows in place
        same_bucket[offset : offset + len(q)] = q
        want = np.asarray(h(same_bucket))[offset : offset + len(q)]
        np.testing.assert_array_equal(y, want)  # bit for bit
        offset += len(q)


def test_results_are_the_requests_own_arrays(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=4) as b:
        f0, futures = busy_then_queue(b, gate, rows(1), [rows(1, seed=2), rows(2, seed=3)])
        a, c = (f.result(30) for f in futures)
        f0.result(30)
    assert a.flags.writeable and c.flags.writeable
    assert not np.shares_memory(a, c)  # no view into the padded batch
    assert a.base is None and c.base is None
    with sm.serving.Batcher(h, example=x, max_batch=4) as b:  # a lone call: one copy, its own
        lone = [b(rows(1)), b(rows(3))]
    assert all(y.flags.writeable and y.base is None for y in lone)
    with sm.serving.Batcher(gate, example=x, max_batch=4) as b:  # one row each: 3, padded to 4
        f0, futures = busy_then_queue(b, gate, rows(1), [rows(1, seed=s) for s in (2, 3, 4)])
        ones = [f.result(30) for f in futures]
        f0.result(30)
    for i, y in enumerate(ones):  # views of one copy of the real rows: disjoint, writable
        assert y.shape == (1, 2) and y.flags.writeable and len(y.base) == 3
        assert not any(np.shares_memory(y, z) for z in ones[i + 1 :])
    ones[0][...] = 7
    assert (ones[1] != 7).all()


def test_nothing_compiles_while_serving(chapter):
    _, _, h, x = chapter
    before = h.trace_count
    with sm.serving.Batcher(h, example=x, max_batch=16) as b:
        assert b.buckets == (1, 2, 4, 8, 16)
        assert h.trace_count == before + len(b.buckets)  # each bucket compiled here
        with no_compiles() as compiled:
            for n in range(1, 17):
                assert b(rows(n, seed=n)).shape == (n, 2)
            futures = [b.submit(rows(n, seed=n)) for n in (3, 5, 16, 1)]
            for f in futures:
                f.result(30)
        assert compiled == []
        assert h.trace_count == before + len(b.buckets)


class _Frame:
    """A pandas-like table whose ``__array__`` raises: its columns mix types."""

    def __array__(self, dtype=None, copy=None):
        raise ValueError("cannot convert a frame of mixed columns")


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (rows(1)[0], ["shape (512,)", "float32[b, 512]", "x[None]"]),
        (rows(1)[:, :3], ["shape (1, 3)", "each row is (3,), not (512,)"]),
        (rows(1).astype(np.float64), ["dtype float64", "x.astype(np.float32)"]),
        (rows(9), ["9 rows", "max_batch >= 9"]),
        (rows(0), ["no rows"]),
        ([[0.0] * 512, [0.0]], ["is a list that is not an array", "float32[b, 512]"]),
        (_Frame(), ["_Frame that is not an array (cannot convert a frame of mixed columns)"]),
    ],  # (a _Frame: its __array__'s raw ValueError)
)
def test_a_bad_request_is_refused_at_submit_without_harming_the_others(chapter, bad, says):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=8) as b:
        f0, (f1,) = busy_then_queue(b, gate, rows(1), [rows(2)])
        gate.hold()
        with pytest.raises(sm.SignatureError) as e:
            b.submit(bad)
        with pytest.raises(sm.SignatureError):
            b(bad)
        gate.open.set()
        for text in says:
            assert text in str(e.value), str(e.value)
        assert f0.result(30).shape == (1, 2) and f1.result(30).shape == (2, 2)
        s = b.stats
        assert s.rejected_by["signature"] == 2 and s.rejected == 2
        assert s.requests == s.completed == 2
        assert b(rows(1)).shape == (1, 2)


def test_wrong_number_of_inputs_is_refused(chapter):
    _, _, h, x = chapter
    with (
        sm.serving.Batcher(h, example=x, max_batch=2) as b,
        pytest.raises(sm.SignatureError, match=r"takes 1 input\(s\).*got 2"),
    ):
        b.submit(rows(1), rows(1))


def test_several_inputs_must_have_the_same_rows():
    h = sm.hybridize(lambda p, x, y: x * p + y.sum(axis=1, keepdims=True), jnp.float32(2))
    example = (jnp.ones((1, 3)), jnp.ones((1, 2)))
    with sm.serving.Batcher(h, example=example, max_batch=4) as b:
        y = b(np.ones((2, 3), np.float32), np.ones((2, 2), np.float32))
        np.testing.assert_array_equal(y, np.full((2, 3), 4.0, np.float32))
        with pytest.raises(sm.SignatureError, match="same number of rows"):
            b(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))


def test_a_full_queue_refuses_with_an_overload_error(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=4, max_queue=2) as b:
        f0 = gate.busy(b, rows(1))
        queued = [b.submit(rows(1)), b.submit(rows(1))]
        with pytest.raises(sm.serving.OverloadError) as e:
            b.submit(rows(1))
        assert isinstance(e.value, sm.SymjaxError)
        assert "max_queue=2" in str(e.value) and "Retry" in str(e.value)
        gate.open.set()
        for f in [f0, *queued]:
            assert f.result(30).shape == (1, 2)
        assert b.stats.rejected_by["overload"] == 1
        assert b.submit(rows(1)).result(30).shape == (1, 2)  # room again


def test_close_finishes_what_is_queued(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    b = sm.serving.Batcher(gate, example=x, max_batch=4)
    f0 = gate.busy(b, rows(1))
    queued = [b.submit(rows(1, seed=i)) for i in range(3)]
    closer = threading.Thread(target=b.close)
    closer.start()
    while not b.closed:
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="closed"):
        b.submit(rows(1))
    gate.open.set()
    closer.join(30)
    assert not closer.is_alive()
    assert all(f.done() and not f.cancelled() for f in [f0, *queued])
    assert b.stats.completed == 4 and b.stats.rejected_by["closed"] == 1
    assert b.name not in [t.name for t in threading.enumerate()]  # its thread ended


def test_close_cancel_cancels_what_is_queued(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=4) as b:
        f0 = gate.busy(b, rows(1))
        queued = [b.submit(rows(1)) for _ in range(3)]
        waiter_error = []

        def blocking_call():
            try:
                b(rows(1))
            except concurrent.futures.CancelledError as e:
                waiter_error.append(e)

        caller = threading.Thread(target=blocking_call)
        caller.start()
        while b.stats.queue_depth < 4:
            time.sleep(0.001)
        threading.Timer(0.05, gate.open.set).start()
        b.close(cancel=True)
        caller.join(30)
        assert f0.result(30).shape == (1, 2)  # the running batch finishes
        assert all(f.cancelled() for f in queued)
        assert len(waiter_error) == 1  # the blocking caller is told, not left hanging
        assert b.stats.cancelled == 4
    assert b.closed


def test_a_cancelled_future_is_skipped(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=4) as b:
        gate.sizes.clear()
        f0 = gate.busy(b, rows(1))
        f1, f2 = b.submit(rows(1)), b.submit(rows(2))
        assert f1.cancel()
        gate.open.set()
        assert f2.result(30).shape == (2, 2)
        f0.result(30)
        assert f1.cancelled() and gate.sizes == [1, 2]
        assert b.stats.cancelled == 1


def test_run_times_out(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=4) as b:
        f0 = gate.busy(b, rows(1))
        with pytest.raises(TimeoutError, match=r"no result after 0\.05 s"):
            b.run(rows(1), timeout=0.05)
        gate.open.set()
        f0.result(30)


def test_a_bad_timeout_or_cancel_is_refused_before_a_request_is_queued(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=4) as b:
        f0 = gate.busy(b, rows(1))
        for bad in ("a", -1, float("nan"), True):  # was a TypeError/ValueError once queued
            with pytest.raises(sm.ConfigError, match=r"run\(timeout=.*\): pass seconds >= 0"):
                b.run(rows(1), timeout=bad)
        assert b.stats.requests == 1  # only f0's: none of them was queued
        with pytest.raises(sm.ConfigError, match=r"close\(cancel='yes'\): expected True or"):
            b.close(cancel="yes")  # truthy: it would have cancelled the queue
        with pytest.raises(sm.ConfigError, match=r"close\(timeout=-1\)"):
            b.close(timeout=-1)
        assert not b.closed
        gate.open.set()
        f0.result(30)


def test_asubmit_refuses_an_alone_that_is_no_bool_as_close_refuses_a_cancel():
    """``asubmit(x, alone="no")`` (or 1, None) was taken for its truth: "no" ran the request at
    once, as if no other could join its pass. Now refused before it is queued, as close(cancel=)
    refuses one (which took 1 for True); NumPy's bool is a bool to both."""
    with sm.serving.Batcher(lambda x: 2 * x, example=rows(1), max_batch=1) as b:

        async def submit(alone):
            return await b.asubmit(rows(1), alone=alone)

        for bad in ("no", 1, None):
            said = rf"asubmit\(alone={re.escape(repr(bad))}\): expected True or False\.$"
            with pytest.raises(sm.ConfigError, match=said):
                asyncio.run(submit(bad))
            with pytest.raises(sm.ConfigError, match=rf"close\(cancel={re.escape(repr(bad))}\)"):
                b.close(cancel=bad)
        assert b.stats.requests == 0 and not b.closed  # nothing queued, nothing closed
        np.testing.assert_array_equal(asyncio.run(submit(np.True_)), b(rows(1)))
        b.close(cancel=np.False_)
        assert b.closed


def test_a_batchers_default_max_batch_holds_its_warm_up_within_a_stated_bound(chapter):
    """``Batcher(model)`` warmed up to 64 rows whatever a row held: a model of 64 MiB rows ran
    4 GiB of zeros as the batcher was made. Its default is now the largest power of two of rows
    within WARM_UP_BYTES (256 MiB), as serve's within max_inflight_bytes; max_batch= warms more;
    the chapter MLP's small rows still batch to 64."""
    from symjax_mlp.serving._requests import WARM_UP_BYTES

    warmed = []

    def first(x):
        warmed.append(x.shape[0])
        return x[:, :1]

    big = np.zeros((1, 16 * 2**20), np.float32)  # one row of 64 MiB (zeros: no page touched)
    with sm.serving.Batcher(first, example=big) as b:
        assert b.max_batch == max(warmed) == WARM_UP_BYTES // big.nbytes < 64, warmed
        with pytest.raises(sm.SignatureError, match=rf"max_batch >= {b.max_batch + 1}\.$"):
            b(np.zeros((b.max_batch + 1, *big.shape[1:]), np.float32))
    with sm.serving.Batcher(first, example=big, max_batch=2 * b.max_batch) as b2:
        assert b2.max_batch == max(warmed) == 2 * b.max_batch
    _, _, _, x = chapter  # the chapter MLP's rows (3 KiB): as before
    with sm.serving.Batcher(first, example=np.asarray(x)) as b:
        assert b.max_batch == max(warmed) == 64 and b.buckets == (1, 2, 4, 8, 16, 32, 64)


def test_a_model_error_reaches_every_request_of_its_batch_and_the_batcher_carries_on(chapter):
    _, _, h, x = chapter

    gate = Gated(refusing_nan(h))
    with sm.serving.Batcher(gate, example=x, max_batch=4) as b:
        poisoned = nan_row()
        f0, (good, bad) = busy_then_queue(b, gate, rows(1), [rows(1), poisoned])
        for f in (good, bad):
            with pytest.raises(FloatingPointError, match="NaN row"):
                f.result(30)
        assert f0.result(30).shape == (1, 2)
        with pytest.raises(FloatingPointError):
            b(poisoned)  # inline: raised to the caller
        assert b(rows(1)).shape == (1, 2)  # and the batcher carries on
        assert b.stats.failed == 3


def test_a_model_that_stops_returning_one_row_per_input_row_is_an_error_not_a_hang():
    """A callable passed the warm-up, then returned a row fewer: a batch of 1-row requests
    raised an IndexError on the batcher's thread and its futures were never settled (a hang)."""
    short = {"on": False}

    def model(x):
        return x[:-1] if short["on"] else x

    gate = Gated(model)
    with sm.serving.Batcher(gate, example=np.ones((1, 3), np.float32), max_batch=4) as b:
        short["on"] = True
        f0, queued = busy_then_queue(
            b, gate, np.ones((2, 3), np.float32), [np.ones((1, 3), np.float32)] * 3
        )
        for f in (f0, *queued):
            with pytest.raises(RuntimeError, match="one row per input row"):
                f.result(30)
        with pytest.raises(RuntimeError, match=r"shape \(1, 3\) for a batch of 2 rows"):
            b(np.ones((2, 3), np.float32))
        short["on"] = False
        assert b(np.ones((2, 3), np.float32)).shape == (2, 3)  # and the batcher carries on
        assert b.stats.failed == 5


@pytest.mark.parametrize(
    ("later", "says"),
    [
        (lambda x: (x * 2).tolist(), "a value of type list for a batch of 2 rows, where it "),
        (lambda x: None, "a value of type NoneType for a batch of 2 rows, where it returned an"),
        (lambda x: (x, x), "a value of type tuple"),  # was stacked: (2, 2, 3), in silence
        (lambda x: x.astype(np.float64), r"shape \(2, 3\) for a batch of 2 rows, dtype float64"),
        (lambda x: x[:, :2], r"of shape \(2, 3\) and dtype float32 as when"),  # in silence
    ],
    ids=["list", "none", "tuple", "dtype", "row-shape"],
)
def test_a_model_whose_output_changes_after_the_warm_up_is_told_what_it_returned(later, says):
    """A plain function that returned an array at warm-up and later a list, a tuple, None, or
    another dtype or row shape: None was "an output of shape ()", the rest went to the caller
    (a tuple of two arrays stacked into one), each request's answer changed by its batch."""
    changed = {"on": False}

    def model(x):
        return later(x) if changed["on"] else x * 2

    with sm.serving.Batcher(model, example=np.ones((1, 3), np.float32), max_batch=2) as b:
        changed["on"] = True
        with pytest.raises(RuntimeError, match=says):
            b(np.ones((2, 3), np.float32))
        changed["on"] = False
        assert b(np.ones((2, 3), np.float32)).dtype == np.float32  # and the batcher carries on


def test_a_model_whose_rows_depend_on_the_batch_size_is_refused_when_the_batcher_is_made():
    """Its warm-up checked only the leading dimension: each request was answered rows shaped
    by the bucket its batch ran at (here (1,) alone, (2,) with another)."""
    with pytest.raises(sm.ConfigError, match=r"for a batch of 2 rows are .* float32\[2\], but"):
        sm.serving.Batcher(
            lambda x: np.zeros((len(x), len(x)), np.float32),
            example=np.ones((1, 3), np.float32),
            max_batch=2,
        )


def test_a_model_of_several_outputs_that_changes_their_kind_is_an_error():
    """Its outputs' structure went unchecked: None or a dict answered each request as such."""
    changed = {"on": False}

    def model(x):
        return {"y": x} if changed["on"] else (x, x[:, 0])

    with sm.serving.Batcher(model, example=np.ones((1, 3), np.float32), max_batch=2) as b:
        changed["on"] = True
        with pytest.raises(RuntimeError, match=r"type dict for a batch of 2 rows, where it "):
            b(np.ones((2, 3), np.float32))


def test_concurrent_clients_each_get_their_own_rows(chapter):
    _, _, h, x = chapter
    want = {i: np.asarray(h(rows(1, seed=i))) for i in range(64)}
    errors: list[BaseException] = []
    with sm.serving.Batcher(h, example=x, max_batch=8) as b:

        def client(j):
            try:
                for k in range(12):
                    i = (j * 12 + k) % 64
                    got = b(rows(1, seed=i)) if k % 2 else b.submit(rows(1, seed=i)).result(30)
                    np.testing.assert_allclose(got, want[i], rtol=1e-5, atol=1e-6)
            except BaseException as e:
                errors.append(e)

        _run_clients(client, 16, timeout=60)
        s = b.stats
    assert errors == []
    assert s.requests == s.completed == s.rows == 16 * 12
    assert s.failed == s.rejected == s.cancelled == 0
    assert sum(s.batches_by_bucket.values()) == s.batches
    assert s.padded_rows == sum(k * n for k, n in s.batches_by_bucket.items()) - s.rows


def test_a_request_behind_a_lone_call_joins_the_queue_and_runs_next(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with (
        sm.serving.Batcher(gate, example=x, max_batch=8) as b,
        concurrent.futures.ThreadPoolExecutor(1) as caller,
    ):
        caller_thread = caller.submit(threading.get_ident).result(30)
        gate.threads.clear()
        gate.hold()
        lone = caller.submit(b, rows(1))  # b(x) on the pool's thread: it runs there
        assert gate.entered.wait(30)
        time.sleep(0.05)
        s = b.stats
        assert s.busy and s.queue_depth == 0 and s.requests == 1
        assert 0.05 <= s.busy_s < 30  # the running batch's age, for /health's "stuck"
        assert f"symjax_mlp_batcher_busy_seconds {s.busy_s!r}" in s.to_prometheus()
        behind = b.submit(rows(2))
        assert b.stats.queue_depth == 1  # the lone call holds the lane: this one waits
        gate.open.set()
        assert lone.result(30).shape == (1, 2) and behind.result(30).shape == (2, 2)
        first, second = gate.threads
        assert first == caller_thread  # the lone call ran on its caller's thread
        assert second not in (caller_thread, threading.get_ident())  # the batcher's
        assert behind.timing.queued > 0 and behind.timing.bucket == 2
    s = b.stats
    assert (s.requests, s.completed, s.batches, s.rows, s.busy, s.busy_s) == (2, 2, 2, 3, False, 0)


def test_a_batch_whose_model_calls_the_batcher_inside_itself_stays_busy(chapter):
    """b(x) inside the model ran and cleared the running batch's start: /health's "stuck"
    (busy_s) then missed the outer batch, however long it ran on."""
    _, _, h, x = chapter
    inside, held = threading.Event(), threading.Event()

    def model(x):
        if x[0, 0] == 7:  # the outer request: a call of b inside, then held
            b(np.zeros_like(x))
            inside.set()
            assert held.wait(30), "the test never let the model go"
        return h(x)

    with (
        sm.serving.Batcher(model, example=x, max_batch=2) as b,
        concurrent.futures.ThreadPoolExecutor(1) as caller,
    ):
        outer = caller.submit(b, np.full_like(x[:1], 7))
        assert inside.wait(30)
        s = b.stats
        held.set()
        assert outer.result(30).shape == (1, 2)
    assert s.busy and s.busy_s > 0  # was 0.0: no batch running, by the inner call's end
    assert b.stats.busy_s == 0 and b.stats.completed == 2


def test_python_lists_are_taken_as_a_loaded_model_takes_them(tmp_path):
    """m([[1.0, 2.0]]) runs (Python numbers are weakly typed, as in JAX); b([[1.0, 2.0]]) was
    refused as float64 with 'Cast it: x.astype(...)', which a list lacks, and a ragged list
    was NumPy's raw ValueError."""
    h = sm.hybridize(lambda p, x: x * p, np.float32(2))
    m = sm.load(sm.export(h, tmp_path / "m", example=np.ones((1, 2), np.float32)).path)
    with sm.serving.Batcher(m, max_batch=2) as b:
        for x in ([[1.0, 2.5]], [[1, 2]], ((3.0, 4.0), [5, 6])):
            np.testing.assert_array_equal(b(x), m(x))
            np.testing.assert_array_equal(b.submit(x).result(30), m(x))
        with pytest.raises(sm.SignatureError, match=r"is a list that is not an array"):
            b([[1.0, 2.0], [3.0]])
        with pytest.raises(sm.SignatureError, match=r"dtype float64.*astype"):
            b(np.ones((1, 2)))  # an array keeps its dtype: refused as before
    assert b.stats.completed == 6


def test_a_signature_seen_before_is_looked_up_and_others_still_refused(chapter):
    _, _, h, x = chapter
    with sm.serving.Batcher(h, example=x, max_batch=8) as b:
        good = rows(3)
        want = np.asarray(h(good))
        for _ in range(2):  # checked, then looked up
            np.testing.assert_allclose(b(good), want, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(b.submit(good).result(30), want, rtol=1e-5, atol=1e-6)
        with pytest.raises(sm.SignatureError, match="dtype float64"):
            b(good.astype(np.float64))  # the same shape, another dtype
        with pytest.raises(sm.SignatureError, match="dtype >f4"):
            b(good.astype(">f4"))  # float32, but not in this machine's byte order
        with pytest.raises(sm.SignatureError, match="each row is"):
            b(good[:, :4])
        np.testing.assert_allclose(b(jnp.asarray(good)), want, rtol=1e-5, atol=1e-6)
        assert b.stats.rejected_by["signature"] == 3
    two = sm.hybridize(lambda p, u, v: u * p + v.sum(axis=1, keepdims=True), jnp.float32(2))
    with sm.serving.Batcher(two, example=(jnp.ones((1, 3)), jnp.ones((1, 2))), max_batch=4) as b:
        u, v = np.ones((2, 3), np.float32), np.ones((2, 2), np.float32)
        for _ in range(2):
            np.testing.assert_array_equal(b(u, v), np.full((2, 3), 4.0, np.float32))
        with pytest.raises(sm.SignatureError, match="dtype float64"):
            b(u, v.astype(np.float64))


def test_futures_work_with_wait_as_completed_callbacks_and_asyncio(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=8) as b:
        f0 = gate.busy(b, rows(1))
        queued = [b.submit(rows(1, seed=i)) for i in range(3)]
        with pytest.raises(TimeoutError):
            queued[0].result(timeout=0.01)
        with pytest.raises(TimeoutError):
            queued[0].exception(timeout=0.01)
        seen = []
        queued[1].add_done_callback(lambda f: seen.append((f, f.timing is not None)))
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            waited = pool.submit(concurrent.futures.wait, [f0, *queued], 30)
            completed = pool.submit(lambda: set(concurrent.futures.as_completed(queued, 30)))
            blocked = pool.submit(queued[2].result, 20)  # woken by its own batch
            time.sleep(0.05)  # let them block
            opened = time.monotonic()
            gate.open.set()
            done, not_done = waited.result(30)
            assert done == {f0, *queued} and not not_done
            assert completed.result(30) == set(queued)
            assert blocked.result(30).shape == (1, 2)
            assert time.monotonic() - opened < 15, "result() was not woken by its batch"
        assert seen == [(queued[1], True)]  # once, with the timing already set
        assert queued[0].exception() is None and queued[0].done() and not queued[0].running()

        async def request():
            return await asyncio.wrap_future(b.submit(rows(2)))

        assert asyncio.run(request()).shape == (2, 2)


def test_asubmit_serves_asyncio_with_one_loop_wake_up_per_batch(chapter, monkeypatch):
    _, _, h, x = chapter
    gate = Gated(h)
    wake_ups = []

    async def clients(b):
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: wake_ups.append(a) or real(*a))
        f0 = gate.busy(b, rows(1))
        xs = [rows(1, seed=i) for i in range(6)]
        requests = [b.asubmit(xi) for xi in xs]  # queued behind the held batch
        assert b.stats.queue_depth == 6
        gate.open.set()
        ys = await asyncio.gather(*requests)
        f0.result(30)
        return xs, ys, requests

    with sm.serving.Batcher(gate, example=x, max_batch=8) as b:
        gate.sizes.clear()
        xs, ys, requests = asyncio.run(clients(b))
        assert gate.sizes == [1, 8]  # the six merged into one batch, padded to 8
        assert len(wake_ups) == 1  # one call_soon_threadsafe for the whole batch
        for xi, y, r in zip(xs, ys, requests, strict=True):
            np.testing.assert_allclose(y, np.asarray(h(xi)), rtol=1e-5, atol=1e-6)
            assert (r.timing.batch_requests, r.timing.bucket, r.timing.rows) == (6, 8, 1)
            assert r.timing.total >= r.timing.compute > 0


@pytest.mark.parametrize("served", ["artifact", "callable"])
def test_a_lone_asubmit_runs_on_its_loop_and_a_pass_of_many_on_the_batcher(
    chapter, tmp_path, served
):
    """A lone asubmit of an artifact (an XLA program) runs on the loop; a user's callable, whose
    Python may block, on the batcher's thread."""
    _, _, h, x = chapter
    gate = Gated(h)  # records the thread and batch size of every model call
    if served == "artifact":
        m = sm.load(sm.export(h, tmp_path / "m", example=x).path)
        with sm.serving.Batcher(m, max_batch=8) as b:
            gate.fn, b._lane.call = b._lane.call, gate  # every model call, as it runs

            async def lone():
                return await asyncio.wait_for(b.asubmit(rows(1)), 30)

            y = asyncio.run(lone())
        assert gate.threads == [threading.get_ident()] and gate.sizes == [1]
        np.testing.assert_allclose(y, np.asarray(m(rows(1))), rtol=1e-6, atol=1e-6)
        return

    async def scenario(b):
        lone = b.asubmit(rows(1))
        y = await lone  # the batcher idle, nothing else queued: it runs at once
        dropped = b.asubmit(rows(1))
        dropped.cancel()  # before its pass ended: it never runs
        await asyncio.sleep(0)
        xs = [rows(1, seed=i) for i in range(5)]
        many = [b.asubmit(xi) for xi in xs]  # one pass: one batch, on the batcher's thread
        ys = await asyncio.gather(*many)
        with pytest.raises(asyncio.CancelledError):
            await dropped
        return lone, y, xs, ys, many

    with sm.serving.Batcher(gate, example=x, max_batch=8) as b:
        gate.threads.clear()
        gate.sizes.clear()
        lone, y, xs, ys, many = asyncio.run(scenario(b))
        worker = b._thread.ident
        assert list(zip(gate.threads, gate.sizes, strict=True)) == [(worker, 1), (worker, 8)]
        np.testing.assert_array_equal(y, np.asarray(h(rows(1))))
        assert (lone.timing.batch_requests, lone.timing.bucket) == (1, 1)
        assert lone.timing.total >= lone.timing.compute > 0
        for xi, yi, r in zip(xs, ys, many, strict=True):
            np.testing.assert_allclose(yi, np.asarray(h(xi)), rtol=1e-5, atol=1e-6)
            assert (r.timing.batch_requests, r.timing.bucket) == (5, 8)
        stats = b.stats
        assert (stats.requests, stats.cancelled, stats.completed) == (7, 1, 6)


def test_a_lone_asubmit_of_an_artifact_with_a_while_loop_runs_on_the_batchers_thread(tmp_path):
    """A while loop may never end (its trip count is data): on the event loop it stopped every
    timeout, /health and the graceful stop with it. Such an artifact runs on the thread, as
    the checker found it, whatever its manifest says it needs (a manifest that left "while"
    out, loaded with allow={"while"} or trust=True, ran on the loop)."""

    def doubling(p, x):  # 2x + 1 until its first entry passes p (zeros too: the warm-up's)
        return jax.lax.while_loop(lambda y: y[0, 0] < p, lambda y: y * 2 + 1, x)

    h = sm.hybridize(doubling, jnp.float32(10))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((1, 2)))
    assert "while" in art.manifest["needs"]
    silent = tmp_path / "silent"  # the same artifact, its manifest silent about the loop
    shutil.copytree(art.path, silent)
    manifest = json.loads((silent / "manifest.json").read_text())
    (silent / "manifest.json").write_text(json.dumps({**manifest, "needs": []}))
    allow = {"while", "dynamic_slice"}  # its data's loop, and y[0, 0]
    for path, options in ((art.path, {"allow": allow}), (silent, {"allow": allow}),
                          (silent, {"trust": True})):  # fmt: skip
        gate, m = Gated(None), sm.load(path, **options)
        assert m.allowed is None if "trust" in options else "while" in m.allowed  # public
        with sm.serving.Batcher(m, max_batch=2) as b:
            gate.fn, b._lane.call = b._lane.call, gate

            async def lone(b=b):
                return await asyncio.wait_for(b.asubmit(np.ones((1, 2), np.float32)), 30)

            assert asyncio.run(lone()).tolist() == [[15.0, 15.0]]
            assert gate.threads == [b._thread.ident], (path.name, options)


@pytest.mark.slow  # an export: 0.2 s after others, ~1 to 10 s as a process's first
def test_an_asubmit_alone_runs_at_once_and_answers_as_its_pass_would(tmp_path):
    """``asubmit(x, alone=True)`` (serve's, on its one connection) runs a request on an idle
    batcher of an artifact at once, on the loop: done when returned, no pass of the loop to
    wait for. Its answer is the pass's bit for bit (dtype, timing's sizes, counts); a refusal
    is the same; on a busy batcher, or a callable's (its Python may block), it queues as any."""
    m = sm.load(sm.chapter.export_mlp(tmp_path / "mlp").path)
    xs = [rows(1, seed=3), rows(3, seed=4)]

    async def both(b):
        out = []
        for x in xs:
            alone = b.asubmit(x, alone=True)
            assert alone.future.done()  # ran in the call
            passed = b.asubmit(x)
            assert not passed.future.done()  # runs as the pass ends
            out.append((alone, await alone, passed, await passed))
        return out

    with sm.serving.Batcher(m, max_batch=4) as b:
        gate = Gated(b._lane.call)
        b._lane.call = gate
        answers = asyncio.run(both(b))
        assert gate.threads == [threading.get_ident()] * 4 and gate.sizes == [1, 1, 4, 4]
        stats = b.stats
        assert (stats.requests, stats.completed, stats.batches) == (4, 4, 4)
        for alone, y, passed, want in answers:
            assert y.dtype == want.dtype == np.float32
            np.testing.assert_array_equal(y, want)
            t, u = alone.timing, passed.timing
            assert (t.rows, t.batch_rows, t.batch_requests, t.bucket) == (
                u.rows, u.batch_rows, u.batch_requests, u.bucket)  # fmt: skip

        async def refused(**alone):
            with pytest.raises(sm.SignatureError) as e:
                b.asubmit(rows(1, 3), **alone)
            return str(e.value)

        assert asyncio.run(refused(alone=True)) == asyncio.run(refused())
        first = gate.busy(b, rows(1))  # a batch runs on the batcher's thread: it queues

        async def behind():
            r = b.asubmit(rows(1, seed=5), alone=True)
            assert not r.future.done()
            gate.open.set()
            return await r

        got = asyncio.run(behind())
        first.result(30)
        np.testing.assert_array_equal(got, b(rows(1, seed=5)))


def test_an_asubmit_alone_of_a_callable_runs_on_the_thread_and_hands_on_its_error(chapter):
    _, _, h, x = chapter

    async def call(b, **alone):
        with pytest.raises(FloatingPointError, match="NaN row"):
            await b.asubmit(nan_row(), **alone)
        r = b.asubmit(rows(1), **alone)
        assert not r.future.done()  # a user's Python: never on the loop
        return await r

    with sm.serving.Batcher(refusing_nan(h), example=x, max_batch=2) as b:
        np.testing.assert_array_equal(asyncio.run(call(b, alone=True)), asyncio.run(call(b)))
        assert b.stats.failed == 2


def test_asubmit_refuses_cancels_and_reports_errors(chapter):
    _, _, h, x = chapter
    gate = Gated(h)

    async def scenario(b):
        with pytest.raises(sm.SignatureError, match=r"has shape \(1, 3\)"):
            b.asubmit(np.ones((1, 3), np.float32))  # refused at once, nothing queued
        f0 = gate.busy(b, rows(1))
        dropped, kept = b.asubmit(rows(1)), b.asubmit(rows(2))
        assert dropped.cancel()  # its batch has not started: it is skipped
        gate.open.set()
        assert (await kept).shape == (2, 2)
        f0.result(30)
        with pytest.raises(asyncio.CancelledError):
            await dropped
        assert dropped.timing is None

        f0 = gate.busy(b, rows(1))
        queued = b.asubmit(rows(1))
        threading.Timer(0.05, gate.open.set).start()
        await asyncio.get_running_loop().run_in_executor(None, lambda: b.close(cancel=True))
        with pytest.raises(asyncio.CancelledError):
            await queued  # closed with cancel=True before its batch ran
        f0.result(30)

    with sm.serving.Batcher(gate, example=x, max_batch=4) as b:
        gate.sizes.clear()
        asyncio.run(scenario(b))
        assert gate.sizes[:2] == [1, 2]  # the cancelled request never ran
        assert b.stats.cancelled == 2 and b.stats.rejected_by["signature"] == 1
    with (
        sm.serving.Batcher(h, example=x, max_batch=4) as b,
        pytest.raises(RuntimeError, match="no asyncio event loop runs on this thread"),
    ):
        b.asubmit(rows(1))


def test_asubmit_hands_a_model_error_to_the_awaiter(chapter):
    _, _, h, x = chapter

    poisoned = nan_row()

    async def call(b):
        with pytest.raises(FloatingPointError, match="NaN row"):
            await b.asubmit(poisoned)
        assert (await b.asubmit(rows(1))).shape == (1, 2)  # the batcher carries on

    with sm.serving.Batcher(refusing_nan(h), example=x, max_batch=2) as b:
        asyncio.run(call(b))
        assert b.stats.failed == 1


def test_a_done_callback_may_call_the_batcher(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=x, max_batch=4) as b:
        got, done = [], threading.Event()

        def again(f):  # on the batcher's thread, which holds the lane between two batches
            y = b.run(rows(3), timeout=20)  # (a timeout: were it queued, it would wait on us)
            got.append((threading.get_ident(), y.shape, b.submit(rows(2))))
            done.set()

        f0, (f1,) = busy_then_queue(b, gate, rows(1), [rows(1)])
        f1.add_done_callback(again)
        assert done.wait(30)
        (thread, shape, later) = got[0]
        assert thread != threading.get_ident() and shape == (3, 2)
        assert later.result(30).shape == (2, 2) and f0.result(30).shape == (1, 2)
        assert b(rows(1)).shape == (1, 2)
    assert b.stats.completed == 5


@pytest.mark.parametrize("cancel", [False, True])
def test_a_done_callback_may_close_the_batcher(chapter, cancel):
    """close() in a done callback raised RuntimeError('cannot join current thread')."""
    _, _, h, x = chapter
    gate = Gated(h)
    b = sm.serving.Batcher(gate, example=x, max_batch=4)
    errors, done = [], threading.Event()

    def close(f):
        try:
            b.close(cancel=cancel)
        except BaseException as e:
            errors.append(e)
        done.set()

    f0 = gate.busy(b, rows(1))  # in the model: its callback runs on the batcher's thread
    f0.add_done_callback(close)
    f1 = b.submit(rows(1))
    gate.open.set()
    assert done.wait(30) and errors == [] and b.closed
    b._thread.join(30)
    assert not b._thread.is_alive()  # it finished (or cancelled) what was queued, and ended
    assert f1.cancelled() if cancel else f1.result(30).shape == (1, 2)
    with pytest.raises(RuntimeError, match="closed"):
        b.submit(rows(1))
    b.close()  # and again, from here


@pytest.mark.parametrize("queued", [False, True])
def test_the_model_itself_may_close_its_batcher(queued):
    """close() called by the model, on the thread of a lone b(x) holding the lane, waited for
    the batcher's thread, which waited for the lane: both hung for ever. Now close() returns;
    the request in flight, and one queued behind it, still get their answers."""
    box = {}

    def model(x):
        if box.pop("b", None) is not None:  # once: the first request closes its batcher
            box["queued"] = b.submit(np.ones((1, 2), np.float32)) if queued else None
            b.close()
        return x * 2

    b = sm.serving.Batcher(model, example=np.ones((1, 2), np.float32), max_batch=4)
    box["b"] = b
    got = []
    caller = threading.Thread(target=lambda: got.append(b(np.ones((4, 2), np.float32))))
    caller.start()
    caller.join(30)
    assert not caller.is_alive(), "b(x) hung in close()"
    np.testing.assert_array_equal(got[0], np.full((4, 2), 2.0))
    if queued:
        np.testing.assert_array_equal(box["queued"].result(30), np.full((1, 2), 2.0))
    b._thread.join(30)
    assert b.closed and not b._thread.is_alive()


def test_a_cancelled_future_reaches_wait_and_its_callbacks(chapter):
    _, _, h, x = chapter
    gate = Gated(h)
    b = sm.serving.Batcher(gate, example=x, max_batch=4)
    f0 = gate.busy(b, rows(1))
    dropped, closed = b.submit(rows(1)), b.submit(rows(1))
    called = []
    dropped.add_done_callback(called.append)
    assert dropped.cancel() and dropped.cancel() and dropped.cancelled()
    assert called == [dropped]
    with pytest.raises(concurrent.futures.CancelledError):
        dropped.result(30)
    threading.Timer(0.05, gate.open.set).start()
    b.close(cancel=True)  # `closed` was still queued: cancelled, and wait() is told
    assert not concurrent.futures.wait([f0, dropped, closed], timeout=30).not_done
    assert f0.result(30).shape == (1, 2)
    assert closed.cancelled() and b.stats.cancelled == 2


def test_lone_calls_submits_asubmits_cancels_and_overloads_under_load_add_up(chapter):
    _, _, h, x = chapter
    errors: list[BaseException] = []
    overloaded = [0]
    with sm.serving.Batcher(h, example=x, max_batch=4, max_queue=8) as b:

        async def asyncio_client(j):
            rng = np.random.default_rng(j)
            for k in range(30):
                n = int(rng.integers(1, 5))
                try:
                    r = b.asubmit(rows(n, seed=k))
                    if k % 2 and r.cancel():
                        continue
                    assert (await r).shape == (n, 2)
                    assert r.timing.rows == n and r.timing.bucket >= r.timing.batch_rows
                except sm.serving.OverloadError:
                    overloaded[0] += 1
                except BaseException as e:
                    errors.append(e)

        def client(j):
            if j % 4 == 0:  # 3 of the 12 clients are asyncio tasks, each on its own loop
                asyncio.run(asyncio_client(j))
                return
            rng = np.random.default_rng(j)
            for k in range(30):
                n = int(rng.integers(1, 5))
                try:
                    if k % 3:
                        assert b(rows(n, seed=k)).shape == (n, 2)
                        continue
                    f = b.submit(rows(n, seed=k))
                    if k % 2 and f.cancel():
                        continue
                    assert f.result(30).shape == (n, 2)
                    assert f.timing.rows == n and f.timing.bucket >= f.timing.batch_rows
                except sm.serving.OverloadError:
                    overloaded[0] += 1
                except BaseException as e:
                    errors.append(e)

        _run_clients(client, 12, timeout=120)
    s = b.stats  # after close: everything queued has run or was dropped
    assert errors == []
    assert s.requests == s.completed + s.cancelled and s.failed == 0
    assert s.requests + s.rejected == 12 * 30 and s.rejected_by["overload"] == overloaded[0]
    assert s.queue_depth == 0 and not s.busy
    assert dict(s.latency)[2.5] <= s.completed and s.latency_sum > 0
    assert s.padded_rows == sum(k * n for k, n in s.batches_by_bucket.items()) - s.rows


def test_counters_folded_in_small_chunks_add_up(chapter, monkeypatch):
    from symjax_mlp.serving import _lane

    monkeypatch.setattr(_lane, "_FOLD_EVERY", 2)  # fold every few batches, not 4096
    _, _, h, x = chapter
    with sm.serving.Batcher(h, example=x, max_batch=4) as b:
        timings = []
        for n in (1, 3, 4, 2, 1, 1):
            assert b(rows(n)).shape == (n, 2)
            f = b.submit(rows(n))
            f.result(30)
            timings.append(f.timing)
    s = b.stats
    assert (s.requests, s.completed, s.batches, s.rows) == (12, 12, 12, 24)
    assert s.padded_rows == 2 and s.batches_by_bucket == {1: 6, 2: 2, 4: 4}  # 3 rows: 4
    assert dict(s.latency)[2.5] == 12 and s.latency_sum > sum(t.total for t in timings) > 0
    assert all(v >= 0 for v in s.seconds.values())


def test_stats_refuse_a_prefix_prometheus_cannot_read():
    """to_prometheus('my-model') (or 'my model', 5) wrote metrics whose names Prometheus
    refuses, the whole scrape with them; create_app checks its prefix, this did not."""
    with sm.serving.Batcher(lambda x: x * 2, example=np.ones((1, 2), np.float32)) as b:
        stats = b.stats
    for bad in ("my-model", "my model", "9lives", "", 5):
        with pytest.raises(sm.ConfigError, match=r"^symjax_mlp\.serving\.BatcherStats\.to_"
                           r"prometheus\(prefix=.*\): a Prometheus metric name is \[a-zA-Z_:\]"
                           r"\[a-zA-Z0-9_:\]\*; pass e\.g\. prefix='my_model'\.$"):  # fmt: skip
            stats.to_prometheus(bad)
    assert stats.to_prometheus("my_model:v2").startswith("# HELP my_model:v2_requests_total")


def test_stats_in_prometheus_text_format(chapter):
    _, _, h, x = chapter
    with sm.serving.Batcher(h, example=x, max_batch=4) as b:
        b(rows(3))
        b(rows(1))
        with pytest.raises(sm.SignatureError):
            b(rows(1)[:, :2])
        text = b.stats.to_prometheus("svc")
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) svc_\w+ .+", line), line
            continue
        name, value = line.rsplit(" ", 1)
        assert re.fullmatch(r'svc_\w+(\{\w+="[^"]*"\})?', name), line
        samples[name] = float(value)
    assert samples["svc_requests_total"] == 2 and samples["svc_rows_total"] == 4
    assert samples["svc_padded_rows_total"] == 1  # 3 rows ran at bucket 4
    assert samples['svc_rejected_total{reason="signature"}'] == 1
    assert samples['svc_request_seconds_bucket{le="+Inf"}'] == 2
    assert samples["svc_request_seconds_count"] == 2
    assert samples['svc_bucket_batches_total{bucket="4"}'] == 1
    assert "# TYPE svc_request_seconds histogram" in text


def test_pytree_outputs_are_split_per_request():
    h = sm.hybridize(lambda p, x: {"double": x * p, "sum": x.sum(axis=1)}, jnp.float32(2))
    gate = Gated(h)
    with sm.serving.Batcher(gate, example=jnp.ones((1, 3)), max_batch=4) as b:
        f0, (f1, f2) = busy_then_queue(
            b, gate, np.ones((1, 3), np.float32), [np.ones((1, 3), np.float32) * 2] * 2
        )
        out = f1.result(30)
        f2.result(30), f0.result(30)
    np.testing.assert_array_equal(out["double"], np.full((1, 3), 4.0, np.float32))
    np.testing.assert_array_equal(out["sum"], np.full((1,), 6.0, np.float32))


def test_outputs_without_the_batch_dimension_are_refused():
    h = sm.hybridize(lambda p, x: (x * p).sum(), jnp.float32(2))
    with pytest.raises(ValueError, match="per-row outputs"):
        sm.serving.Batcher(h, example=jnp.ones((1, 3)), max_batch=2)


def test_the_constructor_checks_its_arguments(chapter, tmp_path):
    _, _, h, x = chapter
    with pytest.raises(TypeError, match="pass example="):
        sm.serving.Batcher(h)
    with pytest.raises(TypeError, match="expected a LoadedModel"):
        sm.serving.Batcher(42, example=x)
    with pytest.raises(ValueError, match="largest is max_batch=8"):
        sm.serving.Batcher(h, example=x, max_batch=8, buckets=(1, 4))
    with pytest.raises(ValueError, match="max_queue"):
        sm.serving.Batcher(h, example=x, max_batch=2, max_queue=0)
    with sm.serving.Batcher(h, example=x, buckets=(1, 3, 6)) as b:
        assert b.buckets == (1, 3, 6) and b.max_batch == 6
        assert b(rows(5)).shape == (5, 2)
        assert b.stats.batches_by_bucket[6] == 1
    m = sm.load(sm.chapter.export_mlp(tmp_path / "m").path)
    with pytest.raises(TypeError, match="drop example="):
        sm.serving.Batcher(m, example=x)
    for bad in (4, "14"):  # an int was a TypeError from iterating it
        with pytest.raises(sm.ConfigError, match=rf"buckets must be a tuple.*got {bad!r}"):
            sm.serving.Batcher(m, buckets=bad)
    for bad in ([True, 4], ["a", 4]):  # True passed as 1, then failed deep in the warm-up
        with pytest.raises(sm.ConfigError, match=r"buckets must be a tuple of ints >= 1.*got \["):
            sm.serving.Batcher(m, buckets=bad, max_batch=4)
    with pytest.raises(sm.ConfigError, match=r"Batcher\(kwargs=\[1\]\): pass a dict"):
        sm.serving.Batcher(h, example=x, kwargs=[1])
    with pytest.raises(sm.ConfigError, match=r"max_batch=65,537 rows is more than .* 65,536"):
        sm.serving.Batcher(m, max_batch=2**16 + 1)  # a list of max_batch entries hung before
    net = sm.mlp((4, 2))  # unbound: flax's CallCompactUnboundModuleError at the warm-up
    with pytest.raises(sm.ConfigError, match=r"Batcher\(HybridSequential\): a flax.linen module"):
        sm.serving.Batcher(net, example=x)


def test_the_constructor_takes_numpy_integers_as_ints(chapter):
    """np.int64(8) (what arithmetic on array sizes gives) was refused as "must be an int"."""
    _, _, h, x = chapter
    for settings in (
        {"max_batch": np.int64(4), "max_queue": np.int32(8)},
        {"buckets": np.array([1, 2, 4])},
    ):
        with sm.serving.Batcher(h, example=x, **settings) as b:
            assert b.buckets == (1, 2, 4) and type(b.max_batch) is int
            assert json.dumps(list(b.buckets)) == "[1, 2, 4]"  # /signature writes them
            assert b(rows(3)).shape == (3, 2)
    for bad in (np.bool_(True), 4.0):
        with pytest.raises(sm.ConfigError, match=r"max_batch must be an int >= 1; got"):
            sm.serving.Batcher(h, example=x, max_batch=bad)


def test_create_app_takes_an_open_batcher_only(chapter, tmp_path):
    m = sm.load(sm.chapter.export_mlp(tmp_path / "m").path)
    for model in (m, str(tmp_path / "m")):  # an AttributeError from deep in the app, before
        with pytest.raises(sm.ConfigError, match=r"create_app: expected a .*Batcher; got"):
            sm.serving.create_app(model)
    b = sm.serving.Batcher(m, max_batch=2)
    b.close()
    with pytest.raises(sm.ConfigError, match=r"the batcher is closed"):
        sm.serving.create_app(b)


# -- a loaded artifact ------------------------------------------------------------------------
def test_a_loaded_artifact_with_a_symbolic_batch(chapter, tmp_path, monkeypatch):
    import symjax_mlp._runtimes.jax as jax_runtime

    # The JAX runtime reuses the compilations of a module loaded before (by sha256): every
    # chapter MLP exports the same module, so another test in this process may have compiled
    # these buckets already. Start from none, to see the batcher compile them.
    monkeypatch.setattr(jax_runtime, "_CALLS", {})
    art = sm.chapter.export_mlp(tmp_path / "m")
    m = sm.load(art.path)
    with no_compiles() as compiled_here:
        b = sm.serving.Batcher(m, max_batch=8)
    assert len(compiled_here) >= 1  # the buckets compile at construction
    requests = [rows(n, seed=n) for n in (1, 3, 8, 5)]
    wants = [np.asarray(m(r)) for r in requests]  # m alone compiles the sizes 3 and 5
    with b, no_compiles() as compiled:
        assert b.buckets == (1, 2, 4, 8)
        futures = [b.submit(r) for r in requests]
        for want, f in zip(wants, futures, strict=True):
            np.testing.assert_allclose(f.result(30), want, rtol=1e-5, atol=1e-6)
        with pytest.raises(sm.SignatureError, match="float32"):
            b(rows(1).astype(np.float16))
    assert compiled == []
    assert repr(b).startswith(f"Batcher({art.path})")


def test_a_loaded_artifact_with_a_static_batch(tmp_path):
    art = sm.chapter.export_mlp(tmp_path / "m4", batch=4)
    m = sm.load(art.path)
    with sm.serving.Batcher(m) as b:
        assert b.buckets == (4,) and b.max_batch == 4
        assert not b.merges and "static shapes" in b.why_alone  # its rows are not shown apart
        np.testing.assert_allclose(b(rows(4)), np.asarray(m(rows(4))), rtol=1e-6, atol=1e-6)
        assert b.stats.padded_rows == 0
    with pytest.raises(ValueError, match="static batch of 4") as e:
        sm.serving.Batcher(m, max_batch=8)
    # both ways, neither promised: a symbolic batch is refused for a model that fixes its rows
    assert "pass max_batch=4) to serve it so, one request of 4 rows" in str(e.value)
    assert "symbolic batch (batch='b') where the model takes one (not where" in str(e.value)


@pytest.mark.slow  # an export: 0.15 s after others, 1.9 s as a process's first
def test_a_static_batch_artifact_of_rows_unlike_its_batch_is_refused_whatever_max_batch(tmp_path):
    """An artifact of static shapes whose output is not its batch's rows (an ensemble's members
    on one example: (8, 2) for 2 rows): Batcher(m, max_batch=4) named a symbolic batch, which
    export refuses for such a model, and max_batch=2 then failed at warm-up. Refused naming
    per-row outputs whatever max_batch, as warm-up refused it without one."""
    h = sm.hybridize(lambda p, x: p * x, jnp.ones((8, 1)))
    m = sm.load(sm.export(h, tmp_path / "m", example=jnp.ones((2,)), batch=None).path)
    for max_batch in (None, 2, 4):
        with pytest.raises(sm.ConfigError, match=r"out is of shape \(8, 2\) for a batch of 2, "):
            sm.serving.Batcher(m, max_batch=max_batch)


def test_outputs_of_a_static_batch_artifact_must_be_its_rows():
    """What a Batcher of a static-batch artifact checks its outputs by (see above), before its
    max_batch: (8, 2) or a scalar for 2 rows is refused, naming the output; (2, 8) passes."""
    rows = sm.TensorSpec("out[0]", (2, 8), "float32")
    for shape in ((8, 2), ()):
        outputs = (rows, sm.TensorSpec("out[1]", shape, "float32"))
        said = rf"^Batcher\(m\): output out\[1\] is of shape {re.escape(str(shape))} for a "
        with pytest.raises(sm.ConfigError, match=said + r"batch of 2, but batching needs per-row"):
            refuse_outputs("m", outputs, 2, "")
    assert refuse_outputs("m", (rows,), 2, "") is None


@pytest.mark.parametrize("n", [1, 3, 5])
def test_a_static_batch_artifact_whose_rows_mix_is_never_padded(tmp_path, n):
    # x - mean over the batch, exported at (4, 3): 3 rows padded with a zero row got the mean
    # of 4 rows, the padding's among them (0.25 x the rows' mean off): answered, and wrong
    h = sm.hybridize(lambda p, x: x - x.mean(0, keepdims=True) + p, jnp.float32(0.5))
    m = sm.load(sm.export(h, tmp_path / "m", example=jnp.ones((4, 3)), batch=None).path)
    with sm.serving.Batcher(m) as b:
        assert b.buckets == (4,) and not b.merges
        x4 = rows(4, features=3)
        np.testing.assert_allclose(b(x4), np.asarray(m(x4)), rtol=1e-6, atol=1e-6)
        with pytest.raises(sm.SignatureError) as e:
            b(rows(n, features=3))
        message = str(e.value)
        assert f"has shape ({n}, 3)" in message and f"it has {n} rows" in message  # received
        assert "static batch of 4" in message and "b = 4 rows" in message  # expected
        assert "pass exactly 4 rows" in message and "batch='b'" in message  # the fix
        with pytest.raises(sm.SignatureError, match="static batch of 4"):
            b.submit(rows(n, features=3))
        stats = b.stats
    assert stats.padded_rows == 0 and stats.rejected_by["signature"] == 2


def _serve_concurrently(b, requests):
    """Each request's answer from ``b``: half from threads (``submit``), half from one asyncio
    pass (``asubmit``, all queued before the batcher's thread takes them)."""
    got = [None] * len(requests)

    def client(j):
        got[j] = b.submit(requests[j]).result(30)

    async def passing():
        return await asyncio.wait_for(asyncio.gather(*[b.asubmit(r) for r in requests]), 30)

    _run_clients(client, len(requests), timeout=30)
    return got, asyncio.run(passing())


@pytest.mark.parametrize("mix", [False, True], ids=["rows-apart", "rows-mix"])
def test_an_artifact_whose_rows_mix_runs_each_request_alone_and_unpadded(tmp_path, mix):
    # x - mean over the batch: merged with others, or padded with zero rows, a request's
    # answer would depend on the rest of its batch (0.1 off); alone, it is m(x)
    f = (lambda p, x: x - x.mean(0, keepdims=True) + p) if mix else (lambda p, x: x * p + 1)
    h = sm.hybridize(f, jnp.float32(0.5))
    m = sm.load(sm.export(h, tmp_path / "m", example=jnp.ones((4, 3))).path)
    assert m.manifest["rows"]["independent"] is not mix
    requests = [rows(n, features=3, seed=j) for j, n in enumerate((3, 1, 5, 2, 3, 7, 1, 6))]
    wants = [np.asarray(m(r)) for r in requests]
    with sm.serving.Batcher(m, max_batch=8) as b:
        assert b.merges is not mix and bool(b.why_alone) is mix
        assert ("merges=False" in repr(b)) is mix
        lone = b(requests[0])  # 3 rows: at bucket 4 where requests merge
        threaded, awaited = _serve_concurrently(b, requests)
        stats = b.stats
    for got in ([lone], threaded, awaited):
        for y, want in zip(got, wants, strict=False):
            np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    assert stats.completed == stats.requests == 1 + 2 * len(requests)
    if mix:
        assert "batch" in b.why_alone
        assert stats.batches == stats.requests and stats.padded_rows == 0
        assert set(stats.batches_by_bucket) <= {len(r) for r in requests}
    else:
        assert stats.batches < stats.requests and stats.mean_batch_rows > 3


@pytest.mark.slow  # an export: 0.2 s after others, 1.1 to 1.7 s as a process's first
def test_an_artifact_served_alone_whose_outputs_rows_grow_with_the_batch_is_refused(tmp_path):
    """A (b, b) covariance (JAX's gaussian_process_regression) served alone: the batcher warmed
    its smallest size only and took it, then a 2-row request failed with a RuntimeError. Now
    refused when made, from the artifact's output shapes."""
    h = sm.hybridize(lambda p, t: (t * p, t @ t.T), jnp.float32(2))
    m = sm.load(sm.export(h, tmp_path / "m", example=jnp.ones((3, 1))).path)
    assert m.manifest["rows"]["independent"] is False
    with pytest.raises(sm.ConfigError, match=r"output out\[1\] is float32\[b, b\], but a "
                       r"batcher needs outputs of 'b' rows of static sizes .*alone.*Call the "
                       r"loaded model directly"):  # fmt: skip
        sm.serving.Batcher(m, max_batch=4)


def test_outputs_served_alone_must_be_the_batchs_rows_of_static_sizes():
    """What a Batcher of an artifact served alone checks its outputs by (see above): a (b, b)
    covariance or a (1, 1) sum of rows is refused, naming the output; rows of (b, 1) pass."""
    rows, why = sm.TensorSpec("out[0]", ("b", 1), "float32"), "a dot_general mixes rows"
    for shape in (("b", "b"), (1, 1)):
        outputs = (rows, sm.TensorSpec("out[1]", shape, "float32"))
        said = rf"^Batcher\(m\): output out\[1\] is float32\[{', '.join(map(str, shape))}\], but"
        with pytest.raises(sm.ConfigError, match=said + r".*\(a dot_general mixes rows\)"):
            refuse_outputs("m", outputs, "b", why)
    assert refuse_outputs("m", (rows,), "b", why) is None


@pytest.mark.parametrize("mix", [False, True], ids=["rows-apart", "rows-mix"])
def test_an_artifact_bounding_its_batch_is_served_at_the_sizes_it_admits(tmp_path, mix):
    """An artifact exported with b >= 2 (or b <= 6) was warmed up at buckets (1, 2, 4, 8): the
    program refused b = 1 (or 8), and serve exited 2 with "the inputs give b = 1 ... split a
    longer one", of inputs no user sent. Now the buckets are those it admits, max_batch the
    largest it admits; a request below them is padded, or where rows mix, refused naming them."""
    f = (lambda p, x: x - x.mean(0, keepdims=True) + p) if mix else (lambda p, x: x * p + 1)
    h = sm.hybridize(f, jnp.float32(0.5))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((2, 3)), shapes=("b, 3",),
                    constraints=("b >= 2", "b <= 6"))  # fmt: skip
    m = sm.load(art.path)
    with sm.serving.Batcher(m, max_batch=8) as b:
        assert b.buckets == (2, 4, 6) and b.max_batch == 6 and b.merges is not mix
        for n in (2, 3, 6) if mix else (1, 3, 5, 6):  # 1: padded to 2
            np.testing.assert_allclose(b(rows(n, 3)), h(rows(n, 3)), rtol=1e-6, atol=1e-6)
        with pytest.raises(
            sm.SignatureError, match=rf"with {1 + mix} <= b <= 6 rows: it has 7 rows"
        ):
            b(rows(7, 3))
        if mix:
            with pytest.raises(sm.SignatureError, match=r"with 2 <= b <= 6 rows: it has 1 rows, "
                               r"and its rows mix: never padded. Pass 2 or more"):  # fmt: skip
                b(rows(1, 3))
    with pytest.raises(sm.ConfigError, match=r"buckets=\(1, 8\).* admits \(b >= 2, b <= 6\)"):
        sm.serving.Batcher(m, buckets=(1, 8))


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")  # (the example's layer)
def test_a_hybrid_taking_its_array_keyword_only_is_told_the_wrapper_a_batcher_serves():
    """flax's nlp_seq tagger, ``__call__(self, *, inputs, train)``: Batcher(h, example=x,
    kwargs={"train": False}) told to pass kwargs= and an example of one array per input, what
    was passed. It names the wrapper taking the array by place, which a Batcher serves."""
    from helpers import tagger

    model, variables, x = tagger()
    h = sm.hybridize(model, variables)
    with pytest.raises(sm.ConfigError, match=r"signature is \(\*, inputs, train\)\. A request's "
                       r"arrays go by place: serve a function taking inputs so,") as e:  # fmt: skip
        sm.serving.Batcher(h, example=x, kwargs={"train": False})
    assert str(e.value).endswith(
        "Batcher(sm.hybridize(lambda params, inputs: h.apply(params, inputs=inputs, train=False)"
        ", h.params), example=inputs)."
    )
    w = sm.hybridize(lambda params, inputs: h.apply(params, inputs=inputs, train=False), h.params)
    with sm.serving.Batcher(w, example=x, buckets=(2,)) as b:  # as it says
        want = h(inputs=x, train=False)
        np.testing.assert_allclose(b(np.asarray(x)), want, rtol=1e-5, atol=1e-6)


# -- the latency mode -------------------------------------------------------------------------
def test_latency_mode_refuses_once_jax_has_started():
    jnp.ones(1).block_until_ready()
    assert sm.serving.dispatch_mode() == "async"  # the library never flipped it
    with pytest.raises(RuntimeError, match="before any JAX computation"):
        sm.serving.latency_mode()
    assert sm.serving.dispatch_mode() == "async"


@pytest.mark.parametrize("given", [None, "--xla_cpu_multi_thread_eigen=true"])
def test_latency_mode_in_a_fresh_process(given):
    """Dispatch turns synchronous, and XLA_FLAGS gains the single-threaded-matmul flag before
    the backend starts (XLA reads it then), unless the user set it; the model agrees (run
    once: the user's flag is XLA's business)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if given:
        env["XLA_FLAGS"] = given
    model = "" if given else (
        "from symjax_mlp.chapter import chapter_mlp\n"
        "h, x = chapter_mlp((2,), in_features=4)  # one layer: a matmul, as the chapter's\n"
        "np.testing.assert_allclose(h(x), h.eager(x), rtol=1e-5, atol=1e-6)\n"
        "sm.serving.latency_mode()  # in force already: a no-op\n"
    )  # fmt: skip
    code = (
        "import os, numpy as np, symjax_mlp as sm\n"
        "before = sm.serving.dispatch_mode()\n"
        f"sm.serving.latency_mode()\n{model}"
        "print(before, sm.serving.dispatch_mode(), os.environ['XLA_FLAGS'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    flags = given or "--xla_cpu_multi_thread_eigen=false"
    assert out.stdout.split() == ["async", "sync", flags]


# -- the HTTP server --------------------------------------------------------------------------
def _start(path, *extra):
    cmd = [sys.executable, "-m", "symjax_mlp", "serve", str(path), "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [*cmd, "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
                found = re.search(r"(http://127\.0\.0\.1:\d+)", line)
                if found:
                    return proc, found.group(1)
    code, _, err = _stop(proc, signal.SIGKILL)
    raise AssertionError(f"the server did not start (exit {code}): {err[-3000:]}")


def _stop(proc, sig=signal.SIGINT):
    """Signals the server and waits; returns ``(exit code, stdout, stderr)``."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    art = sm.chapter.export_mlp(tmp_path_factory.mktemp("serve") / "mlp")
    proc, url = _start(art.path, "--max-batch", "8")
    try:
        yield url, sm.load(art.path)
    finally:
        code, out, err = _stop(proc)
    assert code == 0, err
    assert "shut down cleanly" in out


def _post(url, body, content_type):
    req = urllib.request.Request(
        url + "/predict", data=body, headers={"Content-Type": content_type}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers, e.read()


def _get(url, path):
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return r.status, r.headers, r.read()


def test_http_predict_with_json_and_npy_bodies(server):
    url, m = server
    x = rows(3, seed=7)
    want = np.asarray(m(x))
    code, headers, body = _post(
        url, json.dumps({"inputs": x.tolist()}).encode(), "application/json"
    )
    assert code == 200, body
    np.testing.assert_allclose(np.array(json.loads(body)["outputs"]), want, rtol=1e-5, atol=1e-6)
    assert re.search(
        r"queued;dur=[\d.]+, padded;dur=[\d.]+, compute;dur=", headers["Server-Timing"]
    )
    named = json.dumps({"inputs": {"args[0]": x.tolist()}}).encode()
    assert _post(url, named, "application/json")[0] == 200
    buf = io.BytesIO()
    np.save(buf, x)
    code, headers, body = _post(url, buf.getvalue(), "application/x-npy")
    assert code == 200 and headers["content-type"] == "application/x-npy"
    got = np.load(io.BytesIO(body), allow_pickle=False)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got.dtype == np.float32


def _asgi_post(x):
    """A JSON ``POST /predict`` of ``x`` as an ASGI server hands it to the app: ``(scope,
    receive, send, sent)``, ``sent`` the messages the app sends."""
    body = json.dumps({"inputs": x.tolist()}).encode()
    scope = {"type": "http", "method": "POST", "path": "/predict", "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))
    ], "query_string": b"", "root_path": ""}  # fmt: skip
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    return scope, receive, send, sent


def test_the_app_answers_a_lone_request_from_its_pass_and_merges_a_pass_of_many(tmp_path):
    """In process, through the ASGI app: a lone request runs on the loop when its pass ends
    (its answer, headers and counts as any), and requests arriving in one pass still merge."""
    m = sm.load(sm.chapter.export_mlp(tmp_path / "mlp").path)

    async def post(app, x):
        scope, receive, send, sent = _asgi_post(x)
        await app(scope, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]

    async def clients(app):
        lone = await post(app, rows(1))
        many = await asyncio.gather(*[post(app, rows(1, seed=i)) for i in range(3)])
        return [lone, *many]

    with sm.serving.Batcher(m, max_batch=4) as b:
        gate = Gated(b._lane.call)  # records the thread and batch size of every model call
        b._lane.call = gate
        answers = asyncio.run(clients(sm.serving.create_app(b, close_batcher=False)))
        stats = b.stats
    assert gate.threads == [threading.get_ident(), b._thread.ident] and gate.sizes == [1, 4]
    for (code, headers, body), x, n in zip(
        answers, [rows(1)] + [rows(1, seed=i) for i in range(3)], [1, 3, 3, 3], strict=True
    ):
        assert code == 200 and headers[b"content-type"] == b"application/json", body
        assert headers[b"x-batch"] == b"rows=%d; requests=%d; bucket=%d" % (n, n, 4 if n > 1 else 1)
        assert re.fullmatch(
            rb"queued;dur=[\d.]+, padded;dur=[\d.]+, compute;dur=[\d.]+, split;dur=[\d.]+",
            headers[b"server-timing"],
        )
        np.testing.assert_allclose(
            json.loads(body)["outputs"], np.asarray(m(x)), rtol=1e-6, atol=1e-6
        )
    assert (stats.requests, stats.completed, stats.batches) == (4, 4, 2)


@pytest.mark.slow  # an export: 0.2 s after others, ~1 to 10 s as a process's first
def test_the_apps_request_alone_on_its_server_answers_as_one_from_its_pass(tmp_path):
    """Where its server says it has one connection (``app.state.connections``, serve's), a request
    runs as it is decoded, not when the loop's pass ends: the same status, headers (but the
    timings) and body bytes, the same counts."""
    m = sm.load(sm.chapter.export_mlp(tmp_path / "mlp").path)

    async def post(app, x):
        scope, receive, send, sent = _asgi_post(x)
        await app(scope, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]

    answers, counts = {}, {}
    for alone in (False, True):
        with sm.serving.Batcher(m, max_batch=4) as b:
            app = sm.serving.create_app(b, close_batcher=False)
            app.state.connections[0] = 1 if alone else 2
            answers[alone] = [asyncio.run(post(app, rows(n, seed=n))) for n in (1, 3)]
            s = b.stats
            counts[alone] = (s.requests, s.completed, s.batches, dict(app.state.answered))
    assert counts[True] == counts[False] == (2, 2, 2, {200: 2})
    for (code, heads, body), (code2, heads2, body2) in zip(*answers.values(), strict=True):
        assert code == code2 == 200 and body == body2
        assert heads.pop(b"server-timing") and heads2.pop(b"server-timing")
        assert heads == heads2


def test_serve_answers_its_one_connection_as_it_answers_one_of_two(server):
    """serve runs the request of its one connection at once (nothing else can join its batch);
    with a second connection open, as the loop's pass ends: the same bytes either way."""
    import http.client

    url, m = server
    host, port = url.removeprefix("http://").rsplit(":", 1)
    x = rows(2, seed=11)
    body = json.dumps({"inputs": x.tolist()}).encode()

    def post(conn):
        conn.request("POST", "/predict", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("X-Batch"), r.read()

    one = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        alone = post(one)
        other = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            other.connect()
            two = post(one)
            assert post(other) == two
        finally:
            other.close()
    finally:
        one.close()
    assert alone == two and alone[:2] == (200, "rows=2; requests=1; bucket=2")
    np.testing.assert_allclose(json.loads(alone[2])["outputs"], np.asarray(m(x)), rtol=1e-6)


def test_a_lone_requests_answer_costs_the_app_few_python_calls(server):
    """The HTTP path's own cost, as a count (not a speed): a lone JSON request through the app
    made 49 Python calls in serving's code, starlette's Response (which copied, lowered and
    encoded each header) and NumPy (np.errstate, .all(), reading the body's numbers); the batch
    settled under the futures' lock. Then 30 more in starlette's middleware, routing and
    Request: POST /predict now goes to its endpoint past them (a mounted app's is routed)."""
    import starlette

    scope, receive, send, sent = _asgi_post(rows(1))
    ours = (os.path.dirname(sm.serving._app.__file__), os.path.dirname(np.__file__))
    ours += (os.path.dirname(starlette.__file__),)
    counted = []

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ours):
            counted.append(frame.f_code.co_name)

    async def lone(app):
        await app(dict(scope), receive, send)  # warm: its caches filled
        sys.setprofile(count)
        try:
            await app(dict(scope), receive, send)
        finally:
            sys.setprofile(None)
        await app({**scope, "path": "/api/predict", "root_path": "/api"}, receive, send)

    with sm.serving.Batcher(server[1], max_batch=4) as b:  # the chapter's MLP, loaded
        asyncio.run(lone(sm.serving.create_app(b, close_batcher=False)))
    assert [m["status"] for m in sent if "status" in m] == [200, 200, 200]
    assert len(counted) < 40, " ".join(counted)


def test_a_request_with_two_content_types_is_a_400_naming_them():
    """A head with Content-Type twice (a second Content-Length uvicorn refuses itself: httptools'
    'Duplicate Content-Length') was read by its first, while a proxy before the server may read
    the last: a .npy to one, JSON to the other. It is a 400 naming both; a repeated other header
    (Accept) is answered as before."""
    scope, receive, send, sent = _asgi_post(rows(1, 3))
    twice = [*scope["headers"], (b"content-type", b"application/x-npy")]
    accepts = [*scope["headers"], (b"accept", b"*/*"), (b"accept", b"application/json")]

    async def post(app):
        for heads in (twice, accepts):
            await app({**scope, "headers": heads}, receive, send)

    with sm.serving.Batcher(lambda x: 2 * x, example=rows(1, 3), max_batch=2) as b:
        asyncio.run(post(sm.serving.create_app(b, close_batcher=False)))
    assert [m["status"] for m in sent if "status" in m] == [400, 200]
    said = json.loads(sent[1]["body"])["message"]
    assert re.search(r"2 Content-Type headers \('application/json', 'application/x-npy'\).*"
                     r"send one Content-Type", said), said  # fmt: skip
    np.testing.assert_allclose(json.loads(sent[3]["body"])["outputs"], 2 * rows(1, 3))


def test_middleware_a_user_adds_sees_every_predict_request(server):
    """POST /predict skips starlette's own layers, never a user's: an app given an API-key
    middleware (``app.add_middleware``) must refuse a /predict without the key, as any route."""
    scope, receive, send, sent = _asgi_post(rows(1))

    class NeedsKey:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if (b"x-key", b"k") in scope.get("headers", []):
                return await self.app(scope, receive, send)
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    async def both(app):
        await app(dict(scope), receive, send)
        await app({**scope, "headers": [*scope["headers"], (b"x-key", b"k")]}, receive, send)

    with sm.serving.Batcher(server[1], max_batch=4) as b:
        app = sm.serving.create_app(b, close_batcher=False)
        app.add_middleware(NeedsKey)
        asyncio.run(both(app))
    assert [m["status"] for m in sent if "status" in m] == [401, 200]


def test_a_pass_of_many_runs_on_the_loop_where_its_bucket_last_ran_quickly(tmp_path, monkeypatch):
    """A LoadedModel's batch of one loop's requests runs on that loop (no hand-off to the
    batcher's thread and back) once its bucket ran within ON_LOOP_SECONDS; a bucket that ran
    longer goes to the batcher's thread, so the loop reads on meanwhile. Answers are the same.
    (On a loaded machine a call may take more than 1 ms: ON_LOOP_SECONDS is raised to 250 ms.)"""
    from symjax_mlp.serving import _lane

    monkeypatch.setattr(_lane, "ON_LOOP_SECONDS", ON_LOOP_SECONDS := 0.25)
    m = sm.load(sm.chapter.export_mlp(tmp_path / "mlp").path)
    xs = [rows(1, seed=i) for i in range(3)]
    with sm.serving.Batcher(m, max_batch=4) as b:
        gate, slow = Gated(b._lane.call), [0.0]  # the thread of every call; a delay added

        def model(*inputs):
            time.sleep(slow[0])
            return gate(*inputs)

        b._lane.call = model

        async def passes():
            answers = []
            for delay in (0.0, 0.0, 2 * ON_LOOP_SECONDS, 0.0):
                slow[0] = delay
                answers.append(await asyncio.gather(*[b.asubmit(x) for x in xs]))
                while not b._lane.idle:  # the thread answered, and gives the lane back next
                    await asyncio.sleep(0.001)
            return answers

        answers = asyncio.run(passes())
    here, thread = threading.get_ident(), b._thread.ident
    # first run of bucket 4: the thread; quick: here; here, but slow: the thread next time
    assert gate.threads == [thread, here, here, thread] and gate.sizes == [4] * 4
    for ys in answers:
        for x, y in zip(xs, ys, strict=True):
            np.testing.assert_allclose(y, np.asarray(m(x)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("body", "kind", "code", "says"),
    [
        (json.dumps({"inputs": [[1.0, 2.0, 3.0]]}), "application/json", 422, "(1, 3)"),
        (json.dumps({"inputs": [0.5] * 512}), "application/json", 422, "wrap the one row"),
        (json.dumps({"inputs": [[1, 2], [3]]}), "application/json", 422, "rectangular"),
        (json.dumps({"inputs": {"x": [[0.0] * 512]}}), "application/json", 422, "args[0]"),
        (json.dumps({"inputs": [["a"] * 512]}), "application/json", 422, "numbers"),
        (json.dumps({"x": 1}), "application/json", 400, '"inputs"'),
        ("{not json", "application/json", 400, "not valid JSON"),
        ("hello", "text/plain", 415, "application/x-npy"),
        ("not an npy file", "application/x-npy", 400, ".npy"),
        ('{"inputs": ' + "[" * 5000 + "]" * 5000 + "}", "application/json", 400,
         "nests JSON lists or objects too deep"),  # json.loads' RecursionError: once a 503,
        # "shutting down"; then "not valid JSON (maximum recursion depth exceeded ...)"
        (json.dumps({"inputs": [[1e39] * 512]}), "application/json", 422,
         "beyond float32's range"),  # once cast to inf in silence
    ],
)  # fmt: skip
def test_http_bad_requests_are_4xx_with_the_message(server, body, kind, code, says):
    url, _ = server
    status, _, raw = _post(url, body.encode(), kind)
    assert status == code, raw
    answer = json.loads(raw)
    assert says in answer["message"], answer
    if status == 422:
        assert answer["error"] == "SignatureError"
        assert "float32[b, 512]" in answer["message"]  # what is expected, too


def test_http_non_finite_answers_big_endian_npy_and_what_metrics_count(server):
    """Outputs that are NaN or inf come back as JSON's NaN/Infinity (as Python's json and TF
    Serving write them), not as a 500 counted as a 200; a big-endian .npy is read as the same
    numbers."""
    url, m = server

    def count(code):
        found = re.search(
            rf'http_requests_total\{{code="{code}"\}} (\d+)', _get(url, "/metrics")[2].decode()
        )
        return int(found.group(1)) if found else 0

    before = count(200)
    x = np.full((1, 512), 3e38, np.float32)  # finite, but the sums overflow
    want = np.asarray(m(x))
    assert not np.isfinite(want).all()
    for body in ({"inputs": x.tolist()}, {"inputs": [[float("nan")] * 512]}):
        code, headers, raw = _post(url, json.dumps(body).encode(), "application/json")
        assert code == 200 and headers["content-type"] == "application/json", raw
        got = np.array(json.loads(raw)["outputs"])
        assert got.shape == (1, 2) and not np.isfinite(got).any()
    np.testing.assert_array_equal(np.array(json.loads(_post(
        url, json.dumps({"inputs": x.tolist()}).encode(), "application/json")[2])["outputs"]),
        want)  # fmt: skip
    assert count(200) == before + 3
    y = rows(2, seed=3)
    buf = io.BytesIO()
    np.save(buf, y.astype(">f4"))
    code, _, raw = _post(url, buf.getvalue(), "application/x-npy")
    assert code == 200, raw
    np.testing.assert_array_equal(np.load(io.BytesIO(raw)), np.asarray(m(y)))


def test_json_integers_outside_the_inputs_dtype_are_refused_not_wrapped():
    """[[1, 2**31]] for an int32 input was cast to -2**31 and answered 200."""
    from symjax_mlp.serving._bodies import decode

    h = sm.hybridize(lambda p, x: x * p, jnp.int32(2))
    with sm.serving.Batcher(h, example=np.ones((1, 2), np.int32), max_batch=2) as b:
        for big in (2**31, -(2**31) - 1, 2**40, 2**63, 2**70):
            body = json.dumps({"inputs": [[1, big]]}).encode()
            with pytest.raises(sm.SignatureError, match=r"outside int32's range"):
                decode(b, body, "application/json")
        xs, _ = decode(b, json.dumps({"inputs": [[1, 2**31 - 1]]}).encode(), "application/json")
        assert xs[0].dtype == np.int32 and xs[0].tolist() == [[1, 2**31 - 1]]
        with pytest.raises(sm.SignatureError, match=r"send integers"):
            decode(b, json.dumps({"inputs": [[1.5, 2]]}).encode(), "application/json")


def test_http_health_signature_and_metrics(server):
    url, _ = server
    assert _post(url, json.dumps({"inputs": rows(1).tolist()}).encode(), "application/json")[0]
    code, _, body = _get(url, "/health")
    assert code == 200 and json.loads(body)["status"] == "ok"
    code, _, body = _get(url, "/signature")
    sig = json.loads(body)
    assert sig["inputs"] == [{"path": "args[0]", "shape": ["b", 512], "dtype": "float32"}]
    assert sig["buckets"] == [1, 2, 4, 8]
    assert sig["params_as_constants"] is False
    assert sig["merges"] is True and sig["why_alone"] == ""
    code, headers, body = _get(url, "/metrics")
    assert code == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    assert re.search(r"^symjax_mlp_batcher_requests_total [1-9]\d*$", text, re.M)
    assert re.search(r'^symjax_mlp_http_requests_total\{code="200"\} [1-9]\d*$', text, re.M)
    assert re.search(r"^# TYPE symjax_mlp_batcher_request_seconds histogram$", text, re.M)


def test_http_concurrent_clients_get_their_own_answers(server):
    url, m = server
    inputs = [rows(1 + i % 3, seed=100 + i) for i in range(24)]
    wants = [np.asarray(m(x)) for x in inputs]

    def one(i):
        body = io.BytesIO()
        np.save(body, inputs[i])
        code, _, raw = _post(url, body.getvalue(), "application/x-npy")
        return code, np.load(io.BytesIO(raw), allow_pickle=False)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(len(inputs))))
    for (code, got), want in zip(answers, wants, strict=True):
        assert code == 200
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_serving_without_the_extra_says_which_extra_to_install(tmp_path):
    art = sm.chapter.export_mlp(tmp_path / "mlp")
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('starlette', 'uvicorn'):\n"
        "            raise ImportError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    code = blocker + (
        "import symjax_mlp.serving\n"  # works without the extra
        "print('starlette' in sys.modules)\n"
        "from symjax_mlp.cli import main\n"
        f"sys.exit(main(['serve', {str(art.path)!r}, '--port', '0']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.stdout.strip() == "False"
    assert out.returncode == 2, out.stderr
    assert "pip install 'symjax_mlp[serve]'" in out.stderr


def test_serve_refuses_a_bad_port(capsys):
    from symjax_mlp.cli import main

    assert main(["serve", "somewhere", "--port", "70000"]) == 2
    assert "--port: must be an int from 0 to 65535" in capsys.readouterr().err


def test_serve_says_its_prefix_once_for_a_bad_host(capsys):
    """The library's "serve:" came after the CLI's "symjax-mlp serve: error:" (said twice)."""
    from symjax_mlp.cli import main

    assert main(["serve", "somewhere", "--host", "", "--dispatch", "async"]) == 2
    err = capsys.readouterr().err
    assert "symjax-mlp serve: error: host='' names no address" in err, err
    assert err.count("serve:") == 2, err  # the error line, and the line naming --host


def test_serve_passes_request_timeout_from_the_command_line(monkeypatch):
    from symjax_mlp.cli import main

    seen = {}
    monkeypatch.setattr(sm.serving, "serve", lambda path, *, ready, **kw: seen.update(kw))
    assert main(["serve", "my_mlp", "--dispatch", "async"]) == 0
    assert seen["request_timeout"] == 60.0
    assert main(["serve", "my_mlp", "--dispatch", "async", "--request-timeout", "2.5"]) == 0
    assert seen["request_timeout"] == 2.5


def test_serve_passes_warm_up_timeout_from_the_command_line(monkeypatch):
    """The warm-up's TimeoutError names warm_up_timeout, which serve() and the CLI could not
    set: a model that compiles for longer than 300 s could not be served at all."""
    from symjax_mlp.cli import main

    seen = {}
    monkeypatch.setattr(sm.serving, "serve", lambda path, *, ready, **kw: seen.update(kw))
    assert main(["serve", "my_mlp", "--dispatch", "async"]) == 0
    assert seen["warm_up_timeout"] == 300.0  # the Batcher's default
    for given, passed in (("2.5", 2.5), ("inf", math.inf)):  # inf: no limit
        assert main(["serve", "my_mlp", "--dispatch", "async", "--warm-up-timeout", given]) == 0
        assert seen["warm_up_timeout"] == passed


def test_serve_freezes_the_gc_once_the_model_is_ready(monkeypatch, capsys):
    import gc

    from symjax_mlp.cli import main

    seen = []

    def fake_serve(path, *, ready, **settings):  # stands in for load, compile, bind, run
        seen.append(gc.get_freeze_count())
        ready("http://127.0.0.1:1234")
        seen.append(gc.get_freeze_count())

    monkeypatch.setattr(sm.serving, "serve", fake_serve)
    try:
        assert main(["serve", "my_mlp", "--dispatch", "async"]) == 0
    finally:
        gc.unfreeze()
    assert seen[0] == 0 and seen[1] > 1000  # what existed when it was ready, frozen
    assert "serving my_mlp on http://127.0.0.1:1234" in capsys.readouterr().out


# -- the serving benchmark --------------------------------------------------------------------
@pytest.mark.slow  # a benchmark section (~5-12 s): CI runs it with `-m slow`
def test_bench_serving_latency_and_batcher_sections():
    from benchmarks import serving as lab  # the laboratory, scripts/benchmarks

    result = lab.bench_serving(
        sections=("latency", "batcher"),
        sizes=(16, 2),
        in_features=8,
        calls=20,
        repeats=2,
        torch=False,
        clients=(1, 4),
        requests=40,
        max_batch=8,
        batcher_dispatch=("sync", "async", "pinned"),
    )
    modes = [(r["mode"], r["dispatch"], r["constants"]) for r in result["latency"]["rows"]]
    # each set in its own fresh process; the last with the params compiled in
    assert modes == [("jax", "async", False), ("jax", "sync", False), ("jax", "sync", True)]
    assert (result["latency"]["rounds"], result["latency"]["calls_per_round"]) == (2, 20)
    for r in result["latency"]["rows"]:
        for form in ("device", "numpy"):
            t = r["forms"][form]
            assert 0 < t["p50_s"] <= t["p99_s"] and t["n"] == 40
    many = len(os.sched_getaffinity(0)) > 1  # else there is nothing to pin: a note says so
    runs = (("batcher", "sync"), ("batcher_async", "async"), ("batcher_pinned", "sync"))
    for key, dispatch in runs[: 3 if many else 2]:
        b = result[key]
        assert b["dispatch"] == dispatch and b["traces_while_serving"] == 0
        assert b["buckets"] == [1, 2, 4, 8]
        kinds = ("threads", "futures", "asyncio")
        assert [(r["clients"], r["kind"]) for r in b["rows"]] == [
            (c, kind) for c in (1, 4) for kind in kinds
        ]
        for r in b["rows"]:
            assert r["requests"] == 40 and r["throughput_rps"] > 0 and r["direct_rps"] > 0
            assert r["vs_direct"] == pytest.approx(r["throughput_rps"] / r["direct_rps"])
        bare = b["bare_at_formed_batch"]  # the bare model's cost a row at the batch formed
        assert set(bare) == set(kinds) and all(v["clients"] == 4 for v in bare.values())
        assert all(v["batch"] >= 1 and v["per_row_s"] > 0 for v in bare.values())
        c1 = b["c1"]  # direct calls and b(x) interleaved: the same number of each
        assert c1["direct"]["n"] == c1["batcher"]["n"] >= 200
        assert c1["added_p50_s"] == pytest.approx(c1["batcher"]["p50_s"] - c1["direct"]["p50_s"])
    names = [t["name"] for t in result["targets"]]
    assert "batcher_overhead_c1" in names and "batcher_throughput_4_threads" in names
    assert "batcher_overhead_c1_async" in names and "batcher_throughput_4_futures_async" in names
    assert "batcher_throughput_4_asyncio" in names
    text = lab.format_serving(result)
    assert result["batcher"]["cpus"] == sorted(os.sched_getaffinity(0))
    if many:  # the pinned run's process ran on one CPU, the others on all of this one's
        first = min(os.sched_getaffinity(0))
        assert result["batcher_pinned"]["cpus"] == result["batcher_pinned"]["pinned"] == [first]
        assert "batcher_throughput_4_futures_pinned" in names
        assert f"sync dispatch, pinned to CPU {first}, in-process clients" in text
    else:
        assert "batcher_pinned" not in result and "pinned batcher rows skipped" in text
    assert "Per-request latency" in text and "Micro-batcher" in text and "Targets" in text
    json.dumps(result)  # the --json output


@pytest.mark.slow  # a benchmark section (~5-12 s): CI runs it with `-m slow`
def test_bench_serving_http_section_drives_serve_and_both_bare_endpoints():
    """The HTTP rows: ``symjax-mlp serve`` and the bare endpoints (orjson, stdlib json), each a
    server process, every request answered 200, the ratios those of the rows, the server
    ending cleanly on SIGINT, the targets named."""
    from benchmarks import serving as lab

    result = lab.bench_serving(
        sections=("http",), sizes=(16, 2), in_features=8, torch=False, http_clients=(1, 4),
        http_requests=40, max_batch=8,
    )  # fmt: skip
    h = result["http"]
    assert [(r["clients"], r["body"]) for r in h["rows"]] == [
        (c, body) for c in (1, 4) for body in ("npy", "json")
    ]
    assert all(r["errors"] == 0 and r["throughput_rps"] > 0 for r in h["rows"])
    for key in ("bare", "bare_stdlib"):
        assert [(r["clients"], r["errors"]) for r in h[key]] == [(1, 0), (4, 0)]
    for r in [*h["rows"], *h["bare"], *h["bare_stdlib"]]:  # each row: 3 interleaved runs
        assert len(r["runs_rps"]) == h["rounds"] == 3
        assert r["throughput_rps"] == sorted(r["runs_rps"])[1]  # the median run's
        assert r["server_cpu_s"] > 0  # its server's CPU a request (Linux: /proc)
    for r in h["rows"]:
        if r["body"] == "json":
            (bare,) = (b for b in h["bare"] if b["clients"] == r["clients"])
            assert r["vs_bare"] == pytest.approx(r["throughput_rps"] / bare["throughput_rps"])
            assert r["rows_per_batch"] >= 1
    assert h["server_exit_code"] == 0
    names = {t["name"]: t["target"] for t in result["targets"]}
    assert names["http_vs_bare_c1"] == ">= 0.85" and names["http_vs_bare_c4"] == ">= 0.9"
    text = lab.format_serving(result)
    assert "serve/bare at 4 client(s)" in text and "(starlette, stdlib json, constant)" in text


def test_bench_serving_refuses_unknown_sections():
    from benchmarks import serving as lab

    with pytest.raises(sm.ConfigError, match="unknown section"):
        lab.bench_serving(sections=("grpc",))
    with pytest.raises(sm.ConfigError, match="'sync', 'async' and/or 'pinned'; got \\['gpu'\\]"):
        lab.bench_serving(sections=("batcher",), batcher_dispatch=("gpu",))


def test_the_gpu_check_script_exists_and_is_bash():
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_check.sh")
    with open(script) as f:
        text = f.read()
    assert text.startswith("#!/usr/bin/env bash")
    assert "--xla_gpu_enable_command_buffer=" in text
    out = subprocess.run(["bash", "-n", script], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


def test_serve_params_as_constants_answers_as_a_plain_load_and_finishes_on_sigterm(tmp_path):
    art = sm.chapter.export_mlp(tmp_path / "mlp")
    proc, url = _start(art.path, "--max-batch", "4", "--params-as-constants")
    plain = sm.load(art.path)
    try:
        assert json.loads(_get(url, "/signature")[2])["params_as_constants"] is True
        for n, bucket in ((1, 1), (3, 4)):  # a whole bucket, and 3 rows padded to 4
            x = rows(n, seed=n)
            body = io.BytesIO()
            np.save(body, x)
            status, _, raw = _post(url, body.getvalue(), "application/x-npy")
            assert status == 200, raw
            padded = np.concatenate([x, np.zeros((bucket - n, 512), np.float32)])
            want = np.asarray(plain(padded))  # what the batcher ran, plain
            np.testing.assert_array_equal(np.load(io.BytesIO(raw)), want[:n])
    finally:  # SIGTERM (a process manager's stop), not the fixture's SIGINT: a clean exit too
        code, out, err = _stop(proc, signal.SIGTERM)
    assert code == 0, err
    assert "shut down cleanly" in out


def test_serve_params_as_constants_on_iree_is_a_clear_error(tmp_path, capsys):
    from symjax_mlp.cli import main

    art = sm.chapter.export_mlp(tmp_path / "mlp")
    args = ["serve", str(art.path), "--runtime", "iree", "--params-as-constants"]
    assert main([*args, "--dispatch", "async"]) == 2
    err = capsys.readouterr().err
    assert "only the JAX runtime compiles the weights" in err and "Traceback" not in err


def test_serve_one_entry_point_of_an_artifact(tmp_path):
    x = np.ones((2, 4), np.float32)
    double = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    plus = sm.hybridize(lambda p, x: x + p, jnp.float32(2))
    art = sm.export({"double": double, "plus": plus}, tmp_path / "m", example=x)
    proc, url = _start(art.path, "--entry", "plus")
    try:
        body = json.dumps({"inputs": x.tolist()}).encode()
        status, _, body = _post(url, body, "application/json")
        assert status == 200 and json.loads(body)["outputs"] == np.full((2, 4), 3.0).tolist()
    finally:
        code, _, err = _stop(proc)
    assert code == 0, err


def test_serve_refuses_what_cannot_be_batched_in_one_line(tmp_path, capsys):
    """An rng-key input, a scalar input, a symbolic size past the batch: honest artifacts a
    batcher cannot serve. ``symjax-mlp serve`` says so in one line and exits 2 (a
    ConfigError), not with a traceback."""
    from symjax_mlp.cli import main

    noisy = sm.hybridize(lambda p, k, x: x * p + jax.random.normal(k, x.shape), jnp.float32(1))
    scalar = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    seq = sm.hybridize(lambda p, x, s: x @ p + jnp.sum(s, -1, keepdims=True), jnp.ones((5, 3)))
    arts = {
        "key<fry>[]": sm.export(noisy, tmp_path / "key", batch=None,
                                example=(jax.random.key(0), jnp.ones((2, 3)))),
        "float32[]": sm.export(scalar, tmp_path / "scalar", example=jnp.float32(3), batch=None),
        "float32[b, t]": sm.export(seq, tmp_path / "seq", example=(jnp.ones((2, 5)),
                                   jnp.ones((2, 4))), shapes=("b, 5", "b, t")),
    }  # fmt: skip
    for what, art in arts.items():
        with pytest.raises(sm.ConfigError, match=re.escape(f"is {what}, but batching needs")):
            sm.serving.Batcher(sm.load(art.path))
        assert main(["serve", str(art.path), "--port", "0", "--dispatch", "async"]) == 2
        err = capsys.readouterr().err
        assert f"is {what}, but batching needs" in err and "Traceback" not in err


@pytest.mark.parametrize("case", [c for c in ZOO if c.stateful], ids=lambda c: c.name)
def test_a_stateful_hybrid_is_served_in_inference_and_its_state_never_moves(case):
    """Each stateful zoo model (BatchNorm, Dropout; linen and nnx), called with its defaults
    (inference): serving it (every bucket warmed, a batch of requests) leaves ``h.state`` as
    it was, and each request gets what ``h`` gives its rows."""
    h = case.hybridize()
    x = np.asarray(case.inputs(0)[0])
    before = keyless(h.state)
    with sm.serving.Batcher(h, example=x, max_batch=4) as b:
        futures = [b.submit(x[i : i + 1]) for i in range(4)]
        got = np.concatenate([f.result(30) for f in futures])
    chex.assert_trees_all_equal(keyless(h.state), before)
    np.testing.assert_allclose(got, h(x, **case.eval), rtol=2e-5, atol=2e-5)


def test_serving_a_hybrid_whose_calls_move_its_rng_leaves_the_stream_alone():
    """linen Dropout with its rng stream: each ``h(x)`` splits the stream, serving does not."""
    h = next(c for c in ZOO if c.name == "linen_dropout").hybridize()
    x = np.ones((2, 5), np.float32)
    before = keyless(h.state)
    with sm.serving.Batcher(h, example=x, max_batch=4) as b:
        b(x), b.submit(x).result(30)
    chex.assert_trees_all_equal(keyless(h.state), before)
    h(x)
    assert not np.array_equal(keyless(h.state)["rngs"]["dropout"], before["rngs"]["dropout"])


@pytest.mark.parametrize("name, flags", [("linen_dropout", {"deterministic": False}),
                                         ("linen_batchnorm", {"train": True})])  # fmt: skip
def test_a_linen_hybrid_served_with_its_training_flags_is_refused(name, flags):
    """A linen Hybrid served with its training flags was accepted: BatchNorm normalised each
    batch by its own rows (one request alone: all zeros), and Dropout, its key held fixed by
    the server, dropped the same units in every batch. Its inference flags still serve."""
    case = next(c for c in ZOO if c.name == name)
    h, x = case.hybridize(), np.asarray(case.inputs(0)[0])
    with pytest.raises(sm.ConfigError, match=r"with kwargs=.* training mode \(state\["):
        sm.serving.Batcher(h, example=x, max_batch=4, kwargs=flags)
    with sm.serving.Batcher(h, example=x, max_batch=4, kwargs=case.eval) as b:
        np.testing.assert_allclose(b(x), h(x, **case.eval), rtol=2e-5, atol=2e-5)


def test_an_nnx_module_in_training_mode_is_refused_by_the_batcher():
    from flax import nnx

    module = NnxModes(nnx.Rngs(0, dropout=1))
    h, x = sm.hybridize(module), np.ones((2, 5), np.float32)
    with pytest.raises(sm.ConfigError, match=r"Batcher\(NnxModes\): .*training mode.*eval\(\)"):
        sm.serving.Batcher(h, example=x, max_batch=4)
    assert h.trace_count == 0 and h.state  # nothing ran, nothing moved
    module.eval()
    want = h(x)
    with sm.serving.Batcher(h, example=x, max_batch=4) as b:
        np.testing.assert_allclose(b(x), want, rtol=2e-5, atol=2e-5)
        module.train()  # training h while it serves: the batcher stays in eval mode
        h(x)
        np.testing.assert_allclose(b(x), want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(b.submit(x).result(30), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "case", [c for c in ZOO if c.name != "linen_dict"], ids=lambda c: c.name
)  # a dict input has no artifact form: an artifact's inputs are positional arrays
def test_every_zoo_model_is_served_from_its_artifact_as_its_hybrid_answers(case, tmp_path_factory):
    """Each zoo model (flags, state, several inputs, static settings; linen, nnx, a function)
    exported in inference mode, loaded and batched: every request gets what ``h`` gives its
    rows, whether its inputs come as arrays or as a JSON body naming each one."""
    from symjax_mlp.serving._bodies import decode

    h = case.hybridize()
    inputs = case.inputs(0)
    arrays = [np.asarray(a) for a in inputs if hasattr(a, "shape")]  # static settings baked
    want = np.asarray(h(*inputs, **case.eval))
    path = zoo_artifact(tmp_path_factory, case, h)
    with sm.serving.Batcher(sm.load(path), max_batch=4) as b:
        futures = [b.submit(*(a[i : i + 1] for a in arrays)) for i in range(4)]
        got = np.concatenate([f.result(30) for f in futures])
        body = {"inputs": {f"args[{i}]": a[:2].tolist() for i, a in enumerate(arrays)}}
        decoded, npy = decode(b, json.dumps(body).encode(), "application/json")
        from_json = b(*decoded)
        assert not npy and b.stats.completed == 5
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(from_json, want[:2], rtol=2e-5, atol=2e-5)


def test_serve_refuses_a_port_that_is_not_an_int_before_the_load():
    """A port as text (read from a config file) or a float was socket's raw TypeError."""
    for port in ("8000", 80.5):
        with pytest.raises(sm.ConfigError, match=rf"cannot listen on 127.0.0.1:{port} .*free port"):
            sm.serving.serve("nothing-here", port=port)


def test_serve_refuses_bad_limits_and_a_bool_port_before_the_load():
    """A bad body_timeout (or request_timeout, ...) was said only after the load and compile
    (minutes, for a large model); port=True bound port 1."""
    for bad in ({"body_timeout": 0}, {"request_timeout": -1.0}, {"max_body_bytes": "1MB"}):
        [option] = bad
        with pytest.raises(sm.ConfigError, match=rf"serve: {option} must be a number > 0"):
            sm.serving.serve("nothing-here", port=0, **bad)
    with pytest.raises(sm.ConfigError, match=r"serve: port must be an int .*; got True"):
        sm.serving.serve("nothing-here", port=True)
    for bad in (-1, "300"):  # the batcher's warm-up: checked before the load too
        with pytest.raises(sm.ConfigError, match=rf"serve\(warm_up_timeout={bad!r}\): pass sec"):
            sm.serving.serve("nothing-here", port=0, warm_up_timeout=bad)


def test_serves_connections_accepted_without_nagles_delay_on_plain_asyncio():
    """serve's socket says it is TCP, so asyncio's own loop (uvicorn's without uvloop, as a
    fresh ``.[serve]`` install has it) sets TCP_NODELAY on each connection: from a bare
    ``socket.socket()`` it did not, and every answer waited ~40 ms on Nagle and delayed ACKs."""
    import socket

    from symjax_mlp.serving._server import bind

    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            s = transport.get_extra_info("socket")
            seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        sock = bind("127.0.0.1", 0)
        sock.listen(1)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            port = sock.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(accept_one())  # asyncio's own event loop, not uvloop
    assert seen and seen[0] != 0


def test_an_example_of_no_input_or_a_flag_left_unset_is_refused_saying_so():
    """example=() reached the model as Python's raw TypeError; a flag with no default said
    "the example's inputs{'nope': 1}", its joining words missing."""
    with pytest.raises(sm.ConfigError, match=r"example=\(\).*holds no input.*x\[None\]"):
        sm.serving.Batcher(lambda x: x, example=())
    for odd, what in ((3, "an int"), (memoryview(b"ab"), "a memoryview")):  # "a int", "a scalar"
        with pytest.raises(sm.ConfigError, match=rf"example=...\): input 0 is {what}; pass an"):
            sm.serving.Batcher(lambda x: x, example=odd)
    h = sm.hybridize(lambda p, x, train: x * p, jnp.float32(2))
    with pytest.raises(sm.ConfigError, match=r"1 input and kwargs={'scale': 1}, but missing"):
        sm.serving.Batcher(h, example=jnp.ones((1, 3)), kwargs={"scale": 1})
    said = r"the example's 1 input, but missing .*'train'; its signature is \(x, train\)"
    with pytest.raises(sm.ConfigError, match=said):
        sm.serving.Batcher(h, example=jnp.ones((1, 3)))


def test_a_default_max_batch_under_an_artifacts_least_batch_takes_that_batch(tmp_path):
    """The default max_batch within WARM_UP_BYTES (4 rows of 40 MiB) refused an artifact
    exported with b >= 8 ("none of buckets=(1, 2, 4) ... pass buckets="), where the default of
    64 had served it at (8, 16, 32, 64): the default takes the least batch the artifact admits."""
    from symjax_mlp.serving._requests import artifact_specs, bucket_sizes

    h = sm.hybridize(lambda p, x: x * p, jnp.float32(0.5))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((8, 3)), shapes=("b, 3",),
                    constraints=("b >= 8",))  # fmt: skip
    bound = artifact_specs(sm.load(art.path))[3]
    assert bucket_sizes("m", None, None, None, bound, row=40 * 2**20) == (8,)
    assert bucket_sizes("m", None, None, None, bound, row=12) == (8, 16, 32, 64)
    with pytest.raises(sm.ConfigError, match=r"none of buckets=\(1, 2, 4\)"):
        bucket_sizes("m", 4, None, None, bound, row=40 * 2**20)  # a max_batch given: as before
