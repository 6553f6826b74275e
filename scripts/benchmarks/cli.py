"""The benchmark's command line: ``python scripts/bench.py [options]``.

:func:`add_arguments` declares the options; :func:`main` runs :func:`benchmarks.run.benchmark`,
then ``--devices`` (:func:`benchmarks.devices.bench_devices`), ``--sweep``, ``--serving``,
``--ray``, ``--stateful`` and ``--coldstart`` when asked, prints each report, and writes
``--json`` and the figures (PNG and SVG); ``--quick`` is a first look in seconds,
``--diff OLD NEW`` compares two runs' JSON. Progress: stderr. Exit codes: 0 ok, 2 a usage
error (a bad option, a ``symjax_mlp.SymjaxError``, a missing optional package: one line, no
traceback), 1 a bug (with the traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import symjax_mlp as sm
from benchmarks.compare import compare_runs, format_comparison
from benchmarks.devices import bench_devices
from benchmarks.figures import plot_devices, plot_sweep
from benchmarks.per_request import bench_per_request, format_per_request
from benchmarks.report import format_report
from benchmarks.run import FULL, QUICK, benchmark
from benchmarks.scaling import format_devices, format_sweep, sweep
from benchmarks.serving import bench_serving, format_serving

PROG = "bench"
#: A missing module -> what installs it (the project's extras).
EXTRAS = {"torch": "torch", "matplotlib": "plot", "iree": "iree", "sklearn": "data",
          "starlette": "serve", "uvicorn": "serve", "orjson": "serve", "ray": "ray"}  # fmt: skip


def _positive(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{option} must be an int >= 1; got {text!r}")
        return int(text)

    return parse


def _sizes(text: str) -> tuple[int, ...]:
    """``"256,128,2"`` -> ``(256, 128, 2)``."""
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"--sizes must be comma-separated ints >= 1 such as 256,128,2; got {text!r}"
        )
    return tuple(int(p) for p in parts)


def _writable(path: str) -> None:
    """Refuses a ``--json`` path no file can be written to, before any work."""
    p = Path(path)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"--json {path}: is a directory; pass a file path")
    if not p.parent.exists():
        raise argparse.ArgumentTypeError(f"--json {path}: the directory {p.parent} does not exist")
    try:
        with tempfile.TemporaryFile(dir=p.parent):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"--json {path}: cannot write in {p.parent} ({e.strerror}); pass another path"
        ) from None


class _Preset:
    """A default that depends on ``--quick``; ``--help`` shows both (``1000; --quick: 50``)."""

    def __init__(self, full: Any, quick: Any) -> None:
        self.full, self.quick = full, quick

    def __str__(self) -> str:
        def show(v: Any) -> str:
            return {True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v)

        return f"{show(self.full)}; --quick: {show(self.quick)}"


def _preset(key: str) -> _Preset:
    return _Preset(FULL[key], QUICK[key])


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the benchmark's options to ``parser``.

    Every option's help shows its default; where ``--quick`` changes it, both values.
    """
    if not issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter):
        parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    a = parser.add_argument
    on_off = argparse.BooleanOptionalAction
    a("--quick", action="store_true",
      help=f"a first look in seconds: {QUICK['calls']} calls x {QUICK['repeats']} repeats; the "
      "slow sections (IREE, the training step, the matmul peak) off unless asked (--iree, "
      "--train, --peak); smaller --sweep and --devices runs; the report says it is "
      "quick")  # fmt: skip
    a("--calls", type=_positive("--calls"), default=_preset("calls"),
      help="batch-1 calls per repeat")  # fmt: skip
    a("--repeats", type=_positive("--repeats"), default=_preset("repeats"),
      help="repeats of the compiled rows")  # fmt: skip
    a("--eager-chunks", type=_positive("--eager-chunks"), default=_preset("eager_chunks"),
      help="chunks the eager calls are timed in (their repeats)")  # fmt: skip
    a("--sizes", type=_sizes, default=(256, 128, 2), help="layer widths")
    a("--in-features", type=_positive("--in-features"), default=512, help="input width")
    a("--activation", default="relu", help="a jax.nn activation name")
    a("--compare", action="append", default=[], choices=("torch",),
      help="add another framework's rows (torch: eager, jit.script, compile); to compare two "
      "runs' JSON, see --diff")  # fmt: skip
    a("--stage-repeats", type=_positive("--stage-repeats"), default=_preset("stage_repeats"),
      help="repeats of trace/lower/compile")  # fmt: skip
    a("--artifact", action=on_off, default=True, help="the exported-artifact rows")
    a("--iree", action=on_off, default=_preset("iree"), help="the artifact's IREE row")
    a("--train", action=on_off, default=_preset("train_step"), help="the training-step section")
    a("--peak", action=on_off, default=_preset("peak"), help="the matmul-peak measurement")
    a("--latency", action=on_off, default=True,
      help="the latency-mode row: h(x) with synchronous dispatch (sm.serving.latency_mode()), "
      "timed in a fresh process, interleaved with the others")  # fmt: skip
    a("--per-request", action=on_off, default=True,
      help="the per-request section: h(x) in latency mode against floors measured in the same "
      "fresh process (a jitted x + 1, the AOT executable with params as constants), the "
      "artifact, and with --compare torch the PyTorch/ONNX rows; with --coldstart their cold "
      "starts")  # fmt: skip
    a("--devices", type=_positive("--devices"), metavar="N",
      help="also time sharded inference and training on 1, 2, 4, ... N devices (virtual CPU "
      "devices in a subprocess when fewer are visible: correctness only); writes a figure to "
      "--devices-out")  # fmt: skip
    a("--devices-out", metavar="PREFIX", default="bench_devices",
      help="--devices writes PREFIX.png and PREFIX.svg")  # fmt: skip
    a("--sweep", action="store_true",
      help="also sweep batch sizes, the powers of two from --sweep-min to --sweep-max")  # fmt: skip
    a("--sweep-min", type=_positive("--sweep-min"), default=1, help="smallest batch of the sweep")
    a("--sweep-max", type=_positive("--sweep-max"), default=_Preset(65536, 4096),
      help="largest batch of the sweep (the range must hold at least 2 powers of two)")  # fmt: skip
    a("--sweep-eager-max", type=_positive("--sweep-eager-max"), default=_Preset(4096, 256),
      help="largest eager batch of the sweep")  # fmt: skip
    a("--sweep-out", metavar="PREFIX", default="bench_sweep",
      help="the sweep writes PREFIX.json, PREFIX.png and PREFIX.svg")  # fmt: skip
    a("--serving", action="store_true",
      help="also the serving benchmark: batch-1 latency per dispatch mode and "
      "PyTorch mode, each in a fresh process; the micro-batcher under 1, 8, 64 clients; "
      "symjax-mlp serve over loopback")  # fmt: skip
    a("--ray", action="store_true",
      help="also Ray Serve's rows (the symjax_mlp[ray] extra): a lone request through a "
      "DeploymentHandle against a no-op deployment; 64 in flight, one replica against two, "
      "and where the CPU time goes")  # fmt: skip
    a("--diff", nargs=2, metavar=("OLD.json", "NEW.json"),
      help="instead of benchmarking, compare two runs' --json files: the ratio per row, its "
      "noise band (from each row's min/median spread) and the rows changed beyond the noise "
      "(--compare is something else: another framework's rows)")  # fmt: skip
    a("--stateful", action="store_true",
      help="also stateful models (BatchNorm in train mode, nnx Dropout): the Hybrid against "
      "the same function jitted by hand, state passed and returned, and nnx.jit")  # fmt: skip
    a("--coldstart", action="store_true",
      help="also cold starts: a fresh process imports, loads the artifact and calls it, "
      "first and later runs, against import jax + one jitted call")  # fmt: skip
    a("--json", nargs="?", const="-", metavar="PATH",
      help="write every figure, with versions and device, as JSON (schema 1) to PATH (no "
      "PATH or '-': to stdout, the report to stderr); with --diff, the comparison")  # fmt: skip
    a("--quiet", action="store_true", help="no progress display on stderr")
    return parser


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


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Replaces each ``--quick``-dependent default by its value for this run."""
    for key, value in vars(args).items():
        if isinstance(value, _Preset):
            setattr(args, key, value.quick if args.quick else value.full)
    return args


def _sweep_batches(args: argparse.Namespace) -> tuple[int, ...]:
    """The powers of two from --sweep-min to --sweep-max; fewer than 2 is a usage error."""
    lo, hi = args.sweep_min, args.sweep_max
    batches = tuple(b for b in (2**i for i in range(41)) if lo <= b <= hi)
    if len(batches) < 2:
        raise sm.ConfigError(
            f"--sweep-min {lo} --sweep-max {hi} gives {len(batches)} batch size(s) "
            f"{list(batches)}; a sweep needs at least 2 powers of two in the range, e.g. "
            f"--sweep-max {max(4, 4 * lo)}"
        )
    return batches


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``scripts/bench.py``: every option's help shows its default."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="The chapter's benchmark: eager vs hybridized and beyond.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    return add_arguments(parser)


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
    args = _resolve(args)
    try:
        if args.json not in (None, "-"):
            _writable(args.json)
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
    batches = _sweep_batches(args) if args.sweep else ()  # refused before any work
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
