"""A Hybrid's settings, checked: their types, and the static arguments completed from the
model's signature as ``jax.jit`` completes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from symjax_mlp._errors import ConfigError
from symjax_mlp._hybrid.pure import PureModel


def check_settings(max_traces: Any = None, **given: tuple[Any, type, Any]) -> None:
    """Each ``setting=(value, type, example)``: a value of another type is a ConfigError
    (``compiled="no"`` is truthy; ``name=3`` broke deep inside). ``None`` passes for names.
    ``max_traces``: a positive int or ``None``."""
    if max_traces is not None and (
        not isinstance(max_traces, int) or isinstance(max_traces, bool) or max_traces < 1
    ):
        raise ConfigError(f"max_traces must be a positive int or None; got {max_traces!r}.")
    for key, (value, kind, example) in given.items():
        if (value is None and kind is str) or type(value) is kind:
            continue
        hint = f"{key}={example!r}" if example is not None else f"{key}='mlp'"
        if key == "axis":
            hint = "axis='data' (a mesh axis name)"
        raise ConfigError(
            f"{key} must be a {kind.__name__}; got {value!r} ({type(value).__name__}). "
            f"Pass e.g. {hint}."
        )


def argnums(x: int | Sequence[int]) -> tuple[int, ...]:
    """``static_argnums`` as a tuple: ints >= 0, each an input's place (0: the first input)."""
    got = (x,) if isinstance(x, int) else tuple(x) if isinstance(x, tuple | list) else None
    if got is None or not all(type(i) is int and i >= 0 for i in got):
        raise ConfigError(
            f"static_argnums={x!r}: pass an input's place or a tuple of them, ints from 0 (the "
            "first input after the params), e.g. static_argnums=(1,)."
        )
    return got


def argnames(x: str | Sequence[str]) -> tuple[str, ...]:
    """``static_argnames`` as a tuple of keyword names."""
    got = (x,) if isinstance(x, str) else tuple(x) if isinstance(x, tuple | list) else None
    if got is None or not all(isinstance(n, str) and n.isidentifier() for n in got):
        raise ConfigError(
            f"static_argnames={x!r}: pass a keyword's name or a tuple of them, e.g. "
            "static_argnames=('mode',)."
        )
    return got


def static_args(
    model: PureModel, name: str, nums: tuple[int, ...], names: tuple[str, ...]
) -> tuple[frozenset[int], frozenset[str]]:
    """``static_argnums`` and ``static_argnames`` completed from the model's signature, as
    ``jax.jit`` does: a name static when passed by place too, a place when passed by name."""
    params = model.parameters() if (nums or names) else None
    if params is None:
        return frozenset(nums), frozenset(names)
    places = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    known = {p.name for p in params if p.kind != p.POSITIONAL_ONLY}
    loose = not any(p.kind == p.VAR_KEYWORD for p in params)
    unknown = sorted(n for n in names if n not in known) if loose else []
    if unknown:
        raise ConfigError(
            f"{name}: static_argnames={names!r} names {unknown}, but the model's inputs are "
            f"({', '.join(p.name for p in params)}). Name one of those, or drop it."
        )
    by_name = {p.name: i for i, p in enumerate(places) if p.kind == p.POSITIONAL_OR_KEYWORD}
    nums += tuple(by_name[n] for n in names if n in by_name)
    names += tuple(places[i].name for i in nums if i < len(places) and places[i].name in by_name)
    return frozenset(nums), frozenset(names)
