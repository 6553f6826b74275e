"""``symjax-mlp run ARTIFACT --input x.npy --output y.npy``: an artifact on .npy files."""

from __future__ import annotations

import argparse
import io
import os
import sys
from typing import Any

from symjax_mlp.cli import _args

DTYPES = """\
bfloat16, float8 and int4 (ml_dtypes) have no .npy type: NumPy stores them as raw bytes, a void
dtype of their itemsize (|V2 for bfloat16). So:
  inputs   a |V2 file is read as bfloat16 where the artifact expects bfloat16 (write it with
           np.save("x.npy", x.astype(jnp.bfloat16))); a float32 file is refused there: nothing
           is cast behind your back.
  outputs  a bfloat16 output is written the same way, bit for bit (|V2): read it back with
           np.load("y.npy").view(ml_dtypes.bfloat16), or pass it to run as an --input."""


_OPTIONS = (
    ("path", {"help": "an artifact directory"}),
    ("--input", {"action": "append", "required": True, "type": _args.input_file,
                 "help": ".npy, each input"}),
    ("--output", {"action": "append", "required": True, "help": "where to write: a .npy file "
     "(exactly this path), '-' for stdout (.npy bytes), or a .npz file for several outputs "
     "(out0, out1, ...); or once per output, in order"}),
    ("--runtime", {"choices": ("jax", "iree"), "default": "jax"}),
    ("--entry", {"help": "the entry point to run (default: the artifact's default)"}),
    *_args.TRUST,
)  # fmt: skip


def add_parser(sub: _args.Subcommands) -> None:
    """Declares ``run`` and its options on the CLI's subcommands."""
    help = "run an artifact on .npy inputs and write its outputs"
    _args.subcommand(sub, "run", help, run, _OPTIONS).epilog = DTYPES


def run(args: argparse.Namespace) -> None:
    """``run``: .npy files in, the artifact's outputs out (dtypes as ``DTYPES`` says)."""
    from symjax_mlp._npy import arrays, raw_dtype_notes, read_inputs, write_outputs

    paths = args.output
    _check_outputs(paths, args.input, args.path)
    model = _args.load_model(args)
    outputs = model.signature.outputs
    if len(paths) > 1 and len(paths) != len(outputs):
        n, types = len(outputs), ", ".join(o.type for o in outputs)
        raise argparse.ArgumentTypeError(
            f"{len(paths)} --output paths, but the model returns {n} array{'s' if n != 1 else ''}"
            f", {types}. Pass one --output per output, in order, or one .npz path for them all "
            "(out0, out1, ...); nothing was written."
        )
    out = model(*read_inputs(args.input, model.signature.inputs))
    pairs = list(zip(out if len(paths) > 1 else [out], paths, strict=True))
    to_stdout = paths == ["-"]
    if to_stdout:
        pairs = [(out, _bytes_out())]
    write_outputs(*pairs[0], *pairs[1:])  # every path, or none of them
    stream = sys.stderr if to_stdout else sys.stdout
    for (y, _), path in zip(pairs, paths, strict=True):
        outs = arrays(y)
        shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in outs)
        print(f"wrote {'stdout' if to_stdout else path}: {shapes}", file=stream)
        for note in raw_dtype_notes(outs):
            print(f"note: {note}", file=stream)


def _check_outputs(paths: list[str], inputs: list[Any], artifact: str) -> None:
    """Refuses, before any work, an output path that cannot be written, given twice, stdout
    beside files, an --input, or inside the artifact."""
    for path in paths:
        _args.writable(path, "--output", overwrite=True)
    real = [p if p == "-" else os.path.realpath(p) for p in paths]  # y.npy, ./y.npy: one file
    twice = next((r for r in real if real.count(r) > 1), None)
    if twice is not None:
        given = [p for p, r in zip(paths, real, strict=True) if r == twice]
        spelt = f" (as {', '.join(given)})" if len(set(given)) > 1 else ""
        raise argparse.ArgumentTypeError(
            f"--output {given[0]}: given {len(given)} times{spelt}; each output is written to a "
            "path of its own. Pass each path once."
        )
    if "-" in paths and len(paths) > 1:
        raise argparse.ArgumentTypeError(
            f"--output -: stdout takes one array, and {len(paths)} --output paths were given. "
            "Name a file for each output, or pass one .npz path (out0, out1, ...)."
        )
    if paths == ["-"]:
        _bytes_out()
    for path in (p for p in paths if p != "-"):
        same = [str(x) for x in inputs if os.path.exists(path) and os.path.samefile(path, x)]
        if same:
            raise argparse.ArgumentTypeError(
                f"--output {path}: is the --input {same[0]}; writing there would replace it "
                "with the output. Pass another path."
            )
        _args.outside_artifact(path, "--output", artifact)


def _bytes_out() -> Any:
    """Where ``--output -`` writes .npy bytes: stdout's byte buffer, or stdout itself where it is
    a binary stream (``io.BytesIO``); refused where it is a text stream without one (main() called
    in-process with ``io.StringIO``, a notebook's)."""
    stdout = _args.stdout("--output -")
    binary = stdout if isinstance(stdout, io.BufferedIOBase | io.RawIOBase) else None
    if (target := getattr(stdout, "buffer", binary)) is None:
        raise argparse.ArgumentTypeError(
            f"--output -: stdout is a text stream ({type(stdout).__name__}) with no byte buffer, "
            "which cannot take .npy bytes; pass a file path"
        )
    return target
