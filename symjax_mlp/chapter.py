"""The chapter "Compilers and Interpreters" on real symjax_mlp objects: its examples
(:func:`fancy_func`, :class:`HybridNet`, the MLP) and the demos the CLI runs on them.

Example:
  >>> import jax.numpy as jnp
  >>> import symjax_mlp as sm
  >>> from symjax_mlp.chapter import fancy_func
  >>> a, b, c, d = (jnp.float32(v) for v in (1, 2, 3, 4))
  >>> sm.stage(lambda: fancy_func(a, b, c, d))().primitive_counts["add"]
  3
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from symjax_mlp._artifact.reading import Artifact
from symjax_mlp._artifact.weights import memory
from symjax_mlp._errors import ConfigError, ControlFlowError, as_int
from symjax_mlp._export import export
from symjax_mlp._hybrid.graph import stage
from symjax_mlp._hybrid.hybrid import Hybrid
from symjax_mlp._hybrid.make import hybridize
from symjax_mlp._models import Dense, build_mlp

__all__ = ["HybridNet", "chapter_mlp", "describe_mlp", "export_mlp", "fancy_func", "tour"]


def add(a: Any, b: Any) -> Any:
    return a + b


def fancy_func(a: Any, b: Any, c: Any, d: Any) -> Any:
    """The chapter's example: ``(a + b) + (c + d)``, three additions in imperative Python, of
    ``a``, ``b``, ``c`` and ``d`` (numbers or arrays)."""
    e = add(a, b)
    f = add(c, d)
    g = add(e, f)
    return g


class HybridNet(nn.Module):
    """The chapter's HybridNet: 4 hidden ReLU units, 2 outputs, and ``print`` calls inside."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """The two outputs of ``x``, printing it and the hidden layer's output (once a trace)."""
        print("value x: ", x)
        x = Dense(4, activation="relu", name="hidden")(x)
        print("result : ", x)
        return Dense(2, name="output")(x)


def chapter_mlp(
    sizes: Sequence[int] = (256, 128, 2), *, in_features: int = 512, batch: int = 1,
    activation: str | None = "relu", seed: int = 0,
) -> tuple[Hybrid, jax.Array]:  # fmt: skip
    """The chapter's MLP, hybridized, and a random input of shape ``(batch, in_features)``: the
    layer widths ``sizes``, ``activation`` between them, its weights initialised from ``seed``."""
    return _mlp("chapter_mlp", sizes, activation, in_features, batch, seed, name="mlp")


_INT64 = 2**63


def _int(call: str, name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` as a Python int (a NumPy one too, not a bool) in ``[low, high)``; else a
    ConfigError of ``call`` (sizes past int64 are refused by what they would make)."""
    if type(whole := as_int(value)) is int and low <= whole and (high is None or whole < high):
        return whole
    span = f">= {low}" if high is None else "from -2**63 to 2**63 - 2"
    raise ConfigError(
        f"symjax_mlp.chapter.{call}({name}={value!r}): {name} must be an int {span}. Pass e.g. "
        f"{name}={max(low, 1)}."
    )


