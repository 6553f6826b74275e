"""``params.safetensors``: the weights, one tensor per param path, readable from any language.

Paths join the param tree's keys with ``/`` (``params/layers_0/kernel``). Tensors are written
and read with safetensors' raw (de)serializer, so the common dtypes, bfloat16 included,
round-trips, and reading never involves pickle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

from symjax_mlp._errors import ArtifactError
from symjax_mlp._specs import TensorSpec

# safetensors dtype codes <-> NumPy dtypes (bfloat16 comes from ml_dtypes, as in JAX).
_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NP_TO_ST = {v: k for k, v in _ST_DTYPES.items()}


def param_specs(tree: Any) -> tuple[list[TensorSpec], list[np.ndarray]]:
    """Flattens a params pytree into (specs, host arrays), paths joined with ``/``."""
    import jax

    specs, arrays = [], []
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [_key_name(k) for k in keys]
        bad = [p for p in parts if "/" in p or not p]
        if bad:
            raise ArtifactError(
                f"param key {bad[0]!r} is empty or contains '/', which joins param paths in "
                "params.safetensors. Rename it."
            )
        arr = np.asarray(leaf)
        if arr.dtype not in _NP_TO_ST:
            raise ArtifactError(
                f"param {'/'.join(parts) or 'params'} has dtype {arr.dtype}, which "
                "safetensors cannot store. Cast it (to float32, int32, ...) before exporting."
            )
        path = "/".join(parts) or "params"  # a single array as the params: one tensor
        specs.append(TensorSpec(path, tuple(arr.shape), str(arr.dtype)))
        arrays.append(arr)
    return specs, arrays


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def encode_params(
    specs: Sequence[TensorSpec],
    arrays: Sequence[np.ndarray],
    *,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """Serializes params to safetensors bytes, one tensor per param path; ``metadata`` (a
    model card, strings) goes into the file's ``__metadata__`` beside the format tag."""
    keep = [np.array(a, order="C", copy=None) for a in arrays]  # 0-d stays 0-d
    tensors = {
        s.path: safetensors.TensorSpec(
            dtype=str(a.dtype),
            shape=list(a.shape),
            data_ptr=a.ctypes.data,
            data_len=a.nbytes,
        )
        for s, a in zip(specs, keep, strict=True)
    }
    header = {**(metadata or {}), "format": "symjax_mlp.params"}
    return bytes(safetensors.serialize(tensors, metadata=header))


def decode_params(data: bytes, *, file: Path | str) -> dict[str, np.ndarray]:
    """Parses safetensors bytes into ``{path: array}`` (read-only views, no pickle)."""
    try:
        flat = safetensors.deserialize(data)
    except Exception as e:  # safetensors raises its own SafetensorError
        raise ArtifactError(f"{file} is not a valid safetensors file: {e}") from e
    out = {}
    for name, t in flat:
        if t["dtype"] not in _ST_DTYPES:
            raise ArtifactError(f"{file}: tensor {name} has unsupported dtype {t['dtype']}.")
        out[name] = np.frombuffer(t["data"], _ST_DTYPES[t["dtype"]]).reshape(t["shape"])
    return out


def _spec_of(name: str, a: np.ndarray) -> TensorSpec:
    return TensorSpec(name, tuple(a.shape), str(a.dtype))


def check_params(
    found: Mapping[str, np.ndarray], expected: Sequence[TensorSpec], *, file: Path | str
) -> list[np.ndarray]:
    """Matches params against the manifest's param tree; returns them in call order.

    Raises:
      ArtifactError: naming missing, extra (and likely renamed) keys, or shape/dtype mismatches.
    """
    want = {s.path: s for s in expected}
    missing = [k for k in want if k not in found]
    extra = [k for k in found if k not in want]
    if missing or extra:
        lines = []
        for m in missing:
            s = want[m]
            twin = [e for e in extra if _spec_of(e, found[e]) == TensorSpec(e, s.shape, s.dtype)]
            hint = f" (renamed to {twin[0]}?)" if len(twin) == 1 else ""
            lines.append(f"  missing: {s}{hint}")
        lines += [f"  extra:   {_spec_of(e, found[e])}" for e in extra]
        raise ArtifactError(
            f"{file} does not match the artifact's param tree ({len(missing)} missing, "
            f"{len(extra)} extra):\n" + "\n".join(lines) + "\nUse weights of the same model "
            "(same layer names and sizes), e.g. the params.safetensors of another export of it."
        )
    ordered = []
    for s in expected:
        a = found[s.path]
        if tuple(a.shape) != tuple(s.shape) or str(a.dtype) != s.dtype:
            raise ArtifactError(
                f"{file}: param {s.path} is {a.dtype}{list(a.shape)} but the artifact expects "
                f"{s.type}. Use weights of the same architecture."
            )
        ordered.append(a)
    return ordered
