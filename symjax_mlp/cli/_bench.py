"""The benchmark's command line, shared by ``scripts/bench.py`` and ``symjax-mlp bench``.

:func:`add_arguments` declares the options on any parser; :func:`main` runs
:func:`~symjax_mlp.bench.benchmark`, then ``--devices`` (:func:`~symjax_mlp.bench.bench_devices`)
and ``--sweep`` when asked, prints each report, and writes ``--json``. Progress: stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from symjax_mlp.bench import (
    bench_devices,
    benchmark,
    format_devices,
    format_report,
    format_sweep,
    plot_sweep,
    sweep,
)
from symjax_mlp.cli._args import sizes


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--devices must be an int >= 1; got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the benchmark's options to ``parser`` (shared by the script and the CLI)."""
    a = parser.add_argument
    a("--calls", type=int, default=1000, help="batch-1 calls per repeat (default 1000)")
    a("--repeats", type=int, default=15, help="repeats of the compiled rows (default 15)")
    a("--eager-chunks", type=int, default=10, help="chunks the eager calls are timed in")
    a("--sizes", type=sizes, default=(256, 128, 2), help="layer widths (default 256,128,2)")
    a("--in-features", type=int, default=512, help="input width (default 512)")
    a("--activation", default="relu", help="a jax.nn activation name (default relu)")
    a("--compare", action="append", default=[], choices=("torch",),
      help="add another framework's rows (torch: eager, jit.script, compile)")  # fmt: skip
    a("--stage-repeats", type=int, default=5, help="repeats of trace/lower/compile")
    a("--no-artifact", action="store_true", help="skip the exported-artifact rows")
    a("--no-iree", action="store_true", help="skip the IREE row")
    a("--no-train", action="store_true", help="skip the training-step section")
    a("--no-peak", action="store_true", help="skip the matmul-peak measurement")
    a("--devices", type=_count, metavar="N",
      help="also time sharded inference and training on 1, 2, 4, ... N devices (virtual CPU "
      "devices in a subprocess when fewer are visible: correctness only)")  # fmt: skip
    a("--sweep", action="store_true", help="also sweep batch sizes 1..--sweep-max")
    a("--sweep-max", type=int, default=65536, help="largest batch of the sweep (default 65536)")
    a("--sweep-eager-max", type=int, default=4096, help="largest eager batch (default 4096)")
    a("--sweep-out", default="bench_sweep", help="sweep writes PREFIX.json and PREFIX.png")
    a("--json", metavar="PATH", help="write every figure, with versions and device, as JSON")
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


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Runs the benchmark from the command line (``scripts/bench.py``, ``symjax-mlp bench``).

    Prints the chapter's two lines first, then the table, the stages, the device and the
    targets; ``--devices N`` adds throughput against device count, ``--sweep`` the batch-size
    sweep (JSON and PNG); ``--json`` writes it all.

    Args:
      args: parsed options (from :func:`add_arguments`), or argv to parse (``None``: sys.argv).

    Returns:
      The exit code, 0.
    """
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(
            prog="bench", description="The chapter's benchmark: eager vs hybridized and beyond."
        )
        args = add_arguments(parser).parse_args(args)
    progress = None if args.quiet else _Progress(sys.stderr)
    report = benchmark(
        calls=args.calls,
        repeats=args.repeats,
        eager_chunks=args.eager_chunks,
        sizes=args.sizes,
        in_features=args.in_features,
        activation=args.activation,
        compare=tuple(dict.fromkeys(args.compare)),
        artifact=not args.no_artifact,
        iree=not args.no_iree,
        train_step=not args.no_train,
        stage_repeats=args.stage_repeats,
        peak=not args.no_peak,
        progress=progress,
    )
    if progress:
        progress.done()
    print(format_report(report), flush=True)
    out = report.to_dict()
    if args.devices:
        if progress:
            progress(f"sharded inference and training on 1..{args.devices} devices")
        devices = bench_devices(args.devices, sizes=args.sizes, in_features=args.in_features)
        if progress:
            progress.done()
        out["devices"] = devices
        print("\n" + format_devices(devices), flush=True)
    if args.sweep:
        batches = tuple(b for b in (2**i for i in range(40)) if b <= args.sweep_max)
        sw = sweep(
            batch_sizes=batches,
            eager_max_batch=args.sweep_eager_max,
            sizes=args.sizes,
            in_features=args.in_features,
            activation=args.activation,
            progress=progress,
        )
        if progress:
            progress.done()
        out["sweep"] = sw.to_dict()
        print("\n" + format_sweep(sw))
        _write_json(sw.to_dict(), args.sweep_out + ".json")
        written = [args.sweep_out + ".json"]
        try:
            written.append(plot_sweep(sw, args.sweep_out + ".png"))
        except ImportError:
            print("note: matplotlib not installed; no plot (pip install symjax_mlp[plot])")
        print("wrote " + ", ".join(written))
    if args.json:
        _write_json(out, args.json)
        print(f"wrote {args.json}")
    return 0


def _write_json(obj: Any, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
