"""``python -m fuzzing``: a fuzz run, or one case shown in full (``tests`` on PYTHONPATH)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from fuzzing.driver import fuzz
from fuzzing.worker import TARGETS, target


def main(argv: list[str]) -> None:
    """``fuzz OUT [--target T --cases N --seed S --workers W --timeout T]`` or
    ``show OUT [--target T] --case N``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fuzz")
    f.add_argument("out", type=Path)
    f.add_argument("--target", choices=TARGETS, default="loader")
    f.add_argument("--cases", type=int, default=500)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--workers", type=int, default=2)
    f.add_argument("--timeout", type=float, default=30, help="seconds per case")
    s = sub.add_parser("show")
    s.add_argument("out", type=Path)
    s.add_argument("--target", choices=TARGETS, default="loader")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--case", type=int, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "show":
        make, context, run_case = target(args.target)
        make(args.out)
        ctx = context(args.out, args.out / f"work-show-{args.target}")
        result = run_case(ctx, args.seed, args.case, verbose=True)
        print(json.dumps(result, indent=2))
        print(f"the mutated case is in {ctx.case}")
    else:
        summary = fuzz(
            args.out,
            cases=args.cases,
            seed=args.seed,
            workers=args.workers,
            timeout=args.timeout,
            target_name=args.target,
        )
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main(sys.argv[1:])
