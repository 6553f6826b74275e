"""Request bodies read within bounds (size: 413; pace: 408; bytes held at once: 503), as nginx
and Apache read them, on the server's one loop (so no lock). The bytes held count bodies being
read and (through ``serve``'s connections) answers waiting for a client to read them. One timer
per loop watches every read (:class:`_Deadlines`): the timeout is the same for all, so deadlines
kept in the order set are in time order; a body behind :data:`MIN_BODY_RATE` has its own timer.
"""

from __future__ import annotations

import asyncio
import numbers
from collections.abc import Sequence
from typing import Any

from symjax_mlp._errors import ConfigError
from symjax_mlp._specs import TensorSpec
from symjax_mlp.serving._bodies import BadRequest
from symjax_mlp.serving._requests import artifact_specs, default_batch, headed, row_size

#: Bytes a second a body must average after its first ``body_timeout`` seconds (a phone on
#: GPRS sends 5 000; Apache's mod_reqtimeout asks 500 by default).
MIN_BODY_RATE = 500
#: A body must end within this many ``body_timeout`` however fast it comes (10 min by default):
#: at :data:`MIN_BODY_RATE`, 64 MiB held a connection for 37 h.
MAX_BODY_TIMEOUTS = 10


def check_limits(
    where: str, max_body_bytes: Any, body_timeout: Any, max_inflight_bytes: Any,
    rows: Sequence[TensorSpec] = (), **more: Any,
) -> tuple[int, float, int]:  # fmt: skip
    """The app's limits, ``max_inflight_bytes`` defaulted; a :class:`ConfigError` if bad (or
    one of ``more``, seconds or counts > 0 too, or one of ``rows`` larger than a body)."""
    limits = {"max_body_bytes": max_body_bytes, "body_timeout": body_timeout}
    for option, value in {**limits, "max_inflight_bytes": max_inflight_bytes, **more}.items():
        if option == "max_inflight_bytes" and value is None:  # default: 4 bodies
            value = max_inflight_bytes = 4 * max_body_bytes
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
            raise ConfigError(f"{headed(where)}{option} must be a number > 0; got {value!r}.")
    if max_inflight_bytes < max_body_bytes:  # a body between the two: 503, retry, for ever
        raise ConfigError(
            f"{headed(where)}max_inflight_bytes={max_inflight_bytes} is less than max_body_bytes="
            f"{max_body_bytes}, so a body between the two could never be read; pass "
            "max_inflight_bytes >= max_body_bytes."
        )
    row_bytes(where, rows, max_body_bytes)
    return max_body_bytes, body_timeout, max_inflight_bytes


_ROW = (
    "{where}one row of the model's inputs ({rows}) is {size:,} bytes, more than max_body_bytes="
    "{limit:,}, so no request could carry one, and every batch size would be compiled and run "
    "on such rows first. Pass max_body_bytes >= {size:,} (and max_inflight_bytes with it), or "
    "serve another artifact."
)


def row_bytes(where: str, specs: Sequence[TensorSpec], max_body_bytes: int) -> int:
    """The bytes of one row of ``specs`` (a batcher's: ``b`` first, static sizes after); a
    :class:`ConfigError` where that is more than ``max_body_bytes``."""
    if (size := row_size(specs)) > max_body_bytes:
        rows = ", ".join(f"{s.path} {s.dtype}{list(s.shape[1:])}" for s in specs)
        limit = max_body_bytes
        raise ConfigError(_ROW.format(where=headed(where), rows=rows, size=size, limit=limit))
    return size


def serving_batch(where: str, model: Any, max_batch: Any, limits: tuple[int, float, int]) -> Any:
    """The ``max_batch`` to serve a LoadedModel at under ``limits`` (:func:`check_limits`'),
    checked before its batcher draws a row: where ``max_batch`` is None and its batches merge,
    :func:`default_batch` within ``max_inflight_bytes`` (64, or fewer where 64 rows hold more)."""
    specs, fixed, alone, _ = artifact_specs(model)  # its refusals, as the batcher's
    if any(s.dtype.startswith("key<") for s in specs):
        return max_batch  # no NumPy type: the batcher refuses it
    size = row_bytes(where, specs, limits[0])
    if max_batch is not None or fixed is not None or alone:
        return max_batch
    return default_batch(size, limits[2])


