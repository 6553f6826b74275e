"""Throughput as the work grows: against batch size (:func:`sweep`), against the machine's
matmul rate (:func:`measure_peak`), and against device count (:func:`format_devices`, the
table of :func:`bench_devices`).

Each point takes enough calls (a power of two) that a repeat lasts a set time, then the min
over repeats (and the median, for the noise band). The figures are drawn by
:mod:`benchmarks.figures` (:func:`plot_sweep`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import SCHEMA
from benchmarks.timing import Progress, Timing, environment, time_autoranged
from benchmarks.timing import format_seconds as _fmt_s
from symjax_mlp import ConfigError, hybridize, mlp


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

    @property
    def gflops_median(self) -> float:
        """The FLOP rate at the median repeat (the low end of the spread band)."""
        return self.flops_per_call / self.timing.per_call_median / 1e9

    @property
    def seconds_per_example(self) -> float:
        """Seconds per example at the fastest repeat."""
        return self.timing.per_call_min / self.batch

    @property
    def seconds_per_example_median(self) -> float:
        """Seconds per example at the median repeat."""
        return self.timing.per_call_median / self.batch

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "batch": self.batch,
            "samples_per_s": self.samples_per_s,
            "seconds_per_example_min": self.seconds_per_example,
            "seconds_per_example_median": self.seconds_per_example_median,
            "gflops": self.gflops,
            "gflops_median": self.gflops_median,
            "fraction_of_peak": self.gflops / self.peak_gflops,
            "flops_per_call": self.flops_per_call,
            **self.timing.to_dict(),
        }


@dataclasses.dataclass(frozen=True)
class SweepReport:
    """Throughput against batch size, for ``h`` and ``h.eager``, and the machine's matmul peak.

    ``to_dict()`` is its JSON (``"schema": 1``, as the benchmark's): ``peak``, ``points`` (one
    :meth:`SweepPoint.to_dict` each), ``config`` and ``env``.
    """

    points: tuple[SweepPoint, ...]
    peak_gflops: float
    peak: Timing
    peak_size: int
    config: dict[str, Any]
    env: dict[str, Any]

    @property
    def flops_per_example(self) -> float:
        """FLOPs of one example (the same at every batch size)."""
        p = self.points[0]
        return p.flops_per_call / p.batch

    @property
    def floor_seconds_per_example(self) -> float:
        """The compute floor: one example's FLOPs at the measured matmul rate."""
        return self.flops_per_example / (self.peak_gflops * 1e9)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "floor_seconds_per_example": self.floor_seconds_per_example,
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
        t = time_autoranged(
            lambda dot=dot, a=a, b=b: dot(a, b),
            name=f"dot{size}",
            min_seconds=0.05,
            max_calls=1000,
            repeats=repeats,
        )
        rate = 2 * size**3 / t.per_call_min / 1e9
        if best is None or rate > best[0]:
            best = (rate, size, t)
    if best is None:
        raise ConfigError(f"measure_peak(n={n!r}): pass at least one matrix size, e.g. n=1024.")
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
    peak_size: int | Sequence[int] | None = None,
    peak_repeats: int = 10,
    seed: int = 0,
    progress: Progress | None = None,
) -> SweepReport:
    """Samples/s and GFLOP/s against batch size, hybridized and eager, and the matmul peak.

    Each point takes enough calls (a power of two) that a repeat lasts ``min_seconds``, then
    the min and the median over ``repeats``. Eager runs only up to ``eager_max_batch``. FLOPs
    are counted on the jaxpr (:attr:`symjax_mlp.Graph.flops`): the dots, bias adds and
    activations. The peak is :func:`measure_peak` (``peak_size``, ``peak_repeats``), measured
    before and after the points; the better of the two counts.

    Raises:
      ConfigError: ``batch_sizes`` is empty, or holds a size < 1 or a duplicate.

    Example:
      >>> s = sweep(batch_sizes=(1, 2), eager_max_batch=1, repeats=1, min_seconds=0, peak_size=64)
      >>> [(p.mode, p.batch) for p in s.points]
      [('hybridized', 1), ('eager', 1), ('hybridized', 2)]
    """
    batch_sizes = tuple(batch_sizes)
    if not batch_sizes or min(batch_sizes) < 1 or len(set(batch_sizes)) != len(batch_sizes):
        raise ConfigError(
            f"sweep(batch_sizes={batch_sizes!r}): pass distinct batch sizes >= 1, "
            "e.g. (1, 16, 256)."
        )
    if repeats < 1 or peak_repeats < 1:
        raise ConfigError(
            f"sweep: repeats and peak_repeats must be >= 1; got {repeats}, {peak_repeats}."
        )
    say = progress or (lambda _: None)
    say("measuring the matmul peak")
    peak_gflops, peak_n, peak = measure_peak(peak_size, repeats=peak_repeats)
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
            t = time_autoranged(
                fn, name=f"{mode}@{b}", min_seconds=min_seconds, max_calls=4096, repeats=repeats
            )
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
        "peak_repeats": peak_repeats,
    }
    # Measured again at the end: the peak is the better of the two (load drifts on a shared
    # machine); every point's fraction is against it.
    say("measuring the matmul peak again")
    again, again_n, peak2 = measure_peak(peak_size, repeats=peak_repeats)
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
        f"compute floor: {_fmt_s(report.floor_seconds_per_example)} per example "
        f"({report.flops_per_example:.4g} FLOPs at that rate)",
        f"{'batch':>7}{'mode':>12}{'per call':>11}{'per example':>13}{'median':>11}"
        f"{'samples/s':>13}{'GFLOP/s':>10}{'of peak':>9}",
    ]
    for p in report.points:
        lines.append(
            f"{p.batch:>7}{p.mode:>12}{_fmt_s(p.timing.per_call_min):>11}"
            f"{_fmt_s(p.seconds_per_example):>13}{_fmt_s(p.seconds_per_example_median):>11}"
            f"{p.samples_per_s:>13.4g}{p.gflops:>10.2f}{p.gflops / report.peak_gflops:>9.1%}"
        )
    lines.append(
        f"(min over {report.config['repeats']} repeats; median: the median repeat, per example)"
    )
    return "\n".join(lines)


