"""Serving: a model behind a micro-batcher, an HTTP server, and a latency mode.

:class:`Batcher` merges concurrent requests (``submit``, ``b(x)``, ``await b.asubmit(x)``) to
a :class:`~symjax_mlp.Hybrid` or a :class:`~symjax_mlp.LoadedModel` into a few batch sizes
compiled ahead of time; :func:`create_app` and :func:`serve` put it behind HTTP (the ``serve``
extra), :func:`ray_app` on Ray Serve replicas (the ``ray`` extra); :func:`latency_mode` runs
JAX's CPU calls on the calling thread, for per-request latency.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> import symjax_mlp as sm
  >>> h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
  >>> with sm.serving.Batcher(h, example=jnp.ones((1, 2)), max_batch=4) as b:
  ...     b(np.ones((1, 2), np.float32))
  array([[2., 2.]], dtype=float32)
"""

from symjax_mlp._errors import OverloadError as OverloadError
from symjax_mlp.serving._app import create_app as create_app
from symjax_mlp.serving._batcher import Batcher as Batcher
from symjax_mlp.serving._latency import dispatch_mode as dispatch_mode
from symjax_mlp.serving._latency import latency_mode as latency_mode
from symjax_mlp.serving._ray import ray_app as ray_app
from symjax_mlp.serving._requests import AsyncRequest as AsyncRequest
from symjax_mlp.serving._requests import RequestFuture as RequestFuture
from symjax_mlp.serving._server import serve as serve
from symjax_mlp.serving._stats import LATENCY_BUCKETS as LATENCY_BUCKETS
from symjax_mlp.serving._stats import BatcherStats as BatcherStats
from symjax_mlp.serving._stats import RequestTiming as RequestTiming

__all__ = [
    "LATENCY_BUCKETS",
    "AsyncRequest",
    "Batcher",
    "BatcherStats",
    "OverloadError",
    "RequestFuture",
    "RequestTiming",
    "create_app",
    "dispatch_mode",
    "latency_mode",
    "ray_app",
    "serve",
]
