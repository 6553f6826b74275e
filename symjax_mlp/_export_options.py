"""What :func:`~symjax_mlp.export` checks of its options before any work: nothing traced, nothing
written when one is wrong."""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Iterable, Mapping
from typing import Any

from symjax_mlp._errors import ConfigError, SignatureError
from symjax_mlp._hybrid.hybrid import Hybrid

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
MAX_VJP_ORDER = 8  # the most a manifest may hold (_artifact/format.py)
PER_ENTRY = ("example", "kwargs", "shapes", "constraints")  # may differ by entry point
_TUPLES = {  # an option that takes a tuple: what each item is, and a tuple of one
    "platforms": ((str,), "platform names", "platforms=('cpu',)"),
    "shapes": ((str, type(None)), "shape specs, one per input", "shapes=('b, 512',)"),
    "constraints": ((str,), "constraints", "constraints=('t <= 1024',)"),
}
_SPEC_FUNCTIONS = {"max", "min", "mod", "floordiv"}  # the names jax.export's specs call
_BATCH_AND_SHAPES = (
    "export({name}, batch={batch!r}, shapes={shapes!r}): pass one of them, not both. shapes= "
    "gives every dimension of every input, the batch's too, so batch= would be ignored. Keep "
    "shapes= (name the batch in it, e.g. 'n, 512') and drop batch=, or drop shapes= for {what}."
)
_NO_EXAMPLE = (
    "export({name}, example=None): export traces the model on an example input; pass an array "
    "(or a tuple of arrays) of its shape and dtype, e.g. example=jnp.zeros((1, 512), jnp.float32)."
)


def check_options(
    points: Mapping[str, Hybrid], settings: Mapping[str, list[Any]], batch: Any, platforms: Any,
    *, overwrite: Any, metadata: Any, vjp_order: Any,
) -> tuple[str, ...]:  # fmt: skip
    """Refuses a bad option; returns the platforms as a tuple. ``settings``: per entry point."""
    if not isinstance(overwrite, bool):
        raise ConfigError(
            f"export(overwrite={overwrite!r}): pass True (replace an existing artifact) or "
            "False (refuse to)."
        )
    if not isinstance(vjp_order, int) or isinstance(vjp_order, bool) or vjp_order < 0:
        raise ConfigError(f"export(vjp_order={vjp_order!r}): pass an int >= 0 (1 for jax.grad).")
    if vjp_order > MAX_VJP_ORDER:
        raise ConfigError(
            f"export(vjp_order={vjp_order}): an artifact carries gradients up to order "
            f"{MAX_VJP_ORDER} (each order doubles its program; load refuses more). Pass the "
            "order you will differentiate to: 1 for jax.grad, 2 for a Hessian."
        )
    if metadata is not None and not (
        isinstance(metadata, Mapping) and all(isinstance(k, str) for k in metadata)
    ):
        raise ConfigError(
            f"export(metadata=...): pass a dict with str keys, e.g. metadata={{'labels': "
            f"['cat', 'dog']}}; got {type(metadata).__name__}."
        )
    if batch is not None and not (
        isinstance(batch, str) and batch.isidentifier() and batch not in {*_SPEC_FUNCTIONS, "_"}
    ):
        raise ConfigError(
            f"export(batch={batch!r}): pass a name such as 'b' (not '_' or a function of "
            f"jax.export's specs, {', '.join(sorted(_SPEC_FUNCTIONS))}), or None."
        )
    _check_tuple("", "platforms", platforms)
    if not platforms or set(platforms) - set(PLATFORMS) or len(set(platforms)) < len(platforms):
        raise ConfigError(
            f"export(platforms={tuple(platforms)!r}): name each platform once, from "
            f"{PLATFORMS} (a GPU is 'cuda' or 'rocm')."
        )
    for i, h in enumerate(points.values()):
        example, kwargs, shapes, constraints = (settings[k][i] for k in PER_ENTRY)
        if example is None:
            raise SignatureError(_NO_EXAMPLE.format(name=h.name))
        _check_kwargs(h, kwargs)
        _check_tuple(h.name, "constraints", constraints)
        if shapes is None:
            if constraints:
                raise ConfigError(
                    f"export({h.name}, constraints=...): constraints name the dimensions of "
                    "shapes=; pass shapes too, e.g. shapes=('b, t',), constraints=('t <= 1024',)."
                )
            continue
        _check_tuple(h.name, "shapes", shapes)
        if batch != "b":  # the default: it says nothing beside shapes=
            what = "static shapes" if batch is None else f"a leading dimension {batch!r}"
            raise ConfigError(
                _BATCH_AND_SHAPES.format(name=h.name, batch=batch, shapes=shapes, what=what)
            )
        dims = _dim_names(s for s in shapes if s is not None)
        for c in constraints:
            unknown = sorted(_dim_names([c]) - dims)
            if unknown:
                raise ConfigError(
                    f"export({h.name}, constraints={tuple(constraints)!r}): {c!r} names "
                    f"{unknown[0]!r}, which no spec of shapes={tuple(shapes)!r} uses (they name "
                    f"{', '.join(sorted(dims)) or 'no dimension'}). Constrain a name the specs "
                    f"use, or use {unknown[0]!r} in a spec."
                )
    return tuple(platforms)


def _check_tuple(name: str, option: str, value: Any) -> None:
    kinds, what, one = _TUPLES[option]
    if isinstance(value, tuple | list) and all(isinstance(v, kinds) for v in value):
        return
    why = " (one string would be read as its characters)" if isinstance(value, str) else ""
    raise ConfigError(
        f"export({name + ', ' if name else ''}{option}={value!r}): pass a tuple of {what}"
        f"{why}, e.g. {one}."
    )


def _check_kwargs(h: Hybrid, kwargs: Any) -> None:
    if kwargs is None:
        return
    if not (isinstance(kwargs, Mapping) and all(isinstance(k, str) for k in kwargs)):
        raise ConfigError(
            f"export({h.name}, kwargs={kwargs!r}): pass a dict of keyword settings, e.g. "
            "kwargs={'train': False}."
        )
    params = list(inspect.signature(h).parameters.values())  # the model's inputs
    if any(p.kind == p.VAR_KEYWORD for p in params):  # (or not inspectable)
        return
    known = [p.name for p in params if p.kind != p.POSITIONAL_ONLY]
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"Did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"export({h.name}, kwargs={{{key!r}: ...}}): the model takes no keyword "
                f"{key!r}; its inputs are ({', '.join(p.name for p in params)}). {hint}Pass "
                "only keywords of the model's call."
            )


def _dim_names(specs: Iterable[str]) -> set[str]:
    """The dimension names that ``jax.export`` shape specs or constraints use."""
    return {n for s in specs for n in re.findall(r"[A-Za-z_]\w*", s)} - _SPEC_FUNCTIONS
