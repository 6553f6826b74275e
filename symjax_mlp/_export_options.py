"""What :func:`~symjax_mlp.export` checks of its options before any work: the entry points, each
option, the model card; nothing is traced or written when one is wrong."""

from __future__ import annotations

import contextlib
import datetime
import difflib
import inspect
import json
import os
import re
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax

from symjax_mlp._artifact.format import (
    MAX_DEPTH,
    MAX_TOLERANCE,
    MAX_VJP_ORDER,
    RESERVED_ENTRY_NAMES,
    is_entry_name,
    printable,
    tolerance,
)
from symjax_mlp._compat import without_source_locations
from symjax_mlp._errors import ConfigError, SignatureError, first_line
from symjax_mlp._hybrid.hybrid import Hybrid
from symjax_mlp._hybrid.params import param_fields
from symjax_mlp._selftest import TOLERANCE

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
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
    h: Any, batch: Any, platforms: Any, *, overwrite: Any, metadata: Any, vjp_order: Any,
    **per_entry: Any,
) -> tuple[dict[str, Hybrid], dict[str, list[Any]], tuple[str, ...], dict[str, Any]]:  # fmt: skip
    """Refuses a bad option; returns the entry points by name, the :data:`PER_ENTRY` settings
    (a list, one per entry point), the platforms as a tuple and the model card as JSON data."""
    points = _entry_points(h)
    names = list(points)
    settings = {k: _per_entry(per_entry[k], names, k) for k in PER_ENTRY}
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
    card = _card(metadata, names[0])
    if batch is not None and not (
        isinstance(batch, str) and batch.isidentifier() and batch not in {*_SPEC_FUNCTIONS, "_"}
    ):
        rows = f" (an example of {batch} rows: a static batch of {batch})" * (type(batch) is int)
        raise ConfigError(
            f"export(batch={batch!r}): pass a name such as 'b' for a symbolic batch (not '_' or "
            f"a function of jax.export's specs, {', '.join(sorted(_SPEC_FUNCTIONS))}), or None "
            f"for the example's static shapes{rows}."
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
            if big := [n for n in re.findall(r"\d+", c) if len(n) > 19 or int(n) >= 1 << 63]:
                raise ConfigError(  # else jax.export's raw OverflowError, as it lowers
                    f"export({h.name}, constraints=...): {c[:80]!r} holds {big[0][:30]}, past "
                    "the sizes jax.export computes with (below 2**63); bound by such a size."
                )
            unknown = sorted(_dim_names([c]) - dims)
            if unknown:
                raise ConfigError(
                    f"export({h.name}, constraints={tuple(constraints)!r}): {c!r} names "
                    f"{unknown[0]!r}, which no spec of shapes={tuple(shapes)!r} uses (they name "
                    f"{', '.join(sorted(dims)) or 'no dimension'}). Constrain a name the specs "
                    f"use, or use {unknown[0]!r} in a spec."
                )
    return points, settings, tuple(platforms), card


_EPOCH = (
    "export: SOURCE_DATE_EPOCH={value!r} is not a time: reproducible-builds.org's variable is "
    "whole seconds since 1970-01-01 UTC, as date +%s prints them (git log -1 --format=%ct gives "
    "the last commit's). Set it to such a number, or unset it to date the artifact now."
)


def created_at() -> datetime.datetime:
    """The manifest's ``created``: now, or ``SOURCE_DATE_EPOCH``'s time where that is set, as
    reproducible-builds.org defines it (two exports of one model then write the same bytes)."""
    if not (value := os.environ.get("SOURCE_DATE_EPOCH", "")):
        return datetime.datetime.now(datetime.UTC)
    try:
        if value.isascii() and value.isdigit():
            return datetime.datetime.fromtimestamp(int(value), datetime.UTC)
    except (ValueError, OverflowError, OSError):  # beyond year 9999
        pass
    raise ConfigError(_EPOCH.format(value=value))


def shown(static: Iterable[tuple[Any, Any, Any]], params: Any = None) -> dict[str, str]:
    """The static settings by place, and the static fields of ``params``' tree by path
    (``param_fields``: ``m.apply`` refuses others), as the manifest shows them: each repr without
    a memory address (``<function act at 0x7f..>``: one model's manifest differed run to run), a
    set's items sorted (the order a set of strings iterates in is PYTHONHASHSEED's, each one's)."""
    static = [*static, *param_fields(params)]
    return {(f"args[{k}]" if isinstance(k, int) else k): re.sub(r" at 0x[0-9a-fA-F]+>", ">",
            _sorted_repr(v)) for k, v, _ in static}  # fmt: skip


def _sorted_repr(v: Any) -> str:
    """``repr(v)``, a frozenset's items sorted, in a tuple too (static settings are hashable)."""
    if isinstance(v, frozenset) and v:
        return f"{type(v).__name__}({{{', '.join(sorted(map(_sorted_repr, v)))}}})"
    if type(v) is tuple:
        return "(" + ", ".join(map(_sorted_repr, v)) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


_TOLERANCE = (
    "export(self_test_tolerance={value!r}): pass a number from 0 to {cap} (the rtol and atol "
    "load checks the self-test's outputs to; the default is {default}), or a dict of them "
    "apart, e.g. {{'rtol': 1e-3, 'atol': 1e-6}}: an adaptive solver's rtol. More than {cap} "
    "would let the self-test pass other weights or another program."
)


def tolerance_option(value: Any) -> dict[str, float] | None:
    """``self_test_tolerance`` as the manifest's ``{"rtol", "atol"}`` (a number: both; a key
    left out of a dict: the default's), ``None`` for none; refused unless each is a number
    from 0 to :data:`MAX_TOLERANCE` (not NaN), as load checks a stranger's manifest."""
    if value is None:
        return None
    given = dict(value) if isinstance(value, Mapping) else dict.fromkeys(TOLERANCE, value)
    # a NumPy or JAX scalar (np.float32(1e-3)) as the number it holds
    tol = {**TOLERANCE, **{k: v.item() if getattr(v, "shape", 0) == () else v
                           for k, v in given.items()}}  # fmt: skip
    if not tolerance(tol):  # as load checks a manifest's
        raise ConfigError(_TOLERANCE.format(value=value, cap=MAX_TOLERANCE, default=TOLERANCE))
    return {k: float(v) for k, v in tol.items()}


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


_LOADED = (
    "export() got a loaded model (sm.load's), an artifact already: copy its directory {path} to "
    "ship it as it is. To export its program over other weights (fine-tuned with m.apply), "
    "hybridize m.apply: sm.export(sm.hybridize(m.apply, params), path, example=x), params as "
    "m.params names them; sm.load(m.path, params=params) runs them with no new export."
)


def _entry_points(h: Any) -> dict[str, Hybrid]:
    """``h`` as named entry points: one Hybrid is the entry point ``main``."""
    points = {"main": h} if isinstance(h, Hybrid) else h
    if hasattr(h, "manifest") and callable(getattr(h, "apply", None)):  # sm.load's LoadedModel
        raise ConfigError(_LOADED.format(path=printable(str(getattr(h, "path", "")))[:200]))
    if not isinstance(points, Mapping) or not points:
        got = "an empty dict" if isinstance(points, Mapping) else type(h).__name__
        raise ConfigError(
            f"export() expects a Hybrid or a dict of them; got {got}. Write "
            "sm.export(sm.hybridize(model, variables), path, example=x), or for several entry "
            'points over one weight file sm.export({"predict": h, "embed": h_embed}, ...).'
        )
    for name, value in points.items():
        if not isinstance(value, Hybrid):
            raise ConfigError(
                f"export({{{name!r}: ...}}): each entry point is a Hybrid; got "
                f"{type(value).__name__}. Wrap it: sm.hybridize(fn, params)."
            )
        if not is_entry_name(name) or name.startswith("_"):
            raise ConfigError(
                f"export({{{name!r}: ...}}): an entry point's name is a Python identifier of "
                f"at most 64 ASCII characters, not starting with '_' and not one of "
                f"{sorted(RESERVED_ENTRY_NAMES)} (it names files): e.g. 'predict', 'embed'."
            )
    return dict(points)


def _per_entry(value: Any, names: list[str], what: str) -> list[Any]:
    """``value`` for each entry point: its own from a dict keyed by their names, else shared."""
    if len(names) > 1 and isinstance(value, Mapping) and set(value) & set(names):
        if set(value) != set(names):
            raise ConfigError(
                f"export({what}={{...}}): a per-entry {what} names every entry point, "
                f"{', '.join(names)}; got {', '.join(map(str, value))}."
            )
        return [value[n] for n in names]
    return [value] * len(names)


def _scalar(x: Any) -> Any:
    """A NumPy or JAX scalar (``np.float32(acc)``) as the Python number it holds."""
    if getattr(x, "shape", None) == () and callable(getattr(x, "item", None)):
        return x.item()
    raise TypeError(f"Object of type {type(x).__name__} is not JSON serializable")


def _card(metadata: Any, name: str) -> dict[str, Any]:
    """The model card as plain JSON data: refused if it is not JSON, nests deeper than a
    loader reads, or holds text a terminal would act on."""
    if metadata is None:
        return {}
    if not (isinstance(metadata, Mapping) and all(isinstance(k, str) for k in metadata)):
        raise ConfigError(
            f"export(metadata=...): pass a dict with str keys, e.g. metadata={{'labels': "
            f"['cat', 'dog']}}; got {type(metadata).__name__}."
        )
    try:
        card = json.loads(json.dumps(dict(metadata), allow_nan=False, default=_scalar))
    except (TypeError, ValueError, RecursionError) as e:
        raise ConfigError(
            f"export({name}, metadata=...): {e}. The model card is JSON: strings, numbers, "
            "lists and dicts (convert arrays with .tolist())."
        ) from None
    todo: list[tuple[Any, str, int]] = [(card, "metadata", 1)]  # the card is 1 into a manifest
    while todo:  # without recursion, first to last
        value, at, level = todo.pop(0)
        bad = value if isinstance(value, str) and not value.isprintable() else None
        if isinstance(value, dict | list) and level >= MAX_DEPTH:
            raise ConfigError(
                f"export({name}, metadata=...): the model card nests more than {MAX_DEPTH - 1} "
                "levels deep, more than a loader reads; flatten it (or store it as a string)."
            )
        if isinstance(value, dict):
            bad = next((k for k in value if not k.isprintable()), None)
            at = f"a key of {at}" if bad is not None else at
            todo += [(v, f"{at}[{k!r}]", level + 1) for k, v in value.items()]
        elif isinstance(value, list):
            todo += [(v, f"{at}[{i}]", level + 1) for i, v in enumerate(value)]
        if bad is not None:
            raise ConfigError(
                f"export({name}, metadata=...): {at} is {printable(repr(bad)[:80])}, which holds "
                "a control character (a newline, tab, ESC, NUL or a bidi override); `symjax-mlp "
                "inspect` and messages print the card, where a terminal would act on it. Store "
                "printable text: a multi-line text as a list of its lines, binary data as base64."
            )
    return card


_VJP_SYMBOLIC = (
    "export({name}, vjp_order={order}): the model's VJP (what jax.grad of the loaded model runs) "
    "needs a concrete value of a symbolic dimension of its inputs ({inputs}): {error}. Export "
    "it with vjp_order=0 to keep them symbolic (the loaded model runs; jax.grad of it is "
    "refused), or with static shapes (batch=None, or shapes= of numbers) and vjp_order={order}."
)


def serialized(exported: Any, vjp_order: int, name: str, inputs: Iterable[Any]) -> bytes:
    """``exported.serialize(vjp_order)``; refused where its VJP compares a symbolic dimension
    (the GP's cholesky of (7, 7) and its b test points: 'b' < '7' is inconclusive), or where
    JAX cannot build its VJP of that order (a dynamic while_loop, a pallas_call: none)."""
    # off the caller's mesh where exported is one device's program (staged off a mesh of
    # Explicit axes, see trace_placed): its VJP is built as its forward was (built on the mesh,
    # jax.grad of the loaded model failed 'expects static assert_what' for a symbolic batch)
    mesh = jax.set_mesh(None) if exported.nr_devices == 1 else contextlib.nullcontext()
    with mesh, without_source_locations():  # the VJPs' too: no path or line of this machine
        try:
            return bytes(exported.serialize(vjp_order=vjp_order))
        except jax.errors.InconclusiveDimensionOperation as e:
            said = ", ".join(map(str, inputs))
            raise SignatureError(
                _VJP_SYMBOLIC.format(name=name, order=vjp_order, inputs=said, error=first_line(e))
            ) from None
        except _NO_VJP_ERRORS as e:  # JAX's, its VJP (equinox's RuntimeError: an input it
            if vjp_order == 0:  # cannot differentiate, filter_custom_vjp's *args)
                raise
            works = _highest_order(exported, vjp_order)  # raises where the VJP is not the cause
            said = _NO_VJP if "host_callbacks" not in str(e) else _VJP_CALLS_BACK
            said = said.format(name=name, order=vjp_order, error=_why(e), works=works)
            raise ConfigError(said) from None


def _highest_order(exported: Any, failed: int) -> int:
    """The highest VJP order below ``failed`` that ``exported`` serializes with (0 re-raises)."""
    for order in range(failed - 1, 0, -1):
        try:
            exported.serialize(vjp_order=order)
        except _NO_VJP_ERRORS:
            continue
        return order
    exported.serialize(vjp_order=0)
    return 0


def _why(e: BaseException) -> str:
    """JAX's reason, or where an assert failed (lineax's transpose of its operator at order 2
    asserts, its message a tuple of JAX's internal values)."""
    if not isinstance(e, AssertionError):
        return first_line(e)
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"an assert failed in {'/'.join(Path(frame.filename).parts[-2:])}, line {frame.lineno}"


_NO_VJP_ERRORS = (ValueError, NotImplementedError, AttributeError, TypeError, RuntimeError,
                  AssertionError)  # fmt: skip
_NO_VJP = (
    "export({name}, vjp_order={order}): JAX could not build the model's VJP of order {order} "
    "({error}); it builds those of order {works} and below. Export it with vjp_order={works} "
    "(jax.grad of the loaded model goes {works} deep; vjp_order=0: none); where JAX cannot "
    "reverse-differentiate the model, make it differentiable (lax.scan for a while_loop, a "
    "custom_vjp for an op without a rule such as a pallas_call, an input of equinox's "
    "filter_custom_vjp moved into its first argument) before exporting with "
    "vjp_order={order}."
)
_VJP_CALLS_BACK = (
    "export({name}, vjp_order={order}): the model's VJP of order {order} calls back into Python "
    "(a host callback; JAX: {error}), and an artifact carries no Python. Where it is equinox's "
    "runtime check (eqx.error_if: lineax's linear_solve checks its answer with one in its VJP, "
    "as optimistix's solvers and OTT's implicit differentiation call it), set the environment "
    "variable EQX_ON_ERROR=nan (NaN where a check fails) or EQX_ON_ERROR=off before equinox is "
    "imported; or export with vjp_order={works} (the highest order it builds: jax.grad of the "
    "loaded model goes {works} deep)."
)
