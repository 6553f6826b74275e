"""Reading request bodies so that slow or stalled clients cannot pin the server's memory.

Three bounds, as nginx sets them:

- ``max_body_bytes``: a larger body is refused (413) as soon as its ``Content-Length``, or
  the bytes received, pass it.
- ``body_timeout``: the most seconds between two reads of one body (nginx's
  ``client_body_timeout``); a client that goes quiet is answered 408 and its connection closed.
- ``max_inflight_bytes``: the most bytes all bodies in flight may hold together; a chunk that
  would pass it is refused (503, ``Retry-After``), so a crowd of slow clients cannot take the
  server down.

Connection limits are uvicorn's (``limit_concurrency``, ``timeout_keep_alive``). All of it
runs on the server's one event loop, so the shared count needs no lock.
"""

from __future__ import annotations

import asyncio
from typing import Any

from symjax_mlp.serving._bodies import BadRequest

#: Headers of an answer given before the body was read to its end: the rest of it is not read.
CLOSE = {"Connection": "close"}


class Intake:
    """Reads bodies within ``max_body_bytes``, ``body_timeout`` and a shared byte budget.

    Args:
      max_body_bytes: the most bytes one body may have.
      body_timeout: the most seconds between two reads of a body.
      max_inflight_bytes: the most bytes all bodies in flight may hold together.
    """

    def __init__(self, *, max_body_bytes: int, body_timeout: float, max_inflight_bytes: int):
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.max_inflight_bytes = max_inflight_bytes
        self.held = 0  # bytes of bodies in flight, all requests together

    async def read(self, request: Any, hold: list[int]) -> bytes:
        """The body of ``request``; adds the bytes it holds to ``hold[0]`` as they arrive
        (give them back with :meth:`release` once the body is no longer needed, even when this
        raises).

        Raises:
          BadRequest: 413 too large, 408 a client quiet for ``body_timeout`` seconds, 503 the
            bodies in flight would pass ``max_inflight_bytes``.
          starlette.requests.ClientDisconnect: the client went away.
        """
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise BadRequest(413, _too_large(int(size), self.max_body_bytes))
        chunks, received = [], 0
        stream = request.stream().__aiter__()
        while True:
            try:
                async with asyncio.timeout(self.body_timeout):
                    chunk = await stream.__anext__()
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise BadRequest(
                    408,
                    f"the body stopped arriving: nothing came for {self.body_timeout:g} s after "
                    f"{received} bytes (body_timeout={self.body_timeout:g}). Send the whole "
                    "body at once.",
                ) from None
            received += len(chunk)
            if received > self.max_body_bytes:
                raise BadRequest(413, _too_large(received, self.max_body_bytes))
            if self.held + len(chunk) > self.max_inflight_bytes:
                raise BadRequest(
                    503,
                    f"the server is receiving too many bodies at once ({self.held} bytes held, "
                    f"max_inflight_bytes={self.max_inflight_bytes}); retry shortly.",
                )
            self.held += len(chunk)
            hold[0] += len(chunk)
            chunks.append(chunk)
        return b"".join(chunks)

    def release(self, hold: list[int]) -> None:
        """Gives back what :meth:`read` counted in ``hold``."""
        self.held -= hold[0]
        hold[0] = 0


def _too_large(size: int, limit: int) -> str:
    return (
        f"the body has {size} bytes, more than max_body_bytes={limit}; split the request into "
        "smaller ones."
    )
