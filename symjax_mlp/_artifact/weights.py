"""``params.safetensors``: the weights, one tensor per param path (``params/layers_0/kernel``).

Written with safetensors' serializer; read back by a reader stricter than the ``safetensors``
package (no name twice, no unknown field, the tensors' bytes tiling the file exactly).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import safetensors

from symjax_mlp._artifact.format import (
    MAX_PARAMS,
    VALUES_PER_TENSOR,
    is_int,
    is_size,
    printable,
    show,
    unique_pairs,
)
from symjax_mlp._errors import (
    CHECKPOINT_STATE,
    EXPORT_CHECKPOINT,
    ArtifactError,
    ConfigError,
    SymjaxError,
)
from symjax_mlp._reader import Reader, refusal, too_many_values
from symjax_mlp._specs import TensorSpec, cast_to

_ST_DTYPES = {  # safetensors dtype codes -> NumPy dtypes (bfloat16 from ml_dtypes, as in JAX)
    **{f"F{n}": np.dtype(f"float{n}") for n in (16, 32, 64)},
    **{f"I{n}": np.dtype(f"int{n}") for n in (8, 16, 32, 64)},
    **{f"U{n}": np.dtype(f"uint{n}") for n in (8, 16, 32, 64)},
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "BOOL": np.dtype(np.bool_),
    "C64": np.dtype(np.complex64),
}
_NP_TO_ST = {v: k for k, v in _ST_DTYPES.items()}
_KEY_ATTRS = ("key", "idx", "name")  # what names a dict's, a sequence's, an attribute's key


_ODD_PATH = (
    "{caller}: a param has the path {path!r}, which an artifact cannot name: a path is "
    "at most 4096 printable characters (no newline, tab or control character) and not "
    "safetensors' reserved '__metadata__'; load would refuse the artifact. Rename that key."
)


def check_paths(caller: str, paths: Sequence[str]) -> None:
    """Refuses param paths that ``params.safetensors`` cannot name: twice, or unprintable."""
    if len(set(paths)) < len(paths):
        twice = sorted({p for p in paths if paths.count(p) > 1})
        raise ConfigError(
            f"{caller}: two params share the path {twice[0]!r} (keys that print alike, "
            "such as 1 and '1', or that join alike, such as 'a/b' and 'a' holding 'b'); "
            "params.safetensors names each tensor by its path. Rename one."
        )
    if odd := next((p for p in paths if not _storable_path(p)), None):
        raise ConfigError(_ODD_PATH.format(caller=caller, path=odd))


def _storable_path(path: str) -> bool:  # as params.safetensors and the manifest name it
    return path.isprintable() and len(path) <= 4096 and path != "__metadata__"


_HIJAX_PARAM = (
    "param {path} is a {kind}, a value of a jax.experimental.hijax type: jax.export lowers it "
    "to arrays inside a program, but params.safetensors stores arrays, not {kind}s. Keep the "
    "arrays it is made from as the params and make the {kind} inside the model (hijax-types.md's "
    "quantize(w) of float weights w)."
)


def param_specs(tree: Any, caller: str = "") -> tuple[list[TensorSpec], list[np.ndarray]]:
    """Flattens a params pytree into (specs, host arrays), paths joined with ``/``, each array
    in the dtype JAX traces it with (with x64 off, float64 params are float32), so that the
    same params passed to ``load(params=...)`` match the manifest; ``caller`` heads errors.
    A NumPy array is copied: JAX on CPU aliases one at a 64-byte boundary, and the caller's
    later change to it would reach a loaded model (a JAX array's read-only view is kept)."""
    try:
        return _param_specs(tree)
    except ArtifactError as e:
        raise (ArtifactError(f"{caller}: {e}") if caller else e) from None


def param_paths(tree: Any) -> Iterator[tuple[str, Any]]:
    """``tree``'s leaves by the paths that name them in an artifact (keys joined by ``/``)."""
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(next((getattr(k, a) for a in _KEY_ATTRS if hasattr(k, a)), k)) for k in keys]
        path = "/".join(parts) or "params"  # a single array as the params: one tensor
        if "" in parts or "" in path.split("/"):  # 'mlp/~/linear_0' joins, 'a/' and 'a//b' not
            raise ArtifactError(
                f"param path {path!r} has an empty key ('/' joins keys into "
                "params.safetensors' paths). Rename the key."
            )
        yield path, leaf


