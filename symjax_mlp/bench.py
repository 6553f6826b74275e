"""The chapter's benchmark, measured honestly: eager vs hybridized vs the AOT floor and beyond.

Every timed call ends in ``block_until_ready`` (JAX dispatches asynchronously; without it a
loop times only the dispatch), every row is warmed up first, and every figure is the min and
the median over repeats. Rows that are compared to each other are timed *interleaved* (repeat
1 of each row, then repeat 2 of each, ...), so that noise from other processes lands on all of
them alike. Tracing, lowering and compiling are timed separately from steady-state calls.

The library functions return frozen results (:class:`Timing`, :class:`BenchReport`,
:class:`SweepReport`); :func:`main` is the one entry point of ``scripts/bench.py`` and of
``symjax-mlp bench``. Optional rows (the exported artifact, IREE, PyTorch, the training step)
are skipped with a note when their package is missing; torch and matplotlib are imported
only when asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "BenchReport",
    "Row",
    "SweepPoint",
    "SweepReport",
    "Timing",
    "add_arguments",
    "benchmark",
    "environment",
    "format_report",
    "format_sweep",
    "main",
    "measure_peak",
    "plot_sweep",
    "sweep",
    "time_calls",
    "time_interleaved",
    "time_stages",
]

Progress = Callable[[str], None]


# -- the timer -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of ``repeats`` runs of ``calls`` calls each, every call synced.

    Attributes:
      name: what was timed.
      calls: calls per repeat.
      times: seconds of each repeat (``len(times)`` repeats).
      inputs_per_call: samples one call processes (1000 for a batched call of 1000).
    """

    name: str
    calls: int
    times: tuple[float, ...]
    inputs_per_call: int = 1

    @property
    def min(self) -> float:
        """The fastest repeat, in seconds: the best estimate of the cost under noise."""
        return min(self.times)

    @property
    def median(self) -> float:
        """The median repeat, in seconds."""
        return statistics.median(self.times)

    @property
    def per_call_min(self) -> float:
        return self.min / self.calls

    @property
    def per_call_median(self) -> float:
        return self.median / self.calls

    def per_inputs(self, n: int = 1000) -> tuple[float, float]:
        """(min, median) seconds to process ``n`` inputs at this row's rate."""
        scale = n / (self.calls * self.inputs_per_call)
        return self.min * scale, self.median * scale

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "calls": self.calls,
            "repeats": len(self.times),
            "inputs_per_call": self.inputs_per_call,
            "times_s": list(self.times),
            "min_s": self.min,
            "median_s": self.median,
            "per_call_min_s": self.per_call_min,
            "per_call_median_s": self.per_call_median,
        }


def _sync_for(out: Any) -> Callable[[Any], Any]:
    """The cheapest correct way to wait for ``out``: a bound-method call for a jax.Array."""
    method = getattr(type(out), "block_until_ready", None)
    if isinstance(out, jax.Array) and method is not None:
        return method  # the unbound method of the concrete array type: no tree walk
    return jax.block_until_ready  # pytrees; numpy and CPU tensors pass through


def _loop(fn: Callable[[], Any], sync: Callable[[Any], Any], calls: int) -> float:
    clock = time.perf_counter
    t0 = clock()
    for _ in range(calls):
        sync(fn())
    return clock() - t0


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    *,
    calls: int = 1000,
    repeats: int = 5,
    warmup: int = 10,
    syncs: Mapping[str, Callable[[Any], Any]] | None = None,
    inputs_per_call: Mapping[str, int] | None = None,
    progress: Progress | None = None,
) -> dict[str, Timing]:
    """Times several zero-argument callables, their repeats interleaved.

    Each callable is warmed up (``warmup`` calls, at least one), then repeat ``r`` of every
    callable runs before repeat ``r + 1`` of any, so slow drifts in machine load hit every
    row alike. Every timed call is followed by its sync (``block_until_ready`` by default).

    Args:
      fns: name -> callable; each call should do one unit of work and return its output.
      calls: calls per repeat.
      repeats: repeats per callable (at least 1; use 5 or more for a min and a median).
      warmup: untimed calls before timing.
      syncs: name -> ``sync(output)``, for outputs that need another wait (``torch.cuda``).
      inputs_per_call: name -> samples per call (default 1).
      progress: called with a short status line before each callable's warm-up.

    Returns:
      name -> :class:`Timing`, in the order of ``fns``.

    Example:
      >>> t = time_interleaved({"add": lambda: jnp.ones(3) + 1}, calls=10, repeats=5)
      >>> t["add"].calls, len(t["add"].times)
      (10, 5)
    """
    if calls < 1 or repeats < 1:
        raise ValueError(f"calls and repeats must be >= 1; got calls={calls}, repeats={repeats}.")
    sync_of: dict[str, Callable[[Any], Any]] = {}
    for name, fn in fns.items():
        if progress:
            progress(f"warming up {name}")
        out = fn()
        sync_of[name] = (syncs or {}).get(name) or _sync_for(out)
        sync_of[name](out)
        _loop(fn, sync_of[name], max(0, warmup - 1))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        if progress:
            progress(f"timing {', '.join(fns)}: repeat {r + 1}/{repeats}")
        for name, fn in fns.items():
            times[name].append(_loop(fn, sync_of[name], calls))
    per = inputs_per_call or {}
    return {name: Timing(name, calls, tuple(times[name]), per.get(name, 1)) for name in fns}


