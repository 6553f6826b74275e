"""Drawing a jaxpr as Graphviz DOT: one node per equation, clustered by layer; an equation with
sub-jaxprs (``jit``, ``cond``, ``scan``, ``while``) is a labelled cluster of their equations."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from jax.extend import core as jex_core

from symjax_mlp._hybrid.jaxpr import Body, bodies, call_name, layer_of

# What a variable stands for in the drawing: the nodes that produce it, or a literal
_Source = list[str] | jex_core.Literal


def to_dot(closed: Any, name: str) -> str:
    """Graphviz DOT: one node per equation, clustered by layer, edges along data flow."""
    jaxpr = closed.jaxpr
    drawing = _Drawing()
    env: dict[Any, _Source] = {}
    head: list[str] = []
    for i, v in enumerate(jaxpr.invars):
        _var(f"in{i}", v, env, head)
    for i, v in enumerate(jaxpr.constvars):
        _var(f"const{i}", v, env, head, ", style=dashed")
    head += drawing.jaxpr(jaxpr, env)
    for i, v in enumerate(jaxpr.outvars):
        head.append(f'out{i} [shape=ellipse, label="{_quote(_aval(v))}"];')
        drawing.edges += [f"{s} -> out{i};" for s in drawing.sources(v, env, head)]
    lines = [f"  {line}" for line in ("rankdir=TB;", "node [fontsize=10];", *head, *drawing.edges)]
    return "\n".join([f'digraph "{_quote(name)}" {{', *lines, "}"]) + "\n"


def _var(node: str, v: Any, env: dict[Any, _Source], out: list[str], style: str = "") -> None:
    """Draws variable ``v`` as ``node`` (into ``out``) and binds it in ``env``."""
    out.append(f'{node} [shape=ellipse{style}, label="{_quote(_aval(v))}"];')
    env[v] = [node]


class _Drawing:
    """Node and cluster ids, and the edges, of one DOT graph being drawn."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.edges: list[str] = []

    def new(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"

    def cluster(self, label: str, body: list[str], style: str = "") -> list[str]:
        head = f'subgraph {self.new("cluster_")} {{ label="{_quote(label)}";{style}'
        return [head, *(f"  {line}" for line in body), "}"]

    def sources(self, atom: Any, env: dict[Any, _Source], out: list[str]) -> list[str]:
        """The nodes an input ``atom`` comes from; a literal is drawn (into ``out``) here."""
        if isinstance(atom, jex_core.Literal):
            node = self.new("lit")
            out.append(f'{node} [shape=plaintext, label="{_quote(_literal(atom))}"];')
            return [node]
        source = env.get(atom, [])
        return self.sources(source, env, out) if isinstance(source, jex_core.Literal) else source

    def jaxpr(self, jaxpr: Any, env: dict[Any, _Source]) -> list[str]:
        """The nodes of ``jaxpr``'s equations, in one cluster per layer (named scope)."""
        groups: dict[str, list[str]] = {}
        for eqn in jaxpr.eqns:
            out = groups.setdefault(layer_of(str(eqn.source_info.name_stack)), [])
            subs = bodies(eqn)
            if subs:
                self._nested(eqn, subs, env, out)
                continue
            node = self.new("op")
            avals = ", ".join(_aval(v) for v in eqn.outvars)
            out.append(f'{node} [shape=box, label="{eqn.primitive.name}\\n{_quote(avals)}"];')
            for atom in eqn.invars:
                self.edges += [f"{s} -> {node};" for s in self.sources(atom, env, out)]
            env.update((v, [node]) for v in eqn.outvars)
        lines: list[str] = []
        for layer, nodes in groups.items():
            lines += self.cluster(layer, nodes) if layer else nodes
        return lines

    def _nested(self, eqn: Any, subs: list[Body], env: dict[Any, _Source], out: list[str]):
        """``eqn`` as a cluster of its sub-jaxprs, wired to its inputs and outputs."""
        inner: list[str] = []
        produced: list[list[str]] = [[] for _ in eqn.outvars]
        bound: set[int] = set()
        for k, body in enumerate(subs):
            benv: dict[Any, _Source] = {}
            lines: list[str] = []
            for v in body.jaxpr.constvars:
                _var(self.new("const"), v, benv, lines, ", style=dashed")
            for v, index in zip(body.jaxpr.invars, _inputs(eqn, k, body), strict=True):
                if index is None:
                    _var(self.new("arg"), v, benv, lines)
                    continue
                bound.add(index)
                atom = eqn.invars[index]
                benv[v] = atom if isinstance(atom, jex_core.Literal) else env.get(atom, [])
            lines += self.jaxpr(body.jaxpr, benv)
            outs = body.jaxpr.outvars  # the equation's, but for a while loop's condition
            loop_cond = eqn.primitive.name == "while" and body.role == "cond"
            if len(outs) == len(eqn.outvars) and not loop_cond:
                for i, v in enumerate(outs):
                    produced[i] += self.sources(v, benv, lines)
            inner += self.cluster(body.role, lines, " style=dashed;") if body.role else lines
        free = [a for i, a in enumerate(eqn.invars) if i not in bound]
        if free or not all(produced):  # e.g. a cond's branch index
            node = self.new("op")
            label = "index" if eqn.primitive.name == "cond" else eqn.primitive.name
            inner.append(f'{node} [shape=diamond, label="{label}"];')
            for atom in free:
                self.edges += [f"{s} -> {node};" for s in self.sources(atom, env, inner)]
            produced = [p or [node] for p in produced]
        out += self.cluster(_title(eqn), inner)
        env.update(zip(eqn.outvars, produced, strict=True))


def _inputs(eqn: Any, k: int, body: Body) -> list[int | None]:
    """Per input of ``eqn``'s ``k``-th sub-jaxpr, the equation's input bound to it, or ``None``."""
    n, params = len(body.jaxpr.invars), eqn.params
    if eqn.primitive.name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        carry = list(range(nc + nb, len(eqn.invars)))
        consts = list(range(nc)) if body.role == "cond" else list(range(nc, nc + nb))
        return consts + carry
    m = len(eqn.invars)
    if n <= m:  # a call or scan: all of them; a cond's branches: all but the index
        return list(range(m - n, m))
    return [None] * (n - m) + list(range(m))


def _title(eqn: Any) -> str:
    name, params = eqn.primitive.name, eqn.params
    if name == "scan":
        return f"scan (length={params['length']})"
    if name == "while":
        return "while_loop (trip count unknown)"
    called = call_name(eqn)
    return f"{name}: {called}" if called else name


def _literal(v: Any) -> str:
    try:
        value = np.asarray(v.val)
    except (TypeError, ValueError):  # e.g. a typed PRNG key
        return _aval(v)
    return str(value.item()) if value.ndim == 0 else _aval(v)


def _aval(v: Any) -> str:
    return v.aval.str_short() if hasattr(v, "aval") else str(v)


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
