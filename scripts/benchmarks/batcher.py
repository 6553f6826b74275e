"""Serving's batcher rows: a micro-batcher against direct calls, under three kinds of client.

:func:`batcher_rows` (run in one fresh subprocess per dispatch mode) times the
:class:`~symjax_mlp.serving.Batcher` at 1 client against direct calls, interleaved pair by
pair (:func:`_paired_c1`), then under each concurrency and each kind of client in
:data:`KINDS`: threads blocking in ``b(x)``, callers keeping futures in flight, coroutines
awaiting ``b.asubmit(x)``; each row against direct calls timed just before and after it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.calls import chapter_net, gated, per_call, percentiles


def batcher_rows(
    *, dispatch, sizes, in_features, activation, seed, clients, requests, max_batch
) -> dict:
    """The batcher section, in this (fresh) process: what :func:`benchmarks.serving.bench_serving`
    reports under ``batcher`` (see there)."""
    from symjax_mlp.serving import Batcher, dispatch_mode

    h, _, xn = chapter_net(sizes, in_features, activation, seed)
    pool = np.random.default_rng(seed + 1).standard_normal((256, 1, in_features), np.float32)
    rows = [pool[i] for i in range(len(pool))]
    following = itertools.cycle(rows).__next__

    def direct(x: np.ndarray) -> np.ndarray:
        return np.asarray(h(x))

    n_direct = max(200, requests // 4)
    t0 = time.perf_counter()
    timing = per_call(lambda: direct(following()), n_direct, 1)
    one = {**timing, "throughput_rps": 1.0 / timing["mean_s"], "wall_s": time.perf_counter() - t0}
    out = []
    with Batcher(h, example=xn, max_batch=max_batch) as b:
        compiled = h.trace_count  # every bucket traced and compiled by now
        c1 = _paired_c1(b, direct, rows, max(200, requests // 2))
        for clients_of in KINDS.values():  # warm every path
            clients_of(b, rows, 1, 50)
        direct_before = _direct_rps(direct, rows, n_direct)
        for c in clients:
            for kind, clients_of in KINDS.items():
                before = b.stats
                lat, wall = clients_of(b, rows, c, requests)
                after = b.stats
                batches = after.batches - before.batches
                direct_after = _direct_rps(direct, rows, n_direct)  # and the next row's before
                base = (direct_before + direct_after) / 2  # the same seconds as the row
                direct_before = direct_after
                out.append(
                    {
                        "clients": c,
                        "kind": kind,
                        "requests": len(lat),
                        "throughput_rps": len(lat) / wall,
                        "direct_rps": base,
                        "vs_direct": len(lat) / wall / base,
                        "rows_per_batch": (after.rows - before.rows) / max(1, batches),
                        "padded_rows": after.padded_rows - before.padded_rows,
                        "batches": batches,
                        **percentiles(lat),
                    }
                )
        stats = b.stats.to_dict()
        retraced = h.trace_count - compiled
    top = max(clients)
    bare = {r["kind"]: _bare_at_formed_batch(direct, rows, r) for r in out if r["clients"] == top}
    return {
        "dispatch": dispatch_mode(),
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "max_batch": max_batch,
        "direct": one,
        "c1": c1,
        "rows": out,
        "buckets": list(b.buckets),
        "traces_while_serving": retraced,
        "bare_at_formed_batch": bare,
        "stats": stats,
    }


def _bare_at_formed_batch(direct: Callable, rows: list[np.ndarray], row: dict) -> dict:
    """What the bare model costs a row at the batch size the batcher formed (its mean rows per
    batch, rounded), numpy in and out as a batch is: against the batcher's cost a request."""
    batch = max(1, round(row["rows_per_batch"]))
    xb = np.concatenate([rows[i % len(rows)] for i in range(batch)])
    best = per_call(lambda: direct(xb), 100, 5, warmup=20)["best_repeat_mean_s"]
    return {
        "clients": row["clients"],
        "batch": batch,
        "per_row_s": best / batch,
        "per_request_s": 1.0 / row["throughput_rps"],
    }


