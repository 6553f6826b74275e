"""A model's inputs read from ``.npy`` files (no pickle), its outputs written to them. ml_dtypes
types are stored as raw bytes (``|V2`` for bfloat16) and read back as the dtype the model
expects; nothing else is cast. An input of another dtype, from a file or a call, is refused here
saying the cast to make (for rng keys, the call that makes or wraps them)."""

from __future__ import annotations

import io
import math
import os
import stat
import sys
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import jax
import ml_dtypes
import numpy as np

from symjax_mlp._errors import SignatureError
from symjax_mlp._files import exhausted, write_output, write_stream
from symjax_mlp._specs import TensorSpec, cast_to, out_of_range


def read_npy(
    source: str | os.PathLike[str] | bytes, *, what: str,
    error: Callable[[str], Exception] = SignatureError, altered: str = "",
) -> np.ndarray:  # fmt: skip
    """The one array of a ``.npy`` file (a path, or its bytes), in this CPU's byte order;
    ``error`` (its message naming ``source`` as ``what``) for an ``.npz``, a pickle, other bytes;
    ``altered``: a note where a .npy's bytes were cut or changed (how they may have been)."""
    head = more = short = None
    try:
        with _opened(source) as f:
            head = f.read(6)
            f.seek(0)
            if short := _refused(f):
                raise error(f"{what} {short}")
            x = np.load(f, allow_pickle=False)
            if not isinstance(x, np.ndarray):  # an .npz archive: the names of its arrays
                names = x.files
                x.close()
                x = None
            more = f.read(1)  # np.save twice into one file: the second array would be dropped
    except Exception as e:  # a bad header, a pickle, a broken zip, a missing file
        if short:
            raise
        if isinstance(e, _Irregular):
            raise error(f"{what} {e}") from None
        if isinstance(e, OSError) and (fix := exhausted(e)):  # the process's limit, not the file's
            raise error(
                f"{what} cannot be opened ({e.strerror}): nothing is wrong with it. {fix}"
            ) from None
        why = str(e)
        if head is not None and not head.startswith((b"\x93NUMPY", b"PK", b"\x80")):
            # NumPy reads any other bytes as a pickle, and says so: not a pickle, not an array
            why = f"it does not begin with .npy's magic string \\x93NUMPY but {head!r}"
            why = "it is empty" if not head else why
        altered = altered if head and head.startswith(b"\x93NUMPY") else ""
        raise error(
            f"{what} is not a readable .npy array ({why}); write one with np.save(file, x)"
            f"{altered}."
        ) from None
    if x is None:
        raise error(
            f"{what} is an .npz archive of {names[:8]!s:.200}; a .npy file holds one array. Save "
            f"the one to pass alone: np.save(file, np.load(archive)[{(names or ['x'])[0][:80]!r}])."
        )
    if more:
        raise error(
            f"{what} has more bytes after its array ({x.dtype}{list(x.shape)}): a second array "
            "saved into the same file, or other data appended. A .npy file holds one array; "
            "save each with its own np.save(file, x)."
        )
    if x.dtype.byteorder == (">" if sys.byteorder == "little" else "<"):
        x = x.astype(x.dtype.newbyteorder("="))  # the same numbers, in this CPU's order
    return x


def read_stream(stream: BinaryIO, *, what: str, memory: int) -> bytes:
    """A ``.npy`` file's bytes from ``stream`` (stdin), for :func:`read_npy`: its first MiB and,
    past it, only the bytes its header declares and one more (a second array is refused), so
    an endless stream is not read to its end (nor past its first MiB if no .npy); a header
    declaring more than ``memory`` (this machine's) bytes is refused."""
    data = _read_up_to(stream, 1 << 20)
    try:
        f = io.BytesIO(data)
        version = np.lib.format.read_magic(f)
        shape, _, dtype = getattr(np.lib.format, f"read_array_header_{min(version[0], 2)}_0")(f)
        end = f.tell() + math.prod(shape) * dtype.itemsize
    except Exception:  # read_npy says what the bytes are
        return data
    if dtype.hasobject:  # refused by read_npy, unread
        return data
    if end - len(data) > memory:
        raise SignatureError(
            f"{what} declares an array of shape {shape} and dtype {dtype}, {end:,} bytes, more "
            f"than this machine's memory ({memory:,} bytes); nothing more of it was read. Pass a "
            "smaller array."
        )
    return data + _read_up_to(stream, end + 1 - len(data))


def _read_up_to(stream: BinaryIO, n: int) -> bytes:
    """At most ``n`` bytes of ``stream``: fewer only at its end."""
    parts = []
    while n > 0 and (chunk := stream.read(min(n, 1 << 24))):
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


