"""What every figure of the lab shares: how it is drawn, labelled and written.

matplotlib (``pip install 'symjax_mlp[plot]'``) imported without pyplot
(:func:`matplotlib_parts`: no global state, no display needed); each figure written once per
format, an SVG keeping its text as text (:func:`save`); log axes with units on the ticks
(:func:`log2_x`, :func:`log_y`, and the tick labels :func:`seconds_tick`,
:func:`count_tick`); the caption under the axes, naming the machine and the versions
(:func:`caption`, :func:`machine_line`, :func:`versions_line`). The figures themselves are
:mod:`benchmarks.figures`'.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from symjax_mlp import ConfigError

_IMAGE_SUFFIXES = {".png", ".svg", ".pdf", ".jpg", ".jpeg"}


def _paths(path: str | os.PathLike[str], formats: Sequence[str]) -> list[Path]:
    """``out/sweep`` or ``out/sweep.png`` -> ``out/sweep.png``, ``out/sweep.svg``."""
    if not formats:
        raise ConfigError("a figure needs at least one format, e.g. formats=('png', 'svg').")
    p = Path(path)
    stem = p.with_suffix("") if p.suffix.lower() in _IMAGE_SUFFIXES else p
    return [stem.with_name(f"{stem.name}.{f.lstrip('.')}") for f in formats]


def save(fig: Any, path: str | os.PathLike[str], formats: Sequence[str]) -> tuple[str, ...]:
    """Writes ``fig`` once per format; an SVG keeps its text as text (searchable, editable)."""
    from matplotlib import rc_context

    written = []
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "symjax_mlp"}):
        for p in _paths(path, formats):
            fig.savefig(p, dpi=120)
            written.append(os.fspath(p))
    return tuple(written)


def matplotlib_parts() -> tuple[Any, Any, Any]:
    """matplotlib's ``Figure``, ``ticker`` and ``HandlerTuple``, without pyplot."""
    from matplotlib import ticker  # optional extra (symjax_mlp[plot]); no pyplot
    from matplotlib.figure import Figure
    from matplotlib.legend_handler import HandlerTuple

    return Figure, ticker, HandlerTuple


def machine_line(env: Mapping[str, Any]) -> str:
    """One line: the CPU, its cores, the JAX backend and device."""
    cpu = env.get("cpu_model") or env.get("processor") or "unknown CPU"
    cores = f"{env.get('cpu_usable', '?')} of {env.get('cpu_count', '?')} cores usable"
    return f"machine: {cpu}, {cores}; JAX backend {env.get('backend')} ({env.get('device')})"


def versions_line(env: Mapping[str, Any]) -> str:
    keys = ("jax", "jaxlib", "flax", "symjax_mlp", "python")
    text = ", ".join(f"{k} {env[k]}" for k in keys if env.get(k))
    return f"versions: {text}" + (f"; run {env['time']}" if env.get("time") else "")


def caption(fig: Any, lines: Sequence[str]) -> None:
    """The caption under the axes, left-aligned, small, each line wrapped to the figure's width
    (constrained layout makes room for it)."""
    width = int(fig.get_figwidth() * 14)  # characters of 8 pt text per line, with a margin
    wrapped = [part for line in lines for part in _wrap(line, width)]
    fig.supxlabel("\n".join(wrapped), x=0.01, ha="left", fontsize=8, linespacing=1.5)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]


def _si(v: float) -> str:
    """1 -> '1', 1024 -> '1k', 65536 -> '64k': batch sizes and device counts on a tick."""
    if v >= 1 << 20 and v % (1 << 20) == 0:
        return f"{int(v) >> 20}M"
    if v >= 1024 and v % 1024 == 0:
        return f"{int(v) >> 10}k"
    return f"{v:g}"


def seconds_tick(v: float) -> str:
    """A tick of a log axis in seconds: '1 µs', '10 ms', '1 s'."""
    if v <= 0:
        return ""
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")):
        if v >= scale * 0.999:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0e} s"


def log2_x(ax: Any, ticker: Any, values: Sequence[int]) -> None:
    """A log2 x axis with a labelled tick at every power of two (every other, when many)."""
    lo, hi = min(values), max(values)
    ax.set_xscale("log", base=2)
    powers = [2**i for i in range(int(math.log2(lo)), int(math.log2(hi)) + 1)]
    step = 1 if len(powers) <= 9 else 2
    ax.xaxis.set_major_locator(ticker.FixedLocator(powers[::step]))
    ax.xaxis.set_minor_locator(ticker.FixedLocator(powers))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: _si(v)))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    pad = 2**0.3
    ax.set_xlim(lo / pad, hi * pad)


def log_y(ax: Any, ticker: Any, fmt: Any, values: Sequence[float]) -> None:
    """A log y axis labelled by ``fmt``: decades only over a wide range, more ticks over a
    narrow one (so that a range within one decade still has labelled ticks)."""
    positive = [v for v in values if v > 0]
    decades = math.log10(max(positive) / min(positive)) if positive else 3.0
    if decades > 2.5:
        subs: tuple[float, ...] = (1.0,)
    elif decades > 0.8:
        subs = (1.0, 2.0, 5.0)
    else:
        subs = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=subs, numticks=40))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: fmt(v)))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def count_tick(v: float) -> str:
    """150000 -> '150k', 2e6 -> '2M', 0.5 -> '0.5': a rate on a tick."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.3g}"
