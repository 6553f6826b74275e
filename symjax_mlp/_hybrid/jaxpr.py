"""Reading a jaxpr: its equations (nested ones included), their layers and their flops.

Counting works on the jaxpr's equations, recursing into sub-jaxprs such as
``custom_jvp_call`` and ``jit``, never on its text, which changes across JAX versions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from jax.extend import core as jex_core

# Elementwise primitives that XLA's cost model counts as one flop per output element.
_ELEMENTWISE_FLOPS = frozenset(
    {
        "add", "sub", "mul", "div", "max", "min", "neg", "abs", "sign", "exp", "exp2", "log",
        "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "pow", "integer_pow", "erf",
        "select_n", "sin", "cos", "square", "rem", "atan2", "cbrt", "erf_inv", "is_finite",
        "nextafter", "tan", "clamp",
    }
)  # fmt: skip
_REDUCTION_FLOPS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})


def sub_jaxprs(eqn: Any) -> Iterator[jex_core.Jaxpr]:
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jex_core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex_core.Jaxpr):
                yield v


def layer_of(name_stack: str) -> str:
    """``"HybridSequential/layers_0/layers_0"`` -> ``"HybridSequential/layers_0"``."""
    parts: list[str] = []
    for part in name_stack.split("/") if name_stack else ():
        if not parts or parts[-1] != part:
            parts.append(part)
    return "/".join(parts)


def walk(jaxpr: jex_core.Jaxpr, layer: str | None = None) -> Iterator[tuple[Any, str]]:
    """Every equation, sub-jaxprs included, with the layer it belongs to."""
    for eqn in jaxpr.eqns:
        own = layer if layer is not None else layer_of(str(eqn.source_info.name_stack))
        yield eqn, own
        for sub in sub_jaxprs(eqn):
            yield from walk(sub, own)


def eqn_flops(eqn: Any) -> int:
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = math.prod(lhs[d] for d in contract)
        return 2 * k * math.prod(eqn.outvars[0].aval.shape)
    if name in _ELEMENTWISE_FLOPS:
        return math.prod(eqn.outvars[0].aval.shape)
    if name in _REDUCTION_FLOPS:
        return math.prod(eqn.invars[0].aval.shape)
    return 0
