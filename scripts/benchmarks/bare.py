"""The yardstick of the HTTP rows: a bare starlette endpoint, no model, no batcher.

``POST /predict`` parses the JSON body into a NumPy array (as ``symjax-mlp serve`` must) and
answers a constant of the output's shape; ``GET /health`` answers ``{}``. It runs under its
own uvicorn beside ``serve`` (:mod:`benchmarks.http_rows`) and inside a Ray replica beside
ours (:mod:`benchmarks.ray_rows`). It imports no JAX and no symjax_mlp. Given ``answer`` (the
HTTP rows' ceiling), it answers what that makes of the parsed array: the model's outputs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np


def app(
    width: int, loads: Callable[[bytes], Any], answer: Callable[[Any], bytes] | None = None
) -> Any:
    """The bare endpoint's ASGI app, parsing with ``loads`` (orjson's or the stdlib's); its
    answer: a constant, or ``answer(x)`` of the parsed float32 array ``x``."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    reply = json.dumps({"outputs": [[0.0] * width]}).encode()

    async def predict(request: Any) -> Response:
        x = np.asarray(loads(await request.body())["inputs"], np.float32)
        return Response(reply if answer is None else answer(x), media_type="application/json")

    async def health(request: Any) -> Response:
        return Response(b"{}", media_type="application/json")

    routes = [Route("/predict", predict, methods=["POST"]), Route("/health", health)]
    return Starlette(routes=routes)