def time_calls(
    fn: Callable[[], Any], *, name: str = "fn", calls: int = 1000, repeats: int = 5, **kw: Any
) -> Timing:
    """Times one zero-argument callable; see :func:`time_interleaved` for the arguments.

    Example:
      >>> t = time_calls(lambda: jnp.ones(3) * 2, calls=20, repeats=5)
      >>> t.min <= t.median
      True
    """
    return time_interleaved({name: fn}, calls=calls, repeats=repeats, **kw)[name]


def _autorange(fn: Callable[[], Any], min_seconds: float, max_calls: int) -> int:
    """The smallest power of two of calls (≤ max_calls) that takes at least ``min_seconds``."""
    out = fn()
    sync = _sync_for(out)
    sync(out)
    calls = 1
    while calls < max_calls and _loop(fn, sync, calls) < min_seconds:
        calls *= 2
    return min(calls, max_calls)


def time_stages(fn: Callable[..., Any], *args: Any, repeats: int = 5) -> dict[str, Timing]:
    """Times ``jax.jit(fn)``'s stages separately: trace, lower, compile (one of each per repeat).

    Each repeat wraps ``fn`` in a fresh function, so no trace or compile cache is hit.

    Returns:
      ``{"trace": Timing, "lower": Timing, "compile": Timing}``, one call per repeat.

    Example:
      >>> s = time_stages(lambda x: x * 2, jnp.ones(3), repeats=2)
      >>> sorted(s)
      ['compile', 'lower', 'trace']
    """
    samples: dict[str, list[float]] = {"trace": [], "lower": [], "compile": []}
    clock = time.perf_counter
    for _ in range(repeats):

        def fresh(*a: Any) -> Any:
            return fn(*a)

        t0 = clock()
        traced = jax.jit(fresh).trace(*args)
        t1 = clock()
        lowered = traced.lower()
        t2 = clock()
        lowered.compile()
        t3 = clock()
        samples["trace"].append(t1 - t0)
        samples["lower"].append(t2 - t1)
        samples["compile"].append(t3 - t2)
    return {k: Timing(k, 1, tuple(v)) for k, v in samples.items()}


# -- where it ran ----------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    """Versions, backend, device and core count: what every figure must be read against."""
    import flax

    from symjax_mlp import __version__

    dev = jax.devices()[0]
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    env = {
        "symjax_mlp": __version__,
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "backend": jax.default_backend(),
        "device": str(dev),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if hasattr(os, "getloadavg"):
        env["loadavg"] = list(os.getloadavg())
    return env


# -- the benchmark ---------------------------------------------------------------------------
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
      targets: each ratio the issue sets a target for: ``{"value", "target", "met"}``.
      extra: optional sections (``train_step``, ``sweep``), when they ran.
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
            "chapter": {"calls": self.calls, "without_s": self.without_s, "with_s": self.with_s},
            "rows": [r.to_dict() for r in self.rows],
            "stages": {k: v.to_dict() for k, v in self.stages.items()},
            "targets": self.targets,
            **self.extra,
            "notes": list(self.notes),
            "config": self.config,
            "env": self.env,
        }


def _mlp_fn(params: Any, x: jax.Array, activation: str | None) -> jax.Array:
    """The same MLP as plain jax.numpy on Flax's params: op-by-op dispatch without Flax."""
    from symjax_mlp.models import activation as act

    layers = params["params"]
    names = sorted(layers, key=lambda k: int(k.rsplit("_", 1)[1]))
    for i, name in enumerate(names):
        x = x @ layers[name]["kernel"] + layers[name]["bias"]
        if i < len(names) - 1:
            x = act(activation)(x)
    return x


