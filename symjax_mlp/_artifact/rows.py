"""Row independence read from a StableHLO module: ``jax.vmap`` over a loaded model merges the
mapped axis into the batch and runs the program once only where the module keeps rows apart.

Export writes :func:`verdict` of its own module; load keeps a manifest's claim only where
:func:`analyze` (run on a stranger's module in the checker's child) shows it (:func:`checked`).
Conservative: an op not known to keep rows apart is a reason; every dynamic dimension of
``main``'s arguments is the batch. A value's state is ``FREE`` (no row, not the batch size),
``int`` k (axis k is the batch) or, for an integer shape tensor, a tuple of labels (``"b"``:
the batch size, ``"c"``: a constant, ``"x"``: a function of the batch size).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import jax.extend.mlir as jex
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir as jax_mlir

from symjax_mlp._artifact.ops import CALLS, ELEMENTWISE, MAX_OPS, composite_key

FREE = None
_MOVES = ("broadcast_in_dim", "transpose", "reverse", "pad", "concatenate")
_SAME = frozenset({"stablehlo.optimization_barrier", "sdy.sharding_constraint"})  # x -> x
_DYNAMIC = ("dynamic_broadcast_in_dim", "dynamic_iota", "dynamic_reshape")


class Mixed(Exception):
    """Why the module is not shown to keep rows apart."""


def analyze(module: Any) -> dict[str, Any]:
    """``{"why": reason or "", "ins": [...], "outs": [...]}``: the batch axis of each argument
    and result of ``main`` (``None``: none), for an ``ir.Module`` parsed in its context."""
    try:
        ops = [f.operation for f in module.body.operations]
        funcs = {f.attributes["sym_name"].value: f for f in ops if f.name == "func.func"}
        if "main" not in funcs:
            raise Mixed("the module has no main function")
        ins = []
        for v in funcs["main"].regions[0].blocks[0].arguments:
            if len(dyn := _dynamic_at(v.type)) > 1:
                raise Mixed(f"main takes {v.type}, with more than one dynamic dimension")
            ins.append(dyn[0] if dyn else FREE)
        outs = _Rows(funcs).call("main", tuple(ins))
        if any(isinstance(s, tuple) for s in outs):
            raise Mixed("main returns the batch size (or a function of it) as a value")
        return {"why": "", "ins": ins, "outs": list(outs)}
    except Mixed as e:
        return {"why": str(e), "ins": [], "outs": []}
    except (RecursionError, RuntimeError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, UnicodeDecodeError) as e:  # fmt: skip
        return {"why": f"its module cannot be analyzed ({type(e).__name__})", "ins": [], "outs": []}


def verdict(exported: Any, dim: str | None) -> dict[str, Any]:
    """The ``rows`` field an export writes for its own ``exported`` (batch ``dim``)."""
    why = _STATIC if dim is None else _unshown(exported, dim, None)
    return {"dim": dim, "independent": not why, "why": why}


def checked(view: Any, report: Any, exported: Any) -> Any:
    """``view`` (a manifest's entry point) with its ``rows`` claim kept only where the module
    of ``exported`` shows it: by the checker's ``report`` (``None``: trusted, read here); no
    claim, the module's own verdict."""
    rows = view.get("rows")
    if rows is None:  # the manifest says nothing, which a Batcher took for rows kept apart
        sig = view["signature"]
        lead = sig["inputs"][0]["shape"][:1] if sig["inputs"] else []
        dim = sig.get("batch") or next((d for d in lead if isinstance(d, str)), None)
        why = _STATIC if dim is None else _unshown(exported, dim, report)  # as export's verdict
        return {**view, "rows": {"dim": dim, "independent": not why, "why": why}}
    why = rows and rows.get("independent") and _unshown(exported, rows["dim"], report)
    if not why:
        return view
    why = f"its manifest says that it does, but its StableHLO module does not show it: {why}"
    return {**view, "rows": {**rows, "independent": False, "why": why}}


_STATIC = "it was exported with static shapes, so it has no batch dimension to map over"


def _unshown(e: Any, dim: str, report: Any) -> str:
    """Why the module of ``e`` does not show its rows apart along ``dim`` ("": it does)."""
    found = _here(bytes(e.mlir_module_serialized)) if report is None else report.rows
    kept = [e.in_avals[i] for i in e.module_kept_var_idx]
    want = ([FREE] * (len(e.platforms) > 1) + _axes(kept, dim), _axes(e.out_avals, dim))
    dims = {str(d) for a in (*kept, *e.out_avals) for d in a.shape if not isinstance(d, int)}
    if not isinstance(found, dict):
        return "the module checker gave no verdict"
    if found["why"] or dims != {dim}:
        have = ", ".join(sorted(dims)) or "none"
        return found["why"] or f"its symbolic dimensions are {have}, not {dim} alone"
    if (found["ins"], found["outs"]) != want:
        return f"its batch axes, {found['ins']} -> {found['outs']}, are not its signature's"
    return ""


@functools.lru_cache(maxsize=16)
def _here(module: bytes) -> dict[str, Any] | None:
    """:func:`analyze` of a trusted module, read in this process (``None``: unreadable)."""
    with jax_mlir.make_ir_context(), contextlib.suppress(Exception):
        return analyze(jex.deserialize_portable_artifact(module))
    return None


def _axes(avals: Any, dim: str) -> list[Any]:
    return [next((i for i, d in enumerate(a.shape) if str(d) == dim), FREE) for a in avals]


class _Rows:
    """The states of every value of a module's functions, each call walked once per states."""

    def __init__(self, funcs: dict[str, Any]) -> None:
        self.funcs, self.done, self.active, self.budget = funcs, {}, set(), MAX_OPS

    def call(self, name: str, states: tuple[Any, ...]) -> tuple[Any, ...]:
        key = (name, states)
        if key not in self.done:
            if name not in self.funcs or key in self.active:
                raise Mixed(f"a call of @{name}, undefined or recursive")
            self.active.add(key)
            self.done[key] = self.block(self.funcs[name].regions[0], states, {})
            self.active.discard(key)
        return self.done[key]

    def block(self, region: Any, states: Any, env: dict[Any, Any]) -> tuple[Any, ...]:
        """The states ``region``'s one block returns, its arguments of ``states``."""
        (block,) = region.blocks
        if len(block.arguments) != len(states):
            raise Mixed("a region takes other arguments than its op passes")
        _bind(env, "an argument", block.arguments, states)
        out: tuple[Any, ...] = ()
        for op in block.operations:
            op, self.budget = op.operation, self.budget - 1
            if self.budget < 0:
                raise Mixed("its module has too many ops to analyze")
            ins = [env[v] for v in op.operands]  # KeyError: not defined before its use
            if op.name in ("func.return", "stablehlo.return"):
                out = tuple(ins)
            else:
                res = self.op(op, op.name.removeprefix("stablehlo."), ins, env)
                if len(res) != len(op.results):
                    raise Mixed(f"{op.name} has results the analysis does not know")
                _bind(env, op.name, op.results, res)
        return out

    def op(self, op: Any, name: str, ins: list[Any], env: dict[Any, Any]) -> tuple[Any, ...]:
        """The states of ``op``'s results, its operands of states ``ins``."""
        n, a = len(op.results), op.attributes
        rows, sizes = {s for s in ins if isinstance(s, int)}, any(isinstance(s, tuple) for s in ins)
        if op.name in CALLS:  # a composite: its decomposition, and the op it names if "chlo."
            out = self.call(a[CALLS[op.name]].value, tuple(ins))
            named = a["name"].value if name == "composite" else ""
            if named.startswith("chlo.") and (
                composite_key(named)
                or sizes
                or len(rows) > 1
                or out != (next(iter(rows), FREE),) * n
            ):  # it runs as that op: elementwise, or not known to keep rows apart
                raise Mixed(f"{op.name} {named[:100]!r} runs as the op it names")
            return out
        if name in ("case", "if"):
            if ins[0] is not FREE:
                raise Mixed(f"{op.name} branches on a row or on the batch size")
            if len(got := {self.block(r, (), env) for r in op.regions}) != 1:
                raise Mixed(f"{op.name} has branches of different batch axes")
            return got.pop()
        if name == "while":
            if self.block(op.regions[0], tuple(ins), env) != (FREE,):
                raise Mixed(f"{op.name} loops on a row or on the batch size")
            if self.block(op.regions[1], tuple(ins), env) != tuple(ins):
                raise Mixed(f"{op.name} moves the batch axis between trips")
            return tuple(ins)
        if name == "reduce" and (rows or sizes):
            half = len(ins) // 2
            if self.block(op.regions[0], (FREE,) * 2 * half, env) != (FREE,) * half:
                raise Mixed(f"{op.name} combines elements with a row or the batch size")
            return (_reduced(op, ins),) * n
        if name == "get_dimension_size":
            if ins[0] == (i := a["dimension"].value):
                return (("b",),)
            if op.operands[0].type.is_dynamic_dim(i):
                raise Mixed(f"{op.name} reads a dynamic dimension that is not the batch")
            return (FREE,)
        if op.regions and any(env.get(v, FREE) is not FREE for v in _captured(op)):
            raise Mixed(f"{op.name} uses a row or the batch size inside its regions")
        target = a["call_target_name"].value if name == "custom_call" else None
        if op.name in _SAME or target == "Sharding":
            return tuple(ins)
        if target == "shape_assertion" and not rows:
            return ()
        if not rows and not sizes:
            return (FREE,) * n
        if name in _DYNAMIC:
            return (_dynamic(op, name, ins),)
        if sizes and rows:
            raise Mixed(f"{op.name} combines rows with the batch size as a value")
        if sizes:
            return (_sized(op, name, ins),) * n
        if len(rows) > 1:
            raise Mixed(f"{op.name} combines two batch axes")
        (k,) = rows
        if name in ELEMENTWISE:
            return (k,) * n
        if name == "dot_general":
            return (_dot(op, *ins),)
        if name == "convolution" and ins[1] is FREE and a["batch_group_count"].value == 1:
            dims = hlo.ConvDimensionNumbers(a["dimension_numbers"])
            if dims.input_batch_dimension == k:
                return (dims.output_batch_dimension,)
        if name == "reshape":
            return (_reshaped(op, k, _dynamic_at(op.results[0].type)),)
        if name in ("gather", "dynamic_gather") and [*ins[:1], *ins[2:]] == [FREE] * (len(ins) - 1):
            return (_gathered(op, k),)  # rows of indices into a table (an embedding's lookup)
        if name in _MOVES and all(s == k for s in (ins if name == "concatenate" else ins[:1])):
            return (_moved(op, name, k),)
        raise Mixed(f"{op.name} is not known to keep rows apart")


def _gathered(op: Any, k: int) -> int:
    """Where a gather of a table (no row) at indices of batch axis ``k`` puts that axis: the
    output's axes that are no offset take the indices' axes but the index vector's, in order."""
    dims = hlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
    if k == dims.index_vector_dim or list(dims.start_indices_batching_dims):
        raise Mixed(f"{op.name} indexes with the batch axis")
    out = [i for i in range(op.results[0].type.rank) if i not in list(dims.offset_dims)]
    at = [i for i in range(op.operands[1].type.rank) if i != dims.index_vector_dim]
    return out[at.index(k)]


def _moved(op: Any, name: str, k: int) -> int:
    """Where a move (:data:`_MOVES`) puts the batch axis ``k`` of its operand."""
    a = op.attributes
    if name == "broadcast_in_dim":
        return list(a["broadcast_dimensions"])[k]
    if name == "transpose":
        return list(a["permutation"]).index(k)
    if name == "reverse":
        along = k in list(a["dimensions"])
    elif name == "concatenate":
        along = a["dimension"].value == k
    else:  # pad
        pads = ("edge_padding_low", "edge_padding_high", "interior_padding")
        along = any(list(a[p])[k] for p in pads)
    if along:
        raise Mixed(f"{op.name} moves rows along the batch axis")
    return k


def _dot(op: Any, lhs: Any, rhs: Any) -> int:
    """The batch axis of a ``dot_general``'s result: a free or batching dimension's."""
    d = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    lb, rb = list(d.lhs_batching_dimensions), list(d.rhs_batching_dimensions)
    lc, rc = list(d.lhs_contracting_dimensions), list(d.rhs_contracting_dimensions)
    if lhs in lc or rhs in rc:
        raise Mixed(f"{op.name} contracts the batch axis: it sums over rows")
    free_l = [i for i in range(op.operands[0].type.rank) if i not in lb + lc]
    free_r = [i for i in range(op.operands[1].type.rank) if i not in rb + rc]
    if lhs in lb and rhs in rb and rb.index(rhs) == lb.index(lhs):
        return lb.index(lhs)
    if rhs is FREE and lhs in free_l:
        return len(lb) + free_l.index(lhs)
    if lhs is FREE and rhs in free_r:
        return len(lb) + len(free_l) + free_r.index(rhs)
    raise Mixed(f"{op.name} pairs rows with other rows")


def _reduced(op: Any, ins: list[Any]) -> int:
    """The batch axis of a ``reduce`` over other axes (its operands', less those before)."""
    half = len(ins) // 2
    axes, dims = set(ins[:half]) - {FREE}, list(op.attributes["dimensions"])
    k = axes.pop() if len(axes) == 1 else FREE
    if not isinstance(k, int) or any(s is not FREE for s in ins[half:]):
        raise Mixed(f"{op.name} reduces the batch size, or starts from a row")
    if k in dims:
        raise Mixed(f"{op.name} reduces over the batch axis: it combines rows")
    return k - sum(d < k for d in dims)


def _dynamic(op: Any, name: str, ins: list[Any]) -> Any:
    """The batch axis of a :data:`_DYNAMIC` op: where its shape operand holds the batch size."""
    shape, x = ins[-1], FREE if name == "dynamic_iota" else ins[0]
    labels = shape if isinstance(shape, tuple) else ("c",) * _size(op.operands[-1])
    if isinstance(shape, int) or isinstance(x, tuple) or "x" in labels or labels.count("b") > 1:
        raise Mixed(f"{op.name} makes a shape from rows or from a function of the batch size")
    at = labels.index("b") if "b" in labels else FREE
    if name == "dynamic_iota" and at is not FREE and op.attributes["iota_dimension"].value == at:
        raise Mixed(f"{op.name} counts along the batch axis: a row index")
    if x is FREE and (at is FREE or name != "dynamic_reshape"):
        return at
    if name == "dynamic_broadcast_in_dim" and list(op.attributes["broadcast_dimensions"])[x] == at:
        return at
    if name == "dynamic_reshape" and x is not FREE:
        return _reshaped(op, x, [] if at is FREE else [at])
    raise Mixed(f"{op.name} moves the batch axis or makes one from a value without it")


def _reshaped(op: Any, k: int, at: list[int]) -> int:
    """The batch axis of a reshape of batch axis ``k`` to the batch at ``at`` (one), if the
    static dimensions before and after it hold as many elements: rows stay whole."""
    src, dst = op.operands[0].type.shape, op.results[0].type.shape
    if len(at) == 1:
        p, q, r, s = src[:k], src[k + 1 :], dst[: at[0]], dst[at[0] + 1 :]
        sizes = [math.prod(d) for d in (p, q, r, s)]
        if min(p + q + r + s, default=0) >= 0 and sizes[:2] == sizes[2:]:
            return at[0]
    raise Mixed(f"{op.name} reshapes across the batch axis: it mixes rows")


def _sized(op: Any, name: str, ins: list[Any]) -> Any:
    """The labels of a shape computation: reshaped, converted, sliced, joined, or ``"x"``."""
    if name in ("reshape", "slice", "concatenate"):
        flat = [x for s, v in zip(ins, op.operands, strict=True)
                for x in (s if isinstance(s, tuple) else ("c",) * _size(v))]  # fmt: skip
        if name == "slice" and flat:
            keys = ("start_indices", "limit_indices", "strides")
            (a,), (b,), (c,) = (list(op.attributes[k]) for k in keys)
            flat = flat[a:b:c]
    elif name in ELEMENTWISE:
        flat = ["x"] * _size(op.results[0])
    else:
        raise Mixed(f"{op.name} uses the batch size as a value")
    return FREE if all(x == "c" for x in flat) else tuple(flat)


def _bind(env: dict[Any, Any], name: str, values: Any, states: Any) -> None:
    """Records each value's state, refused where its type has other dynamic dimensions."""
    for v, s in zip(values, states, strict=True):
        t = v.type
        if not isinstance(t, ir.RankedTensorType):
            ok = s is FREE and not isinstance(t, ir.ShapedType)
        else:
            ok = _dynamic_at(t) == ([s] if isinstance(s, int) else []) and (
                not isinstance(s, tuple) or (t.rank <= 1 and _size(v) == len(s))
            )
        if not ok:
            raise Mixed(f"{name} makes a {t} whose dynamic dimensions are not the batch's")
        env[v] = s


def _size(v: Any) -> int:
    if _dynamic_at(v.type):
        raise Mixed(f"a shape tensor of dynamic size {v.type}")
    return math.prod(v.type.shape)


def _captured(op: Any) -> Any:
    """The values the ops inside ``op``'s regions use, at any depth."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield from inner.operation.operands
                yield from _captured(inner.operation)


def _dynamic_at(t: Any) -> list[int]:
    return [i for i in range(getattr(t, "rank", 0)) if t.is_dynamic_dim(i)]
