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

:func:`format_serving` prints the tables and the targets (64 clients >= 5x one-at-a-time, the
batcher adding <= 10 µs at concurrency 1), the batcher's cost a request at the top
concurrency against the bare model's cost a row at the batch size it formed, and the fastest
PyTorch mode over JAX in latency mode (reported: the per-request targets, against floors
measured in the same process, are :mod:`benchmarks.per_request`'s).

The sections live apart: :mod:`benchmarks.latency`, :mod:`benchmarks.batcher` and
:mod:`benchmarks.http_rows`, on :mod:`benchmarks.calls` (timing one call at a time) and
:mod:`benchmarks.children` (the subprocesses); this module holds the entry, the
subprocesses' entry (:func:`run_child`), the targets and the text.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.batcher import KINDS, batcher_rows
from benchmarks.children import run_once
from benchmarks.http_rows import http_rows, http_targets
from benchmarks.latency import latency_child, latency_rows, mode_label
from benchmarks.timing import Progress, environment, format_seconds, usable_cores
from symjax_mlp import ConfigError

SECTIONS = ("latency", "batcher", "http")
#: The batcher section's runs, each in a fresh process, and their keys in the result.
BATCHER_RUNS = {"sync": "batcher", "async": "batcher_async", "pinned": "batcher_pinned"}
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
    result["targets"] = _targets(result)
    return result


def _one_cpu() -> list[int] | None:
    """The first CPU this process may use, to pin a child to; ``None`` where pinning would
    change nothing (one usable CPU) or is not offered (no ``os.sched_setaffinity``)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:1] if len(cpus) > 1 else None


def _targets(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    lat = result.get("latency", {}).get("rows", [])
    jax_sync = [r for r in lat if r["mode"] == "jax" and r["dispatch"] == "sync"]
    torch_rows = [r for r in lat if r["mode"] != "jax"]
    if jax_sync and torch_rows:
        p50 = lambda r: r["forms"]["device"]["p50_s"]  # noqa: E731
        best, ours = min(torch_rows, key=p50), min(jax_sync, key=p50)
        ratio = p50(best) / p50(ours)
        out.append(
            {
                "name": "latency_vs_fastest_torch",
                "what": f"fastest PyTorch p50 ({mode_label(best)}) / fastest JAX latency-mode "
                f"p50 ({mode_label(ours)}); the per-request targets are the per-request "
                "section's, against floors",
                "value": ratio,
                "target": "reported",
                "met": None,
            }
        )
    for run, key in BATCHER_RUNS.items():
        b = result.get(key)
        if not b:
            continue
        mode = {"sync": "", "async": ", async dispatch", "pinned": ", pinned to one CPU"}[run]
        base = {"sync": "", "async": " in async dispatch", "pinned": " pinned alike"}[run]
        suffix = "" if run == "sync" else f"_{run}"
        for kind in KINDS:
            top = max((r for r in b["rows"] if r["kind"] == kind), key=lambda r: r["clients"])
            ratio = top["vs_direct"]
            out.append(
                {
                    "name": f"batcher_throughput_{top['clients']}_{kind}{suffix}",
                    "what": f"{top['clients']} clients ({kind}{mode}) req/s / one-at-a-time "
                    f"req/s{base}",
                    "value": ratio,
                    "target": ">= 5",
                    "met": ratio >= 5,
                }
            )
        added = b["c1"]["added_paired_median_s"]
        out.append(
            {
                "name": f"batcher_overhead_c1{suffix}",
                "what": f"b(x) - direct call at 1 client, interleaved, median (µs{mode})",
                "value": added * 1e6,
                "target": "<= 10",
                "met": added <= 10e-6,
            }
        )
    out += http_targets(h := result.get("http"))
    if h and h["rows"]:
        worst = max(h["rows"], key=lambda r: r["p99_s"])
        out.append(
            {
                "name": "http_p99",
                "what": f"worst HTTP p99 (ms; {worst['clients']} clients, {worst['body']})",
                "value": worst["p99_s"] * 1e3,
                "target": "reported",
                "met": None,
            }
        )
    return out


def _format_batcher(b: Mapping[str, Any]) -> str:
    us, d, c1 = format_seconds, b["direct"], b["c1"]
    pinned = f", pinned to CPU {b['pinned'][0]}" if b.get("pinned") else ""
    lines = [
        f"Micro-batcher: max_batch {b['max_batch']}, {b['dispatch']} dispatch{pinned}, in-process "
        f"clients (buckets {b['buckets']} compiled ahead, "
        f"{b['traces_while_serving']} traces while serving)",
        f"  at 1 client, calls interleaved with direct ones: b(x) adds "
        f"{c1['added_paired_median_s'] * 1e6:.1f} µs (median of the pairs; direct p50 "
        f"{us(c1['direct']['p50_s'])}, b(x) p50 {us(c1['batcher']['p50_s'])})",
        f"  {'clients':<22} {'req/s':>9} {'p50':>10} {'p99':>10} {'rows/batch':>10} "
        f"{'vs one-at-a-time':>16}",
        f"  {'one at a time, direct':<22} {d['throughput_rps']:>9.0f} {us(d['p50_s']):>10} "
        f"{us(d['p99_s']):>10} {1.0:>10.1f} {1.0:>15.2f}x",
    ]
    for r in b["rows"]:
        who = f"{r['clients']} {r['kind']}"
        lines.append(
            f"  {who:<22} {r['throughput_rps']:>9.0f} {us(r['p50_s']):>10} "
            f"{us(r['p99_s']):>10} {r['rows_per_batch']:>10.1f} {r['vs_direct']:>15.2f}x"
        )
    lines.append("  (vs one-at-a-time: against direct calls timed just before and after each row)")
    for kind, bare in b.get("bare_at_formed_batch", {}).items():
        lines.append(
            f"  {bare['clients']} {kind} in flight: {us(bare['per_request_s'])} a request; the "
            f"bare model at the batch it formed ({bare['batch']}): {us(bare['per_row_s'])} a row, "
            f"{bare['per_request_s'] / bare['per_row_s']:.2f}x"
        )
    return "\n".join(lines)


def format_serving(result: Mapping[str, Any]) -> str:
    """The serving benchmark as text: the latency table, the batcher, HTTP, the targets.

    Example:
      >>> from benchmarks.serving import format_serving
      >>> print(format_serving({"notes": [], "targets": []}))
      Serving benchmark: no sections were run.
    """
    us = format_seconds
    parts: list[str] = []
    lat = result.get("latency")
    if lat:
        lines = [
            "Per-request latency: the chapter MLP at batch 1, synced, one fresh process per mode"
            f" ({lat.get('rounds', '?')} rounds of {lat.get('calls_per_round', '?')} calls, the "
            "modes interleaved)",
            f"  {'mode':<46} {'on device p50':>13} {'p99':>9}   "
            f"{'numpy in/out p50':>16} {'p99':>9}",
        ]
        for r in lat["rows"]:
            d, n = r["forms"]["device"], r["forms"]["numpy"]
            lines.append(
                f"  {mode_label(r):<46} {us(d['p50_s']):>13} {us(d['p99_s']):>9}   "
                f"{us(n['p50_s']):>16} {us(n['p99_s']):>9}"
            )
        parts.append("\n".join(lines))
    for key in BATCHER_RUNS.values():
        b = result.get(key)
        if b:
            parts.append(_format_batcher(b))
    h = result.get("http")
    if h:
        rounds = h.get("rounds", 1)
        lines = [
            "HTTP: symjax-mlp serve on loopback (uvicorn, keep-alive clients, bounded load); "
            f"each row the median of {rounds} interleaved runs; CPU: its server's, a request",
            f"  {'clients':>7} {'body':<5} {'req/s':>9} {'p50':>10} {'p99':>10} {'CPU':>10} "
            f"{'rows/batch':>10} {'errors':>6}",
        ]

        def cpu(r: dict) -> str:
            return "" if r.get("server_cpu_s") is None else us(r["server_cpu_s"])

        for r in h["rows"]:
            lines.append(
                f"  {r['clients']:>7} {r['body']:<5} {r['throughput_rps']:>9.0f} "
                f"{us(r['p50_s']):>10} {us(r['p99_s']):>10} {cpu(r):>10} "
                f"{r['rows_per_batch']:>10.1f} {r['errors']:>6}"
            )
        for key, parser in (("bare", "orjson"), ("bare_stdlib", "stdlib json")):
            for r in h.get(key, []):
                lines.append(
                    f"  {r['clients']:>7} {'bare':<5} {r['throughput_rps']:>9.0f} "
                    f"{us(r['p50_s']):>10} {us(r['p99_s']):>10} {cpu(r):>10}  "
                    f"(starlette, {parser}, constant)"
                )
        for r in h.get("ceiling", []):  # the bare endpoint answering the model's outputs
            lines.append(
                f"  {r['clients']:>7} {'ceil':<5} {r['throughput_rps']:>9.0f} "
                f"{us(r['p50_s']):>10} {us(r['p99_s']):>10} {cpu(r):>10}  "
                "(starlette, orjson, the model's call: serve's ceiling)"
            )
        for r in h["rows"]:
            if "vs_bare_stdlib" in r:
                top = r.get("vs_ceiling")  # what serve adds to the model's call
                lines.append(
                    f"  serve/bare at {r['clients']} client(s): {r['vs_bare']:.2f} (both orjson, "
                    f"the target's); against the stdlib-json endpoint {r['vs_bare_stdlib']:.2f}"
                    + ("" if top is None else f"; against its ceiling {top:.2f}")
                )
        lone = h.get("lone", {})
        if "served_compute_s" in lone and "call_hot_s" in lone:
            lines.append(
                f"  a lone client's request: the model's call {us(lone['served_compute_s'])} "
                f"inside serve (Server-Timing; queued {us(lone['served_queued_s'])}), against "
                f"{us(lone['call_hot_s'])} back to back in a fresh process, "
                f"{us(lone['call_after_sleep_s'])} after its CPU idled 300 µs, "
                f"{us(lone['call_after_spin_s'])} after a 300 µs spin: between a lone client's "
                "requests the server's CPU idles, and every call runs cold"
            )
        elif "idle_probe_error" in lone:
            lines.append(f"  the idle probe failed: {lone['idle_probe_error']}")
        lines.append(f"  server exit code after SIGINT: {h['server_exit_code']}")
        parts.append("\n".join(lines))
    if not parts:
        return "Serving benchmark: no sections were run."
    targets = result.get("targets", [])
    if targets:
        lines = ["Targets"]
        for t in targets:
            verdict = "reported" if t["met"] is None else ("met" if t["met"] else "MISSED")
            lines.append(f"  {t['what']}: {t['value']:.2f} (target {t['target']}): {verdict}")
        parts.append("\n".join(lines))
    env = result.get("env", {})
    where = f"{env.get('device', '?')}, {env.get('cpu_usable', '?')} usable cores"
    parts.append(f"Ran on {where}; jax {env.get('jax', '?')}.")
    parts.extend(f"note: {n}" for n in result.get("notes", []))
    return "\n\n".join(parts)
