"""The benchmark's options: ``python scripts/bench.py --help``.

:func:`add_arguments` declares them, each help showing its default, and both values where
``--quick`` changes it (:func:`resolve` picks this run's); :func:`build_parser` is the parser
of ``scripts/bench.py``. What can be refused before any work is refused here: a bad value
(ints >= 1, ``--sizes``), a ``--json`` path no file can be written to
(:func:`check_writable`), a sweep range of fewer than 2 batch sizes (:func:`sweep_batches`).
:mod:`benchmarks.cli` runs what they ask.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import symjax_mlp as sm
from benchmarks.run import FULL, QUICK

PROG = "bench"


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


def check_writable(path: str) -> None:
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


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Replaces each ``--quick``-dependent default by its value for this run."""
    for key, value in vars(args).items():
        if isinstance(value, _Preset):
            setattr(args, key, value.quick if args.quick else value.full)
    return args


def sweep_batches(args: argparse.Namespace) -> tuple[int, ...]:
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