class Intake:
    """Reads bodies within ``max_body_bytes``, ``body_timeout`` and ``max_inflight_bytes``."""

    def __init__(self, max_body_bytes: int, body_timeout: float, max_inflight_bytes: int):
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout
        self.max_inflight_bytes = max_inflight_bytes
        self.held = 0  # bytes of bodies in flight and answers waiting, all connections'
        self._reads = Watch(body_timeout)

    async def read(self, receive: Any, hold: list[int], size: bytes = b"") -> bytes:
        """The body an ASGI ``receive`` gives (``size``: its Content-Length), its bytes counted
        in ``hold[0]`` as they arrive (give them back with :meth:`release`, even when this
        raises): a :class:`BadRequest` (413, 408, 503) or starlette's ``ClientDisconnect``."""
        if size.isdigit() and int(size) > self.max_body_bytes:  # bytes: ASCII digits only
            raise BadRequest(413, _too_large(int(size), self.max_body_bytes))
        chunks, received, more, limit = [], 0, True, self.body_timeout
        task = asyncio.current_task()
        deadlines, cancelling = self._reads.on(task.get_loop()), task.cancelling()
        end = deadlines.set(task)  # moved on as each chunk arrives
        behind = None  # a timer at end + received / MIN_BODY_RATE, while that comes first
        try:
            while more:
                message = await receive()
                if message["type"] != "http.request":  # http.disconnect
                    from starlette.requests import ClientDisconnect

                    raise ClientDisconnect()
                chunk, more = message.get("body", b""), message.get("more_body", False)
                received += len(chunk)
                if received > self.max_body_bytes:
                    raise BadRequest(413, _too_large(received, self.max_body_bytes))
                if self.held + len(chunk) > self.max_inflight_bytes:
                    raise BadRequest(
                        503,
                        f"the server holds too many bytes at once ({self.held}, of bodies and "
                        "of answers its clients have not read, max_inflight_bytes="
                        f"{self.max_inflight_bytes}); retry shortly.",
                    )
                self.held += len(chunk)
                hold[0] += len(chunk)
                chunks.append(chunk)
                if more:
                    due = end + min(received / MIN_BODY_RATE, (MAX_BODY_TIMEOUTS - 1) * limit)
                    if due < deadlines.set(task) or behind is not None:  # a timer of its own
                        behind = deadlines.at(task, due, behind)
        except asyncio.CancelledError:  # ours (408), unless another cancel came too
            if not deadlines.clear(task) or task.uncancel() > cancelling:
                raise
            took, got = deadlines.loop.time() - end + limit, f"{received} bytes"
            why = f"stopped arriving: nothing came for {limit:g} s after {got}"
            if behind is not None:  # the rate's timer (or the cap's, where it came first)
                why = f"came too slowly: {got} in {took:.1f} s, under {MIN_BODY_RATE} bytes/s "
                why += f"after its first {limit:g} s"
                if received / MIN_BODY_RATE >= (MAX_BODY_TIMEOUTS - 1) * limit:
                    why = f"took too long: {got} in {took:.1f} s, past {MAX_BODY_TIMEOUTS} x"
            said = f"the body {why} (body_timeout={limit:g}). Send the whole body at once."
            raise BadRequest(408, said) from None
        finally:
            if behind is not None:
                behind.cancel()
            if deadlines.clear(task):  # late as it ended: the cancel is taken back
                task.uncancel()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def release(self, hold: list[int]) -> None:
        """Gives back what :meth:`read` counted in ``hold``."""
        self.held -= hold[0]
        hold[0] = 0


class Watch:
    """Deadlines of ``limit`` seconds, kept per loop: the last loop that asked for them."""

    def __init__(self, limit: float) -> None:
        self.limit, self._last = limit, None

    def on(self, loop: Any) -> _Deadlines:
        last = self._last
        if last is None or last.loop is not loop:
            last = self._last = _Deadlines(loop, self.limit)
        return last


class _Deadlines:
    """One loop's deadlines, in the order set (so in time order), with one timer at the first."""

    def __init__(self, loop: Any, limit: float) -> None:
        self.loop, self.limit = loop, limit
        self.due: dict[Any, float] = {}
        self.late: set[Any] = set()
        self.timer: asyncio.TimerHandle | None = None

    def set(self, task: Any) -> float:
        """``task`` must read again within ``limit`` seconds from now: when that is."""
        due = self.due
        due.pop(task, None)  # last: the latest deadline
        due[task] = when = self.loop.time() + self.limit
        if self.timer is None:
            self.timer = self.loop.call_at(when, self._expire)
        return when

    def at(
        self, task: Any, when: float, timer: asyncio.TimerHandle | None
    ) -> asyncio.TimerHandle | None:
        """A timer making ``task`` late at ``when``, if before its deadline; ``timer`` cancelled."""
        if timer is not None:
            timer.cancel()
        return self.loop.call_at(when, self.cancel, task) if when < self.due[task] else None

    def cancel(self, task: Any) -> None:
        """Cancels ``task`` for being late."""
        self.due.pop(task, None)
        self.late.add(task)
        task.cancel()

    def clear(self, task: Any) -> bool:
        """Forgets ``task``'s deadline; whether it was cancelled for being late."""
        self.due.pop(task, None)
        late = task in self.late
        self.late.discard(task)
        return late

    def _expire(self) -> None:
        """Cancels the reads past their deadline; waits for the next one."""
        self.timer, now, due = None, self.loop.time(), self.due
        while due:
            task, when = next(iter(due.items()))
            if when > now:
                self.timer = self.loop.call_at(when, self._expire)
                return
            self.cancel(task)


def _too_large(size: int, limit: int) -> str:
    return (
        f"the body has {size} bytes, more than max_body_bytes={limit}; split the request into "
        "smaller ones."
    )
