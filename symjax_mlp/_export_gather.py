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
_PROMISED = jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS
_FOLDED = 1 << 12  # the most elements of a constant folded here (an index, not a weight)


def refuse_clamped_gathers(name: str, jaxpr: Any, order: int) -> None:
    """Raises a ``SignatureError`` where ``jaxpr`` (export's trace of params, *inputs; some
    dimension symbolic) gathers at a constant index out of a static dimension's bounds and the
    artifact carries gradients (``order >= 1``)."""
    shapes = [getattr(v.aval, "shape", ()) for v in jaxpr.invars]
    if not order or all(isinstance(d, int) for shape in shapes for d in shape):
        return
    eqns, known = [eqn for eqn, _ in walk(jaxpr)], {}
    needed = _indexing(eqns)
    for eqn in eqns:
        values = [v.val if isinstance(v, Literal) else known.get(v) for v in eqn.invars]
        gather = eqn.primitive.name == "gather" and values[1] is not None
        if gather and (said := _out_of_bounds(eqn, np.asarray(values[1]))) is not None:
            raise SignatureError(_CLAMPED.format(name=name, order=order, **said))
        outs = [v.aval for v in eqn.outvars]
        folds = any(id(v) in needed for v in eqn.outvars)  # (each bind compiles, once)
        if not folds or any(v is None for v in values) or eqn.effects or not _small(outs):
            continue
        try:  # an index computed from constants (jnp's normalisation of 11 or -1)
            got = eqn.primitive.bind(*values, **eqn.params)
        except Exception:  # what cannot fold is no constant here
            continue
        got = got if eqn.primitive.multiple_results else [got]
        known.update(zip(eqn.outvars, got, strict=True))  # (as bound: a key stays a key)


def _indexing(eqns: list[Any]) -> set[int]:
    """The ids of the variables a promised-in-bounds gather's indices are computed from: what
    is folded (each other constant, bound eagerly, cost a compile: 0.3-0.8 s of the zoo's
    miniGPT export)."""
    needed: set[int] = set()
    for eqn in reversed(eqns):
        if eqn.primitive.name == "gather" and eqn.params["mode"] == _PROMISED:
            needed.add(id(eqn.invars[1]))
        if any(id(v) in needed for v in eqn.outvars):
            needed.update(id(v) for v in eqn.invars)
    return needed


def _small(avals: list[Any]) -> bool:
    shapes = [getattr(a, "shape", None) for a in avals]
    return all(s is not None and all(isinstance(d, int) for d in s) for s in shapes) and all(
        math.prod(s) <= _FOLDED for s in shapes
    )


def _out_of_bounds(eqn: Any, indices: np.ndarray) -> dict[str, Any] | None:
    """Where a gather that promises its indices in bounds gets one outside a static one."""
    if eqn.params["mode"] != _PROMISED or not indices.size:
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
