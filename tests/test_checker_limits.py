"""The op checker's accounting of calls: a module is charged for every call once inlined.

A call graph that fans out (each function calling the one below it twice) is small on disk
and exponential once inlined; the checker must count it as XLA will run it.
"""

from __future__ import annotations

import pytest
from jax.extend.mlir import ir
from jax.interpreters import mlir as jax_mlir

from symjax_mlp._artifact import ops, walk

T = "tensor<2xf32>"


def fanout(levels: int) -> str:
    """StableHLO text whose ``@main`` runs ``2**levels`` adds through ``levels`` functions."""
    funcs = [
        f"  func.func private @f0(%x: {T}) -> {T} {{\n"
        f"    %y = stablehlo.add %x, %x : {T}\n    return %y : {T}\n  }}"
    ]
    for k in range(1, levels + 1):
        funcs.append(
            f"  func.func private @f{k}(%x: {T}) -> {T} {{\n"
            f"    %a = func.call @f{k - 1}(%x) : ({T}) -> {T}\n"
            f"    %b = func.call @f{k - 1}(%a) : ({T}) -> {T}\n"
            f"    return %b : {T}\n  }}"
        )
    funcs.append(
        f"  func.func public @main(%x: {T}) -> {T} {{\n"
        f"    %y = func.call @f{levels}(%x) : ({T}) -> {T}\n    return %y : {T}\n  }}"
    )
    return "module @m {\n" + "\n".join(funcs) + "\n}\n"


def report(text: str) -> ops.ModuleReport:
    with jax_mlir.make_ir_context():
        return walk.analyze_module(ir.Module.parse(text))


def inlined_ops_problems(r: ops.ModuleReport) -> list[str]:
    return [p.what for p in r.problems if "once every call is inlined" in p.what]


@pytest.mark.parametrize("levels", [4, 12])
def test_a_small_call_graph_is_within_the_op_bound(levels):
    r = report(fanout(levels))
    assert not inlined_ops_problems(r), r.problems
    assert r.work >= 2 * 2**levels  # each add, every time a call runs it


def test_a_call_graph_that_inlines_past_the_op_bound_is_refused():
    levels = ops.MAX_OPS.bit_length()  # 2**levels adds, past the bound, in 22 small functions
    [detail] = inlined_ops_problems(report(fanout(levels)))
    assert f"at most {ops.MAX_OPS:,}" in detail
