"""Row independence read from the StableHLO module itself, not from the manifest's word.

``jax.vmap`` over a loaded model merges the mapped axis into the batch and runs the program
once, right only if the program keeps the rows of its batch apart. Export records a verdict
from the jaxpr (:mod:`symjax_mlp._rows`), but a manifest is a stranger's claim: the checker's
child runs :func:`analyze` on the module (this process, for a trusted one), and load believes
the claim only where :func:`checked` finds that the module shows it; elsewhere vmap runs the
program once per example (``jax.lax.map``), slower and always right.

The analysis is conservative. Every dynamic dimension of ``main``'s arguments is taken to be
the batch (the loader checks that the artifact has one symbolic dimension, that one). Each value
is ``FREE`` (depends on no row and not on the batch size), ``int`` k (its axis k is the batch:
row i depends on row i of the inputs alone) or a tuple of labels (an integer shape tensor, each
element ``"b"``: the batch size, ``"c"``: independent of it, ``"x"``: a function of it). An op
is followed only where the rule below knows that it keeps rows apart; anything else that sees
a row or the batch size (a reduce over it, a reverse, a sort, the size as data) is a reason.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

from symjax_mlp._artifact.ops import MAX_OPS

FREE = None
_ELEMENTWISE = frozenset(str.split("""
    abs add and atan2 bitcast_convert cbrt ceil clamp compare convert cosine divide exponential
    exponential_minus_one floor is_finite log log_plus_one logistic maximum minimum multiply
    negate not or power remainder round_nearest_afz round_nearest_even rsqrt select
    shift_left shift_right_arithmetic shift_right_logical sign sine sqrt subtract tan tanh xor
