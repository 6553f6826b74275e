"""``symjax-mlp`` / ``python -m symjax_mlp``: one subcommand per public function.

Exit codes: 0 ok, 2 user error (bad arguments, a :class:`~symjax_mlp.SymjaxError`), 1 bug.
No logic lives only here: each handler parses, calls one library function, prints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from symjax_mlp.cli._args import sizes


# -- tour ------------------------------------------------------------------------------------
def _add_tour(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tour", help="the chapter, step by step, on real objects")
    p.add_argument("--calls", type=int, default=1000, help="calls in the short timing")
    p.set_defaults(handler=_run_tour)


def _run_tour(args: argparse.Namespace) -> int:
    from symjax_mlp.chapter import tour

    tour(calls=args.calls)
    return 0


# -- graph -----------------------------------------------------------------------------------
def _add_graph(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graph", help="print the MLP's symbolic program")
    p.add_argument("--sizes", type=sizes, default=(256, 128, 2))
    p.add_argument("--in-features", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--activation", default="relu")
    p.add_argument(
        "--format", choices=("jaxpr", "stablehlo", "hlo", "dot", "summary"), default="summary"
    )
    p.set_defaults(handler=_run_graph)


def _run_graph(args: argparse.Namespace) -> int:
    from symjax_mlp.chapter import describe_mlp

    print(
        describe_mlp(
            args.sizes,
            in_features=args.in_features,
            batch=args.batch,
            activation=args.activation,
            format=args.format,
        )
    )
    return 0


# -- export / inspect / run / verify (issue: artifacts) --------------------------------------
def _batch(text: str) -> str | int:
    if text.isdigit() and int(text) >= 1:
        return int(text)
    if text.isidentifier():
        return text
    raise argparse.ArgumentTypeError(
        f"--batch must be a name for a symbolic batch (b) or a static size >= 1; got {text!r}"
    )


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export the chapter's MLP as a portable artifact")
    p.add_argument("path", help="the artifact directory to write")
    p.add_argument("--sizes", type=sizes, default=(256, 128, 2), help="layer widths")
    p.add_argument("--in-features", type=int, default=512)
    p.add_argument("--activation", default="relu")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights")
    p.add_argument("--batch", type=_batch, default="b", help="symbolic name (b) or a size")
    p.add_argument("--platforms", default="cpu", help="comma-separated, e.g. cpu,cuda")
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact")
    p.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from symjax_mlp.chapter import export_mlp

    art = export_mlp(
        args.path,
        sizes=args.sizes,
        in_features=args.in_features,
        activation=args.activation,
        seed=args.seed,
        batch=args.batch,
        platforms=tuple(p for p in args.platforms.split(",") if p),
        overwrite=args.overwrite,
    )
    print(f"exported {art.path}: {art.signature}; platforms {', '.join(art.platforms)}")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="an artifact's manifest, signature and StableHLO ops")
    p.add_argument("path", help="an artifact directory")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(handler=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    import json

    from symjax_mlp import inspect

    art = inspect(args.path)
    print(json.dumps(art.to_json(), indent=2) if args.json else art)
    return 0


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run an artifact on .npy inputs, write .npy outputs")
    p.add_argument("path", help="an artifact directory")
    p.add_argument("--input", action="append", required=True, help=".npy file, once per input")
    p.add_argument("--output", action="append", required=True, help=".npy file per output")
    p.add_argument("--runtime", choices=("jax", "iree"), default="jax")
    p.set_defaults(handler=_run_run)


def _run_run(args: argparse.Namespace) -> int:
    import numpy as np

    from symjax_mlp import load

    xs = [np.load(f, allow_pickle=False) for f in args.input]
    out = load(args.path, runtime=args.runtime)(*xs)
    outs = list(out) if isinstance(out, tuple) else [out]
    if len(outs) != len(args.output):
        raise ValueError(f"the artifact returns {len(outs)} array(s); pass --output that often")
    for file, y in zip(args.output, outs, strict=True):
        np.save(file, np.asarray(y))
        print(f"wrote {file}: {y.dtype}{list(y.shape)}")
    return 0


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="reload an artifact in a fresh process and check it")
    p.add_argument("path", help="an artifact directory")
    p.add_argument("--runtime", action="append", choices=("jax", "iree"), help="repeatable")
    p.add_argument("--batches", type=sizes, default=(1, 7, 128), help="e.g. 1,7,128")
    p.set_defaults(handler=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from symjax_mlp import verify

    report = verify(args.path, runtimes=tuple(args.runtime or ("jax",)), batches=args.batches)
    print(report)
    return 0 if report.ok else 2


# -- bench (issue: benchmark) ----------------------------------------------------------------
def _add_bench(sub: argparse._SubParsersAction) -> None:
    from symjax_mlp.cli._bench import add_arguments

    p = sub.add_parser("bench", help="the chapter's benchmark: eager vs hybridized and beyond")
    add_arguments(p)
    p.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from symjax_mlp.cli._bench import main

    return main(args)


# -- train (issue: training) -----------------------------------------------------------------
def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train an MLP on the bundled digits data with optax")
    p.add_argument("--sizes", type=sizes, default=(128, 64, 10), help="layer widths")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=1e-3, help="adam's learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true", help="run the step eagerly, not compiled")
    p.add_argument("--checkpoint", metavar="DIR", help="write a checkpoint every epoch here")
    p.add_argument("--checkpoint-every", type=int, default=1, metavar="EPOCHS")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint DIR")
    p.add_argument("--json", metavar="PATH", help="write the history as JSON")
    p.add_argument("--export", metavar="PATH", help="export the trained model as an artifact")
    p.add_argument("--quiet", action="store_true", help="no per-epoch progress")
    p.set_defaults(handler=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from symjax_mlp import mlp
    from symjax_mlp.training import train

    def progress(r) -> None:
        done = round(20 * r.epoch / args.epochs)
        print(
            f"epoch {r.epoch:>{len(str(args.epochs))}}/{args.epochs} "
            f"[{'#' * done}{'.' * (20 - done)}] loss {r.loss:.4f}  "
            f"train {r.train_accuracy:.2%}  test {r.test_accuracy:.2%}  {r.seconds:.2f} s",
            file=sys.stderr,
            flush=True,
        )

    result = train(
        mlp(args.sizes),
        learning_rate=args.learning_rate,
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        compiled=not args.eager,
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        on_epoch=None if args.quiet else progress,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    if args.export:
        result.export(args.export)
        print(f"exported the trained model to {args.export}")
    print(
        f"test accuracy {result.test_accuracy:.2%} after {result.epoch} epochs "
        f"({result.step} steps, {'compiled' if result.compiled else 'eager'}) "
        f"in {result.train_seconds:.1f} s"
    )
    return 0


_COMMANDS = (
    _add_tour,
    _add_graph,
    _add_export,
    _add_inspect,
    _add_run,
    _add_verify,
    _add_bench,
    _add_train,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="symjax-mlp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 2 user error, 1 bug)."""
    from symjax_mlp import SymjaxError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 on --help
        return int(e.code or 0)
    try:
        return args.handler(args)
    except (SymjaxError, ValueError, FileNotFoundError) as e:
        print(f"symjax-mlp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
