"""A gradient jax.export gets wrong at a symbolic shape, refused: an index out of bounds (Common
Gotchas' ``jnp.arange(10)[11]``, clamped to the last entry) is staged there as a gather that
promises its indices in bounds; forward it clamps as JAX does, but its VJP's scatter drops the
update, so ``jax.grad`` of the loaded model is zero where JAX's own is not (at static shapes
JAX stages a dynamic_slice, which clamps both ways)."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

from symjax_mlp._errors import SignatureError
from symjax_mlp._hybrid.jaxpr import walk

_CLAMPED = (
    "export({name}, vjp_order={order}): the model indexes dimension {dim} of {shape} at "
    "{index}, out of its bounds, which JAX clamps to {last} (its Common Gotchas: an index past "
    "the end reads the last entry). At a symbolic shape jax.export stages that read as a gather "
    "whose gradient drops the clamped entry: jax.grad of the loaded model would be zero there, "
    "and JAX's own is not. Index within the bounds (x[..., {last}], or x[..., -1]), or ask for "
    "the clamp: x.at[...].get(mode='clip'); or export static shapes (batch=None)."
)
_FOLDED = 1 << 12  # the most elements of a constant folded here (an index, not a weight)


def refuse_clamped_gathers(name: str, fn: Any, structs: Any, order: int) -> None:
    """Raises a ``SignatureError`` where ``fn`` traced at ``structs`` (params, *inputs; some
    dimension symbolic) gathers at a constant index out of a static dimension's bounds and the
    artifact carries gradients (``order >= 1``)."""
    shapes = [s.shape for s in jax.tree.leaves(structs)]
    if not order or all(isinstance(d, int) for shape in shapes for d in shape):
        return
    try:  # (jit's cache: export traced it so)
        jaxpr = jax.jit(fn).trace(*structs).jaxpr.jaxpr
    except Exception:  # traced otherwise there (an input shared by every row, a mesh)
        return
    known: dict[Any, Any] = {}
    for eqn, _ in walk(jaxpr):
        values = [v.val if isinstance(v, Literal) else known.get(v) for v in eqn.invars]
        gather = eqn.primitive.name == "gather" and values[1] is not None
        if gather and (said := _out_of_bounds(eqn, np.asarray(values[1]))) is not None:
            raise SignatureError(_CLAMPED.format(name=name, order=order, **said))
        outs = [v.aval for v in eqn.outvars]
        if any(v is None for v in values) or eqn.effects or not _small(outs):
            continue
        try:  # an index computed from constants (jnp's normalisation of 11 or -1)
            got = eqn.primitive.bind(*values, **eqn.params)
        except Exception:  # what cannot fold is no constant here
            continue
        got = got if eqn.primitive.multiple_results else [got]
        known.update(zip(eqn.outvars, got, strict=True))  # (as bound: a key stays a key)


def _small(avals: list[Any]) -> bool:
    shapes = [getattr(a, "shape", None) for a in avals]
    return all(s is not None and all(isinstance(d, int) for d in s) for s in shapes) and all(
        math.prod(s) <= _FOLDED for s in shapes
    )


def _out_of_bounds(eqn: Any, indices: np.ndarray) -> dict[str, Any] | None:
    """Where a gather that promises its indices in bounds gets one outside a static one."""
    if eqn.params["mode"] != jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS or not indices.size:
        return None
    shape, sizes = eqn.invars[0].aval.shape, eqn.params["slice_sizes"]
    for k, dim in enumerate(eqn.params["dimension_numbers"].start_index_map):
        if not isinstance(shape[dim], int) or not isinstance(sizes[dim], int):
            continue
        last, at = shape[dim] - sizes[dim], indices.reshape(-1, indices.shape[-1])[:, k]
        if (bad := at[(at < 0) | (at > last)]).size:
            dims = ", ".join(map(str, shape))
            return {"dim": dim, "shape": f"({dims})", "index": int(bad[0]), "last": last}
    return None