def format_devices(result: Mapping[str, Any]) -> str:
    """The result of :func:`bench_devices` as a table, throughput against device
    count, followed by its note (on virtual CPU devices: correctness only, not scaling).

    Example:
      >>> from benchmarks.devices import bench_devices
      >>> from benchmarks.scaling import format_devices
      >>> result = bench_devices(1, sizes=(8, 2), in_features=4, batch=8, repeats=1, train_steps=1)
      >>> print(format_devices(result).splitlines()[0])  # doctest: +ELLIPSIS
      throughput against device count (global batch 8, mlp(8, 2) on 4 features; ...
    """
    where = f"{result['backend']} / {result['device_kind']}"
    if result.get("virtual_cpu_devices"):
        n = result["n_devices"]
        where += f", {n} virtual CPU device{'s' if n > 1 else ''}"
        where += " in a subprocess" if result.get("in_subprocess") else ""
    lines = [
        f"throughput against device count (global batch {result['batch']}, "
        f"mlp{tuple(result['sizes'])} on {result['in_features']} features; {where}):",
        f"{'devices':>8}{'inference ex/s':>16}{'train ex/s':>13}{'speedup':>9}{'compile':>11}"
        f"{'max |diff|':>12}  matches 1 device",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['devices']:>8}{r['inference_examples_per_s']:>16.4g}"
            f"{r['train_examples_per_s']:>13.4g}{r['inference_speedup']:>8.2f}x"
            f"{_fmt_s(r['compile_seconds']):>11}{r['max_abs_diff']:>12.1e}  "
            f"{'yes' if r['matches_1_device'] else 'NO'}"
        )
    lines.append(f"note: {result['note']}")
    return "\n".join(lines)
