"""The op checker's accounting: a module is charged for every op as often as XLA runs it.

A call graph that fans out (each function calling the one below it twice) is small on disk
and exponential once inlined; a reducer's body runs once per element it combines, a loop's
body once per trip, nested ones multiplied. Each multiplier has a test that fails without it
(a module just over the bound with it, far under without), and the bytes of the tensors made
are bounded, not just their elements. Control flow inside a reducer's body is refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jax.extend.mlir import ir
from jax.interpreters import mlir as jax_mlir

from symjax_mlp._artifact import ops, rows, walk
from symjax_mlp._errors import ArtifactError

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


def composites(text: str) -> str:
    """``text`` with each ``func.call`` a ``stablehlo.composite`` of the callee (what
    ``jax.lax.erf`` exports as: the composite "chlo.erf" of its decomposition)."""
    return re.sub(
        r"func\.call @(\w+)\((%\w+)\)",
        r'stablehlo.composite "my.op" \2 {decomposition = @\1}',
        text,
    )


def test_a_composite_is_allowed_and_charged_as_a_call_of_its_decomposition():
    """A composite (jax.lax.erf's "chlo.erf", an exact GELU's) was refused as an op an MLP never
    needs; XLA runs its decomposition, so the walk charges it as a call: a fan-out of
    composites is refused past the op bound as one of calls is, and a cycle as recursion."""
    small = report(composites(fanout(4)))
    assert not small.problems and small.work >= 2 * 2**4
    assert small.counts["stablehlo.composite"] == 2 * 4 + 1
    [detail] = inlined_ops_problems(report(composites(fanout(ops.MAX_OPS.bit_length()))))
    assert f"at most {ops.MAX_OPS:,}" in detail
    add, back = (
        f"stablehlo.add %x, %x : {T}",
        f'stablehlo.composite "my.op" %x {{decomposition = @f1}} : ({T}) -> {T}',
    )
    cycle = composites(fanout(1)).replace(add, back)  # @f0 composes @f1, which calls @f0
    assert [p.key for p in report(cycle).problems] == ["recursion"]


def named(name: str, t: str = T) -> str:
    """StableHLO text whose ``@main`` applies a composite ``name`` whose decomposition returns
    its operand, as a stranger would write one."""
    return (
        f"module @m {{\n  func.func private @same(%x: {t}) -> {t} {{\n    return %x : {t}\n  }}\n"
        f"  func.func public @main(%x: {t}) -> {t} {{\n"
        f'    %y = stablehlo.composite "{name}" %x {{decomposition = @same, version = 1 : i32}} '
        f": ({t}) -> {t}\n    return %y : {t}\n  }}\n}}\n"
    )


@pytest.mark.parametrize(
    "name, key",
    [("chlo.top_k", "sort"), ("chlo.ragged_dot", "chlo.ragged_dot"), ("chlo.next", "chlo.next")],
)
def test_a_composite_xla_runs_by_its_name_is_refused_as_that_op(name, key):
    """XLA and IREE run a composite "chlo.top_k" (or "chlo.ragged_dot") as the op it names,
    whatever its decomposition does: one whose decomposition returned its operand loaded and
    sorted (or, under IREE, gave each row the weights of its place in a merged batch, which
    the rows analysis of the decomposition took for rows kept apart). An elementwise one
    ("chlo.erf") is allowed; a "chlo." name not known to be elementwise is refused by name."""
    assert [p.key for p in report(named(name)).problems] == [key]
    assert not report(named("chlo.erf")).problems and not report(named("my.erf")).problems
    with jax_mlir.make_ir_context():
        apart = rows.analyze(ir.Module.parse(named("chlo.erf", "tensor<?x2xf32>")))
        mixed = rows.analyze(ir.Module.parse(named(name, "tensor<?x2xf32>")))
    assert apart == {"why": "", "ins": [0], "outs": [0]}
    assert "runs as the op it names" in mixed["why"], mixed


def chain(n: int) -> str:
    """StableHLO text whose ``@main`` calls @c{n}, which calls @c{n - 1}, ..., down to @c0."""
    funcs = [f"  func.func private @c0(%x: {T}) -> {T} {{\n    return %x : {T}\n  }}"]
    funcs += [
        f"  func.func private @c{k}(%x: {T}) -> {T} {{\n"
        f"    %y = func.call @c{k - 1}(%x) : ({T}) -> {T}\n    return %y : {T}\n  }}"
        for k in range(1, n + 1)
    ]
    funcs.append(
        f"  func.func public @main(%x: {T}) -> {T} {{\n"
        f"    %y = func.call @c{n}(%x) : ({T}) -> {T}\n    return %y : {T}\n  }}"
    )
    return "module @m {\n" + "\n".join(funcs) + "\n}\n"


def test_calls_nested_past_the_nesting_bound_are_refused():
    """A chain of 200 functions, each calling the next (by func.call or as a composite's
    decomposition), crashed XLA (SIGSEGV: its stack overflowed converting each callee inside
    its caller), 150 did not: a chain past :data:`ops.MAX_NESTING` is refused as nesting."""
    assert not report(chain(ops.MAX_NESTING - 1)).problems
    for text in (chain(200), composites(chain(200))):
        [problem] = report(text).problems
        assert problem.key == "nesting" and "calls nested 201 deep" in problem.what


def test_a_call_graph_that_takes_xla_a_minute_to_compile_is_refused():
    """A few kB of functions inlining to 2**17 adds took XLA 73 s and 3.7 GB to compile (one
    load, 2 cores); the op bound keeps a compile to seconds: 2**16 adds are refused."""
    [detail] = inlined_ops_problems(report(fanout(16)))
    assert f"at most {ops.MAX_OPS:,}" in detail


# -- regions: every one charged by how often XLA runs it ----------------------------------------
# Each construct runs a call of @big (about 3 * k element operations) ``runs`` times; k is
# chosen so that the work is ``factor`` times the bound once the multiplier is applied, and
# far below it if the multiplier were dropped.
S = "tensor<f32>"


def big(k: int) -> str:
    return (
        f"  func.func private @big(%s: {S}) -> {S} {{\n"
        f"    %v = stablehlo.broadcast_in_dim %s, dims = [] : ({S}) -> tensor<{k}xf32>\n"
        f"    %w = stablehlo.add %v, %v : tensor<{k}xf32>\n"
        f"    %o = stablehlo.slice %w [0:1] : (tensor<{k}xf32>) -> tensor<1xf32>\n"
        f"    %r = stablehlo.reshape %o : (tensor<1xf32>) -> {S}\n"
        f"    return %r : {S}\n  }}"
    )


CALL = f"      %c = func.call @big(%a) : ({S}) -> {S}\n"


def _region(args: str, result: str = "%c", ret: str = S) -> str:
    return f'    ^bb0({args}):\n{CALL}      "stablehlo.return"({result}) : ({ret}) -> ()\n'


PAIR = f"%a: {S}, %b: {S}"


def _while(trips: int, inner: str) -> str:
    return (
        "    %c0 = stablehlo.constant dense<0> : tensor<i32>\n"
        f'    %w:2 = "stablehlo.while"(%c0, %x) ({{\n'
        f"    ^bb0(%i: tensor<i32>, %a: {S}):\n"
        f"      %lim = stablehlo.constant dense<{trips}> : tensor<i32>\n"
        "      %p = stablehlo.compare LT, %i, %lim, SIGNED : (tensor<i32>, tensor<i32>) -> "
        "tensor<i1>\n"
        '      "stablehlo.return"(%p) : (tensor<i1>) -> ()\n'
        "    }, {\n"
        f"    ^bb0(%i: tensor<i32>, %a: {S}):\n"
        "      %one = stablehlo.constant dense<1> : tensor<i32>\n"
        "      %n = stablehlo.add %i, %one : tensor<i32>\n"
        f"{inner}"
        f'      "stablehlo.return"(%n, %c) : (tensor<i32>, {S}) -> ()\n'
        f"    }}) : (tensor<i32>, {S}) -> (tensor<i32>, {S})\n"
        f"    %y = stablehlo.add %w#1, %x : {S}\n"
    )


def construct(kind: str, n: int) -> tuple[str, int]:
    """``(main's body, runs)``: a construct that runs @big ``runs`` times, ``n`` its size."""
    v, f = f"tensor<{n}xf32>", f"tensor<{n - 1}xf32>"
    zero = f"    %z = stablehlo.constant dense<0.0> : {S}\n    %t = stablehlo.iota dim = 0 : {v}\n"
    bit = "      %c = stablehlo.compare LT, %a, %b : (tensor<f32>, tensor<f32>) -> tensor<i1>\n"
    if kind == "while":
        return _while(n, CALL), n
    if kind == "case_in_while":
        case = (
            f"      %k = stablehlo.constant dense<1> : tensor<i32>\n"
            f'      %c = "stablehlo.case"(%k) ({{\n        "stablehlo.return"(%a) : ({S}) -> ()\n'
            f"      }}, {{\n  {CALL}"
            f'        "stablehlo.return"(%c) : ({S}) -> ()\n      }}) : (tensor<i32>) -> {S}\n'
        )
        return _while(n, case), n
    if kind == "call_in_while":
        return _while(n, f"      %c = func.call @mid(%a) : ({S}) -> {S}\n"), n
    sel = f'    ^bb0({PAIR}):\n{bit}      "stablehlo.return"(%c) : (tensor<i1>) -> ()\n'
    ind = f"tensor<{n}x1xi32>"
    reducers = {  # kind: (operands, regions, attributes, types, runs)
        "reduce": ("%t, %z", [_region(PAIR)], "dimensions = array<i64: 0>", f"{v}, {S}) -> {S}", n),
        "map": ("%t", [_region(f"%a: {S}")], "dimensions = array<i64: 0>", f"{v}) -> {v}", n),
        "reduce_window": (
            "%t, %z", [_region(PAIR)], "window_dimensions = array<i64: 2>",
            f"{v}, {S}) -> {f}", 2 * (n - 1),
        ),
        "select_and_scatter": (
            "%t, %s, %z", [sel, _region(PAIR)],
            "window_dimensions = array<i64: 2>, window_strides = array<i64: 1>",
            f"{v}, {f}, {S}) -> {v}", 2 * (n - 1),
        ),
        "scatter": (
            "%t, %i, %t", [_region(PAIR)],
            "scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [0], "
            "scatter_dims_to_operand_dims = [0], index_vector_dim = 1>",
            f"{v}, {ind}, {v}) -> {v}", n,
        ),
        "sort": (
            "%t", [f"    ^bb0({PAIR}):\n{CALL}" + bit.replace("%a,", "%c,").replace("%c =", "%d =")
                   + '      "stablehlo.return"(%d) : (tensor<i1>) -> ()\n'],
            "dimension = 0 : i64", f"{v}) -> {v}", n * n.bit_length(),
        ),
    }  # fmt: skip
    operands, regions, attributes, types, runs = reducers[kind]
    zero += f"    %s = stablehlo.iota dim = 0 : {f}\n    %i = stablehlo.constant dense<0> : {ind}\n"
    op = f'    %r = "stablehlo.{kind}"({operands}) ({{\n' + "    }, {\n".join(regions)
    op += f"    }}) {{{attributes}}} : ({types}\n"
    return zero + op + f"    %y = stablehlo.add %z, %x : {S}\n", runs


def module(kind: str, n: int, k: int) -> str:
    body, _ = construct(kind, n)
    mid = f"  func.func private @mid(%a: {S}) -> {S} {{\n{CALL}    return %c : {S}\n  }}"
    main = f"  func.func public @main(%x: {S}) -> {S} {{\n{body}    return %y : {S}\n  }}"
    return f"module @m {{\n{big(k)}\n{mid}\n{main}\n}}\n"


def over_work(r: ops.ModuleReport) -> bool:
    return any("element operations" in p.what for p in r.problems)


KINDS = ["while", "case_in_while", "call_in_while", "reduce", "map", "reduce_window",
         "select_and_scatter", "scatter", "sort"]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_every_region_is_charged_as_often_as_xla_runs_it(kind):
    n = 1 << 12
    _, runs = construct(kind, n)
    for factor, refused in ((2.0, True), (0.5, False)):
        k = int(factor * ops.MAX_WORK / (3 * runs))
        r = report(module(kind, n, k))
        assert over_work(r) == refused, (kind, factor, r.work, r.problems)
        assert 3 * k * runs <= r.work <= 3 * k * (runs + 1) + 16 * runs + 8 * n, (r.work, k)


def test_calls_are_charged_per_call_site():
    levels = 12  # 4,096 inlined copies of one add of k elements, each ~5k with its calls
    for factor, refused in ((2.0, True), (0.25, False)):
        k = int(factor * ops.MAX_WORK / (5 * 2**levels))
        text = fanout(levels).replace(T, f"tensor<{k}xf32>")
        assert over_work(report(text)) == refused, factor


def test_the_reduce_whose_body_calls_a_function_is_charged_per_element():
    """The 3 kB artifact of the report: a reduce of 2**24 elements whose body calls a
    function of 2**16 elements; it was charged 3.4e7 (0.8% of the bound) and ran ~4e12."""
    body = (
        f"    %z = stablehlo.constant dense<0.0> : {S}\n"
        f"    %t = stablehlo.iota dim = 0 : tensor<{1 << 24}xf32>\n"
        f'    %r = "stablehlo.reduce"(%t, %z) ({{\n{_region(PAIR)}    }}) '
        f"{{dimensions = array<i64: 0>}} : (tensor<{1 << 24}xf32>, {S}) -> {S}\n"
        f"    %y = stablehlo.add %r, %x : {S}\n"
    )
    main = f"  func.func public @main(%x: {S}) -> {S} {{\n{body}    return %y : {S}\n  }}"
    r = report(f"module @m {{\n{big(1 << 16)}\n{main}\n}}\n")
    assert r.work > 3 * 2**40 and over_work(r)
    assert {p.key for p in r.problems} == {"compute", "control_in_reducer"}


def test_a_composite_inside_a_reducer_body_is_refused_as_a_call_there():
    """A composite in a reduce's body (a call of its decomposition, which ran a counted loop
    of 4 steps) escaped the name a func.call there is refused by; XLA's CPU compiler aborted
    (SIGABRT) at the load of such an artifact."""
    body = (
        f"    %z = stablehlo.constant dense<0.0> : {S}\n"
        "    %t = stablehlo.iota dim = 0 : tensor<8xf32>\n"
        f'    %y = "stablehlo.reduce"(%t, %z) ({{\n{_region(PAIR)}    }}) '
        f"{{dimensions = array<i64: 0>}} : (tensor<8xf32>, {S}) -> {S}\n"
    )
    main = f"  func.func public @main(%x: {S}) -> {S} {{\n{body}    return %y : {S}\n  }}"
    r = report(composites(f"module @m {{\n{big(4)}\n{main}\n}}\n"))
    assert r.counts["stablehlo.composite"] == 1
    assert [p.key for p in r.problems] == ["control_in_reducer"]
    assert "stablehlo.composite inside the body of stablehlo.reduce" in r.problems[0].what


@pytest.mark.parametrize("kind", ["while", "call_in_while", "case_in_while"])
def test_control_flow_inside_a_reducer_body_is_refused_by_name(kind):
    inner, _ = construct(kind, 4)
    inner = inner.replace("%x", "%e").replace("%y = ", "%q = ").replace("    ", "      ")
    body = f"    ^bb0(%e: {S}, %b: {S}):\n{inner}" + f'      "stablehlo.return"(%q) : ({S}) -> ()\n'
    op = (
        f"    %z = stablehlo.constant dense<0.0> : {S}\n    %t = stablehlo.iota dim = 0 : "
        f'tensor<8xf32>\n    %y = "stablehlo.reduce"(%t, %z) ({{\n{body}    }}) '
        f"{{dimensions = array<i64: 0>}} : (tensor<8xf32>, {S}) -> {S}\n"
    )
    plain = op.replace(inner, f"      %q = stablehlo.add %e, %b : {S}\n")
    for text, refused in ((op, True), (plain, False)):
        main = f"  func.func public @main(%x: {S}) -> {S} {{\n{text}    return %y : {S}\n  }}"
        mid = f"  func.func private @mid(%a: {S}) -> {S} {{\n{CALL}    return %c : {S}\n  }}"
        r = report(f"module @m {{\n{big(4)}\n{mid}\n{main}\n}}\n")
        keys = {p.key for p in r.problems}
        assert keys == ({"control_in_reducer"} if refused else set()), r.problems
    with pytest.raises(ArtifactError, match="allow=\\{'control_in_reducer'\\}"):
        ops.check(report_of(op), file=Path("m"), allow=frozenset(), caller="load()")


def report_of(body: str) -> ops.ModuleReport:
    main = f"  func.func public @main(%x: {S}) -> {S} {{\n{body}    return %y : {S}\n  }}"
    mid = f"  func.func private @mid(%a: {S}) -> {S} {{\n{CALL}    return %c : {S}\n  }}"
    return report(f"module @m {{\n{big(4)}\n{mid}\n{main}\n}}\n")


@pytest.mark.parametrize("dtype, refused", [("f32", False), ("f64", True), ("i8", False)])
def test_the_bytes_of_the_tensors_made_are_bounded_not_just_their_elements(dtype, refused):
    n = 1 << 28  # 2**28 elements: 1 GiB as f32, 2 GiB as f64 (twice, and 16 bytes: over)
    body = (
        f"    %v = stablehlo.iota dim = 0 : tensor<{n}x{dtype}>\n"
        f"    %w = stablehlo.add %v, %v : tensor<{n}x{dtype}>\n"
        f"    %o = stablehlo.slice %w [0:1] : (tensor<{n}x{dtype}>) -> tensor<1x{dtype}>\n"
        f"    %y = stablehlo.reshape %o : (tensor<1x{dtype}>) -> tensor<{dtype}>\n"
    )
    t = f"tensor<{dtype}>"
    main = f"  func.func public @main() -> {t} {{\n{body}    return %y : {t}\n  }}"
    r = report(f"module @m {{\n{main}\n}}\n")
    assert not over_work(r)
    assert any("bytes" in p.what for p in r.problems) == refused, r.problems


def test_a_convolution_is_charged_for_its_window():
    """Each output element reads a kernel window of every input feature (3 * 3 * 8 here)."""
    import jax
    import jax.numpy as jnp

    conv = jax.jit(lambda x, k: jax.lax.conv(x, k, (1, 1), "VALID"))
    text = conv.lower(jnp.ones((1, 8, 16, 16)), jnp.ones((4, 8, 3, 3))).as_text()
    assert report(text).work >= (4 * 14 * 14) * (8 * 3 * 3)


def nested_ifs(levels: int, per_function: int) -> str:
    """``levels`` functions, each ``per_function`` ``stablehlo.if`` deep, the innermost region
    of each calling the next: ``levels * per_function`` deep once inlined."""
    p, funcs = "tensor<i1>", []
    for k in range(levels):
        inner = f"func.call @f{k + 1}(%x)" if k + 1 < levels else "stablehlo.add %x, %x"
        text = f"%y = {inner} : {'(' + T + ') -> ' if k + 1 < levels else ''}{T}\n"
        for _ in range(per_function):
            text = (
                f'%y = "stablehlo.if"(%p) ({{\n{text}"stablehlo.return"(%y) : ({T}) -> ()\n'
                f'}}, {{\n"stablehlo.return"(%x) : ({T}) -> ()\n}}) : ({p}) -> {T}\n'
            )
        funcs.append(
            f"func.func {'public' if k == 0 else 'private'} @f{k}(%x: {T}) -> {T} {{\n"
            f"%p = stablehlo.constant dense<true> : {p}\n{text}return %y : {T}\n}}"
        )
    return "module @m {\n" + "\n".join(funcs) + "\n}\n"


@pytest.mark.parametrize("levels, per_function", [(1, 100), (10, 10), (1, 60)])
def test_regions_nested_deeper_than_xla_compiles_are_refused(levels, per_function):
    """XLA crashed (SIGSEGV) compiling 300 nested ifs, ran 200; calls nest as they inline."""
    deep = [p.what for p in report(nested_ifs(levels, per_function)).problems]
    assert any("nested" in w for w in deep) == (levels * per_function > ops.MAX_NESTING), deep


def test_a_walked_module_is_not_kept_alive_by_the_walk():
    """The walk held every module it read (a cache decorating the wrong function: a load
    process kept each refined module of each new input shape, the checker's child each module
    it checked, with their MLIR contexts): once its report is made, the module is the caller's."""
    import gc
    import sys

    with jax_mlir.make_ir_context():
        module = ir.Module.parse(fanout(2))
        before = sys.getrefcount(module)
        walk.analyze_module(module)
        gc.collect()
        assert sys.getrefcount(module) == before
