"""Argument types and checks shared by the subcommands: a bad value is refused before any work.

A type's message names no option: argparse prefixes ``argument --calls:`` to it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def subcommand(
    sub: Any, name: str, help: str, handler: Callable[..., int | None],
    options: Sequence[tuple[Any, dict[str, Any]]] = (), more: str = "", epilog: str | None = None,
) -> None:  # fmt: skip
    """Declares the subcommand ``name``, run by ``handler(args)`` (its exit code; ``None``: 0),
    with ``options``, each ``(name, add_argument's keywords)``; ``help + more``: its description."""
    formatter = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(name, help=help, description=help + more, formatter_class=formatter)
    p.set_defaults(handler=handler)
    p.epilog = epilog
    for option, keywords in options:  # an option of two names: a tuple
        p.add_argument(*((option,) if isinstance(option, str) else option), **keywords)


def _checked(kind: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Any:
    """An argparse type: ``kind(text)``, refused unless ``ok`` of it."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):  # NaN is no number >= 0
            raise argparse.ArgumentTypeError(f"must be {what}; got {text!r}")
        return value

    return parse


count = _checked(int, lambda v: v >= 1, "an int >= 1")
natural = _checked(int, lambda v: v >= 0, "an int >= 0")
positive = _checked(float, lambda v: v > 0, "a number > 0")
nonnegative = _checked(float, lambda v: v >= 0, "a number >= 0")
port = _checked(int, lambda v: 0 <= v <= 65535, "an int from 0 to 65535 (0: any free port)")


def int_list(example: str) -> Any:
    """The argparse type of comma-separated ints >= 1, its refusal naming ``example``."""
    return _checked(
        lambda text: tuple(int(s) for s in text.split(",")),
        lambda v: min(v) >= 1,
        f"comma-separated ints >= 1 such as {example}",
    )


batch = _checked(  # --batch: a symbolic dimension's name, or a static size
    lambda text: int(text) if text.isdigit() else text,
    lambda v: v >= 1 if isinstance(v, int) else v.isidentifier(),
    "a name for a symbolic batch (b) or a static size >= 1",
)


def input_file(text: str) -> Path | str:
    """An existing regular file to read (``--input``), or ``-``: stdin."""
    if text == "-":
        return text
    path = Path(text)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise argparse.ArgumentTypeError(f"{text}: does not exist; pass a .npy file") from None
    except OSError as e:  # a name too long, a directory that may not be searched
        raise argparse.ArgumentTypeError(f"{text}: {e.strerror}; pass a .npy file") from None
    if not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device or FIFO)"
        raise argparse.ArgumentTypeError(f"{text}: is {what}; pass a .npy file")
    return path


def json_option(what: str) -> tuple[str, dict[str, Any]]:
    """The one ``--json [PATH|-]`` convention: write ``what`` as JSON to PATH, or stdout."""
    help = f"write {what} as JSON to PATH (no PATH or '-': to stdout)"
    return "--json", {"nargs": "?", "const": "-", "metavar": "PATH", "help": help}


def emit_json(data: Any, target: str) -> None:
    """Writes ``data`` as JSON to the file ``target`` (whole or not at all), or stdout (``-``)."""
    from symjax_mlp._files import write_output

    text = json.dumps(_finite(data), indent=2, default=str, allow_nan=False)
    if target != "-":
        write_output((target, text.encode() + b"\n"))
    else:
        say(text, stdout("--json -"))


def say(text: str, stream: Any = None) -> None:
    """Prints ``text`` and a newline to ``stream`` (stdout; closed, ``>&-``: nothing) whole, or
    a ConfigError naming it: Python's own writes may stop short at a file-size limit, silent."""
    from symjax_mlp._files import write_stream

    out, text = sys.stdout if stream is None else stream, text + "\n"
    if out is None:
        return
    if (raw := getattr(out, "buffer", None)) is None:  # main() called in-process with a text
        out.write(text)  # stream
    else:
        out.flush()
        write_stream(raw, text.encode(out.encoding or "utf-8", out.errors or "strict"))


def _finite(data: Any) -> Any:
    """``data`` with each inf or NaN as its text ("inf"): json.dumps's ``Infinity`` is no JSON
    (jq and JavaScript refuse it)."""
    if isinstance(data, float) and not math.isfinite(data):
        return str(data)
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def show(result: Any, data: Any, target: str | None) -> None:
    """Prints ``result``, or writes ``data`` as JSON where ``--json`` says."""
    if target:
        emit_json(data, target)
    else:
        say(str(result))


def outside_artifact(path: str, option: str, artifact: str | None) -> None:
    """Refuses an output path inside the artifact read, before any work: a file of it would be
    replaced (``inspect A --json A/manifest.json``), a new file breaks its signature, which
    covers the whole directory."""
    if not artifact or path == "-":
        return
    home, into = os.path.realpath(artifact), os.path.dirname(os.path.realpath(path))
    if os.path.commonpath((home, into)) != home:
        return
    if os.path.isfile(path):
        what, harm = "a file of", "replace it with the output"
    else:
        what, harm = "inside", "add a file its checksums and signature do not list"
    raise argparse.ArgumentTypeError(
        f"{option} {path}: is {what} the artifact {artifact}; writing there would {harm}. "
        "Pass another path, outside the artifact."
    )


def stdout(option: str) -> Any:
    """``sys.stdout``, refused where the shell closed it (``>&-``: Python's ``None``)."""
    if sys.stdout is None:
        raise argparse.ArgumentTypeError(f"{option}: stdout is closed; pass a file path")
    return sys.stdout


def writable(path: str, option: str, *, overwrite: bool) -> None:
    """Refuses an output path before any work: a directory, a missing parent, or an existing
    file without ``overwrite``."""
    if path == "-":
        stdout(f"{option} -")
        return
    if not path:  # Path("") is the working directory
        raise argparse.ArgumentTypeError(f"{option} '': is empty; pass a file path")
    p, refuse = Path(path), f"{option} {path}:"
    try:
        os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:  # a name too long, a directory that may not be searched
        raise argparse.ArgumentTypeError(f"{refuse} {e.strerror}; pass another path") from None
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{refuse} is a directory; pass a file path")
    if not p.parent.exists():
        raise argparse.ArgumentTypeError(
            f"{refuse} the directory {p.parent} does not exist; make it first (mkdir -p "
            f"{shlex.quote(str(p.parent))}), or pass a path in an existing directory"
        )
    if p.exists() and not overwrite:
        raise argparse.ArgumentTypeError(f"{refuse} already exists; pass --overwrite to replace it")
    writable_in(p.parent, refuse)


def writable_in(directory: Path, refuse: str) -> None:
    """Refuses, before any work, a ``directory`` where nothing can be made: read-only or
    special, which says no only when asked."""
    try:
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"{refuse} cannot write in {directory} ({e.strerror}); pass another path"
        ) from None


#: ``--allow OP``, ``--trust`` and ``--key PEM``: ``load()``'s ``allow``, ``trust`` and
#: ``verify_signature`` (:func:`load_options`)
TRUST = (
    ("--allow", {"action": "append", "metavar": "OP", "help": "let the artifact's program use "
     "OP, as load(allow=...) does (e.g. gather, while, custom_call:NAME); repeatable. Only for "
     "artifacts you trust as code"}),
    ("--trust", {"action": "store_true", "help": "skip the program checks, as load(trust=True): "
     "only for artifacts you made"}),
    (("--key", "--verify-signature"), {"metavar": "PEM", "help": "a PEM public key: refuse "
     "unless every file is signed by it, as load(verify_signature=...) does"}),
)  # fmt: skip


def sync_dispatch() -> None:
    """``--dispatch sync``: :func:`~symjax_mlp.serving.latency_mode`, before anything starts
    JAX's CPU backend; where JAX ran already (``main()`` called in such a process), refused."""
    from symjax_mlp.serving import latency_mode

    try:
        latency_mode()
    except RuntimeError as e:  # not a bug of ours: the caller's process
        raise argparse.ArgumentTypeError(f"--dispatch sync: {e}") from None


def keywords(args: argparse.Namespace, names: str) -> dict[str, Any]:
    """The options ``names`` (space-separated) as the library keywords they are named after."""
    return {name: getattr(args, name) for name in names.split()}


def load_options(args: argparse.Namespace) -> dict:
    """The ``load()`` keywords of :data:`TRUST`'s options."""
    return {"allow": args.allow, "trust": args.trust, "verify_signature": args.key}


def load_model(args: argparse.Namespace, **more: Any) -> Any:
    """``load(PATH, runtime=..., ..., **more)``, its ``--entry`` if one was given."""
    from symjax_mlp.serving._app import load_entry

    return load_entry(args.path, args.entry, runtime=args.runtime, **load_options(args), **more)
