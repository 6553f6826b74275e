"""The server around the app: ``serve()`` binds a socket, runs uvicorn, stops on a signal.

uvicorn over httptools bounds no head: here a head must come within ``head_timeout`` (else 408),
:data:`MAX_HEAD_BYTES` and :data:`MAX_HEAD_FIELDS` (else 431): nginx's ``client_header_timeout``,
``large_client_header_buffers``, Apache's ``LimitRequestFields``. A client reading no answer for
it is dropped (``send_timeout``); uvicorn's own refusals are the JSON error body, counted on
/metrics as the app's are.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from typing import Any

from symjax_mlp._artifact.format import printable
from symjax_mlp._errors import ConfigError
from symjax_mlp.serving._app import (
    REFUSED,
    create_app,
    drain,
    error_body,
    load_entry,
    model_name,
    print_ready,
    require,
)
from symjax_mlp.serving._batcher import Batcher
from symjax_mlp.serving._fds import Pipeline, bind, room
from symjax_mlp.serving._intake import check_limits, serving_batch
from symjax_mlp.serving._requests import check_count, headed, seconds, short

#: The most bytes of one request's line and headers, or trailers (nginx: 4 x 8 KiB by default).
MAX_HEAD_BYTES = 64 * 2**10
#: The most header fields of one request, or trailers (Apache's LimitRequestFields): each is a
#: tuple of two bytes objects, ~130 bytes held, where its line may be 4 (``a:b``).
MAX_HEAD_FIELDS = 100
#: Seconds a lingering close waits for the client to send more.
LINGER = 2.0


class _Lingering:
    """A connection's transport whose close, after an answer given before the request's body
    ended, lingers (nginx's lingering_close): sends FIN, then drops what the client sends until it
    stops for :data:`LINGER` s (at most ``limit``), so the client reads the answer, not a reset.
    An answer's head goes out with its body: one write, one segment, where uvicorn makes two."""

    def __init__(self, transport: Any, protocol: Any, limit: float) -> None:
        self._t, self._protocol, self._limit = transport, protocol, limit
        self.lingering, self.last, self._head, self._headed = False, 0.0, b"", None

    def __getattr__(self, name: str) -> Any:  # once a name: then found on the instance
        value = getattr(self._t, name)
        setattr(self, name, value)
        return value

    def is_closing(self) -> bool:
        return self.lingering or self._t.is_closing()

    def write(self, data: bytes) -> None:
        cycle = self._protocol.cycle
        if self.is_closing():  # a refusal sent (a 431, a 400 in a body), a client gone: dropped
            return
        if not self._head and cycle is not self._headed and cycle and cycle.response_started:
            self._head, self._headed = data, cycle  # an answer's head: sent with what comes next
        elif data := self._head + data:
            self._t.write(data)
            self._head = b""

    def close(self, linger: bool = False) -> None:  # linger: whatever the request (a 503)
        self.write(b"")  # a head held: sent first
        cut = getattr(self._protocol.cycle, "more_body", False) or self._protocol.pipeline.refusal
        linger = linger or bool(cut)  # a body, or requests sent ahead of a 429, left unread
        if not linger or self.is_closing() or not self._t.can_write_eof():
            return self._t.close()
        self._t.write_eof()
        self._t.resume_reading()
        loop = self._protocol.loop
        self.lingering, self._end, self.last = True, loop.time() + self._limit, loop.time()
        loop.call_later(LINGER, self._check)

    def _check(self) -> None:
        if (now := self._protocol.loop.time()) >= self._end or now - self.last >= LINGER:
            self._t.close()
        else:
            self._protocol.loop.call_later(LINGER, self._check)


def bounded_heads(head_timeout: float, app: Any) -> type:
    """uvicorn's HTTP protocol class (``uvicorn.Config(http=...)``), heads and unread answers
    bounded; its refusals name ``app``'s model and are counted on its /metrics, as its own are."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    model, intake, connections = app.state.model, app.state.intake, app.state.connections
    complete = getattr(AutoHTTPProtocol, "on_headers_complete", None)  # httptools (h11: none)

    class BoundedHeads(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        limit, files = 1 << 62, 1 << 62  # limited(), room() set these
        connections = app.state.connections  # open now: the app's count (1: answered at once)
        _deferred = False  # a 400 waits for the answers to the requests before it

        def connection_made(self, transport: Any) -> None:
            connections[0] += 1
            super().connection_made(_Lingering(transport, self, head_timeout))
            self._head_bytes, self._unsent, self._head_timer, self._send_timer = 0, 0, None, None
            if connections[0] > BoundedHeads.limit:  # refused at once: nothing of it is read
                said = f"the server has {connections[0]} connections open, past max_connections="
                return self._refuse(503, f"{said}{self.limit}; retry shortly.")
            self._bound()

        def send_400_response(self, msg: str) -> None:  # uvicorn's, in text/plain
            why = sys.exception()  # the parser's, which names the fault (where uvicorn's not)
            said = short(printable(msg if why is None else str(why)), 100).rstrip(".")
            said = (f"the request is not HTTP/1.1 that this server reads ({said}); send a "
                    "well-formed request (one Content-Length, or a chunked body).")  # fmt: skip
            status, said = self.pipeline.refusal or (400, said)  # or too many sent ahead: 429
            cycle = self.cycle  # the newest request (httptools queues those pipelined)
            if self._waiting() or cycle.more_body:  # in no request, or within this one's body
                return self._refuse(status, said)
            if not self._deferred:  # after the answers to the requests before it (once: the
                self._deferred, done = True, cycle.on_response  # parser raises on new bytes)
                cycle.on_response = lambda: (done(), self._refuse(status, said))

        def on_headers_complete(self) -> None:  # httptools' callback: a head read, fields bounded
            if len(self.headers) > MAX_HEAD_FIELDS:  # answered by send_400_response (as a 429)
                self.pipeline.refusal = 431, self._fields()
                raise RuntimeError(self.pipeline.refusal[1])  # in httptools: its parsing stops
            complete(self)  # not super(): 50 ns a request, where super() made it 120

        def _fields(self) -> str:  # a 431's message; the fields are dropped (not held to a close)
            said = f"the request came with {len(self.headers)} header lines (or trailers), past the"
            self.headers.clear()
            return f"{said} {MAX_HEAD_FIELDS} this server reads; send at most {MAX_HEAD_FIELDS}."

        def _unsupported_upgrade_warning(self) -> None:  # uvicorn's logs "install websockets"
            # httptools took a body for the new protocol's bytes, and dropped it (h11 reads it)
            heads = dict(self.headers) if getattr(self, "parser", None) is not None else {}
            if heads.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in heads:
                what = short(printable(heads.get(b"upgrade", b"").decode("latin-1")), 40)
                self._refuse(400, (
                    f"the request asks to switch protocols (Upgrade: {what}), which this server "
                    "does not do, so its body was not read; send it without Upgrade."
                ))  # fmt: skip

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.pipeline = Pipeline(self, MAX_HEAD_BYTES)  # requests sent ahead: bounded

        def _refuse(self, status: int, message: str) -> None:
            if not self._waiting():  # the app reads this request: it counts this answer
                self.cycle.scope[REFUSED] = status
            else:  # in no request: counted here
                app.state.answered[status] += 1
            busy = {"retry-after": "1"} if status == 503 else {}  # past max_connections
            kind = "OverloadError" if busy else "BadRequest"
            said = error_body(status, kind, message, model, {"connection": "close", **busy})
            head = b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())
            head += b"".join(b"%s: %s\r\n" % pair for pair in said.raw_headers)
            self.transport.write(head + b"\r\n" + said.body)
            # busy: its request comes, to be dropped (if this process has files left for it)
            self.transport.close(linger=bool(busy) and connections[0] <= self.files)

        def pause_writing(self) -> None:  # answers wait for the client to read them
            super().pause_writing()
            self._sending(self.loop.time())

        def _sending(self, taken: float) -> None:  # every head_timeout / 4 while answers wait
            unsent, now = self.transport.get_write_buffer_size(), self.loop.time()
            taken = now if unsent < self._unsent else taken  # when the client last took some
            intake.held, self._unsent = intake.held + unsent - self._unsent, unsent  # as a body
            if now - taken >= head_timeout:  # nothing taken for it: nginx's send_timeout
                return self.transport.abort()  # their bytes given back as it is lost
            self._send_timer = self.loop.call_later(head_timeout / 4, self._sending, taken)

        def resume_writing(self) -> None:  # drained (or lost): their bytes given back
            super().resume_writing()
            intake.held, self._unsent = intake.held - self._unsent, 0
            if self._send_timer is not None:
                self._send_timer.cancel()

        def _waiting(self) -> bool:  # for a head: none yet, or the last one answered
            return self.cycle is None or self.cycle.response_complete

        def _disarm(self) -> None:
            self._head_bytes = 0
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _late(self, cycle: Any) -> None:
            self._head_timer = None
            if self._waiting() and self.cycle is cycle and not self.transport.is_closing():
                if not self._head_bytes:  # nothing of a head came: nothing to say
                    return self.transport.close()
                self._refuse(408, (
                    f"the request's headers did not arrive within {head_timeout:g} s "
                    f"({self._head_bytes} bytes came). Send the whole request at once."
                ))  # fmt: skip

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:  # answered: the rest of the body is dropped, as it comes
                self.transport.last = self.loop.time()
                return
            cycle, waiting = self.cycle, self._waiting()
            ahead = not waiting and not cycle.more_body  # a request runs, its body read: a head
            unread = None if waiting or ahead else len(cycle.body)  # in a body: its bytes so far
            super().data_received(data)
            if self.transport.is_closing():
                return
            body_came = unread is not None and (len(cycle.body) > unread or not cycle.more_body)
            if self.cycle is not cycle or body_came:  # a head arrived, or body bytes (or its end):
                return self._disarm()  # the app bounds the rest
            self._head_bytes += len(data)  # a head's, or a body's framing or trailers (held whole)
            if ahead:  # no more is read until the answer is sent (as h11), then it is bounded
                return self.flow.pause_reading()
            self._bound()

        def on_response_complete(self) -> None:
            self.transport.write(b"")  # a head held, with no body after it (HEAD, a 204)
            super().on_response_complete()
            if self._head_bytes and not self.transport.is_closing():  # a head came as it ran
                self._bound()

        def _bound(self) -> None:  # the head so far: past the limit, a 431; else it is timed
            if self._head_bytes > MAX_HEAD_BYTES:
                self._disarm()
                said = "the request's line and headers (or its chunked body's trailers) passed"
                return self._refuse(431, f"{said} {MAX_HEAD_BYTES} bytes; send shorter ones.")
            if len(self.headers or ()) > MAX_HEAD_FIELDS:  # a head (or trailers) yet to end
                self._disarm()
                return self._refuse(431, self._fields())
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(head_timeout, self._late, self.cycle)

        def eof_received(self) -> bool | None:  # half-closed after its request (nc -N): answered
            cycle, waiting = self.cycle, self._waiting()
            if not waiting and not cycle.more_body:
                cycle.keep_alive = self._deferred  # (that 400 closes it once answered)
                return True
            if (self._head_bytes if waiting else not cycle.response_started) and not (
                self.transport.is_closing()  # answered early (413), lingering: no second one
            ):  # ended within a request: its head, or a body short of its length (last chunk)
                where = "in its headers" if waiting else "before the end of its body"
                self._refuse(400, (
                    f"the client ended the request (shut down its sending side) {where}; "
                    "send the whole request: a body of exactly Content-Length bytes (or a "
                    "chunked one, to its last, empty chunk)."
                ))  # fmt: skip
            return super().eof_received()

        def connection_lost(self, exc: Exception | None) -> None:
            connections[0] -= 1
            self._disarm()
            self.resume_writing()  # its timer, off
            super().connection_lost(exc)

    return BoundedHeads


def limited(app: Any, heads: type, limit: int) -> Any:
    """``app``, answering a request 503 (the JSON error body, with ``Retry-After``) while more
    than ``limit`` connections of ``heads`` are open or ``limit`` requests run (uvicorn's
    ``limit_concurrency`` answers in text/plain, and refuses every request at 1)."""
    running, heads.limit = [0], limit  # a connection past it: refused as it opens (bounded_heads)
    count = heads.connections  # connections open now: the app's count

    async def limited_app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        if count[0] > limit or running[0] >= limit:
            app.state.answered[503] += 1  # any path's
            message = (f"the server has {count[0]} connections open and {running[0]} requests "
                       f"running, past max_connections={limit}; retry shortly.")  # fmt: skip
            headers = {"Connection": "close", "Retry-After": "1"}
            said = error_body(503, "OverloadError", message, app.state.model, headers)
            return await said(scope, receive, send)
        running[0] += 1
        try:
            return await app(scope, receive, send)
        finally:
            running[0] -= 1

    return limited_app


def serve(
    artifact: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    runtime: str = "jax",
    max_batch: int | None = None,
    max_queue: int = 1024,
    max_body_bytes: int = 64 * 2**20,
    body_timeout: float = 60.0,
    max_inflight_bytes: int | None = None,
    request_timeout: float = 60.0,
    max_connections: int = 1000,
    log_level: str = "warning",
    ready: Callable[[str], None] | None = None,
    entry: str | None = None,
    params_as_constants: bool = False,
    trust: bool = False,
    allow: Iterable[str] | None = None,
    verify_signature: str | os.PathLike[str] | None = None,
    warm_up_timeout: float | None = 300.0,
    where: str = "serve",
) -> None:
    """Serves an artifact over HTTP until SIGINT or SIGTERM, then shuts down cleanly.

    Binds ``host:port`` (``port=0``: a free port), loads the artifact, compiles the batcher's
    buckets, calls ``ready(url)`` and runs uvicorn; on a signal it finishes the requests in flight
    and queued, and returns. For latency on the CPU, call :func:`~symjax_mlp.serving.latency_mode`
    first, and ``gc.freeze()`` in ``ready``, as ``symjax-mlp serve`` does.

    Args:
      artifact: the artifact directory.
      host, port: where to listen.
      runtime: ``"jax"`` or ``"iree"``.
      max_batch, max_queue, warm_up_timeout: see :class:`~symjax_mlp.serving.Batcher` (default
        ``max_batch``: 64, less where 64 rows hold more than ``max_inflight_bytes``).
      max_body_bytes, body_timeout, max_inflight_bytes: see :func:`create_app`; a head must come
        within ``body_timeout`` (64 KiB, 100 fields; else 408, 431), and a client taking none of
        its answers for it is dropped, their bytes counted in ``max_inflight_bytes`` as they wait.
      request_timeout: see :func:`create_app` (504 past it; /health 503 while a batch is longer).
      max_connections: the most connections (and requests) at once; past it, a 503 with
        ``Retry-After`` (a connection past it, as it opens: nothing of it is read).
      log_level: uvicorn's log level.
      ready: called with the URL once the socket is bound (default: prints it).
      entry: the entry point to serve (default: the artifact's default one).
      params_as_constants, trust, allow, verify_signature: passed to :func:`~symjax_mlp.load`.
      where: the heading of its own refusals (``""``: none, where the caller's line names it).

    Raises:
      ConfigError: ``params_as_constants`` with ``runtime="iree"`` or a sharded artifact; a
        row larger than ``max_body_bytes`` (no request could carry it).
      ImportError: starlette or uvicorn is missing (``pip install 'symjax_mlp[serve]'``).
      ArtifactError: the artifact cannot be loaded.
      TimeoutError: the batcher's warm-up took longer than ``warm_up_timeout``.
    """
    require()
    import uvicorn

    check_count(where, "max_connections", max_connections)
    limits = max_body_bytes, body_timeout, max_inflight_bytes  # before the load, as the port
    limits = check_limits(where, *limits, request_timeout=request_timeout)
    waits = {"warm_up_timeout": seconds(warm_up_timeout, "serve(warm_up_timeout")}
    levels = uvicorn.config.LOG_LEVELS
    if not isinstance(log_level, int) and str(log_level).lower() not in levels:
        say = f"log_level must be one of {', '.join(levels)}; got {log_level!r}."
        raise ConfigError(headed(where) + say)
    with bind(host, port, where) as sock:  # before the load: a busy port is said at once
        model = load_entry(
            artifact, entry, runtime=runtime, params_as_constants=params_as_constants,
            trust=trust, allow=allow, verify_signature=verify_signature,
        )  # fmt: skip
        max_batch = serving_batch(where, model, max_batch, limits)  # a row within a body
        sizes = {"max_batch": max_batch, "max_queue": max_queue, "name": model_name(model)}
        batcher = Batcher(model, **sizes, **waits)
        try:
            app = create_app(batcher, max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                max_inflight_bytes=max_inflight_bytes, request_timeout=request_timeout)  # fmt: skip
            sock.listen(2048)  # connections queue from here on: "ready" means ready
            shown = f"[{host}]" if sock.family == socket.AF_INET6 else host
            url = f"http://{shown}:{sock.getsockname()[1]}"
            heads = bounded_heads(body_timeout, app=app)  # within time, 64 KiB
            server = uvicorn.Server(uvicorn.Config(
                limited(app, heads, room(heads, max_connections, where)),  # a 503, not a reset
                log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=30,
                http=heads, ws="none",  # no websocket endpoint: an upgrade is plain HTTP (a 405)
                # h11 (uvicorn without httptools) stops a head at 16 KiB with a 400: past ours
                h11_max_incomplete_event_size=2 * MAX_HEAD_BYTES,
            ))  # fmt: skip
            (ready or print_ready(artifact))(url)
            with on_signals(lambda *_: None):  # uvicorn re-raises the signal it stopped on
                server.run(sockets=[sock])
        finally:
            if not batcher.closed:  # uvicorn stopped before its lifespan closed it
                drain(batcher, cancel=True)
            sys.stdout.flush()


@contextlib.contextmanager
def on_signals(handler: Callable[..., None]) -> Iterator[None]:
    """SIGINT and SIGTERM call ``handler`` within the block (on the main thread only)."""
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM) if main}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)
