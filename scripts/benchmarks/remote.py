"""The main table's latency-mode row: ``h(x)`` timed in a fresh process with synchronous dispatch.

JAX fixes its CPU dispatch when its backend starts, so the benchmark's own process (JAX's
default, asynchronous dispatch) cannot time ``h(x)`` in
:func:`~symjax_mlp.serving.latency_mode` too. :class:`LatencyRow` keeps a fresh process that
can: it builds the same net from the same seed (its output is checked against the parent's),
and :func:`benchmarks.timing.time_interleaved` asks it for one repeat at a time, so that its
repeats interleave with the in-process rows'. The child times ``calls`` synced calls on its
own clock while the parent waits, idle, on the pipe.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.calls import chapter_net
from benchmarks.children import Child
from benchmarks.timing import loop

_REWARM = 20  # untimed calls before each repeat: the child's caches went cold while it idled


def row_child(*, sizes, in_features, activation, seed, warmup, **_: Any) -> None:
    """The child's side: announce the net's output and dispatch, then time a repeat of
    ``calls`` synced calls per request on stdin, until ``{"quit": true}``."""
    import jax

    from symjax_mlp.serving import dispatch_mode

    h, _, xn = chapter_net(sizes, in_features, activation, seed)
    x = jax.device_put(xn)

    def call() -> Any:
        return h(x)

    def sync(y: Any) -> Any:
        return y.block_until_ready()

    loop(call, sync, warmup, False)
    out = np.asarray(h(xn)).tolist()
    ready = {"ready": True, "dispatch": dispatch_mode(), "x": xn.tolist(), "out": out}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("quit"):
            return
        loop(call, sync, _REWARM, False)
        seconds = loop(call, sync, ask["calls"], False)
        print(json.dumps({"seconds": seconds, "traces": h.trace_count}), flush=True)


class LatencyRow:
    """A fresh process holding ``h(x)`` in latency mode; calling it times one repeat.

    Args:
      sizes, in_features, activation, seed: the net, as :func:`benchmarks.run.benchmark`
        builds it (the same params; the input is the seed's first row).
      timeout: seconds to wait for the process to start or to answer a repeat.

    Attributes:
      dispatch: the child's dispatch mode (``"sync"``).
      x: the child's input (NumPy, ``(1, in_features)``), as it drew it from ``seed``.
      out: the child's output for :attr:`x`, to check against the parent's model.

    Raises:
      RuntimeError: the process failed to start or to answer (with the end of its stderr).
    """

    def __init__(
        self,
        *,
        sizes: Sequence[int],
        in_features: int,
        activation: str | None,
        seed: int,
        timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        net = {"sizes": list(sizes), "in_features": in_features, "activation": activation}
        args = {"kind": "row", "dispatch": "sync", "warmup": 200, "seed": seed, **net}
        self._child = Child(args, env=env, timeout=timeout, who="its process")
        ready = self._child.ready
        self.dispatch: str = ready["dispatch"]
        self.x = np.asarray(ready["x"], np.float32)
        self.out = np.asarray(ready["out"], np.float32)
        self.traces = 0

    def __call__(self, calls: int) -> float:
        """Seconds of ``calls`` synced calls of ``h(x)`` in the child (after a short re-warm)."""
        got = self._child.ask({"calls": calls})
        self.traces = got["traces"]
        return got["seconds"]

    def close(self) -> None:
        self._child.close()

    def __enter__(self) -> LatencyRow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