"""))  # fmt: skip
_MOVES = ("broadcast_in_dim", "transpose", "reverse", "pad", "concatenate")
_SAME = frozenset({"stablehlo.optimization_barrier", "sdy.sharding_constraint"})  # x -> x


class Mixed(Exception):
    """Why the module is not shown to keep rows apart."""


def analyze(module: Any) -> dict[str, Any]:
    """``{"why": reason or "", "ins": [...], "outs": [...]}``: the batch axis of each argument
    and result of ``main`` (``None``: none), for an ``ir.Module`` parsed in its context."""
    try:
        ops = [f.operation for f in module.body.operations]
        funcs = {_attr(f, "sym_name").value: f for f in ops if f.name == "func.func"}
        if "main" not in funcs:
            raise Mixed("the module has no main function")
        args = funcs["main"].regions[0].blocks[0].arguments
        ins = []
        for v in args:
            dyn = _dynamic_at(v.type)
            if len(dyn) > 1:
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


def checked(view: Any, report: Any, exported: Any) -> Any:
    """``view`` (a manifest's entry point) with its ``rows`` claim kept only where the module
    of ``exported`` shows it: by the checker's ``report`` (``None``: trusted, read here)."""
    rows = view.get("rows")
    if not rows or not rows.get("independent"):
        return view
    found = _here(bytes(exported.mlir_module_serialized)) if report is None else report.rows
    e = exported
    kept = [e.in_avals[i] for i in e.module_kept_var_idx]
    want = (
        [FREE] * (len(e.platforms) > 1) + _axes(kept, rows["dim"]),
        _axes(e.out_avals, rows["dim"]),
    )
    dims = {str(d) for a in (*kept, *e.out_avals) for d in a.shape if not isinstance(d, int)}
    if not isinstance(found, dict):
        why = "the module checker gave no verdict"
    elif found["why"] or dims != {rows["dim"]}:
        have = ", ".join(sorted(dims)) or "none"
        why = found["why"] or f"its symbolic dimensions are {have}, not {rows['dim']} alone"
    elif (found["ins"], found["outs"]) != want:
        why = f"its batch axes, {found['ins']} -> {found['outs']}, are not its signature's"
    else:
        return view
    why = f"its manifest says that it does, but its StableHLO module does not show it: {why}"
    return {**view, "rows": {**rows, "independent": False, "why": why}}


@functools.lru_cache(maxsize=16)
def _here(module: bytes) -> dict[str, Any] | None:
    """:func:`analyze` of a trusted module, read in this process (``None``: unreadable)."""
    import jax.extend.mlir as jex
    from jax.interpreters import mlir as jax_mlir

    with jax_mlir.make_ir_context(), contextlib.suppress(Exception):
        return analyze(jex.deserialize_portable_artifact(module))
    return None


def _axes(avals: Any, dim: str) -> list[Any]:
    return [next((i for i, d in enumerate(a.shape) if str(d) == dim), FREE) for a in avals]


class _Rows:
    def __init__(self, funcs: dict[str, Any]) -> None:
        self.funcs, self.done, self.active, self.budget = funcs, {}, set(), MAX_OPS

    def call(self, name: str, states: tuple[Any, ...]) -> tuple[Any, ...]:
        """The states ``@name`` returns for arguments of ``states`` (once per states)."""
        key = (name, states)
        if key not in self.done:
            if name not in self.funcs or key in self.active:
                raise Mixed(f"a call of @{name}, undefined or recursive")
            self.active.add(key)
            self.done[key] = self.block(self.funcs[name].regions[0], states, {})
            self.active.discard(key)
        return self.done[key]

    def block(self, region: Any, states: Any, env: dict[Any, Any]) -> tuple[Any, ...]:
        """Walks ``region``'s one block, its arguments of ``states``: the states it returns."""
        (block,) = region.blocks
        if len(block.arguments) != len(states):
            raise Mixed("a region takes other arguments than its op passes")
        for v, s in zip(block.arguments, states, strict=True):
            _fits("an argument", s, v)
            env[v] = s
        out: tuple[Any, ...] = ()
        for op in block.operations:
            op, self.budget = op.operation, self.budget - 1
            if self.budget < 0:
                raise Mixed("its module has too many ops to analyze")
            ins = [env[v] for v in op.operands]  # KeyError: not defined before its use
            if op.name in ("func.return", "stablehlo.return"):
                out = tuple(ins)
                continue
            res = self.op(op, op.name.removeprefix("stablehlo."), ins, env)
            if len(res) != len(op.results):
                raise Mixed(f"{op.name} has results the analysis does not know")
            for v, s in zip(op.results, res, strict=True):
                _fits(op.name, s, v)
                env[v] = s
        return out

    def op(self, op: Any, name: str, ins: list[Any], env: dict[Any, Any]) -> tuple[Any, ...]:
        """The states of ``op``'s results, its operands of states ``ins``."""
        n, rows = len(op.results), {s for s in ins if isinstance(s, int)}
        sizes = any(isinstance(s, tuple) for s in ins)
        if name == "func.call":
            return self.call(_attr(op, "callee").value, tuple(ins))
        if name in ("case", "if"):
            if ins[0] is not FREE:
                raise Mixed(f"{op.name} branches on a row or on the batch size")
            got = {self.block(r, (), env) for r in op.regions}
            if len(got) != 1:
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
            i = _attr(op, "dimension").value
            return (("b",) if ins[0] == i else _dim(op, i),)
        if op.regions and any(env.get(v, FREE) is not FREE for v in _captured(op)):
            raise Mixed(f"{op.name} uses a row or the batch size inside its regions")
        if op.name in _SAME or (name == "custom_call" and _str(op) == "Sharding"):
            return tuple(ins)
        if name == "custom_call" and _str(op) == "shape_assertion" and not rows:
            return ()
        if not rows and not sizes:
            return (FREE,) * n
        if name in ("dynamic_broadcast_in_dim", "dynamic_iota", "dynamic_reshape"):
            return (_dynamic(op, name, ins),)
        if sizes and rows:
            raise Mixed(f"{op.name} combines rows with the batch size as a value")
        if sizes:
            return (_sized(op, name, ins),) * n
        if len(rows) > 1:
            raise Mixed(f"{op.name} combines two batch axes")
        (k,) = rows
        if name in _ELEMENTWISE:
            return (k,) * n
        if name == "dot_general":
            return (_dot(op, *ins),)
        if name == "convolution" and ins[1] is FREE and _int(op, "batch_group_count") == 1:
            from jax.extend.mlir.dialects import stablehlo as hlo

            dims = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
            if dims.input_batch_dimension == k:
                return (dims.output_batch_dimension,)
        if name == "reshape":
            return (_reshaped(op, k, _dynamic_at(op.results[0].type)),)
        if name in _MOVES and all(s == k for s in (ins if name == "concatenate" else ins[:1])):
            return (_moved(op, name, k),)
        raise Mixed(f"{op.name} is not known to keep rows apart")


def _moved(op: Any, name: str, k: int) -> int:
    """Where a ``broadcast_in_dim``, ``transpose``, ``reverse``, ``pad``, ``concatenate``
    puts the batch axis ``k`` of its operand."""
    if name == "broadcast_in_dim":
        return list(_attr(op, "broadcast_dimensions"))[k]
    if name == "transpose":
        return list(_attr(op, "permutation")).index(k)
    moves = {
        "reverse": lambda: k in list(_attr(op, "dimensions")),
        "concatenate": lambda: _int(op, "dimension") == k,
        "pad": lambda: any(list(_attr(op, f"{a}_padding{b}"))[k]
                           for a, b in (("edge", "_low"), ("edge", "_high"), ("interior", ""))),
    }  # fmt: skip
    if moves[name]():
        raise Mixed(f"{op.name} moves rows along the batch axis")
    return k


def _dot(op: Any, lhs: Any, rhs: Any) -> int:
    """The batch axis of a ``dot_general``'s result: a free or batching dimension's."""
    from jax.extend.mlir.dialects import stablehlo as hlo

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
    axes, dims = set(ins[:half]) - {FREE}, list(_attr(op, "dimensions"))
    if (
        any(s is not FREE for s in ins[half:])
        or len(axes) != 1
        or not isinstance(k := axes.pop(), int)
    ):
        raise Mixed(f"{op.name} reduces the batch size, or starts from a row")
    if k in dims:
        raise Mixed(f"{op.name} reduces over the batch axis: it combines rows")
    return k - sum(d < k for d in dims)


def _dynamic(op: Any, name: str, ins: list[Any]) -> Any:
    """The batch axis of a ``dynamic_broadcast_in_dim``, ``dynamic_iota`` or
    ``dynamic_reshape``: where its shape operand holds the batch size."""
    shape, x = ins[-1], FREE if name == "dynamic_iota" else ins[0]
    labels = shape if isinstance(shape, tuple) else ("c",) * _size(op.operands[-1])
    if isinstance(shape, int) or isinstance(x, tuple) or "x" in labels or labels.count("b") > 1:
        raise Mixed(f"{op.name} makes a shape from rows or from a function of the batch size")
    at = labels.index("b") if "b" in labels else FREE
    if name == "dynamic_iota" and at is not FREE and _int(op, "iota_dimension") == at:
        raise Mixed(f"{op.name} counts along the batch axis: a row index")
    if x is FREE and (at is FREE or name != "dynamic_reshape"):
        return at
    if name == "dynamic_broadcast_in_dim" and list(_attr(op, "broadcast_dimensions"))[x] == at:
        return at
    if name == "dynamic_reshape" and x is not FREE:
        return _reshaped(op, x, [] if at is FREE else [at])
    raise Mixed(f"{op.name} moves the batch axis or makes one from a value without it")


def _reshaped(op: Any, k: int, at: list[int]) -> int:
    """The batch axis of a reshape of batch axis ``k`` to the batch at ``at`` (one), if the
    static dimensions before and after each hold as many elements: rows stay whole."""
    src, dst = op.operands[0].type, op.results[0].type
    if len(at) == 1:
        (p, q), (r, s) = (([*t.shape[:i]], [*t.shape[i + 1 :]]) for t, i in ((src, k), (dst, *at)))
        if min(p + q + r + s, default=0) >= 0 and [math.prod(p), math.prod(q)] == [
            math.prod(r), math.prod(s)
        ]:  # fmt: skip
            return at[0]
    raise Mixed(f"{op.name} reshapes across the batch axis: it mixes rows")


def _sized(op: Any, name: str, ins: list[Any]) -> Any:
    """The labels of a shape computation: reshaped, converted, sliced, joined, or ``"x"``."""
    if name in ("reshape", "slice", "concatenate"):
        flat = [x for s, v in zip(ins, op.operands, strict=True)
                for x in (s if isinstance(s, tuple) else ("c",) * _size(v))]  # fmt: skip
        if name == "slice" and flat:
            (a,), (b,), (c,) = (
                list(_attr(op, k)) for k in ("start_indices", "limit_indices", "strides")
            )
            flat = flat[a:b:c]
        return _labels(flat)
    if name in _ELEMENTWISE:
        return _labels(["x"] * _size(op.results[0]))
    raise Mixed(f"{op.name} uses the batch size as a value")


def _labels(flat: Any) -> Any:
    flat = tuple(flat)
    return FREE if all(x == "c" for x in flat) else flat


def _fits(name: str, s: Any, v: Any) -> None:
    """Refuses a result whose type has dynamic dimensions other than its state says."""
    from jax.extend.mlir import ir

    t = v.type
    if not isinstance(t, ir.RankedTensorType):
        ok = s is FREE and not isinstance(t, ir.ShapedType)
    else:
        ok = _dynamic_at(t) == ([s] if isinstance(s, int) else []) and (
            not isinstance(s, tuple) or (t.rank <= 1 and _size(v) == len(s))
        )
    if not ok:
        raise Mixed(f"{name} makes a {t} whose dynamic dimensions are not the batch's")


def _size(v: Any) -> int:
    t = v.type
    if _dynamic_at(t):
        raise Mixed(f"a shape tensor of dynamic size {t}")
    return math.prod(t.shape)


def _captured(op: Any) -> Any:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield from inner.operation.operands
                yield from _captured(inner.operation)


def _dynamic_at(t: Any) -> list[int]:
    return [i for i in range(getattr(t, "rank", 0)) if t.is_dynamic_dim(i)]


def _dim(op: Any, i: int) -> Any:
    if op.operands[0].type.is_dynamic_dim(i):
        raise Mixed(f"{op.name} reads a dynamic dimension that is not the batch")
    return FREE


def _attr(op: Any, name: str) -> Any:
    return op.attributes[name]


def _int(op: Any, name: str) -> int:
    return _attr(op, name).value


def _str(op: Any) -> str:
    return _attr(op, "call_target_name").value
