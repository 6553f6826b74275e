"""One request at a time, against floors measured in the same run, in latency mode.

Every row runs in ONE fresh process in :func:`~symjax_mlp.serving.latency_mode` (synchronous
dispatch, XLA's CPU ops on the calling thread), built from the same weights and input, timed
interleaved (:func:`benchmarks.timing.time_interleaved`, every call synced), so that the
ratios compare like with like:

- the floors: a jitted ``x + 1`` (JAX's dispatch floor: what any call of an XLA executable
  costs here) and the MLP lowered and compiled ahead of time with its params as constants
  (``jax.jit(lambda x: net.apply(variables, x)).lower(x).compile()``), and with its params as
  arguments; the compute part is the constants executable less the dispatch floor;
- every row runs the same params, as a trained model has them (one Adam step from init:
  :func:`benchmarks.calls.trained`); one more row, the constants executable of the params at
  init, shows what a floor measured there would miss: their zero biases, which XLA folds out
  of a program holding them as constants, never out of one taking them as arguments;
- ``h(x)`` and ``h(x)`` with ``params_as_constants=True``;
- the exported artifact loaded in JAX (and IREE, when asked and installed: from Python, and
  the same ``.vmfb`` in IREE's native ``iree-benchmark-module``, :mod:`benchmarks.iree_native`);
- with ``rivals=True``, what a user would pick instead for one request on a CPU
  (:mod:`benchmarks.rivals`: PyTorch eager, ``jit.script``, ``jit.freeze``,
  ``torch.compile``, ``torch.export`` + AOTInductor, ONNX Runtime), at one intra-op thread,
  as XLA runs in latency mode; a row that cannot be made here says why.

With ``coldstart=True`` each row that ships a file (the artifact, each rival) is also started
in a fresh process, spawn to first answer (:func:`benchmarks.rivals.cold_start`).

:func:`per_request_targets` holds the targets; they are this benchmark's, never the library's.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.children import run_json
from benchmarks.timing import Progress, format_seconds

LABELS = {
    "dispatch_floor": "jitted x + 1 (dispatch floor)",
    "aot_constants": "AOT executable, params as constants",
    "aot_constants_init": "AOT executable, params as constants, at init",
    "aot_arguments": "AOT executable, params as arguments",
    "h": "h(x)",
    "h_constants": "h(x), params_as_constants=True",
    "artifact_jax": "loaded artifact (JAX)",
    "artifact_iree": "loaded artifact (IREE)",
    "artifact_iree_native": "the same .vmfb, iree-benchmark-module",
}
#: The targets: (name, numerator row, denominator row, bound).
RATIO_TARGETS = (
    ("h_over_aot_constants", "h", "aot_constants", "<= 1.15"),
    # The floor for a call that takes its params (as h does): the same calling convention.
    ("h_over_aot_arguments", "h", "aot_arguments", "<= 1.05"),
    ("h_constants_over_aot_constants", "h_constants", "aot_constants", "<= 1.05"),
)
#: With ``iree=True``: IREE from Python against h(x), and IREE with no Python at all (the
#: native tool on the same .vmfb) against XLA's floor for the same program (params as
#: arguments, the same calling convention).
IREE_TARGETS = (
    ("iree_over_h", "artifact_iree", "h", "<= 1.5"),
    ("iree_native_over_aot_arguments", "artifact_iree_native", "aot_arguments", "<= 1.2"),
)
_ENTRY = (
    "import json, sys; from benchmarks.per_request import measure; "
    "print(json.dumps(measure(**json.loads(sys.argv[1]))))"
)
_JAX_SCRIPT = """\
import json, time
import numpy as np
import symjax_mlp as sm
sm.serving.latency_mode()
x = np.load({x!r})
y = sm.load({path!r})(x)
print(json.dumps({{"t": time.time(), "y": np.asarray(y).tolist()}}))
"""


def measure(
    *, sizes, in_features, activation, seed, calls, repeats, iree, rivals, coldstart
) -> dict[str, Any]:
    """The rows, in this (fresh, latency-mode) process: per-call seconds of each repeat."""
    import jax

    import symjax_mlp as sm
    from benchmarks import iree_native
    from benchmarks import rivals as rv
    from benchmarks.calls import chapter_init, chapter_net
    from benchmarks.timing import time_interleaved

    sm.serving.latency_mode()  # before anything starts JAX's CPU backend
    h, variables, xn = chapter_net(sizes, in_features, activation, seed)
    x = jax.device_put(xn)
    net = sm.mlp(tuple(sizes), activation=activation)
    leaves, treedef = jax.tree.flatten(variables)

    def with_args(leaves: Any, x: Any) -> Any:
        return net.apply(jax.tree.unflatten(treedef, leaves), x)

    plus_one = jax.jit(lambda x: x + 1).lower(x).compile()
    constants = jax.jit(lambda x: net.apply(variables, x)).lower(x).compile()
    at_init = chapter_init(sizes, in_features, activation, seed)[1]
    constants_init = jax.jit(lambda x: net.apply(at_init, x)).lower(x).compile()
    arguments = jax.jit(with_args).lower(leaves, x).compile()
    hc = h.replace(params_as_constants=True)
    fns = {
        "dispatch_floor": lambda: plus_one(x),
        "aot_constants": lambda: constants(x),
        "aot_constants_init": lambda: constants_init(x),
        "aot_arguments": lambda: arguments(leaves, x),
        "h": lambda: h(x),
        "h_constants": lambda: hc(x),
    }
    want = np.asarray(h(x))
    notes: list[str] = []
    stages: dict[str, float] = {}
    skipped: dict[str, str] = {}
    starters: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="symjax_mlp_per_request_") as tmp:
        path = Path(tmp) / "mlp"
        sm.export(h, path, example=xn, batch="b")
        np.save(Path(tmp) / "x.npy", xn)
        m = sm.load(path)
        fns["artifact_jax"] = lambda: m(x)
        script = _JAX_SCRIPT.format(x=str(Path(tmp) / "x.npy"), path=str(path))
        starters.append(rv.Rival("artifact_jax", LABELS["artifact_jax"], None, None, None,
                                 script, want))  # fmt: skip
        remote: dict[str, Any] = {}
        if iree:
            try:
                with iree_native.recording() as vmfbs:
                    mi = sm.load(path, runtime="iree")
                    mi(xn)  # compiles (or reads from the user's cache) its batch's module
                fns["artifact_iree"] = lambda: mi(xn)
                made = iree_native.native_row(vmfbs[-1], path, xn, Path(tmp) / "native")
                if isinstance(made, str):
                    skipped["artifact_iree_native"] = made
                else:
                    remote["artifact_iree_native"] = made
            except Exception as e:  # e.g. IREE not installed: the error says what to install
                key = "artifact_iree_native" if "artifact_iree" in fns else "artifact_iree"
                skipped[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        # a NumPy array, as PyTorch's rows give: nothing to wait for (no pytree walk)
        syncs = {"artifact_iree": lambda _: None} if "artifact_iree" in fns else {}
        if rivals:
            made = rv.build_rivals(variables["params"], xn, threads=1, workdir=Path(tmp))
            for r in made:
                if r.skipped:
                    skipped[r.key] = r.skipped
                    continue
                fns[r.key], syncs[r.key], stages[r.key] = r.call, (lambda _: None), r.stage_s
                starters.append(r)
        for key, fn in fns.items():
            if key in ("dispatch_floor", "aot_constants_init"):  # another function, other params
                continue
            got = np.asarray(fn())
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-4):
                notes.append(f"{key}: its answer differs from h's by {np.abs(got - want).max()}")
        timed = time_interleaved(fns, calls=calls, repeats=repeats, warmup=200, syncs=syncs,
                                 pause=0.02, remote=remote)  # fmt: skip
        cold: dict[str, float] = {}
        for r in starters if coldstart else ():
            try:
                cold[r.key] = rv.cold_start(r)
            except Exception as e:
                notes.append(f"{r.key} cold start failed: {type(e).__name__}: {e}")
    return {
        "dispatch": sm.serving.dispatch_mode(),
        "traces": {"h": h.trace_count, "h_constants": hc.trace_count},
        "rows": {k: [s / calls for s in t.times] for k, t in timed.items()},
        "labels": {k: LABELS.get(k) or rv.LABELS[k] for k in timed},
        "stages": stages,
        "cold_start_s": cold,
        "skipped": skipped,
        "notes": notes,
    }


def bench_per_request(
    *,
    sizes: Sequence[int] = (256, 128, 2),
    in_features: int = 512,
    activation: str | None = "relu",
    seed: int = 0,
    calls: int = 1000,
    repeats: int = 15,
    iree: bool = False,
    rivals: bool = False,
    coldstart: bool = False,
    timeout: float = 1800.0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Runs :func:`measure` in a fresh process; its rows summarised, and the targets.

    Returns:
      A dict: ``rows`` (key -> ``label``, ``per_call_s`` of each repeat, ``min_s``,
      ``median_s``, ``spread``, ``stage_s``, ``cold_start_s``), ``skipped`` (key -> why),
      ``floors`` (``dispatch_s``, ``compute_s``, ``left_s``: h's min less the constants
      executable's), ``targets``, ``dispatch``, ``traces``, ``notes``, ``config``.
    """
    if progress:
        what = " and the PyTorch/ONNX rows (compiling them takes a while)" if rivals else ""
        progress(f"per request: h(x) against its floors{what}, in a fresh latency-mode process")
    config = {"sizes": list(sizes), "in_features": in_features, "activation": activation,
              "seed": seed, "calls": calls, "repeats": repeats, "iree": iree, "rivals": rivals,
              "coldstart": coldstart}  # fmt: skip
    got = run_json(_ENTRY, config, None, timeout, "the per-request process")
    rows = {}
    for key, times in got["rows"].items():
        lo, med = min(times), statistics.median(times)
        rows[key] = {"label": got["labels"][key], "per_call_s": times, "min_s": lo,
                     "median_s": med, "spread": med / lo - 1, "stage_s": got["stages"].get(key),
                     "cold_start_s": got["cold_start_s"].get(key)}  # fmt: skip
    floors = {
        "dispatch_s": rows["dispatch_floor"]["min_s"],
        "compute_s": rows["aot_constants"]["min_s"] - rows["dispatch_floor"]["min_s"],
        "left_s": rows["h"]["min_s"] - rows["aot_constants"]["min_s"],
    }
    result = {**{k: got[k] for k in ("dispatch", "traces", "skipped", "notes")}, "rows": rows,
              "floors": floors, "config": config}  # fmt: skip
    result["targets"] = per_request_targets(rows)
    return result


