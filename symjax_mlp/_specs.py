"""The path, shape and dtype of an array: an input leaf a Hybrid traced on (its ``weak_type``
matters there) or a tensor of an artifact's contract (a dimension may be a name, ``"b"``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


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
