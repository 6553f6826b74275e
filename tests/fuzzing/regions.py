"""The checker's accounting fuzz target: random nestings of reduce, while, call and case whose
work is just under or just over the bound, walked as the loader walks a stranger's module.

Each case draws a tree of constructs (a counted ``while`` of 1 to 2**16 trips, a ``reduce``
over 1 to 2**12 elements whose body is a subtree, a ``case`` whose second branch is one, a
function called 1 to 3 times) over payloads of ``m * k`` elements, and computes from the tree
alone, by how often XLA runs each region, the work, the bytes made and the largest tensor as
linear functions of ``k``. It then picks ``k`` so that the work lands just under or just over
``MAX_WORK`` (within 30%, within one payload, or exactly at the edge) and renders the module.
The oracle expects exactly the problems ``compute`` (work, bytes or a tensor past its bound)
and ``control_in_reducer`` (a loop, case, call or reduce inside a reduce's body), and the
checker's work equal to the oracle's, walking the module in the worker. One case in four,
its bytecode (the writer folds constants) is also read as ``sm.load`` reads it, in the
checker's child process through the signed cache, which must report what the walk does.
Outcomes: ``rejected`` (refused, as expected), ``same`` (passed, as expected), ``wrong``
(another verdict or work: a silent wrong answer), ``foreign`` (an exception); the driver
counts crashes and hangs.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
import traceback
from pathlib import Path

from fuzzing.cases import case_rng

S = "tensor<f32>"


def make(out: Path) -> None:
    """Nothing to write but the directory: each case renders its own module."""
    out.mkdir(parents=True, exist_ok=True)


class Context:
    def __init__(self, out: Path, work: Path):
        self.out, self.work = out.resolve(), work.resolve()
        self.marker = self.out / "PWNED"
        self.work.mkdir(parents=True, exist_ok=True)
        os.environ["XDG_CACHE_HOME"] = str(self.work / "cache")  # the worker's own cache


@dataclasses.dataclass
class Node:
    kind: str  # payload, while, reduce, case, call
    size: int = 1  # payload: m (m * k elements); while: trips; reduce: elements; call: sites
    body: list[Node] = dataclasses.field(default_factory=list)


def tree(rng: random.Random, depth: int) -> list[Node]:
    """A body: one or two constructs, each a payload or a construct around a smaller body."""
    body = []
    for _ in range(rng.choice([1, 1, 2])):
        kind = rng.choice(["payload"] if depth == 0 else ["payload", *["while", "reduce",
                          "case", "call"] * 2])  # fmt: skip
        size = {"payload": rng.randint(1, 3), "call": rng.randint(1, 3), "case": 1}.get(kind)
        if kind == "while":
            size = min(1 << 16, int(2 ** rng.uniform(0, 16.5)))
        elif kind == "reduce":
            size = int(2 ** rng.uniform(0, 12))
        body.append(Node(kind, size, [] if kind == "payload" else tree(rng, depth - 1)))
    return body


@dataclasses.dataclass
class Cost:
    """Linear in k: work ``w1 * k + w0`` (each op run as often as XLA runs it), bytes of the
    tensors made ``b1 * k + b0`` (every call inlined), the largest tensor ``e1 * k + e0``."""

    w1: int = 0
    w0: int = 0
    b1: int = 0
    b0: int = 0
    e1: int = 0
    e0: int = 1
    control_in_reducer: bool = False

    def plus(self, other: Cost, runs: int = 1, copies: int = 1) -> Cost:
        return Cost(
            self.w1 + runs * other.w1, self.w0 + runs * other.w0,
            self.b1 + copies * other.b1, self.b0 + copies * other.b0,
            max(self.e1, other.e1), max(self.e0, other.e0),
            self.control_in_reducer or other.control_in_reducer,
        )  # fmt: skip


def ops(w0: int = 0, b0: int = 0) -> Cost:
    return Cost(w0=w0, b0=b0)


def cost(body: list[Node], in_reducer: bool = False) -> Cost:
    """What the walk must charge for ``body`` (per run; bytes per inlined copy)."""
    total = Cost()
    for n in body:
        scope = n.kind != "call" and (in_reducer or n.kind == "reduce")  # a function: its own
        inner = cost(n.body, scope) if n.body else Cost()
        if n.kind == "payload":  # broadcast, add, slice (m * k each), reshape
            c = Cost(w1=3 * n.size, w0=1, b1=8 * n.size, b0=8, e1=n.size, e0=0)
        elif n.kind == "while":  # constant, while; cond: constant, compare, return; body:
            c = ops(2, 12 + 5 + 8).plus(ops(6), n.size).plus(inner, n.size)  # constant, add
        elif n.kind == "reduce":  # constant, iota, reduce, add; body: add, return
            c = ops(2 + 2 * n.size, 12 + 4 * n.size).plus(ops(2, 4), n.size).plus(inner, n.size)
            c.e0 = max(c.e0, n.size)
        elif n.kind == "case":  # constant, case; branch 0: return; branch 1: body, return
            c = ops(4, 8).plus(inner)
        else:  # each site: a call (1, 4 bytes) of a function: func.func, body, return
            c = Cost().plus(ops(3, 4).plus(inner), n.size, n.size)
        c.control_in_reducer |= in_reducer and n.kind != "payload"
        total = total.plus(c)
    return total


class Render:
    def __init__(self, k: int):
        self.k, self.n, self.funcs = k, 0, []

    def name(self, what: str) -> str:
        self.n += 1
        return f"%{what}{self.n}"

    def body(self, body: list[Node], v: str, pad: str) -> tuple[str, str]:
        text = ""
        for n in body:
            t, v = getattr(self, {"while": "loop"}.get(n.kind, n.kind))(n, v, pad)
            text += t
        return text, v

    def payload(self, n: Node, v: str, pad: str) -> tuple[str, str]:
        t = f"tensor<{n.size * self.k}xf32>"
        b, a, s, r = (self.name(x) for x in "basr")
        return (
            f"{pad}{b} = stablehlo.broadcast_in_dim {v}, dims = [] : ({S}) -> {t}\n"
            f"{pad}{a} = stablehlo.add {b}, {b} : {t}\n"
            f"{pad}{s} = stablehlo.slice {a} [0:1] : ({t}) -> tensor<1xf32>\n"
            f"{pad}{r} = stablehlo.reshape {s} : (tensor<1xf32>) -> {S}\n"
        ), r

    def loop(self, n: Node, v: str, pad: str) -> tuple[str, str]:
        c0, w, i, a, lim, p, one, nx = (self.name(x) for x in ("c", "w", "i", "a", "l", "p", "o",
                                                                "n"))  # fmt: skip
        inner, r = self.body(n.body, a, pad + "  ")
        i32 = "tensor<i32>"
        return (
            f"{pad}{c0} = stablehlo.constant dense<0> : {i32}\n"
            f'{pad}{w}:2 = "stablehlo.while"({c0}, {v}) ({{\n'
            f"{pad}^bb0({i}: {i32}, {a}: {S}):\n"
            f"{pad}  {lim} = stablehlo.constant dense<{n.size}> : {i32}\n"
            f"{pad}  {p} = stablehlo.compare LT, {i}, {lim}, SIGNED : ({i32}, {i32}) -> "
            f'tensor<i1>\n{pad}  "stablehlo.return"({p}) : (tensor<i1>) -> ()\n'
            f"{pad}}}, {{\n{pad}^bb0({i}: {i32}, {a}: {S}):\n"
            f"{pad}  {one} = stablehlo.constant dense<1> : {i32}\n"
            f"{pad}  {nx} = stablehlo.add {i}, {one} : {i32}\n{inner}"
            f'{pad}  "stablehlo.return"({nx}, {r}) : ({i32}, {S}) -> ()\n'
            f"{pad}}}) : ({i32}, {S}) -> ({i32}, {S})\n"
        ), f"{w}#1"

    def reduce(self, n: Node, v: str, pad: str) -> tuple[str, str]:
        z, t, red, a, b, q, o = (self.name(x) for x in "ztrabqo")
        inner, r = self.body(n.body, a, pad + "  ")
        vt = f"tensor<{n.size}xf32>"
        return (
            f"{pad}{z} = stablehlo.constant dense<0.0> : {S}\n"
            f"{pad}{t} = stablehlo.iota dim = 0 : {vt}\n"
            f'{pad}{red} = "stablehlo.reduce"({t}, {z}) ({{\n{pad}^bb0({a}: {S}, {b}: {S}):\n'
            f"{inner}{pad}  {q} = stablehlo.add {r}, {b} : {S}\n"
            f'{pad}  "stablehlo.return"({q}) : ({S}) -> ()\n'
            f"{pad}}}) {{dimensions = array<i64: 0>}} : ({vt}, {S}) -> {S}\n"
            f"{pad}{o} = stablehlo.add {red}, {v} : {S}\n"
        ), o

    def case(self, n: Node, v: str, pad: str) -> tuple[str, str]:
        k, c = self.name("k"), self.name("c")
        inner, r = self.body(n.body, v, pad + "  ")
        ret = '"stablehlo.return"({}) : (' + S + ") -> ()\n"
        return (
            f"{pad}{k} = stablehlo.constant dense<1> : tensor<i32>\n"
            f'{pad}{c} = "stablehlo.case"({k}) ({{\n{pad}  {ret.format(v)}{pad}}}, {{\n'
            f"{inner}{pad}  {ret.format(r)}{pad}}}) : (tensor<i32>) -> {S}\n"
        ), c

    def call(self, n: Node, v: str, pad: str) -> tuple[str, str]:
        f = f"@f{len(self.funcs)}"
        self.funcs.append("")
        inner, r = self.body(n.body, "%arg", "    ")
        self.funcs[int(f[2:])] = (
            f"  func.func private {f}(%arg: {S}) -> {S} {{\n{inner}    return {r} : {S}\n  }}\n"
        )
        text = ""
        for _ in range(n.size):
            c = self.name("call")
            text += f"{pad}{c} = func.call {f}({v}) : ({S}) -> {S}\n"
            v = c
        return text, v

    def module(self, body: list[Node]) -> str:
        inner, r = self.body(body, "%x", "    ")
        main = f"  func.func public @main(%x: {S}) -> {S} {{\n{inner}    return {r} : {S}\n  }}\n"
        return "module @m {\n" + "".join(self.funcs) + main + "}\n"


def mutate(rng: random.Random) -> dict:
    from symjax_mlp._artifact import ops as limits

    body = tree(rng, rng.randint(1, 4))
    c = cost(body).plus(ops(2))  # main: func.func, return
    edge = rng.choice(["under", "over", "near", "edge", "edge+1"])
    target = limits.MAX_WORK * {"under": 1 - rng.uniform(1e-6, 0.3),
                                "over": 1 + rng.uniform(1e-6, 0.3)}.get(edge, 1)  # fmt: skip
    k = max(1, int((target - c.w0) // c.w1))
    if edge == "near":
        k += rng.choice([-1, 0, 1])
    elif edge == "edge+1":
        k += 1
    k = max(1, k)
    work, nbytes, largest = c.w1 * k + c.w0, c.b1 * k + c.b0, max(c.e1 * k, c.e0)
    over = work > limits.MAX_WORK or nbytes > limits.MAX_BYTES or largest > limits.MAX_ELEMENTS
    want = ({"compute"} if over else set()) | (
        {"control_in_reducer"} if c.control_in_reducer else set()
    )
    kinds = sorted({n.kind for n in _all(body)})
    notes = f"{edge} k={k} work={work:.4g} bytes={nbytes:.3g} {'/'.join(kinds)}"
    return {"body": body, "k": k, "work": work, "want": want, "family": edge, "notes": notes,
            "child": rng.random() < 0.25}  # fmt: skip


def _all(body: list[Node]):
    for n in body:
        yield n
        yield from _all(n.body)


def run_case(ctx: Context, seed: int, case: int, *, started=None, verbose: bool = False) -> dict:
    import jax.extend.mlir as jex
    from jax.extend.mlir import ir
    from jax.interpreters import mlir as jax_mlir

    from symjax_mlp._artifact import checker, walk

    rng = case_rng(seed, case)
    t0 = time.perf_counter()
    spec = mutate(rng)
    if started is not None:
        started({"case": case, "family": spec["family"], "notes": spec["notes"]})
    text = Render(spec["k"]).module(spec["body"])
    detail = ""
    try:
        with jax_mlir.make_ir_context():
            report = walk.analyze_module(ir.Module.parse(text))
        got = {p.key for p in report.problems}
        if got != spec["want"] or report.work != spec["work"]:
            outcome = "wrong"
            detail = f"problems {sorted(got)} (want {sorted(spec['want'])}), work {report.work}"
        else:
            outcome = "rejected" if got else "same"
        if spec["child"]:  # the loader's path: bytecode (its writer folds constants), the child
            from fuzzing.forge import serialize_module

            data = serialize_module(text)
            with jax_mlir.make_ir_context():
                direct = walk.analyze_module(jex.deserialize_portable_artifact(data))
            if checker.analyze(data, file=ctx.work / "m") != direct:
                outcome, detail = "wrong", f"the child's report differs from {direct}"
    except Exception as e:
        outcome = "foreign"
        detail = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_tb(e.__traceback__)[-4:])
    if verbose:
        print(text[:4000], detail)
    from fuzzing.worker import peak_rss_mb

    return {
        "case": case,
        "family": f"regions-{spec['family']}",
        "notes": spec["notes"][:200],
        "outcome": outcome,
        "detail": detail[:2000],
        "seconds": round(time.perf_counter() - t0, 4),
        "max_rss_mb": peak_rss_mb(),
    }
