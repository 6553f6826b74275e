"""The timer: synced, warmed-up, interleaved wall-clock timing, and where it ran.

Every timed call ends in ``block_until_ready`` (JAX dispatches asynchronously; without it a
loop times only the dispatch): a *synced* call is what a request answered on its own costs.
A *pipelined* timing (``pipelined=True``) syncs once, after the last call of a repeat, as the
chapter's loop does: what a call costs when the next is dispatched while one runs. Every
callable is warmed up first, and every figure is the min and the median over repeats.
Callables that are compared to each other are timed *interleaved* (repeat 1 of each, then
repeat 2 of each, ...), so that noise from other processes lands on all of them alike.
:func:`time_stages` times tracing, lowering and compiling apart from steady-state calls.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from symjax_mlp import ConfigError

#: Called with a short status line as a run goes (``None`` where a function takes one: quiet).
Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of ``repeats`` runs of ``calls`` calls each, every call synced
    (``pipelined``: one sync per repeat, after its last call).

    Attributes:
      name: what was timed.
      calls: calls per repeat.
      times: seconds of each repeat (``len(times)`` repeats).
      inputs_per_call: samples one call processes (1000 for a batched call of 1000).
      pipelined: whether only the last call of a repeat was waited for.
    """

    name: str
    calls: int
    times: tuple[float, ...]
    inputs_per_call: int = 1
    pipelined: bool = False

    @property
    def min(self) -> float:
        """The fastest repeat, in seconds: the best estimate of the cost under noise."""
        return min(self.times)

    @property
    def median(self) -> float:
        """The median repeat, in seconds."""
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """``median / min - 1``: how far the median repeat lies above the fastest, the noise
        band of this figure (0.0 with a single repeat, where there is no estimate)."""
        return self.median / self.min - 1 if self.min > 0 else 0.0

    @property
    def per_call_min(self) -> float:
        return self.min / self.calls

    @property
    def per_call_median(self) -> float:
        return self.median / self.calls

    @property
    def per_input_min(self) -> float:
        """Seconds per input sample at the fastest repeat: what rows are compared by."""
        return self.min / (self.calls * self.inputs_per_call)

    def per_inputs(self, n: int = 1000) -> tuple[float, float]:
        """(min, median) seconds to process ``n`` inputs at this row's rate."""
        scale = n / (self.calls * self.inputs_per_call)
        return self.min * scale, self.median * scale

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "calls": self.calls,
            "repeats": len(self.times),
            "inputs_per_call": self.inputs_per_call,
            "times_s": list(self.times),
            "min_s": self.min,
            "median_s": self.median,
            "per_call_min_s": self.per_call_min,
            "per_call_median_s": self.per_call_median,
            "spread": self.spread,
            "pipelined": self.pipelined,
        }


def _sync_for(out: Any) -> Callable[[Any], Any]:
    """The cheapest correct way to wait for ``out``: a bound-method call for a jax.Array."""
    method = getattr(type(out), "block_until_ready", None)
    if isinstance(out, jax.Array) and method is not None:
        return method  # the unbound method of the concrete array type: no tree walk
    return jax.block_until_ready  # pytrees; numpy and CPU tensors pass through


def loop(fn: Callable[[], Any], sync: Callable[[Any], Any], calls: int, pipelined: bool) -> float:
    clock = time.perf_counter
    t0 = clock()
    if pipelined:
        out = None
        for _ in range(calls):
            out = fn()
        if calls:  # a warm-up of no calls has nothing to wait for
            sync(out)
    else:
        for _ in range(calls):
            sync(fn())
    return clock() - t0


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    *,
    calls: int = 1000,
    repeats: int = 5,
    warmup: int = 10,
    syncs: Mapping[str, Callable[[Any], Any]] | None = None,
    inputs_per_call: Mapping[str, int] | None = None,
    pipelined: bool = False,
    progress: Progress | None = None,
    remote: Mapping[str, Callable[[int], float]] | None = None,
    pause: float = 0.0,
) -> dict[str, Timing]:
    """Times several zero-argument callables, their repeats interleaved.

    Each callable is warmed up (``warmup`` calls, at least one), then repeat ``r`` of every
    callable runs before repeat ``r + 1`` of any, so slow drifts in machine load hit every
    row alike; the order rotates each repeat, so no row always runs right after the same
    other (one that leaves a thread pool spinning, or the caches full of its own data).
    Every timed call is followed by its sync (``block_until_ready`` by default); with
    ``pipelined``, only the last call of each repeat (the others still run: JAX runs a
    program's calls in order on its device).

    Args:
      fns: name -> callable; each call should do one unit of work and return its output.
      calls: calls per repeat.
      repeats: repeats per callable (at least 1; use 5 or more for a min and a median).
      warmup: untimed calls before timing.
      syncs: name -> ``sync(output)``, for outputs that need another wait (``torch.cuda``).
      inputs_per_call: name -> samples per call (default 1).
      pipelined: sync once per repeat, not after every call.
      progress: called with a short status line before each callable's warm-up.
      remote: name -> ``run(calls)``, rows timed elsewhere (another process: it warms
        itself up, times ``calls`` calls on its own clock and returns the seconds), their
        repeats interleaved with the others'.
      pause: seconds to sleep before each row's repeat (a thread pool's spin-wait after one
        row's calls would otherwise land on the next row).

    Returns:
      name -> :class:`Timing`, in the order of ``fns``, then of ``remote``.

    Example:
      >>> import jax.numpy as jnp
      >>> from benchmarks.timing import time_interleaved
      >>> t = time_interleaved({"add": lambda: jnp.ones(3) + 1}, calls=10, repeats=5)
      >>> t["add"].calls, len(t["add"].times)
      (10, 5)
    """
    if calls < 1 or repeats < 1:
        raise ConfigError(f"calls and repeats must be >= 1; got calls={calls}, repeats={repeats}.")
    sync_of: dict[str, Callable[[Any], Any]] = {}
    for name, fn in fns.items():
        if progress:
            progress(f"warming up {name}")
        out = fn()
        sync_of[name] = (syncs or {}).get(name) or _sync_for(out)
        sync_of[name](out)
        loop(fn, sync_of[name], max(0, warmup - 1), pipelined)
    remote = remote or {}
    names = [*fns, *remote]
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        if progress:
            progress(f"timing {', '.join(names)}: repeat {r + 1}/{repeats}")
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if pause:
                time.sleep(pause)
            if name in remote:
                times[name].append(remote[name](calls))
            else:
                times[name].append(loop(fns[name], sync_of[name], calls, pipelined))
    per = inputs_per_call or {}
    return {
        name: Timing(name, calls, tuple(times[name]), per.get(name, 1), pipelined) for name in names
    }


