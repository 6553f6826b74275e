"""The benchmark's result: its rows, the issue's targets, and the report in words and JSON.

:func:`benchmark` measures; this module holds what it returns
(:class:`BenchReport`, a :class:`Row` per way of running the net) and how that reads:
:func:`format_report` prints the chapter's two lines first, then the table, the stages, what
the figures mean, the targets and where it ran.

The JSON (``BenchReport.to_dict()``, ``python scripts/bench.py --json``) carries ``"schema": 1``
(:data:`SCHEMA`). Schema 1 is: ``schema``; ``chapter`` (``calls``, ``without_s``,
``with_s``); ``rows``, a list of :meth:`Row.to_dict` (``key``, ``label``, ``speedup``,
``per_1000_inputs_min_s``, ``per_1000_inputs_median_s`` and the row's
:meth:`Timing.to_dict`: ``calls``, ``repeats``, ``times_s``, ``min_s``,
``median_s``, ``spread``, ...); ``stages`` (name -> timing); ``targets`` (name -> ``value``,
``target``, ``met``, ``what``); ``pipelined`` (key -> the timing of the JAX rows of
:data:`PIPELINED` timed again with one sync per repeat); the optional sections ``peak``,
``traces``, ``train_step``, ``latency_mode`` (the latency-mode row's process: its
``dispatch`` and ``traces``) and, from the command line, ``devices`` and ``sweep``;
``notes``; ``config`` (the run's arguments, ``quick`` among them) and ``env``
(:func:`environment`, and ``dispatch``: JAX's CPU dispatch in the
benchmark's process). New keys may be added under the same schema; a key
renamed, removed or changed in meaning bumps it.
:func:`compare_runs` reads schema 1 (and files from before the schema).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from benchmarks.timing import Timing
from benchmarks.timing import format_seconds as _fmt_s

#: The version of the benchmark's JSON layout (see the module docstring); readers check it.
SCHEMA = 1

#: Decimals the targets are printed with; ``met`` is decided on the value rounded to them, so
#: a printed value never contradicts its verdict (no "1.15 (target <= 1.15) MISSED").
TARGET_DECIMALS = 3

#: The table's label of each row key; ``{n}`` is the number of inputs.
LABELS = {
    "eager": "eager op-by-op (h.eager)",
    "flax_eager": "Flax eager (net.apply, no jit)",
    "jnp_eager": "jax.numpy eager, no Flax",
    "hybridized": "hybridized (h)",
    "floor": "AOT floor (jit.lower.compile)",
    "artifact_jax": "loaded artifact (JAX)",
    "artifact_iree": "loaded artifact (IREE, CPU)",
    "torch_eager": "PyTorch eager",
    "torch_script": "torch.jit.script",
    "torch_compile": "torch.compile",
    "hybridized_latency": "h, latency mode (own process)",
    "vmap": "{n} inputs, one call (vmap)",
    "batch": "batch of {n}, one call (h)",
}


#: The rows timed a second time pipelined (one sync per repeat), as the chapter's loop runs.
PIPELINED = ("hybridized", "floor", "artifact_jax")


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: a way of running the same net on the same inputs.

    ``speedup`` is the eager row's min time per input over this row's (min over min).
    """

    key: str
    label: str
    timing: Timing
    speedup: float

    def to_dict(self) -> dict[str, Any]:
        lo, med = self.timing.per_inputs(1000)
        return {
            "key": self.key,
            "label": self.label,
            "speedup": self.speedup,
            "per_1000_inputs_min_s": lo,
            "per_1000_inputs_median_s": med,
            **self.timing.to_dict(),
        }


@dataclasses.dataclass(frozen=True)
class BenchReport:
    """Everything one :func:`benchmark` run measured; ``to_dict()`` is its JSON.

    Attributes:
      without_s, with_s: the chapter's two lines: ``calls`` calls of ``h.eager`` (the whole
        run, timed in chunks) and of ``h`` (the median repeat).
      rows: the table, eager first.
      stages: ``trace``/``lower``/``compile`` of the net, and ``first_call`` of a fresh
        ``h`` (all three plus one run).
      targets: each ratio the issue sets a target for: ``{"value", "target", "met"}``;
        ``met`` is decided on ``value`` rounded to :data:`TARGET_DECIMALS` decimals, as printed.
      extra: optional sections (``peak``, ``traces``, ``train_step``), when they ran.
      notes: why an optional row was skipped, warnings worth reading.
      config: the arguments of the run; env: :func:`environment`.
    """

    without_s: float
    with_s: float
    calls: int
    rows: tuple[Row, ...]
    stages: dict[str, Timing]
    targets: dict[str, dict[str, Any]]
    extra: dict[str, Any]
    notes: tuple[str, ...]
    config: dict[str, Any]
    env: dict[str, Any]

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "chapter": {"calls": self.calls, "without_s": self.without_s, "with_s": self.with_s},
            "rows": [r.to_dict() for r in self.rows],
            "stages": {k: v.to_dict() for k, v in self.stages.items()},
            "targets": self.targets,
            **self.extra,
            "notes": list(self.notes),
            "config": self.config,
            "env": self.env,
        }


