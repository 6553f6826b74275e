"""Serving, measured: per-request latency per dispatch mode, the micro-batcher, the HTTP server.

:func:`bench_serving` runs three sections on the chapter's MLP, each where its figures mean
something:

- ``latency``: synced batch-1 calls, one fresh subprocess per mode (JAX's dispatch mode is
  fixed when its CPU backend starts), all started first and then timed in interleaved rounds,
  one mode at a time: JAX with asynchronous dispatch (the default),
  JAX in :func:`~symjax_mlp.serving.latency_mode` (as hybridized, and with
  ``params_as_constants=True``), and PyTorch eager / ``jit.script`` / ``jit.freeze`` (the
  scripted module with its params inlined as constants) / ``compile`` (with the benchmark's
  threads and with one), each in two forms: the input already on the device, and a NumPy
  array in and out (what a server does).
- ``batcher``: one subprocess in latency mode, then one in JAX's default async dispatch: a
  :class:`~symjax_mlp.serving.Batcher` at 1 client, its calls alternated one by one with
  direct synced calls (the added µs: the median of the pairs' differences, each pair timed in
  the same microseconds), then under 1, 8, 64 concurrent clients (threads blocking in ``b(x)``,
  callers keeping that many futures in flight, and coroutines on one event loop awaiting
  ``b.asubmit(x)``): throughput against direct calls timed just before and after each row,
  p50, p99, rows per batch. Each mode's ratios are against its own direct calls (on a CPU,
  async dispatch's are the slower ones: compare its req/s, not its ratios, across modes).
- ``http``: ``symjax-mlp serve`` in a subprocess, driven over loopback by keep-alive clients
  (``.npy`` and JSON bodies) at a bounded concurrency: throughput, p50, p99.

The sections live apart: :mod:`benchmarks.latency`, :mod:`benchmarks.batcher` and
:mod:`benchmarks.http_rows`, on :mod:`benchmarks.calls` (timing one call at a time) and
:mod:`benchmarks.children` (the subprocesses); the targets and the text are
:mod:`benchmarks.serving_report`'s (:func:`format_serving`, re-exported here). This module
holds the entry and the subprocesses' entry (:func:`run_child`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.batcher import BATCHER_RUNS, batcher_rows
from benchmarks.children import run_once
from benchmarks.http_rows import http_rows
from benchmarks.latency import latency_child, latency_rows
from benchmarks.serving_report import format_serving, serving_targets
from benchmarks.timing import Progress, environment, usable_cores
from symjax_mlp import ConfigError

__all__ = ["SECTIONS", "TORCH_MODES", "bench_serving", "format_serving", "run_child"]

SECTIONS = ("latency", "batcher", "http")
TORCH_MODES = ("torch_eager", "torch_script", "torch_freeze", "torch_compile")


# -- the subprocesses' entry (``benchmarks.children.ENTRY`` imports it from here) ------------
def run_child(kind: str, **kw: Any) -> dict[str, Any] | None:
    """Runs one measurement in this (fresh) process; its CPUs (``cpus``) and JAX's dispatch
    are set first."""
    cpus = kw.pop("cpus", None)
    if cpus:
        os.sched_setaffinity(0, cpus)
    if kw.get("dispatch") == "sync":
        from symjax_mlp.serving import latency_mode

        latency_mode()  # before anything starts JAX's backend
    if kind in ("jax", "torch"):
        return latency_child(kind, **kw)
    if kind == "batcher":
        return batcher_rows(**kw)
    if kind == "row":  # the main table's latency-mode row (benchmarks.remote)
        from benchmarks.remote import row_child

        return row_child(**kw)
    raise ConfigError(f"unknown child kind {kind!r}")


# -- the whole benchmark ---------------------------------------------------------------------
def bench_serving(
    *,
    sections: Sequence[str] = SECTIONS,
    sizes: Sequence[int] = (256, 128, 2),
    in_features: int = 512,
    activation: str | None = "relu",
    calls: int = 500,
    repeats: int = 20,
    torch: bool = True,
    torch_modes: Sequence[str] = TORCH_MODES,
    clients: Sequence[int] = (1, 8, 64),
    requests: int = 4000,
    max_batch: int = 64,
    batcher_dispatch: Sequence[str] = ("sync", "async", "pinned"),
    http_clients: Sequence[int] = (1, 16),
    http_requests: int = 600,
    env: Mapping[str, str] | None = None,
    seed: int = 0,
    timeout: float = 600.0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Measures serving the chapter's MLP: latency per dispatch mode, the batcher, HTTP.

    Every section runs in fresh subprocesses (the dispatch mode is fixed when JAX's CPU
    backend starts), one after another, so no two measurements share the cores.

    Args:
      sections: any of ``"latency"``, ``"batcher"``, ``"http"``.
      sizes, in_features, activation: the net, ``mlp(sizes)`` on ``(1, in_features)`` rows.
      calls, repeats: synced batch-1 calls per round, and rounds (the modes take turns, the
        order rotating each round), in the latency section. Many short rounds, at least as
        many as modes, put each mode at each place of the turn (after each other mode) and
        spread a busy spell of the machine over all of them. On a 2-core VM, two runs each,
        alternated: 5 rounds of 2000 calls read the PyTorch/JAX target 1.64x and 1.66x (and
        params as constants slower than the plain call); 20 rounds of 500 read 1.99x twice.
      torch: add the PyTorch rows (when torch is installed; else a note).
      torch_modes: which of ``torch_eager``, ``torch_script``, ``torch_freeze``,
        ``torch_compile``.
      clients: concurrent in-process clients of the batcher.
      requests: requests per concurrency level (half as many interleaved pairs at 1 client,
        a quarter as many direct calls around each level).
      max_batch: the batcher's (and server's) largest batch.
      batcher_dispatch: the dispatch modes the batcher section runs in, each in its own
        fresh process: ``"sync"`` (:func:`~symjax_mlp.serving.latency_mode`, as
        ``symjax-mlp serve``; ``result["batcher"]``), ``"async"`` (JAX's default;
        ``result["batcher_async"]``) and ``"pinned"``: sync, the process pinned to one CPU,
        as ``taskset -c 0 symjax-mlp serve`` runs (``result["batcher_pinned"]``, its
        ``pinned`` the CPUs; skipped with a note where there is one usable CPU or no
        ``os.sched_setaffinity``). In latency mode a call runs on its caller's thread, so
        the process uses one core at a time anyway; on one core a thread's wake-up is a
        context switch, not a cross-core interrupt (on a VM, an exit to the hypervisor).
      http_clients, http_requests: concurrent HTTP clients, requests per level.
      env: extra environment for the subprocesses (e.g. ``{"XLA_FLAGS": ...}``).
      seed: for the params and the inputs.
      timeout: seconds per subprocess.
      progress: called with a status line as the run goes.

    Returns:
      A dict with ``config``, ``env``, ``notes``, ``targets`` and one entry per section run:
      ``latency`` (``rows``: ``mode``, ``dispatch``, ``threads``, ``forms``: ``device`` and
      ``numpy``, each ``p50_s``, ``p90_s``, ``p99_s``, ``mean_s``, ``best_repeat_mean_s``),
      ``batcher`` (and ``batcher_async``: ``direct``; ``c1``: ``direct`` and ``batcher``
      percentiles of the interleaved calls, ``added_paired_median_s``, ``added_p50_s``; and
      ``rows``: ``clients``, ``kind``, ``throughput_rps``, ``direct_rps``, ``vs_direct``,
      ``p50_s``, ``p99_s``, ``rows_per_batch``, ...), ``http`` (``rows``: ``clients``,
      ``body``, ``throughput_rps``, ``p50_s``, ``p99_s``, ``errors``, ``rows_per_batch``).

    Raises:
      ConfigError: an unknown section or torch mode, or a size below 1.
      RuntimeError: a subprocess failed (its stderr is in the message).
    """
    bad = sorted(set(sections) - set(SECTIONS)) + sorted(set(torch_modes) - set(TORCH_MODES))
    if bad:
        raise ConfigError(
            f"bench_serving: unknown section or torch mode {bad}; sections are {SECTIONS}, "
            f"torch modes {TORCH_MODES}."
        )
    if not batcher_dispatch or set(batcher_dispatch) - set(BATCHER_RUNS):
        raise ConfigError(
            f"bench_serving: batcher_dispatch names 'sync', 'async' and/or 'pinned'; got "
            f"{list(batcher_dispatch)!r}."
        )
    if min(calls, repeats, requests, max_batch, http_requests, *clients, *http_clients) < 1:
        raise ConfigError(
            "bench_serving: calls, repeats, requests, clients, max_batch must be >= 1."
        )
    say = progress or (lambda _: None)
    net = {"sizes": list(sizes), "in_features": in_features, "activation": activation, "seed": seed}
    notes: list[str] = []
    result: dict[str, Any] = {
        "config": {
            **net,
            "sections": list(sections),
            "calls": calls,
            "repeats": repeats,
            "clients": list(clients),
            "requests": requests,
            "max_batch": max_batch,
            "batcher_dispatch": list(batcher_dispatch),
            "http_clients": list(http_clients),
            "http_requests": http_requests,
            "env": dict(env or {}),
        },
        "env": environment(),
        "notes": notes,
    }
    if "latency" in sections:
        modes = [("jax", {"dispatch": d}) for d in ("async", "sync")]
        modes.append(("jax", {"dispatch": "sync", "constants": True}))
        if torch:
            try:
                import torch as _torch  # noqa: F401  (only to know it is there)
            except ImportError:
                notes.append("torch rows skipped: torch is not installed (symjax_mlp[torch])")
            else:
                on_cpu = result["env"]["backend"] == "cpu"  # threads matter only there
                threads = [usable_cores()] + ([1] if usable_cores() > 1 and on_cpu else [])
                for mode in torch_modes:
                    for n in threads if mode != "torch_compile" else threads[:1]:
                        modes.append(("torch", {"mode": mode, "threads": n}))
        result["latency"] = latency_rows(
            modes, net, calls=calls, rounds=repeats, env=env, timeout=timeout, say=say,
            notes=notes,
        )  # fmt: skip
    if "batcher" in sections:
        for run in batcher_dispatch:
            dispatch = "async" if run == "async" else "sync"
            kw = {"dispatch": dispatch, **net, "clients": list(clients), "requests": requests}
            cpus = _one_cpu() if run == "pinned" else None
            if run == "pinned" and cpus is None:
                notes.append("pinned batcher rows skipped: one usable CPU, or no sched_setaffinity")
                continue
            where = f", pinned to CPU {cpus[0]}" if cpus else ""
            levels = ", ".join(map(str, clients))
            say(f"batcher, {dispatch} dispatch{where}: 1 client, then {levels}")
            kw = {**kw, "max_batch": max_batch, **({"cpus": cpus} if cpus else {})}
            result[BATCHER_RUNS[run]] = run_once("batcher", kw, env, timeout)
            if cpus:
                result[BATCHER_RUNS[run]]["pinned"] = cpus
    if "http" in sections:
        result["http"] = http_rows(
            **net,
            clients=list(http_clients),
            requests=http_requests,
            max_batch=max_batch,
            env=env,
            timeout=timeout,
            say=say,
        )
    result["targets"] = serving_targets(result)
    return result


def _one_cpu() -> list[int] | None:
    """The first CPU this process may use, to pin a child to; ``None`` where pinning would
    change nothing (one usable CPU) or is not offered (no ``os.sched_setaffinity``)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:1] if len(cpus) > 1 else None