def _torch_rows(
    variables: Any, x: jax.Array, activation: str | None, notes: list[str], stages: dict
) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[Any], Any]], Callable[[], None]]:
    """PyTorch eager / jit.script / compile with the same weights, threads and device.

    Returns the timed callables, their syncs, and a function that restores torch's thread
    count (set to JAX's for the comparison).
    """
    import torch  # optional extra: symjax_mlp[torch]

    acts = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "sigmoid": torch.nn.Sigmoid}
    acts |= {"gelu": functools.partial(torch.nn.GELU, approximate="tanh"), "silu": torch.nn.SiLU}
    if activation not in acts:
        raise ValueError(f"no PyTorch twin for activation {activation!r}")
    gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    old_threads = torch.get_num_threads()
    if not gpu:
        try:
            threads = len(os.sched_getaffinity(0))
        except AttributeError:
            threads = os.cpu_count() or 1
        torch.set_num_threads(threads)  # XLA:CPU's intra-op pool uses every usable core
        notes.append(f"torch: {torch.__version__}, {threads} threads, device cpu")
    else:
        notes.append(f"torch: {torch.__version__}, device {torch.cuda.get_device_name()}")
    layers = variables["params"]
    names = sorted(layers, key=lambda k: int(k.rsplit("_", 1)[1]))
    modules: list[Any] = []
    for i, name in enumerate(names):
        kernel = np.array(layers[name]["kernel"])  # writable copies: torch shares memory
        lin = torch.nn.Linear(*kernel.shape)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(kernel.T.copy()))
            lin.bias.copy_(torch.from_numpy(np.array(layers[name]["bias"])))
        modules.append(lin)
        if i < len(names) - 1:
            modules.append(acts[activation]())
    net = torch.nn.Sequential(*modules).eval().to(device)
    tx = torch.from_numpy(np.array(x)).to(device)
    sync = (lambda _: torch.cuda.synchronize()) if gpu else (lambda _: None)
    modes = {"torch_eager": net}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.script is deprecated in torch 2.x; still timed
        for key, make in (("torch_script", torch.jit.script), ("torch_compile", torch.compile)):
            try:
                t0 = time.perf_counter()
                modes[key] = make(net)
                modes[key](tx)  # torch.compile compiles on the first call
                stages[key] = Timing(key, 1, (time.perf_counter() - t0,))
            except Exception as e:  # e.g. no C++ compiler for inductor: keep the other rows
                notes.append(f"{key} row skipped: {type(e).__name__}: {str(e)[:200]}")
    want = np.asarray(_mlp_fn(variables, x, activation))
    got = net(tx).detach().cpu().numpy()
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
        notes.append(f"torch output differs from JAX by {np.abs(got - want).max():.2e}")

    def nograd(m: Any) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return m(tx)

        return call

    fns = {key: nograd(m) for key, m in modes.items()}
    return fns, dict.fromkeys(fns, sync), lambda: torch.set_num_threads(old_threads)


_LABELS = {
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
    "vmap": "{n} inputs, one call (vmap)",
    "batch": "batch of {n}, one call (h)",
}


