"""The fuzz worker process: runs a range of cases, one JSON line each on stdout.

``python -m fuzzing.worker OUT SEED FIRST STOP [TARGET]`` (``tests`` on ``PYTHONPATH``; the
driver, :mod:`fuzzing.driver`, starts it) runs cases ``FIRST`` to ``STOP - 1`` of ``TARGET``
(:data:`TARGETS`: ``loader``, the default, ``entries``, ``hostile``, ``checkpoint``, ``bodies``,
``regions``)
against what ``make`` wrote in ``OUT``. Before loading each case it prints a ``start`` line,
so that a case that kills or hangs the interpreter is still attributed; after it, the result:
the outcome (see :mod:`fuzzing`), what was mutated, the time and the peak memory. Result lines
start with :data:`TAG` (libraries may print to stdout too). Its address space is limited to
:data:`MEMORY_LIMIT`, so an enormous allocation fails, visibly.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

from fuzzing.cases import Context, case_rng, host, same
from fuzzing.mutations import mutate

TAG = "@fuzz "  # prefix of the worker's result lines (libraries may print to stdout too)
OK = ("rejected", "same")
MEMORY_LIMIT = 4 << 30  # address space per worker: an enormous allocation fails, visibly


def run_case(
    ctx: Context, seed: int, case: int, *, started=None, verbose: bool = False,
    mutate=mutate, check=None,
) -> dict:  # fmt: skip
    """Runs one case; returns its JSON-ready result (``started(info)`` runs before loading).

    ``mutate(rng, ctx)`` mutates the case; ``check(ctx, spec, case) -> (outcome, detail)``
    loads and judges it (default: :func:`check_loaded`).
    """
    rng = case_rng(seed, case)
    t0 = time.perf_counter()
    spec = mutate(rng, ctx)
    if started is not None:
        started({"case": case, "family": spec["family"], "notes": spec["notes"]})
    outcome, detail = (check or check_loaded)(ctx, spec, case)
    if ctx.marker.exists():
        outcome, detail = "executed", f"{ctx.marker} appeared"
    if verbose:
        print(detail)
    return {
        "case": case,
        "family": spec["family"],
        "notes": spec["notes"],
        "outcome": outcome,
        "detail": detail[:2000],
        "seconds": round(time.perf_counter() - t0, 4),
        "max_rss_mb": peak_rss_mb(),
    }


def check_loaded(ctx: Context, spec: dict, case: int) -> tuple[str, str]:
    """``sm.load(case)(x)``: refused, or the original's output (or, for re-signed weights, what
    safetensors' own reader finds)."""
    import symjax_mlp as sm

    if spec["params"] is not None:
        expected, nan_equal = ctx.expected_for_params(spec["params"]), True
    else:
        expected, nan_equal = ctx.expected, False
    sabotage = _sabotage().get(case)

    def call():  # sabotage (the driver's self-test) misbehaves on the original
        got = host(sm.load(ctx.original if sabotage else ctx.case)(ctx.x))
        return _sabotaged(sabotage, got) if sabotage else got

    got, outcome, detail = attempt(call)
    return (outcome, detail) if outcome else judge(got, expected, spec, nan_equal=nan_equal)


def attempt(call) -> tuple[object, str, str]:
    """``(call(), "", "")``, or ``(None, outcome, detail)`` if it raised: ``rejected`` for a
    library error, ``foreign`` (with the traceback's end) for any other exception."""
    import symjax_mlp as sm

    try:
        return call(), "", ""
    except sm.SymjaxError as e:
        return None, "rejected", f"{type(e).__name__}: {e}"
    except Exception as e:
        tb = "".join(traceback.format_tb(e.__traceback__)[-4:])
        return None, "foreign", f"{type(e).__name__}: {e}\n{tb}"


def judge(got, expected, spec: dict, *, nan_equal: bool = False) -> tuple[str, str]:
    """What a case that loaded and ran did: ``escaped`` (its files reach outside),
    ``same`` (bit-for-bit ``expected``; None: nothing may run) or ``wrong``."""
    if spec["escapes"]:
        return "escaped", ""
    if expected is not None and same(got, expected, nan_equal=nan_equal):
        return "same", ""
    return "wrong", f"got {got!r}, expected {expected!r}"


def _sabotage() -> dict[int, str]:
    """``SYMJAX_FUZZ_SELFTEST="3=crash,5=hang,7=foreign,9=wrong"``: cases that misbehave on
    purpose, so a test can check that the driver sees every kind of failure."""
    spec = os.environ.get("SYMJAX_FUZZ_SELFTEST", "")
    return {int(k): v for k, v in (item.split("=") for item in spec.split(",") if item)}


def _sabotaged(kind: str, got):
    if kind == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind == "hang":
        time.sleep(3600)
    if kind == "foreign":
        raise RuntimeError("sabotaged")
    return (got[0], tuple(a + 1 for a in got[1]))  # "wrong"


def peak_rss_mb() -> int:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the
    process that forked it)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


# -- the worker process ------------------------------------------------------------------------
TARGETS = ("loader", "entries", "hostile", "checkpoint", "bodies", "regions")  # fuzzing.driver


def target(name: str):
    """``(make, Context, run_case)`` of a fuzz target."""
    if name == "loader":
        from fuzzing.cases import make

        return make, Context, run_case
    if name == "entries":
        from fuzzing import entries

        return entries.make, entries.Context, entries.run_case
    if name == "hostile":
        from fuzzing import hostile

        return hostile.make, hostile.Context, hostile.run_case
    if name == "checkpoint":
        from fuzzing import checkpoints

        return checkpoints.make, checkpoints.Context, checkpoints.run_case
    if name == "bodies":
        from fuzzing import bodies

        return bodies.make, bodies.Context, bodies.run_case
    if name == "regions":
        from fuzzing import regions

        return regions.make, regions.Context, regions.run_case
    raise ValueError(f"unknown fuzz target {name!r}; choose from {TARGETS}")


def worker(out: Path, seed: int, first: int, stop: int, name: str = "loader") -> None:
    """Runs cases ``first`` to ``stop - 1``, one JSON line each (after a ``start`` line)."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    work = out / f"work-{name}-{os.getpid()}"
    _, context, run = target(name)
    try:
        ctx = context(out, work)

        def started(info: dict) -> None:
            print(TAG + json.dumps(dict(info, start=True)), flush=True)

        for case in range(first, stop):
            print(TAG + json.dumps(run(ctx, seed, case, started=started)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # python -m fuzzing.worker OUT SEED FIRST STOP [TARGET]
    out, seed, first, stop, *name = sys.argv[1:]
    with contextlib.suppress(BrokenPipeError):
        worker(Path(out), int(seed), int(first), int(stop), *name)
