"""The symbolic program: a staged jaxpr you can print, count, attribute to layers and draw.

:func:`stage` turns any function into a :class:`Graph` with :func:`jax.make_jaxpr`. Counting
works on the jaxpr's equations (recursing into sub-jaxprs such as ``custom_jvp_call`` and
``jit``), never on its text, which changes across JAX versions.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import core as jex_core

__all__ = ["Graph", "stage"]

# Elementwise primitives that XLA's cost model counts as one flop per output element.
_ELEMENTWISE_FLOPS = frozenset(
    {
        "add", "sub", "mul", "div", "max", "min", "neg", "abs", "sign", "exp", "exp2", "log",
        "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "pow", "integer_pow", "erf",
        "select_n", "sin", "cos", "square", "rem", "atan2", "cbrt", "erf_inv", "is_finite",
        "nextafter", "tan", "clamp",
    }
)  # fmt: skip
_REDUCTION_FLOPS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})


def _sub_jaxprs(eqn: Any) -> Iterator[jex_core.Jaxpr]:
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jex_core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex_core.Jaxpr):
                yield v


def _layer_of(name_stack: str) -> str:
    """``"HybridSequential/layers_0/layers_0"`` -> ``"HybridSequential/layers_0"``."""
    parts: list[str] = []
    for part in name_stack.split("/") if name_stack else ():
        if not parts or parts[-1] != part:
            parts.append(part)
    return "/".join(parts)


def _walk(jaxpr: jex_core.Jaxpr, layer: str | None = None) -> Iterator[tuple[Any, str]]:
    """Every equation, sub-jaxprs included, with the layer it belongs to."""
    for eqn in jaxpr.eqns:
        own = layer if layer is not None else _layer_of(str(eqn.source_info.name_stack))
        yield eqn, own
        for sub in _sub_jaxprs(eqn):
            yield from _walk(sub, own)


def _eqn_flops(eqn: Any) -> int:
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = math.prod(lhs[d] for d in contract)
        return 2 * k * math.prod(eqn.outvars[0].aval.shape)
    if name in _ELEMENTWISE_FLOPS:
        return math.prod(eqn.outvars[0].aval.shape)
    if name in _REDUCTION_FLOPS:
        return math.prod(eqn.invars[0].aval.shape)
    return 0


@dataclasses.dataclass(frozen=True)
class Graph:
    """A staged program: the jaxpr of a function on given inputs, and ways to look at it.

    ``str(g)`` is the jaxpr. Counts include the equations inside sub-jaxprs (the body of a
    ``custom_jvp_call`` or nested ``jit``) as well as the wrapping equation itself.

    Attributes:
      jaxpr: the ``ClosedJaxpr`` from :func:`jax.make_jaxpr`.
      name: the staged function's name.
    """

    jaxpr: jex_core.ClosedJaxpr
    name: str
    _lower: Callable[[], jax.stages.Lowered] = dataclasses.field(repr=False, compare=False)

    def __str__(self) -> str:
        return str(self.jaxpr)

    @functools.cached_property
    def primitive_counts(self) -> collections.Counter[str]:
        """How many equations use each primitive, e.g. ``{"dot_general": 3, "add": 3, ...}``."""
        return collections.Counter(e.primitive.name for e, _ in _walk(self.jaxpr.jaxpr))

    @functools.cached_property
    def by_layer(self) -> dict[str, collections.Counter[str]]:
        """Primitive counts per named layer (the ``jax.named_scope`` path; ``""``: unnamed)."""
        layers: dict[str, collections.Counter[str]] = {}
        for eqn, layer in _walk(self.jaxpr.jaxpr):
            layers.setdefault(layer, collections.Counter())[eqn.primitive.name] += 1
        return layers

    @functools.cached_property
    def flops(self) -> int:
        """Floating-point operations, counted from the jaxpr with XLA's conventions.

        A ``dot_general`` costs ``2 * K`` per output element, an elementwise op one per output
        element, a reduction one per input element; layout ops (reshape, broadcast) cost none.
        Equations are counted once, at the innermost level.
        """
        return sum(_eqn_flops(e) for e, _ in _walk(self.jaxpr.jaxpr) if not any(_sub_jaxprs(e)))

    def lower(self) -> jax.stages.Lowered:
        """Lowers the staged function with ``jax.jit``: ``.as_text()`` is StableHLO."""
        return self._lower()

    def optimized(self) -> str:
        """XLA's optimized HLO for this program, after constant folding and fusion."""
        return self._lower().compile().as_text()

    def to_dot(self) -> str:
        """Graphviz DOT: one node per equation, clustered by layer, edges along data flow."""
        jaxpr = self.jaxpr.jaxpr
        lines = [f'digraph "{_quote(self.name)}" {{', "  rankdir=TB;", "  node [fontsize=10];"]
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
            layer = _layer_of(str(eqn.source_info.name_stack))
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

    def to_svg(self) -> str:
        """Renders :meth:`to_dot` with the Graphviz ``dot`` program (must be on PATH)."""
        dot = shutil.which("dot")
        if dot is None:
            raise RuntimeError(
                "Graph.to_svg() needs the Graphviz `dot` program on PATH (Debian/Ubuntu: "
                "apt-get install graphviz); Graph.to_dot() gives the DOT text without it."
            )
        done = subprocess.run(
            [dot, "-Tsvg"], input=self.to_dot(), capture_output=True, text=True, check=True
        )
        return done.stdout


def _aval(v: Any) -> str:
    return v.aval.str_short() if hasattr(v, "aval") else str(v)


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def stage(fn: Callable[..., Any]) -> Callable[..., Graph]:
    """Returns a function that stages ``fn`` on its arguments into a :class:`Graph`.

    Pass the plain (un-jitted) function: staging shows each operation it performs, and
    :meth:`Graph.optimized` shows what XLA makes of them.

    Raises:
      TypeError: ``fn`` is already ``jax.jit``-wrapped (its jaxpr would be one opaque
        ``jit`` equation) or a :class:`~symjax_mlp.Hybrid`.

    Example:
      >>> a, b, c, d = (jnp.float32(v) for v in (1, 2, 3, 4))
      >>> g = stage(lambda: (a + b) + (c + d))()
      >>> g.primitive_counts["add"]
      3
    """
    from symjax_mlp.hybrid import Hybrid

    if isinstance(fn, Hybrid):
        raise TypeError(
            "stage() got a Hybrid; stage its function instead: h.graph(x) (or stage(h.fn)"
            "(h.params, x))."
        )
    if isinstance(fn, jax.stages.Wrapped) or hasattr(fn, "lower"):
        inner = getattr(fn, "__wrapped__", None)
        hint = f" (here: stage({inner.__name__}))" if inner is not None else ""
        raise TypeError(
            f"stage() got {getattr(fn, '__name__', fn)!r}, which is already jax.jit-compiled: "
            "its jaxpr would be a single opaque `jit` equation hiding every layer. Pass the "
            f"undecorated Python function{hint}, e.g. stage(f.__wrapped__)."
        )
    if not callable(fn):
        raise TypeError(f"stage() expects a callable; got {type(fn).__name__}.")
    name = getattr(fn, "__name__", type(fn).__name__)

    def staged(*args: Any, **kwargs: Any) -> Graph:
        jaxpr = jax.make_jaxpr(fn)(*args, **kwargs)
        return Graph(jaxpr, name, lambda: jax.jit(fn).lower(*args, **kwargs))

    return staged
