"""The benchmark's command line: ``python scripts/bench.py [options]``.

:mod:`benchmarks.options` declares the options; :func:`main` runs
:func:`benchmarks.run.benchmark`, then ``--devices`` (:func:`benchmarks.devices.bench_devices`),
``--sweep``, ``--serving``, ``--ray``, ``--stateful`` and ``--coldstart`` when asked, prints
each report, and writes ``--json`` and the figures (PNG and SVG); ``--quick`` is a first look
in seconds, ``--diff OLD NEW`` compares two runs' JSON. Progress: stderr. Exit codes: 0 ok, 2
a usage error (a bad option, a ``symjax_mlp.SymjaxError``, a missing optional package: one
line, no traceback), 1 a bug (with the traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import symjax_mlp as sm
from benchmarks.compare import compare_runs, format_comparison
from benchmarks.devices import bench_devices
from benchmarks.figures import plot_devices, plot_sweep
from benchmarks.options import PROG, build_parser, check_writable, resolve, sweep_batches
from benchmarks.per_request import bench_per_request, format_per_request
from benchmarks.report import format_report
from benchmarks.run import benchmark
from benchmarks.scaling import format_devices, format_sweep, sweep
from benchmarks.serving import bench_serving, format_serving

#: A missing module -> what installs it (the project's extras).
EXTRAS = {"torch": "torch", "matplotlib": "plot", "iree": "iree", "sklearn": "data",
          "starlette": "serve", "uvicorn": "serve", "orjson": "serve", "ray": "ray"}  # fmt: skip


class _Progress:
    """Status lines on stderr: rewritten in place on a terminal, one per line otherwise."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.t0 = stream, time.perf_counter()
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def __call__(self, msg: str) -> None:
        line = f"[bench {time.perf_counter() - self.t0:6.1f}s] {msg}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:120])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark from the command line (``python scripts/bench.py``).

    Prints the chapter's two lines first, then the table, the stages, the device and the
    targets; ``--devices N`` adds throughput against device count, ``--sweep`` the batch-size
    sweep (JSON, PNG and SVG); ``--json`` writes it all. ``--quick`` is a first look in
    seconds; ``--diff OLD NEW`` compares two runs' JSON instead of running.

    Args:
      argv: the options (``None``: ``sys.argv[1:]``).

    Returns:
      The exit code: 0 ok, 2 a usage error (found before any work where it can be: a sweep
      range of fewer than 2 batch sizes, an unwritable ``--json``, an unreadable ``--diff``
      file), 1 a bug, 130 interrupted.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 on --help
        return int(e.code or 0)
    args = resolve(args)
    try:
        if args.json not in (None, "-"):
            check_writable(args.json)
        if args.json == "-":  # stdout is the JSON: everything else goes to stderr
            stdout = sys.stdout
            with contextlib.redirect_stdout(sys.stderr):
                code = _main(args)
            stdout.write(_JSON_OUT.pop())
            return code
        return _main(args)
    except (sm.SymjaxError, argparse.ArgumentTypeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        name = (e.name or "").split(".")[0]
        if name not in EXTRAS:
            raise
        print(f"{PROG}: error: this needs {name!r}: pip install 'symjax_mlp[{EXTRAS[name]}]'",
              file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print(f"{PROG}: this is a bug (the traceback above); please report it.", file=sys.stderr)
        return 1


def run(argv: Sequence[str] | None = None) -> None:
    """``scripts/bench.py``: exits with :func:`main`'s code (at once after an interrupt: XLA
    may still be compiling on its own threads, and tearing the interpreter down under them
    can crash or hang it)."""
    code = main(argv)
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(130)
    sys.exit(code)


_JSON_OUT: list[str] = []


def _main(args: argparse.Namespace) -> int:
    if args.diff:
        comparison = compare_runs(*args.diff)
        print(format_comparison(comparison), flush=True)
        if args.json:
            _write_json(comparison.to_dict(), args.json)
            print(f"wrote {args.json}")
        return 0
    batches = sweep_batches(args) if args.sweep else ()  # refused before any work
    progress = None if args.quiet else _Progress(sys.stderr)
    report = benchmark(
        calls=args.calls,
        repeats=args.repeats,
        eager_chunks=args.eager_chunks,
        sizes=args.sizes,
        in_features=args.in_features,
        activation=args.activation,
        compare=tuple(dict.fromkeys(args.compare)),
        artifact=args.artifact,
        iree=args.iree,
        train_step=args.train,
        stage_repeats=args.stage_repeats,
        peak=args.peak,
        latency=args.latency,
        quick=args.quick,
        progress=progress,
    )
    if progress:
        progress.done()
    print(format_report(report), flush=True)
    out = report.to_dict()
    if args.per_request:
        out["per_request"] = per = bench_per_request(
            sizes=args.sizes, in_features=args.in_features, activation=args.activation,
            calls=args.calls, repeats=args.repeats, iree=args.iree,
            rivals="torch" in args.compare, coldstart=args.coldstart, progress=progress,
        )  # fmt: skip
        if progress:
            progress.done()
        print("\n" + format_per_request(per), flush=True)
    if args.devices:
        if progress:
            progress(f"sharded inference and training on 1..{args.devices} devices")
        small = {"repeats": 5, "train_steps": 3} if args.quick else {}
        devices = bench_devices(
            args.devices, sizes=args.sizes, in_features=args.in_features, **small
        )
        if progress:
            progress.done()
        out["devices"] = devices
        print("\n" + format_devices(devices), flush=True)
        _plot(lambda: plot_devices(devices, args.devices_out, env=report.env), [])
    if args.sweep:
        quick = {"repeats": 3, "min_seconds": 0.01, "peak_size": 512, "peak_repeats": 3}
        sw = sweep(
            batch_sizes=batches,
            eager_max_batch=args.sweep_eager_max,
            sizes=args.sizes,
            in_features=args.in_features,
            activation=args.activation,
            progress=progress,
            **(quick if args.quick else {}),
        )
        if progress:
            progress.done()
        out["sweep"] = sw.to_dict()
        print("\n" + format_sweep(sw))
        _write_json(sw.to_dict(), args.sweep_out + ".json")
        _plot(lambda: plot_sweep(sw, args.sweep_out), [args.sweep_out + ".json"])
    if args.serving:
        out["serving"] = serving = bench_serving(
            sizes=args.sizes, in_features=args.in_features, activation=args.activation,
            progress=progress,
        )  # fmt: skip
        if progress:
            progress.done()
        print("\n" + format_serving(serving), flush=True)
    if args.ray:
        from benchmarks.ray_rows import bench_ray, format_ray

        out["ray"] = ray_rows = bench_ray(
            sizes=args.sizes, in_features=args.in_features, activation=args.activation,
            progress=progress,
        )  # fmt: skip
        if progress:
            progress.done()
        print("\n" + format_ray(ray_rows), flush=True)
    if args.stateful:
        from benchmarks.stateful import bench_stateful, format_stateful

        out["stateful"] = stateful = bench_stateful(progress=progress)
        if progress:
            progress.done()
        print("\n" + format_stateful(stateful), flush=True)
        out["stateful"] = {
            m: {r: t.to_dict() for r, t in rows.items()} for m, rows in stateful.items()
        }
    if args.coldstart:
        from benchmarks.coldstart import bench_coldstart, format_coldstart

        if progress:
            progress("cold starts in fresh processes")
        out["coldstart"] = coldstart = bench_coldstart(sizes=args.sizes)
        if progress:
            progress.done()
        print("\n" + format_coldstart(coldstart), flush=True)
    if args.json:
        _write_json(out, args.json)
        if args.json != "-":
            print(f"wrote {args.json}")
    return 0


def _plot(draw: Any, written: list[str]) -> None:
    """Draws a figure, and says what was written (a note when matplotlib is missing)."""
    try:
        written += draw()
    except ImportError:
        print("note: matplotlib not installed; no figure (pip install 'symjax_mlp[plot]')")
    if written:
        print("wrote " + ", ".join(written))


def _write_json(obj: Any, path: str) -> None:
    if path == "-":
        _JSON_OUT.append(json.dumps(obj, indent=2, default=str) + "\n")
        return
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
