"""Drawing a jaxpr as Graphviz DOT: one node per equation, clustered by layer."""

from __future__ import annotations

from typing import Any

from symjax_mlp._hybrid.jaxpr import layer_of


def to_dot(closed: Any, name: str) -> str:
    """Graphviz DOT: one node per equation, clustered by layer, edges along data flow."""
    jaxpr = closed.jaxpr
    lines = [f'digraph "{_quote(name)}" {{', "  rankdir=TB;", "  node [fontsize=10];"]
    producer: dict[Any, str] = {}
    for i, v in enumerate(jaxpr.invars):
        node = f"in{i}"
        lines.append(f'  {node} [shape=ellipse, label="{_quote(_aval(v))}"];')
        producer[v] = node
    for i, v in enumerate(jaxpr.constvars):
        node = f"const{i}"
        lines.append(f'  {node} [shape=ellipse, style=dashed, label="{_quote(_aval(v))}"];')
        producer[v] = node
    clusters: dict[str, list[str]] = {}
    edges = []
    for i, eqn in enumerate(jaxpr.eqns):
        node = f"op{i}"
        out = ", ".join(_aval(v) for v in eqn.outvars)
        label = f"{eqn.primitive.name}\\n{_quote(out)}"
        layer = layer_of(str(eqn.source_info.name_stack))
        clusters.setdefault(layer, []).append(f'{node} [shape=box, label="{label}"];')
        edges += [f"  {producer[v]} -> {node};" for v in eqn.invars if v in producer]
        producer.update((v, node) for v in eqn.outvars)
    for j, (layer, nodes) in enumerate(clusters.items()):
        if layer:
            lines.append(f'  subgraph cluster_{j} {{ label="{_quote(layer)}";')
            lines += [f"    {n}" for n in nodes]
            lines.append("  }")
        else:
            lines += [f"  {n}" for n in nodes]
    lines += edges
    for i, v in enumerate(jaxpr.outvars):
        lines.append(f'  out{i} [shape=ellipse, label="{_quote(_aval(v))}"];')
        if v in producer:
            lines.append(f"  {producer[v]} -> out{i};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _aval(v: Any) -> str:
    return v.aval.str_short() if hasattr(v, "aval") else str(v)


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
