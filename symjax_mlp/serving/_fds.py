"""The server's sockets and what its connections may hold: the socket it listens on
(:func:`bind`); room for connections in this process's open-file limit (``ulimit -n``,
RLIMIT_NOFILE): each connection holds a file descriptor, and a server out of them cannot even
refuse one (uvloop accepts and closes it: the client sees a reset, the log nothing), so a
refusal past ``max_connections`` lingers (its client's request read and dropped) while files
are left; and the requests one connection sends ahead of their answers (:class:`Pipeline`)."""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import warnings
from typing import Any

from symjax_mlp._errors import ConfigError, user_stacklevel
from symjax_mlp.serving._requests import headed

SPARE = 16  # descriptors kept for the server's own (its event loop, a refusal's, logs)
#: Requests one connection may send ahead of their answers (HTTP pipelining), queued.
MAX_PIPELINED = 32


def room(heads: Any, max_connections: int, where: str) -> int:
    """The connections this process can hold open, ``max_connections`` at most, and as many
    refusals lingering (``heads.files``), the soft limit raised as they need (else a warning)."""
    try:
        import resource
    except ImportError:  # not POSIX: nothing to read
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    used = _open_now()
    need = used + 2 * max_connections + SPARE
    raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft < raised:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    heads.files = max(1, soft - used - SPARE)
    fits = max(1, heads.files // 2)
    if fits < max_connections:
        warnings.warn(
            f"{headed(where)}max_connections={max_connections}, but this process may open only "
            f"{soft} files (ulimit -n; {used} open now): past {fits} connections, a client gets "
            f"the 503, where it would be reset. For {max_connections}, raise ulimit -n to "
            f"{need}.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
    return min(fits, max_connections)


def bind(host: str, port: int, where: str = "serve") -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening); raises :class:`ConfigError`,
    headed ``where``, where that address cannot be had (a port in use, a host not this one's)."""
    if isinstance(port, bool):  # True was port 1
        raise ConfigError(f"{headed(where)}port must be an int from 0 to 65535; got {port!r}.")
    if not isinstance(host, str) or not host.strip():  # "" is every interface, in silence
        raise ConfigError(
            f"{headed(where)}host={host!r} names no address; pass 127.0.0.1 (this machine only) or "
            "0.0.0.0 (every interface)."
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say they are TCP
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError, TypeError, UnicodeError) as e:  # TypeError: port="80"
        sock.close()
        why = getattr(e, "strerror", None) or str(e)
        raise ConfigError(
            f"{headed(where)}cannot listen on {host}:{port} ({why}). Pass a free port (0: any free "
            "one) and a host address of this machine (127.0.0.1, 0.0.0.0)."
        ) from None
    return sock


def _open_now() -> int:
    """The file descriptors this process has open (0 where the system does not list them)."""
    for listing in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(listing))
    return 0


class Pipeline(collections.deque):  # type: ignore[type-arg]
    """A connection's requests sent ahead of their answers, as uvicorn's httptools protocol
    queues them (``protocol.pipeline``), bounded: uvicorn parses all it reads at once and reads
    again after each answer, so 4 MiB of pipelined 18-byte requests were held as 127,000 (2 kB
    each), and a client sending on as it read grew the server without end. Past
    :data:`MAX_PIPELINED` requests, or ``max_bytes`` of their heads, the parser is stopped (nothing
    more of the connection is read) and :attr:`refusal` says why, for the protocol to answer once
    the requests queued are answered."""

    def __init__(self, protocol: Any, max_bytes: int) -> None:
        super().__init__()
        self._protocol, self._max, self.bytes, self.refusal = protocol, max_bytes, 0, None

    def appendleft(self, item: Any) -> None:  # a request, its head read: queued (or refused)
        size = _head_size(item[0].scope)
        if self and (len(self) >= MAX_PIPELINED or self.bytes + size > self._max):
            self._protocol.cycle = self[0][0]  # the newest queued: answered, then the refusal
            self.refusal = 429, (
                f"the connection sent more than {len(self)} requests ahead of their answers "
                f"(HTTP pipelining), past the {MAX_PIPELINED} requests and {self._max} bytes of "
                "their headers this server queues; the ones queued were answered, the rest not "
                "read. Read each answer before sending more, or open more connections."
            )  # fmt: skip
            self._protocol.flow.resume_reading = lambda: None  # nothing more read but to drop
            raise RuntimeError(self.refusal[1])  # in httptools' callback: its parsing stops
        self.bytes += size
        super().appendleft(item)

    def pop(self) -> Any:  # the oldest queued: it runs now
        item = super().pop()
        self.bytes -= _head_size(item[0].scope)
        return item


def _head_size(scope: dict[str, Any]) -> int:
    """About the bytes of a request's line and headers, as sent."""
    line = len(scope["raw_path"]) + len(scope["query_string"]) + 16
    return line + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
