"""What a StableHLO module does: every op of every function walked, in an MLIR context.

:func:`analyze_module` counts ops and custom calls, loops' trips, recursion, control flow in
reducers, work (:mod:`~symjax_mlp._artifact.cost`) and bytes made, every call inlined: the
:class:`ops.ModuleReport` that :func:`ops.check` judges. A stranger's bytes are walked only in
the checker's child process; this process walks only modules it refined itself.
"""

from __future__ import annotations

import collections
import functools
import graphlib
from typing import Any

from jax.extend.mlir import ir

from symjax_mlp._artifact import cost, ops
from symjax_mlp._errors import ArtifactError


def analyze_module(module: Any, head: str = "the module: ") -> ops.ModuleReport:
    """The report of an ``ir.Module`` already parsed (in its context); an ``ArtifactError``
    headed ``head`` where it cannot be walked (the checker's child: none, its parent names the
    file)."""
    try:
        return _Walk(module).report()
    except RecursionError:
        raise ArtifactError(f"{head}its regions nest too deeply to check; refused.") from None
    except (RuntimeError, ValueError, TypeError, UnicodeDecodeError) as e:  # MLIR bindings
        raise ArtifactError(
            f"{head}the StableHLO module cannot be checked ({type(e).__name__}: "
            f"{str(e)[:200]}); refused."
        ) from e


_OPEN_LOOP = "a while loop whose trip count is not a constant"
_BOUND = (
    f" if each while loop whose trip count is not a constant ran {ops.MAX_LOOP_TRIPS:,} trips (a "
    "bound the check assumes, not a measure)"
)


