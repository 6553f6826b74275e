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
                 "help": "a .npy file, or '-' for stdin; once per input, in order"}),
    ("--output", {"action": "append", "required": True, "help": "where to write: a .npy file "
     "(exactly this path), '-' for stdout (.npy bytes), or a .npz file for several outputs "
     "(out0, out1, ...); or once per output, in order"}),
    ("--runtime", {"choices": ("jax", "iree"), "default": "jax"}),
    ("--entry", {"help": "the entry point to run (default: the artifact's default)"}),
    ("--params", {"metavar": "SAFETENSORS", "help": "other weights for the same param tree, as "
     "load(params=...) takes them: a .safetensors file (another export's params.safetensors)"}),
    *_args.TRUST,
)  # fmt: skip


_ONE_PER_OUTPUT = (
    "Pass one --output per output, in order, or one .npz path for them all (out0, out1, ...); "
    "nothing was written."
)


def run(args: argparse.Namespace) -> None:
    """``run``: .npy files in, the artifact's outputs out (dtypes as ``DTYPES`` says)."""
    import jax

    from symjax_mlp._artifact.format import printable
    from symjax_mlp._artifact.weights import memory
    from symjax_mlp._npy import arrays, raw_dtype_notes, read_inputs, read_stream, write_outputs

    paths = args.output
    sink = _check_outputs(paths, args.input, args.path)  # --output -: stdout's bytes
    if (n := args.input.count("-")) > 1:
        raise argparse.ArgumentTypeError(
            f"--input -: given {n} times; stdin holds one array. Pass the others as files."
        )
    stdin = _binary("--input") if n else None
    model = _args.load_model(args, params=args.params)
    inputs, outputs = model.signature.inputs, model.signature.outputs
    if len(args.input) != len(inputs):
        n, types = len(inputs), ", ".join(f"{i.path}: {i.type}" for i in inputs)
        raise argparse.ArgumentTypeError(
            f"{len(args.input)} --input file{'s' if len(args.input) != 1 else ''}, but the "
            f"artifact takes {n} input{'s' if n != 1 else ''}, {types}. Pass one --input per "
            "input, in order."
        )
    if len(paths) > 1 and len(paths) != len(outputs):
        n, types = len(outputs), ", ".join(o.type for o in outputs)
        raise argparse.ArgumentTypeError(
            f"{len(paths)} --output paths, but the model returns {n} array{'s' if n != 1 else ''}"
            f", {types}. {_ONE_PER_OUTPUT}"
        )
    if stdin is not None:  # as much as its .npy header declares: a stream may never end
        stdin = read_stream(stdin, what="stdin", memory=memory())
    files = [stdin if f == "-" else f for f in args.input]
    names = ["stdin" if f == "-" else str(f) for f in args.input]
    to_stdout = sink is not None
    with jax.transfer_guard("allow"):  # the files' arrays are run's own to move, to and back
        out = model(*read_inputs(files, inputs, names=names))  # (JAX_TRANSFER_GUARD=disallow)
        pairs = list(zip(out if len(paths) > 1 else [out], [sink] if to_stdout else paths,
                         strict=True))  # fmt: skip
        write_outputs(*pairs[0], *pairs[1:], fix=_ONE_PER_OUTPUT)  # every path, or none
    stream = sys.stderr if to_stdout else sys.stdout
    for (y, _), path in zip(pairs, paths, strict=True):
        outs = arrays(y)
        shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in outs)
        where = "stdout" if to_stdout else printable(path)  # \x1b, \xfc: not acted on
        _args.say(f"wrote {where}: {shapes}", stream)
        for note in raw_dtype_notes(outs):
            _args.say(f"note: {note}", stream)


def _check_outputs(paths: list[str], inputs: list[Any], artifact: str) -> Any:
    """Refuses, before any work, an output path that cannot be written, given twice, stdout
    beside files, an --input, or inside the artifact; for ``-``, its bytes' :func:`_binary` sink."""
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
    for path in (p for p in paths if p != "-"):
        there = os.path.exists(path)
        same = [str(x) for x in inputs if there and x != "-" and os.path.samefile(path, x)]
        if same:
            raise argparse.ArgumentTypeError(
                f"--output {path}: is the --input {same[0]}; writing there would replace it "
                "with the output. Pass another path."
            )
        _args.outside_artifact(path, "--output", artifact)
    return _binary("--output") if paths == ["-"] else None


def _binary(option: str) -> Any:
    """Where ``--input -`` reads and ``--output -`` writes .npy bytes (stdin's or stdout's byte
    buffer); refused where it is closed, a terminal, or a text stream without one (a notebook's)."""
    name, does = ("stdin", "give") if option == "--input" else ("stdout", "take")
    stream = sys.stdin if name == "stdin" else _args.stdout(f"{option} -")
    if stream is None:  # the shell closed it (<&-)
        raise argparse.ArgumentTypeError(f"{option} -: stdin is closed; pass a file path")
    if stream.isatty():  # stdin would wait for typed bytes, stdout's binary garble the screen
        fix = "pipe the .npy file in (< x.npy)" if name == "stdin" else "redirect it (> y.npy)"
        raise argparse.ArgumentTypeError(f"{option} -: {name} is a terminal; {fix} or pass a path")
    binary = stream if isinstance(stream, io.BufferedIOBase | io.RawIOBase) else None
    if (target := getattr(stream, "buffer", binary)) is None:
        raise argparse.ArgumentTypeError(
            f"{option} -: {name} is a text stream ({type(stream).__name__}) with no byte buffer, "
            f"which cannot {does} .npy bytes; pass a file path"
        )
    return target


#: ``run``'s help, handler, options, description and epilog (:func:`_args.subcommand`'s)
COMMAND = ("run an artifact on .npy inputs and write its outputs", run, _OPTIONS, "", DTYPES)
