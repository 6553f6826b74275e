"""Latency mode: JAX's CPU calls run on the calling thread, not handed to a dispatch thread.

By default JAX's CPU client dispatches every call asynchronously: the call returns a future
array at once and a runtime thread runs the program; ``block_until_ready`` then waits for
that thread. For throughput that overlaps Python with compute. For one request at a time it
is a thread hand-off per call, often more than the small program itself. The switch
(``jax_cpu_enable_async_dispatch``) is read once, when JAX starts its CPU backend, so it must
be set before the first computation; :func:`latency_mode` sets it, and refuses when it is too
late rather than silently doing nothing. It also makes XLA's CPU matmuls single-threaded
(``--xla_cpu_multi_thread_eigen=false`` in ``XLA_FLAGS``, also read when the backend starts):
handing a batch-1 matvec to Eigen's thread pool and waiting for it costs more than the second
core gains, and a call then runs on its caller's thread from start to finish, as PyTorch's
fastest per-request mode (one thread) does. Measured on the chapter MLP, 2-core CPU, synced
batch-1 calls: p50 about 15% lower, p10 about 25% lower; batch 64 no slower. The library
never sets either by itself: only you, or the ``symjax-mlp serve`` and ``python scripts/bench.py
--serving`` entry points, do.

What else sits on a batch-1 call's path (measured by ``python scripts/bench.py --serving``):
the Python wrapper (a :class:`~symjax_mlp.Hybrid` sorts static from traced arguments, a
:class:`~symjax_mlp.LoadedModel` checks its signature once per shape), the copy of a NumPy
input to the device and of the result back (pass device arrays to skip them; a
:class:`~symjax_mlp.serving.Batcher` pays them once per batch), and the program itself.
On a GPU the flag changes nothing: kernels are always queued on a stream.
"""

from __future__ import annotations

import os

import jax

from symjax_mlp._compat import backend_started

_FLAG = "jax_cpu_enable_async_dispatch"
_EIGEN = "--xla_cpu_multi_thread_eigen"  # XLA_FLAGS; a value the user set there is kept


def dispatch_mode() -> str:
    """``"sync"`` when JAX's CPU calls run on the calling thread, else ``"async"``.

    It reads the setting; after :func:`latency_mode` succeeded, that is what the CPU backend
    does.

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

    Equivalently: ``jax.config.update("jax_cpu_enable_async_dispatch", False)`` and
    ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`` at the same point. ``symjax-mlp serve``
    does this for you (``--dispatch async`` opts out). A call that finds the mode already in
    force is a no-op.

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
