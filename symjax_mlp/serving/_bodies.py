"""What crosses the wire: a request body (read by :mod:`._intake`) to the model's inputs, and
the model's outputs back.

A JSON body becomes arrays of the inputs' dtypes, refusing what a cast would change (1.5 to
an int, 2**31 to int32, 1e39 to float32, 7 to float4); a ``.npy`` body is read as
``symjax-mlp run`` reads a file. What cannot be read is a :class:`BadRequest` with its HTTP
status; what does not fit the model, a :class:`~symjax_mlp.SignatureError`.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
from typing import Any

import jax
import ml_dtypes
import numpy as np

from symjax_mlp._errors import SignatureError
from symjax_mlp._npy import npy_array, read_npy
from symjax_mlp._specs import beyond_range
from symjax_mlp.serving._batcher import Batcher
from symjax_mlp.serving._requests import short

try:  # the serve extra's JSON parser: ~10x the standard library's on a body of numbers
    from orjson import JSONDecodeError as _FastError
    from orjson import JSONEncodeError as _FastWriteError
    from orjson import dumps as _fast_dumps
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - the standard library parses alone
    _fast_loads, _FastError, _fast_dumps, _FastWriteError = json.loads, ValueError, None, None

NPY, NPZ = "application/x-npy", "application/x-npz"
_NPY_TYPES = (NPY, "application/octet-stream", "application/npy")
_CURL = "; with curl, -H 'Content-Type: {}' (-d alone sends a form){}"  # curl -d's default
_BINARY = "send the file with --data-binary @FILE (-d strips its newlines)"  # curl -d @x.npy


class BadRequest(Exception):
    """A body that cannot be read as a request (answered with ``status``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def decode(
    batcher: Batcher, body: bytes, content_type: str, heads: dict[bytes, bytes] | None = None
) -> tuple[list[Any], bool]:
    """The request's inputs, and whether it came as .npy (answer in kind); ``heads``: its other
    headers (no Content-Encoding but ``identity`` is decoded: a 415; curl's User-Agent)."""
    coding, agent = ((heads or {}).get(k, b"") for k in (b"content-encoding", b"user-agent"))
    if coding and any(
        c.strip(b" \t").lower() not in (b"", b"identity") for c in coding.split(b",")
    ):
        raise BadRequest(415, (
            f"the body came with Content-Encoding {short(repr(coding.decode('latin-1')), 60)}, "
            "which this server does not decode; send it as it is, without Content-Encoding: "
            f'application/json ({{"inputs": [[...]]}}) or {NPY} (a .npy file).'
        ))  # fmt: skip
    specs = batcher.specs
    kind = content_type.split(";")[0].strip().lower()
    if kind in _NPY_TYPES:
        if len(specs) != 1:
            raise BadRequest(415, (
                f"a .npy body holds one array, but this model takes {len(specs)} inputs "
                f"({', '.join(map(str, specs))}); send JSON "
                '{"inputs": {"args[0]": [...], ...}} instead.'
            ))  # fmt: skip
        curl = f"; with curl, {_BINARY}" if agent.lower().startswith(b"curl/") else ""
        x = read_npy(bytes(body), what="the body", error=functools.partial(BadRequest, 400),
                     altered=curl)  # fmt: skip
        return [npy_array(x, specs[0].dtype)], True  # bfloat16 arrives as |V2: its bytes
    if kind not in ("application/json", ""):
        npy = body.startswith(b"\x93NUMPY")
        curl = _CURL.format(NPY, f" and {_BINARY}") if npy else _CURL.format("application/json", "")
        raise BadRequest(415, (  # a form is what curl -d sends unless told: its first try
            f"unsupported Content-Type {short(repr(content_type), 100)}; send application/json "
            f'({{"inputs": [[...]]}}) or {NPY} (a .npy file)'
            f"{curl if kind == 'application/x-www-form-urlencoded' else ''}."
        ))  # fmt: skip
    types, per_row, floats, tops = _plan(specs)
    most = batcher.max_batch * per_row  # numbers, at most
    if len(body) > 32 * most + 4096 and body.count(b",") > most + 1024:  # 10 s of parsing
        raise BadRequest(413, (
            f"the body holds more than {most + 1024} numbers, more than a request of at most "
            f"{batcher.max_batch} rows ({types}) holds; split it into requests of at most "
            f"{batcher.max_batch} rows."
        ))  # fmt: skip
    # a body quoting more than "inputs" and its inputs' names (strings: orjson holds 13 times
    # their size; keys twice) goes to the standard library's parser
    quotes = _quotes(body, n := 2 + 2 * len(specs) + 1)
    fast = floats and quotes < n
    try:
        data = _parse(body, fast)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's stack
        if type(e) is ValueError:  # int()'s, on a number of 4300 digits: no syntax error
            held = "an integer of thousands of digits, beyond every dtype's range"
            raise _holds(batcher, "the request", held, types) from None
        deep = f"nests JSON lists or objects too deep to read; send rows of {types}"  # valid
        said = deep if type(e) is RecursionError else f"is not valid JSON ({short(str(e))})"
        raise BadRequest(400, f"the body {said}.") from None
    except OverflowError as e:  # was read as inf, where 1e39 is refused for float32
        held = f"{short(str(e), 40)}, beyond float64's range"
        raise _holds(batcher, "the request", held, types) from None
    if not isinstance(data, dict) or "inputs" not in data:
        raise BadRequest(400, (
            'the JSON body must be an object with "inputs": {"inputs": [[...], ...]} (rows '
            'first), or {"inputs": {"args[0]": [...], ...}} naming each input; got '
            f"{type(data).__name__}{' without inputs' if isinstance(data, dict) else ''}."
        ))  # fmt: skip
    inputs = data["inputs"]
    if isinstance(inputs, dict):
        if sorted(inputs) != sorted(names := [s.path for s in specs]):
            raise SignatureError(
                f"{batcher.name}: the request names the inputs {short(str(sorted(inputs)))}, "
                f"but the model takes {names} ({', '.join(map(str, specs))}). Send one entry "
                "per input."
            )
        values = [inputs[n] for n in names]
    elif len(specs) == 1:
        values = [inputs]
    else:
        raise SignatureError(
            f"{batcher.name}: the model takes {len(specs)} inputs ({', '.join(map(str, specs))})"
            '; name them: {"inputs": {"args[0]": [...], "args[1]": [...]}}.'
        )
    # JSON booleans among the numbers ([true, 1.5] would be [1.0, 1.5]): an "l" (false, null) or
    # a "u" past "inputs" (one memchr each), which numbers and input names (args[0]) lack
    bools = b"l" in body or body.find(b"u", body.find(b"inputs") + 6) >= 0
    texts = quotes > 2 + (2 * len(inputs) if isinstance(inputs, dict) else 0)
    if texts and fast:  # strings, other keys, or a key twice: which one a parser takes differs
        json.loads(body, object_pairs_hook=_once)
    arrays = []
    for spec, v, top in zip(specs, values, tops, strict=True):
        x = from_json(batcher, spec, v, bools=bools, texts=texts, top=top)
        if x.ndim != len(spec.shape):  # said in JSON's words (not x[None])
            raise _nested(batcher, spec, x.ndim, x.shape)
        arrays.append(x)
    return arrays, False


def _nested(batcher: Batcher, spec: Any, depth: int, shape: tuple | None = None) -> SignatureError:
    rows = f"lists nested {len(spec.shape)} deep, rows first"
    got, fix = ("a number" if depth == 0 else f"lists nested {depth} deep"), f"send {rows}"
    if shape == (0,):  # {"inputs": []}: it held no rows, not too few lists
        got, fix = "no rows (an empty list)", f"send at least one row, {rows}"
    elif shape == tuple(spec.shape[1:]):
        fix = "wrap the one row in a list, [[...]], a batch of one"
    return _holds(batcher, f"input {spec.path}", got, f"{spec.type}, a list of rows", fix)


@functools.lru_cache(maxsize=64)
def _plan(specs: tuple[Any, ...]) -> tuple[str, int, bool, tuple[float | None, ...]]:
    """Once per signature: its inputs' types (for messages), numbers in a row, whether all are
    floats (orjson may parse the body), each one's top if NumPy's float16/32/64 (from_json)."""
    dtypes = [np.dtype(s.dtype) for s in specs]
    tops = tuple(float(np.finfo(d).max) if d.char in ("e", "f", "d") else None for d in dtypes)
    per_row = sum(math.prod(s.shape[1:]) for s in specs)
    return ", ".join(s.type for s in specs), per_row, all(d.kind == "f" for d in dtypes), tops


def _quotes(body: bytes, n: int) -> int:
    """``body``'s quotes up to ``n`` (a memchr each), or ``n``: a quoted text past 256 bytes."""
    at = start = -1
    for i in range(n):
        at = body.find(b'"', at + 1)
        if at < 0 or (i % 2 and at - start > 256):
            return i if at < 0 else n
        start = at
    return n


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each there once, else a :class:`BadRequest`."""
    keys = [k for k, _ in pairs]
    for k in keys if len(set(keys)) < len(keys) else ():
        if keys.count(k) > 1:
            raise BadRequest(400, (
                f"the JSON body names {short(json.dumps(k), 60)} {keys.count(k)} times in one "
                "object, and JSON parsers differ on which one counts; send each key once."
            ))  # fmt: skip
    return dict(pairs)


def _parse(body: bytes, fast: bool) -> Any:
    """``json.loads(body)``, by orjson if ``fast`` (every input a float: orjson reads an int past
    64 bits as a float); what orjson refuses (``NaN``, 1e400, deep nesting) by the stdlib's,
    which refuses a key twice."""
    if fast:
        try:
            return _fast_loads(body)
        except _FastError:
            pass
    return json.loads(body, parse_float=_finite, object_pairs_hook=_once)


def _finite(text: str) -> float:
    """A JSON number as a float; past float64 (``1e400``, not ``Infinity``), OverflowError."""
    x = float(text)
    if x in (math.inf, -math.inf):
        raise OverflowError(text)
    return x


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
        return _holds(batcher, what, beyond_range(want), spec.type)

    if kind != "b" and bools and _first(value, bool):
        fix = f"send {'integers' if kind in 'iu' else 'numbers'}"
        raise _holds(batcher, what, "JSON booleans (true/false)", spec.type, fix)
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
            raise _holds(batcher, what, held, spec.type, "send integers in range") from None
        raise beyond() from None
    except ValueError as e:  # ragged lists, or nested past NumPy's 64 dimensions
        depth, v = 0, value
        while type(v) is list and v:
            v, depth = v[0], depth + 1
        if depth > len(spec.shape):
            raise _nested(batcher, spec, depth) from None
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
            raise _holds(batcher, what, held, spec.type, "send finite numbers")
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
            raise _holds(batcher, what, held, spec.type)
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
    return _holds(batcher, f"input {spec.path}", held, spec.type, "send JSON booleans")


def _not_numbers(batcher: Batcher, spec: Any, held: str, kind: str, want: Any) -> SignatureError:
    numbers = "integers" if kind in "biu" else "numbers"
    fix = f"send {numbers} (JSON has no dtypes: they are cast to {want})"
    return _holds(batcher, f"input {spec.path}", held, spec.type, fix)


def _holds(
    batcher: Batcher, what: str, held: str, takes: str, fix: str = "send values in range"
) -> SignatureError:
    """A request whose values its input cannot take: the one message form."""
    return SignatureError(
        f"{batcher.name}: {what} holds {held}, but the model takes {takes}; {fix}."
    )


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # json.dumps makes one per call


def to_json(out: Any) -> tuple[bytes, str]:
    """``{"outputs": ...}``, non-finite floats as ``NaN``/``Infinity`` (as TF Serving writes),
    every number as the standard library's json writes it."""
    one = isinstance(out, np.ndarray)
    outputs = out.tolist() if one else [np.asarray(y).tolist() for y in jax.tree.leaves(out)]
    if _fast_dumps is not None:  # orjson: ~20x faster; the same text, but where it says
        try:  # NaN as null, and |x| < 1e-4 as 0.00001 or 1e-8 (Python: 1e-05, 1e-08)
            data = _fast_dumps({"outputs": outputs})
        except _FastWriteError:  # e.g. an int past 64 bits: the stdlib writes it
            data = b"null"
        if b"null" not in data and b"e-" not in data and b"0.0000" not in data:
            return data, "application/json"
    try:
        return _ENCODER.encode({"outputs": outputs}).encode(), "application/json"
    except TypeError as e:  # complex numbers: no JSON number holds them
        raise BadRequest(
            406,
            f"the model's outputs hold values JSON cannot write ({e}); send the request as a "
            f".npy body (Content-Type: {NPY}) to be answered with a .npy.",
        ) from None


def to_npy(out: Any) -> tuple[bytes, str]:
    buf = io.BytesIO()
    if isinstance(out, np.ndarray):
        np.save(buf, out, allow_pickle=False)
        return buf.getvalue(), NPY
    np.savez(buf, **{f"out{i}": np.asarray(y) for i, y in enumerate(jax.tree.leaves(out))})
    return buf.getvalue(), NPZ
