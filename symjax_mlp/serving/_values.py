"""JSON values to an input's array (:func:`from_json`), refusing what a cast would change
(1.5 to an int, 2**31 to int32, 1e39 to float32, 7 to float4), each refusal a
:class:`~symjax_mlp.SignatureError` in JSON's words (objects, strings, lists nested 2 deep)."""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

import ml_dtypes
import numpy as np

from symjax_mlp._errors import SignatureError
from symjax_mlp._specs import beyond_range
from symjax_mlp.serving._batcher import Batcher
from symjax_mlp.serving._requests import short


def from_json(
    batcher: Batcher, spec: Any, value: Any, *, bools: bool = True, texts: bool = True,
    top: float | None = None,
) -> np.ndarray:  # fmt: skip
    """JSON numbers as the input's dtype, refusing what the cast would change (``bools``,
    ``texts``: whether ``value`` may hold them; ``top``: a NumPy float dtype's largest number)."""
    if top is not None and not texts and not (bools and _first(value, bool)):  # the usual body
        try:  # numbers for a float: as float64 (Python's floats), cast once known in range
            x = np.asarray(value, np.float64)
            if np.vdot(x, x) < top * top:  # so each |x| < top (float64's: inf; NaN: False)
                return x.astype(spec.dtype, copy=False)
        except (TypeError, ValueError, OverflowError):  # the checks below say what it holds
            pass
    want = np.dtype(spec.dtype)
    kind, what = _kind(want), f"input {spec.path}"  # bfloat16's kind is "f", int4's "i"

    def beyond() -> SignatureError:
        return holds(batcher, what, beyond_range(want), spec.type)

    if kind != "b" and bools and _first(value, bool):
        fix = f"send {'integers' if kind in 'iu' else 'numbers'}"
        raise holds(batcher, what, "JSON booleans (true/false)", spec.type, fix)
    if texts and (text := _first(value, str, True)):  # before NumPy's array: 4 bytes a char
        if kind == "b":
            raise _not_bools(batcher, spec, value)
        held = f"strings ({short(json.dumps(text[0][:40]), 40, more=max(len(text[0]) - 40, 0))})"
        raise _not_numbers(batcher, spec, held, kind, want)
    try:
        raw = np.asarray(value)
    except OverflowError:  # 10**400 among floats
        if kind in "iub":
            held = f"numbers that are neither {want} nor in its range"
            raise holds(batcher, what, held, spec.type, "send integers in range") from None
        raise beyond() from None
    except ValueError as e:  # ragged lists, or nested past NumPy's 64 dimensions
        depth, v = 0, value
        while type(v) is list and v:
            v, depth = v[0], depth + 1
        if depth > len(spec.shape):
            raise nested(batcher, spec, depth) from None
        raise SignatureError(
            f"{batcher.name}: input {spec.path} is not a rectangular array ({short(str(e))}); "
            f"send nested lists of one shape, {spec.type}."
        ) from None
    if kind == "b":  # true/false, or 0/1
        ok = raw.dtype.kind in "biuf" or (raw.dtype.kind == "O" and raw.size == 0)
        if not ok or (raw.dtype.kind != "b" and raw.size and not np.isin(raw, (0, 1)).all()):
            raise _not_bools(batcher, spec, value)
        return raw.astype(np.bool_, copy=False)
    if kind == "f" and _saturates(want) and raw.dtype.kind in "fiu" and raw.size:
        if not np.isfinite(raw).all():  # float4 would read NaN as -0 and inf as its largest
            held = f"NaN or Infinity, which {want} cannot hold"
            raise holds(batcher, what, held, spec.type, "send finite numbers")
        if np.abs(raw).max() > ml_dtypes.finfo(want).max:  # a cast saturates, in silence
            raise beyond()
    mixed = raw.dtype.kind == "O" and {type(v) for v in raw.flat} == {int, float}
    if mixed and kind == "f":  # NumPy made [1.5, 2**64] objects: an int past int64
        try:
            raw = raw.astype(np.float64)
        except OverflowError:  # [1.5, 10**400]: past float64 too
            raise beyond() from None
    integral = raw.dtype.kind in "biu" or (
        raw.dtype.kind == "O" and all(type(v) is int for v in raw.flat)  # past int64
    )
    if raw.dtype.kind == "f" and kind in "iu" and np.array_equal(raw, np.trunc(raw)):
        integral, raw = True, raw.astype(object)  # whole numbers (2**63: NumPy made floats)
    if not (integral or raw.dtype.kind == "f") or (raw.dtype.kind == "f" and kind in "biu"):
        raise _not_numbers(batcher, spec, _held(raw), kind, want)
    if kind in "iu" and raw.size and integral:
        info = ml_dtypes.iinfo(want)
        low, high = min(raw.flat), max(raw.flat)
        if low < info.min or high > info.max:
            held = f"integers from {short(str(low), 40)} to {short(str(high), 40)}, outside "
            held += f"{want}'s range [{info.min}, {info.max}]"
            raise holds(batcher, what, held, spec.type)
    try:
        with np.errstate(over="ignore"):
            x = raw.astype(want, copy=False)
    except OverflowError:  # a Python int past float64 (10**400): no float holds it
        raise beyond() from None
    finite = np.isfinite(raw) if raw.dtype.kind == "f" else np.ones(raw.shape, bool)  # ints
    if kind == "f" and raw.size and not np.array_equal(np.isfinite(x), finite):
        raise beyond()
    return x


