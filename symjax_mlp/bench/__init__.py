"""The chapter's benchmark, measured honestly: eager vs hybridized vs the AOT floor and beyond.

Every timed call is synced, warmed up and repeated; compared rows are timed interleaved;
tracing, lowering and compiling are timed apart from steady-state calls. Results are frozen
(:class:`Timing`, :class:`BenchReport`, :class:`SweepReport`); :func:`main` is the one entry
point of ``scripts/bench.py`` and of ``symjax-mlp bench``.

Modules: ``timing`` (the timer and :func:`environment`), ``run`` (:func:`benchmark`),
``report`` (its rows, targets and text), ``twins`` (the net in plain jax.numpy and PyTorch),
``scaling`` (against batch size, matmul peak and device count), ``cli`` (the options).
"""

from symjax_mlp.bench.cli import add_arguments, main
from symjax_mlp.bench.report import BenchReport, Row, format_report
from symjax_mlp.bench.run import benchmark
from symjax_mlp.bench.scaling import (
    SweepPoint,
    SweepReport,
    format_devices,
    format_sweep,
    measure_peak,
    plot_sweep,
    sweep,
)
from symjax_mlp.bench.timing import Timing, environment, time_calls, time_interleaved, time_stages

__all__ = [
    "BenchReport",
    "Row",
    "SweepPoint",
    "SweepReport",
    "Timing",
    "add_arguments",
    "benchmark",
    "environment",
    "format_devices",
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
