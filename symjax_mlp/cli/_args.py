"""Argument types and checks shared by the subcommands: a bad value is refused before any work."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help shows its default; descriptions keep their line breaks."""


def subcommand(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """Declares the subcommand ``name``: ``help`` is its one-line help and its description."""
    return sub.add_parser(name, help=help, description=help, formatter_class=Formatter)


def emit_json(data: Any, target: str) -> None:
    """Writes ``data`` as indented JSON to the file ``target`` (whole or not at all), or stdout
    for ``"-"``."""
    from symjax_mlp._files import write_output

    text = json.dumps(data, indent=2, default=str) + "\n"
    if target == "-":
        stdout("--json -").write(text)
    else:
        write_output(target, text.encode())  # whole or not at all


def stdout(option: str) -> Any:
    """``sys.stdout``, refused where the shell closed it (``>&-``: Python's ``None``)."""
    if sys.stdout is None:
        raise argparse.ArgumentTypeError(f"{option}: stdout is closed; pass a file path")
    return sys.stdout


def int_list(option: str) -> Callable[[str], tuple[int, ...]]:
    """``"256,128,2"`` -> ``(256, 128, 2)``: comma-separated ints >= 1, for ``option``."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(s) for s in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{option} must be comma-separated ints such as 256,128,2; got {text!r}"
            ) from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{option} must be positive ints; got {text!r}")
        return values

    return parse


sizes = int_list("--sizes")


def positive(option: str, kind: type = int, *, zero: bool = False) -> Callable[[str], Any]:
    """An int (or float) > 0 for ``option``; ``zero``: a float >= 0 (not NaN)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or (not value >= 0 if zero else value <= 0):
            what = "an int >= 1" if kind is int else f"a number {'>=' if zero else '>'} 0"
            raise argparse.ArgumentTypeError(f"{option} must be {what}; got {text!r}")
        return value

    return parse


def batch(text: str) -> str | int:
    """``--batch``: a name for a symbolic batch (``b``) or a static size >= 1."""
    if text.isdigit() and int(text) >= 1:
        return int(text)
    if text.isidentifier():
        return text
    raise argparse.ArgumentTypeError(
        f"--batch must be a name for a symbolic batch (b) or a static size >= 1; got {text!r}"
    )


def input_file(text: str) -> Path:
    """An existing regular file to read (``--input``)."""
    path = Path(text)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise argparse.ArgumentTypeError(
            f"--input {text}: does not exist; pass a .npy file"
        ) from None
    except OSError as e:  # a name too long, a directory that may not be searched
        raise argparse.ArgumentTypeError(
            f"--input {text}: {e.strerror}; pass a .npy file"
        ) from None
    if not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device or FIFO)"
        raise argparse.ArgumentTypeError(f"--input {text}: is {what}; pass a .npy file")
    return path


def add_json(parser: argparse.ArgumentParser, what: str) -> None:
    """The one ``--json [PATH|-]`` convention: write ``what`` as JSON to PATH, or stdout."""
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help=f"write {what} as JSON to PATH (no PATH or '-': to stdout)",
    )


def writable(path: str, option: str, *, overwrite: bool) -> None:
    """Refuses an output path before any work: a directory, a missing parent, or an existing
    file without ``overwrite``."""
    if path == "-":
        stdout(f"{option} -")  # open, before any work
        return
    if not path:  # Path("") is the working directory
        raise argparse.ArgumentTypeError(f"{option} '': is empty; pass a file path")
    p = Path(path)
    try:
        os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:  # a name too long, a directory that may not be searched
        raise argparse.ArgumentTypeError(
            f"{option} {path}: {e.strerror}; pass another path"
        ) from None
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{option} {path}: is a directory; pass a file path")
    if not p.parent.exists():
        raise argparse.ArgumentTypeError(
            f"{option} {path}: the directory {p.parent} does not exist"
        )
    if p.exists() and not overwrite:
        raise argparse.ArgumentTypeError(
            f"{option} {path}: already exists; pass --overwrite to replace it"
        )
    try:  # a file can be made there (a read-only or special directory says no only now)
        with tempfile.TemporaryFile(dir=p.parent):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"{option} {path}: cannot write in {p.parent} ({e.strerror}); pass another path"
        ) from None


def add_trust_options(p: argparse.ArgumentParser) -> None:
    """``--allow OP`` (repeatable), ``--trust`` and ``--key PEM``: what ``load()`` takes as
    ``allow=``, ``trust=True`` and ``verify_signature=``."""
    p.add_argument(
        "--allow",
        action="append",
        default=None,
        metavar="OP",
        help="let the artifact's program use OP, as load(allow=...) does (e.g. gather, while, "
        "custom_call:NAME); repeatable. Only for artifacts you trust as code",
    )
    p.add_argument(
        "--trust",
        action="store_true",
        help="skip the program checks, as load(trust=True): only for artifacts you made",
    )
    p.add_argument("--key", help="a PEM public key: refuse unless every file is signed by it")


def keywords(args: argparse.Namespace, names: str) -> dict[str, Any]:
    """The options ``names`` (space-separated) as the library keywords they are named after."""
    return {name: getattr(args, name) for name in names.split()}


def load_options(args: argparse.Namespace) -> dict:
    """The ``load()`` keywords of :func:`add_trust_options`' options."""
    return {"allow": args.allow, "trust": args.trust, "verify_signature": args.key}