def _mlp(
    call: str, sizes: Sequence[int], activation: str | None, in_features: int, batch: int,
    seed: int, name: str | None = None,
) -> tuple[Hybrid, jax.Array]:  # fmt: skip
    """``mlp(sizes)`` hybridized from ``seed`` and a zero input; the chapter's (``name``) a
    random input. Sizes past int64 or memory and seeds past int64 are ConfigErrors."""
    net = build_mlp(sizes, activation, None, f"chapter.{call}")  # named as the call made
    in_features, batch = _int(call, "in_features", in_features, 1), _int(call, "batch", batch, 0)
    seed = _int(call, "seed", seed, -_INT64, _INT64 - 1)
    for rows, cols in (*itertools.pairwise((in_features, *sizes)), (batch, in_features)):
        if rows * cols >= _INT64:
            raise ConfigError(
                f"symjax_mlp.chapter.{call}(sizes={tuple(sizes)}): an MLP of those sizes on "
                f"in_features={in_features} (batch={batch}) has a {rows} x {cols} array, more "
                "elements than any array can have; pass smaller widths (sizes, in_features) or a "
                "smaller batch."
            )
    params = sum((a + 1) * b for a, b in zip((in_features, *sizes), sizes, strict=False))
    too_large = ConfigError(
        f"symjax_mlp.chapter.{call}(sizes={tuple(sizes)}): an MLP of those sizes on "
        f"{in_features} inputs has {params:,} parameters, more than this process can hold in "
        "memory; pass smaller widths."
    )
    if 4 * params > memory():  # XLA may abort the process, not raise, on such an allocation
        raise too_large
    key = jax.random.key(seed)
    if name is None:
        x = jnp.zeros((batch, in_features), jnp.float32)
    else:  # the input from the seed, the weights from the next one
        x, key = jax.random.normal(key, (batch, in_features), jnp.float32), jax.random.key(seed + 1)
    try:
        variables = net.init(key, x)
    except (MemoryError, jax.errors.JaxRuntimeError) as e:
        if not isinstance(e, MemoryError) and "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise too_large from None
    return hybridize(net, variables, name=name), x


def describe_mlp(
    sizes: Sequence[int] = (256, 128, 2), *, in_features: int = 512, batch: int = 1,
    activation: str | None = "relu", format: str = "summary",
) -> str:  # fmt: skip
    """One view of an MLP's program, ``format``: ``jaxpr``, ``stablehlo``, ``hlo``, ``dot`` or
    ``summary``; the MLP of layer widths ``sizes`` and ``activation`` on a ``(batch,
    in_features)`` input."""
    h, x = _mlp("describe_mlp", sizes, activation, in_features, batch, 0, name="mlp")
    views: dict[str, Callable[[], str]] = {
        "jaxpr": lambda: str(h.graph(x)),
        "stablehlo": lambda: h.lower(x).as_text(),
        "hlo": lambda: h.compile(x).as_text(),
        "dot": lambda: h.graph(x).to_dot(),
        "summary": lambda: _summary(h, x),
    }
    if not isinstance(format, str) or format not in views:
        raise ConfigError(
            f"symjax_mlp.chapter.describe_mlp(format={format!r}): unknown format {format!r}; "
            f"expected one of: {', '.join(views)}."
        )
    return views[format]()


#: why a summary's flops are a lower bound, per primitive of ``Graph.flops_unknown``
_UNKNOWN = {
    "while": "a while_loop's trip count is unknown",
    "call_exported": "a loaded model's program is not counted",
    "call_hi_primitive": "a hijax primitive's ops are not counted",
}


def _summary(h: Hybrid, x: jax.Array) -> str:
    g = h.graph(x)
    xla_flops = h.compile(x).cost_analysis().get("flops", float("nan"))
    flops = f"{g.flops:,}"
    if not g.flops_exact:
        unknown = ", ".join(
            _UNKNOWN.get(p, f"{p}'s trip count is unknown") for p in g.flops_unknown
        )
        flops = f"at least {flops} ({unknown})"
    lines = [
        f"{h.name}: input {x.dtype}{list(x.shape)}, "
        f"{sum(p.size for p in jax.tree.leaves(h.params)):,} params",
        f"flops: {flops} counted from the jaxpr, {xla_flops:,.0f} by XLA's cost analysis",
        "primitives: " + ", ".join(f"{k}={v}" for k, v in sorted(g.primitive_counts.items())),
        "by layer:",
    ]
    for layer, counts in g.by_layer.items():
        ops = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        lines.append(f"  {layer or '(top level)'}: {ops}")
    return "\n".join(lines)


