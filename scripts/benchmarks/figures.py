"""The benchmark's figures, drawn to be read like a paper's.

Log axes with units on the ticks, the machine's limits drawn as lines, the spread over repeats
as a band, and a caption that says what was measured, on which machine, with which versions.
Each function draws its figure once and writes it in every format asked (PNG and SVG by
default) next to ``path``, and returns the paths written.

:func:`plot_sweep` draws a :func:`sweep`, :func:`plot_devices` the result
of :func:`bench_devices`, :func:`plot_training` the history of
:func:`symjax_mlp.training.train`. matplotlib (``pip install 'symjax_mlp[plot]'``) is imported
only when a figure is drawn, and without pyplot: no global state, no display needed. What the
figures share (the axes, the ticks, the caption, the files) is :mod:`benchmarks.plotting`'s.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.devices import CPU_NOTE
from benchmarks.plotting import (
    caption,
    count_tick,
    log2_x,
    log_y,
    machine_line,
    matplotlib_parts,
    save,
    seconds_tick,
    versions_line,
)
from benchmarks.scaling import SweepReport
from benchmarks.timing import environment
from symjax_mlp import ConfigError

#: The formats every figure is written in, by default.
FORMATS = ("png", "svg")
_MODE_STYLE = {"hybridized": ("C0", "o"), "eager": ("C3", "s")}


def plot_sweep(
    report: SweepReport, path: str | os.PathLike[str], *, formats: Sequence[str] = FORMATS
) -> tuple[str, ...]:
    """Draws a :func:`sweep` as two panels; returns the files written.

    Left: seconds per example against batch size, log-log, with the compute floor (one
    example's FLOPs at the measured matmul rate) as a dashed line. Right: the achieved
    GFLOP/s, with the measured matmul rate as a dashed line. Each mode's solid line is the
    fastest repeat, its dotted line the median repeat, the band between them the spread. The
    caption names the machine (CPU model, cores), the versions and the repeats.

    Args:
      report: the sweep.
      path: where to write: ``out/sweep`` or ``out/sweep.png`` both give ``out/sweep.png``
        and ``out/sweep.svg`` (one file per entry of ``formats``).
      formats: file formats, by suffix: ``("png", "svg")``, ``("pdf",)``, ...

    Returns:
      The paths written, one per format.

    Raises:
      ConfigError: the sweep has fewer than two batch sizes (a point, not a curve).
      ImportError: matplotlib is not installed (``pip install 'symjax_mlp[plot]'``).
    """
    batches = sorted({p.batch for p in report.points})
    if len(batches) < 2:
        raise ConfigError(
            f"plot_sweep: the sweep has {len(batches)} batch size(s) {batches}; a curve needs "
            "at least 2. Sweep a range, e.g. batch_sizes=(1, 16, 256)."
        )
    Figure, ticker, HandlerTuple = matplotlib_parts()
    fig = Figure(figsize=(12, 6), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=(1, 14))
    key = fig.add_subplot(grid[0, :])  # the shared legend, between the title and the panels
    key.axis("off")
    ax_t, ax_r = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    handles: list[tuple[Any, str]] = []
    for mode in dict.fromkeys(p.mode for p in report.points):
        pts = sorted((p for p in report.points if p.mode == mode), key=lambda p: p.batch)
        color, marker = _MODE_STYLE.get(mode, ("C2", "^"))
        b = [p.batch for p in pts]
        per_example = [p.seconds_per_example for p in pts]
        per_example_median = [p.seconds_per_example_median for p in pts]
        for ax, lo, med in (
            (ax_t, per_example, per_example_median),
            (ax_r, [p.gflops for p in pts], [p.gflops_median for p in pts]),
        ):
            band = ax.fill_between(b, lo, med, color=color, alpha=0.22, lw=0)
            (line,) = ax.plot(b, lo, "-", marker=marker, ms=4.5, color=color, lw=1.6)
            (dots,) = ax.plot(b, med, ":", color=color, lw=1.2)
        handles += [(line, f"{mode}: fastest repeat"), ((band, dots), f"{mode}: median (shaded)")]
    # The machine's limits: dashed lines, labelled on the line (left end, clear of the data).
    floor = report.floor_seconds_per_example
    ax_t.axhline(floor, color="k", ls="--", lw=1.1)
    ax_t.annotate(
        f"compute floor: {seconds_tick(floor)} per example",
        xy=(0.015, floor), xycoords=("axes fraction", "data"), xytext=(0, 3),
        textcoords="offset points", va="bottom", fontsize=8,
    )  # fmt: skip
    ax_r.axhline(report.peak_gflops, color="k", ls="--", lw=1.1)
    ax_r.annotate(
        f"measured matmul rate {report.peak_gflops:.3g} GFLOP/s",
        xy=(0.015, report.peak_gflops), xycoords=("axes fraction", "data"), xytext=(0, -3),
        textcoords="offset points", va="top", fontsize=8,
    )  # fmt: skip
    for ax in (ax_t, ax_r):
        log2_x(ax, ticker, batches)
        ax.set_xlabel("batch size (examples per call, log scale)")
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", axis="x", alpha=0.12)
    hs, labels = zip(*handles, strict=True)
    key.legend(hs, labels, loc="center", ncol=len(labels), fontsize=9, frameon=False,
               handler_map={tuple: HandlerTuple(ndivide=None)})  # fmt: skip
    times = [
        t for p in report.points for t in (p.seconds_per_example, p.seconds_per_example_median)
    ]
    rates = [r for p in report.points for r in (p.gflops, p.gflops_median)]
    log_y(ax_t, ticker, seconds_tick, [*times, floor])
    log_y(ax_r, ticker, lambda v: f"{v:g}", [*rates, report.peak_gflops])
    ax_t.set_ylabel("seconds per example (log scale)")
    ax_t.set_title("time per example (lower is better)", fontsize=10)
    ax_r.set_ylabel("achieved GFLOP/s (log scale)")
    ax_r.set_title("achieved FLOP rate (higher is better)", fontsize=10)
    c, e = report.config, report.env
    fig.suptitle(
        f"mlp{tuple(c['sizes'])} on {c['in_features']} float32 features: "
        "throughput against batch size",
        fontsize=12,
    )
    caption(
        fig,
        [
            f"Each point: the fastest (solid) and the median (dotted) of {c['repeats']} repeats, "
            "shaded between; each repeat "
            f">= {c['min_seconds'] * 1e3:g} ms of calls (a power of two, every call synced). Eager "
            f"up to batch {c['eager_max_batch']}. FLOPs counted on the jaxpr.",
            f"Dashed: the matmul rate, the best {report.peak_size}x{report.peak_size} float32 "
            "jnp.dot measured in this run (not the hardware's peak; a point can pass it when its "
            "weights stay in cache), and the compute floor, one example's "
            f"{report.flops_per_example:.3g} FLOPs at that rate.",
            machine_line(e),
            versions_line(e),
        ],
    )
    return save(fig, path, formats)


def plot_devices(
    result: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    env: Mapping[str, Any] | None = None,
    formats: Sequence[str] = FORMATS,
) -> tuple[str, ...]:
    """Draws :func:`bench_devices`: examples/s against device count.

    Inference and training throughput, log-log, with each one's ideal linear scaling from the
    1-device point as a dashed line. On virtual CPU devices the figure says, on the axes and
    in the caption, that it shows correctness, not scaling (:data:`CPU_NOTE`).

    Args:
      result: what :func:`bench_devices` returned (or its JSON).
      path, formats: as :func:`plot_sweep`.
      env: :func:`environment` of the run (default: this process's).

    Returns:
      The paths written, one per format.
    """
    rows = sorted(result["rows"], key=lambda r: r["devices"])
    if not rows:
        raise ConfigError("plot_devices: the result has no rows; run bench_devices(n) first.")
    Figure, ticker, _ = matplotlib_parts()
    env = environment() if env is None else env
    fig = Figure(figsize=(10, 5.6), layout="constrained")
    ax = fig.add_subplot()
    counts = [r["devices"] for r in rows]
    for key, label, color, marker in (
        ("inference_examples_per_s", "inference (sharded forward)", "C0", "o"),
        ("train_examples_per_s", "training (sharded step)", "C1", "s"),
    ):
        ys = [r[key] for r in rows]
        ax.plot(counts, ys, "-", marker=marker, color=color, lw=1.6, label=label)
        if len(counts) > 1:
            ax.plot(counts, [ys[0] * k / counts[0] for k in counts], "--", color=color,
                    lw=1, alpha=0.6, label=f"{label.split()[0]}: ideal linear scaling")  # fmt: skip
    log2_x(ax, ticker, counts)
    ax.xaxis.set_major_locator(ticker.FixedLocator(counts))
    rates = [r[k] for r in rows for k in ("inference_examples_per_s", "train_examples_per_s")]
    ideal = [r * counts[-1] / counts[0] for r in rates[:2]]
    log_y(ax, ticker, count_tick, [*rates, *ideal])
    ax.set_xlabel("devices (log scale)")
    ax.set_ylabel("examples per second (log scale)")
    ax.grid(True, which="major", alpha=0.35)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), framealpha=0.9)
    virtual = bool(result.get("virtual_cpu_devices"))
    if virtual:
        ax.text(1.02, 0.0, "virtual CPU devices\nshare the host's cores:\nthis shows correctness,\n"
                "not scaling", transform=ax.transAxes, va="bottom", ha="left", fontsize=9,
                bbox={"boxstyle": "round", "fc": "#fff3cd", "ec": "#c9a227"})  # fmt: skip
    ok = all(r.get("matches_1_device") for r in rows)
    fig.suptitle(
        f"mlp{tuple(result['sizes'])} on {result['in_features']} features, global batch "
        f"{result['batch']}: throughput against device count",
        fontsize=11,
    )
    ax.set_title(
        f"every device count {'matches' if ok else 'does NOT match'} the 1-device result",
        fontsize=9,
    )
    note = CPU_NOTE if virtual else result.get("note", "")
    caption(
        fig,
        [
            f"Inference: {result.get('repeats', '?')} calls; training: "
            f"{result.get('train_steps', '?')} steps after the compile; backend "
            f"{result.get('backend')} / {result.get('device_kind')}.",
            f"Note: {note}",
            machine_line(env),
            versions_line(env),
        ],
    )
    return save(fig, path, formats)


def _history(result_or_history: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the epochs as dicts, the run's summary) from a TrainResult, its dict, or a history."""
    summary: dict[str, Any] = {}
    h = result_or_history
    if hasattr(h, "history") and hasattr(h, "to_dict"):  # a TrainResult
        summary, h = h.to_dict(), h.history
    elif isinstance(h, Mapping):  # TrainResult.to_dict(), or `symjax-mlp train --json`
        summary, h = dict(h), h.get("history", ())
    epochs = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r) for r in h]
    need = {"epoch", "loss", "train_accuracy", "test_accuracy"}
    if not epochs or not all(need <= set(r) for r in epochs):
        raise ConfigError(
            "plot_training: pass a TrainResult, its to_dict(), or its history (EpochRecords "
            f"with {', '.join(sorted(need))}); got {len(epochs)} epoch(s)"
            + ("" if epochs else ": nothing to plot (epochs=0?)")
            + "."
        )
    return epochs, summary


