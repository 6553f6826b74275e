"""``symjax-mlp train``: :func:`symjax_mlp.training.train` on the bundled digits data.

The ``--json`` and ``--export`` targets are refused before the first epoch; in a
multi-process run (``--coordinator``) process 0 writes them.
"""

from __future__ import annotations

import argparse
import sys

from symjax_mlp.cli import _args
from symjax_mlp.cli._args import add_json, emit_json, positive, sizes, subcommand, writable


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declares ``train`` and its options on the CLI's subcommands."""
    p = subcommand(sub, "train", "train an MLP on the bundled digits data with optax")
    p.add_argument("--sizes", type=sizes, default=(128, 64, 10), help="layer widths")
    p.add_argument("--epochs", type=positive("--epochs"), default=20)
    p.add_argument("--batch-size", type=positive("--batch-size"), default=64)
    p.add_argument(
        "--learning-rate", type=positive("--learning-rate", float), default=1e-3, help="adam's"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true", help="run the step eagerly, not compiled")
    p.add_argument("--checkpoint", metavar="DIR", help="write a checkpoint every epoch here")
    p.add_argument(
        "--checkpoint-every", type=positive("--checkpoint-every"), default=1, metavar="EPOCHS"
    )
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint DIR")
    add_json(p, "the history")
    p.add_argument("--export", metavar="PATH", help="export the trained model as an artifact")
    p.add_argument("--overwrite", action="store_true", help="replace --export/--json targets")
    p.add_argument("--quiet", action="store_true", help="no progress")
    p.add_argument("--blocks", type=positive("--blocks"), help="gradient blocks (default: 1, or "
                   "the number of processes): bitwise the same for any process count")  # fmt: skip
    p.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address: one of "
                   "--num-processes processes")  # fmt: skip
    p.add_argument("--num-processes", type=positive("--num-processes"), default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--timeout", type=positive("--timeout"), default=60, metavar="SECONDS",
                   help="how long a process waits for another before the run fails")  # fmt: skip
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Trains, shows each epoch, then writes what ``--json`` and ``--export`` ask for."""
    from pathlib import Path

    from symjax_mlp import mlp
    from symjax_mlp._artifact.format import check_target
    from symjax_mlp.cli._progress import epochs_progress
    from symjax_mlp.training import initialize, train

    if args.num_processes > 1 or args.coordinator or args.process_id:
        if not args.coordinator:  # else --process-id N alone would skip --json and --export
            given = "--num-processes" if args.num_processes > 1 else "--process-id"
            raise argparse.ArgumentTypeError(f"{given} needs --coordinator HOST:PORT")
        initialize(args.coordinator, args.num_processes, args.process_id, timeout=args.timeout)
    if args.process_id:  # one writer of the results: process 0
        args.json = args.export = None
    if args.json is not None:  # refused before training, never after ("" too)
        writable(args.json, "--json", overwrite=args.overwrite)
    if args.export is not None:
        if not args.export:  # Path("") is the working directory
            raise argparse.ArgumentTypeError("--export '': is empty; pass a directory path")
        check_target(Path(args.export), args.overwrite)
    if args.resume and not args.checkpoint:
        raise argparse.ArgumentTypeError("--resume needs --checkpoint DIR, the directory to use")
    with epochs_progress(args.epochs, quiet=args.quiet) as on_epoch:
        options = "learning_rate epochs batch_size seed checkpoint checkpoint_every resume blocks"
        keyed = _args.keywords(args, options)
        result = train(mlp(args.sizes), compiled=not args.eager, on_epoch=on_epoch, **keyed)
    if args.json is not None:
        emit_json(result.to_dict(), args.json)
    if args.export is not None:
        result.export(args.export, overwrite=args.overwrite)
        print(f"exported the trained model to {args.export} (it takes raw pixels)")
    print(
        f"test accuracy {result.test_accuracy:.2%} after {result.epoch} epochs "
        f"({result.step} steps, {'compiled' if result.compiled else 'eager'}) "
        f"in {result.train_seconds:.1f} s",
        file=sys.stderr if args.json == "-" else sys.stdout,
    )
    return 0
