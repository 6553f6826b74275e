"""A batcher's executor lane: the queue, the thread that runs batches, and how results go out.

:class:`Lane` is the state a Batcher shares with its thread (which holds no Batcher, so dropping
the Batcher ends the thread). Whoever holds the lane's token runs the model. Whatever the model
raises, ``BaseException`` included, goes to the batch's requests, and the thread goes on.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from symjax_mlp import _compat as compat
from symjax_mlp._compat import after_finish, finish_futures, start_future
from symjax_mlp._errors import SymjaxError
from symjax_mlp.serving._model import unlike, warmed
from symjax_mlp.serving._requests import AsyncRequest, RequestFuture, short
from symjax_mlp.serving._stats import Counters

_CANCELLED = "the batcher was closed with cancel=True"
_DROPPED = concurrent.futures.CancelledError(_CANCELLED)  # what close(cancel=True) hands out
_FOLD_EVERY = 4096  # batches counted before they are folded into the stats
#: A batch of one event loop's requests runs on it (no hand-off) where it last took less than this.
ON_LOOP_SECONDS = 1e-3
clock = time.perf_counter
#: The serving log (the app's too): each message of a traceback cut (see :func:`_cut`).
LOG = logging.getLogger("symjax_mlp.serving")
_LOGGED = 4096  # a traceback's message's characters logged: a model may echo a 64 MB body
_ZEROS = "{self.warming} rows of zeros (each batch size compiled runs once on zeros, as padding is)"
_STUCK = (
    "{self.name}: warming up, the model did not return within {timeout:g} s for a batch of "
    f"{_ZEROS}. Serve a model that returns on zero rows (its while loops ending on them too), or "
    "pass warm_up_timeout= above {timeout:g} if it only compiles slowly (None: no limit); its "
    "thread stays in the call."
)
_RAISED = (  # a note on what the model raised
    f"{{self.name}}: raised by the model warming up, on a batch of {_ZEROS}. Serve a model "
    "that takes the example's inputs and kwargs and runs on zero rows, as padding is in every "
    "batch (no check refusing them, no division by them); out of memory: a smaller max_batch."
)


def _cut(record: logging.LogRecord) -> bool:
    """:data:`LOG`'s filter: each message of ``record``'s traceback cut to :data:`_LOGGED`
    characters, the frames whole (a Formatter writes ``exc_text``, where set, as it is)."""
    if record.exc_info and not record.exc_text:
        parts = traceback.format_exception(*record.exc_info)
        text = "".join(p if len(p) <= _LOGGED else short(p, _LOGGED) + "\n" for p in parts)
        record.exc_text = text.removesuffix("\n")
    return True


LOG.addFilter(_cut)


def _guarded() -> bool:
    """Whether a transfer guard (this thread's, else the global one) refuses a batch's trips to
    the device or back, which are the lane's own: a global "disallow" failed every b(x)."""
    to, back = (
        jax.config.jax_transfer_guard_host_to_device,
        jax.config.jax_transfer_guard_device_to_host,
    )
    return (to is not None and "dis" in to) or (back is not None and "dis" in back)


class Blocking:
    """A blocking ``b(x)`` in the queue: its inputs, and the held lock its caller waits on."""

    __slots__ = ("arrays", "error", "result", "rows", "t0", "waiter")

    def __init__(self, arrays: Sequence[Any], rows: int, t0: float) -> None:
        self.arrays, self.rows, self.t0, self.waiter = arrays, rows, t0, None
        self.result = self.error = None  # its rows, or its batch's error


def _resolve(items: Iterable[tuple[AsyncRequest, Any]], error: BaseException | None) -> None:
    """On an event loop: hands a batch's results to that loop's awaiting tasks."""
    for r, result in items:
        if (f := r.future).done():  # cancelled by its awaiter meanwhile
            continue
        if error is None:
            f.set_result(result)
        elif error is _DROPPED:  # by close(cancel=True); a model's CancelledError is its error
            f.cancel(_CANCELLED)
        else:
            r.fail(error)


def _wake_loops(items: list[tuple[AsyncRequest, Any]], error: Any) -> None:
    """One wake-up per event loop for a whole batch."""
    by_loop: dict[Any, list[tuple[AsyncRequest, Any]]] = {}
    for item in items:
        by_loop.setdefault(item[0].future.get_loop(), []).append(item)
    for loop, mine in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits these now
            loop.call_soon_threadsafe(_resolve, mine, error)


class Lane:
    """The executor state, shared by the batcher and its thread (which holds no Batcher)."""

    def __init__(self, call: Callable[..., Any], row_specs, buckets, name: str = "Batcher",
                 merges: bool = True) -> None:  # fmt: skip
        self.call, self.name, self.merges = call, name, merges
        self.row_shapes = [tuple(s.shape[1:]) for s in row_specs]
        self.dtypes = [np.dtype(s.dtype) for s in row_specs]
        self.buckets, self.max_batch = tuple(buckets), buckets[-1]
        # where it does not merge, each request at its own rows: a size compiled at first use
        self.bucket_of = [0, *(self.buckets[bisect.bisect_left(self.buckets, n)] if merges else n
                               for n in range(1, self.max_batch + 1))]  # fmt: skip
        self.lock, self.wake = (lock := threading.Lock()), threading.Condition(lock)
        self.sleeping = False  # the thread waits on `wake` and nobody notified it yet
        self.futures = threading.Condition()  # the one lock (an RLock) of all our futures
        self.queue: collections.deque[Blocking | RequestFuture] = collections.deque()
        # the token: whoever pops it (a lone call, the thread) runs the model till it is back
        self.idle, self.closing = [True], False
        self.n = Counters(self.buckets if merges else ())  # else: the sizes run, as they come
        self.to_host: Callable[[Any], Any] = functools.partial(jax.tree.map, np.asarray)
        self.split = lambda out, a, b: jax.tree.map(lambda y: y[a:b].copy(), out)
        self.single = False  # one array out: the split is a list of row copies
        self.tree, self.want = None, []  # the outputs' kind and, by rows, shapes: see warm_up
        self.thread = self.holder = None  # idents: the batcher's thread, a lone call's thread
        self.took: dict[int, float] = {}  # by bucket: seconds its last run took (see ON_LOOP)
        self.since: float | None = None  # when the batch running now started (None: none runs)

    def work(self) -> None:
        """The thread's loop, until the lane is closed and its queue done."""
        while True:
            try:
                self.serve()
                return
            except BaseException:  # the token and the lock were given back on the way out
                LOG.exception("%s: handing out a batch failed; serving goes on", self.name)

    def serve(self) -> None:
        lock, idle = self.lock, self.idle
        with lock:
            while True:
                if not self.queue and self.closing and idle:
                    return
                if not self.queue or not claim(idle):  # a lone call wakes us when it is done
                    self.sleeping = True
                    self.wake.wait()
                    self.sleeping = False
                    continue
                try:
                    while self.queue:  # the lane stays ours while there is work
                        batch, rows = self.take()
                        if batch:
                            lock.release()
                            try:
                                self.run(batch, rows)
                            finally:
                                lock.acquire()
                        if len(self.n.pending) > _FOLD_EVERY:
                            self.n.fold()
                finally:
                    idle.append(True)

    def nudge(self) -> None:
        """Wakes the thread if it sleeps (the lock is held): one notify per wake-up."""
        if self.sleeping:
            self.sleeping = False
            self.wake.notify()

    def start(self, timeout: float | None) -> threading.Thread:
        """Starts the thread (warm-up, then batches); waits ``timeout`` s at most for warm-up."""
        ready, failed, self.warming = threading.Event(), [], self.buckets[0]  # its bucket now
        x64 = jax.config.jax_enable_x64  # the caller's: a `with jax.enable_x64(True)` block's

        def warm_then_work() -> None:  # its batches' trips to the device and back are ours:
            # a global "disallow" refused them at warm-up; its 64-bit types are the caller's:
            with jax.transfer_guard("allow"), jax.enable_x64(x64):  # a thread starts without
                try:
                    self.warm_up()
                except BaseException as e:
                    failed.append(e)
                ready.set()
                failed or self.work()  # returns at once if the caller stopped waiting: closing

        thread = threading.Thread(target=warm_then_work, name=self.name, daemon=True)
        thread.start()
        self.thread = thread.ident
        try:
            if not ready.wait(timeout):
                raise TimeoutError(_STUCK.format(self=self, timeout=timeout))
        except BaseException:  # past the timeout, or Ctrl-C: the thread ends after the call
            self.close(False)
            raise
        if failed:
            raise failed[0]
        return thread

    def warm_up(self) -> None:
        """Compiles each bucket (where it does not merge, the smallest); checks the outputs
        (:func:`~symjax_mlp.serving._model.warmed`)."""
        rows, first = list(zip(self.row_shapes, self.dtypes, strict=True)), None
        for bucket in self.buckets if self.merges else self.buckets[:1]:
            self.warming = bucket
            try:
                out = self.call(*[np.zeros((bucket, *s), d) for s, d in rows])
            except Exception as e:  # the model's own, on rows no caller sent (a Hybrid's say why)
                isinstance(e, SymjaxError) or e.add_note(_RAISED.format(self=self))
                raise
            pairs, self.tree, first = warmed(self.name, out, bucket, first)
        # by a batch's rows: its outputs' shapes (at its bucket's rows) and dtypes
        want = {b: [((b, *y.shape[1:]), y.dtype) for _, y in pairs] for b in set(self.bucket_of)}
        self.want = [want[b] for b in self.bucket_of]
        if isinstance(out, jax.Array | np.ndarray):  # one array out, as at every bucket
            self.to_host, self.single = np.asarray, True
            self.split = lambda out, a, b: out[a:b].copy()

    def quick(self, loop: Any) -> bool:
        """Whether the queue's next batch holds only ``loop``'s requests, at a bucket whose
        last run took less than ``ON_LOOP_SECONDS`` (the lock is held)."""
        rows = 0
        for r in self.queue:
            if rows + r.rows > self.max_batch:
                break
            if type(r) is not AsyncRequest or r.future.get_loop() is not loop:
                return False
            rows += r.rows
            if not self.merges:
                break
        return self.took.get(self.bucket_of[rows], ON_LOOP_SECONDS) < ON_LOOP_SECONDS

    def take(self) -> tuple[list[Any], int]:
        """Pops the next batch (FIFO, at most max_batch rows); drops cancelled futures."""
        batch: list[Any] = []
        rows, q, limit, alone = 0, self.queue, self.max_batch, not self.merges
        with self.futures:  # a future turns running here, or was cancelled while queued
            while q and rows + q[0].rows <= limit:
                r = q.popleft()
                if type(r) is AsyncRequest:
                    gone = r.future.cancelled()
                else:
                    gone = type(r) is RequestFuture and not start_future(r)
                if gone:  # cancelled while queued
                    self.n.cancelled += 1
                    continue
                batch.append(r)
                rows += r.rows
                if alone:  # never merged with another request: its rows mix
                    break
        return batch, rows

    def run(self, batch: list[Any], rows: int, loop: Any = None) -> None:
        """Runs one batch (on the batcher's thread, or on the event loop ``loop``); settles it."""
        try:
            results, record = self.compute(batch, rows, [r.t0 for r in batch])
        except BaseException as e:  # every request of the batch gets it; the lane carries on
            self.settle(batch, None, e, loop=loop)  # (SystemExit too, as a ThreadPoolExecutor's)
        else:
            self.settle(batch, results, None, (*record[1:], len(batch)), loop)

    def compute(self, batch: Sequence[Any], rows: int, t0: Any) -> tuple[list[Any], tuple]:
        """The model's results for ``batch`` (``rows`` rows), one per request, and its timing
        record ``(t0, t1, ..., t4, rows, bucket)``: t0 its request's or requests' starts."""
        if _guarded():  # a caller's transfer guard (b(x), on an event loop): the trips are ours
            with jax.transfer_guard("allow"):
                return self.compute(batch, rows, t0)
        nested = self.since is not None  # b(x) inside the model: the outer batch's mark stays
        try:  # counted: in bulk, later, or at once as failed
            t1 = clock()
            self.since = self.since if nested else t1
            bucket = self.bucket_of[rows]
            inputs = self.assemble([r.arrays for r in batch], rows, bucket)
            t2 = clock()
            raw = self.call(*inputs)
            out, want = self.to_host(raw), self.want[rows]  # its warm-up's, at this bucket
            if self.single:
                same = out.shape == want[0][0] and out.dtype is want[0][1]
            else:
                leaves, tree = jax.tree.flatten(out)
                same = tree == self.tree
                for y, (shape, dtype) in zip(leaves, want, strict=True) if same else ():
                    same = same and y.shape == shape and y.dtype is dtype
            if not same and (error := unlike(self, raw, rows)):
                raise error
            t3 = clock()
            self.took[bucket] = t3 - t2
            if len(batch) == 1:  # a lone request: one copy of its rows, no views
                results = [self.split(out, 0, rows)]
            elif self.single and rows == len(batch):  # one row each: the common batch
                results = list(out[:rows, None].copy())  # one copy; a view per row
            else:
                results, start, split = [], 0, self.split
                for r in batch:
                    results.append(split(out, start, start + r.rows))
                    start += r.rows
        except BaseException:
            with self.lock:
                self.n.failed += len(batch)
            raise
        finally:
            self.since = self.since if nested else None
        record = (t0, t1, t2, t3, clock(), rows, bucket)
        self.n.pending.append(record)  # before any result
        return results, record

    def settle(self, batch, results, error, timing=None, loop=None) -> None:
        """Hands out a batch's results (or ``error``) under one lock, then the done callbacks;
        on ``loop``, where only its awaited requests run, to them at once."""
        results = results or [None] * len(batch)
        if loop is not None:  # see Batcher._end_of_pass
            for r in batch:
                r.batch_record = timing
            return _resolve(zip(batch, results, strict=True), error)
        futures, settled, awaited = [], [], []
        with self.futures:
            for r, result in zip(batch, results, strict=True):
                kind = type(r)
                if kind is Blocking:
                    r.result, r.error = result, error
                    r.waiter.release()
                    continue
                r.batch_record = timing
                if kind is AsyncRequest:
                    awaited.append((r, result))
                else:
                    futures.append(r)
                    settled.append(result)
            finish_futures(futures, settled, error)
        _wake_loops(awaited, error)
        after_finish(futures, settled, error)

    def run_alone(self, request: Any) -> Any:
        """Runs one request on the calling thread, the token's holder: its result."""
        self.n.alone += 1  # only the token's holder writes it
        return self.compute((request,), request.rows, request.t0)[0][0]

    def release(self) -> None:
        """Gives the token back, and wakes the thread if requests came meanwhile."""
        self.holder = None
        if not compat.GIL or len(self.n.pending) > _FOLD_EVERY:
            with self.lock:
                if len(self.n.pending) > _FOLD_EVERY:
                    self.n.fold()
                self.idle.append(True)
        else:  # an enqueuer looks for the token under the lock after appending, so it either
            self.idle.append(True)  # sees it (and wakes the thread) or appended before we look
        if self.queue or self.closing:
            with self.lock:
                self.nudge()

    def assemble(self, requests: Sequence[Any], rows: int, bucket: int) -> Sequence[Any]:
        """The model's inputs: the requests' arrays stacked, zero rows up to the bucket."""
        if len(requests) == 1 and rows == bucket:
            return requests[0]
        inputs = []
        for i, dtype in enumerate(self.dtypes):
            parts = [arrays[i] for arrays in requests]
            if bucket > rows:
                parts.append(np.zeros((bucket - rows, *self.row_shapes[i]), dtype))
            inputs.append(np.concatenate(parts))
        return inputs

    def close(self, cancel: bool) -> None:
        with self.lock:
            self.closing = True
            dropped = [self.queue.popleft() for _ in range(len(self.queue))] if cancel else []
            self.n.cancelled += len(dropped)
            self.wake.notify_all()
        _wake_loops([(r, None) for r in dropped if type(r) is AsyncRequest], _DROPPED)
        for r in dropped:
            if type(r) is RequestFuture:
                r.cancel()
                r.set_running_or_notify_cancel()  # tells concurrent.futures.wait(), too
            elif type(r) is Blocking:
                r.error = concurrent.futures.CancelledError(_CANCELLED)
                r.waiter.release()


def claim(idle: list[bool]) -> bool:
    """Takes the lane's token if it is there (``list.pop`` is atomic)."""
    try:
        return idle.pop()
    except IndexError:
        return False