def benchmark(
    *,
    calls: int = 1000,
    repeats: int = 15,
    eager_chunks: int = 10,
    sizes: Sequence[int] = (256, 128, 2),
    in_features: int = 512,
    activation: str | None = "relu",
    compare: Sequence[str] = (),
    artifact: bool = True,
    iree: bool = True,
    train_step: bool = True,
    stage_repeats: int = 5,
    peak: bool = True,
    peak_size: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> BenchReport:
    """Runs the chapter's benchmark: ``calls`` batch-1 calls of one MLP, every way there is.

    Rows (all on the same net, weights and input): ``h.eager``; Flax ``net.apply`` un-jitted;
    the same math in plain ``jax.numpy``, un-jitted; ``h(x)``; the floor, a
    ``jax.jit(f).lower(...).compile()`` executable called on pre-flattened params; the
    exported artifact loaded in JAX and in IREE (when :mod:`symjax_mlp.export` and IREE are
    available); PyTorch (``compare=("torch",)``); and all ``calls`` inputs in one compiled
    call, via ``vmap`` and as one batch.

    Eager rows run the ``calls`` calls once, in ``eager_chunks`` timed chunks (eager Flax
    costs milliseconds a call); the compiled rows run ``repeats`` repeats of ``calls``
    calls, interleaved.

    Args:
      calls: batch-1 calls per repeat (the chapter's 1000).
      repeats: repeats of each compiled row (min and median over them).
      eager_chunks: chunks the eager rows' ``calls`` calls are timed in (their repeats).
      sizes, in_features, activation: the net, ``mlp(sizes, activation=...)`` on
        ``(1, in_features)`` inputs.
      compare: other frameworks to add to the table: ``("torch",)``.
      artifact, iree, train_step: include those optional rows/sections when available.
      stage_repeats: repeats of the trace/lower/compile timing.
      peak, peak_size: also time an ``n x n`` ``jnp.dot`` (see :func:`measure_peak`), to say
        how close the batched call gets to this machine's matmul rate.
      seed: for the params and the input.
      progress: called with a status line as the run goes.

    Returns:
      A :class:`BenchReport`.

    Example:
      >>> r = benchmark(calls=10, repeats=2, eager_chunks=2, artifact=False, train_step=False)
      >>> r.rows[0].key, r.row("hybridized").timing.calls
      ('eager', 10)
    """
    from symjax_mlp.hybrid import hybridize
    from symjax_mlp.models import mlp

    bad = sorted(set(compare) - {"torch"})
    if bad:
        raise ValueError(f"--compare accepts only 'torch'; got {', '.join(bad)}.")
    if calls < 1 or repeats < 1 or eager_chunks < 1 or stage_repeats < 1:
        raise ValueError("calls, repeats, eager_chunks and stage_repeats must all be >= 1.")
    say = progress or (lambda _: None)
    env = environment()
    notes: list[str] = []
    extra: dict[str, Any] = {}
    net = mlp(tuple(sizes), activation=activation)
    rng = np.random.default_rng(seed)  # inputs from numpy: nothing to compile
    inputs = rng.standard_normal((calls, 1, in_features), dtype=np.float32)
    x, xs, xb = (jnp.asarray(a) for a in (inputs[0], inputs, inputs[:, 0]))
    variables = jax.jit(net.init)(jax.random.key(seed), x)  # one compile, not one per op

    # Stages first, on a fresh function: nothing has been traced or compiled yet.
    say("timing trace / lower / compile")
    stages = time_stages(net.apply, variables, x, repeats=stage_repeats)
    t0 = time.perf_counter()
    h = hybridize(net, variables)
    h(x).block_until_ready()
    stages["first_call"] = Timing("first_call", 1, (time.perf_counter() - t0,))

    # Eager: the chapter's "without" line is exactly `calls` calls, timed in chunks.
    chunk = max(1, calls // eager_chunks)
    pure = functools.partial(_mlp_fn, activation=activation)
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
    with tempfile.TemporaryDirectory(prefix="symjax_mlp_bench_") as tmp:
        if artifact:
            fast |= _artifact_rows(h, x, os.path.join(tmp, "mlp"), iree, notes, stages, say)
        if "torch" in compare:
            say("building the PyTorch twins (torch.compile takes a while)")
            try:
                tfns, tsyncs, restore_torch = _torch_rows(variables, x, activation, notes, stages)
            except (ImportError, ValueError) as e:
                notes.append(f"torch rows skipped: {type(e).__name__}: {e}")
            else:
                fast |= tfns
                syncs |= tsyncs
        try:
            compiled = time_interleaved(
                fast, calls=calls, repeats=repeats, syncs=syncs, progress=say
            )
        finally:
            restore_torch()

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
    base = timings["eager"].min / (timings["eager"].calls * timings["eager"].inputs_per_call)
    rows = []
    for key, t in timings.items():
        per_input = t.min / (t.calls * t.inputs_per_call)
        label = _LABELS.get(key, key).format(n=calls)
        rows.append(Row(key, label, t, base / per_input))
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
    }
    return BenchReport(
        without_s=sum(timings["eager"].times) * calls / (chunk * eager_chunks),
        with_s=timings["hybridized"].median,
        calls=calls,
        rows=tuple(rows),
        stages=stages,
        targets=_targets(timings),
        extra=extra,
        notes=tuple(notes),
        config=config,
        env=env,
    )


def _public(name: str) -> Callable[..., Any] | None:
    """``symjax_mlp.<name>`` if the package exports that function (optional sections)."""
    import symjax_mlp

    fn = getattr(symjax_mlp, name, None)
    return fn if callable(fn) else None


def _artifact_rows(
    h: Any, x: jax.Array, path: str, iree: bool, notes: list[str], stages: dict, say: Progress
) -> dict[str, Callable[[], Any]]:
    """The exported artifact, loaded back in JAX and (if installed) IREE, as timed rows."""
    export, load = _public("export"), _public("load")
    if export is None or load is None:
        notes.append("artifact rows skipped: symjax_mlp.export / symjax_mlp.load not available")
        return {}
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
    except Exception as e:
        notes.append(f"artifact (IREE) row skipped: {type(e).__name__}: {str(e)[:300]}")
    return fns


def _train_step_section(notes: list[str], say: Progress) -> dict[str, Any] | None:
    time_train_step = _public("time_train_step")
    if time_train_step is None:
        notes.append("train step section skipped: symjax_mlp.time_train_step not available")
        return None
    say("timing the training step, compiled and eager")
    try:
        return time_train_step()
    except Exception as e:
        notes.append(f"train step section skipped: {type(e).__name__}: {e}")
        return None


def _targets(t: Mapping[str, Timing]) -> dict[str, dict[str, Any]]:
    """The issue's targets, as measured (min over min); ``met`` is informative, never asserted."""

    def per_input(key: str) -> float:
        return t[key].min / (t[key].calls * t[key].inputs_per_call)

    out: dict[str, dict[str, Any]] = {}

    def add(name: str, value: float, target: float, higher_is_better: bool, what: str) -> None:
        met = value >= target if higher_is_better else value <= target
        op = ">=" if higher_is_better else "<="
        out[name] = {"value": value, "target": f"{op} {target:g}", "met": met, "what": what}

    hyb = per_input("hybridized")
    add("hybridized_vs_eager", per_input("eager") / hyb, 10, True, "speedup of h over h.eager")
    add("hybridized_over_floor", hyb / per_input("floor"), 1.15, False, "h per call / floor")
    if "artifact_jax" in t:
        add("artifact_over_hybridized", per_input("artifact_jax") / hyb, 1.3, False,
            "loaded artifact (JAX) per call / h")  # fmt: skip
    for key in ("vmap", "batch"):
        add(f"{key}_vs_single_calls", hyb / per_input(key), 10, True,
            f"single h calls / one {key} call over as many inputs")  # fmt: skip
    torch_keys = [k for k in ("torch_eager", "torch_script", "torch_compile") if k in t]
    if torch_keys:
        fastest = min(torch_keys, key=per_input)
        add("torch_fastest_over_hybridized", per_input(fastest) / hyb, 1, True,
            f"fastest PyTorch mode ({fastest}) per call / h; > 1 means h is faster")  # fmt: skip
    return out


# -- printing --------------------------------------------------------------------------------
def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def _meaning(report: BenchReport) -> list[str]:
    """What the figures say, in words, from this run's own numbers."""
    per = {r.key: r.timing.per_call_min for r in report.rows}
    n = report.calls
    e, j, hyb, floor = per["eager"], per["jnp_eager"], per["hybridized"], per["floor"]
    out = [
        f"what it means: eager, every call re-runs Python: Flax re-enters each module and checks "
        f"each param's shape, then dispatches each op ({_fmt_s(e)} a call); the same ops "
        f"dispatched one by one from plain jax.numpy cost {_fmt_s(j)}.",
        f"Hybridized, a call is one dispatch of one XLA executable: {_fmt_s(hyb)}, against "
        f"{_fmt_s(floor)} for the bare AOT executable (h's own Python adds "
        f"{_fmt_s(max(hyb - floor, 0.0))}).",
    ]
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
        out.append(
            f"As one batch it runs at {pk['batched_gflops']:.1f} GFLOP/s, "
            f"{pk['batched_gflops'] / pk['gflops']:.0%} of this machine's measured matmul rate "
            f"({pk['gflops']:.1f} GFLOP/s, best {pk['size']}² jnp.dot): it is compute-bound; at "
            f"that rate {n} inputs take {_fmt_s(bound)}, {hyb * n / bound:.1f}x less than {n} "
            "single calls here."
        )
    return out


def format_report(report: BenchReport) -> str:
    """The human-readable report: the chapter's two lines first, then the table and the rest."""
    n = report.calls
    lines = [
        f"Without hybridization: {report.without_s:.4f} sec",
        f"With hybridization: {report.with_s:.4f} sec",
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
    lines += ["", *_meaning(report)]
    lines += ["", "targets (measured in this run):"]
    for name, t in report.targets.items():
        mark = "met" if t["met"] else "MISSED"
        lines.append(f"  {name:<30} {t['value']:>8.2f}  (target {t['target']}) {mark}")
    e = report.env
    lines += [
        "",
        f"ran on: {e['backend']} / {e['device_kind']} ({e['device']}), {e['cpu_usable']} of "
        f"{e['cpu_count']} cores usable, load average {e.get('loadavg', ['?'])[0]:.2f} at start"
        if "loadavg" in e
        else f"ran on: {e['backend']} / {e['device_kind']} ({e['device']})",
        f"versions: jax {e['jax']}, jaxlib {e['jaxlib']}, flax {e['flax']}, "
        f"symjax_mlp {e['symjax_mlp']}, python {e['python']}",
    ]
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


# -- scaling ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """One (mode, batch size) point: throughput and achieved FLOP rate (from the min time)."""

    mode: str
    batch: int
    timing: Timing
    flops_per_call: int
    peak_gflops: float

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.timing.per_call_min

    @property
    def gflops(self) -> float:
        return self.flops_per_call / self.timing.per_call_min / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "batch": self.batch,
            "samples_per_s": self.samples_per_s,
            "gflops": self.gflops,
            "fraction_of_peak": self.gflops / self.peak_gflops,
            "flops_per_call": self.flops_per_call,
            **self.timing.to_dict(),
        }


@dataclasses.dataclass(frozen=True)
class SweepReport:
    """Throughput against batch size, for ``h`` and ``h.eager``, and the machine's matmul peak."""

    points: tuple[SweepPoint, ...]
    peak_gflops: float
    peak: Timing
    peak_size: int
    config: dict[str, Any]
    env: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak": {"gflops": self.peak_gflops, "size": self.peak_size, **self.peak.to_dict()},
            "points": [p.to_dict() for p in self.points],
            "config": self.config,
            "env": self.env,
        }