class _Irregular(Exception):
    """What :func:`_opened` refuses to read: no regular file."""


def _opened(source: str | os.PathLike[str] | bytes) -> BinaryIO:
    """``source``'s bytes, or its regular file: opened without blocking, as a FIFO would (one
    put in place of a file after the caller checked it, as run checks its --input)."""
    if isinstance(source, bytes):
        return io.BytesIO(source)

    def opener(path: str, flags: int) -> int:
        return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))

    try:
        f = open(source, "rb", opener=opener)  # noqa: SIM115 - read_npy's with closes it
    except IsADirectoryError:
        f = None
    if f is None or not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        if f is not None:
            f.close()
        raise _Irregular(
            "is not a regular file (a FIFO, device or directory); nothing was read from it. "
            "Pass a .npy file."
        )
    return f


_MAX_HEADER = 10_000  # np.load's max_header_size


def _refused(f: BinaryIO) -> str | None:
    """Why a .npy header is refused before NumPy reads on: Python objects (a pickle), or an
    array past the bytes after it (NumPy would allocate it first)."""
    try:
        version = np.lib.format.read_magic(f)
        width = 2 if version[0] == 1 else 4  # the header's size's
        size = int.from_bytes(f.read(width), "little")
        if size > _MAX_HEADER and version[0] <= 3:  # NumPy's refusal: trust it, allow_pickle
            return (
                f"is not a readable .npy array: its header has {size:,} bytes, more than the "
                f"{_MAX_HEADER:,} NumPy reads safely (np.save writes about 128 for an array of "
                "numbers); it was crafted, or its dtype has thousands of fields. Save an array "
                "of numbers: np.save(file, np.asarray(x, np.float32)) (or the dtype expected)."
            )
        f.seek(-width, os.SEEK_CUR)
        header = getattr(np.lib.format, f"read_array_header_{min(version[0], 2)}_0")
        shape, _, dtype = header(f)
        start = f.tell()
        present = f.seek(0, os.SEEK_END) - start
    except Exception:  # np.load says what is wrong
        return None
    finally:
        f.seek(0)
    if dtype.hasobject:
        return (
            f"is not a readable .npy array of numbers: it holds Python objects (dtype {dtype}), "
            "read only by unpickling, which can run code. Save numbers: np.save(file, "
            "np.asarray(x, np.float32)) (or the dtype expected)."
        )
    needs = math.prod(shape) * dtype.itemsize
    if needs <= present:
        return None
    return (
        f"declares an array of shape {shape} and dtype {dtype}, which needs {needs:,} bytes, but "
        f"it holds {present:,} after its header: it is truncated, or its header was edited. "
        "Write it again with np.save(file, x)."
    )


#: JAX's rng-key dtype names, and the impl of each
KEY_IMPLS = {"key<fry>": "threefry2x32", "key<rbg>": "rbg", "key<unsafe_rbg>": "unsafe_rbg"}


def draw(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, *, high: int = 2) -> Any:
    """A random input of the spec dtype ``dtype``: normal floats, integers from 0 below ``high``,
    bools, or rng keys split from one (ml_dtypes' too); ``TypeError`` for another dtype."""
    if dtype in KEY_IMPLS:
        key = jax.random.key(int(rng.integers(2**31)), impl=KEY_IMPLS[dtype])
        return jax.random.split(key, shape) if shape else key
    try:
        kind = np.dtype(dtype if dtype in np.sctypeDict else getattr(ml_dtypes, dtype, dtype))
    except (TypeError, ValueError):
        raise TypeError(dtype) from None
    if kind == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if "int" in kind.name:  # ml_dtypes' int4 too, which is no np.integer
        return rng.integers(0, high, shape).astype(kind)
    if jax.dtypes.issubdtype(kind, np.inexact):
        return rng.standard_normal(shape, np.float32).astype(kind)
    raise TypeError(dtype)


