"""The path, shape and dtype of an array: an input leaf a Hybrid traced on (its ``weak_type``
matters there) or a tensor of an artifact's contract (a dimension may be a name, ``"b"``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from symjax_mlp._errors import SignatureError


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One array: a path, a shape (ints and symbolic names), a dtype, and JAX's weak type.

    Example:
      >>> from symjax_mlp import TensorSpec
      >>> str(TensorSpec("args[0]", ("b", 512), "float32"))
      'args[0]: float32[b, 512]'
    """

    path: str
    shape: tuple[int | str, ...]
    dtype: str
    weak_type: bool = False

    def __str__(self) -> str:
        weak = " (weak)" if self.weak_type else ""
        return f"{self.path}: {self.type}{weak}"

    @property
    def type(self) -> str:
        """``float32[b, 512]``: the dtype and the shape, symbolic dimensions by name."""
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TensorSpec:
        return cls(str(d["path"]), tuple(d["shape"]), str(d["dtype"]))


def shape_dims(shape: Sequence[Any]) -> tuple[int | str, ...]:
    """A JAX shape as spec dims: ints stay, symbolic dimensions become their names."""
    return tuple(d if isinstance(d, int) else str(d) for d in shape)


_UNSERIALIZABLE = (
    "export({name}): {path} is {type}, which jax.export cannot serialize. An artifact's inputs "
    "and outputs are bool, int4 to int64, uint4 to uint64 or floats (float4_e2m1fn, the float8 "
    "types, bfloat16, float16 to float64). Cast it to {cast}: give an input as {cast} (cast it "
    "back to {dtype} inside the model if it must be), return an output as out.astype(jnp.{cast})."
)


def unserializable(name: str, structs: Mapping[str, Any]) -> SignatureError | None:
    """The :class:`~symjax_mlp.SignatureError` for the first of ``structs`` (by path) whose
    dtype ``jax.export`` cannot serialize (int2: its raw ``KeyError``; uint1: a lowering's
    ``ValueError``); ``None`` if it can serialize them all. Imports JAX."""
    import jax
    import jax.numpy as jnp

    for path, x in structs.items():
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) or _serializable(x.dtype):
            continue  # an rng key's dtype is extended: serialized as its kind
        dtype = np.dtype(x.dtype)
        kinds = [("float16", jnp.floating), ("uint8", jnp.unsignedinteger), ("int8", jnp.integer)]
        cast = next((c for c, kind in kinds if jnp.issubdtype(dtype, kind)), "complex64")
        spec = TensorSpec(path, shape_dims(x.shape), str(dtype))
        return SignatureError(
            _UNSERIALIZABLE.format(name=name, path=path, type=spec.type, cast=cast, dtype=dtype)
        )
    return None


@functools.cache
def _serializable(dtype: Any) -> bool:
    """Whether ``jax.export`` serializes ``dtype``, probed once: the identity exported on it."""
    import jax

    try:
        jax.export.export(jax.jit(lambda x: x))(jax.ShapeDtypeStruct((1,), dtype)).serialize()
    except Exception:  # KeyError (int2), TypeError (complex32), ValueError (uint1), ...
        return False
    return True


def array_types() -> frozenset[type]:
    """The concrete array types a hot path may take as they are: ``np.ndarray`` and every class
    below ``jax.Array`` (a tracer is not one), found without creating an array (which would
    start JAX's backend). Imports JAX: call it where JAX is imported anyway."""
    import jax
    import numpy as np

    types, todo = {np.ndarray}, [jax.Array]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in types:
                types.add(sub)
                todo.append(sub)
    return frozenset(types)


#: A NumPy masked array given as an input, refused by a Hybrid's call and a loaded model's
#: (neither JAX nor an artifact has a mask: it would be dropped without a word).
MASKED_INPUT = (
    "{caller}: input {path} is a NumPy masked array, and a compiled program has no mask: it "
    "would compute on the masked entries' hidden values as if they were data. Fill them with "
    "the value that means 'missing' to your model, x.filled(value) (e.g. x.filled(0.0)), or "
    "pass np.asarray(x) to use the data under the mask as it is."
)


def cast_to(dtype: str) -> str:
    """``dtype`` as a cast names it: ``np.float32``; ``jnp.bfloat16`` for ml_dtypes' types,
    which NumPy does not name. Looked up, never ``getattr(np, ...)``: a stranger's manifest may
    name ``object``, which NumPy warns about."""
    numpys = getattr(np.sctypeDict.get(dtype), "__module__", None) == "numpy"  # not ml_dtypes'
    return f"{'np' if numpys else 'jnp'}.{dtype}"