def _param_specs(tree: Any) -> tuple[list[TensorSpec], list[np.ndarray]]:
    specs, arrays = [], []
    for path, leaf in param_paths(tree):
        arr = np.asarray(leaf)
        if arr.dtype.kind in "OUSV" and not hasattr(leaf, "dtype"):  # a function, str, object
            from symjax_mlp._hybrid.args import traceable

            if traceable(leaf):  # a hijax type's value (a Hybrid passes it to jit whole)
                raise ArtifactError(_HIJAX_PARAM.format(path=path, kind=type(leaf).__name__))
            raise ArtifactError(
                f"param {path} is a {type(leaf).__name__}, not an array: params are a tree of "
                "arrays, as h.params holds them (of an equinox model, its float arrays: "
                "eqx.filter(model, eqx.is_inexact_array)). Pass that tree."
            )
        if arr.flags.writeable or arr.base is None or isinstance(arr.base, np.ndarray):
            arr = arr.copy()  # NumPy's, not JAX's buffer: the caller may still change it
        if (to := jax.dtypes.canonicalize_dtype(arr.dtype)) != arr.dtype:  # x64 off: 32 bits
            arr = _narrowed(path, arr, to)
        if arr.dtype not in _NP_TO_ST:
            raise ArtifactError(
                f"param {path} is {arr.dtype}, which params.safetensors cannot hold (it holds "
                "bool, integers, float16, bfloat16, float32, float64 and complex64). Cast it to "
                "one of those (complex128 to complex64), or store its parts as params of their own."
            )
        specs.append(TensorSpec(path, tuple(arr.shape), str(arr.dtype)))
        arrays.append(arr)
    return specs, arrays


def _narrowed(path: str, arr: np.ndarray, to: np.dtype) -> np.ndarray:
    """``arr`` as ``to``; an :class:`ArtifactError` where a value does not fit (1e39: inf)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(to)
    if arr.dtype.kind in "iu" and np.array_equal(out.astype(arr.dtype), arr):
        return out
    if arr.dtype.kind in "fc" and np.array_equal(np.isfinite(out), np.isfinite(arr)):
        return out
    raise ArtifactError(
        f"param {path} is {arr.dtype} with values beyond {to}'s range, the dtype JAX computes it "
        f"in with x64 off: they would change ({'inf' if to.kind in 'fc' else 'wrapped'}). Scale "
        f"them into {to}'s range, or enable x64 (jax.config.update('jax_enable_x64', True))."
    )


def encode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """``tensors`` by name as safetensors bytes, ``metadata`` (strings) its ``__metadata__``."""
    keep = {k: np.asarray(a, order="C") for k, a in tensors.items()}  # 0-d stays 0-d
    specs = {k: safetensors.TensorSpec(dtype=str(a.dtype), shape=list(a.shape),
                                       data_ptr=a.ctypes.data, data_len=a.nbytes)
             for k, a in keep.items()}  # fmt: skip
    data = serialized(lambda: safetensors.serialize(specs), sum(a.nbytes for a in keep.values()))
    n = int.from_bytes(data[:8], "little")  # metadata ours: Rust's is a HashMap, order random
    header = {**({"__metadata__": dict(sorted(metadata.items()))} if metadata else {}),
              **json.loads(data[8 : 8 + n])}  # fmt: skip
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the tensors 8-byte aligned, as safetensors writes them
    return b"".join([len(text).to_bytes(8, "little"), text, memoryview(data)[8 + n :]])


def serialized(make: Callable[[], bytes], nbytes: int) -> bytes:
    """``make()``, safetensors' bytes of ``nbytes`` of tensors, or a MemoryError saying so:
    safetensors builds them in Rust, then copies them into Python, and where it cannot allocate
    Rust aborts the process (pyo3 panics for Python), so the room for both is asked first."""
    said = (
        f"out of memory serializing {nbytes:,} bytes of tensors (safetensors holds them twice "
        "at once): free memory, or raise this process's limit (ulimit -v), and write them again."
    )
    try:
        np.empty(2 * nbytes + (1 << 20), np.uint8)  # mapped, never touched: only room asked
    except MemoryError:
        raise MemoryError(said) from None
    try:
        return bytes(make())
    except BaseException as e:  # pyo3's PanicException, where Python could not allocate
        if type(e).__name__ != "PanicException" or "null" not in str(e):
            raise
        raise MemoryError(said) from None


def decode_params(data: bytes | bytearray, *, file: Path | str) -> dict[str, np.ndarray]:
    """Parses safetensors bytes into ``{path: array}``: read-only views of ``data``, no copy;
    anything but a valid file is an ``ArtifactError`` naming ``file``."""
    refuse = functools.partial(refusal, ArtifactError, file)
    entries, _, start = _parse_header(data.__getitem__, len(data), refuse, MAX_TENSORS)
    out = {}
    for begin, _, name, dtype, shape, count in entries:
        a = np.frombuffer(data, _ST_DTYPES[dtype], count=count, offset=start + begin)
        out[name] = _frozen(a.reshape(shape))
    return out


MAX_TENSORS = MAX_PARAMS
MAX_HEADER_BYTES = 100_000_000  # the safetensors package's own limit
_ST_ITEMSIZE = {k: v.itemsize for k, v in _ST_DTYPES.items()}


def read_safetensors_file(
    file: Path,
    *,
    size: int | None = None,
    sha256: str | None = None,
    error: type[SymjaxError] = ArtifactError,
    max_tensors: int = MAX_TENSORS,
    expected: Sequence[TensorSpec] | None = None,
    fix: str | None = None,
    select: Callable[[dict[str, np.ndarray]], Container[str]] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file read in one hashed pass, each tensor in a
    64-byte-aligned buffer; FileNotFoundError for no file, ``error`` for anything else. Its
    header is checked against ``expected`` (an artifact's own params) before any tensor is;
    ``select(declared)`` (the header's tensors as views of a 0-d array: nothing held) checks
    them too and names those to read, the others hashed, never held; ``fix``: the caller's, in
    place of each refusal's own (a checkpoint's)."""
    with Reader(file, size=size, error=error, fix=fix) as r:

        def read(at: slice) -> bytes:  # called in file order
            return r.read(at.stop - at.start)

        entries, metadata, start = _parse_header(read, r.size, r.refuse, max_tensors)
        if (held := r.size - start) > memory():  # a sparse file is terabytes of nothing
            raise r.refuse(
                f"holds {held:,} bytes of tensors, more than this machine's memory "
                f"({memory():,} bytes); nothing was read",
                "Load it where they fit.",
            )
        declared = {  # the header, before any tensor is allocated (views of 0-d)
            e[2]: np.broadcast_to(np.zeros((), _ST_DTYPES[e[3]]), e[4]) for e in entries
        }
        if expected is not None:
            check_params(declared, expected, file=file, own=True)
        wanted = declared if select is None else select(declared)
        out = {}
        for _, _, name, dtype, shape, count in entries:  # in file order, back to back
            nbytes = count * _ST_ITEMSIZE[dtype]
            if name not in wanted:
                r.skip(nbytes)
                continue
            raw = np.empty(nbytes + 64, np.uint8)
            start = (-raw.ctypes.data) % 64
            raw = raw[start : start + nbytes]
            r.readinto(memoryview(raw))
            out[name] = _frozen(raw.view(_ST_DTYPES[dtype]).reshape(shape))
        r.finish(sha256)
    return out, metadata


