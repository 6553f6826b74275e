"""A Hybrid's settings checked, as ``hybridize`` takes them: ``max_traces``, its bools and
strs, and ``static_argnums``/``static_argnames`` completed from the model's inputs."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from symjax_mlp._errors import ConfigError, as_bool, as_int


def check_settings(max_traces: Any = None, **given: tuple[Any, type, str]) -> tuple[Any, ...]:
    """``max_traces``, then each ``setting=(value, type, example)``, of its type (``None`` for
    a str): a NumPy integer or bool as Python's, as ``jax.jit`` takes them."""
    budget = as_int(max_traces)
    if max_traces is not None and (type(budget) is not int or budget < 1):
        raise ConfigError(
            f"max_traces must be a positive int or None; got {max_traces!r}. Pass e.g. "
            "max_traces=8 (a budget of traces), or None for no budget."
        )
    values: list[Any] = [budget]
    for key, (value, kind, example) in given.items():
        value = as_bool(value) if kind is bool else value
        if not ((value is None and kind is str) or type(value) is kind):
            raise ConfigError(
                f"{key} must be a {kind.__name__}; got {value!r} ({type(value).__name__}). "
                f"Pass e.g. {key}={example}."
            )
        values.append(value)
    return tuple(values)


def static_args(
    params: list[inspect.Parameter] | None, name: str, nums: Any, names: Any
) -> tuple[frozenset[int], frozenset[str]]:
    """``static_argnums`` and ``static_argnames`` checked, and completed from the model's
    inputs as ``jax.jit`` does (a name static by place too, a place by name)."""
    got = _as_tuple(nums, (int, np.integer))
    places = [as_int(i) for i in got or ()]
    if got is None or not all(type(i) is int and i >= 0 for i in places):
        raise ConfigError(
            f"static_argnums={nums!r}: pass an input's place or a tuple of them, ints from 0 (the "
            "first input after the params), e.g. static_argnums=(1,)."
        )
    nums, names, given = tuple(places), _as_tuple(names, str), names
    if names is None or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise ConfigError(
            f"static_argnames={given!r}: pass a keyword's name or a tuple of them, e.g. "
            "static_argnames=('mode',)."
        )
    if params is None or not (nums or names):
        return frozenset(nums), frozenset(names)
    places = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    known = {p.name for p in params if p.kind != p.POSITIONAL_ONLY}
    loose = not any(p.kind == p.VAR_KEYWORD for p in params)
    unknown = sorted(n for n in names if n not in known) if loose else []
    if only := [i for i, p in enumerate(places) if p.name in unknown]:  # before a "/"
        raise ConfigError(
            f"{name}: static_argnames={names!r} names {places[only[0]].name!r}, which is "
            f"positional-only (before '/'), so it has no name to pass by. Mark it by place: "
            f"static_argnums={tuple(only)}."
        )
    if unknown:
        raise ConfigError(
            f"{name}: static_argnames={names!r} names {unknown}, but the model's inputs are "
            f"({', '.join(p.name for p in params)}). Name one of those, or drop it."
        )
    by_name = {p.name: i for i, p in enumerate(places) if p.kind == p.POSITIONAL_OR_KEYWORD}
    nums += tuple(by_name[n] for n in names if n in by_name)
    names += tuple(places[i].name for i in nums if i < len(places) and places[i].name in by_name)
    return frozenset(nums), frozenset(names)


def keyed(kwargs: dict[str, Any]) -> tuple | None:
    """A call's keywords as the key of the static entries a call gave them (``None``: a value
    other than a bool, str or None, which the Hybrid's hot path does not key on: 1 == True)."""
    for v in kwargs.values():  # (a loop: a generator's all() is twice its time, on h(x)'s path)
        if not (type(v) is bool or type(v) is str or v is None):
            return None
    return tuple(kwargs.items())


def remember(
    statics: dict[tuple, Any] | None, kwargs: dict[str, Any], static: tuple, every_arg: bool
):
    """Keeps ``static``, the entries a call's ``kwargs`` gave, for calls with the same settings
    (64 kinds at most), where ``every_arg`` positional one was traced (none a setting); none
    where ``statics`` is ``None`` (no hot path)."""
    if statics is not None and every_arg and (named := keyed(kwargs)) and len(statics) < 64:
        statics[named] = static


def _as_tuple(x: Any, single: type | tuple[type, ...]) -> tuple | None:
    return (x,) if isinstance(x, single) else tuple(x) if isinstance(x, tuple | list) else None
