"""The chapter's benchmark, run: ``calls`` batch-1 calls of one MLP, every way there is.

:func:`benchmark` times the rows (eager, Flax and jax.numpy eager, hybridized, the AOT floor,
the exported artifact in JAX and IREE, PyTorch, one batched call) with the timer of
:mod:`benchmarks.timing` and returns a :class:`BenchReport`. Optional
rows (the artifact, IREE, PyTorch, the training step) are skipped with a note when they fail,
for example when their package is missing: an optional row never sinks the run.

``benchmark(quick=True)`` (``--quick``) is a first look in seconds: the :data:`QUICK` settings
instead of :data:`FULL` for whatever the caller leaves unset, without the slow sections
(IREE, the training step, the matmul peak) unless asked; its report says it is a quick run.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.calls import trained
from benchmarks.remote import LatencyRow
from benchmarks.report import PIPELINED, BenchReport, make_rows, targets
from benchmarks.scaling import measure_peak
from benchmarks.timing import Progress, Timing, environment, time_interleaved, time_stages
from benchmarks.train_step import time_checkpoint_wait, time_train_step
from benchmarks.twins import mlp_jnp, torch_rows
from symjax_mlp import ConfigError, Hybrid, export, hybridize, load, mlp
from symjax_mlp.serving import dispatch_mode

#: The settings of a full run, for every argument of :func:`benchmark` left at ``None``.
FULL: dict[str, Any] = {
    "calls": 1000,
    "repeats": 15,
    "eager_chunks": 10,
    "stage_repeats": 5,
    "iree": True,
    "train_step": True,
    "peak": True,
}
#: The settings of ``quick=True`` (``--quick``): a first look in seconds, slow sections off.
QUICK: dict[str, Any] = {
    "calls": 50,
    "repeats": 5,
    "eager_chunks": 5,
    "stage_repeats": 2,
    "iree": False,
    "train_step": False,
    "peak": False,
}


def benchmark(
    *,
    calls: int | None = None,
    repeats: int | None = None,
    eager_chunks: int | None = None,
    sizes: Sequence[int] = (256, 128, 2),
    in_features: int = 512,
    activation: str | None = "relu",
    compare: Sequence[str] = (),
    artifact: bool = True,
    iree: bool | None = None,
    train_step: bool | None = None,
    stage_repeats: int | None = None,
    peak: bool | None = None,
    peak_size: int | None = None,
    latency: bool = True,
    seed: int = 0,
    quick: bool = False,
    progress: Progress | None = None,
) -> BenchReport:
    """Runs the chapter's benchmark: ``calls`` batch-1 calls of one MLP, every way there is.

    Rows (all on the same net, weights and input): ``h.eager``; Flax ``net.apply`` un-jitted;
    the same math in plain ``jax.numpy``, un-jitted; ``h(x)``; the floor, a
    ``jax.jit(f).lower(...).compile()`` executable called on pre-flattened params; the
    exported artifact loaded in JAX and in IREE (when IREE is installed); PyTorch
    (``compare=("torch",)``); ``h(x)`` in :func:`~symjax_mlp.serving.latency_mode`, timed in
    a fresh process (this one keeps JAX's default, asynchronous dispatch, where a synced call
    waits for a hand-off to JAX's dispatch thread); and all ``calls`` inputs in one compiled
    call, via ``vmap`` and as one batch.

    Eager rows run the ``calls`` calls once, in ``eager_chunks`` timed chunks (eager Flax
    costs milliseconds a call); the compiled rows run ``repeats`` repeats of ``calls``
    calls, interleaved.

    Every argument left at ``None`` takes its value from :data:`FULL`, or from :data:`QUICK`
    with ``quick=True``; given values always win (``quick=True, peak=True`` measures the peak).

    Args:
      calls: batch-1 calls per repeat (the chapter's 1000; 50 quick).
      repeats: repeats of each compiled row (min and median over them).
      eager_chunks: chunks the eager rows' ``calls`` calls are timed in (their repeats).
      sizes, in_features, activation: the net, ``mlp(sizes, activation=...)`` on
        ``(1, in_features)`` inputs.
      compare: other frameworks to add to the table: ``("torch",)``.
      artifact, iree, train_step: include those optional rows/sections when available.
      stage_repeats: repeats of the trace/lower/compile timing.
      peak, peak_size: also time an ``n x n`` ``jnp.dot`` (see
        :func:`measure_peak`), to say how close the batched call gets to
        this machine's matmul rate.
      latency: include the latency-mode row (a subprocess; skipped with a note if it fails).
      seed: for the params and the input.
      quick: a first look: the :data:`QUICK` settings; the report says it is a quick run.
      progress: called with a status line as the run goes.

    Returns:
      A :class:`BenchReport`.

    Example:
      >>> r = benchmark(calls=10, repeats=2, eager_chunks=2, artifact=False, train_step=False)
      >>> r.rows[0].key, r.row("hybridized").timing.calls
      ('eager', 10)
    """
    preset = QUICK if quick else FULL
    calls, repeats, eager_chunks, stage_repeats = (
        preset[k] if v is None else v
        for k, v in (
            ("calls", calls),
            ("repeats", repeats),
            ("eager_chunks", eager_chunks),
            ("stage_repeats", stage_repeats),
        )
    )
    iree, train_step, peak = (
        preset[k] if v is None else v
        for k, v in (("iree", iree), ("train_step", train_step), ("peak", peak))
    )
    bad = sorted(set(compare) - {"torch"})
    if bad:
        raise ConfigError(
            f"benchmark(compare={tuple(compare)!r}): the frameworks to compare with are "
            "('torch',); drop the others."
        )
    if calls < 1 or repeats < 1 or eager_chunks < 1 or stage_repeats < 1:
        raise ConfigError("calls, repeats, eager_chunks and stage_repeats must all be >= 1.")
    say = progress or (lambda _: None)
    env = environment()
    env["dispatch"] = dispatch_mode()  # JAX's CPU dispatch in this process: async by default
    notes: list[str] = []
    extra: dict[str, Any] = {}
    net = mlp(tuple(sizes), activation=activation)
    rng = np.random.default_rng(seed)  # inputs from numpy: nothing to compile
    inputs = rng.standard_normal((calls, 1, in_features), dtype=np.float32)
    x, xs, xb = (jnp.asarray(a) for a in (inputs[0], inputs, inputs[:, 0]))
    variables = jax.jit(net.init)(jax.random.key(seed), x)  # one compile, not one per op
    variables = trained(net, variables, inputs[0], seed)  # as a trained model's (all rows)

    # Stages first, on a fresh function: nothing has been traced or compiled yet.
    say("timing trace / lower / compile")
    stages = time_stages(net.apply, variables, x, repeats=stage_repeats)
    t0 = time.perf_counter()
    h = hybridize(net, variables)
    h(x).block_until_ready()
    stages["first_call"] = Timing("first_call", 1, (time.perf_counter() - t0,))

    # Eager: the chapter's "without" line is exactly `calls` calls, timed in chunks.
    chunk = max(1, calls // eager_chunks)
    pure = functools.partial(mlp_jnp, activation=activation)
    eager = time_interleaved(
        {
            "eager": lambda: h.eager(x),
            "flax_eager": lambda: net.apply(variables, x),
            "jnp_eager": lambda: pure(variables, x),
        },
        calls=chunk,
        repeats=eager_chunks,
        warmup=3,
        progress=say,
    )

    # Compiled, batch 1: h, the floor, the artifact, other frameworks; interleaved.
    leaves, treedef = jax.tree.flatten(variables)

    def flat_apply(leaves: Any, x: jax.Array) -> jax.Array:
        return net.apply(jax.tree.unflatten(treedef, leaves), x)

    floor = jax.jit(flat_apply).lower(leaves, x).compile()
    fast: dict[str, Callable[[], Any]] = {
        "hybridized": lambda: h(x),
        "floor": lambda: floor(leaves, x),
    }
    syncs: dict[str, Callable[[Any], Any]] = {}
    restore_torch: Callable[[], None] = lambda: None  # noqa: E731
    remote = _latency_row(h, sizes, in_features, activation, seed, notes, say) if latency else None
    with tempfile.TemporaryDirectory(prefix="symjax_mlp_bench_") as tmp:
        if artifact:
            fast |= _artifact_rows(h, x, os.path.join(tmp, "mlp"), iree, notes, stages, say)
        if "torch" in compare:
            say("building the PyTorch twins (torch.compile takes a while)")
            try:
                tfns, tsyncs, restore_torch = torch_rows(variables, x, activation, notes, stages)
            except (ImportError, ValueError) as e:
                notes.append(f"torch rows skipped: {type(e).__name__}: {e}")
            else:
                fast |= tfns
                syncs |= tsyncs
        try:
            rows = {"hybridized_latency": remote} if remote else None
            compiled = time_interleaved(
                fast, calls=calls, repeats=repeats, syncs=syncs, progress=say, remote=rows
            )
            # The same JAX calls pipelined, as the chapter's loop runs them: one sync a repeat.
            piped = {k: fast[k] for k in PIPELINED if k in fast}
            pipelined = time_interleaved(
                piped, calls=calls, repeats=repeats, pipelined=True, progress=say
            )
        finally:
            restore_torch()
            if remote:
                remote.close()
    extra["pipelined"] = {k: t.to_dict() for k, t in pipelined.items()}
    if remote:
        extra["latency_mode"] = {"dispatch": remote.dispatch, "traces": remote.traces}

    # All `calls` inputs in one compiled call: vmap over single inputs, and one plain batch.
    vfn = jax.jit(jax.vmap(h.fn, in_axes=(None, 0))).lower(h.params, xs).compile()
    batched = time_interleaved(
        {"vmap": lambda: vfn(h.params, xs), "batch": lambda: h(xb)},
        calls=max(1, min(20, calls // 10)),
        repeats=repeats,
        inputs_per_call={"vmap": calls, "batch": calls},
        progress=say,
    )

    if peak:
        say("measuring the matmul peak")
        gflops, n, _ = measure_peak(peak_size)
        batch_flops = h.graph(xb).flops
        extra["peak"] = {
            "gflops": gflops,
            "size": n,
            "batched_flops": batch_flops,
            "batched_gflops": batch_flops / batched["batch"].per_call_min / 1e9,
        }

    # No retrace while timing: one trace for batch 1, one for the batch of `calls`.
    extra["traces"] = {"count": h.trace_count, "log": [str(e) for e in h.trace_log]}
    if train_step:
        extra["train_step"] = _train_step_section(notes, say)

    timings = {**eager, **compiled, **batched}
    env["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    config = {
        "calls": calls,
        "repeats": repeats,
        "eager_chunks": eager_chunks,
        "sizes": list(sizes),
        "in_features": in_features,
        "activation": activation,
        "compare": list(compare),
        "seed": seed,
        "quick": quick,
        "artifact": artifact,
        "iree": iree,
        "train_step": train_step,
        "peak": peak,
        "latency": latency,
        "stage_repeats": stage_repeats,
    }
    return BenchReport(
        without_s=sum(timings["eager"].times) * calls / (chunk * eager_chunks),
        with_s=timings["hybridized"].median,
        calls=calls,
        rows=make_rows(timings, calls),
        stages=stages,
        targets=targets(timings, pipelined, extra.get("train_step")),
        extra=extra,
        notes=tuple(notes),
        config=config,
        env=env,
    )


def _latency_row(
    h: Hybrid,
    sizes: Sequence[int],
    in_features: int,
    activation: str | None,
    seed: int,
    notes: list[str],
    say: Progress,
) -> LatencyRow | None:
    """The latency-mode row's process, its output checked against ``h``'s (``None``, with a
    note, when it fails or differs: an optional row never sinks the run)."""
    say("starting h(x) in latency mode, in a fresh process")
    try:
        row = LatencyRow(sizes=sizes, in_features=in_features, activation=activation, seed=seed)
    except (RuntimeError, OSError) as e:
        notes.append(f"latency-mode row skipped: {str(e)[-300:]}")
        return None
    want = np.asarray(h(jnp.asarray(row.x)))
    if row.out.shape != want.shape or not np.allclose(row.out, want, rtol=1e-5, atol=1e-6):
        row.close()
        notes.append(
            f"latency-mode row skipped: its output {row.out.tolist()} differs from h's "
            f"{want.tolist()} on the same input"
        )
        return None
    return row


def _artifact_rows(
    h: Hybrid, x: jax.Array, path: str, iree: bool, notes: list[str], stages: dict, say: Progress
) -> dict[str, Callable[[], Any]]:
    """The exported artifact, loaded back in JAX and (if installed) IREE, as timed rows."""
    fns: dict[str, Callable[[], Any]] = {}
    say("exporting the artifact")
    try:
        t0 = time.perf_counter()
        export(h, path, example=x, batch="b")
        t1 = time.perf_counter()
        m = load(path)
        m(x)
        stages["export"] = Timing("export", 1, (t1 - t0,))
        stages["load_jax"] = Timing("load_jax", 1, (time.perf_counter() - t1,))
        fns["artifact_jax"] = lambda: m(x)
    except Exception as e:  # an optional row must not sink the run; the note says why
        notes.append(f"artifact (JAX) row skipped: {type(e).__name__}: {e}")
        return fns
    if not iree:
        return fns
    say("loading the artifact in IREE (compiles it once)")
    try:
        t0 = time.perf_counter()
        mi = load(path, runtime="iree")
        mi(x)
        stages["load_iree"] = Timing("load_iree", 1, (time.perf_counter() - t0,))
        fns["artifact_iree"] = lambda: mi(x)
    except Exception as e:  # e.g. IREE not installed: the ArtifactError says what to install
        notes.append(f"artifact (IREE) row skipped: {type(e).__name__}: {str(e)[:300]}")
    return fns


def _train_step_section(notes: list[str], say: Progress) -> dict[str, Any] | None:
    say("timing the training step, compiled and eager")
    try:
        section = time_train_step()
    except Exception as e:
        notes.append(f"train step section skipped: {type(e).__name__}: {e}")
        return None
    say("timing a 2-process run's asynchronous checkpoint saves")
    try:
        section["checkpoint_wait"] = time_checkpoint_wait()
    except Exception as e:
        notes.append(f"checkpoint-wait row skipped: {type(e).__name__}: {str(e)[:300]}")
    return section
