"""``symjax-mlp`` / ``python -m symjax_mlp``: one subcommand per public function.

Exit codes: 0 ok, 2 user error (bad arguments, a :class:`~symjax_mlp.SymjaxError`), 1 bug.
No logic lives only here: each handler parses, calls one library function, prints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes must be comma-separated ints such as 256,128,2; got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes must be positive ints; got {text!r}")
    return sizes


# -- tour ------------------------------------------------------------------------------------
def _add_tour(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tour", help="the chapter, step by step, on real objects")
    p.add_argument("--calls", type=int, default=1000, help="calls in the short timing")
    p.set_defaults(handler=_run_tour)


def _run_tour(args: argparse.Namespace) -> int:
    from symjax_mlp.tour import tour

    tour(calls=args.calls)
    return 0


# -- graph -----------------------------------------------------------------------------------
def _add_graph(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graph", help="print the MLP's symbolic program")
    p.add_argument("--sizes", type=_sizes, default=(256, 128, 2))
    p.add_argument("--in-features", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--activation", default="relu")
    p.add_argument(
        "--format", choices=("jaxpr", "stablehlo", "hlo", "dot", "summary"), default="summary"
    )
    p.set_defaults(handler=_run_graph)


def _run_graph(args: argparse.Namespace) -> int:
    from symjax_mlp.tour import describe_mlp

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

# -- bench (issue: benchmark) ----------------------------------------------------------------

# -- train (issue: training) -----------------------------------------------------------------

_COMMANDS = (_add_tour, _add_graph)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="symjax-mlp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 2 user error, 1 bug)."""
    from symjax_mlp.errors import SymjaxError

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