_JSON = {"NoneType": "null", "str": "strings", "dict": "objects", "list": "lists"}


def _held(raw: np.ndarray) -> str:
    """What ``raw``, read from JSON, holds that no number input takes, in JSON's words."""
    if raw.dtype.kind == "f":  # for an integer input: NaN, Infinity or a fraction
        bad = raw[~np.isfinite(raw) | (raw != np.trunc(raw))]
        return f"numbers that are not integers ({short(str(bad.flat[0]), 40)})"
    kinds = {_JSON.get(type(v).__name__, type(v).__name__) for v in raw.flat}
    return " and ".join(sorted(kinds - {"int", "float", "bool"})) or f"{raw.dtype} values"


@functools.lru_cache(maxsize=64)
def _kind(want: np.dtype) -> str:
    """``want``'s kind by what it holds (ml_dtypes' bfloat16 and int4 are "V" to NumPy)."""
    if want.kind != "V" or want.names is not None:
        return want.kind
    for info, kind in ((ml_dtypes.finfo, "f"), (ml_dtypes.iinfo, "i")):
        with contextlib.suppress(ValueError, TypeError):
            info(want)
            return kind
    return want.kind


@functools.lru_cache(maxsize=64)
def _saturates(want: np.dtype) -> bool:
    """Whether a float dtype has neither NaN nor Infinity (float4, float6): a cast clamps."""
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.isfinite(np.array([np.nan, np.inf]).astype(want)).any())


def _first(value: Any, kind: type, ordered: bool = False) -> list[Any]:
    """``[v]``: a ``kind`` in nested lists ``value`` (the first if ``ordered``), or ``[]``."""
    todo = [value]
    while todo:
        v = todo.pop()
        if type(v) is kind:
            return [v]
        if type(v) is list:
            todo.extend(reversed(v) if ordered else v)
    return []


def _not_bools(batcher: Batcher, spec: Any, value: Any, n: int = 8) -> SignatureError:
    """A bool input's refusal, showing the first ``n`` values not true, false, 0 or 1."""
    todo, bad = [value], []
    while todo and len(bad) < n:
        v = todo.pop()
        if type(v) is list:
            todo.extend(reversed(v))
        elif not (type(v) in (bool, int, float) and v in (0, 1)):
            bad.append(v if type(v) is not str or len(v) < 40 else v[:40] + "...")
    held = f"values other than true and false ({short(json.dumps(bad, default=str))})"
    return holds(batcher, f"input {spec.path}", held, spec.type, "send JSON booleans")


def _not_numbers(batcher: Batcher, spec: Any, held: str, kind: str, want: Any) -> SignatureError:
    numbers = "integers" if kind in "biu" else "numbers"
    fix = f"send {numbers} (JSON has no dtypes: they are cast to {want})"
    return holds(batcher, f"input {spec.path}", held, spec.type, fix)


def holds(
    batcher: Batcher, what: str, held: str, takes: str, fix: str = "send values in range"
) -> SignatureError:
    """A request whose values its input cannot take: the one message form."""
    return SignatureError(
        f"{batcher.name}: {what} holds {held}, but the model takes {takes}; {fix}."
    )


def nested(batcher: Batcher, spec: Any, depth: int, shape: tuple | None = None) -> SignatureError:
    rows = f"lists nested {len(spec.shape)} deep, rows first"
    got, fix = ("a number" if depth == 0 else f"lists nested {depth} deep"), f"send {rows}"
    if shape == (0,):  # {"inputs": []}: it held no rows, not too few lists
        got, fix = "no rows (an empty list)", f"send at least one row, {rows}"
    elif shape == tuple(spec.shape[1:]):
        fix = "wrap the one row in a list, [[...]], a batch of one"
    return holds(batcher, f"input {spec.path}", got, f"{spec.type}, a list of rows", fix)
