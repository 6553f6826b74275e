"""The fuzz driver: runs the cases in worker processes and sums up what happened.

Each worker (:mod:`fuzzing.worker`) runs a contiguous range of cases; the driver reads its
lines, gives each case ``timeout`` seconds, and when a worker dies inside a case (a crash) or a
case runs past its time (a hang) records that case and starts a new worker at the next one.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers import STRICT_WARNINGS

from fuzzing.worker import OK, TAG, target

TESTS = Path(__file__).resolve().parent.parent  # on the workers' PYTHONPATH: fuzzing is there


REPRODUCE = "PYTHONPATH=tests python -m fuzzing show OUT"  # from the repository root


def _worker_env() -> dict[str, str]:
    path = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(path))


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)  # end of output: the worker exited


def _drive(
    out: Path, seed: int, cases: list[int], timeout: float, results: dict, log, name: str
) -> None:
    """Runs ``cases`` (contiguous) in worker processes; restarts after a crash or a hang."""
    todo = collections.deque(cases)
    while todo:
        first, stop = todo[0], todo[-1] + 1
        cmd = [sys.executable, *STRICT_WARNINGS, "-m", "fuzzing.worker", str(out), str(seed)]
        proc = subprocess.Popen(
            [*cmd, str(first), str(stop), name],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=_worker_env(),
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        current, started = None, {}
        deadline = time.monotonic() + timeout + 120  # + start-up
        while True:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:  # a case (or the start-up) ran past its time: a hang
                proc.kill()
                proc.wait()
                if current is None:
                    raise RuntimeError(f"fuzz worker for {first}..{stop} never started") from None
                results[current] = dict(started, outcome="hang", seconds=timeout)
                results[current].pop("start")
                todo.popleft()
                current = None
                break
            if line is None:
                break
            if not line.startswith(TAG):
                continue
            msg = json.loads(line[len(TAG) :])
            if msg.get("start"):
                current, deadline = msg["case"], time.monotonic() + timeout
                started = msg
            else:
                results[msg["case"]] = msg
                todo.popleft()
                current = None
        rc = proc.wait()
        proc.stdout.close()
        if current is not None:  # died inside a case: that case crashed the interpreter
            results[current] = dict(started, outcome="crash", returncode=rc)
            results[current].pop("start")
            todo.popleft()
        elif rc not in (0, -9) and todo:
            raise RuntimeError(f"fuzz worker exited with {rc} outside a case; see workers-*.log")


def fuzz(
    out: Path,
    *,
    cases: int,
    seed: int = 0,
    workers: int = 2,
    timeout: float = 30,
    target_name: str = "loader",
) -> dict:
    """Runs ``cases`` fuzz cases of ``target_name`` over ``workers`` processes; returns the
    summary.

    The summary counts outcomes (``counts``), lists every failing case (``failures``, with how
    to reproduce it), and records per-family counts, the slowest case and the workers' peak
    memory.
    """
    out = Path(out).resolve()
    target(target_name)[0](out)
    (out / "PWNED").unlink(missing_ok=True)
    ids = list(range(cases))
    size = -(-cases // workers)
    ranges = [ids[i : i + size] for i in range(0, cases, size)]  # contiguous: fewer starts
    results: dict[int, dict] = {}
    t0 = time.perf_counter()
    with open(out / f"workers-{target_name}.log", "w") as log:
        threads = [
            threading.Thread(target=_drive, args=(out, seed, r, timeout, results, log, target_name))
            for r in ranges
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    missing = sorted(set(ids) - set(results))
    if missing:
        raise RuntimeError(f"fuzz cases {missing[:10]}... produced no result; see workers-*.log")
    counts = collections.Counter(r["outcome"] for r in results.values())
    families = collections.Counter(
        f"{r.get('family', '?')}:{r['outcome']}" for r in results.values()
    )
    failures = [
        dict(r, reproduce=f"{REPRODUCE} --target {target_name} --seed {seed} --case {r['case']}")
        for r in sorted(results.values(), key=lambda r: r["case"])
        if r["outcome"] not in OK
    ]
    timed = [r for r in results.values() if "seconds" in r]
    largest = max((r.get("largest_file_mb", 0) for r in timed), default=0)
    return {
        "target": target_name,
        "cases": cases,
        "seed": seed,
        "workers": workers,
        "seconds": round(time.perf_counter() - t0, 1),
        "counts": dict(counts),
        "families": dict(sorted(families.items())),
        "failures": failures,
        "slowest_case_s": max((r["seconds"] for r in timed), default=0),
        "max_rss_mb": max((r.get("max_rss_mb", 0) for r in timed), default=0),
        "largest_listed_file_mb": largest,
        "code_executed": (out / "PWNED").exists(),
    }
