"""The symbolic program: a staged jaxpr (:func:`stage`, ``h.graph(x)``) you can print, count,
attribute to layers and draw as Graphviz DOT (one node per equation, clustered by layer)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import itertools
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from symjax_mlp._errors import ConfigError, SignatureError
from symjax_mlp._hybrid.args import MODEL_ERRORS, not_data, partition, rebuild, split_equinox
from symjax_mlp._hybrid.jaxpr import Body, bodies, call_name, count_flops, layer_of, numbered, walk
from symjax_mlp._hybrid.pure.linen_module import APPLY_FIXES  # apply's own keywords
from symjax_mlp._hybrid.pure.nnx_module import layer_scopes
from symjax_mlp._hybrid.trace import symbolic, unbindable


@dataclasses.dataclass(frozen=True)
class Graph:
    """A staged program: the jaxpr of a function on given inputs, and ways to look at it.

    ``str(g)`` is the jaxpr. Counts include the equations inside sub-jaxprs (a nested ``jit``,
    ``cond`` branches, ``scan`` and ``while`` bodies) and the wrapping equation, each once.

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
        return collections.Counter(e.primitive.name for e, _ in walk(self.jaxpr.jaxpr))

    @functools.cached_property
    def by_layer(self) -> dict[str, collections.Counter[str]]:
        """Primitive counts per named layer (the ``jax.named_scope`` path; ``""``: unnamed;
        equinox layers of one class by call order, ``"eqx.nn.MLP/eqx.nn.Linear[1]"``)."""
        layers: dict[str, collections.Counter[str]] = {}
        for eqn, layer in numbered(walk(self.jaxpr.jaxpr)):
            layers.setdefault(layer, collections.Counter())[eqn.primitive.name] += 1
        return layers

    @functools.cached_property
    def _flops(self) -> tuple[int, tuple[str, ...]]:
        return count_flops(self.jaxpr.jaxpr)

    @property
    def flops(self) -> int:
        """Floating-point operations, counted from the jaxpr with XLA's conventions.

        A ``dot_general`` costs ``2 * K`` per output element, a convolution ``2 * in_channels
        / feature_group_count`` per output element and kernel position on the input, an
        elementwise op one per output element, a reduction (``cumsum`` too) one per input
        element; transcendentals and layout ops none. A ``scan`` body counts ``length`` times,
        a ``cond`` as its costliest branch; a ``while_loop``'s body is not counted (its trip
        count is unknown: :attr:`flops_exact` is false and this is a lower bound), nor a loaded
        model's program (``call_exported``) nor a ``jax.experimental.hijax`` primitive's
        (``call_hi_primitive``), whose ops the jaxpr does not show.
        """
        return self._flops[0]

    @property
    def flops_exact(self) -> bool:
        """Whether :attr:`flops` is the whole count (false: a lower bound)."""
        return not self._flops[1]

    @property
    def flops_unknown(self) -> tuple[str, ...]:
        """The primitives whose bodies run an unknown number of times, e.g. ``("while",)``, or
        whose ops are not shown (``"call_exported"``, a loaded model's program;
        ``"call_hi_primitive"``, a hijax primitive)."""
        return self._flops[1]

    @classmethod
    def of(cls, fn: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Graph:
        """Stages ``fn(*args, **kwargs)``, Python settings static (:func:`stage`); ``name``
        names the graph and its errors (``stage(name)``)."""
        fix = f"Pass them as {name} takes them: stage({name})({{call}})."
        unbound = unbindable(f"stage({name})", fn, args, kwargs, skip=0, fix=fix, whose=name + "'s")
        if unbound := unbound or _unbound_apply(fn, name, args, kwargs):  # (apply passes them on)
            raise unbound  # not Python's TypeError from inside the trace, nor Flax's
        args, kwargs, join = split_equinox(args, kwargs)
        static, dyn, dyn_kw = partition(args, kwargs, caller=f"stage({name})", lists=True)

        def staged(*dyn: Any, **dyn_kw: Any) -> Any:
            a, k = join(*rebuild(static, dyn, dyn_kw))
            return fn(*a, **k)

        try:
            return cls.traced(staged, name, *dyn, **dyn_kw)
        except MODEL_ERRORS as e:  # raised on an input no array (stage(f)(x, "abc")): named
            if (named := not_data(f"stage({name})", e, args, kwargs)) is None:
                raise
            raise named from None

    @classmethod
    def traced(cls, fn: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Graph:
        """Stages ``fn(*args, **kwargs)``, every argument traced (a Hybrid's split call);
        ``name`` names the graph and its errors (the Hybrid's)."""
        with symbolic(name):
            jaxpr = jax.make_jaxpr(fn)(*args, **kwargs)
        return cls(jaxpr, name, lambda: jax.jit(fn).lower(*args, **kwargs))

    def lower(self) -> jax.stages.Lowered:
        """Lowers the staged function with ``jax.jit``: ``.as_text()`` is StableHLO."""
        return self._lower()

    def optimized(self) -> str:
        """XLA's optimized HLO for this program, after constant folding and fusion."""
        return self._lower().compile().as_text()

    def to_dot(self) -> str:
        """Graphviz DOT: one node per equation, clustered by layer and nested call (``jit``,
        ``cond``, ``scan``, ``while``), edges along data flow."""
        jaxpr, drawing = self.jaxpr.jaxpr, _Drawing()
        env: dict[Any, _Source] = {}
        head = ["rankdir=TB;", "node [fontsize=10];"]
        for i, v in enumerate(jaxpr.invars):
            _var(f"in{i}", v, env, head)
        for i, v in enumerate(jaxpr.constvars):
            _var(f"const{i}", v, env, head, ", style=dashed")
        head += drawing.jaxpr(jaxpr, env)
        for i, v in enumerate(jaxpr.outvars):
            head.append(f'out{i} [shape=ellipse, label="{_quote(_aval(v))}"];')
            drawing.edges += [f"{s} -> out{i};" for s in drawing.sources(v, env, head)]
        lines = [f"  {line}" for line in (*head, *drawing.edges)]
        return "\n".join([f'digraph "{_quote(self.name)}" {{', *lines, "}"]) + "\n"

    def to_svg(self) -> str:
        """Renders :meth:`to_dot` with the Graphviz ``dot`` program (must be on PATH)."""
        dot = shutil.which("dot")
        if dot is None:
            raise RuntimeError(
                "Graph.to_svg() needs the Graphviz `dot` program on PATH (Debian/Ubuntu: "
                "apt-get install graphviz); Graph.to_dot() gives the DOT text without it."
            )
        options = {"input": self.to_dot(), "capture_output": True, "text": True, "check": True}
        return subprocess.run([dot, "-Tsvg"], **options).stdout


def stage(fn: Callable[..., Any]) -> Callable[..., Graph]:
    """Returns a function that stages ``fn`` on its arguments into a :class:`Graph`.

    Its arguments are pytrees of arrays (a list of ``(W, b)`` pairs too); Python settings
    among them are static, as in a Hybrid's call, and an equinox module is split as
    ``eqx.filter_make_jaxpr`` splits it. A ``jax.jit`` / ``nnx.jit`` function is staged as the
    function it wraps (its layers, not one ``jit`` equation).

    Raises:
      TypeError: ``fn`` is a :class:`~symjax_mlp.Hybrid` or not callable.
      ControlFlowError: (when called) Python needed a concrete value from a traced array.

    Example:
      >>> import jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> a, b, c, d = (jnp.float32(v) for v in (1, 2, 3, 4))
      >>> g = sm.stage(lambda: (a + b) + (c + d))()
      >>> g.primitive_counts["add"]
      3
    """
    if callable(getattr(fn, "eager", None)) and callable(getattr(fn, "graph", None)):
        raise ConfigError(
            "stage() got a Hybrid; stage its function instead: h.graph(x) (or stage(h.fn)"
            "(h.params, x))."
        )
    if isinstance(fn, jax.stages.Wrapped) or hasattr(fn, "lower"):  # jax.jit's, nnx.jit's
        fn = getattr(fn, "__wrapped__", fn)
    if not callable(fn):
        raise ConfigError(f"stage() expects a callable; got {type(fn).__name__}.")
    return functools.partial(Graph.of, _nnx_copy(fn), _name(fn))


def _nnx_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An nnx module staged as a copy merged inside the trace (its updates stay on the copy,
    as ``nnx.jit`` confines them), its layers named as in ``h.graph``; any other ``fn`` as is."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not isinstance(fn, nnx.Module):
        return fn
    graphdef, state = nnx.split(fn)
    state = nnx.to_pure_dict(state)  # values: the copy's Variables are made in the trace

    @functools.wraps(type(fn).__call__)
    def call(*args: Any, **kwargs: Any) -> Any:
        module = nnx.merge(graphdef, state)
        with layer_scopes(module):
            return module(*args, **kwargs)

    with contextlib.suppress(TypeError, ValueError):  # the module's call's, without self
        call.__signature__ = inspect.signature(fn)
    return call


def _unbound_apply(fn: Any, name: str, args: tuple, kwargs: dict) -> SignatureError | None:
    """Arguments of a linen ``model.apply`` (no ``method=``) that its module's call does not
    take, as :func:`unbindable` names them; ``None`` if they bind or ``fn`` is no such apply."""
    linen, module = sys.modules.get("flax.linen"), getattr(fn, "__self__", None)
    if linen is None or not isinstance(module, linen.Module) or kwargs.get("method") is not None:
        return None
    if getattr(fn, "__name__", None) != "apply" or not args:
        return None
    model, own = type(module).__name__, {k: v for k, v in kwargs.items() if k not in APPLY_FIXES}
    fix = f"Pass them as {model} takes them: stage({name})(variables, {{call}})."
    return unbindable(f"stage({name})", module.__call__, args[1:], own, skip=0, fix=fix,
                      whose=f"{model}'s")  # fmt: skip


def _name(fn: Callable[..., Any]) -> str:
    """``fn``'s name; a ``functools.partial`` is named after the function it wraps."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


# What a variable stands for in the drawing: the nodes that produce it, or a literal
_Source = list[str] | jex_core.Literal


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
        clusters = (self.cluster(name, nodes) if name else nodes for name, nodes in groups.items())
        return list(itertools.chain.from_iterable(clusters))

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
    return f"{name}: {called}" if (called := call_name(eqn)) else name


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
