"""Two benchmark runs, row by row: a regression told apart from noise.

:func:`compare_runs` reads two JSON files written by ``python scripts/bench.py --json`` (or a
sweep's ``PREFIX.json``, or their dicts) and, for every row, stage and sweep point both hold, gives
the ratio new / old of the time per input at the fastest repeat, and the noise band of the
two runs: each figure's spread (median repeat / fastest repeat - 1), the larger of the two,
at least ``min_noise``. A ratio beyond the band is flagged ``slower`` or ``faster``; inside
it, ``noise``; a figure of one repeat has no spread, so its change is ``unknown``.
``python scripts/bench.py --diff OLD.json NEW.json`` prints :func:`format_comparison`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.report import SCHEMA
from benchmarks.timing import format_seconds as _fmt_s
from symjax_mlp import ConfigError

#: The smallest noise band: two runs of one binary rarely agree better than this.
MIN_NOISE = 0.02
#: Decimals a ratio is printed with; its verdict is decided on the same rounded value.
RATIO_DECIMALS = 3
_CONFIG_KEYS = ("calls", "repeats", "sizes", "in_features", "activation", "quick", "batch_sizes")
_ENV_KEYS = ("cpu_model", "backend", "device_kind", "cpu_usable", "jax", "jaxlib", "flax",
             "symjax_mlp", "python")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RowChange:
    """One figure both runs hold, old against new.

    Attributes:
      section: ``"row"`` (the table), ``"stage"`` (trace/lower/compile...) or ``"sweep"``.
      key: the row key (``hybridized``), stage name, or ``mode@batch`` of a sweep point.
      label: what it is, in words.
      old_min, old_median, new_min, new_median: seconds per input (per example for the sweep,
        per run for a stage) at the fastest and the median repeat.
      repeats: the fewer repeats of the two runs.
      ratio: ``new_min / old_min``; above 1 the new run is slower.
      noise: the band, as a fraction: the larger spread of the two, at least ``min_noise``.
      verdict: ``"slower"``, ``"faster"`` (beyond the noise), ``"noise"`` (within it) or
        ``"unknown"`` (a single repeat: no spread to judge by).
    """

    section: str
    key: str
    label: str
    old_min: float
    old_median: float
    new_min: float
    new_median: float
    repeats: int
    ratio: float
    noise: float
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RunComparison:
    """What :func:`compare_runs` found: one :class:`RowChange` per shared figure, and notes.

    Attributes:
      old, new: where each run came from (a path, or ``"<dict>"``).
      changes: the shared figures, in the old run's order.
      only_old, only_new: keys (``section key``) only one run holds.
      notes: differences of settings or machine that bear on the ratios.
      min_noise: the smallest band used.
    """

    old: str
    new: str
    changes: tuple[RowChange, ...]
    only_old: tuple[str, ...]
    only_new: tuple[str, ...]
    notes: tuple[str, ...]
    min_noise: float

    @property
    def regressions(self) -> tuple[RowChange, ...]:
        """The changes slower beyond the noise."""
        return tuple(c for c in self.changes if c.verdict == "slower")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "old": self.old,
            "new": self.new,
            "min_noise": self.min_noise,
            "changes": [c.to_dict() for c in self.changes],
            "only_old": list(self.only_old),
            "only_new": list(self.only_new),
            "notes": list(self.notes),
        }


def _load(source: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(source, Mapping):
        return "<dict>", dict(source)
    name = os.fspath(source)
    try:
        data = json.loads(Path(name).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{name}: no such file; pass a JSON written by bench --json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{name}: not a readable JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: holds a JSON {type(data).__name__}, not a benchmark run")
    return name, data


def _figures(name: str, d: Mapping[str, Any], notes: list[str]) -> dict[str, tuple]:
    """``"section key"`` -> (section, key, label, min, median, repeats) of one run."""
    schema = d.get("schema")
    if not any(k in d for k in ("rows", "points", "sweep")):
        raise ConfigError(
            f"{name}: not a benchmark run (no rows, no sweep points); pass files written by "
            "`python scripts/bench.py --json PATH` or a sweep's PREFIX.json"
        )
    if schema is None:
        notes.append(f"{name} has no schema field (written before schema {SCHEMA}); read as it")
    elif schema != SCHEMA:
        raise ConfigError(
            f"{name}: benchmark JSON schema {schema!r}; this symjax_mlp reads schema {SCHEMA}. "
            "Compare it with the version that wrote it, or run the benchmark again"
        )
    try:
        return _entries(d)
    except (KeyError, TypeError, AttributeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(
            f"{name}: a row, stage or sweep point is not what `python scripts/bench.py --json` "
            f"writes ({type(e).__name__}: {str(e)[:120]}); pass an unedited run's JSON"
        ) from None


def _entries(d: Mapping[str, Any]) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for r in d.get("rows", ()):
        lo, med = r["per_1000_inputs_min_s"] / 1000, r["per_1000_inputs_median_s"] / 1000
        out[f"row {r['key']}"] = ("row", r["key"], r.get("label", r["key"]), lo, med, r["repeats"])
    for k, t in d.get("stages", {}).items():
        out[f"stage {k}"] = ("stage", k, f"stage: {k}", t["min_s"], t["median_s"], t["repeats"])
    points = d.get("points") or (d.get("sweep") or {}).get("points", ())
    for p in points:
        key, b = f"{p['mode']}@{p['batch']}", p["batch"]
        lo, med = p["per_call_min_s"] / b, p["per_call_median_s"] / b
        label = f"sweep: {p['mode']}, batch {b}"
        out[f"sweep {key}"] = ("sweep", key, label, lo, med, p["repeats"])
    return out


def _verdict(ratio: float, noise: float, repeats: int) -> str:
    if repeats < 2:
        return "unknown"
    shown = round(ratio, RATIO_DECIMALS)
    if shown > round(1 + noise, RATIO_DECIMALS):
        return "slower"
    if shown < round(1 / (1 + noise), RATIO_DECIMALS):
        return "faster"
    return "noise"


def _differences(old: Mapping[str, Any], new: Mapping[str, Any], keys: tuple[str, ...]) -> list:
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def compare_runs(
    old: str | os.PathLike[str] | Mapping[str, Any],
    new: str | os.PathLike[str] | Mapping[str, Any],
    *,
    min_noise: float = MIN_NOISE,
) -> RunComparison:
    """Compares two benchmark runs figure by figure: ratio, noise band and verdict.

    Args:
      old, new: paths of JSON files written by ``python scripts/bench.py --json`` (schema 1, or from
        before the schema) or a sweep's ``PREFIX.json``, or those dicts.
      min_noise: the smallest noise band, as a fraction (default 2%).

    Returns:
      A :class:`RunComparison`; :func:`format_comparison` prints it.

    Raises:
      ConfigError: a file is missing, not JSON, not a benchmark run, or of another schema.

    Example:
      >>> row = {"key": "h", "per_1000_inputs_min_s": 1.0, "per_1000_inputs_median_s": 1.01,
      ...        "repeats": 5}
      >>> slow = dict(row, per_1000_inputs_min_s=1.5, per_1000_inputs_median_s=1.52)
      >>> c = compare_runs({"schema": 1, "rows": [row]}, {"schema": 1, "rows": [slow]})
      >>> c.changes[0].ratio, c.changes[0].verdict
      (1.5, 'slower')
    """
    if not 0 <= min_noise < 1:
        raise ConfigError(f"compare_runs: min_noise must be in [0, 1); got {min_noise!r}")
    (old_name, a), (new_name, b) = _load(old), _load(new)
    notes: list[str] = []
    fa, fb = _figures(old_name, a, notes), _figures(new_name, b, notes)
    changes = []
    for k, (section, key, label, lo_a, med_a, rep_a) in fa.items():
        if k not in fb:
            continue
        _, _, _, lo_b, med_b, rep_b = fb[k]
        ratio = lo_b / lo_a if lo_a > 0 else float("inf")
        spread = max(med_a / lo_a - 1 if lo_a > 0 else 0.0, med_b / lo_b - 1 if lo_b > 0 else 0.0)
        noise = max(spread, min_noise)
        reps = min(rep_a, rep_b)
        changes.append(
            RowChange(section, key, label, lo_a, med_a, lo_b, med_b, reps, ratio, noise,
                      _verdict(ratio, noise, reps))
        )  # fmt: skip
    config = _differences(a.get("config", {}), b.get("config", {}), _CONFIG_KEYS)
    if config:
        notes.append("the runs differ in settings (" + "; ".join(config) + "): a ratio may "
                     "reflect the settings, not the code")  # fmt: skip
    env = _differences(a.get("env", {}), b.get("env", {}), _ENV_KEYS)
    if env:
        notes.append("the runs differ in machine or versions: " + "; ".join(env))
    for name, d in ((old_name, a), (new_name, b)):
        load, cores = (d.get("env") or {}).get("loadavg"), (d.get("env") or {}).get("cpu_usable")
        if load and cores and load[0] > 0.5 * cores:
            notes.append(
                f"{name} started at load average {load[0]:.2f} on {cores} cores: other work "
                "shared the machine, and a busy machine varies more between runs than within "
                "one; rerun both on a quiet machine before calling a change a regression"
            )
    return RunComparison(
        old=old_name,
        new=new_name,
        changes=tuple(changes),
        only_old=tuple(k for k in fa if k not in fb),
        only_new=tuple(k for k in fb if k not in fa),
        notes=tuple(notes),
        min_noise=min_noise,
    )


_MARK = {"slower": "SLOWER", "faster": "faster", "noise": "noise", "unknown": "? 1 repeat"}


def format_comparison(comparison: RunComparison) -> str:
    """The comparison as a table: old and new time per input, ratio, noise band, verdict.

    Example:
      >>> row = {"key": "h", "per_1000_inputs_min_s": 1.0, "per_1000_inputs_median_s": 1.01,
      ...        "repeats": 5}
      >>> c = compare_runs({"schema": 1, "rows": [row]}, {"schema": 1, "rows": [row]})
      >>> print(format_comparison(c).splitlines()[-1])
      0 slower beyond the noise, 0 faster, 1 within the noise.
    """
    c = comparison
    lines = [
        f"comparing {c.old} (old) with {c.new} (new)",
        "ratio: new / old seconds per input at the fastest repeat (> 1: the new run is slower);",
        "noise: the larger median/fastest spread of the two runs' repeats, at least "
        f"{c.min_noise:.0%}; only a ratio beyond it is flagged (a within-run estimate:",
        "runs on a busy machine vary more from run to run)",
        "",
        f"{'row':<40}{'old min':>11}{'new min':>11}{'ratio':>9}{'noise':>9}  verdict",
    ]
    for ch in c.changes:
        noise = f"±{ch.noise:.1%}"
        lines.append(
            f"{ch.label[:39]:<40}{_fmt_s(ch.old_min):>11}{_fmt_s(ch.new_min):>11}"
            f"{ch.ratio:>9.{RATIO_DECIMALS}f}{noise:>9}  {_MARK[ch.verdict]}"
        )
    for side, keys in (("old", c.only_old), ("new", c.only_new)):
        if keys:
            lines.append(f"only in the {side} run: {', '.join(keys)}")
    lines += [f"note: {n}" for n in c.notes]
    count = {v: sum(ch.verdict == v for ch in c.changes) for v in _MARK}
    slower = [ch.key for ch in c.regressions]
    summary = (
        f"{count['slower']} slower beyond the noise"
        + (f" ({', '.join(slower)})" if slower else "")
        + f", {count['faster']} faster, {count['noise']} within the noise"
        + (f", {count['unknown']} without a noise estimate (1 repeat)" if count["unknown"] else "")
        + "."
    )
    return "\n".join([*lines, "", summary])