def npy_array(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x``, a void array from a .npy file, viewed as the ml_dtypes type ``dtype`` of its
    itemsize; any other array as it is, for the caller to check."""
    if x.dtype.kind != "V" or x.dtype.names is not None or x.dtype.subdtype is not None:
        return x
    kind = getattr(ml_dtypes, dtype, None)
    same_size = isinstance(kind, type) and issubclass(kind, np.generic)
    return x.view(kind) if same_size and np.dtype(kind).itemsize == x.dtype.itemsize else x


def read_inputs(
    files: Sequence[str | os.PathLike[str] | bytes], specs: Sequence[TensorSpec],
    names: Sequence[str] | None = None,
) -> list[np.ndarray]:  # fmt: skip
    """The ``.npy`` files (paths, or their bytes, called ``names`` in messages) as a model's
    inputs, one per spec (one past the last is read as it is, for the model to refuse); a
    ``SignatureError`` for a file of another dtype."""
    names = [str(file) for file in files] if names is None else names
    xs = [read_npy(file, what=name) for file, name in zip(files, names, strict=True)]
    for i, (file, x, spec) in enumerate(zip(names, xs, specs, strict=False)):
        x = xs[i] = npy_array(x, spec.dtype)
        to = "file" if isinstance(files[i], bytes) else f'"{file}"'  # np.save's first argument
        if spec.dtype.startswith("key<"):  # .npy has no key type: the key's data, as run writes
            xs[i] = _key(file, x, spec, to)
        elif str(x.dtype) != spec.dtype:
            fix = f". Save it as {spec.dtype}: np.save({to}, x.astype({cast_to(spec.dtype)}))."
            if held := out_of_range(x, spec.dtype):
                fix = f": it {held}. Save values in range."
            raise SignatureError(
                f"{file} ({spec.path}) holds {x.dtype}{list(x.shape)} but the artifact expects "
                f"{spec.type}; nothing is cast{fix}"
            )
    return xs


def _key(file: Any, x: np.ndarray, spec: TensorSpec, to: str) -> Any:
    """The rng keys whose data ``x`` holds (``jax.random.key_data``'s uint32, a last axis of
    the impl's size), or a ``SignatureError`` saying how to write them (to ``to``)."""
    impl = KEY_IMPLS.get(spec.dtype)
    size = _key_size(impl or "threefry2x32")
    if impl and x.dtype == np.uint32 and x.shape[-1:] == (size,):
        return jax.random.wrap_key_data(x, impl=impl)
    raise SignatureError(
        f"{file} ({spec.path}) holds {x.dtype}{list(x.shape)} but the artifact expects "
        f"{spec.type}, rng keys, which .npy stores as their data: uint32 with a last axis of "
        f"{size}. Save the keys' data: np.save({to}, jax.random.key_data(keys))."
    )


def _key_size(impl: str) -> int:
    """The length of one key's data (``jax.random.key_data``'s last axis) for ``impl``."""
    return int(jax.random.key_data(jax.random.key(0, impl=impl)).shape[-1])


#: why an array a user's code made is float64 where it was float32 before
X64 = " (jax_enable_x64 is on: jnp.ones, jnp.asarray of Python floats and jax.random make float64)"


def dtype_refused(caller: str, spec: TensorSpec, x: Any, given: Any) -> str:
    """The message for a call's input ``x`` (``given`` as the caller passed it) of a dtype not
    ``spec``'s: for rng keys, how to make them (:func:`_key_refused`); else the values a cast
    would change past ``spec``'s range, else the cast to make."""
    if spec.dtype.startswith("key<"):
        return _key_refused(caller, spec, x)
    if not (held := out_of_range(x, spec.dtype)):
        made = isinstance(given, jax.Array) and jax.config.jax_enable_x64  # by jnp, not np
        why = X64 if x.dtype == "float64" and made else ""
        return (
            f"{caller}: input {spec.path} has dtype {x.dtype}{why} but the artifact expects "
            f"{spec.type}. Cast it: x.astype({cast_to(spec.dtype)})."
        )
    python = "" if hasattr(given, "dtype") else f" (a Python {type(given).__name__})"
    return (
        f"{caller}: input {spec.path} has dtype {x.dtype}{python} but the artifact expects "
        f"{spec.type}: it {held}. Pass values in range."
    )


def weakly_typed(x: Any) -> bool:
    """Whether jit traces ``x`` weakly typed (type_promotion.rst): a Python number, or an array
    that is (``jnp.asarray(2)``). Export traces it so, as the Hybrid did: else a bfloat16
    model's ``* 0.5`` promotes to float32, an int8 input times ``2`` to int32."""
    return type(x) in (int, float, complex) or bool(getattr(x, "weak_type", False))


def weak_refusal(caller: str, spec: TensorSpec, given: Any, strong: bool) -> str | None:
    """Why ``given`` is refused where ``spec`` takes only a weakly typed scalar (exported at a
    Python number) or, ``strong``, only strongly typed values; ``None`` where it is taken."""
    if weakly_typed(given) == spec.weak_type or not (spec.weak_type or strong):
        return None
    two, dtype, weak = "2" if "int" in spec.dtype else "2.0", spec.dtype, spec.weak_type
    got = f"a {'JAX' if hasattr(given, 'weak_type') else 'NumPy'} {getattr(given, 'dtype', '')}"
    got = f"{got}{list(np.shape(given))}, {'strongly' if weak else 'weakly'} typed"
    if type(given) in (int, float, complex):
        got = f"the Python {type(given).__name__} {str(given)[:40]}, weakly typed"
    eg = ("2.0", "np.float32(2.0)") if not spec.shape else ("jnp.full(s, 2.0)", "jnp.ones(s)")
    if weak:
        takes = f"a Python number such as {two}, as it was exported"
        fix = f"Pass a Python number, x.item(); or export at np.{dtype}({two}) to take arrays."
    elif not spec.shape:
        takes = f"a strongly typed {dtype} scalar such as np.{dtype}({two}), as it was exported"
        fix = f"Pass np.{dtype}(x); or export at a Python number to take weakly typed ones."
    else:
        takes = f"a strongly typed {dtype} array, as NumPy arrays and jnp.ones(s) are"
        fix = f"Pass x.astype(jnp.{dtype}) (jnp.full(s, {two}) and jax.vmap over numbers are weak)."
    return (
        f"{caller}: input {spec.path} takes only {takes}; got {got}, which the model answers "
        f"in other dtypes (a bfloat16 model times {eg[0]} answers bfloat16, times {eg[1]} "
        f"float32). {fix}"
    )


def _key_refused(caller: str, spec: TensorSpec, x: Any) -> str:
    """The message for ``x``, no rng keys of ``spec``'s dtype (``key<fry>``): a raw key's data
    (``jax.random.PRNGKey``'s uint32[2]) is wrapped; other arrays, keys are made (no cast makes
    one), of the impl the artifact records."""
    impl = KEY_IMPLS.get(spec.dtype)
    name = repr(impl) if impl else f"'...' (the {spec.dtype} impl it was exported with)"
    got = f"{caller}: input {spec.path} is {x.dtype}{list(x.shape)}"
    want = f"the artifact expects {spec.type}, typed rng keys of impl {name}"
    raw = x.dtype == np.uint32 and len(x.shape) == len(spec.shape) + 1
    if impl and raw and x.shape[-1] == _key_size(impl):
        return (
            f"{got}, raw key data (jax.random.PRNGKey's), but {want}. Wrap it: "
            f"jax.random.wrap_key_data(x, impl={name})."
        )
    return (
        f"{got} but {want}; no cast makes a key. Pass keys made so: jax.random.key(seed, "
        f"impl={name}) (from raw uint32 key data: jax.random.wrap_key_data(data, impl={name}))."
    )


_NPZ = "Write to a .npz path to keep them all (out0, out1, ...)."


def write_outputs(
    out: Any, target: str | os.PathLike[str] | BinaryIO, *more: tuple[Any, Any], fix: str = _NPZ
) -> list[np.ndarray]:
    """Writes a model's outputs: one array as ``.npy`` to a path or stream, or all into a
    ``.npz`` path (``out0``, ...); ``more``: further ``(out, target)`` pairs, all paths or
    none. Returns the first's arrays; a ``SignatureError`` for several outputs to a ``.npy``,
    ``fix`` saying what to do (the caller's ways: the command line's ``--output`` per output)."""
    files, streams, first = [], [], None
    for y, to in ((out, target), *more):
        outs = arrays(y)
        is_path = isinstance(to, str | os.PathLike)
        buffer = io.BytesIO()
        if is_path and os.fspath(to).lower().endswith(".npz"):
            np.savez(buffer, **{f"out{i}": a for i, a in enumerate(outs)})
        elif len(outs) != 1:
            name = os.fspath(to) if is_path else getattr(to, "name", "the stream")
            raise SignatureError(
                f"the model returns {len(outs)} arrays, but {name} is one .npy array. {fix}"
            )
        else:
            np.save(buffer, outs[0])
        (files if is_path else streams).append((to, buffer.getvalue()))
        first = outs if first is None else first
    write_output(*files)  # whole or not at all
    for stream, data in streams:
        write_stream(stream, data)
    return first


def arrays(out: Any) -> list[np.ndarray]:
    """A model's output (an array or a tuple of them) as a list of NumPy arrays (:func:`host`)."""
    return [host(y) for y in (out if isinstance(out, tuple) else (out,))]


def host(a: Any) -> np.ndarray:
    """``a`` as a NumPy array; an rng key as its key data (NumPy has no key type)."""
    jax = sys.modules.get("jax")  # no JAX imported: no key array can exist
    if jax is not None and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a)


def raw_dtype_notes(arrays: Sequence[np.ndarray]) -> list[str]:
    """How to read back each ml_dtypes type that ``.npy`` stored as raw bytes, one line each."""
    raw = {
        str(y.dtype): y.dtype.itemsize for y in arrays if y.dtype.kind == "V" and not y.dtype.names
    }
    return [
        f".npy has no {name} type, so it is stored as |V{size} (the same bytes); read it back "
        f"with np.load(...).view(ml_dtypes.{name})"
        for name, size in sorted(raw.items())
    ]
