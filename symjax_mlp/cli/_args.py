"""Argument types shared by the subcommands: each refuses a bad value before any work."""

from __future__ import annotations

import argparse


def sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes must be comma-separated ints such as 256,128,2; got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes must be positive ints; got {text!r}")
    return sizes
