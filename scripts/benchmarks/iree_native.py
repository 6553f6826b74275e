"""The IREE rows: ``load(path, runtime="iree")`` from Python, and the same ``.vmfb`` native.

The native row is IREE's own timing, no Python: ``iree-benchmark-module`` runs the very
``.vmfb`` that the loaded model runs at this batch (recorded as IREE's runtime is handed it),
on the same driver (``local-sync``, the calling thread), with the artifact's weights and the
same input as ``.npy`` files, the weights first in the order JAX flattens their dict (the
order of ``main``'s arguments). It is a ``remote`` row of
:func:`benchmarks.timing.time_interleaved`: each repeat is one run of the tool, timing
``calls`` calls on its own clock, interleaved with the Python rows.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

DRIVER = "local-sync"
TOOL = "iree-benchmark-module"


@contextlib.contextmanager
def recording() -> Iterator[list[bytes]]:
    """Within the block: the bytes of every compiled module IREE's runtime is handed."""
    import iree.runtime as ir

    seen: list[bytes] = []
    real = ir.VmModule.copy_buffer

    def record(instance: Any, buffer: Any) -> Any:
        seen.append(bytes(buffer))
        return real(instance, buffer)

    ir.VmModule.copy_buffer = staticmethod(record)
    try:
        yield seen
    finally:
        ir.VmModule.copy_buffer = staticmethod(real)


def declaration(vmfb: bytes) -> str:
    """``main``'s declaration in a compiled module (its argument and result shapes)."""
    import iree.runtime as ir

    instance = ir.VmInstance()
    module = ir.VmModule.copy_buffer(instance, vmfb)
    main = module.lookup_function("main")  # (the module must outlive it)
    return str(main.reflection.get("iree.abi.declaration", ""))


def native_row(
    vmfb: bytes, artifact: Path, x: np.ndarray, workdir: Path
) -> Callable[[int], float] | str:
    """``run(calls) -> seconds`` for ``calls`` calls of ``vmfb`` in ``iree-benchmark-module``,
    or why the row cannot be made here."""
    from safetensors.numpy import load_file

    tool = shutil.which(TOOL) or shutil.which(TOOL, path=str(Path(sys.executable).parent))
    if tool is None:
        return f"{TOOL} is not installed (pip install iree-base-runtime puts it on PATH)"
    workdir.mkdir(parents=True, exist_ok=True)
    module = workdir / "batch.vmfb"
    module.write_bytes(vmfb)
    import jax

    args = [*jax.tree.leaves(load_file(str(artifact / "params.safetensors"))), x]
    found = declaration(vmfb)
    shapes = [tuple(int(d) for d in t.split("x")[:-1])
              for t in re.findall(r"%input\d+: tensor<([^>]*)>", found)]  # fmt: skip
    if shapes != [a.shape for a in args]:
        return f"main's arguments are not the weights then the input: {found}"
    inputs = []
    for i, a in enumerate(args):
        np.save(workdir / f"arg{i}.npy", a)
        inputs.append(f"--input=@{workdir / f'arg{i}.npy'}")

    def run(calls: int) -> float:
        out = subprocess.run(
            [tool, f"--device={DRIVER}", f"--module={module}", "--function=main", *inputs,
             f"--benchmark_min_time={calls}x", "--benchmark_format=json"],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        (bench,) = [b for b in json.loads(out.stdout)["benchmarks"] if b.get("real_time")]
        scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[bench["time_unit"]]
        return bench["real_time"] * scale * calls

    run(10)  # it runs here, or the row says why not
    return run
