"""The retraces a Hybrid warns of, on the retrace path, at the user's line that called it: for
a new value of a Python number alone (a setting, so a trace per value), once per Hybrid,
naming the number and the fixes; and for held state that grows at every call (an nnx
module's ``sow`` outside ``nnx.capture``), naming ``nnx.capture``."""

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
#: the traces in a row, each for held state grown alone, that are warned of (once a run)
GROWN = 3
_GREW = "the held state grew"
_GROWING = (
    "{name}: traced again at each of the last {n} calls because the held state grew ({reason}): "
    "the Hybrid keeps what an nnx module's call adds to its Variables, as nnx.jit does, so each "
    "call compiles anew and holds more. An nnx module's self.sow(nnx.Intermediate, ...) outside "
    "nnx.capture appends every call's value (deprecated since flax 0.12.8). Have each call "
    "return them instead: h = sm.hybridize(lambda m, *a: nnx.capture(m, nnx.Intermediate)(*a), "
    "model) answers (out, intermediates), traced once; or keep one value (self.y = "
    "nnx.Intermediate(y), or sow's reduce_fn); max_traces=... makes the growth an error."
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


def warn_growing(log: TraceLog, event: TraceEvent) -> bool:
    """Whether it warned (a :class:`RetraceWarning`): ``event`` is the :data:`GROWN` th trace
    in a row each for held state a call grew (warned once for a run of them)."""
    events = log.events
    if not event.reason.startswith(_GREW) or len(events) < GROWN - 1:
        return False
    run = [e.reason.startswith(_GREW) for e in events[-GROWN:]]  # and one before: not grown
    if not all(run[-(GROWN - 1) :]) or (len(run) == GROWN and run[0]):
        return False
    reason = event.reason.removeprefix(f"{_GREW}: ")
    warned = _GROWING.format(name=log.name, n=GROWN, reason=reason)
    warnings.warn(warned, RetraceWarning, stacklevel=user_stacklevel())
    return True