def memory() -> int:
    """This machine's physical memory in bytes (2**62, no bound, where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _parse_header(
    read: Callable[[slice], Any],
    n: int,
    refuse: Callable[[str], Exception],
    max_tensors: int,
) -> tuple[list[tuple[int, int, str, str, list[int], int]], dict[str, str], int]:
    """The header's tensors, in file order, checked to tile the file's ``n`` bytes exactly; its
    ``__metadata__``; and where the data starts. ``read(slice(start, stop))`` gives its bytes;
    ``refuse(what)``: the error naming the file (:func:`~symjax_mlp._reader.refusal`)."""

    def bad(why: str) -> Exception:
        return refuse(f"is not a valid safetensors file: {why}")

    if n < 8:
        raise bad(f"it has {n} bytes, fewer than the 8 of its header length")
    size = int.from_bytes(read(slice(0, 8)), "little")
    if size > MAX_HEADER_BYTES or 8 + size > n:
        raise bad(f"its header claims {size:,} bytes, but the file has {n:,}")
    text_bytes = bytes(read(slice(8, 8 + size)))
    if message := too_many_values(text_bytes, VALUES_PER_TENSOR * max_tensors):
        raise bad(f"its header {message}")
    try:
        text = text_bytes.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("the header is not a JSON object")
        header = json.loads(text, object_pairs_hook=unique_pairs)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError too
        raise bad(f"its header is not valid JSON ({str(e)[:200]})") from None
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("its __metadata__ is not an object of strings")
    if len(header) > max_tensors:
        raise bad(f"it holds {len(header):,} tensors, more than the {max_tensors:,} allowed")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {show(name)} is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
            raise bad(f"tensor {show(name)} has the unsupported dtype {show(dtype)}")
        if not isinstance(shape, list) or len(shape) > 32 or not all(map(is_size, shape)):
            raise bad(f"tensor {show(name)} has the shape {show(shape)}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_int, offsets)):
            raise bad(f"tensor {show(name)} has the data_offsets {show(offsets)}")
        if math.prod(max(d, 1) for d in shape) * _ST_ITEMSIZE[dtype] >= 1 << 62:
            raise bad(f"tensor {show(name)} has the shape {show(shape)}, too large for NumPy")
        entries.append((offsets[0], offsets[1], name, dtype, shape, math.prod(shape)))
    entries.sort(key=lambda e: (e[0], e[1]))
    end = 0
    for begin, stop, name, dtype, shape, count in entries:
        if begin != end or stop < begin:
            raise bad(f"tensor {show(name)}'s bytes [{begin}, {stop}) do not follow the last "
                      f"tensor's, which end at {end}")  # fmt: skip
        if stop - begin != count * _ST_ITEMSIZE[dtype]:
            raise bad(
                f"tensor {show(name)} is {dtype}{shape} ({count * _ST_ITEMSIZE[dtype]} bytes) "
                f"but has {stop - begin}"
            )
        end = stop
    if 8 + size + end != n:
        raise bad(f"its tensors end at byte {8 + size + end:,}, but the file has {n:,}")
    return entries, metadata, 8 + size


MAX_LISTED = 20  # mismatches an error message lists


_OWN = (
    "The artifact's own weights disagree with its manifest (it was edited, or mixes two "
    "exports); export it again."
)


def check_params(
    found: Mapping[str, np.ndarray], expected: Sequence[TensorSpec], *, file: Path | str,
    own: bool = False,
) -> list[np.ndarray]:  # fmt: skip
    """Matches params against the manifest's param tree (``own``: the artifact's weights, not
    weights passed in); returns them in call order.

    Raises:
      ArtifactError: listing (up to :data:`MAX_LISTED`) missing, extra (and likely renamed)
        params, or a shape/dtype mismatch.
    """
    if len(found) > MAX_PARAMS:
        raise ArtifactError(
            f"{file} holds {len(found):,} params, more than the {MAX_PARAMS:,} an artifact may "
            "have. Use the weights of the same model."
        )
    want = {s.path: s for s in expected}
    missing = [k for k in want if k not in found]
    extra = [k for k in found if k not in want]
    state = ("params/", "opt_state/")  # and "rng": a training checkpoint's tensors
    if extra and "rng" in found and all(k.startswith(state) for k in found if k != "rng"):
        raise ArtifactError(CHECKPOINT_STATE.format(file=file) + EXPORT_CHECKPOINT + ".")
    if missing or extra:
        extras = [TensorSpec(e, tuple(found[e].shape), str(found[e].dtype)) for e in extra]
        twins: dict[str, list[str]] = {}  # by type: a missing param's likely new name
        for s in extras:
            twins.setdefault(s.type, []).append(s.path)
        lines = []
        for label, specs in (("missing:", [want[m] for m in missing]), ("extra:  ", extras)):
            for s in specs[:MAX_LISTED]:
                twin = twins.get(s.type, []) if label == "missing:" else []
                lines.append(
                    f"  {label} {s}" + (f" (renamed to {twin[0]}?)" if len(twin) == 1 else "")
                )
            if len(specs) > MAX_LISTED:
                lines.append(f"  ... and {len(specs) - MAX_LISTED:,} more {label.strip(' :')}")
        raise ArtifactError(
            f"{file} does not match the artifact's param tree ({len(missing)} missing, "
            f"{len(extra)} extra):\n"
            + "\n".join(printable(t if len(t) < 200 else t[:196] + "...") for t in lines)
            + "\n"
            + (_OWN if own else "Use weights of the same model (same layer names and sizes), "
               "e.g. the params.safetensors of another export of it.")
        )  # fmt: skip
    ordered = []
    for s in expected:
        a = found[s.path]
        if tuple(a.shape) != tuple(s.shape) or str(a.dtype) != s.dtype:
            fix = _OWN if own else "Use weights of the same architecture."
            lossless = a.dtype.kind != "c" or s.dtype.startswith("complex")  # else a real
            if tuple(a.shape) == tuple(s.shape) and not own and lossless:  # model's: no cast
                fix = f"Cast them: x.astype({printable(cast_to(s.dtype))}) for each."
            raise ArtifactError(
                f"{file}: param {printable(s.path)} is {a.dtype}{list(a.shape)} but the "
                f"artifact expects {printable(s.type)}. {fix}"
            )
        ordered.append(a)
    return ordered
