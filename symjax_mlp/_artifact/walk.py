"""What a StableHLO module does: every op of every function walked, in an MLIR context.

:func:`analyze_module` counts the ops and custom-call targets, bounds each ``while`` loop's
trip count, finds recursion, and adds up the element operations, multiplied by loop trip
counts and call counts (dynamic dimensions counted as 1): the
:class:`~symjax_mlp._artifact.ops.ModuleReport` that :func:`~symjax_mlp._artifact.ops.check`
judges. A stranger's bytes are walked only in the checker's child process
(:mod:`~symjax_mlp._artifact.checker`); this process walks only modules it made itself (the
module refined for a call's shapes, from one the child has read).
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path
from typing import Any

from symjax_mlp._artifact import ops
from symjax_mlp._errors import ArtifactError

_INT_MAX = (1 << 31) - 1


def analyze_module(module: Any, *, file: Path | str = "the module") -> ops.ModuleReport:
    """:func:`analyze` of an ``ir.Module`` already parsed (in its context)."""
    try:
        return _Walk(module).report()
    except RecursionError:
        raise ArtifactError(f"{file}: its regions nest too deeply to check; refused.") from None
    except (RuntimeError, ValueError, TypeError, UnicodeDecodeError) as e:  # MLIR bindings
        raise ArtifactError(
            f"{file}: the StableHLO module cannot be checked ({type(e).__name__}: "
            f"{str(e)[:200]}); refused."
        ) from e


# -- the walk ---------------------------------------------------------------------------------
def _short(name: str) -> str:
    return name.removeprefix("stablehlo.")


class _Walk:
    def __init__(self, module: Any) -> None:
        self.module = module
        self.counts: collections.Counter[str] = collections.Counter()
        self.custom: collections.Counter[str] = collections.Counter()
        self.problems: dict[tuple[str, str], ops.Problem] = {}
        self.funcs: dict[str, dict[str, Any]] = {}  # name -> {"work", "ops", "calls"}
        self.n_modules = 0

    def report(self) -> ops.ModuleReport:
        self._op(self.module.operation, None, 1)
        if self.n_modules != 1:
            self._problem("module", f"{self.n_modules} nested modules")
        work = self._inline()
        if work > ops.MAX_WORK:
            self._problem(
                "compute",
                f"about {work:.3g} element operations per call beyond the batch (at most "
                f"{ops.MAX_WORK:.3g}): compiling or running it could take hours",
            )
        return ops.ModuleReport(
            dict(self.counts.most_common()),
            dict(self.custom.most_common()),
            work,
            tuple(self.problems.values()),
        )

    def _problem(self, key: str, what: str) -> None:
        self.problems.setdefault((key, what), ops.Problem(key, what))

    def _op(self, op: Any, func: dict[str, Any] | None, mult: int) -> None:
        name = op.name
        self.counts[name] += 1
        if name == "builtin.module":
            self.n_modules += 1
        elif name == "func.func":
            fname = _str_attr(op, "sym_name") or f"#{len(self.funcs)}"
            func = self.funcs.setdefault(fname, {"work": 0, "ops": 0, "calls": []})
            if not op.regions or not len(op.regions[0].blocks):
                self._problem(  # jax.export writes none; lowering one crashed JAX (SIGSEGV)
                    "call", f"the function @{fname} is declared without a body (an external symbol)"
                )
            if func["ops"]:
                self._problem("module", f"two functions named @{fname}")
            mult = 1
        elif name not in ops.ALLOWED_OPS and not name.startswith(ops.ALLOWED_DIALECTS):
            self._problem(_short(name), f"the op {name}")
        if func is not None:
            func["ops"] += 1  # inlining copies a loop body once, not once per iteration
            func["work"] += mult * self._cost(op)
        if name == "stablehlo.custom_call":
            target = _str_attr(op, "call_target_name") or "?"
            self.custom[target] += 1
            if target in ops.HOST_CALLBACKS:
                self._problem(
                    f"custom_call:{target}",
                    f"a host callback ({target}): it calls a Python function of the process "
                    "that exported the model, which here is no function or another one",
                )
            elif target not in ops.JAX_CUSTOM_CALLS:
                self._problem(
                    f"custom_call:{target}",
                    f"custom_call @{target}: a native kernel that reads and writes buffers of "
                    "the sizes the module declares, unchecked",
                )
            else:
                self._jax_custom_call(op, target)
                self._attributes(op, name)
        elif name == "func.call" and func is not None:
            callee = _symbol_attr(op, "callee")
            func["calls"].append((callee, mult))
        if name != "stablehlo.custom_call":  # a kernel allowed by name: its attributes too
            self._attributes(op, name)
        inner = mult
        if name == "stablehlo.while":
            trips = _trip_count(op)
            if trips is None:
                self._problem("while", "a while loop whose trip count is not a constant")
                trips = ops.MAX_LOOP_TRIPS
            elif trips > ops.MAX_LOOP_TRIPS:
                self._problem(
                    "while",
                    f"a while loop of {trips:,} iterations (at most {ops.MAX_LOOP_TRIPS:,})",
                )
            inner = mult * max(trips, 1)
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    self._op(child.operation, func, inner)

    def _attributes(self, op: Any, name: str) -> None:
        """Dialect-prefixed attributes (``jax.*``, ``mhlo.*``: nothing verifies those) must
        be ones jax.export writes, of the type it writes: JAX and XLA read them unchecked."""
        from jax.extend.mlir import ir

        for attr_name in op.attributes:
            a = op.attributes[attr_name]
            if "." in attr_name:
                self._attribute(name, attr_name, a)
            elif attr_name in ("arg_attrs", "res_attrs") and name == "func.func":
                for entry in a if isinstance(a, ir.ArrayAttr) else [None]:
                    if not isinstance(entry, ir.DictAttr):
                        self._problem("attribute", f"{name} with {attr_name} of {entry}")
                        continue
                    for i in range(len(entry)):
                        named = entry[i]
                        self._attribute(f"{name} argument", named.name, named.attr)

    def _attribute(self, where: str, attr_name: str, a: Any) -> None:
        if attr_name.startswith("sdy."):
            return  # Shardy verifies its own attributes
        kinds = _attribute_kinds().get(attr_name)
        if kinds is None or not isinstance(a, kinds):
            self._problem(
                "attribute",
                f"the attribute {attr_name} ({type(a).__name__}) of {where}, which jax.export "
                "does not write so",
            )

    def _jax_custom_call(self, op: Any, target: str) -> None:
        """A custom call jax.export emits must look exactly like what it emits: JAX's shape
        refinement read a forged ``shape_assertion`` (an error_message that was no string)
        and crashed (SIGSEGV)."""
        from jax.extend.mlir import ir

        attrs = {n: op.attributes[n] for n in op.attributes}
        operands, results = list(op.operands), list(op.results)
        want = {
            "call_target_name": ir.StringAttr,
            "api_version": ir.IntegerAttr,
            "has_side_effect": ir.BoolAttr,
        }
        if target == "shape_assertion":
            want["error_message"] = ir.StringAttr
            shaped = (
                {"error_message", "has_side_effect"} <= set(attrs)
                and not results
                and operands
                and all(
                    _scalar_type(v.type, {1} if i == 0 else {32, 64})
                    for i, v in enumerate(operands)
                )
            )
        else:  # sharding annotations: one array in, the same array out
            want["backend_config"] = ir.StringAttr
            want["mhlo.sharding"] = ir.StringAttr
            want["mhlo.frontend_attributes"] = ir.DictAttr
            shaped = len(operands) == 1 and len(results) == 1
        typed = set(attrs) <= set(want) and all(isinstance(attrs[k], want[k]) for k in attrs)
        if not (shaped and typed):
            self._problem(
                f"custom_call:{target}",
                f"custom_call @{target} with operands, results or attributes other than those "
                "jax.export writes",
            )

    def _cost(self, op: Any) -> int:
        sizes = [_elements(v.type) for v in (*op.operands, *op.results)]
        for n in sizes:
            if n > ops.MAX_ELEMENTS:
                self._problem(
                    "compute",
                    f"a tensor of {n:,} elements in {op.name} (at most {ops.MAX_ELEMENTS:,})",
                )
        cost = max(sizes, default=1)
        if op.name == "stablehlo.dot_general" and op.results:
            cost = _elements(op.results[0].type) * _contracting(op)
        return cost

    def _inline(self) -> int:
        """Work of ``main`` with every call inlined; flags recursion and call explosions."""
        order, state = [], {}

        def visit(name: str, path: list[str]) -> None:
            if state.get(name) == 2:
                return
            if state.get(name) == 1:
                cycle = " -> ".join([*path[path.index(name) :], name])
                self._problem("recursion", f"recursive calls ({cycle}), which never finish")
                return
            state[name] = 1
            for callee, _ in self.funcs.get(name, {}).get("calls", []):
                if callee not in self.funcs:
                    self._problem("call", f"a call of @{callee}, which the module does not define")
                else:
                    visit(callee, [*path, name])
            state[name] = 2
            order.append(name)

        for name in self.funcs:
            visit(name, [])
        if any(p.key == "recursion" for p in self.problems.values()):
            return sum(f["work"] for f in self.funcs.values())
        total_work: dict[str, int] = {}
        total_ops: dict[str, int] = {}
        for name in order:  # callees first
            f = self.funcs[name]
            total_work[name] = f["work"] + sum(
                m * total_work.get(c, 0) for c, m in f["calls"] if c in self.funcs
            )
            total_ops[name] = f["ops"] + sum(
                total_ops.get(c, 0) for c, _ in f["calls"] if c in self.funcs
            )
        roots = [n for n in self.funcs if not any(n == c for f in self.funcs.values()
                                                  for c, _ in f["calls"])]  # fmt: skip
        n_ops = sum(total_ops[n] for n in roots)
        if n_ops > ops.MAX_OPS:
            self._problem(
                "compute", f"{n_ops:,} ops once every call is inlined (at most {ops.MAX_OPS:,})"
            )
        return sum(total_work[n] for n in roots)


# -- attribute and type helpers ----------------------------------------------------------------
@functools.cache  # built on first use: MLIR's bindings import only in the checker
def _attribute_kinds() -> dict[str, tuple[type, ...]]:
    from jax.extend.mlir import ir

    string, integer, boolean = (ir.StringAttr,), (ir.IntegerAttr,), (ir.BoolAttr,)
    return {
        "jax.uses_shape_polymorphism": boolean,
        "jax.global_constant": string,
        "jax.result_info": string,
        "jax.buffer_donor": boolean,
        "mhlo.num_partitions": integer,
        "mhlo.num_replicas": integer,
        "mhlo.sharding": string,
        "mhlo.layout_mode": string,
        "mhlo.memory_kind": string,
        "mhlo.frontend_attributes": (ir.DictAttr,),
        "mhlo.backend_config": (ir.DictAttr, ir.StringAttr),
        "tf.aliasing_output": integer,
        "stablehlo.mesh": (ir.DictAttr,),  # on sdy.mesh, as Shardy writes it
    }


def _scalar_type(t: Any, widths: set[int]) -> bool:
    from jax.extend.mlir import ir

    return (
        isinstance(t, ir.RankedTensorType)
        and t.rank == 0
        and isinstance(t.element_type, ir.IntegerType)
        and t.element_type.width in widths
    )


def _attr(op: Any, name: str) -> Any:
    try:
        return op.attributes[name]
    except (KeyError, IndexError, ValueError):
        return None


def _str_attr(op: Any, name: str) -> str | None:
    from jax.extend.mlir import ir

    a = _attr(op, name)  # value_bytes: a forged name need not be UTF-8
    return a.value_bytes.decode("utf-8", "replace") if isinstance(a, ir.StringAttr) else None


def _symbol_attr(op: Any, name: str) -> str:
    from jax.extend.mlir import ir

    a = _attr(op, name)
    if not isinstance(a, ir.FlatSymbolRefAttr):
        return "?"
    try:
        return a.value
    except (RuntimeError, UnicodeDecodeError):  # a forged name need not be UTF-8
        return str(a).removeprefix("@")


def _elements(t: Any) -> int:
    from jax.extend.mlir import ir

    return _static_size(t, range(t.rank)) if isinstance(t, ir.RankedTensorType) else 1


def _static_size(t: Any, dims: Any) -> int:
    """The product of ``t``'s static dimensions among ``dims`` (dynamic ones count as 1)."""
    n = 1
    for i in dims:
        if not t.is_dynamic_dim(i):
            n *= max(t.get_dim_size(i), 0)
    return n


