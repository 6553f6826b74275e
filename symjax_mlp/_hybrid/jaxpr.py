"""Reading a jaxpr: its equations (sub-jaxprs included, never the text), their layers (the
``jax.named_scope`` names, equinox's numbered by call order) and their flops."""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from jax.extend import core as jex_core

# XLA's cost model: one flop per output element (elementwise), one per input element
# (reductions, arg-reductions, cumulative ops); transcendentals (exp, tanh, ...) none
_ELEMENTWISE_FLOPS = frozenset({
    "add", "sub", "mul", "div", "max", "min", "neg", "abs", "sign", "exp2", "select_n", "square",
    "rem", "is_finite", "nextafter", "clamp", "erf_inv", "eq", "ne", "lt", "le", "gt", "ge",
    "convert_element_type", "floor", "ceil", "round", "reduce_precision",
})  # fmt: skip
_REDUCTION_FLOPS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "cumsum",
    "cumprod", "cummax", "cummin", "cumlogsumexp",
})  # fmt: skip
# Primitives whose sub-jaxprs run exactly once per run of the equation
_CALLS = frozenset({
    "jit", "pjit", "closed_call", "core_call", "named_call", "custom_jvp_call", "custom_vjp_call",
    "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint", "custom_vmap_call",
})  # fmt: skip
#: Primitives whose flops the jaxpr does not show: a loaded model's program (jax.export's), a
#: hijax primitive's (hijax-types.md's MatmulQ: its ops are its ``expand``'s, not shown)
_OPAQUE = frozenset({"call_exported", "call_hi_primitive"})


@dataclasses.dataclass(frozen=True)
class Body:
    """A sub-jaxpr of an equation and how often it runs per run of it (a lower bound unless
    ``exact``); ``role``: ``""`` (a call), ``"body"``, ``"cond"``, ``"branch 0"``, or a param."""

    role: str
    jaxpr: jex_core.Jaxpr
    trips: int = 1
    exact: bool = True


def _jaxprs(value: Any) -> Iterator[jex_core.Jaxpr]:
    for v in value if isinstance(value, tuple | list) else (value,):
        if isinstance(v, jex_core.ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, jex_core.Jaxpr):
            yield v


def sub_jaxprs(eqn: Any) -> Iterator[jex_core.Jaxpr]:
    """Every sub-jaxpr of ``eqn``'s parameters."""
    for value in eqn.params.values():
        yield from _jaxprs(value)


def bodies(eqn: Any) -> list[Body]:
    """``eqn``'s sub-jaxprs, each with how often it runs (``[]``: a plain equation)."""
    name, params = eqn.primitive.name, eqn.params
    if name == "scan":
        return [Body("body", params["jaxpr"].jaxpr, int(params["length"]))]
    if name == "while":
        return [
            Body("cond", params["cond_jaxpr"].jaxpr, 1, exact=False),
            Body("body", params["body_jaxpr"].jaxpr, 0, exact=False),
        ]
    if name == "cond":
        return [Body(f"branch {i}", b.jaxpr) for i, b in enumerate(params["branches"])]
    if name in _CALLS:
        return [Body("", j) for j in sub_jaxprs(eqn)]
    return [Body(key, j, exact=False) for key, v in params.items() for j in _jaxprs(v)]


def call_name(eqn: Any) -> str:
    """The name of a call equation's function (``"relu"``), or ``""``."""
    name = eqn.params.get("name")
    if isinstance(name, str):
        return name
    for j in sub_jaxprs(eqn):
        func = getattr(getattr(j, "debug_info", None), "func_name", "")
        if func and not func.startswith("<"):
            return func
    return ""


def layer_of(name_stack: str) -> str:
    """``"HybridSequential/layers_0/layers_0"`` -> ``"HybridSequential/layers_0"``."""
    parts: list[str] = []
    for part in name_stack.split("/") if name_stack else ():
        if not parts or parts[-1] != part:
            parts.append(part)
    return "/".join(parts)


def walk(jaxpr: jex_core.Jaxpr, layer: str = "") -> Iterator[tuple[Any, str]]:
    """Every equation, sub-jaxprs included, with its layer: its enclosing equation's layer
    followed by its own named scopes (a sub-jaxpr's name stack is relative)."""
    for eqn in jaxpr.eqns:
        own = layer_of("/".join(filter(None, (layer, str(eqn.source_info.name_stack)))))
        yield eqn, own
        for sub in sub_jaxprs(eqn):
            yield from walk(sub, own)