def _paired_c1(b: Any, direct: Callable, rows: list[np.ndarray], calls: int) -> dict:
    """A direct call and ``b(x)`` on the same input, alternated call by call (which goes first
    flips every pair), so that both see the same machine: the batcher's own cost at
    concurrency 1 is the median of the pairs' differences (robust to a busy machine, whose
    preemptions shift the two p50s apart at random; their difference is reported too)."""
    clock, k = time.perf_counter, len(rows)
    for i in range(100):
        direct(rows[i % k])
        b(rows[i % k])
    d, w = np.empty(calls), np.empty(calls)
    for i in range(calls):
        x = rows[i % k]
        if i & 1:
            t0 = clock()
            direct(x)
            t1 = clock()
            b(x)
            t2 = clock()
            d[i], w[i] = t1 - t0, t2 - t1
        else:
            t0 = clock()
            b(x)
            t1 = clock()
            direct(x)
            t2 = clock()
            w[i], d[i] = t1 - t0, t2 - t1
    direct_p, batcher_p = percentiles(d), percentiles(w)
    return {
        "direct": direct_p,
        "batcher": batcher_p,
        "added_p50_s": batcher_p["p50_s"] - direct_p["p50_s"],
        "added_paired_median_s": float(np.median(w - d)),
    }


def _direct_rps(direct: Callable, rows: list[np.ndarray], n: int) -> float:
    """One-at-a-time synced calls per second, over ``n`` calls."""
    k = len(rows)
    start = time.perf_counter()
    for i in range(n):
        direct(rows[i % k])
    return n / (time.perf_counter() - start)


def _threads(b: Any, rows: list[np.ndarray], c: int, requests: int) -> tuple[list[float], float]:
    """``c`` threads, each calling ``b(x)`` in a loop (a closed loop of blocking clients)."""
    per = max(1, requests // c)
    lats: list[list[float]] = [[] for _ in range(c)]
    gate = threading.Barrier(c + 1)

    def client(j: int) -> None:
        clock, mine, k = time.perf_counter, lats[j], len(rows)
        gate.wait()
        for i in range(per):
            t0 = clock()
            b(rows[(i * c + j) % k])
            mine.append(clock() - t0)

    wall = gated(client, c, gate)
    return [x for mine in lats for x in mine], wall


def _futures(b: Any, rows: list[np.ndarray], c: int, requests: int) -> tuple[list[float], float]:
    """``c`` requests kept in flight through ``submit`` and done-callbacks (async clients).

    A client's callback (on the batcher's thread) records its latency and submits the next
    request; ``next()`` on the shared counter and ``list.append`` are atomic, so no lock."""
    clock, done, k = time.perf_counter, threading.Event(), len(rows)
    lat: list[float] = []
    failed: list[BaseException] = []
    total = max(c, requests)
    issued = itertools.count()

    def launch() -> None:
        while (i := next(issued)) < total:  # a loop: a request answered at once (the lane
            t0 = clock()  # idle runs a lone call in its caller) would recurse through callbacks
            f = b.submit(rows[i % k])
            if not f.done():
                f.add_done_callback(lambda f, t0=t0: finished(f, t0))
                return
            if not counted(f, t0):
                return

    def counted(f: Any, t0: float) -> bool:
        """Records ``f``'s latency; whether to go on."""
        if (error := f.exception()) is not None:  # stop, and let the caller see it
            failed.append(error)
            done.set()
            return False
        lat.append(clock() - t0)
        if len(lat) == total:
            done.set()
        return len(lat) < total

    def finished(f: Any, t0: float) -> None:
        if counted(f, t0):
            launch()

    start = clock()
    for _ in range(c):
        launch()
    done.wait()
    if failed:
        raise failed[0]
    return lat, clock() - start


def _asyncio(b: Any, rows: list[np.ndarray], c: int, requests: int) -> tuple[list[float], float]:
    """``c`` coroutines on one event loop (this thread), each awaiting ``b.asubmit(x)`` in a
    loop: an asyncio server's handlers."""
    per, k, clock = max(1, requests // c), len(rows), time.perf_counter
    lats: list[float] = []

    async def client(j: int) -> None:
        for i in range(per):
            t0 = clock()
            await b.asubmit(rows[(i * c + j) % k])
            lats.append(clock() - t0)

    async def main() -> float:
        start = clock()
        await asyncio.gather(*(client(j) for j in range(c)))
        return clock() - start

    return lats, asyncio.run(main())


KINDS = {"threads": _threads, "futures": _futures, "asyncio": _asyncio}
#: The batcher section's runs, each in a fresh process, and their keys in the result.
BATCHER_RUNS = {"sync": "batcher", "async": "batcher_async", "pinned": "batcher_pinned"}