def plot_training(
    result_or_history: Any,
    path: str | os.PathLike[str],
    *,
    env: Mapping[str, Any] | None = None,
    formats: Sequence[str] = FORMATS,
) -> tuple[str, ...]:
    """Draws a training run: mean loss and accuracy per epoch, from its history.

    Left: the mean training loss per epoch (cross-entropy, log scale). Right: train and test
    accuracy per epoch, in percent. The caption gives the final test accuracy, steps, time,
    compiled or eager, the machine and the versions.

    Args:
      result_or_history: what :func:`symjax_mlp.training.train` returned, its ``to_dict()``
        (the JSON of ``symjax-mlp train --json``), or its ``history`` (a sequence of
        :class:`~symjax_mlp.training.EpochRecord` or their dicts).
      path, formats: as :func:`plot_sweep`.
      env: :func:`environment` of the run (default: this process's).

    Returns:
      The paths written, one per format.

    Raises:
      ConfigError: the history is empty or not a training history.
    """
    epochs, summary = _history(result_or_history)
    Figure, ticker, _ = matplotlib_parts()
    env = environment() if env is None else env
    fig = Figure(figsize=(11, 4.8), layout="constrained")
    ax_l, ax_a = fig.subplots(1, 2)
    xs = [r["epoch"] for r in epochs]
    ax_l.plot(xs, [r["loss"] for r in epochs], "-o", ms=3.5, color="C0", label="training loss")
    log_y(ax_l, ticker, lambda v: f"{v:g}", [r["loss"] for r in epochs])
    ax_l.set_ylabel("mean training loss per epoch\n(cross-entropy, log scale)")
    ax_l.set_title("loss (lower is better)", fontsize=10)
    for key, label, color, marker in (
        ("train_accuracy", "train split", "C0", "o"),
        ("test_accuracy", "test split", "C1", "s"),
    ):
        ax_a.plot(xs, [100 * r[key] for r in epochs], "-", marker=marker, ms=3.5, color=color,
                  label=label)  # fmt: skip
    ax_a.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
    ax_a.set_ylabel("accuracy after the epoch (%)")
    ax_a.set_title("accuracy (higher is better)", fontsize=10)
    ax_a.legend(fontsize=9, loc="lower right")
    for ax in (ax_l, ax_a):
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True, nbins=10))
        ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
        ax.grid(True, alpha=0.35)
    last = epochs[-1]
    fig.suptitle(
        f"training: {len(epochs)} epoch{'s' if len(epochs) != 1 else ''}, final test accuracy "
        f"{summary.get('test_accuracy', last['test_accuracy']):.2%}",
        fontsize=12,
    )
    how = []
    if "step" in summary:
        how.append(f"{summary['step']} steps")
    if "compiled" in summary:
        how.append("compiled step (jit)" if summary["compiled"] else "eager step")
    if "train_seconds" in summary:
        how.append(f"{summary['train_seconds']:.1f} s in all")
    elif all("seconds" in r for r in epochs):
        how.append(f"{sum(r['seconds'] for r in epochs):.1f} s of epochs")
    caption(
        fig,
        [
            "Loss: mean over the epoch's batches; accuracy: evaluated after each epoch"
            + (f"; {', '.join(how)}." if how else "."),
            machine_line(env),
            versions_line(env),
        ],
    )
    return save(fig, path, formats)