# An equinox layer's scope, bare or under a transform: "vmap(eqx.nn.Linear)".
_EQX_SCOPE = re.compile(r"(?:\w+\()*eqx\.")


def numbered(pairs: Iterable[tuple[Any, str]]) -> list[tuple[Any, str]]:
    """:func:`walk`'s pairs, an equinox scope entered more than once under one parent numbered
    in call order (``"eqx.nn.MLP/eqx.nn.Linear[1]"``); entered again when a sibling's equation
    came between (two layers called back to back with nothing between stay one)."""
    seen: collections.Counter[tuple[Any, ...]] = collections.Counter()
    prev: list[str] = []
    ids: list[tuple[str, int]] = []
    runs = []
    for eqn, layer in pairs:
        parts, k = layer.split("/") if layer else [], 0
        while k < min(len(parts), len(prev)) and parts[k] == prev[k]:
            k += 1
        del ids[k:]
        for part in parts[k:]:
            eqx = _EQX_SCOPE.match(part) is not None
            ids.append((part, seen[(*ids, part)] if eqx else 0))
            seen[(*ids[:-1], part)] += eqx
        prev = parts
        runs.append((eqn, tuple(ids)))

    def name(ids: tuple) -> str:
        return "/".join(
            p if seen[(*ids[:i], p)] < 2 else f"{p}[{n}]" for i, (p, n) in enumerate(ids)
        )

    return [(eqn, name(ids)) for eqn, ids in runs]


def input_dependent(jaxpr: jex_core.Jaxpr, sources: Any) -> list[bool]:
    """Per output of ``jaxpr``: whether it depends on ``sources`` (some of its ``invars``),
    followed into calls, ``scan`` and ``while`` carries and ``cond`` branches."""
    seen = set(sources)
    for eqn in jaxpr.eqns:
        given = [isinstance(v, jex_core.Var) and v in seen for v in eqn.invars]
        if any(given):
            seen.update(v for v, d in zip(eqn.outvars, _followed(eqn, given), strict=True) if d)
    return [isinstance(v, jex_core.Var) and v in seen for v in jaxpr.outvars]


def _through(jaxpr: jex_core.Jaxpr, given: list[bool]) -> list[bool]:
    return input_dependent(jaxpr, [v for v, d in zip(jaxpr.invars, given, strict=True) if d])


def _carried(body: jex_core.Jaxpr, given: list[bool], at: int, n: int) -> list[bool]:
    """``body``'s outputs' dependence once its ``n`` carries from invar ``at`` (its first
    outputs) settle: a carry depends on what any trip feeds it."""
    while True:
        outs = _through(body, given)
        carry = [a or b for a, b in zip(given[at : at + n], outs[:n], strict=True)]
        if carry == given[at : at + n]:
            return outs
        given = [*given[:at], *carry, *given[at + n :]]


def _followed(eqn: Any, given: list[bool]) -> list[bool]:
    """Per output of ``eqn``: whether it depends on the operands ``given`` marks."""
    name, params, subs = eqn.primitive.name, eqn.params, list(sub_jaxprs(eqn))
    if name in _CALLS and len(subs) == 1 and len(subs[0].invars) == len(given):
        return _through(subs[0], given)
    if name == "scan":
        return _carried(params["jaxpr"].jaxpr, given, params["num_consts"], params["num_carry"])
    if name == "cond" and not given[0]:  # the branch taken does not depend on them
        branches = [_through(b.jaxpr, given[1:]) for b in params["branches"]]
        return [any(outs) for outs in zip(*branches, strict=True)]
    if name == "while":  # a trip count that depends on them: every carry does
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        outs = _carried(params["body_jaxpr"].jaxpr, given[nc:], nb, len(given) - nc - nb)
        carry = [a or b for a, b in zip(given[nc + nb :], outs, strict=True)]
        if not _through(params["cond_jaxpr"].jaxpr, [*given[:nc], *carry])[0]:
            return carry
    return [True] * len(eqn.outvars)


