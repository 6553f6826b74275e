"""Latency mode: JAX's CPU calls run on the calling thread, not handed to a dispatch thread.

By default JAX's CPU client dispatches every call asynchronously: the call returns a future
array at once and a runtime thread runs the program. That overlaps Python with compute, but
for one request at a time it is a thread hand-off per call, often more than the small program
itself. :func:`latency_mode` turns it off and also makes XLA's CPU matmuls single-threaded
(handing a batch-1 matvec to Eigen's thread pool costs more than the second core gains), so a
call runs on its caller's thread from start to finish. Both settings are read once, when JAX
starts its CPU backend, so the switch refuses when it comes too late rather than silently
doing nothing. The library never sets them by itself; ``symjax-mlp serve`` does. On a GPU
the setting changes nothing: kernels are always queued on a stream.
"""

from __future__ import annotations

import os

import jax

from symjax_mlp._compat import backend_started

_FLAG = "jax_cpu_enable_async_dispatch"
_EIGEN = "--xla_cpu_multi_thread_eigen"  # XLA_FLAGS; a value the user set there is kept


def dispatch_mode() -> str:
    """``"sync"`` when JAX's CPU calls run on the calling thread, else ``"async"``.

    Example:
      >>> import symjax_mlp as sm
      >>> sm.serving.dispatch_mode() in ("sync", "async")
      True
    """
    return "async" if jax.config.read(_FLAG) else "sync"


def latency_mode() -> None:
    """Runs JAX's CPU calls inline, on the calling thread: per-request latency, not throughput.

    Sets ``jax_cpu_enable_async_dispatch=False``, which JAX reads once, when its CPU backend
    starts, and adds ``--xla_cpu_multi_thread_eigen=false`` to ``XLA_FLAGS`` (read then too;
    subprocesses inherit it) unless ``XLA_FLAGS`` already sets it. Call it first thing,
    before any JAX computation (creating an array counts)::

        import symjax_mlp as sm
        sm.serving.latency_mode()   # before the first jnp.ones, sm.load, h(x), ...

    ``symjax-mlp serve`` does this for you. A call that finds the mode already in force is a
    no-op.

    Raises:
      RuntimeError: JAX's backend already started with asynchronous dispatch; the setting
        would be ignored. Call it earlier (at the top of the program), or in a fresh process.

    Example:
      >>> import jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> _ = jnp.ones(1)  # JAX's backend starts here, with the default (async) dispatch
      >>> try:
      ...     sm.serving.latency_mode()
      ... except RuntimeError as e:
      ...     print("too late:", "before any JAX computation" in str(e))
      too late: True
    """
    if backend_started():
        if not jax.config.read(_FLAG):
            return  # already synchronous: set before the backend started
        raise RuntimeError(
            "latency_mode(): JAX's backend has already started with asynchronous CPU dispatch, "
            "and jax_cpu_enable_async_dispatch is read only at that start, so setting it now "
            "would change nothing. Call sm.serving.latency_mode() before any JAX computation "
            "(at the top of the program), or run the latency-sensitive code in a fresh process."
        )
    jax.config.update(_FLAG, False)
    flags = os.environ.get("XLA_FLAGS", "")
    if _EIGEN not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_EIGEN}=false".strip()