def export_mlp(
    path: str | os.PathLike[str], *, sizes: Sequence[int] = (256, 128, 2), in_features: int = 512,
    activation: str = "relu", seed: int = 0, batch: str | int = "b",
    platforms: Sequence[str] = ("cpu",), overwrite: bool = False,
) -> Artifact:  # fmt: skip
    """Exports the chapter's MLP (``mlp(sizes, activation)`` on ``in_features`` inputs,
    initialised from ``seed``) to ``path``, what ``symjax-mlp export`` runs; ``batch``: a name
    for a symbolic batch dimension, or an int for a static one; ``platforms`` and ``overwrite``
    as :func:`~symjax_mlp.export` takes them."""
    static = type(as_int(batch)) is int  # an int of any kind, not a bool
    h, x = _mlp("export_mlp", sizes, activation, in_features, batch if static else 1, seed)
    batch = None if static else batch
    return export(h, path, example=x, batch=batch, platforms=platforms, overwrite=overwrite)


def tour(*, calls: int = 1000, print: Callable[..., None] = print) -> None:
    """Walks through the chapter: imperative, symbolic, hybrid, tracing, timing (``calls``
    calls), control flow; each line goes to ``print``."""
    calls, step = _int("tour", "calls", calls, 0), iter(range(1, 100))
    if not callable(print):
        raise ConfigError(
            f"symjax_mlp.chapter.tour(print={print!r}): print takes each line, as the builtin "
            "print does; pass a callable, e.g. print=functools.partial(print, file=sys.stderr)."
        )

    def title(text: str) -> None:
        print(f"\n== {next(step)}. {text} ==")

    title("Imperative: Python runs every add")
    print("fancy_func(1, 2, 3, 4) =", fancy_func(1, 2, 3, 4))

    title("Symbolic: stage the same function, let XLA optimize it")
    a, b, c, d = (jnp.float32(v) for v in (1, 2, 3, 4))
    g = stage(lambda: fancy_func(a, b, c, d))()
    print("the jaxpr still has", g.primitive_counts["add"], "adds:")
    print(g)
    print("XLA's optimized HLO folds them into one constant:")
    print(g.optimized())

    title("Hybrid: the chapter's MLP (512 -> 256 -> 128 -> 2), eager and compiled")
    h, x = chapter_mlp()
    print("h.eager(x) =", h.eager(x))
    print("h(x)       =", h(x))

    title("The symbolic program of the MLP")
    print(h.graph(x))
    print(_summary(h, x))

    title("Python runs only while tracing (the chapter's HybridNet print demonstration)")
    net = HybridNet()
    x3 = jax.random.normal(jax.random.key(0), (1, 3))
    print("-- init runs the Python body once to create the params")
    hn = hybridize(net, net.init(jax.random.key(1), x3), name="HybridNet")
    print("-- eager call: Python prints concrete values")
    print(hn.eager(x3))
    print("-- first compiled call: Python prints tracers (symbols), once")
    print(hn(x3))
    print("-- second compiled call: nothing to print, only the compiled program runs")
    print(hn(x3))
    print(f"trace_count = {hn.trace_count}")

    title(f"Timing {calls} calls at batch 1 (scripts/bench.py measures this properly)")
    for label, fn in (("Without", h.eager), ("With", h)):
        for _ in range(10):  # warmed up: the first compiled call traces and compiles
            fn(x).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x).block_until_ready()  # every call synced: JAX dispatches asynchronously
        print(f"{label} hybridization: {time.perf_counter() - t0:.4f} sec")

    title("Control flow: a Python `if` on a traced value")

    def relu_if(params, x):
        if x.sum() > 0:  # needs a concrete value
            return x
        return -x

    hc = hybridize(relu_if, {}, name="relu_if")
    print("eager works:", hc.eager(jnp.ones(2)))
    try:
        hc(jnp.ones(2))
    except ControlFlowError as e:
        print(f"compiled raises ControlFlowError:\n{e}")