def measure_peak(
    n: int | Sequence[int] | None = None, *, repeats: int = 10
) -> tuple[float, int, Timing]:
    """The best achieved GFLOP/s of a float32 ``jnp.dot`` of two ``n x n`` matrices, compiled.

    ``n`` may be one size or several (the best rate wins); by default 512, 1024 and 2048 on
    CPU, 4096 and 8192 on accelerators. Each repeat lasts about 50 ms, and the rate is from
    the fastest: short repeats, many of them, so that a burst of load from elsewhere on a
    shared machine misses some.

    Returns:
      ``(gflops, n, timing)`` of the best size.

    Example:
      >>> gflops, n, t = measure_peak(64, repeats=2)
      >>> gflops > 0 and n == 64
      True
    """
    if n is None:
        n = (512, 1024, 2048) if jax.default_backend() == "cpu" else (4096, 8192)
    best: tuple[float, int, Timing] | None = None
    rng = np.random.default_rng(0)
    for size in (n,) if isinstance(n, int) else tuple(n):
        a, b = (jnp.asarray(rng.standard_normal((size, size), dtype=np.float32)) for _ in "ab")
        dot = jax.jit(jnp.dot).lower(a, b).compile()
        calls = _autorange(lambda dot=dot, a=a, b=b: dot(a, b), 0.05, 1000)
        t = time_calls(
            lambda dot=dot, a=a, b=b: dot(a, b),
            name=f"dot{size}",
            calls=calls,
            repeats=repeats,
            warmup=1,
        )
        rate = 2 * size**3 / t.per_call_min / 1e9
        if best is None or rate > best[0]:
            best = (rate, size, t)
    assert best is not None, "measure_peak needs at least one size"
    return best


