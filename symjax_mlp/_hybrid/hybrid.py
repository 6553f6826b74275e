"""The Hybrid object: a model plus its params (and state), eager or XLA-compiled at one switch.

:func:`~symjax_mlp.hybridize` makes one. The Hybrid is the one place where ``jax.jit`` is
applied: one ``jax.jit`` object per Hybrid, its params flattened once. Its parts live in their
own modules: call arguments (``args``), the trace log (``trace``), what the jit traces
(``traced``), held state (``held``), nnx modes (``modes``) and the sharded call (``mesh``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from symjax_mlp._errors import ConfigError
from symjax_mlp._hybrid import mesh as _mesh
from symjax_mlp._hybrid import objects
from symjax_mlp._hybrid import rng as _rng
from symjax_mlp._hybrid.args import partition
from symjax_mlp._hybrid.graph import Graph
from symjax_mlp._hybrid.held import HeldState
from symjax_mlp._hybrid.jaxpr import input_dependent
from symjax_mlp._hybrid.modes import ModuleModes
from symjax_mlp._hybrid.options import argnames, argnums, check_settings, static_args
from symjax_mlp._hybrid.pure import PureModel, plain
from symjax_mlp._hybrid.trace import TRACER_ERRORS, TraceEvent, TraceLog, control_flow_error
from symjax_mlp._hybrid.traced import TracedModel
from symjax_mlp._specs import array_types

_FROZEN = (
    "{name}: a Hybrid is a frozen result (like jax.stages.Compiled): its {field!r} cannot be "
    "assigned, because the compiled program and the eager path would then disagree. Write "
    "h = h.replace({field}=...) for a new Hybrid with the new value."
)
_STATELESS = (
    "{caller}(params, state, ...): the model is stateless (it carries nothing between calls), "
    "so there is no state to pass. Call {name}.apply(params, *args, **kwargs); a keyword of "
    "your own (state=...) reaches the model as any keyword does."
)
#: what replace() takes besides params and state, as the Hybrid's attributes
_SETTINGS = (
    "name", "max_traces", "compiled", "mesh", "axis", "pad", "static_argnums",
    "static_argnames", "donate", "params_as_constants",
)  # fmt: skip


class Hybrid:
    """A model bound to its params, compiled by XLA on call, or run eagerly; a frozen result.

    Create one with :func:`~symjax_mlp.hybridize`. ``h(x)`` runs the compiled program (one
    trace and compile per input signature and static setting); ``h.eager(x)`` runs the same
    function op by op, Python and all, every time; ``h.apply(params, x)`` is the compiled pure
    function for ``jax.grad``. ``h.shard(mesh)`` runs it data-parallel over a device mesh.
    Settings never change in place: ``h.replace(params=new)`` returns a new Hybrid.

    Attributes:
      fn: the pure inference function ``fn(variables, *args, **kwargs) -> out`` (see
        :attr:`variables`); what :func:`~symjax_mlp.export` exports.
      params: what gradients are taken of: a linen model's variables without its mutable
        collections, an nnx module's ``Param`` values, or the params given.
      state: what calls carry forward (read-only; ``{}`` when stateless): a linen model's
        mutable collections and rng streams, or an nnx module's other variables.
      name: shown in trace logs and errors.
      stateful: whether calls carry state.
      max_traces: the trace budget, or ``None``.
      compiled: whether ``__call__`` is compiled (``False``: eager).
      params_as_constants: whether ``h(x)``'s program holds the params as constants.
      mesh: the ``jax.sharding.Mesh`` the batch is split over, or ``None`` (one device).
      axis: the mesh axis the batch is split over; ``n_shards`` is its size.
      pad: pad a batch that does not divide over the shards, and trim the result.
      __signature__: the model's inputs, its params dropped (``inspect.signature(h)``).

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
        fn: Callable[..., Any] | PureModel,
        params: Any,
        *,
        state: Any = None,
        name: str | None = None,
        max_traces: int | None = None,
        compiled: bool = True,
        mesh: Mesh | None = None,
        axis: str = "data",
        pad: bool = True,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate: bool = False,
        params_as_constants: bool = False,
    ) -> None:
        check_settings(
            name=(name, str, None), axis=(axis, str, None), compiled=(compiled, bool, True),
            pad=(pad, bool, True), donate=(donate, bool, False),
            params_as_constants=(params_as_constants, bool, False), max_traces=max_traces,
        )  # fmt: skip
        model = fn if isinstance(fn, PureModel) else plain(fn)
        name = name or getattr(model.target, "__name__", type(model.target).__name__)
        leaves, treedef = jax.tree.flatten(params)
        nums, names = static_args(model, name, argnums(static_argnums), argnames(static_argnames))
        # A donating call consumes the held state: hold buffers of our own, never the caller's
        # (their variables, an nnx module's BatchStat) nor another Hybrid's. Copied once, here.
        owned = bool(donate) and model.stateful and mesh is None
        held = HeldState(name, {} if state is None else state, own=owned)
        log = TraceLog(name, max_traces)
        # Baked: the compiled calls close over the params (XLA constants), pass none.
        baked = params_as_constants and mesh is None
        self._set(
            fn=model.target if model.kind == "plain" else model.inference(name), name=name,
            max_traces=max_traces,
            compiled=compiled, axis=axis, pad=pad, static_argnums=nums, static_argnames=names,
            donate=bool(donate), params_as_constants=bool(params_as_constants),
            stateful=model.stateful, _model=model, _given=params, _treedef=treedef, _held=held,
            _log=log, _modes=ModuleModes.of(model), _apply=None, __signature__=_inputs(model),
            _traced=TracedModel(model, treedef, leaves if baked else None, held, log),
        )  # fmt: skip
        trace = self._traced.stateful if self.stateful else self._traced.stateless
        if mesh is None:
            donated = (2,) if (self.stateful and donate) else ()
            self._set(
                mesh=None,
                n_shards=1,
                _parallel=None,
                _leaves=() if baked else leaves,
                _jitted=self._jit(trace, static_argnums=0, donate_argnums=donated),
                _fast=compiled and not self.static_argnums,
            )
            return
        parallel = _mesh.DataParallel.over(name, mesh, axis, pad, params_as_constants)
        if self.stateful:  # the state replicated, as the params are; a call's new state too
            self._held.hold(parallel.replicate(self._held.leaves))
        options = parallel.jit(trace, self.stateful)
        self._set(
            mesh=parallel.mesh,
            n_shards=parallel.n_shards,
            _parallel=parallel,
            _leaves=parallel.replicate(leaves),
            _jitted=self._jit(options.pop("fun"), static_argnums=0, **options),
            _fast=False,
        )

    def _jit(self, trace: Callable[..., Any], **options: Any) -> Any:
        """``jax.jit`` of ``trace``, its module named ``jit_<name>_hybrid`` (see ``rng``)."""
        return jax.jit(_rng.as_program(trace, self.name), **options)

    def _set(self, **fields: Any) -> None:
        for k, v in fields.items():
            object.__setattr__(self, k, v)

    def __setattr__(self, field: str, value: Any) -> None:
        raise AttributeError(_FROZEN.format(name=self.name, field=field))

    # -- what it holds ---------------------------------------------------------------------
    @property
    def params(self) -> Any:
        """What gradients are taken of (read-only; see :meth:`replace`)."""
        if self.mesh is None:
            return self._given
        return jax.tree.unflatten(self._treedef, self._leaves)

    @property
    def state(self) -> Any:
        """What calls carry forward, as of the last call (``{}`` when stateless)."""
        return self._held.tree

    @property
    def variables(self) -> Any:
        """What :attr:`fn` takes: ``{"params": params, "state": state}`` for a stateful model,
        else the params."""
        return {"params": self.params, "state": self.state} if self.stateful else self.params

    @property
    def module(self) -> Any:
        """The model: an nnx module rebuilt with the current state, or the linen module."""
        if self._model.kind == "nnx":
            state = self._held.copy() if self.donate else self.state
            return self._model.module(self.params, state)
        return self._model.module

    def replace(self, **changes: Any) -> Hybrid:
        """A new Hybrid with ``changes`` (``params``, ``state``, ``name``, ``max_traces``,
        ``compiled``, ``mesh``, ``axis``, ``pad``, ``static_argnums``, ``static_argnames``,
        ``donate``, ``params_as_constants``).

        The new Hybrid has its own trace log and shares the ``on_trace`` callbacks.

        Example:
          >>> import jax.numpy as jnp
          >>> import symjax_mlp as sm
          >>> h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
          >>> h.replace(params=jnp.float32(3))(jnp.ones(2))
          Array([3., 3.], dtype=float32)
        """
        settings = {k: getattr(self, k) for k in ("params", "state", *_SETTINGS)}
        settings |= {k: tuple(settings[k]) for k in ("static_argnums", "static_argnames")}
        bad = sorted(set(changes) - set(settings))
        if bad:
            raise ConfigError(
                f"{self.name}.replace({bad[0]}=...): not a setting of a Hybrid; choose from "
                f"{', '.join(sorted(settings))}."
            )
        settings |= changes
        params, state = settings.pop("params"), settings.pop("state")
        if self.donate and not settings["donate"] and "state" not in changes:
            state = self._held.copy()  # self's next call consumes what it holds
        twin = Hybrid(self._model, params, state=state, **settings)
        twin._log.callbacks = self._log.callbacks
        return twin

    def snapshot(self) -> Hybrid:
        """This Hybrid as it runs now, whatever happens to its model later.

        An nnx module's settings are fixed as they are now, and a donating Hybrid's state is
        copied into buffers that no call of ``self`` consumes. Returns ``self`` when neither
        applies. What a :class:`~symjax_mlp.serving.Batcher` serves.

        Example:
          >>> import jax.numpy as jnp
          >>> import symjax_mlp as sm
          >>> h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
          >>> h.snapshot() is h
          True
        """
        if self._modes is None and not (self.donate and self.stateful):
            return self
        owned = self.donate and self.stateful  # its next call consumes what self holds
        twin = self.replace(state=self._held.copy()) if owned else self.replace()
        if self._modes is not None:
            twin._set(_modes=self._modes.fixed())
        return twin

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the compiled program (or :meth:`eager`, for a ``hybridize(False)`` twin)."""
        if self._fast and not kwargs:  # the hot path: arrays in, one dispatch
            for a in args:
                if type(a) not in _ARRAYS:
                    break
            else:
                key = () if self._modes is None else self._modes.key(())
                try:
                    if not self.stateful:
                        return self._jitted(key, self._leaves, *args)
                    return self._call_held(key, args, {})
                except TRACER_ERRORS as e:
                    raise control_flow_error(self.name, e) from e
        if not self.compiled:
            return self.eager(*args, **kwargs)
        static, dyn, dyn_kw = self._partition(args, kwargs, self.name)
        given = objects.given(dyn, dyn_kw, self.name, sharded=self._parallel is not None)
        try:
            if self._parallel is not None:
                held = self._held if self.stateful else None
                return self._parallel.call(
                    self._jitted, static, self._leaves, held, dyn, dyn_kw, self._sees_rows
                )
            if not self.stateful:
                out = self._jitted(static, self._leaves, *dyn, **dyn_kw)
                if not given:
                    return out
                out, new = out
                objects.write_back(given, new)
                return out
            return self._call_held(static, dyn, dyn_kw, given)
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e

    def _call_held(self, static: Any, dyn: Any, dyn_kw: Any, given: Any = ()) -> Any:
        """A stateful call: the held state passed, and the new state held, under its lock;
        the nnx Variables ``given`` in the inputs set as the call left them."""
        with self._held.lock:
            out, held, *new = self._jitted(static, self._leaves, self._held.leaves, dyn, dyn_kw)
            self._held.hold(held)
        if given:
            objects.write_back(given, new[0])
        return out

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the model imperatively: op by op, Python (and its ``print``) on every call.

        The ``on_trace`` callbacks run too, with the concrete inputs, every call; a stateful
        model's state is carried exactly as in compiled calls.
        """
        self._log.run_callbacks(args, kwargs)
        with self._held.lock:
            out, state = self._model.call(self.params, self.state, args, kwargs)
            if self.stateful:
                self._held.hold(self._held.flatten(state))
        return out

    def apply(self, params: Any, /, *args: Any, **kwargs: Any) -> Any:
        """The compiled pure function, for ``jax.grad`` and optax: ``h.apply(h.params, x)``.

        Traced visibly (``entry="apply"`` in :attr:`trace_log`, counted against
        ``max_traces``). A stateless model returns ``out``. A stateful one returns
        ``(out, new_state)``, from :attr:`state`, and holds nothing; to carry the state
        yourself, see :meth:`apply_with_state`. Every keyword goes to the model (an equinox
        style ``state=`` too). nnx objects given (an ``Rngs``) come back mutated, as eagerly.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> import symjax_mlp as sm
          >>> h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.float32(2)})
          >>> jax.grad(lambda p: h.apply(p, jnp.ones(3)).sum())(h.params)
          {'w': Array(3., dtype=float32)}
        """
        out, new_state = self._apply_pure(f"{self.name}.apply", params, self.state, args, kwargs)
        return (out, new_state) if self.stateful else out

    def apply_with_state(self, params: Any, state: Any, /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`apply` of a stateful model from ``state``: ``(out, new_state)``, for a loop
        that carries the state itself (as Haiku's ``apply(params, state, ...)``).

        Raises:
          ConfigError: the model is stateless (use :meth:`apply`).

        Example:
          >>> import jax.numpy as jnp
          >>> import symjax_mlp as sm
          >>> from flax import nnx
          >>> h = sm.hybridize(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
          >>> out, state = h.apply_with_state(h.params, h.state, jnp.ones((3, 2)))
          >>> out, state = h.apply_with_state(h.params, state, jnp.ones((3, 2)))
          >>> sorted(state)
          ['mean', 'var']
        """
        caller = f"{self.name}.apply_with_state"
        if not self.stateful:
            raise ConfigError(_STATELESS.format(caller=caller, name=self.name))
        return self._apply_pure(caller, params, state, args, kwargs)

    def _apply_pure(self, caller: str, params: Any, state: Any, args: Any, kwargs: Any) -> Any:
        """``(out, new_state)`` of the compiled pure function; given nnx objects written back."""
        static, dyn, dyn_kw = self._partition(args, kwargs, caller)
        given = objects.given(dyn, dyn_kw, caller)
        if self._apply is None:  # never donating: params and state are the caller's
            jitted = self._jit(self._traced.apply, static_argnums=0)
            object.__setattr__(self, "_apply", jitted)
        try:
            out, new_state, *new = self._apply(static, params, state, dyn, dyn_kw)
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e
        if given:
            objects.write_back(given, new[0])
        return out, new_state

    def hybridize(self, active: bool = True) -> Hybrid:
        """Returns a twin whose ``__call__`` is compiled (``True``) or eager (``False``).

        ``self`` is unchanged; the twin shares the params and callbacks but not the traces.
        """
        return self.replace(compiled=active)

    def shard(self, mesh: Mesh | None = None, *, axis: str = "data", pad: bool = True) -> Hybrid:
        """This Hybrid run data-parallel over ``mesh``; see :func:`~symjax_mlp.shard`."""
        mesh = _mesh.data_mesh(axis=axis) if mesh is None else mesh
        return self.replace(mesh=mesh, axis=axis, pad=pad)

    # -- the stages ------------------------------------------------------------------------
    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Traces and lowers for the inputs: ``.as_text()`` is the StableHLO module.

        A sharded Hybrid lowers for the padded batch: one SPMD module for every device.
        """
        static, dyn, dyn_kw = self._partition(args, kwargs, self.name)
        try:
            if self._parallel is not None:
                held = self._held if self.stateful else None
                return self._parallel.lower(self._jitted, static, self._leaves, held, dyn, dyn_kw)
            if not self.stateful:
                return self._jitted.lower(static, self._leaves, *dyn, **dyn_kw)
            return self._jitted.lower(static, self._leaves, self._held.leaves, dyn, dyn_kw)
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e

    def compile(self, *args: Any, **kwargs: Any) -> jax.stages.Compiled:
        """Lowers and compiles: ``.as_text()`` is XLA's optimized HLO, with ``.cost_analysis()``
        and ``.memory_analysis()``."""
        return self.lower(*args, **kwargs).compile()

    def graph(self, *args: Any, **kwargs: Any) -> Graph:
        """Stages the model on the inputs into a :class:`~symjax_mlp.Graph` (jaxpr, per layer).

        This stages the un-jitted function, so every layer shows; it is not counted in
        :attr:`trace_count`. Static settings (``train=True``) are taken as in a call.
        """
        static, dyn, dyn_kw = self._split(args, kwargs, self.name)
        try:
            return self._traced.graph(self.name, static, self.params, self.state, dyn, dyn_kw)
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e

    def training_mode(self, *args: Any, **kwargs: Any) -> tuple[str, ...]:
        """An nnx module's settings that hold it in training mode on these inputs.

        The ``deterministic`` and ``use_running_average`` attributes that ``module.eval()``
        would flip, where flipping them changes the staged program, as ``"path=value"``;
        ``()`` in eval mode and for other models.
        """
        if self._modes is None:
            return ()
        static, dyn, dyn_kw = self._split(args, kwargs, self.name)
        try:
            return self._modes.training(
                lambda values: str(self._staged(static, dyn, dyn_kw, 0, values))
            )
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e

    # -- tracing you can see ---------------------------------------------------------------
    @property
    def trace_count(self) -> int:
        """How many times the compiled paths (``h(x)``, ``h.apply``) have traced the model."""
        return len(self._log)

    @property
    def trace_log(self) -> tuple[TraceEvent, ...]:
        """One :class:`~symjax_mlp.TraceEvent` per trace, oldest first."""
        return self._log.events

    def on_trace(self, callback: Callable[..., Any]) -> Callable[..., Any]:
        """Registers ``callback(*args, **kwargs)``; runs once per trace, with traced inputs.

        In eager mode it runs on every call, with concrete arrays. Returns ``callback``, so it
        also works as a decorator.
        """
        self._log.add(callback)
        return callback

    def _split(self, args: Any, kwargs: Any, caller: str) -> tuple[Any, Any, Any]:
        """The call's static args, traced args and traced kwargs."""
        return partition(args, kwargs, self.static_argnums, self.static_argnames, caller=caller)

    def _partition(self, args: Any, kwargs: Any, caller: str) -> tuple[Any, Any, Any]:
        """As :meth:`_split`, the static key with the module's settings added."""
        static, dyn, dyn_kw = self._split(args, kwargs, caller)
        return (static if self._modes is None else self._modes.key(static)), dyn, dyn_kw

    def _staged(self, static: Any, dyn: Any, dyn_kw: Any, part: int, settings=None) -> Any:
        """The jaxpr of the model's output (0) or new state (1) on a partitioned call."""
        return self._traced.staged(static, self.params, self.state, dyn, dyn_kw, part, settings)

    def _sees_rows(self, static: Any, dyn: Any, dyn_kw: Any) -> bool:
        """Whether a call's new state depends on its inputs (BatchNorm's statistics)."""
        return any(input_dependent(self._staged(static, dyn, dyn_kw, 1)))

    def __repr__(self) -> str:
        where = "" if self.mesh is None else f", mesh={dict(self.mesh.shape)}, axis={self.axis!r}"
        mode = "compiled" if self.compiled else "eager"
        state = ", stateful" if self.stateful else ""
        return f"Hybrid({self.name}, {mode}{state}, traces={self.trace_count}{where})"


_ARRAYS = array_types()


def _inputs(model: PureModel) -> inspect.Signature | None:
    parameters = model.parameters()
    return None if parameters is None else inspect.Signature(parameters)
