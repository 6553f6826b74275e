"""A batcher's futures and per-request timings.

A :class:`RequestFuture` is a ``concurrent.futures.Future`` (``wait``, ``as_completed`` and
``add_done_callback`` work on it) built to be settled a whole batch at a time: the futures
of one batcher share one lock, and only the callers blocked in ``result()`` on a future are
woken for it. It is also its own entry in the batcher's queue. An :class:`AsyncRequest`,
what ``asubmit`` returns, is its asyncio counterpart: an awaitable over an ``asyncio.Future``,
and its own queue entry too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from symjax_mlp._compat import SharedLockFuture


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
    """A request's timing from its start, rows and batch's timings (``None``: it never ran)."""
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
        self._batch: tuple | None = None  # as RequestFuture's, set by the lane

    def __await__(self) -> Any:
        return self.future.__await__()

    @property
    def timing(self) -> RequestTiming | None:
        """The request's :class:`RequestTiming` (``None`` until its batch ran)."""
        return request_timing(self.t0, self.rows, self._batch)

    def cancel(self) -> bool:
        """Drops the request if its batch has not started; ``False`` once it has a result."""
        return self.future.cancel()


class RequestFuture(SharedLockFuture):
    """What :meth:`Batcher.submit` returns: a ``concurrent.futures.Future`` of the result.

    Attributes:
      timing: the request's :class:`RequestTiming`, set before the result (``None`` until
        then, and for a request cancelled or failed before it ran).
    """

    # The request (inputs, rows, start time) rides on the future, as class defaults; the lane
    # sets _batch, (t1, padded, compute, split, batch_rows, requests, bucket), before the result.
    _batch: tuple | None = None
    arrays: Sequence[Any] = ()
    rows = 0
    t0 = 0.0

    @property
    def timing(self) -> RequestTiming | None:
        """The request's :class:`RequestTiming` (``None`` until its batch ran)."""
        return request_timing(self.t0, self.rows, self._batch)