class _Walk:
    def __init__(self, module: Any) -> None:
        self.module = module
        self.counts: collections.Counter[str] = collections.Counter()
        self.custom: collections.Counter[str] = collections.Counter()
        self.problems: dict[tuple[str, str], ops.Problem] = {}
        self.funcs: dict[str, dict[str, Any]] = {}  # name -> work, ops, bytes, depth, calls
        self.assertions: dict[str, None] = {}  # shape assertions' messages, in order

    def report(self) -> ops.ModuleReport:
        self._op(self.module.operation, None, 1)
        if (n := self.counts["builtin.module"]) != 1:
            self._problem("module", f"{n} nested modules")
        work, bytes_made, n_ops = self._inline()
        if work > ops.MAX_WORK:  # a loop of data's trips counted at its bound (diffrax's)
            bound = ("while", _OPEN_LOOP) in self.problems
            self._problem(
                "compute",
                f"about {work:.3g} element operations per call beyond the batch (at most "
                f"{ops.MAX_WORK:.3g}){_BOUND if bound else ''}: compiling or running it could take "
                "hours",
            )
        return ops.ModuleReport(
            dict(self.counts.most_common()),
            dict(self.custom.most_common()),
            work,
            bytes_made,
            tuple(self.problems.values()),
            n_ops,
            main=_main_types(self.module),
            assertions=tuple(self.assertions),
        )

    def _problem(self, key: str, what: str) -> None:
        self.problems.setdefault((key, what), ops.Problem(key, what))

    def _op(self, op: Any, func: dict[str, Any] | None, mult: int, reducer: str = "",
            depth: int = 0) -> None:  # fmt: skip
        name = op.name
        self.counts[name] += 1
        if name == "func.func":
            fname = _str_attr(op, "sym_name") or f"#{len(self.funcs)}"
            func = self.funcs.setdefault(fname, {**_EMPTY, "calls": []})
            if not op.regions or not len(op.regions[0].blocks):
                self._problem(  # jax.export writes none; lowering one crashed JAX (SIGSEGV)
                    "call", f"the function @{fname} is declared without a body (an external symbol)"
                )
            if func["ops"]:
                self._problem("module", f"two functions named @{fname}")
            mult = 1
        elif name not in ops.ALLOWED_OPS and not name.startswith(ops.ALLOWED_DIALECTS):
            self._problem(name.removeprefix("stablehlo."), f"the op {name}")
        if reducer and (op.regions or name in ops.CALLS):  # a composite: a call
            self._problem(
                "control_in_reducer",
                f"{name} inside the body of {reducer}, which XLA runs per element (no exporter "
                "writes one; XLA's CPU compiler aborted on a loop there)",
            )
        if func is not None:
            func["depth"] = max(func["depth"], depth)  # regions around it, in its function
            func["ops"] += 1  # inlining copies a loop body once, not once per iteration
            func["work"] += mult * self._cost(op)
            func["bytes"] += sum(cost.nbytes(v.type) for v in op.results)
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
        else:
            self._attributes(op, name)
        if name in ops.CALLS and func is not None:  # a composite: a call of its decomposition
            func["calls"].append((_symbol_attr(op, ops.CALLS[name]), mult, depth))
        named = (_str_attr(op, "name") or "") if name == "stablehlo.composite" else ""
        if key := ops.composite_key(named):
            self._problem(
                key,
                f"the composite {named[:100]!r}, which XLA and IREE run as the op it names, "
                "whatever its decomposition does",
            )
        inner = mult
        if name == "stablehlo.while":
            trips = cost.trip_count(op)
            if trips is None or trips > ops.MAX_LOOP_TRIPS:
                of = f"of {trips:,} iterations (at most {ops.MAX_LOOP_TRIPS:,})" if trips else ""
                self._problem("while", f"a while loop {of}" if of else _OPEN_LOOP)
            inner = mult * max(ops.MAX_LOOP_TRIPS if trips is None else trips, 1)
        elif name in cost.REDUCERS:
            inner, reducer = mult * cost.region_runs(op), name
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    below = 0 if name in ("builtin.module", "func.func") else depth + 1
                    self._op(child.operation, func, inner, reducer, below)

    def _attributes(self, op: Any, name: str) -> None:
        """Dialect-prefixed attributes (``jax.*``, ``mhlo.*``: nothing verifies those) must
        be ones jax.export writes, of the type it writes: JAX and XLA read them unchecked."""
        for attr_name in op.attributes:  # only those checked are read: a complex constant's
            if "." in attr_name:  # value has no Python class (reading it raises TypeError)
                self._attribute(name, attr_name, op.attributes[attr_name])
            elif attr_name in ("arg_attrs", "res_attrs") and name == "func.func":
                a = op.attributes[attr_name]
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
        attrs = {n: op.attributes[n] for n in op.attributes}
        operands, results = list(op.operands), list(op.results)
        want = {"call_target_name": ir.StringAttr, "api_version": ir.IntegerAttr,
                "has_side_effect": ir.BoolAttr}  # fmt: skip
        if target == "shape_assertion":
            want["error_message"] = ir.StringAttr
            if len(self.assertions) < 64 and (said := _str_attr(op, "error_message")):
                self.assertions[said[:1000]] = None
            shaped = (
                {"error_message", "has_side_effect"} <= set(attrs)
                and not results
                and operands
                and all(
                    cost.scalar_type(v.type, {1} if i == 0 else {32, 64})
                    for i, v in enumerate(operands)
                )
            )
        else:  # sharding annotations: one array in, the same array out
            want |= dict.fromkeys(("backend_config", "mhlo.sharding"), ir.StringAttr)
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
        sizes = [cost.elements(v.type) for v in (*op.operands, *op.results)]
        for n in sizes:
            if n > ops.MAX_ELEMENTS:
                self._problem(
                    "compute",
                    f"a tensor of {n:,} elements in {op.name} (at most {ops.MAX_ELEMENTS:,})",
                )
        if op.name == "stablehlo.dot_general" and op.results:
            return cost.elements(op.results[0].type) * cost.contracting(op)
        if op.name == "stablehlo.convolution" and op.results:
            return cost.elements(op.results[0].type) * cost.window(op)
        return max(sizes, default=1)

    def _inline(self) -> tuple[int, int, int]:
        """Work and bytes made of the module with every call inlined; flags recursion and call
        explosions."""
        graph = {n: {c for c, *_ in f["calls"]} for n, f in self.funcs.items()}
        called = set().union(*graph.values())  # once: per function, 20,000 took 11 s
        for c in called - set(graph):
            self._problem("call", f"a call of @{c}, which the module does not define")
            graph[c] = set()
        try:
            order = list(graphlib.TopologicalSorter(graph).static_order())  # callees first
        except graphlib.CycleError as e:
            cycle = " -> ".join(reversed(e.args[1]))
            self._problem("recursion", f"recursive calls ({cycle}), which never finish")
            return tuple(sum(f[k] for f in self.funcs.values()) for k in ("work", "bytes", "ops"))
        total: dict[str, dict[str, int]] = {}
        for name in order:  # a call inlines one copy, run m times
            f = self.funcs.get(name, {**_EMPTY, "calls": []})
            calls = f["calls"]
            total[name] = {
                k: f[k] + sum((m if k == "work" else 1) * total[c][k] for c, m, _ in calls)
                for k in ("work", "ops", "bytes")
            }
            total[name]["depth"] = max([f["depth"], *(d + total[c]["depth"] for c, _, d in calls)])
            total[name]["chain"] = max([0, *(1 + total[c]["chain"] for c, *_ in calls)])
        roots = [n for n in self.funcs if n not in called]
        if (deepest := max((total[n]["depth"] for n in roots), default=0)) > ops.MAX_NESTING:
            self._problem(
                "nesting",
                f"regions nested {deepest} deep once every call is inlined (at most "
                f"{ops.MAX_NESTING}): XLA crashed (SIGSEGV) compiling 300 nested ifs",
            )
        if (chain := max((total[n]["chain"] for n in roots), default=0)) > ops.MAX_NESTING:
            self._problem(  # func.call or composite: XLA converts each callee inside its caller
                "nesting",
                f"calls nested {chain} deep, each function calling the next (at most "
                f"{ops.MAX_NESTING}): XLA crashed (SIGSEGV) converting a chain of 200 calls",
            )
        n_ops, n_bytes = (sum(total[n][k] for n in roots) for k in ("ops", "bytes"))
        if n_ops > ops.MAX_OPS:
            self._problem(
                "compute", f"{n_ops:,} ops once every call is inlined (at most {ops.MAX_OPS:,})"
            )
        if n_bytes > ops.MAX_BYTES:
            self._problem(
                "compute",
                f"tensors of {n_bytes:,} bytes in all, beyond the batch, once every call is "
                f"inlined (at most {ops.MAX_BYTES:,}): XLA may allocate that much",
            )
        return sum(total[n]["work"] for n in roots), n_bytes, n_ops


