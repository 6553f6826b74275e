"""What a user would pick instead of JAX for one request on a CPU: the rival rows.

Each row serves the chapter MLP from the SAME weights (the Flax params dict of
``sm.mlp(sizes)``: ``params["layers_i"]["kernel"/"bias"]``) on the same input, with the same
intra-op thread count, and is checked against the JAX model's output before it is timed:

============== ==================================================================================
key            how the row is made (its one-off stage, first call included)
============== ==================================================================================
torch_eager    ``torch.nn.Sequential`` of ``Linear``/``ReLU`` with the weights copied in
torch_script   ``torch.jit.script`` of it
torch_freeze   ``torch.jit.freeze`` of the scripted module in eval mode
torch_compile  ``torch.compile`` of it (inductor; needs a C++ compiler)
torch_aoti     ``torch.export.export`` + ``torch._inductor.aoti_compile_and_package`` (a .pt2),
               then ``aoti_load_package``, called as documented (``model(x)``, whose Python
               wrapper parses the call's pytree specs again on every call)
onnxruntime    ``torch.onnx.export`` (the dynamo exporter: needs onnx and onnxscript) to an
               .onnx file, run by an ``onnxruntime.InferenceSession`` (intra-op threads as
               torch's), numpy in and out
============== ==================================================================================

Interface::

    rivals = build_rivals(params, x, threads=2, workdir=Path(tmp))  # list[Rival], KEYS order
    for r in rivals:
        if r.skipped: print(f"{r.label}: skipped, {r.skipped}")
        else: r.call()                       # one synced request; time it as you like
    seconds = cold_start(rivals[0])          # a fresh process: import, load, first answer

A row that cannot be made here (a package missing, no compiler, an export error, an output
that differs from JAX) is still returned, with ``call=None`` and ``skipped`` set to one line,
``"<ExceptionType>: <message>"``, for the table to print.

``stage_s`` is what a user pays once in a process, from the weights in memory to the first
answer, writing the artifact that the cold start loads: building the module, scripting,
freezing, compiling, exporting and packaging, creating the session. Inductor's on-disk caches
are disabled for the stage (``torch.compiler.config.force_disable_caches``) and for the cold
start of ``torch_compile`` and ``torch_aoti`` alike, so the figures are those of a fresh machine
whatever earlier runs left in ``/tmp``.

:func:`cold_start` runs the row's deployment script (:attr:`Rival.script`: imports, loads the
saved artifact from ``workdir`` — a state dict, a TorchScript file, a .pt2 package, an .onnx
file — and answers once) in a fresh ``sys.executable``. Its figure is spawn to first answer:
the parent reads ``time.time()`` just before it starts the process, the child reads it just after
its first answer and prints it with the answer; the interpreter's shutdown is not counted. The
answer is checked against JAX's. Calling it several times and taking the min is the caller's
choice (each costs seconds; ``torch_compile``'s costs a compile).

This module is part of the benchmark, not the library: it uses only ``symjax_mlp``'s public API
and imports torch and onnxruntime only inside the rows that need them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import symjax_mlp as sm

KEYS = ("torch_eager", "torch_script", "torch_freeze", "torch_compile", "torch_aoti", "onnxruntime")
LABELS = {
    "torch_eager": "PyTorch eager",
    "torch_script": "torch.jit.script",
    "torch_freeze": "torch.jit.freeze",
    "torch_compile": "torch.compile",
    "torch_aoti": "torch.export + AOTInductor",
    "onnxruntime": "ONNX Runtime",
}
_IMPORTS = dict.fromkeys(KEYS, ("torch",)) | {"onnxruntime": ("onnxruntime", "onnxscript", "torch")}
RTOL = ATOL = 1e-4  # float32, a different summation order than XLA's


@dataclasses.dataclass(frozen=True)
class Rival:
    """One rival row: how to call it, what it cost to make, or why it could not be made.

    Attributes:
      key: the row's name in the table and the JSON (one of :data:`KEYS`).
      label: the row's title for a reader.
      call: a zero-argument callable that runs one request and returns its answer, synced
        (torch on CPU returns when the result is computed; onnxruntime returns numpy).
        ``None`` when skipped.
      stage_s: the one-off cost in seconds (see the module docstring); ``None`` when skipped.
      skipped: why the row could not be made, one line (``"ImportError: ..."``); else ``None``.
      script: the Python source a fresh process runs for :func:`cold_start`; it prints one
        JSON line ``{"t": time.time() after the first answer, "y": the answer}``.
      expected: the JAX model's answer, which the row matched and the cold start must match.
    """

    key: str
    label: str
    call: Callable[[], Any] | None
    stage_s: float | None
    skipped: str | None = None
    script: str | None = dataclasses.field(default=None, repr=False)
    expected: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)


def build_rivals(
    params: dict,
    x: np.ndarray,
    *,
    threads: int,
    workdir: Path,
    keys: Sequence[str] = KEYS,
) -> list[Rival]:
    """Makes each rival row of ``keys`` from the MLP's Flax ``params`` and checks it on ``x``.

    Sets torch's intra-op threads to ``threads`` for the whole process (the torch rows are
    called later, with the thread count they were measured at).

    Args:
      params: the Flax params of ``sm.mlp(sizes)`` (ReLU between layers), ``variables["params"]``.
      x: one request, a float32 array of shape ``(batch, features)``.
      threads: intra-op threads of torch and onnxruntime (JAX's: the usable cores).
      workdir: an existing directory for the artifacts the cold starts load.
      keys: the rows to make, a subset of :data:`KEYS`, returned in that order.

    Returns:
      One :class:`Rival` per key, each made or skipped with its reason.

    Raises:
      ValueError: a key not in :data:`KEYS`.
    """
    unknown = [k for k in keys if k not in KEYS]
    if unknown:
        raise ValueError(f"build_rivals: unknown rows {unknown}; expected some of {KEYS}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    layers = _dense_layers(params)
    want = np.asarray(sm.mlp([k.shape[1] for k, _ in layers]).apply({"params": params}, x))
    np.save(workdir / "x.npy", x)
    row = _Row(layers, x, threads, Path(workdir))
    rivals = []
    for key in keys:
        try:
            for module in _IMPORTS[key]:  # before the clock: importing is the cold start's part
                importlib.import_module(module)
            with warnings.catch_warnings():  # torch's deprecation notes are not the table's
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                call, script = getattr(row, key)()
                got = np.asarray(call())
                stage_s = time.perf_counter() - t0
            if got.shape != want.shape or not np.allclose(got, want, rtol=RTOL, atol=ATOL):
                raise ValueError(f"answer differs from JAX's: {_difference(got, want)}")
        except Exception as e:  # the table says why, the other rows go on
            rivals.append(Rival(key, LABELS[key], None, None, _reason(e), expected=want))
        else:
            rivals.append(Rival(key, LABELS[key], call, stage_s, None, script, want))
    return rivals


def cold_start(rival: Rival, *, timeout_s: float = 600.0) -> float:
    """Seconds from spawning a fresh Python process to its first answer from the row's artifact.

    Runs :attr:`Rival.script` (import, load the saved artifact, one call) in a new
    ``sys.executable`` and checks its answer against JAX's.

    Raises:
      ValueError: the row was skipped (it has no artifact).
      RuntimeError: the process failed, or answered something else than JAX.
    """
    if rival.script is None:
        raise ValueError(f"cold_start: {rival.key} was skipped ({rival.skipped}); nothing to start")
    env = os.environ | {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, "-c", rival.script],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"cold_start: {rival.key} exited {done.returncode}: {tail[0]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    got = np.asarray(answer["y"], np.float32)
    if got.shape != rival.expected.shape or not np.allclose(
        got, rival.expected, rtol=RTOL, atol=ATOL
    ):
        raise RuntimeError(
            f"cold_start: {rival.key} answered {_difference(got, rival.expected)} from JAX"
        )
    return answer["t"] - t0


# -- the rows ----------------------------------------------------------------------------------

# Each deployment script starts the same way and ends by printing its first answer; the row's
# part in between defines ``y`` from ``x`` (an array loaded from x.npy) and ``T`` (threads).
_HEAD = "import json, time\nimport numpy as np\nx = np.load({x!r})\nT = {threads}\n"
_TAIL = 'print(json.dumps({"t": time.time(), "y": np.asarray(y).tolist()}))\n'  # not formatted
_TORCH_NET = """\
import torch
torch.set_num_threads(T)
dims = {dims}
mods = []
for i, (n_in, n_out) in enumerate(dims):
    mods.append(torch.nn.Linear(n_in, n_out))
    if i < len(dims) - 1:
        mods.append(torch.nn.ReLU())
net = torch.nn.Sequential(*mods).eval()
net.load_state_dict(torch.load({path!r}))
"""
_SCRIPTS = {
    "torch_eager": _TORCH_NET
    + "with torch.inference_mode():\n    y = net(torch.from_numpy(x)).numpy()\n",
    "torch_compile": _TORCH_NET
    + "net = torch.compile(net)\n"
    + "with torch.inference_mode():\n    y = net(torch.from_numpy(x)).numpy()\n",
    "torch_script": "import torch\ntorch.set_num_threads(T)\nnet = torch.jit.load({path!r})\n"
    + "with torch.inference_mode():\n    y = net(torch.from_numpy(x)).numpy()\n",
    "torch_aoti": "import torch\ntorch.set_num_threads(T)\n"
    + "net = torch._inductor.aoti_load_package({path!r})\n"
    + "with torch.inference_mode():\n    y = net(torch.from_numpy(x)).numpy()\n",
    "onnxruntime": "import onnxruntime as ort\n"
    + "opts = ort.SessionOptions()\nopts.intra_op_num_threads = T\n"
    + "s = ort.InferenceSession({path!r}, opts, providers=['CPUExecutionProvider'])\n"
    + "y = s.run(None, {{'x': x}})[0]\n",
}
_SCRIPTS["torch_freeze"] = _SCRIPTS["torch_script"]


class _Row:
    """Makes each row: a method per key, returning ``(call, deployment script)``."""

    def __init__(self, layers: list, x: np.ndarray, threads: int, workdir: Path):
        self.layers, self.x, self.threads, self.workdir = layers, x, threads, workdir

    def _script(self, key: str, path: Path) -> str:
        dims = [tuple(k.shape) for k, _ in self.layers]
        body = _SCRIPTS[key].format(dims=dims, path=str(path))
        return _HEAD.format(x=str(self.workdir / "x.npy"), threads=self.threads) + body + _TAIL

    def _net(self) -> Any:
        """The MLP as a torch module in eval mode, with the weights copied in."""
        import torch  # the benchmark's torch extra

        torch.set_num_threads(self.threads)
        mods: list[Any] = []
        for i, (kernel, bias) in enumerate(self.layers):
            lin = torch.nn.Linear(*kernel.shape)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(np.array(kernel, np.float32).T.copy()))
                lin.bias.copy_(torch.from_numpy(np.array(bias, np.float32)))
            mods.append(lin)
            if i < len(self.layers) - 1:
                mods.append(torch.nn.ReLU())
        return torch.nn.Sequential(*mods).eval()

    def _torch_call(self, net: Any) -> Callable[[], Any]:
        import torch

        tx = torch.from_numpy(self.x.copy())

        def call() -> Any:
            with torch.inference_mode():
                return net(tx)

        return call

    def torch_eager(self) -> tuple[Callable[[], Any], str]:
        import torch

        net = self._net()
        path = self.workdir / "mlp_state.pt"
        torch.save(net.state_dict(), path)
        return self._torch_call(net), self._script("torch_eager", path)

    def torch_script(self) -> tuple[Callable[[], Any], str]:
        import torch

        net = torch.jit.script(self._net())  # deprecated in torch 2.x, still what users run
        path = self.workdir / "mlp_script.pt"
        torch.jit.save(net, str(path))
        return self._torch_call(net), self._script("torch_script", path)

    def torch_freeze(self) -> tuple[Callable[[], Any], str]:
        import torch

        net = torch.jit.freeze(torch.jit.script(self._net()))
        path = self.workdir / "mlp_frozen.pt"
        torch.jit.save(net, str(path))
        return self._torch_call(net), self._script("torch_freeze", path)

    def torch_compile(self) -> tuple[Callable[[], Any], str]:
        import torch

        net = self._net()
        path = self.workdir / "mlp_state.pt"
        torch.save(net.state_dict(), path)
        compiled = torch.compile(net)
        call = self._torch_call(compiled)
        with torch.compiler.config.patch(force_disable_caches=True):
            call()  # compiles here, on the first call
        return call, self._script("torch_compile", path)

    def torch_aoti(self) -> tuple[Callable[[], Any], str]:
        import torch

        net = self._net()
        path = self.workdir / "mlp.pt2"
        with torch.compiler.config.patch(force_disable_caches=True):
            exported = torch.export.export(net, (torch.from_numpy(self.x.copy()),))
            torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
        return self._torch_call(torch._inductor.aoti_load_package(str(path))), self._script(
            "torch_aoti", path
        )

    def onnxruntime(self) -> tuple[Callable[[], Any], str]:
        import onnxruntime as ort  # first: a missing runtime fails before the export's seconds
        import torch

        path = self.workdir / "mlp.onnx"
        quiet = logging.getLogger("torch.onnx")  # it warns of each torchvision op it lacks
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            torch.onnx.export(
                self._net(),
                (torch.from_numpy(self.x.copy()),),
                str(path),
                input_names=["x"],
                output_names=["y"],
                dynamo=True,
                external_data=False,
                verbose=False,
            )
        finally:
            quiet.setLevel(level)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        feed = {"x": self.x}
        return (lambda: session.run(None, feed)[0]), self._script("onnxruntime", path)


def _dense_layers(params: dict) -> list[tuple[Any, Any]]:
    """``(kernel, bias)`` of each ``Dense`` layer, in order (``layers_10`` after ``layers_9``)."""
    names = sorted(params, key=lambda k: int(k.rsplit("_", 1)[1]))
    return [(params[name]["kernel"], params[name]["bias"]) for name in names]


def _difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shape {got.shape}, JAX's {want.shape}"
    return f"max |difference| {np.abs(got - want).max():.2e}"


def _reason(e: BaseException) -> str:
    """One line for the table: the exception's type and the first line of its message."""
    lines = str(e).strip().splitlines()
    message = lines[0] if lines else ""
    return f"{type(e).__name__}: {message[:200]}"
