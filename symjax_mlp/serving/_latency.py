"""Latency mode: JAX's CPU calls run on the calling thread, not handed to a dispatch thread.

JAX's CPU client hands each call to a thread, and XLA a batch-1 matvec to Eigen's pool: both
settings are read once, as JAX starts its CPU backend. On a GPU it changes nothing.
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

    Sets ``jax_cpu_enable_async_dispatch=False`` and adds ``--xla_cpu_multi_thread_eigen=false``
    to ``XLA_FLAGS`` unless it sets it already. Call it before any JAX computation (creating an
    array counts), as ``symjax-mlp serve`` does; with the mode in force already, a no-op.

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