def time_calls(
    fn: Callable[[], Any], *, name: str = "fn", calls: int = 1000, repeats: int = 5, **kw: Any
) -> Timing:
    """Times one zero-argument callable; see :func:`time_interleaved` for the arguments.

    Example:
      >>> import jax.numpy as jnp
      >>> from benchmarks.timing import time_calls
      >>> t = time_calls(lambda: jnp.ones(3) * 2, calls=20, repeats=5)
      >>> t.min <= t.median
      True
    """
    return time_interleaved({name: fn}, calls=calls, repeats=repeats, **kw)[name]


def time_autoranged(
    fn: Callable[[], Any], *, name: str, min_seconds: float, max_calls: int, repeats: int
) -> Timing:
    """Times ``fn`` with the smallest power of two of calls (≤ ``max_calls``) that takes at
    least ``min_seconds`` a repeat: short repeats for slow calls, enough calls for fast ones."""
    out = fn()
    sync = _sync_for(out)
    sync(out)
    calls = 1
    while calls < max_calls and loop(fn, sync, calls, False) < min_seconds:
        calls *= 2
    return time_calls(fn, name=name, calls=min(calls, max_calls), repeats=repeats, warmup=1)


def time_stages(fn: Callable[..., Any], *args: Any, repeats: int = 5) -> dict[str, Timing]:
    """Times ``jax.jit(fn)``'s stages separately: trace, lower, compile (one of each per repeat).

    Each repeat wraps ``fn`` in a fresh function, so no trace or compile cache is hit.

    Returns:
      ``{"trace": Timing, "lower": Timing, "compile": Timing}``, one call per repeat.

    Example:
      >>> import jax.numpy as jnp
      >>> from benchmarks.timing import time_stages
      >>> s = time_stages(lambda x: x * 2, jnp.ones(3), repeats=2)
      >>> sorted(s)
      ['compile', 'lower', 'trace']
    """
    samples: dict[str, list[float]] = {"trace": [], "lower": [], "compile": []}
    clock = time.perf_counter
    for _ in range(repeats):

        def fresh(*a: Any) -> Any:
            return fn(*a)

        t0 = clock()
        traced = jax.jit(fresh).trace(*args)
        t1 = clock()
        lowered = traced.lower()
        t2 = clock()
        lowered.compile()
        t3 = clock()
        samples["trace"].append(t1 - t0)
        samples["lower"].append(t2 - t1)
        samples["compile"].append(t3 - t2)
    return {k: Timing(k, 1, tuple(v)) for k, v in samples.items()}


# -- where it ran ----------------------------------------------------------------------------
def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity on Linux), at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def environment() -> dict[str, Any]:
    """Versions, backend, device, CPU model and core count: what every figure must be read
    against."""
    import importlib.metadata

    import flax

    dev = jax.devices()[0]
    env = {
        "symjax_mlp": importlib.metadata.version("symjax_mlp"),
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "backend": jax.default_backend(),
        "device": str(dev),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable_cores(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if hasattr(os, "getloadavg"):
        env["loadavg"] = list(os.getloadavg())
    return env


def format_seconds(s: float) -> str:
    """``1.234 s``, ``12.34 ms`` or ``12.3 µs``: the unit that keeps a few digits."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"
