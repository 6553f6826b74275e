"""``symjax-mlp train``: :func:`symjax_mlp.training.train` on the bundled digits data.

The ``--json`` and ``--export`` targets are refused before the first epoch; in a
multi-process run (``--coordinator``) process 0 writes them, and refuses them before it joins.
Progress: a rich bar on a terminal, plain lines on stderr otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from symjax_mlp.cli import _args
from symjax_mlp.cli._args import count, natural, positive

_OPTIONS = (
    ("--sizes", {"type": _args.int_list("128,64,10"), "default": (128, 64, 10),
                 "help": "layer widths"}),
    ("--epochs", {"type": natural, "default": 20}),  # 0: --init-from's weights as they are
    ("--batch-size", {"type": count, "default": 64}),
    ("--learning-rate", {"type": positive, "default": 1e-3, "help": "adam's"}),
    ("--seed", {"type": int, "default": 0}),
    ("--eager", {"action": "store_true", "help": "run the step eagerly, not compiled"}),
    ("--checkpoint", {"metavar": "DIR", "help": "write checkpoints here: every "
     "--checkpoint-every epochs, and after the last"}),
    ("--checkpoint-every", {"type": count, "default": 1, "metavar": "EPOCHS"}),
    ("--resume", {"action": "store_true", "help": "continue from --checkpoint DIR"}),
    ("--init-from", {"metavar": "DIR", "help": "start a new run (its own optimizer state, epoch "
     "0) from the weights of DIR's newest checkpoint, which stays as it is"}),
    _args.json_option("the history"),
    ("--export", {"metavar": "PATH", "help": "export the trained model as an artifact"}),
    ("--overwrite", {"action": "store_true", "help": "replace --export/--json targets"}),
    ("--quiet", {"action": "store_true", "help": "no progress"}),
    ("--blocks", {"type": count, "help": "gradient blocks (default: 1, or with --coordinator "
     "the run's number of devices): bitwise the same for any process count"}),
    ("--coordinator", {"metavar": "HOST:PORT", "help": "process 0's address: one of "
     "--num-processes processes"}),
    ("--num-processes", {"type": count, "default": 1}),
    ("--process-id", {"type": int, "default": 0}),
    ("--timeout", {"type": count, "default": 60, "metavar": "SECONDS", "help": "how long a "
     "process waits for another before the run fails"}),
)  # fmt: skip


def run(args: argparse.Namespace) -> None:
    """Trains, shows each epoch, then writes what ``--json`` and ``--export`` ask for."""
    from pathlib import Path

    from symjax_mlp import mlp
    from symjax_mlp._artifact.format import check_target, printable
    from symjax_mlp.training import initialize, train
    from symjax_mlp.training._processes import RESUME

    several = args.num_processes > 1 or args.coordinator or args.process_id
    if several and not args.coordinator:  # else --process-id N alone would skip the targets
        given = "--num-processes" if args.num_processes > 1 else "--process-id"
        raise argparse.ArgumentTypeError(f"{given} needs --coordinator HOST:PORT")
    if args.process_id:  # one writer of the results: process 0
        args.json = args.export = None
    if args.json is not None:  # refused before training, never after ("" too)
        _args.writable(args.json, "--json", overwrite=args.overwrite)
        others = {"--checkpoint": args.checkpoint, "--init-from": args.init_from}
        _apart("--json", args.json, others, "the JSON is a file")
    if args.export is not None:
        if not args.export:  # Path("") is the working directory
            raise argparse.ArgumentTypeError("--export '': is empty; pass a directory path")
        check_target(target := Path(args.export), args.overwrite)
        _args.writable_in(next(p for p in target.parents if p.exists()), f"--export {args.export}:")
        others = {
            "--checkpoint": args.checkpoint,
            "--json": args.json,
            "--init-from": args.init_from,
        }
        _apart("--export", args.export, others, "the artifact is a directory")
    if several:  # after the targets' checks: a refusal once joined left the others waiting,
        # then JAX aborted every process (SIGABRT) when its shutdown barrier timed out
        initialize(args.coordinator, args.num_processes, args.process_id, timeout=args.timeout)
    resume = RESUME.set("--resume")  # train's words, in the CLI's (a relaunch, no checkpoint)
    told, log = _Told(), logging.getLogger("symjax_mlp.training")  # train's "resuming from"
    level = log.level
    if not args.quiet:
        log.addHandler(told)
        log.setLevel(logging.INFO)
    try:
        with _progress(args.epochs, quiet=args.quiet) as on_epoch:
            options = "learning_rate epochs batch_size seed checkpoint checkpoint_every resume "
            keyed = _args.keywords(args, options + "init_from blocks")
            result = train(mlp(args.sizes), compiled=not args.eager, on_epoch=on_epoch, **keyed)
    finally:
        RESUME.reset(resume)
        log.removeHandler(told)
        log.setLevel(level)
    if args.json is not None:
        _args.emit_json(result.to_dict(), args.json)
    if args.export is not None:
        result.export(args.export, overwrite=args.overwrite)
        where = printable(args.export)  # as export prints it: \x1b, \xfc not acted on
        _args.say(f"exported the trained model to {where} (it takes raw pixels)")
    _args.say(
        f"test accuracy {result.test_accuracy:.2%} after {result.epoch} epochs "
        f"({result.step} steps, {'compiled' if result.compiled else 'eager'}) "
        f"in {result.train_seconds:.1f} s",
        sys.stderr if args.json == "-" else sys.stdout,
    )


class _Told(logging.Handler):
    """What train() logs (``resuming from PATH``, once that checkpoint is checked), on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        _args.say(record.getMessage(), sys.stderr)


