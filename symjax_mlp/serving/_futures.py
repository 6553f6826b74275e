"""A batcher's futures and per-request timings.

A :class:`RequestFuture` is a ``concurrent.futures.Future`` (``wait``, ``as_completed`` and
``add_done_callback`` work on it) built to be settled a whole batch at a time: the futures
of one batcher share one lock, and only the callers blocked in ``result()`` on a future are
woken for it. It is also its own entry in the batcher's queue. An :class:`AsyncRequest`,
what ``asubmit`` returns, is its asyncio counterpart: an awaitable over an ``asyncio.Future``,
and its own queue entry too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures._base import (  # Future's states, which wait()/as_completed() read
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    PENDING,
    RUNNING,
)
from typing import Any

DONE = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED))
GIL = getattr(sys, "_is_gil_enabled", lambda: True)()  # False on a free-threaded build


@dataclasses.dataclass(frozen=True, slots=True)
class RequestTiming:
    """Where one request's time went, in seconds; the last three are its batch's.

    Attributes:
      queued: from the call (or ``submit``) to its batch starting.
      padded: assembling the batch: stacking the requests, zero-filling the padding rows.
      compute: the model call, results on the host (synced).
      split: cutting the results into one per request.
      rows: the request's rows.
      batch_rows: the real rows of its batch (all its requests).
      batch_requests: the requests merged into its batch.
      bucket: the compiled batch size it ran at (``bucket - batch_rows`` padding rows).
    """

    queued: float
    padded: float
    compute: float
    split: float
    rows: int
    batch_rows: int
    batch_requests: int
    bucket: int

    @property
    def total(self) -> float:
        """Seconds from the call to the result."""
        return self.queued + self.padded + self.compute + self.split


def request_timing(t0: float, rows: int, batch: tuple | None) -> RequestTiming | None:
    """A request's timing from its start, its rows and its batch's timings (``None``: it
    never ran)."""
    if batch is None:
        return None
    t1, padded, compute, split, batch_rows, requests, bucket = batch
    return RequestTiming(t1 - t0, padded, compute, split, rows, batch_rows, requests, bucket)


class AsyncRequest:
    """What :meth:`Batcher.asubmit` returns: await it for the result.

    Attributes:
      future: the ``asyncio.Future`` of the result, on the loop that called ``asubmit``
        (for ``asyncio.wait``, ``asyncio.shield``, ...).
      timing: the request's :class:`RequestTiming`, set before the result (``None`` until
        then, and for a request cancelled or failed before it ran).
    """

    __slots__ = ("_batch", "arrays", "future", "rows", "t0")

    def __init__(self, arrays: Sequence[Any], rows: int, t0: float, future: Any) -> None:
        self.arrays, self.rows, self.t0, self.future = arrays, rows, t0, future
        self._batch: tuple | None = None  # as RequestFuture's

    def __await__(self) -> Any:
        return self.future.__await__()

    @property
    def timing(self) -> RequestTiming | None:
        """The request's :class:`RequestTiming` (``None`` until its batch ran)."""
        return request_timing(self.t0, self.rows, self._batch)

    def cancel(self) -> bool:
        """Drops the request if its batch has not started; ``False`` once it has a result."""
        return self.future.cancel()


class RequestFuture(concurrent.futures.Future):
    """What :meth:`Batcher.submit` returns: a ``concurrent.futures.Future`` of the result.

    It works wherever a ``concurrent.futures.Future`` does (done callbacks,
    ``concurrent.futures.wait`` and ``as_completed``, ``asyncio.wrap_future``). The futures
    of one batcher share one lock: the batcher settles a whole batch under one acquire, and
    wakes only the callers blocked in ``result()`` or ``exception()`` on this future.

    Attributes:
      timing: the request's :class:`RequestTiming`, set before the result (``None`` until
        then, and for a request cancelled or failed before it ran).
    """

    # The fields concurrent.futures.Future's methods read, as class defaults: a request sets
    # only what changes. The request itself (inputs, rows, start time) rides on the future.
    _state = PENDING
    _result: Any = None
    _exception: BaseException | None = None
    _wake: threading.Condition | None = None  # made when a caller first blocks on it
    _batch: tuple | None = None  # (t1, padded, compute, split, batch_rows, requests, bucket)
    arrays: Sequence[Any] = ()
    rows = 0
    t0 = 0.0

    def __init__(self, condition: threading.Condition | None = None) -> None:
        # no super().__init__(): it would make a Condition (an RLock) per request
        self._condition = threading.Condition() if condition is None else condition
        self._waiters: list[Any] = []  # concurrent.futures.wait()'s
        self._done_callbacks: list[Callable[[Any], Any]] = []

    @property
    def timing(self) -> RequestTiming | None:
        """The request's :class:`RequestTiming` (``None`` until its batch ran)."""
        return request_timing(self.t0, self.rows, self._batch)

    def _wait(self, timeout: float | None) -> str:
        """Waits (at most ``timeout`` s) for a final state; returns the state."""
        state = self._state
        if GIL and state in DONE:  # settled: _result and _exception were set first
            return state
        with self._condition:
            if self._state not in DONE:
                if self._wake is None:
                    self._wake = threading.Condition(self._condition)
                self._wake.wait_for(lambda: self._state in DONE, timeout)
            return self._state

    def result(self, timeout: float | None = None) -> Any:
        state = self._wait(timeout)
        if state == FINISHED:
            if self._exception is not None:
                try:
                    raise self._exception
                finally:
                    self = None  # as concurrent.futures does: no reference cycle
            return self._result
        if state in DONE:
            raise concurrent.futures.CancelledError()
        raise TimeoutError()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        state = self._wait(timeout)
        if state == FINISHED:
            return self._exception
        if state in DONE:
            raise concurrent.futures.CancelledError()
        raise TimeoutError()

    def cancel(self) -> bool:
        with self._condition:
            if self._state in (RUNNING, FINISHED):
                return False
            if self._state in (CANCELLED, CANCELLED_AND_NOTIFIED):
                return True
            self._state = CANCELLED
            if self._wake is not None:
                self._wake.notify_all()
        self._invoke_callbacks()
        return True

    def set_result(self, result: Any) -> None:
        self._settle(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        self._settle(None, exception)

    def _settle(self, result: Any, exception: BaseException | None) -> None:
        with self._condition:
            if self._state in DONE:
                raise concurrent.futures.InvalidStateError(f"{self._state}: {self!r}")
            _finish(self, result, exception)
        self._invoke_callbacks()


def _finish(f: RequestFuture, result: Any, exception: BaseException | None) -> None:
    """Settles ``f`` (its lock is held); the caller then runs its done callbacks."""
    f._result, f._exception, f._state = result, exception, FINISHED
    if f._waiters:
        for w in f._waiters:
            if exception is None:
                w.add_result(f)
            else:
                w.add_exception(f)
    if f._wake is not None:
        f._wake.notify_all()
