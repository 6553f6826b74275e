"""The serving benchmark's targets and text: what :func:`~benchmarks.serving.bench_serving`
measured, judged and printed.

:func:`serving_targets` judges a result (64 clients >= 5x one-at-a-time, the batcher adding
<= 10 µs at concurrency 1, the HTTP section's own targets from
:func:`~benchmarks.http_rows.http_targets`); :func:`format_serving` prints the tables and the
targets, the batcher's cost a request at the top concurrency against the bare model's cost a
row at the batch size it formed, and the fastest PyTorch mode over JAX in latency mode
(reported: the per-request targets, against floors measured in the same process, are
:mod:`benchmarks.per_request`'s). :mod:`benchmarks.serving` runs the sections and re-exports
:func:`format_serving`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.batcher import BATCHER_RUNS, KINDS
from benchmarks.http_rows import http_targets
from benchmarks.latency import mode_label
from benchmarks.timing import format_seconds


def serving_targets(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The targets of a :func:`~benchmarks.serving.bench_serving` result (its
    ``targets``): each ``name``, ``what``, ``value``, ``target`` and ``met`` (``None``:
    reported)."""
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
      >>> from benchmarks.serving_report import format_serving
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