_EMPTY = {"work": 0, "ops": 0, "bytes": 0, "depth": 0}  # a function's totals before its ops


# -- attribute and type helpers ----------------------------------------------------------------
def _main_types(module: Any) -> dict[str, list[str]] | None:
    """The MLIR types ``main`` takes and returns (its ``func.return``'s): what JAX calls it
    with and reads back as the export's avals (:func:`ops.check_main`); ``None``: no main."""
    for f in module.body.operations:
        op = f.operation
        if op.name == "func.func" and _str_attr(op, "sym_name") == "main" and op.regions:
            blocks = op.regions[0].blocks
            if not len(blocks) or not len(body := blocks[0].operations):
                return None
            ret = body[len(body) - 1].operation
            outs = [str(v.type) for v in ret.operands] if ret.name == "func.return" else []
            return {"ins": [str(a.type) for a in blocks[0].arguments], "outs": outs}
    return None


@functools.cache  # built once, on first use
def _attribute_kinds() -> dict[str, tuple[type, ...]]:
    string, integer, boolean = (ir.StringAttr,), (ir.IntegerAttr,), (ir.BoolAttr,)
    return {
        **dict.fromkeys(("jax.uses_shape_polymorphism", "jax.buffer_donor"), boolean),
        **dict.fromkeys(("jax.global_constant", "jax.result_info", "mhlo.sharding"), string),
        **dict.fromkeys(("mhlo.layout_mode", "mhlo.memory_kind"), string),
        **dict.fromkeys(("mhlo.num_partitions", "mhlo.num_replicas"), integer),
        **dict.fromkeys(("mhlo.frontend_attributes", "stablehlo.mesh"), (ir.DictAttr,)),
        "mhlo.backend_config": (ir.DictAttr, ir.StringAttr),
        "tf.aliasing_output": integer,
    }  # stablehlo.mesh: on sdy.mesh, as Shardy writes it


def _str_attr(op: Any, name: str) -> str | None:
    a = cost.attr(op, name)  # value_bytes: a forged name need not be UTF-8
    return a.value_bytes.decode("utf-8", "replace") if isinstance(a, ir.StringAttr) else None


def _symbol_attr(op: Any, name: str) -> str:
    a = cost.attr(op, name)
    if not isinstance(a, ir.FlatSymbolRefAttr):
        return "?"
    try:
        return a.value
    except (RuntimeError, UnicodeDecodeError):  # a forged name need not be UTF-8
        return str(a).removeprefix("@")