def _apart(option: str, target: str, others: dict[str, str | None], what: str) -> None:
    """Refuses, before training, an ``--export`` or ``--json`` ``target`` that is or holds
    another target: ``what`` it is, written last, would be refused there, after the epochs."""
    home = os.path.realpath(target)
    for other, path in others.items():
        there = os.path.realpath(path) if path and path != "-" and target != "-" else None
        if there and os.path.commonpath((home, there)) == home:
            raise argparse.ArgumentTypeError(
                f"{option} {target}: {'is' if there == home else 'would hold'} the {other} "
                f"{path}; {what} of its own, written after training, which would be refused "
                f"there. Pass {option} another path."
            )


@contextlib.contextmanager
def _progress(epochs: int, *, quiet: bool) -> Iterator[Callable[[Any], None] | None]:
    """``on_epoch`` for :func:`symjax_mlp.training.train`: a bar over ``epochs``, or lines."""
    if quiet:
        yield None
        return

    def line(r: Any) -> str:
        return (
            f"loss {r.loss:.4f}  train {r.train_accuracy:.2%}  test {r.test_accuracy:.2%}  "
            f"{r.seconds:.2f} s"
        )

    if not sys.stderr.isatty():
        width = len(str(epochs))

        def plain(r: Any) -> None:
            bar = ("#" * round(20 * r.epoch / epochs)).ljust(20, ".")
            print(f"epoch {r.epoch:>{width}}/{epochs} [{bar}] {line(r)}", file=sys.stderr)

        yield plain
        return
    from rich import progress as rp
    from rich.console import Console

    columns = (
        rp.TextColumn("epoch"),
        rp.MofNCompleteColumn(),
        rp.BarColumn(),
        rp.TimeElapsedColumn(),
        rp.TextColumn("ETA"),
        rp.TimeRemainingColumn(),
        rp.TextColumn("{task.description}"),
    )
    with rp.Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("", total=epochs)
        yield lambda r: bar.update(task, completed=r.epoch, description=line(r))


COMMAND = ("train an MLP on the bundled digits data with optax", run, _OPTIONS)  # as _run's
