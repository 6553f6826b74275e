"""Whether an exported function keeps the rows of its batch apart (``jax.vmap`` of a loaded
model needs it), decided from the jaxpr: each value's symbolic shape says which axis is the
batch; an equation that drops, reorders or mixes it, or is unknown here, says no, and why."""

from __future__ import annotations

import math
import re
from typing import Any

from symjax_mlp._hybrid.jaxpr import bodies, layer_of, sub_jaxprs

# primitives that keep the batch axis where their output's shape says
_KEEP = frozenset(str.split("""
    abs acos acosh add and argmax argmin asin asinh atan atan2 atanh bitcast_convert_type
    broadcast_in_dim cbrt ceil clamp concatenate conj convert_element_type copy copy_p cos cosh
    digamma div dot_general dynamic_slice eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
    pow real reduce_and reduce_max reduce_min reduce_or reduce_precision reduce_prod reduce_sum
    reduce_xor rem round rsqrt select_n sharding_constraint shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh slice stop_gradient split sqrt square squeeze sub tan
    tanh transpose xor
"""))  # fmt: skip
_ALONG = {  # primitives that mix along one axis: the parameter that names it
    "cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis",
    "cumlogsumexp": "axis", "sort": "dimension", "top_k": "axis", "iota": "dimension",
}  # fmt: skip
_NAME = re.compile(r"[A-Za-z_]\w*")


class _Mixed(Exception):
    """Why rows are not independent."""


def verdict(jaxpr: Any, dim: str | None) -> dict[str, Any]:
    """``{"dim": dim, "independent": bool, "why": reason or ""}`` for ``jaxpr`` (batch: dim)."""
    why = "it was exported with static shapes, so it has no batch dimension to map over"
    if dim is not None:
        try:
            for v in (*jaxpr.invars, *jaxpr.outvars):
                _axis(v, dim, "the function")
            _walk(jaxpr, dim, "")
            why = ""
        except _Mixed as e:
            why = str(e)
    return {"dim": dim, "independent": not why, "why": why}


def _axis(v: Any, dim: str, what: str) -> int | None:
    """The axis of ``v`` that holds ``dim`` (``None``: none)."""
    shape = getattr(getattr(v, "aval", None), "shape", ())
    hits = [i for i, d in enumerate(shape) if dim in _NAME.findall(str(d))]  # ints: no names
    if not hits:
        return None
    if len(hits) > 1 or str(shape[hits[0]]) != dim:
        raise _Mixed(f"{what} makes a value of shape {v.aval.str_short()}, mixing rows")
    return hits[0]


def _walk(jaxpr: Any, dim: str, layer: str) -> None:
    for eqn in jaxpr.eqns:
        _check(eqn, dim, layer_of("/".join(filter(None, (layer, str(eqn.source_info.name_stack))))))


def _check(eqn: Any, dim: str, layer: str) -> None:
    name, params = eqn.primitive.name, eqn.params
    what = name + (f" (in {layer})" if layer else "")
    ins = [_axis(v, dim, what) for v in eqn.invars]
    outs = [_axis(v, dim, what) for v in eqn.outvars]
    call = bool(bodies(eqn)) and all(b.role == "" for b in bodies(eqn))
    if call or all(a is None for a in ins + outs):  # a call, or no batch in sight
        if name == "dim_as_value" and dim in _NAME.findall(str(params.get("dim"))):
            raise _Mixed(f"{what} reads the batch size {dim} as a value")
        for sub in sub_jaxprs(eqn):
            _walk(sub, dim, layer)
    if any(a is not None for a in ins) and any(a is None for a in outs):
        raise _Mixed(f"{what} reduces over the batch dimension {dim} (or drops it)")
    if call or all(a is None for a in ins + outs) or name in _KEEP:
        return
    k = ins[0] if ins else None
    if name in _ALONG:
        k = outs[0] if name == "iota" else k
        mixes = params[_ALONG[name]] % len(eqn.outvars[0].aval.shape) == k
    elif name == "reshape":
        old, new = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        mixes = k is None or math.prod(old[:k]) != math.prod(new[: outs[0]])
    elif name == "rev":
        mixes = k in params["dimensions"]
    elif name == "pad":
        mixes = k is not None and tuple(params["padding_config"][k]) != (0, 0, 0)
    elif name == "conv_general_dilated":
        lhs = params["dimension_numbers"].lhs_spec
        mixes = ins[1] is not None or k != lhs[0] or params["batch_group_count"] != 1
    else:
        raise _Mixed(f"{what} is not known to keep the rows of the batch {dim} apart")
    if mixes:
        raise _Mixed(f"{what} mixes rows along the batch dimension {dim}")
