"""The retrace of a Hybrid for a new value of a Python number alone (a setting, so a trace per
value): warned of once per Hybrid, on the retrace path, naming the number and the fixes, at
the user's line that called the Hybrid."""

from __future__ import annotations

import warnings
from typing import Any

from symjax_mlp._errors import RetraceWarning, user_stacklevel
from symjax_mlp._hybrid.args import ModuleSetting, path_of
from symjax_mlp._hybrid.trace import TraceEvent, TraceLog

_NUMBER = (
    "{name}: traced again only because the Python number {changed} took a new value: a Python "
    "number is a setting, so each value is traced and compiled anew. Pass it as an array, "
    "jnp.asarray(...), to trace it once for every value; or, if each value is meant to be its "
    "own program, mark it static on purpose: sm.hybridize(..., {fix})."
)


def numbers_changed(static: Any, trace: Any, events: Any, deliberate: Any) -> list[tuple]:
    """The Python numbers (not static on purpose: ``deliberate``) whose value alone changed
    against one of ``events`` for ``trace``, ``(sig, tree, entry)``: ``(key, was, now)``."""
    now = {path_of(k): (k, repr(v)) for k, v, _ in static}
    numbers = {path_of(k) for k, v, _ in static if type(v) in (int, float, complex)
               and k not in deliberate and not isinstance(k, ModuleSetting)}  # fmt: skip
    for e in events if numbers else ():
        if (e.signature, e.tree, e.entry) != trace or dict(e.static).keys() != now.keys():
            continue
        changed = [(now[p][0], v, now[p][1]) for p, v in e.static if now[p][1] != v]
        kept = all(path_of(k) in numbers and _type(was) is _type(new) for k, was, new in changed)
        if changed and kept:  # values, not types (4 -> 4.0: an int's program, then a float's)
            return changed
    return []


def _type(text: str) -> type | None:
    """The type of the Python number whose repr is ``text`` (``None``: no number's)."""
    for kind in (int, float, complex):
        try:
            kind(text)
            return kind
        except ValueError:
            continue
    return None


def warn_numbers(log: TraceLog, deliberate: Any, static: Any, event: TraceEvent) -> bool:
    """Whether it warned (a :class:`RetraceWarning`): ``event``, a trace begun of ``static``,
    differs from one of the log's events by Python numbers' values alone (none ``deliberate``)."""
    events = log.events
    if not events or not any(type(v) in (int, float, complex) for _, v, _ in static):
        return False
    trace = (event.signature, event.tree, event.entry)
    if not (changed := numbers_changed(static, trace, events, deliberate)):
        return False
    said = ", ".join(f"{path_of(k)} ({was} -> {now})" for k, was, now in changed)
    key = changed[0][0]
    fix = f"static_argnums=({key},)" if isinstance(key, int) else f"static_argnames=({key!r},)"
    warned = _NUMBER.format(name=log.name, changed=said, fix=fix)
    warnings.warn(warned, RetraceWarning, stacklevel=user_stacklevel())
    return True