def forwarded(jaxpr: jex_core.Jaxpr) -> list[int | None]:
    """Per output of ``jaxpr``: the index of the input it returns unchanged, followed through
    calls and ``scan`` carries (what an ``nnx.jit`` hands back as given), or ``None``."""
    at = {v: i for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        for out, k in zip(eqn.outvars, _forwards(eqn), strict=True):
            if k is not None and isinstance(src := eqn.invars[k], jex_core.Var) and src in at:
                at[out] = at[src]
    return [at.get(v) if isinstance(v, jex_core.Var) else None for v in jaxpr.outvars]


def _forwards(eqn: Any) -> list[int | None]:
    """Per output of ``eqn``: the operand it returns unchanged, or ``None``."""
    name, params, subs = eqn.primitive.name, eqn.params, list(sub_jaxprs(eqn))
    if name in _CALLS and len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
        return forwarded(subs[0])
    outs: list[int | None] = [None] * len(eqn.outvars)
    if name == "scan":  # a carry the body hands back as given
        c, body = params["num_consts"], forwarded(params["jaxpr"].jaxpr)
        outs[: params["num_carry"]] = [
            c + j if k == c + j else None for j, k in enumerate(body[: params["num_carry"]])
        ]
    return outs


def count_flops(jaxpr: jex_core.Jaxpr) -> tuple[int, tuple[str, ...]]:
    """``(flops, unknown)``: one run's flops (see ``Graph.flops``), and the primitives whose
    trip counts (or, ``call_exported`` and hijax primitives, flops) are unknown."""
    total, unknown = 0, []
    for eqn in jaxpr.eqns:
        subs = bodies(eqn)
        if not subs:
            total += eqn_flops(eqn)
            unknown += [eqn.primitive.name] if _opaque(eqn.primitive) else []
            continue
        counted = [(b, *count_flops(b.jaxpr)) for b in subs]
        if eqn.primitive.name == "cond":
            total += max(flops for _, flops, _ in counted)
        else:
            total += sum(b.trips * flops for b, flops, _ in counted)
        unknown += [eqn.primitive.name for b in subs if not b.exact]
        unknown += [name for _, _, names in counted for name in names]
    return total, tuple(dict.fromkeys(unknown))


def _opaque(primitive: Any) -> bool:
    hijax = sys.modules.get("jax.experimental.hijax")  # not imported: no hijax primitive made
    hi = hijax is not None and isinstance(primitive, hijax.HiPrimitive)
    return hi or primitive.name in _OPAQUE


def eqn_flops(eqn: Any) -> int:
    """The flops of one equation without sub-jaxprs, with XLA's conventions."""
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = math.prod(lhs[d] for d in contract)
        return 2 * k * math.prod(eqn.outvars[0].aval.shape)
    if name == "conv_general_dilated":
        return conv_flops(eqn)
    if name in _ELEMENTWISE_FLOPS:
        return math.prod(eqn.outvars[0].aval.shape)
    if name == "integer_pow":  # lowered to square-and-multiply, and a division if y < 0
        y = abs(eqn.params["y"])
        muls = max(y.bit_length() - 1, 0) + max(y.bit_count() - 1, 0)
        return (muls + (eqn.params["y"] < 0)) * math.prod(eqn.outvars[0].aval.shape)
    if name in _REDUCTION_FLOPS:
        return math.prod(eqn.invars[0].aval.shape)
    return 0


def conv_flops(eqn: Any) -> int:
    """A convolution's flops as ``HloCostAnalysis::GetConvolutionFlops`` counts them: ``2 *
    batch * out_channels * in_channels/groups * positions``, ``positions`` the (output, kernel)
    index pairs that land on an input element (not padding or a dilation hole)."""
    p = eqn.params
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    out = eqn.outvars[0].aval.shape
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    positions = 1
    for i in range(len(lhs_spec) - 2):
        size, kernel, n = lhs[lhs_spec[2 + i]], rhs[rhs_spec[2 + i]], out[out_spec[2 + i]]
        stride, low = p["window_strides"][i], p["padding"][i][0]
        base, window = p["lhs_dilation"][i], p["rhs_dilation"][i]
        at = [o * stride - low + k * window for k in range(kernel) for o in range(n)]
        positions *= sum(j % base == 0 and 0 <= j // base < size for j in at)
    batch = lhs[lhs_spec[0]] // p["batch_group_count"]
    in_features = lhs[lhs_spec[1]] // p["feature_group_count"]
    return 2 * batch * in_features * out[out_spec[1]] * positions
