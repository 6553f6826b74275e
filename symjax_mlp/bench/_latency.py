"""Serving's latency rows: synced batch-1 calls, one fresh subprocess per mode, interleaved.

Each mode (JAX in async or latency-mode dispatch, with or without params as constants; a
PyTorch twin eager, scripted, frozen or compiled) is built in its own process
(:func:`_latency_child`), all started first, then asked for one round at a time in turn
(:func:`_latency_rows`), each round timing two forms: the input on the device, and a NumPy
array in and out.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from symjax_mlp._errors import ConfigError
from symjax_mlp.bench._calls import _chapter, _one_round, _summary
from symjax_mlp.bench._children import _CHILD, _answer, _child_env, _stop

_LABELS = {
    "jax": "JAX h(x)",
    "torch_eager": "PyTorch eager",
    "torch_script": "torch.jit.script",
    "torch_freeze": "torch.jit.freeze",
    "torch_compile": "torch.compile",
}


def _mode_label(r: Mapping[str, Any]) -> str:
    label = _LABELS.get(r["mode"], r["mode"])
    if r["mode"] == "jax":
        baked = ", params as constants" if r.get("constants") else ""
        return f"{label}, {r['dispatch']} dispatch{baked}"
    return label + (f", {r['threads']} thread(s)" if r.get("threads") else "")


def _jax_latency(
    *, dispatch, sizes, in_features, activation, seed, constants=False
) -> tuple[Callable, dict]:
    """JAX's batch-1 calls: what to report, and the call of each form."""
    import jax

    from symjax_mlp.serving import dispatch_mode

    h, _, xn = _chapter(sizes, in_features, activation, seed)
    if constants:
        h = h.replace(params_as_constants=True)
    x = jax.device_put(xn)
    forms = {
        "device": lambda: h(x).block_until_ready(),
        "numpy": lambda: np.asarray(h(xn)),
    }

    def meta() -> dict:
        return {
            "mode": "jax",
            "dispatch": dispatch_mode(),
            "constants": h.params_as_constants,
            "threads": None,
            "device": str(jax.devices()[0]),
            "traces": h.trace_count,
        }

    return meta, forms


def _torch_latency(*, mode, threads, sizes, in_features, activation, seed) -> tuple[Callable, dict]:
    """The PyTorch twin's batch-1 calls in ``mode``: what to report, and each form's call."""
    import warnings

    import jax
    import torch  # optional extra: symjax_mlp[torch]

    from symjax_mlp.bench._twins import dense_layers

    _, variables, xn = _chapter(sizes, in_features, activation, seed)
    acts = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "sigmoid": torch.nn.Sigmoid}
    if activation not in acts:
        raise ConfigError(f"no PyTorch twin for activation {activation!r}")
    gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        torch.set_num_threads(threads)
    layers, modules = dense_layers(variables), []
    for i, (kernel, bias) in enumerate(layers):
        kernel = np.array(kernel)
        lin = torch.nn.Linear(*kernel.shape)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(kernel.T.copy()))
            lin.bias.copy_(torch.from_numpy(np.array(bias)))
        modules += [lin] + ([acts[activation]()] if i < len(layers) - 1 else [])
    net = torch.nn.Sequential(*modules).eval().to(device)
    tx = torch.from_numpy(xn).to(device)
    t0 = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.script is deprecated in torch 2.x; still timed
        if mode == "torch_script":
            net = torch.jit.script(net)
        elif mode == "torch_freeze":
            net = torch.jit.freeze(torch.jit.script(net))
        elif mode == "torch_compile":
            net = torch.compile(net)
        net(tx)
    build_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def on_device() -> Any:
        with torch.no_grad():
            y = net(tx)
        sync()
        return y

    def numpy_in_out() -> np.ndarray:
        with torch.no_grad():
            return net(torch.from_numpy(xn).to(device)).cpu().numpy()

    meta = {
        "mode": mode,
        "dispatch": None,
        "threads": None if gpu else threads,
        "device": str(device),
        "torch": torch.__version__,
        "build_s": build_s,
    }
    return lambda: meta, {"device": on_device, "numpy": numpy_in_out}


def _latency_child(kind: str, warmup: int, **kw: Any) -> None:
    """A latency subprocess: builds its mode, then times one round per request on stdin
    (``{"calls": n}``), printing each round's samples, until ``{"quit": true}``; idle (blocked
    on stdin, using no core) while the other modes run theirs."""
    meta, forms = (_jax_latency if kind == "jax" else _torch_latency)(**kw)
    for fn in forms.values():
        for _ in range(warmup):
            fn()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("quit"):
            return
        for fn in forms.values():  # caches and branch predictors warm again after idling
            for _ in range(min(warmup, 50)):
                fn()
        rounds = {form: _one_round(fn, ask["calls"]) for form, fn in forms.items()}
        print(json.dumps({"meta": meta(), "rounds": rounds}), flush=True)


def _latency_rows(
    modes: Sequence[tuple[str, dict]],
    net: Mapping[str, Any],
    *,
    calls: int,
    rounds: int,
    env: Mapping[str, str] | None,
    timeout: float,
    say: Callable[[str], None],
    notes: list[str],
) -> dict[str, Any]:
    """Every mode in its own fresh process, all started first (one at a time), then timed in
    ``rounds`` interleaved rounds of ``calls`` synced calls (mode after mode, the order
    rotating each round), so that a busy spell of the machine lands on every mode alike."""
    children: list[tuple[str, dict, subprocess.Popen, Any]] = []
    try:
        for kind, kw in modes:
            label = _mode_label({"mode": kind, **kw})  # as its row will be labelled
            say(f"latency: starting {label} in a fresh process")
            errors = tempfile.TemporaryFile("w+")  # noqa: SIM115  (a file: never fills up)
            args = json.dumps({"kind": kind, "warmup": 200, **kw, **net})
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, args],
                env=_child_env(env),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
            )
            children.append((kind, kw, proc, errors))
            try:
                _answer(proc, errors, timeout, f"bench_serving: the {label} subprocess")
            except RuntimeError as e:
                if kind == "jax":
                    raise
                notes.append(f"{label} skipped: {str(e)[-300:]}")
                _stop(*children.pop()[2:])
        samples: list[dict[str, list]] = [{} for _ in children]
        metas: list[dict] = [{} for _ in children]
        for r in range(rounds):
            say(f"latency: round {r + 1}/{rounds}, {len(children)} modes in turn")
            for i in itertools.islice(itertools.cycle(range(len(children))), r, r + len(children)):
                _, kw, proc, errors = children[i]
                proc.stdin.write(json.dumps({"calls": calls}) + "\n")
                proc.stdin.flush()
                who = f"bench_serving: the latency subprocess ({kw})"
                got = _answer(proc, errors, timeout, who)
                metas[i] = got["meta"]
                for form, xs in got["rounds"].items():
                    samples[i].setdefault(form, []).append(xs)
                time.sleep(0.05)  # let a thread pool's spin-wait end before the next mode
    finally:
        for _, _, proc, errors in children:
            _stop(proc, errors)
    rows = [
        {**meta, "forms": {form: _summary(xs) for form, xs in by_form.items()}}
        for meta, by_form in zip(metas, samples, strict=True)
    ]
    return {"rows": rows, "rounds": rounds, "calls_per_round": calls}