def sweep(
    *,
    batch_sizes: Sequence[int] = tuple(2**i for i in range(17)),
    eager_max_batch: int = 4096,
    sizes: Sequence[int] = (256, 128, 2),
    in_features: int = 512,
    activation: str | None = "relu",
    repeats: int = 5,
    min_seconds: float = 0.05,
    peak_size: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> SweepReport:
    """Samples/s and GFLOP/s against batch size, hybridized and eager, and the matmul peak.

    Each point takes enough calls (a power of two) that a repeat lasts ``min_seconds``, then
    the min over ``repeats``. Eager runs only up to ``eager_max_batch``. FLOPs are counted on
    the jaxpr (:attr:`symjax_mlp.Graph.flops`): the dots, bias adds and activations.

    Example:
      >>> s = sweep(batch_sizes=(1, 2), eager_max_batch=1, repeats=1, min_seconds=0, peak_size=64)
      >>> [(p.mode, p.batch) for p in s.points]
      [('hybridized', 1), ('eager', 1), ('hybridized', 2)]
    """
    from symjax_mlp.hybrid import hybridize
    from symjax_mlp.models import mlp

    say = progress or (lambda _: None)
    say("measuring the matmul peak")
    peak_gflops, peak_n, peak = measure_peak(peak_size)
    net = mlp(tuple(sizes), activation=activation)
    rng = np.random.default_rng(seed)
    h = hybridize(net, jax.jit(net.init)(jax.random.key(seed), jnp.ones((1, in_features))))
    flops_per_sample = h.graph(jnp.ones((1, in_features), jnp.float32)).flops
    points = []
    for b in batch_sizes:
        x = jnp.asarray(rng.standard_normal((b, in_features), dtype=np.float32))
        modes = {"hybridized": lambda x=x: h(x)}
        if b <= eager_max_batch:
            modes["eager"] = lambda x=x: h.eager(x)
        for mode, fn in modes.items():
            say(f"sweep: {mode}, batch {b}")
            calls = _autorange(fn, min_seconds, 4096)
            t = time_calls(fn, name=f"{mode}@{b}", calls=calls, repeats=repeats, warmup=1)
            t = dataclasses.replace(t, inputs_per_call=b)
            points.append(SweepPoint(mode, b, t, flops_per_sample * b, peak_gflops))
    config = {
        "batch_sizes": list(batch_sizes),
        "eager_max_batch": eager_max_batch,
        "sizes": list(sizes),
        "in_features": in_features,
        "activation": activation,
        "repeats": repeats,
        "min_seconds": min_seconds,
    }
    # Measured again at the end: the peak is the better of the two (load drifts on a shared
    # machine); every point's fraction is against it.
    say("measuring the matmul peak again")
    again, again_n, peak2 = measure_peak(peak_size)
    if again > peak_gflops:
        peak_gflops, peak_n, peak = again, again_n, peak2
        points = [dataclasses.replace(p, peak_gflops=again) for p in points]
    return SweepReport(tuple(points), peak_gflops, peak, peak_n, config, environment())


def format_sweep(report: SweepReport) -> str:
    """The sweep as a table: samples/s, GFLOP/s and the fraction of the matmul peak."""
    lines = [
        f"matmul peak ({report.peak_size}x{report.peak_size} float32 dot): "
        f"{report.peak_gflops:.1f} GFLOP/s (the best jnp.dot rate measured in this run, not "
        "the hardware's; a point can pass it when its weights stay in cache)",
        f"{'batch':>7}{'mode':>12}{'per call':>11}{'samples/s':>13}{'GFLOP/s':>10}{'of peak':>9}",
    ]
    for p in report.points:
        lines.append(
            f"{p.batch:>7}{p.mode:>12}{_fmt_s(p.timing.per_call_min):>11}"
            f"{p.samples_per_s:>13.4g}{p.gflops:>10.2f}{p.gflops / report.peak_gflops:>9.1%}"
        )
    return "\n".join(lines)


def plot_sweep(report: SweepReport, path: str | os.PathLike[str]) -> str:
    """Writes the sweep as a PNG (needs matplotlib: ``symjax_mlp[plot]``); returns the path."""
    from matplotlib.figure import Figure  # optional extra; no pyplot, no global backend

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for mode, style in (("hybridized", "o-"), ("eager", "s--")):
        pts = [p for p in report.points if p.mode == mode]
        if pts:
            ax1.plot([p.batch for p in pts], [p.samples_per_s for p in pts], style, label=mode)
            ax2.plot([p.batch for p in pts], [p.gflops for p in pts], style, label=mode)
    peak = f"matmul peak {report.peak_gflops:.0f} GFLOP/s ({report.peak_size}² jnp.dot)"
    ax2.axhline(report.peak_gflops, color="k", ls=":", label=peak)
    for ax, ylabel in ((ax1, "samples / s"), (ax2, "achieved GFLOP/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    e = report.env
    fig.suptitle(f"mlp{tuple(report.config['sizes'])} on {e['backend']} / {e['device_kind']}")
    fig.savefig(path, dpi=110)
    return os.fspath(path)


# -- the entry point -------------------------------------------------------------------------
def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"--sizes must be comma-separated positive ints such as 256,128,2; got {text!r}"
        )
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the benchmark's options to ``parser`` (shared by the script and the CLI)."""
    a = parser.add_argument
    a("--calls", type=int, default=1000, help="batch-1 calls per repeat (default 1000)")
    a("--repeats", type=int, default=15, help="repeats of the compiled rows (default 15)")
    a("--eager-chunks", type=int, default=10, help="chunks the eager calls are timed in")
    a("--sizes", type=_sizes, default=(256, 128, 2), help="layer widths (default 256,128,2)")
    a("--in-features", type=int, default=512, help="input width (default 512)")
    a("--activation", default="relu", help="a jax.nn activation name (default relu)")
    a("--compare", action="append", default=[], choices=("torch",),
      help="add another framework's rows (torch: eager, jit.script, compile)")  # fmt: skip
    a("--stage-repeats", type=int, default=5, help="repeats of trace/lower/compile")
    a("--no-artifact", action="store_true", help="skip the exported-artifact rows")
    a("--no-iree", action="store_true", help="skip the IREE row")
    a("--no-train", action="store_true", help="skip the training-step section")
    a("--no-peak", action="store_true", help="skip the matmul-peak measurement")
    a("--sweep", action="store_true", help="also sweep batch sizes 1..--sweep-max")
    a("--sweep-max", type=int, default=65536, help="largest batch of the sweep (default 65536)")
    a("--sweep-eager-max", type=int, default=4096, help="largest eager batch (default 4096)")
    a("--sweep-out", default="bench_sweep", help="sweep writes PREFIX.json and PREFIX.png")
    a("--json", metavar="PATH", help="write every figure, with versions and device, as JSON")
    a("--quiet", action="store_true", help="no progress display on stderr")
    return parser


class _Progress:
    """Status lines on stderr: rewritten in place on a terminal, one per line otherwise."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.t0 = stream, time.perf_counter()
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def __call__(self, msg: str) -> None:
        line = f"[bench {time.perf_counter() - self.t0:6.1f}s] {msg}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:120])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Runs the benchmark from the command line (``scripts/bench.py``, ``symjax-mlp bench``).

    Prints the chapter's two lines first, then the table, the stages, the device and the
    targets; ``--sweep`` adds the batch-size sweep (JSON and PNG); ``--json`` writes it all.

    Args:
      args: parsed options (from :func:`add_arguments`), or argv to parse (``None``: sys.argv).

    Returns:
      The exit code, 0.
    """
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(
            prog="bench", description="The chapter's benchmark: eager vs hybridized and beyond."
        )
        args = add_arguments(parser).parse_args(args)
    progress = None if args.quiet else _Progress(sys.stderr)
    report = benchmark(
        calls=args.calls,
        repeats=args.repeats,
        eager_chunks=args.eager_chunks,
        sizes=args.sizes,
        in_features=args.in_features,
        activation=args.activation,
        compare=tuple(dict.fromkeys(args.compare)),
        artifact=not args.no_artifact,
        iree=not args.no_iree,
        train_step=not args.no_train,
        stage_repeats=args.stage_repeats,
        peak=not args.no_peak,
        progress=progress,
    )
    if progress:
        progress.done()
    print(format_report(report), flush=True)
    out = report.to_dict()
    if args.sweep:
        batches = tuple(b for b in (2**i for i in range(40)) if b <= args.sweep_max)
        sw = sweep(
            batch_sizes=batches,
            eager_max_batch=args.sweep_eager_max,
            sizes=args.sizes,
            in_features=args.in_features,
            activation=args.activation,
            progress=progress,
        )
        if progress:
            progress.done()
        out["sweep"] = sw.to_dict()
        print("\n" + format_sweep(sw))
        _write_json(sw.to_dict(), args.sweep_out + ".json")
        written = [args.sweep_out + ".json"]
        try:
            written.append(plot_sweep(sw, args.sweep_out + ".png"))
        except ImportError:
            print("note: matplotlib not installed; no plot (pip install symjax_mlp[plot])")
        print("wrote " + ", ".join(written))
    if args.json:
        _write_json(out, args.json)
        print(f"wrote {args.json}")
    return 0


def _write_json(obj: Any, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
