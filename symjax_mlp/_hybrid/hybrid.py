"""The Hybrid object: a pure function plus its params, eager or XLA-compiled at one switch.

``hybridize`` is the one place where ``jax.jit`` is applied. The compiled path is a single
``jax.jit`` object created once per ``Hybrid``: JAX's C++ dispatch keeps one executable per
input signature, and the params are flattened once, at construction. Every trace goes through
:meth:`Hybrid._trace`, which records a :class:`~symjax_mlp.TraceEvent`, explains retraces,
enforces the ``max_traces`` budget and runs the ``on_trace`` callbacks, so tracing is
visible, never silent.

Sharding is a setting of the same object: ``h.shard(mesh)`` is a Hybrid whose one ``jax.jit``
carries the data-parallel in/out shardings (see :mod:`symjax_mlp._hybrid.mesh`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from symjax_mlp._errors import RetraceError, SignatureError
from symjax_mlp._hybrid import mesh as _mesh
from symjax_mlp._hybrid.graph import Graph
from symjax_mlp._hybrid.trace import (
    TRACER_ERRORS,
    TraceEvent,
    control_flow_error,
    explain,
    signature,
)


class Hybrid:
    """A pure function ``fn(params, *inputs)`` bound to its params, compiled by XLA on call.

    Create one with :func:`~symjax_mlp.hybridize`. ``h(x)`` runs the compiled program (one
    trace and compile per input signature); ``h.eager(x)`` runs the same function op by op,
    Python and all, every time. ``h.shard(mesh)`` runs it data-parallel over a device mesh.

    Attributes:
      fn: the pure function, ``fn(params, *inputs)``.
      params: its params (replicated over the mesh when sharded).
      name: shown in trace logs and errors.
      max_traces: the trace budget, or ``None``.
      compiled: whether ``__call__`` is compiled (``False``: eager).
      mesh: the ``jax.sharding.Mesh`` the batch is split over, or ``None`` (one device).
      axis: the mesh axis the batch is split over; ``n_shards`` is its size.
      pad: pad a batch that does not divide over the shards, and trim the result.

    Example:
      >>> import jax, jax.numpy as jnp
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
        mesh: Mesh | None = None,
        axis: str = "data",
        pad: bool = True,
    ) -> None:
        if max_traces is not None and (
            not isinstance(max_traces, int) or isinstance(max_traces, bool) or max_traces < 1
        ):
            raise ValueError(f"max_traces must be a positive int or None; got {max_traces!r}.")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.max_traces = max_traces
        self.compiled = compiled
        self.axis, self.pad = axis, pad
        self._leaves, self._treedef = jax.tree.flatten(params)
        self._lock = threading.Lock()
        self._events: list[TraceEvent] = []
        self._callbacks: list[Callable[..., Any]] = []
        if mesh is None:
            self.mesh, self.n_shards = None, 1
            self.params = params
            self._jitted = jax.jit(self._trace)
            return
        self.mesh, rep, self._batch_sharding, self.n_shards = _mesh.shardings(mesh, axis)
        self._leaves = [_mesh.place(leaf, rep) for leaf in self._leaves]
        self.params = jax.tree.unflatten(self._treedef, self._leaves)
        self._jitted = jax.jit(
            self._trace_sharded,
            in_shardings=(rep, self._batch_sharding),
            out_shardings=self._batch_sharding,
        )

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *inputs: Any) -> Any:
        """Runs the compiled program (or :meth:`eager`, for a ``hybridize(False)`` twin)."""
        if not self.compiled:
            return self.eager(*inputs)
        try:
            if self.mesh is None:
                return self._jitted(self._leaves, *inputs)
            batch, placed = self._prepare(inputs)
            out = self._jitted(self._leaves, placed)
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e
        if placed[0].shape[0] == batch:
            return out
        return jax.tree.map(lambda y: y[:batch], out)

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
        return self._twin(compiled=active)

    def shard(self, mesh: Mesh | None = None, *, axis: str = "data", pad: bool = True) -> Hybrid:
        """This Hybrid run data-parallel over ``mesh``; see :func:`~symjax_mlp.shard`."""
        mesh = _mesh.data_mesh(axis=axis) if mesh is None else mesh
        return self._twin(mesh=mesh, axis=axis, pad=pad)

    def _twin(self, **changes: Any) -> Hybrid:
        settings = dict(
            name=self.name,
            max_traces=self.max_traces,
            compiled=self.compiled,
            mesh=self.mesh,
            axis=self.axis,
            pad=self.pad,
        )
        params = jax.tree.unflatten(self._treedef, self._leaves)
        twin = Hybrid(self.fn, params, **(settings | changes))
        twin._callbacks = self._callbacks
        return twin

    # -- the stages ------------------------------------------------------------------------
    def lower(self, *inputs: Any) -> jax.stages.Lowered:
        """Traces and lowers for ``inputs``: ``.as_text()`` is the StableHLO module.

        A sharded Hybrid lowers for the padded batch: one SPMD module for every device.
        """
        try:
            if self.mesh is None:
                return self._jitted.lower(self._leaves, *inputs)
            return self._jitted.lower(self._leaves, self._prepare(inputs)[1])
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e

    def compile(self, *inputs: Any) -> jax.stages.Compiled:
        """Lowers and compiles: ``.as_text()`` is XLA's optimized HLO, with ``.cost_analysis()``
        and ``.memory_analysis()``."""
        return self.lower(*inputs).compile()

    def graph(self, *inputs: Any):
        """Stages ``fn`` on ``inputs`` into a :class:`~symjax_mlp.Graph` (the jaxpr, per layer).

        This stages the un-jitted function, so every layer shows; it is not counted in
        :attr:`trace_count`, which counts the traces of the compiled path.
        """
        try:
            return Graph.of(self.fn, self.name, self.params, *inputs)
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e

    # -- tracing you can see ---------------------------------------------------------------
    @property
    def trace_count(self) -> int:
        """How many times the compiled path has traced ``fn``."""
        return len(self._events)

    @property
    def trace_log(self) -> tuple[TraceEvent, ...]:
        """One :class:`~symjax_mlp.TraceEvent` per trace, oldest first."""
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
            sig, tree = signature(inputs)
            reason = explain(sig, tree, self._events)
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

    # -- sharded -----------------------------------------------------------------------------
    def _trace_sharded(self, leaves: list[jax.Array], inputs: tuple[jax.Array, ...]) -> Any:
        out = self._trace(leaves, *inputs)
        batch = inputs[0].shape[0]
        for path, leaf in jax.tree_util.tree_leaves_with_path(out):
            if leaf.ndim == 0 or leaf.shape[0] != batch:
                raise SignatureError(
                    f"{self.name}: output out{jax.tree_util.keystr(path)} has shape "
                    f"{leaf.shape}, but a sharded call needs per-example outputs with the batch "
                    f"({batch}) as leading dimension. Reduce over the batch after the call."
                )
        return out

    def _prepare(self, inputs: tuple[Any, ...]) -> tuple[int, tuple[jax.Array, ...]]:
        caller = f"{self.name}.shard(...)"
        if not inputs:
            raise SignatureError(f"{caller}: needs at least one batched input.")
        batch = _mesh.batch_size(inputs, caller)
        extra = _mesh.padding(batch, self.n_shards, self.pad, caller)
        placed = (_mesh.place(_mesh.pad_rows(x, extra), self._batch_sharding) for x in inputs)
        return batch, tuple(placed)

    def __repr__(self) -> str:
        where = "" if self.mesh is None else f", mesh={dict(self.mesh.shape)}, axis={self.axis!r}"
        mode = "compiled" if self.compiled else "eager"
        return f"Hybrid({self.name}, {mode}, traces={self.trace_count}{where})"


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
      >>> import jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> h = sm.hybridize(lambda p, x: x * p["scale"], {"scale": jnp.float32(2)})
      >>> h(jnp.ones(2))
      Array([2., 2.], dtype=float32)
    """
    from flax import linen as nn
    from flax import nnx

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


def shard(h: Hybrid, mesh: Mesh | None = None, *, axis: str = "data", pad: bool = True) -> Hybrid:
    """Runs ``h`` data-parallel over ``mesh``: batch split over ``axis``, params replicated.

    Args:
      h: the :class:`Hybrid`; its function must treat examples independently (true of an
        MLP) for padding to be exact.
      mesh: a ``jax.sharding.Mesh`` (default: :func:`~symjax_mlp.data_mesh` over every
        device).
      axis: the mesh axis the batch is split over.
      pad: pad an indivisible batch and trim the result (``False``: raise
        :class:`~symjax_mlp.SignatureError`).

    Returns:
      A sharded :class:`Hybrid` (``h.shard(mesh)``); its result equals ``h``'s up to float
      rounding.

    Raises:
      TypeError: ``h`` is not a Hybrid.
      ValueError: ``axis`` is not an axis of ``mesh``.

    Example:
      >>> import jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
      >>> s = sm.shard(h, sm.data_mesh(1))
      >>> s(jnp.ones((3, 2))).shape, s.n_shards
      ((3, 2), 1)
    """
    if not isinstance(h, Hybrid):
        raise TypeError(
            f"shard() expects a Hybrid; got {type(h).__name__}. Write "
            "shard(sm.hybridize(model, variables), mesh)."
        )
    return h.shard(mesh, axis=axis, pad=pad)


def _nnx_apply(graphdef: Any, params: Any, *inputs: Any) -> Any:
    from flax import nnx

    return nnx.merge(graphdef, params)(*inputs)
