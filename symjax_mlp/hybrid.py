"""The Hybrid object: a pure function plus its params, eager or XLA-compiled at one switch.

``hybridize`` is the one place where ``jax.jit`` is applied. The compiled path is a single
``jax.jit`` object created once per ``Hybrid``: JAX's C++ dispatch keeps one executable per
input signature, and the params are flattened once, at construction. Every trace goes through
:meth:`Hybrid._trace`, which records a :class:`TraceEvent`, explains retraces, enforces the
``max_traces`` budget and runs the ``on_trace`` callbacks, so tracing is visible, never silent.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from symjax_mlp.errors import ControlFlowError, RetraceError

__all__ = ["ArgSpec", "Hybrid", "TraceEvent", "hybridize"]

# The errors JAX raises when Python needs a concrete value from a tracer.
_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,  # includes TracerBoolConversionError
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """The abstract value of one input leaf: what a trace is specialised on."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    weak_type: bool

    def __str__(self) -> str:
        weak = " (weak)" if self.weak_type else ""
        return f"{self.path}: {self.dtype}{list(self.shape)}{weak}"


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One trace of a :class:`Hybrid`: the input signature, and why it (re)traced.

    Attributes:
      index: 0 for the first trace, 1 for the first retrace, ...
      signature: one :class:`ArgSpec` per input leaf (the params are not included).
      tree: the input tree structure, as text.
      reason: ``"first call"`` or what changed against the nearest earlier trace, e.g.
        ``"args[0].shape changed from (1, 512) to (7, 512)"``.
    """

    index: int
    signature: tuple[ArgSpec, ...]
    tree: str
    reason: str

    def __str__(self) -> str:
        sig = ", ".join(map(str, self.signature))
        return f"trace #{self.index} [{sig}]: {self.reason}"


def _signature(args: Sequence[Any]) -> tuple[tuple[ArgSpec, ...], str]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tuple(args))
    specs = []
    for path, leaf in leaves:
        aval = jax.typeof(leaf)
        specs.append(
            ArgSpec(
                path="args" + jax.tree_util.keystr(path),
                shape=tuple(aval.shape),
                dtype=str(aval.dtype),
                weak_type=bool(getattr(aval, "weak_type", False)),
            )
        )
    return tuple(specs), str(treedef)


def _explain(sig: tuple[ArgSpec, ...], tree: str, events: Sequence[TraceEvent]) -> str:
    """Why ``(sig, tree)`` traced again: its differences from the nearest earlier trace."""
    if not events:
        return "first call"

    def distance(e: TraceEvent) -> int:
        if e.tree != tree:
            return 1 << 30
        return sum(a != b for a, b in zip(e.signature, sig, strict=True))

    old = min(reversed(events), key=distance)
    if old.tree != tree:
        return f"input tree structure changed from {old.tree} to {tree}"
    changes = []
    for n, o in zip(sig, old.signature, strict=True):
        for field in ("shape", "dtype", "weak_type"):
            if getattr(n, field) != getattr(o, field):
                changes.append(
                    f"{n.path}.{field} changed from {getattr(o, field)} to {getattr(n, field)}"
                )
    return "; ".join(changes) or "same signature traced again (a new jax.jit cache entry)"


class Hybrid:
    """A pure function ``fn(params, *inputs)`` bound to its params, compiled by XLA on call.

    Create one with :func:`hybridize`. ``h(x)`` runs the compiled program (one trace and
    compile per input signature); ``h.eager(x)`` runs the same function op by op, Python and
    all, every time.

    Example:
      >>> import symjax_mlp as sm
      >>> net = sm.mlp((4, 2))
      >>> x = jnp.ones((1, 3))
      >>> h = sm.hybridize(net, net.init(jax.random.key(0), x))
      >>> h(x).shape, h.trace_count
      ((1, 2), 1)
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        params: Any,
        *,
        name: str | None = None,
        max_traces: int | None = None,
        compiled: bool = True,
    ) -> None:
        if max_traces is not None and (not isinstance(max_traces, int) or max_traces < 1):
            raise ValueError(f"max_traces must be a positive int or None; got {max_traces!r}.")
        self.fn = fn
        self.params = params
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.max_traces = max_traces
        self.compiled = compiled
        self._leaves, self._treedef = jax.tree.flatten(params)
        self._jitted = jax.jit(self._trace)
        self._lock = threading.Lock()
        self._events: list[TraceEvent] = []
        self._callbacks: list[Callable[..., Any]] = []

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *inputs: Any) -> Any:
        """Runs the compiled program (or :meth:`eager`, for a ``hybridize(False)`` twin)."""
        if not self.compiled:
            return self.eager(*inputs)
        try:
            return self._jitted(self._leaves, *inputs)
        except _TRACER_ERRORS as e:
            raise self._control_flow_error(e) from e

    def eager(self, *inputs: Any) -> Any:
        """Runs ``fn`` imperatively: op by op, Python (and its ``print``) on every call.

        The ``on_trace`` callbacks run too, with the concrete inputs, every call.
        """
        for callback in self._callbacks:
            callback(*inputs)
        return self.fn(self.params, *inputs)

    def hybridize(self, active: bool = True) -> Hybrid:
        """Returns a twin whose ``__call__`` is compiled (``True``) or eager (``False``).

        ``self`` is unchanged; the twin shares the params and callbacks but not the traces.
        """
        twin = Hybrid(
            self.fn, self.params, name=self.name, max_traces=self.max_traces, compiled=active
        )
        twin._callbacks = self._callbacks
        return twin

    def shard(self, mesh: Any = None, *, axis: str = "data", pad: bool = True) -> Any:
        """Runs this Hybrid data-parallel over ``mesh``; see :func:`symjax_mlp.shard`."""
        from symjax_mlp.distributed import shard  # distributed imports hybrid; avoid a cycle

        return shard(self, mesh, axis=axis, pad=pad)

    # -- the stages ------------------------------------------------------------------------
    def lower(self, *inputs: Any) -> jax.stages.Lowered:
        """Traces and lowers for ``inputs``: ``.as_text()`` is the StableHLO module."""
        try:
            return self._jitted.lower(self._leaves, *inputs)
        except _TRACER_ERRORS as e:
            raise self._control_flow_error(e) from e

    def compile(self, *inputs: Any) -> jax.stages.Compiled:
        """Lowers and compiles: ``.as_text()`` is XLA's optimized HLO, with ``.cost_analysis()``
        and ``.memory_analysis()``."""
        return self.lower(*inputs).compile()

    def graph(self, *inputs: Any):
        """Stages ``fn`` on ``inputs`` into a :class:`~symjax_mlp.Graph` (the jaxpr, per layer).

        This stages the un-jitted function, so every layer shows; it is not counted in
        :attr:`trace_count`, which counts the traces of the compiled path.
        """
        from symjax_mlp.graph import stage  # graph imports nothing from here; avoid a cycle

        try:
            return stage(self.fn)(self.params, *inputs)
        except _TRACER_ERRORS as e:
            raise self._control_flow_error(e) from e

    # -- tracing you can see ---------------------------------------------------------------
    @property
    def trace_count(self) -> int:
        """How many times the compiled path has traced ``fn``."""
        return len(self._events)

    @property
    def trace_log(self) -> tuple[TraceEvent, ...]:
        """One :class:`TraceEvent` per trace, oldest first."""
        return tuple(self._events)

    def on_trace(self, callback: Callable[..., Any]) -> Callable[..., Any]:
        """Registers ``callback(*inputs)``; runs once per trace, with the traced inputs.

        In eager mode it runs on every call, with concrete arrays. Returns ``callback``, so it
        also works as a decorator.
        """
        if not callable(callback):
            raise TypeError(f"on_trace expects a callable; got {type(callback).__name__}.")
        self._callbacks.append(callback)
        return callback

    def _trace(self, leaves: list[Any], *inputs: Any) -> Any:
        with self._lock:
            sig, tree = _signature(inputs)
            reason = _explain(sig, tree, self._events)
            event = TraceEvent(len(self._events), sig, tree, reason)
            if self.max_traces is not None and len(self._events) >= self.max_traces:
                history = "\n  ".join(map(str, self._events))
                raise RetraceError(
                    f"{self.name}: trace #{event.index} would exceed max_traces="
                    f"{self.max_traces}. Why it retraced: {reason}.\n  Earlier traces:\n  "
                    f"{history}\nCall it with inputs of one shape and dtype (pad the batch, or "
                    "cast once), or raise max_traces if each signature is intended."
                )
            self._events.append(event)
        for callback in self._callbacks:
            callback(*inputs)
        return self.fn(jax.tree.unflatten(self._treedef, leaves), *inputs)

    def _control_flow_error(self, e: Exception) -> ControlFlowError:
        first_line = str(e).strip().splitlines()[0]
        return ControlFlowError(
            f"{self.name}: Python needed a concrete value from a traced (symbolic) array while "
            f"compiling: {type(e).__name__}: {first_line}\n"
            "The same code runs fine eagerly (h.eager(x), or h.hybridize(False)(x)), "
            "because there every array has a value. Under compilation only shapes and dtypes "
            "are known, so a Python `if`/`while` on an array, float(x), int(x) or "
            "np.asarray(x) cannot be decided. Fix it by staying symbolic:\n"
            "  - `if x > 0: a else b`       ->  jnp.where(x > 0, a, b) or jax.lax.cond\n"
            "  - `while cond(x): ...`       ->  jax.lax.while_loop / jax.lax.fori_loop\n"
            "  - np.asarray(x) / float(x)   ->  keep using jnp operations on x\n"
            "  - a value that is really a setting -> pass it as a Python constant (static), "
            "not as an array input.\n"
            "A Python `for` over a fixed range is fine: it unrolls into the graph."
        )