def make_rows(timings: Mapping[str, Timing], n: int) -> tuple[Row, ...]:
    """A labelled :class:`Row` per timing, each with its speedup over ``timings["eager"]``."""
    base = timings["eager"].per_input_min
    return tuple(
        Row(key, LABELS.get(key, key).format(n=n), t, base / t.per_input_min)
        for key, t in timings.items()
    )


def target_met(value: float, target: str) -> bool:
    """Whether ``value`` meets ``target`` (``">= 10"``, ``"<= 1.15"``), on the value rounded to
    :data:`TARGET_DECIMALS` decimals: the verdict of the digits the report prints."""
    op, _, bound = target.partition(" ")
    shown = round(value, TARGET_DECIMALS)
    return shown >= float(bound) if op == ">=" else shown <= float(bound)


def targets(
    t: Mapping[str, Timing],
    pipelined: Mapping[str, Timing] | None = None,
    train: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """The issue's targets, as measured (min over min); ``met`` is informative, never asserted.

    ``pipelined``: the :data:`PIPELINED` rows timed with one sync per repeat, where the
    Hybrid's own Python is measured without the wait for each result. ``train``: the
    training-step section, whose ``checkpoint_wait`` (a 2-process run's saves) has a target.

    ``met`` compares the value rounded to :data:`TARGET_DECIMALS` decimals, the digits
    :func:`format_report` prints, so the line and its verdict always agree.
    """

    def per_input(key: str) -> float:
        return t[key].per_input_min

    out: dict[str, dict[str, Any]] = {}

    def add(
        name: str, value: float, target: float | None, higher_is_better: bool, what: str
    ) -> None:
        """A ratio and its target; ``target=None``: reported, with no target (``met`` None)."""
        if target is None:
            out[name] = {"value": value, "target": "reported", "met": None, "what": what}
            return
        bound = f"{'>=' if higher_is_better else '<='} {target:g}"
        out[name] = {"value": value, "target": bound, "met": target_met(value, bound), "what": what}

    hyb = per_input("hybridized")
    add("hybridized_vs_eager", per_input("eager") / hyb, 10, True, "speedup of h over h.eager")
    add("hybridized_over_floor", hyb / per_input("floor"), 1.15, False, "h per call / floor")
    if pipelined and {"hybridized", "floor"} <= pipelined.keys():
        add("hybridized_over_floor_pipelined",
            pipelined["hybridized"].per_call_min / pipelined["floor"].per_call_min, 1.05, False,
            "h per call / floor, pipelined (one sync per repeat)")  # fmt: skip
    if "artifact_jax" in t:
        add("artifact_over_hybridized", per_input("artifact_jax") / hyb, 1.3, False,
            "loaded artifact (JAX) per call / h")  # fmt: skip
    for key in ("vmap", "batch"):
        add(f"{key}_vs_single_calls", hyb / per_input(key), 10, True,
            f"single h calls / one {key} call over as many inputs")  # fmt: skip
    torch_keys = [k for k in ("torch_eager", "torch_script", "torch_compile") if k in t]
    if torch_keys:
        fastest = min(torch_keys, key=per_input)
        add("torch_fastest_over_hybridized", per_input(fastest) / hyb, None, True,
            f"fastest PyTorch mode ({fastest}) per call / h; > 1 means h is faster (JAX's "
            "default async dispatch: a synced call waits for a hand-off to its dispatch "
            "thread; the per-request targets are latency mode's)")  # fmt: skip
        if "hybridized_latency" in t:
            add("torch_fastest_over_latency_mode", per_input(fastest) / per_input(
                "hybridized_latency"), 1, True,
                f"fastest PyTorch mode ({fastest}) per call / h in latency mode (synchronous "
                "dispatch, its own process); > 1 means h answers a request faster")  # fmt: skip
    wait = (train or {}).get("checkpoint_wait")
    if wait:
        add("checkpoint_wait_over_step", wait["save_over_step"], 0.1, False,
            "a 2-process run: median wait of an async Orbax save / median step")  # fmt: skip
        if "save_max_over_step" in wait:
            add("checkpoint_max_wait_over_step", wait["save_max_over_step"], 0.1, False,
                "the worst later save's wait (a queue full of saves would show here) / median "
                "step")  # fmt: skip
    return out


def _meaning(report: BenchReport) -> list[str]:
    """What the figures say, in words, from this run's own numbers."""
    per = {r.key: r.timing.per_call_min for r in report.rows}
    n = report.calls
    e, j, hyb, floor = per["eager"], per["jnp_eager"], per["hybridized"], per["floor"]
    out = [
        f"what it means: eager, every call re-runs Python: Flax re-enters each module and checks "
        f"each param's shape, then dispatches each op ({_fmt_s(e)} a call); the same ops "
        f"dispatched one by one from plain jax.numpy cost {_fmt_s(j)}.",
        f"Hybridized, a call is one dispatch of one XLA executable: {_fmt_s(hyb)} synced, "
        f"against {_fmt_s(floor)} for the bare AOT executable.",
    ]
    piped = report.extra.get("pipelined") or {}
    if {"hybridized", "floor"} <= piped.keys():
        ph, pf = (piped[k]["per_call_min_s"] for k in ("hybridized", "floor"))
        cost = (
            f"h's own Python costs {_fmt_s(ph - pf)} a call"
            if ph > pf
            else "h was the faster of the two here: its own Python is within the noise"
        )
        out[-1] += (
            f" Pipelined (one sync per repeat, no wait for each result) {_fmt_s(ph)} against "
            f"{_fmt_s(pf)}: {cost}."
        )
    lat = per.get("hybridized_latency")
    if lat and report.env.get("dispatch") == "sync":
        out.append(
            f"This process runs in latency mode too (synchronous dispatch); h timed in a fresh "
            f"process in that mode: {_fmt_s(lat)} a call" + _against_torch(per, lat) + "."
        )
    elif lat:
        out.append(
            f"Answered one request at a time, a synced call waits for JAX's dispatch thread to "
            f"hand the result back; in latency mode (sm.serving.latency_mode(): synchronous "
            f"dispatch, timed in its own process) the call runs on the caller's thread: "
            f"{_fmt_s(lat)} a call, {hyb / lat:.2f}x faster than h here"
            + _against_torch(per, lat)
            + "."
        )
    v = report.row("vmap")
    if v:
        out.append(
            f"All {n} inputs in one call ({_fmt_s(v.timing.per_call_min)}): the dispatch is paid "
            f"once and the matmuls see {n} rows at a time, {hyb * n / v.timing.per_call_min:.1f}x "
            f"faster than {n} single calls."
        )
    pk = report.extra.get("peak")
    if pk:
        bound = pk["batched_flops"] / (pk["gflops"] * 1e9)
        share = pk["batched_gflops"] / pk["gflops"]
        verdict = "it is compute-bound" if share >= 0.7 else "below the best square matmul's rate"
        out.append(
            f"As one batch it runs at {pk['batched_gflops']:.1f} GFLOP/s, {share:.0%} of this "
            f"machine's measured matmul rate ({pk['gflops']:.1f} GFLOP/s, best {pk['size']}² "
            f"jnp.dot): {verdict}; at that rate {n} inputs take {_fmt_s(bound)}, "
            f"{hyb * n / bound:.1f}x less than {n} single calls here."
        )
    return out


def _against_torch(per: Mapping[str, float], lat: float) -> str:
    """``", and 1.6x faster than torch.jit.script"`` (its fastest mode), or ``""``."""
    torch = {k: v for k, v in per.items() if k.startswith("torch_")}
    if not torch:
        return ""
    fastest = min(torch, key=torch.__getitem__)
    ratio = torch[fastest] / lat
    side = f"{ratio:.2f}x faster than" if ratio >= 1 else f"{1 / ratio:.2f}x slower than"
    return f", and {side} {LABELS[fastest]} (PyTorch's fastest here)"


def _quick_lines(report: BenchReport) -> list[str]:
    """The banner of a quick run: what it skipped, and that its figures are a first look."""
    if not report.config.get("quick"):
        return []
    c = report.config
    sections = (("IREE", "iree"), ("the training step", "train_step"), ("the matmul peak", "peak"))
    skipped = [(name, key) for name, key in sections if not c.get(key, True)]
    flags = {"iree": "--iree", "train_step": "--train", "peak": "--peak"}
    ask = (
        f"; skipped {', '.join(n for n, _ in skipped)} "
        f"(ask with {', '.join(flags[k] for _, k in skipped)})"
        if skipped
        else ""
    )
    return [
        "",
        f"QUICK RUN (--quick): {c['calls']} calls, {c['repeats']} repeats{ask}. A first look: "
        "for figures to quote, run without --quick.",
    ]


def format_report(report: BenchReport) -> str:
    """The human-readable report: the chapter's two lines first, then the table and the rest."""
    n = report.calls
    lines = [
        f"Without hybridization: {report.without_s:.4f} sec",
        f"With hybridization: {report.with_s:.4f} sec",
        *_quick_lines(report),
        "",
        f"{n} batch-1 inputs of mlp({report.config['sizes']}) on "
        f"(1, {report.config['in_features']}); min and median over repeats, every call synced",
        f"{'row':<34}{'min':>11}{'median':>11}{'per call':>11}{'calls x rep':>13}{'speedup':>10}",
    ]
    for r in report.rows:
        lo, med = r.timing.per_inputs(n)
        reps = f"{r.timing.calls}x{len(r.timing.times)}"
        lines.append(
            f"{r.label:<34}{_fmt_s(lo):>11}{_fmt_s(med):>11}"
            f"{_fmt_s(r.timing.per_call_min):>11}{reps:>13}{r.speedup:>9.1f}x"
        )
    lines.append("(min/median: seconds for all the inputs; speedup: over eager, min vs min)")
    piped = report.extra.get("pipelined") or {}
    if piped:
        floor = piped.get("floor", {}).get("per_call_min_s")
        lines += [
            "",
            "the same JAX calls pipelined, one sync per repeat (the next call is dispatched while "
            "one runs)",
            f"{'row':<34}{'min/call':>11}{'median/call':>13}{'vs floor':>10}",
        ]
        for key, t in piped.items():
            ratio = f"{t['per_call_min_s'] / floor:>9.3f}x" if floor else ""
            lines.append(
                f"{LABELS.get(key, key):<34}{_fmt_s(t['per_call_min_s']):>11}"
                f"{_fmt_s(t['per_call_median_s']):>13}{ratio}"
            )
    lines += ["", "stages (min / median over repeats; one-off where a single figure):"]
    for k, t in report.stages.items():
        extra = f" / {_fmt_s(t.median)}" if len(t.times) > 1 else ""
        lines.append(f"  {k:<12} {_fmt_s(t.min)}{extra}")
    tr = report.extra.get("train_step")
    if tr:
        lines += [
            "",
            f"train step (mlp{tuple(tr['sizes'])}, batch {tr['batch_size']}): compiled "
            f"{tr['compiled_steps_per_s']:.0f} steps/s, eager {tr['eager_steps_per_s']:.1f} "
            f"steps/s, {tr['speedup']:.0f}x; first compiled step {tr['compile_seconds']:.2f} s",
        ]
        if w := tr.get("checkpoint_wait"):
            lines.append(
                f"checkpoint saves ({w['processes']} processes, async Orbax, {w['saves']} saves, "
                f"{w.get('superseded', 0)} of them skipped while one committed): "
                f"a step waits {w['save_ms']:.2f} ms per save (median; "
                f"{w.get('save_min_ms', w['save_ms']):.2f}-{w.get('save_max_ms', w['save_ms']):.2f}"
                f" ms; the first {w['first_save_ms']:.0f} ms) against a {w['step_ms']:.2f} ms step"
            )
    lines += ["", *_meaning(report)]
    lines += ["", "targets (measured in this run):"]
    width = max(map(len, report.targets), default=0)
    for name, t in report.targets.items():
        value = f"{t['value']:.{TARGET_DECIMALS}f}"
        if t["met"] is None:
            lines.append(f"  {name:<{width}} {value:>10}  (no target) reported")
            continue
        mark = "met" if target_met(t["value"], t["target"]) else "MISSED"  # as printed
        lines.append(f"  {name:<{width}} {value:>10}  (target {t['target']}) {mark}")
    e = report.env
    where = f"ran on: {e['backend']} / {e['device_kind']} ({e['device']})"
    where += f", {e['cpu_model']}" if e.get("cpu_model") else ""
    where += f", {e['cpu_usable']} of {e['cpu_count']} cores usable"
    where += f", JAX {e['dispatch']} dispatch" if e.get("dispatch") else ""
    if "loadavg" in e:
        where += f", load average {e['loadavg'][0]:.2f} at start"
    lines += [
        "",
        where,
        f"versions: jax {e['jax']}, jaxlib {e['jaxlib']}, flax {e['flax']}, "
        f"symjax_mlp {e['symjax_mlp']}, python {e['python']}",
    ]
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)
