"""The chapter's benchmark, measured honestly: eager vs hybridized vs the AOT floor and beyond.

Every timed call is synced, warmed up and repeated; compared rows are timed interleaved;
tracing, lowering and compiling are timed apart from steady-state calls. Results are frozen
(:class:`Timing`, :class:`BenchReport`, :class:`SweepReport`). Every timer of the project lives
in this package: the benchmark (:func:`benchmark`), the batch-size sweep (:func:`sweep`),
throughput against device count (:func:`bench_devices`) and the training step
(:func:`time_train_step`). ``scripts/bench.py`` and ``symjax-mlp bench`` drive them.
"""

from symjax_mlp.bench._devices import CPU_NOTE as CPU_NOTE
from symjax_mlp.bench._devices import bench_devices as bench_devices
from symjax_mlp.bench._report import BenchReport as BenchReport
from symjax_mlp.bench._report import Row as Row
from symjax_mlp.bench._report import format_report as format_report
from symjax_mlp.bench._run import benchmark as benchmark
from symjax_mlp.bench._scaling import SweepPoint as SweepPoint
from symjax_mlp.bench._scaling import SweepReport as SweepReport
from symjax_mlp.bench._scaling import format_devices as format_devices
from symjax_mlp.bench._scaling import format_sweep as format_sweep
from symjax_mlp.bench._scaling import measure_peak as measure_peak
from symjax_mlp.bench._scaling import plot_sweep as plot_sweep
from symjax_mlp.bench._scaling import sweep as sweep
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
    "SweepPoint",
    "SweepReport",
    "Timing",
    "bench_devices",
    "benchmark",
    "environment",
    "format_devices",
    "format_report",
    "format_sweep",
    "measure_peak",
    "plot_sweep",
    "sweep",
    "time_calls",
    "time_interleaved",
    "time_stages",
    "time_train_step",
]