def _contracting(op: Any) -> int:
    from jax.extend.mlir import ir
    from jax.extend.mlir.dialects import stablehlo as hlo

    try:
        dims = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
        lhs = op.operands[0].type
        if not isinstance(lhs, ir.RankedTensorType):
            return 1
        return max(_static_size(lhs, dims.lhs_contracting_dimensions), 1)
    except (ValueError, KeyError, IndexError, TypeError):
        return max((_elements(v.type) for v in op.operands), default=1)


def _scalar_int(value: Any) -> int | None:
    """The value of a scalar integer ``stablehlo.constant``, else None."""
    from jax.extend.mlir import ir

    if not isinstance(value, ir.OpResult):
        return None
    op = value.owner.operation
    if op.name != "stablehlo.constant":
        return None
    dense = _attr(op, "value")
    if not isinstance(dense, ir.DenseIntElementsAttr) or not dense.is_splat:
        return None
    t = dense.type
    if not isinstance(t, ir.RankedTensorType) or t.rank != 0:
        return None
    et = t.element_type
    if not isinstance(et, ir.IntegerType) or et.width not in (32, 64) or et.is_unsigned:
        return None
    return int(dense.get_splat_value().value)


def _block_arg(value: Any, block: Any) -> int | None:
    from jax.extend.mlir import ir

    if isinstance(value, ir.BlockArgument) and value.owner == block:
        return value.arg_number
    return None


