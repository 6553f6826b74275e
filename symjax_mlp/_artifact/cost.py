"""What one StableHLO op costs: the elements of its largest tensor (a ``dot_general``: its
result's times its contracted size; dynamic dimensions as 1), times how often XLA runs the
regions around it (a ``while`` body per trip, a reducer's per element it combines)."""

from __future__ import annotations

import math
from typing import Any

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

_INT_MAX = (1 << 31) - 1
# ops whose regions XLA runs per element (or pair of elements) they combine
REDUCERS = frozenset(f"stablehlo.{n}" for n in (
    "reduce", "reduce_window", "scatter", "sort", "select_and_scatter", "map", "all_reduce",
    "reduce_scatter",
))  # fmt: skip


def region_runs(op: Any) -> int:
    """How often XLA runs each region of the reducer ``op``, per run of ``op``: ``reduce``
    and ``map`` once per element, ``scatter`` per update, ``reduce_window`` and
    ``select_and_scatter`` per window element, ``sort`` ``n * log2(d)`` comparisons."""
    name = op.name
    ins = [elements(v.type) for v in op.operands]
    outs = [elements(v.type) for v in op.results]
    most = max([*ins, *outs, 1])
    if name == "stablehlo.scatter":
        return ins[-1] if ins else most
    if name in ("stablehlo.reduce_window", "stablehlo.select_and_scatter"):
        window = attr(op, "window_dimensions")  # select_and_scatter: per source element
        base = (outs if name == "stablehlo.reduce_window" else ins[1:]) or [most]
        known = isinstance(window, ir.DenseI64ArrayAttr)
        return base[0] * (max(math.prod(window), 1) if known else most)
    if name == "stablehlo.sort":
        try:
            t = op.operands[0].type
            d = t.get_dim_size(attr(op, "dimension").value % max(t.rank, 1))
        except (AttributeError, IndexError, TypeError, ValueError):
            d = most
        return most * max(int(d).bit_length(), 1)
    return most


def nbytes(t: Any) -> int:
    """The bytes of a tensor of type ``t`` (dynamic dimensions as 1)."""
    if not isinstance(t, ir.RankedTensorType):
        return 8
    et, k = t.element_type, 1
    if isinstance(et, ir.ComplexType):
        et, k = et.element_type, 2
    return elements(t) * k * max(-(-getattr(et, "width", 64) // 8), 1)


def elements(t: Any) -> int:
    return _static_size(t, range(t.rank)) if isinstance(t, ir.RankedTensorType) else 1


def _static_size(t: Any, dims: Any) -> int:
    """The product of ``t``'s static dimensions among ``dims`` (dynamic ones count as 1)."""
    n = 1
    for i in dims:
        if not t.is_dynamic_dim(i):
            n *= max(t.get_dim_size(i), 0)
    return n


def contracting(op: Any) -> int:
    """The contracted size of a ``dot_general`` (its operands' largest, if unreadable)."""
    try:
        dims = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
        lhs = op.operands[0].type
        if not isinstance(lhs, ir.RankedTensorType):
            return 1
        return max(_static_size(lhs, dims.lhs_contracting_dimensions), 1)
    except (ValueError, KeyError, IndexError, TypeError):
        return max((elements(v.type) for v in op.operands), default=1)


def window(op: Any) -> int:
    """What a ``convolution`` reads per output element: its kernel less the output features
    (the whole kernel, if unreadable)."""
    kernel = op.operands[1].type
    try:
        dims = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
        out = kernel.shape[dims.kernel_output_feature_dimension]
        return max(elements(kernel) // max(out, 1), 1)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return max(elements(kernel), 1)


def attr(op: Any, name: str) -> Any:
    try:
        return op.attributes[name]
    except (KeyError, IndexError, ValueError):
        return None


def _scalar_int(value: Any) -> int | None:
    """The value of a scalar int32/int64 ``stablehlo.constant``, else None."""
    const = _made_by(value, "stablehlo.constant")
    dense = attr(const, "value") if const is not None else None
    if not isinstance(dense, ir.DenseIntElementsAttr) or not dense.is_splat:
        return None
    if not scalar_type(dense.type, {32, 64}) or dense.type.element_type.is_unsigned:
        return None
    return int(dense.get_splat_value().value)


def scalar_type(t: Any, widths: set[int]) -> bool:
    """Whether ``t`` is a 0-d tensor of integers of one of ``widths`` bits."""
    et = t.element_type if isinstance(t, ir.RankedTensorType) and t.rank == 0 else None
    return isinstance(et, ir.IntegerType) and et.width in widths


def _made_by(value: Any, name: str, block: Any = None) -> Any:
    """The op named ``name`` (in ``block``, if given) whose result ``value`` is, else None."""
    op = value.owner.operation if isinstance(value, ir.OpResult) else None
    ok = op is not None and op.name == name and (block is None or op.block == block)
    return op if ok else None


def _arg_number(value: Any, block: Any) -> int | None:
    ok = isinstance(value, ir.BlockArgument) and value.owner == block
    return value.arg_number if ok else None


def trip_count(op: Any) -> int | None:
    """The trip count of a counted ``stablehlo.while``, or None if it is not one.

    Counted: the condition is ``counter < limit`` (signed) of a loop-carried ``counter``
    that starts at a constant and that the body increments by a constant ``step >= 1``, with
    ``limit`` a constant and ``limit + step`` within int32 (no wrap-around).
    """
    try:
        cond, body = op.regions[0].blocks[0], op.regions[1].blocks[0]
        (pred,) = list(cond.operations)[-1].operands
        cmp = _made_by(pred, "stablehlo.compare", cond)
        kind = attr(cmp, "compare_type") if cmp is not None else None
        if (
            cmp is None
            or hlo.ComparisonDirectionAttr(cmp.attributes["comparison_direction"]).value != "LT"
            or (kind is not None and hlo.ComparisonTypeAttr(kind).value != "SIGNED")
        ):
            return None
        k, limit = _arg_number(cmp.operands[0], cond), _scalar_int(cmp.operands[1])
        if k is None or limit is None or (start := _scalar_int(op.operands[k])) is None:
            return None
        add = _made_by(list(body.operations)[-1].operands[k], "stablehlo.add", body)
        a, b = add.operands if add is not None else (None, None)
        step = _scalar_int(b) if _arg_number(a, body) == k else None
        step = _scalar_int(a) if step is None and _arg_number(b, body) == k else step
        if step is None or step < 1 or limit + step > _INT_MAX:
            return None
        return max(0, -(-(limit - start) // step))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
