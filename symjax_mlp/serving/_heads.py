"""Request heads within bounds: what uvicorn leaves open before the app sees a request.

uvicorn (over httptools) reads a request line and headers of any size, for as long as the
client takes, and keeps a connection that sends nothing open for ever: ``max_connections``
such clients shut everyone else out, and a header of a few hundred MB is held in memory
(:class:`~symjax_mlp.serving._bodies.Intake` bounds bodies only). As nginx's
``client_header_timeout`` and ``large_client_header_buffers``: a head (or, on a new
connection, its first byte) must arrive within ``head_timeout`` seconds (else 408, and the
connection is closed) and within :data:`MAX_HEAD_BYTES` (else 431). An answer given before
the body ended (413, 408, 503) closes the connection lingering, so the client reads it; a
client that half-closes after its request is answered.
"""

from __future__ import annotations

import json
from typing import Any

#: The most bytes of one request's line and headers (nginx allows 4 x 8 KiB by default).
MAX_HEAD_BYTES = 64 * 2**10


def _refusal(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": "BadRequest", "message": message}).encode()
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    return head.encode() + body


class _Lingering:
    """A connection's transport whose close, after an answer given before the request's body
    ended (413, 408, 503), lingers: it sends FIN, then drops what the client still sends until
    it stops for :data:`LINGER` seconds (at most ``limit``), so that the client reads the
    answer rather than a reset (a close with unread bytes is one): nginx's lingering_close."""

    def __init__(self, transport: Any, protocol: Any, limit: float) -> None:
        self._t, self._protocol, self._limit = transport, protocol, limit
        self.lingering, self._last = False, 0.0

    def __getattr__(self, name: str) -> Any:  # once a name: then found on the instance
        value = getattr(self._t, name)
        setattr(self, name, value)
        return value

    def is_closing(self) -> bool:
        return self.lingering or self._t.is_closing()

    def close(self) -> None:
        cycle = self._protocol.cycle
        unread = cycle is not None and cycle.more_body
        if not unread or self.is_closing() or not self._t.can_write_eof():
            self._t.close()
            return
        self.lingering = True
        self._t.write_eof()
        self._t.resume_reading()
        loop = self._protocol.loop
        self._end, self._last = loop.time() + self._limit, loop.time()
        loop.call_later(LINGER, self._check)

    def dropped(self) -> None:  # bytes came, and were dropped
        self._last = self._protocol.loop.time()

    def _check(self) -> None:
        now = self._protocol.loop.time()
        if now >= self._end or now - self._last >= LINGER:
            self._t.close()
        else:
            self._protocol.loop.call_later(LINGER, self._check)


#: Seconds a lingering close waits for the client to send more.
LINGER = 2.0


def bounded_heads(head_timeout: float, max_head_bytes: int = MAX_HEAD_BYTES) -> type:
    """uvicorn's HTTP protocol class (``uvicorn.Config(http=...)``), with heads bounded."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class BoundedHeads(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(_Lingering(transport, self, head_timeout))
            self._head_bytes, self._head_timer = 0, None
            self._arm()

        def _waiting(self) -> bool:  # for a head: none yet, or the last one answered
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(head_timeout, self._late, self.cycle)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _late(self, cycle: Any) -> None:
            self._head_timer = None
            if self._waiting() and self.cycle is cycle and not self.transport.is_closing():
                if self._head_bytes:  # a head begun and not finished: say why
                    self.transport.write(_refusal(408, "Request Timeout", (
                        f"the request's headers did not arrive within {head_timeout:g} s "
                        f"({self._head_bytes} bytes came). Send the whole request at once."
                    )))  # fmt: skip
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:  # answered: the rest of the body is not read
                self.transport.dropped()
                return
            cycle = self.cycle
            super().data_received(data)
            if self.transport.is_closing():
                return
            if not self._waiting():  # a head arrived: the app bounds the rest
                self._head_bytes = 0
                self._disarm()
                return
            if self.cycle is cycle:  # no head ended in this chunk: all of it is head
                self._head_bytes += len(data)
            if self._head_bytes > max_head_bytes:
                self._disarm()
                self.transport.write(_refusal(431, "Request Header Fields Too Large", (
                    f"the request's line and headers passed {max_head_bytes} bytes; send "
                    "shorter ones."
                )))  # fmt: skip
                self.transport.close()
                return
            self._arm()

        def eof_received(self) -> bool | None:
            # A client that half-closed after its whole request (printf ... | nc -N) got no
            # answer: uvicorn closed at once. It is answered, then the connection closed.
            cycle = self.cycle
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                cycle.keep_alive = False
                return True
            return super().eof_received()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedHeads
