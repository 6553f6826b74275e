"""Serving's latency rows: synced batch-1 calls, one fresh subprocess per mode, interleaved.

Each mode (JAX in async or latency-mode dispatch, with or without params as constants; a
PyTorch twin eager, scripted, frozen or compiled) is built in its own process
(:func:`latency_child`), all started first, then asked for one round at a time in turn
(:func:`latency_rows`), each round timing two forms: the input on the device, and a NumPy
array in and out.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.calls import chapter_net, one_round, summary
from benchmarks.children import Child

_LABELS = {
    "jax": "JAX h(x)",
    "torch_eager": "PyTorch eager",
    "torch_script": "torch.jit.script",
    "torch_freeze": "torch.jit.freeze",
    "torch_compile": "torch.compile",
}


def mode_label(r: Mapping[str, Any]) -> str:
    """A latency row's name in the table: ``JAX h(x), sync dispatch``, ``torch.jit.script, 1
    thread(s)``."""
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

    h, _, xn = chapter_net(sizes, in_features, activation, seed)
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

    from benchmarks.twins import torch_mlp

    _, variables, xn = chapter_net(sizes, in_features, activation, seed)
    gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        torch.set_num_threads(threads)
    net = torch_mlp(variables, activation).to(device)
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


def latency_child(kind: str, warmup: int, **kw: Any) -> None:
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
        rounds = {form: one_round(fn, ask["calls"]) for form, fn in forms.items()}
        print(json.dumps({"meta": meta(), "rounds": rounds}), flush=True)


def latency_rows(
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
    children: list[tuple[str, dict, Child]] = []
    try:
        for kind, kw in modes:
            label = mode_label({"mode": kind, **kw})  # as its row will be labelled
            say(f"latency: starting {label} in a fresh process")
            payload = {"kind": kind, "warmup": 200, **kw, **net}
            who = f"bench_serving: the {label} subprocess"
            try:
                children.append((kind, kw, Child(payload, env=env, timeout=timeout, who=who)))
            except RuntimeError as e:
                if kind == "jax":
                    raise
                notes.append(f"{label} skipped: {str(e)[-300:]}")
        samples: list[dict[str, list]] = [{} for _ in children]
        metas: list[dict] = [{} for _ in children]
        for r in range(rounds):
            say(f"latency: round {r + 1}/{rounds}, {len(children)} modes in turn")
            for i in itertools.islice(itertools.cycle(range(len(children))), r, r + len(children)):
                got = children[i][2].ask({"calls": calls})
                metas[i] = got["meta"]
                for form, xs in got["rounds"].items():
                    samples[i].setdefault(form, []).append(xs)
                time.sleep(0.05)  # let a thread pool's spin-wait end before the next mode
    finally:
        for _, _, child in children:
            child.close()
    rows = [
        {**meta, "forms": {form: summary(xs) for form, xs in by_form.items()}}
        for meta, by_form in zip(metas, samples, strict=True)
    ]
    return {"rows": rows, "rounds": rounds, "calls_per_round": calls}