def hybridize(
    model: Any,
    params: Any = None,
    *,
    name: str | None = None,
    max_traces: int | None = None,
) -> Hybrid:
    """Binds a model to its params as a :class:`Hybrid`: one switch from eager to compiled.

    Args:
      model: a ``flax.linen.Module`` (with ``params`` its variables, as returned by
        ``init``), a ``flax.nnx.Module`` (no ``params``: its state is split off once), or any
        pure function ``fn(params, *inputs)``.
      params: the variables or params; must be omitted for an nnx module.
      name: shown in trace logs and errors (default: the function or module class name).
      max_traces: a budget of traces; one more raises :class:`~symjax_mlp.RetraceError`.

    Returns:
      A :class:`Hybrid`; ``h(x)`` is XLA-compiled, ``h.eager(x)`` imperative.

    Raises:
      TypeError: ``model`` is none of the above, or params are missing or superfluous.

    Example:
      >>> import symjax_mlp as sm
      >>> h = sm.hybridize(lambda p, x: x * p["scale"], {"scale": jnp.float32(2)})
      >>> h(jnp.ones(2))
      Array([2., 2.], dtype=float32)
    """
    if isinstance(model, nnx.Module):
        if params is not None:
            raise TypeError(
                "hybridize(nnx_module) takes no params: the module carries its own state. "
                "Write hybridize(module)."
            )
        graphdef, state = nnx.split(model)
        fn = functools.partial(_nnx_apply, graphdef)
        return Hybrid(
            fn,
            nnx.to_pure_dict(state),
            name=name or type(model).__name__,
            max_traces=max_traces,
        )
    if isinstance(model, nn.Module):
        if params is None:
            raise TypeError(
                f"hybridize({type(model).__name__}) needs its variables: write "
                "hybridize(module, module.init(jax.random.key(0), x))."
            )
        return Hybrid(model.apply, params, name=name or type(model).__name__, max_traces=max_traces)
    if isinstance(model, Hybrid):
        raise TypeError("hybridize() got a Hybrid; it is already hybridized. Use it directly.")
    if callable(model):
        if params is None:
            raise TypeError(
                "hybridize(fn, params) needs params: fn is called as fn(params, *inputs). "
                "For a function without params write hybridize(lambda _, x: f(x), {})."
            )
        return Hybrid(model, params, name=name, max_traces=max_traces)
    raise TypeError(
        "hybridize() expects a flax.linen.Module with its variables, a flax.nnx.Module, or a "
        f"pure function fn(params, *inputs); got {type(model).__name__}."
    )


def _nnx_apply(graphdef: Any, params: Any, *inputs: Any) -> Any:
    return nnx.merge(graphdef, params)(*inputs)
