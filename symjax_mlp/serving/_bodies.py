"""What crosses the wire: a request body (read by :mod:`._intake`) to the model's inputs, and
the model's outputs back.

A JSON body becomes arrays of the inputs' dtypes (:mod:`._values`, refusing what a cast would
change); a ``.npy`` body is read as ``symjax-mlp run`` reads a file. What cannot be read is a
:class:`BadRequest` with its HTTP status; what does not fit the model, a
:class:`~symjax_mlp.SignatureError`.
"""

from __future__ import annotations

import functools
import io
import json
import math
from typing import Any

import jax
import numpy as np

from symjax_mlp._errors import SignatureError
from symjax_mlp._npy import npy_array, read_npy
from symjax_mlp.serving._batcher import Batcher
from symjax_mlp.serving._requests import short
from symjax_mlp.serving._values import from_json, holds, nested

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
_TE = b"transfer-encoding"
_BINARY = "send the file with --data-binary @FILE (-d strips its newlines)"  # curl -d @x.npy


class BadRequest(Exception):
    """A body that cannot be read as a request (answered with ``status``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def decode(
    batcher: Batcher, body: bytes, content_type: str, heads: dict[bytes, bytes] | None = None,
    raw: Any = None,
) -> tuple[list[Any], bool]:  # fmt: skip
    """The request's inputs, and whether it came as .npy (answer in kind); ``heads``: its other
    headers (no Content-Encoding but ``identity`` is decoded: a 415; curl's User-Agent), the
    first of a name; ``raw``: the head's (name, value) pairs, read where a name came twice."""
    heads = heads or {}
    if raw is not None and len(raw) != len(heads):  # a name twice: read (no call else)
        _one_type(raw)  # and Content-Encoding's lines are one list (RFC 9110), not the first
        codings = [b",".join(v for k, v in raw if k == n) for n in (b"content-encoding", _TE)]
        heads = {**heads, b"content-encoding": codings[0], _TE: codings[1]}
    # gets, no generator: each of its steps is a Python call on the hot path
    coding, agent = heads.get(b"content-encoding", b""), heads.get(b"user-agent", b"")
    if _TE in heads and heads[_TE] != b"chunked":  # the parser undid chunked, no other coding
        _chunked(heads[_TE])
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
            raise holds(batcher, "the request", held, types) from None
        deep = f"nests JSON lists or objects too deep to read; send rows of {types}"  # valid
        said = deep if type(e) is RecursionError else f"is not valid JSON ({short(str(e))})"
        raise BadRequest(400, f"the body {said}.") from None
    except OverflowError as e:  # was read as inf, where 1e39 is refused for float32
        held = f"{short(str(e), 40)}, beyond float64's range"
        raise holds(batcher, "the request", held, types) from None
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
            raise nested(batcher, spec, x.ndim, x.shape)
        arrays.append(x)
    return arrays, False


def _chunked(codings: bytes) -> None:
    """A 501 (RFC 9112, 6.1: a transfer coding the server does not understand) if the request's
    Transfer-Encoding names another coding than ``chunked``, which the parser alone undid."""
    if any(c.strip(b" \t").lower() not in (b"", b"chunked") for c in codings.split(b",")):
        raise BadRequest(501, (
            f"the body came with Transfer-Encoding {short(repr(codings.decode('latin-1')), 60)}, "
            "and this server undoes only chunked (its gzip or other would be read as the body); "
            "send the body as it is, with Content-Length or Transfer-Encoding: chunked alone."
        ))  # fmt: skip


def _one_type(raw: Any) -> None:
    """A :class:`BadRequest` if the head ``raw`` names Content-Type more than once."""
    types = [v for k, v in raw if k == b"content-type"]
    if len(types) > 1:
        said = ", ".join(short(repr(v.decode("latin-1")), 60) for v in types[:4])
        raise BadRequest(400, (
            f"the request came with {len(types)} Content-Type headers ({said}), and a proxy "
            "before this server may have read another of them than this server would; send "
            "one Content-Type."
        ))  # fmt: skip


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