def _trip_count(op: Any) -> int | None:
    """The trip count of a counted ``stablehlo.while``, or None if it is not one.

    Counted: the condition is ``counter < limit`` (signed) of a loop-carried ``counter``
    that starts at a constant and that the body increments by a constant ``step >= 1``, with
    ``limit`` a constant and ``limit + step`` within int32 (no wrap-around).
    """
    try:
        cond, body = op.regions[0].blocks[0], op.regions[1].blocks[0]
        pred = list(cond.operations)[-1].operands
        if len(pred) != 1:
            return None
        from jax.extend.mlir import ir
        from jax.extend.mlir.dialects import stablehlo as hlo

        if not isinstance(pred[0], ir.OpResult):
            return None
        cmp = pred[0].owner.operation
        if cmp.name != "stablehlo.compare" or cmp.block != cond:
            return None
        if hlo.ComparisonDirectionAttr(cmp.attributes["comparison_direction"]).value != "LT":
            return None
        kind = _attr(cmp, "compare_type")
        if kind is not None and hlo.ComparisonTypeAttr(kind).value != "SIGNED":
            return None
        k = _block_arg(cmp.operands[0], cond)
        limit = _scalar_int(cmp.operands[1])
        if k is None or limit is None:
            return None
        start = _scalar_int(op.operands[k])
        returned = list(body.operations)[-1].operands
        if start is None or k >= len(returned) or not isinstance(returned[k], ir.OpResult):
            return None
        add = returned[k].owner.operation
        if add.name != "stablehlo.add" or add.block != body:
            return None
        a, b = add.operands[0], add.operands[1]
        if _block_arg(a, body) == k:
            step = _scalar_int(b)
        elif _block_arg(b, body) == k:
            step = _scalar_int(a)
        else:
            return None
        if step is None or step < 1 or limit + step > _INT_MAX:
            return None
        return max(0, -(-(limit - start) // step))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