def per_request_targets(rows: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The per-request targets (min over min); ``band``: the two rows' larger spread."""
    out = []

    def ratio(name: str, num: str, den: str, target: str, what: str) -> None:
        a, b = rows[num], rows[den]
        value = round(a["min_s"] / b["min_s"], 3)
        op, _, bound = target.partition(" ")
        met = None if not bound else value >= float(bound) if op == ">=" else value <= float(bound)
        band = max(a["spread"], b["spread"])
        out.append({"name": name, "what": what, "value": value, "band": band, "target": target,
                    "met": met})  # fmt: skip

    for name, num, den, target in RATIO_TARGETS + IREE_TARGETS:
        if num in rows:  # an IREE row: when asked, and made here
            ratio(name, num, den, target, f"{rows[num]['label']} / {rows[den]['label']}")
    ours = min(("h", "h_constants"), key=lambda k: rows[k]["min_s"])
    torch = [k for k in rows if k.startswith("torch_")]
    if torch:
        fastest = min(torch, key=lambda k: rows[k]["min_s"])
        ratio("fastest_torch_over_h", fastest, ours, ">= 1",
              f"{rows[fastest]['label']} (PyTorch's fastest) / {rows[ours]['label']}; above "
              "1, JAX answers a request sooner")  # fmt: skip
    others = [k for k in rows if k not in LABELS and k not in torch]
    if others:
        fastest = min(others, key=lambda k: rows[k]["min_s"])
        ratio("fastest_other_over_h", fastest, ours, "reported",
              f"{rows[fastest]['label']} / {rows[ours]['label']}")  # fmt: skip
    return out


def format_per_request(result: Mapping[str, Any]) -> str:
    """The rows as a table (per call, against the constants executable), the floors, the
    targets with their noise band, and the rows that could not be made."""
    us, rows = format_seconds, result["rows"]
    base = rows["aot_constants"]["min_s"]
    c = result["config"]
    lines = [
        f"Per request, against floors measured in the same run: one fresh process, JAX "
        f"{result['dispatch']} dispatch, mlp({c['sizes']}) at batch 1, {c['calls']} synced calls "
        f"x {c['repeats']} repeats, rows interleaved; params after one Adam step from init (every "
        f"bias non-zero, as a trained model's), but the row 'at init' (zero biases, folded out)",
        f"  {'row':<48}{'min':>10}{'median':>10}{'vs AOT const':>14}{'stage':>10}{'cold':>9}",
    ]
    for r in rows.values():
        stage = us(r["stage_s"]) if r["stage_s"] is not None else ""
        cold = f"{r['cold_start_s']:.2f} s" if r["cold_start_s"] is not None else ""
        lines.append(
            f"  {r['label'][:47]:<48}{us(r['min_s']):>10}{us(r['median_s']):>10}"
            f"{r['min_s'] / base:>13.3f}x{stage:>10}{cold:>9}"
        )
    f = result["floors"]
    lines.append(
        f"  dispatch floor {us(f['dispatch_s'])}; compute (AOT constants less the floor) "
        f"{us(f['compute_s'])}; left to h beyond the AOT executable {us(f['left_s'])}"
    )
    lines += [f"  {key}: not made here: {why}" for key, why in result["skipped"].items()]
    lines.append("Targets (per request, min over min; band: the larger median/min spread)")
    for t in result["targets"]:
        verdict = {None: "reported", True: "met", False: "MISSED"}[t["met"]]
        lines.append(
            f"  {t['name']:<32}{t['value']:>7.3f} ±{t['band']:.1%}  (target {t['target']}) "
            f"{verdict}: {t['what']}"
        )
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)
