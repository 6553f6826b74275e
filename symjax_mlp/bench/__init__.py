"""The chapter's benchmark, measured honestly: eager vs hybridized vs the AOT floor and beyond.

Every timed call is synced, warmed up and repeated; compared rows are timed interleaved;
tracing, lowering and compiling are timed apart from steady-state calls. Results are frozen
(:class:`Timing`, :class:`BenchReport`, :class:`SweepReport`). Every timer of the project lives
in this package: the benchmark (:func:`benchmark`), the batch-size sweep (:func:`sweep`),
throughput against device count (:func:`bench_devices`), the training step
(:func:`time_train_step`) and serving (:func:`bench_serving`: latency per dispatch mode, the
micro-batcher, the HTTP server). The figures (:func:`plot_sweep`, :func:`plot_devices`,
:func:`plot_training`) are written as PNG and SVG; two runs' JSON (``"schema": 1``) are
compared row by row, noise told apart from a regression, by :func:`compare_runs`.
``scripts/bench.py`` and ``symjax-mlp bench`` drive them (``--quick`` for a first look).
"""

from symjax_mlp.bench._coldstart import bench_coldstart as bench_coldstart
from symjax_mlp.bench._coldstart import format_coldstart as format_coldstart
from symjax_mlp.bench._compare import RowChange as RowChange
from symjax_mlp.bench._compare import RunComparison as RunComparison
from symjax_mlp.bench._compare import compare_runs as compare_runs
from symjax_mlp.bench._compare import format_comparison as format_comparison
from symjax_mlp.bench._devices import CPU_NOTE as CPU_NOTE
from symjax_mlp.bench._devices import bench_devices as bench_devices
from symjax_mlp.bench._figures import plot_devices as plot_devices
from symjax_mlp.bench._figures import plot_sweep as plot_sweep
from symjax_mlp.bench._figures import plot_training as plot_training
from symjax_mlp.bench._report import BenchReport as BenchReport
from symjax_mlp.bench._report import Row as Row
from symjax_mlp.bench._report import format_report as format_report
from symjax_mlp.bench._run import benchmark as benchmark
from symjax_mlp.bench._scaling import SweepPoint as SweepPoint
from symjax_mlp.bench._scaling import SweepReport as SweepReport
from symjax_mlp.bench._scaling import format_devices as format_devices
from symjax_mlp.bench._scaling import format_sweep as format_sweep
from symjax_mlp.bench._scaling import measure_peak as measure_peak
from symjax_mlp.bench._scaling import sweep as sweep
from symjax_mlp.bench._serving import bench_serving as bench_serving
from symjax_mlp.bench._serving import format_serving as format_serving
from symjax_mlp.bench._stateful import bench_stateful as bench_stateful
from symjax_mlp.bench._stateful import format_stateful as format_stateful
from symjax_mlp.bench._timing import Timing as Timing
from symjax_mlp.bench._timing import environment as environment
from symjax_mlp.bench._timing import time_calls as time_calls
from symjax_mlp.bench._timing import time_interleaved as time_interleaved
from symjax_mlp.bench._timing import time_stages as time_stages
from symjax_mlp.bench._train_step import time_train_step as time_train_step

__all__ = [
    "CPU_NOTE",
    "BenchReport",
    "Row",
    "RowChange",
    "RunComparison",
    "SweepPoint",
    "SweepReport",
    "Timing",
    "bench_coldstart",
    "bench_devices",
    "bench_serving",
    "bench_stateful",
    "benchmark",
    "compare_runs",
    "environment",
    "format_coldstart",
    "format_comparison",
    "format_devices",
    "format_report",
    "format_serving",
    "format_stateful",
    "format_sweep",
    "measure_peak",
    "plot_devices",
    "plot_sweep",
    "plot_training",
    "sweep",
    "time_calls",
    "time_interleaved",
    "time_stages",
    "time_train_step",
]
