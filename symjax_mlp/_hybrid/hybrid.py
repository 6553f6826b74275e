"""The Hybrid object: a model plus its params (and state), eager or XLA-compiled at one switch.

:func:`~symjax_mlp.hybridize` (in :mod:`~symjax_mlp._hybrid.make`) makes one; the Hybrid
is the one place where ``jax.jit`` is applied. The compiled path is a single
``jax.jit`` object created once per ``Hybrid``: JAX's C++ dispatch keeps one executable per
input signature, and the params are flattened once, at construction. Every trace goes through
:meth:`Hybrid._trace`, which records a :class:`~symjax_mlp.TraceEvent`, explains retraces,
enforces the ``max_traces`` budget and runs the ``on_trace`` callbacks, so tracing is
visible, never silent.

What a call takes, as MXNet's ``hybridize`` and equinox's ``filter_jit`` see it: arrays
(JAX or NumPy, and tuples/dicts of them) are traced; Python settings (bool, int, float, str,
None, tuples of them) are static, part of the cache key, so ``h(x, train=True)`` just works.

A model with state carries it across calls exactly as eager calls would: linen's mutable
collections (``batch_stats``) and rng streams (``dropout``), and every non-``Param`` variable of
an nnx module (batch statistics, rng counts). The state is held as the params are, flattened
once: a list of arrays, typed rng keys as their raw ``key_data`` (the compiled function wraps
and unwraps them), so a call passes and takes back a flat list and :attr:`Hybrid.state`
rebuilds the tree only when read. A call may change the state's values but not its structure.
The pure form, for ``jax.grad`` and optax, is :meth:`Hybrid.apply`, which returns the new
state instead of holding it.

Sharding is a setting of the same object: ``h.shard(mesh)`` is a Hybrid whose one ``jax.jit``
carries the data-parallel in/out shardings (see :mod:`symjax_mlp._hybrid.mesh`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from symjax_mlp._errors import ConfigError, ControlFlowError, RetraceError, SignatureError
from symjax_mlp._hybrid import mesh as _mesh
from symjax_mlp._hybrid import rng as _rng
from symjax_mlp._hybrid.graph import Graph
from symjax_mlp._hybrid.jaxpr import input_dependent
from symjax_mlp._hybrid.options import argnames, argnums, check_settings, static_args
from symjax_mlp._hybrid.pure import (
    PureModel,
    mode_settings,
    plain,
    state_structure,
    unwrap_keys,
    wrap_keys,
)
from symjax_mlp._hybrid.trace import (
    TRACER_ERRORS,
    ModuleSetting,
    TraceEvent,
    control_flow_error,
    explain,
    partition,
    rebuild,
    settings_key,
    signature,
)
from symjax_mlp._specs import array_types

_FROZEN = (
    "{name}: a Hybrid is a frozen result (like jax.stages.Compiled): its {field!r} cannot be "
    "assigned, because the compiled program and the eager path would then disagree. Write "
    "h = h.replace({field}=...) for a new Hybrid with the new value."
)
_STATE_UNDER_TRANSFORM = (
    "{name}: a stateful Hybrid was called inside a JAX transformation (jax.jit, jax.grad, "
    "jax.vmap, ...), where its new state would be a tracer. Use the pure form inside "
    "transformations: out, state = h.apply(h.params, x) returns the new state instead of "
    "holding it."
)
_PADDED_STATE = (
    "{name}.shard(...): a batch of {batch} rows does not divide over {n} shards, and the "
    "model's new state depends on its rows (BatchNorm's batch statistics, in training): the "
    "padding rows would change it. Pass a batch that is a multiple of {n} (or call it in "
    "eval mode, where the state does not see the rows)."
)
_STATE_STRUCTURE = (
    "{name}: a call changed the structure of the model's state, from {before} to {after}. A "
    "Hybrid holds its state as the arrays it started with; a call may change their values, not "
    "add, remove or retype them (a variable created inside __call__, a sow into a mutable "
    "collection). Create every variable when the model is built, or use the pure form, "
    "out, state = h.apply(h.params, x), which returns whatever state the call makes."
)


class Hybrid:
    """A model bound to its params, compiled by XLA on call, or run eagerly; a frozen result.

    Create one with :func:`~symjax_mlp.hybridize`. ``h(x)`` runs the compiled program (one
    trace and compile per input signature and static setting); ``h.eager(x)`` runs the same
    function op by op, Python and all, every time; ``h.apply(params, x)`` is the compiled pure
    function for ``jax.grad``. ``h.shard(mesh)`` runs it data-parallel over a device mesh.
    Settings never change in place: ``h.replace(params=new)`` returns a new Hybrid.

    Attributes:
      fn: the pure inference function ``fn(variables, *args, **kwargs) -> out`` (see
        :attr:`variables`), or the function given to :func:`~symjax_mlp.hybridize`; what
        :func:`~symjax_mlp.export` exports.
      params: what gradients are taken of: a linen model's variables without its mutable
        collections, an nnx module's ``Param`` values, or the params given.
      state: what calls carry forward (read-only; ``{}`` when stateless): a linen model's
        mutable collections and rng streams (``state["rngs"]``), or an nnx module's other
        variables (batch statistics, rng keys and counts).
      name: shown in trace logs and errors.
      stateful: whether calls carry state.
      max_traces: the trace budget, or ``None``.
      compiled: whether ``__call__`` is compiled (``False``: eager).
      params_as_constants: whether ``h(x)``'s program holds the params as constants.
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
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate: bool = False,
        params_as_constants: bool = False,
        _model: PureModel | None = None,
        _state: Any = None,
    ) -> None:
        if max_traces is not None and (
            not isinstance(max_traces, int) or isinstance(max_traces, bool) or max_traces < 1
        ):
            raise ConfigError(f"max_traces must be a positive int or None; got {max_traces!r}.")
        check_settings(
            name=(name, str, None), axis=(axis, str, None), compiled=(compiled, bool, True),
            pad=(pad, bool, True), donate=(donate, bool, False),
            params_as_constants=(params_as_constants, bool, False),
        )  # fmt: skip
        model = plain(fn) if _model is None else _model
        name = name or getattr(fn, "__name__", type(fn).__name__)
        leaves, treedef = jax.tree.flatten(params)
        state = {} if _state is None else _state
        state_def, key_impls = state_structure(state)
        held = unwrap_keys(jax.tree.leaves(state), key_impls)
        # A donating call consumes the held state: hold buffers of our own, never the caller's
        # (their variables, an nnx module's BatchStat) nor another Hybrid's. Copied once, here.
        owned = bool(donate) and model.stateful and mesh is None
        nums, names = static_args(model, name, argnums(static_argnums), argnames(static_argnames))
        settings = {
            "fn": fn if _model is None else model.inference(name),
            "name": name,
            "max_traces": max_traces,
            "compiled": compiled,
            "axis": axis,
            "pad": pad,
            "static_argnums": nums,
            "static_argnames": names,
            "donate": bool(donate),
            "params_as_constants": bool(params_as_constants),
            "stateful": model.stateful,
            "_model": model,
            "_given": params,
            "_treedef": treedef,
            "_held": _copies(held) if owned else held,
            "_state_def": state_def,
            "_key_impls": key_impls,
            # The tree of ``_held``, rebuilt on the first read after a call (or a copy).
            "_state_tree": None if owned else state,
            "_lock": threading.RLock(),
            "_events": [],
            "_callbacks": [],
            "_apply": None,
            # an nnx module's settings (module.eval() flips them): read at every call
            "_settings_of": model.settings,
            "_setting_keys": tuple(map(ModuleSetting, model.setting_names)),
            "_keyed": {},  # settings -> their static entries, made once per mode
            "_sees": {},  # a sharded call's signature -> whether its new state sees its rows
        }
        for k, v in settings.items():
            object.__setattr__(self, k, v)
        if mesh is None:
            trace = self._trace_stateful if self.stateful else self._trace
            donated = (2,) if (self.stateful and donate) else ()
            self._set(
                mesh=None,
                n_shards=1,
                # Baked: the compiled calls close over the params (XLA constants), pass none.
                _constants=leaves if params_as_constants else None,
                _leaves=() if params_as_constants else leaves,
                _jitted=self._jit(trace, static_argnums=0, donate_argnums=donated),
                _fast=compiled and not self.static_argnums,
            )
            return
        if params_as_constants:
            raise ConfigError(
                f"{name}.shard(...): params_as_constants=True compiles the params into one "
                "device's program; a sharded Hybrid places them on every device of the mesh. "
                "Shard the Hybrid without it: h.replace(params_as_constants=False).shard(mesh)."
            )
        m, rep, dat, n = _mesh.shardings(mesh, axis)
        if self.stateful:  # the state replicated, as the params are; a call's new state too
            trace, ins, outs = self._trace_sharded_stateful, (rep, rep, dat, dat), (dat, rep)
            self._set(_held=[_mesh.place(leaf, rep) for leaf in self._held], _state_tree=None)
        else:
            trace, ins, outs = self._trace_sharded, (rep, dat, dat), dat
        self._set(
            _fast=False,
            _constants=None,
            mesh=m,
            n_shards=n,
            _batch_sharding=dat,
            _leaves=[_mesh.place(leaf, rep) for leaf in leaves],
            _jitted=self._jit(trace, static_argnums=0, in_shardings=ins, out_shardings=outs),
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
        tree = self._state_tree
        if tree is None:
            with self._lock:  # not between a call and its _hold
                tree = jax.tree.unflatten(self._state_def, wrap_keys(self._held, self._key_impls))
                object.__setattr__(self, "_state_tree", tree)
        return tree

    @property
    def module(self) -> Any:
        """The model: an nnx module rebuilt with the current state, or the linen module."""
        if self._model.kind == "nnx":
            state = self._state_copy() if self.donate else self.state
            return self._model.module(self.params, state)
        return self._model.module

    def _state_copy(self) -> Any:
        """:attr:`state` in new buffers, which no call of this Hybrid consumes."""
        with self._lock:
            raw = _copies(self._held)
        return jax.tree.unflatten(self._state_def, wrap_keys(raw, self._key_impls))

    def replace(self, **changes: Any) -> Hybrid:
        """A new Hybrid with ``changes`` (``params``, ``state``, ``name``, ``max_traces``,
        ``compiled``, ``mesh``, ``axis``, ``pad``, ``static_argnums``, ``static_argnames``,
        ``donate``, ``params_as_constants``).

        The new Hybrid has its own trace log (a new compiled program) and shares the
        ``on_trace`` callbacks.

        Example:
          >>> import jax.numpy as jnp
          >>> import symjax_mlp as sm
          >>> h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
          >>> h.replace(params=jnp.float32(3))(jnp.ones(2))
          Array([3., 3.], dtype=float32)
        """
        settings = {
            "params": self.params,
            "state": self.state,
            "name": self.name,
            "max_traces": self.max_traces,
            "compiled": self.compiled,
            "mesh": self.mesh,
            "axis": self.axis,
            "pad": self.pad,
            "static_argnums": tuple(self.static_argnums),
            "static_argnames": tuple(self.static_argnames),
            "donate": self.donate,
            "params_as_constants": self.params_as_constants,
        }
        bad = sorted(set(changes) - set(settings))
        if bad:
            raise ConfigError(
                f"{self.name}.replace({bad[0]}=...): not a setting of a Hybrid; choose from "
                f"{', '.join(sorted(settings))}."
            )
        settings |= changes
        params, state = settings.pop("params"), settings.pop("state")
        if self.donate and not settings["donate"] and "state" not in changes:
            state = self._state_copy()  # self's next call consumes what it holds
        fn = self.fn if self._model.kind == "plain" else self._model.call
        twin = Hybrid(fn, params, _model=self._model, _state=state, **settings)
        object.__setattr__(twin, "_callbacks", self._callbacks)
        return twin

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the compiled program (or :meth:`eager`, for a ``hybridize(False)`` twin)."""
        if self._fast and not kwargs:  # the hot path: arrays in, one dispatch
            for a in args:
                if type(a) not in _ARRAYS:
                    break
            else:
                key = () if self._settings_of is None else self._with_settings(())
                try:
                    if not self.stateful:
                        return self._jitted(key, self._leaves, *args)
                    with self._lock:
                        out, held = self._jitted(key, self._leaves, self._held, args, {})
                        self._hold(held)
                    return out
                except TRACER_ERRORS as e:
                    raise control_flow_error(self.name, e) from e
        if not self.compiled:
            return self.eager(*args, **kwargs)
        static, dyn, dyn_kw = self._partition(args, kwargs, self.name)
        try:
            if self.mesh is not None:
                return self._call_sharded(static, dyn, dyn_kw)
            if not self.stateful:
                return self._jitted(static, self._leaves, *dyn, **dyn_kw)
            with self._lock:
                out, held = self._jitted(static, self._leaves, self._held, dyn, dyn_kw)
                self._hold(held)
            return out
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the model imperatively: op by op, Python (and its ``print``) on every call.

        The ``on_trace`` callbacks run too, with the concrete inputs, every call; a stateful
        model's state is carried exactly as in compiled calls.
        """
        for callback in self._callbacks:
            callback(*args, **kwargs)
        with self._lock:
            out, state = self._model.call(self.params, self.state, args, kwargs)
            if self.stateful:
                self._hold(self._flatten_state(state))
        return out

    def apply(self, params: Any, *args: Any, state: Any = None, **kwargs: Any) -> Any:
        """The compiled pure function, for ``jax.grad`` and optax: ``h.apply(h.params, x)``.

        Traced visibly (``entry="apply"`` in :attr:`trace_log`, counted against
        ``max_traces``). A stateless model returns ``out``. A stateful one returns
        ``(out, new_state)``, from ``state`` (default: :attr:`state`), and holds nothing.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> import symjax_mlp as sm
          >>> h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.float32(2)})
          >>> jax.grad(lambda p: h.apply(p, jnp.ones(3)).sum())(h.params)
          {'w': Array(3., dtype=float32)}
        """
        static, dyn, dyn_kw = self._partition(args, kwargs, f"{self.name}.apply")
        if self._apply is None:  # never donating: params and state are the caller's
            jitted = self._jit(self._trace_apply, static_argnums=0)
            object.__setattr__(self, "_apply", jitted)
        state = self.state if state is None else state
        try:
            out, new_state = self._apply(static, params, state, dyn, dyn_kw)
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e
        return (out, new_state) if self.stateful else out

    @property
    def variables(self) -> Any:
        """What :attr:`fn` takes: ``{"params": params, "state": state}`` for a stateful model,
        else the params."""
        return {"params": self.params, "state": self.state} if self.stateful else self.params

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
            if self.mesh is not None:
                _, placed, placed_kw = self._prepare(dyn, dyn_kw)
                held = (self._held,) if self.stateful else ()
                return self._jitted.lower(static, self._leaves, *held, placed, placed_kw)
            if not self.stateful:
                return self._jitted.lower(static, self._leaves, *dyn, **dyn_kw)
            return self._jitted.lower(static, self._leaves, self._held, dyn, dyn_kw)
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e

    def compile(self, *args: Any, **kwargs: Any) -> jax.stages.Compiled:
        """Lowers and compiles: ``.as_text()`` is XLA's optimized HLO, with ``.cost_analysis()``
        and ``.memory_analysis()``."""
        return self.lower(*args, **kwargs).compile()

    def graph(self, *args: Any, **kwargs: Any) -> Graph:
        """Stages the model on the inputs into a :class:`~symjax_mlp.Graph` (jaxpr, per layer).

        This stages the un-jitted function, so every layer shows; it is not counted in
        :attr:`trace_count`, which counts the traces of the compiled path. Static settings
        (``train=True``) are taken as in a call.
        """
        static, dyn, dyn_kw = partition(
            args, kwargs, self.static_argnums, self.static_argnames, caller=self.name
        )
        call, state = self._model.call, self.state

        def staged(params: Any, dyn: Any, dyn_kw: Any) -> Any:
            args, kwargs = rebuild(static, dyn, dyn_kw)
            return call(params, state, args, kwargs)[0]

        staged.__name__ = self.name
        try:
            return Graph.of(staged, self.name, self.params, dyn, dyn_kw)
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e

    def _settings_fixed(self) -> Hybrid:
        """A twin whose nnx module settings stay as they are now: what a batcher serves, so
        that ``module.train()`` later (training ``h`` while it serves) does not switch it."""
        values = self._settings_of()
        twin = self.replace()
        object.__setattr__(twin, "_settings_of", lambda: values)
        return twin

    def training_mode(self, *args: Any, **kwargs: Any) -> tuple[str, ...]:
        """An nnx module's settings that hold it in training mode on these inputs.

        The module's ``deterministic`` and ``use_running_average`` attributes that
        ``module.eval()`` would flip, where flipping them changes the staged program (a call
        that passes ``deterministic=`` itself is not held by them), as ``"path=value"``;
        ``()`` in eval mode and for other models. An artifact or a batcher of such a model
        would drop units with a fixed key and normalise each batch by its own statistics.
        """
        if self._settings_of is None:
            return ()
        now = self._settings_of()
        evaluating = mode_settings(self._model, now, train=False)
        if now == evaluating:
            return ()
        static, dyn, dyn_kw = partition(
            args, kwargs, self.static_argnums, self.static_argnames, caller=self.name
        )
        try:
            programs = {str(self._staged(static, dyn, dyn_kw, 0, v)) for v in (now, evaluating)}
        except TRACER_ERRORS as e:
            raise control_flow_error(self.name, e) from e
        if len(programs) == 1:  # the mode attributes do not change what it computes
            return ()
        pairs = zip(self._model.setting_names, now, evaluating, strict=True)
        return tuple(f"{n}={v}" for n, v, e in pairs if v != e)

    # -- tracing you can see ---------------------------------------------------------------
    @property
    def trace_count(self) -> int:
        """How many times the compiled paths (``h(x)``, ``h.apply``) have traced the model."""
        return len(self._events)

    @property
    def trace_log(self) -> tuple[TraceEvent, ...]:
        """One :class:`~symjax_mlp.TraceEvent` per trace, oldest first."""
        return tuple(self._events)

    def on_trace(self, callback: Callable[..., Any]) -> Callable[..., Any]:
        """Registers ``callback(*args, **kwargs)``; runs once per trace, with traced inputs.

        In eager mode it runs on every call, with concrete arrays. Returns ``callback``, so it
        also works as a decorator.
        """
        if not callable(callback):
            raise ConfigError(f"on_trace expects a callable; got {type(callback).__name__}.")
        self._callbacks.append(callback)
        return callback

    def _partition(self, args: Any, kwargs: Any, caller: str) -> tuple[Any, Any, Any]:
        """The call's static key (with the module's settings), traced args and kwargs."""
        static, dyn, dyn_kw = partition(
            args, kwargs, self.static_argnums, self.static_argnames, caller=caller
        )
        return (static if self._settings_of is None else self._with_settings(static)), dyn, dyn_kw

    def _with_settings(self, static: tuple) -> tuple:
        """``static`` and an nnx module's settings as they are now: a trace is keyed on them,
        so ``module.eval()`` after ``hybridize`` retraces once (the reason names what
        changed) and every later call in that mode reuses its program."""
        values = self._settings_of()
        entries = self._keyed.get(values)
        if entries is None:
            entries = self._keyed[values] = settings_key(self._setting_keys, values)
        return static + entries

    def _begin(self, static: Any, dyn: Any, dyn_kw: Any, entry: str) -> TraceEvent:
        """The event this trace will log; raises RetraceError past the budget."""
        sig, tree, shown = signature(dyn, dyn_kw, static)
        with self._lock:
            reason = explain(sig, tree, self._events, shown)
            event = TraceEvent(len(self._events), sig, tree, reason, shown, entry)
            if self.max_traces is not None and len(self._events) >= self.max_traces:
                history = "\n  ".join(map(str, self._events))
                raise RetraceError(
                    f"{self.name}: trace #{event.index} would exceed max_traces="
                    f"{self.max_traces}. Why it retraced: {reason}.\n  Earlier traces:\n  "
                    f"{history}\nCall it with inputs of one shape and dtype (pad the batch, or "
                    "cast once) and fixed settings, or raise max_traces if each is intended."
                )
        args, kwargs = rebuild(static, dyn, dyn_kw)
        for callback in self._callbacks:
            callback(*args, **kwargs)
        return event

    def _commit(self, event: TraceEvent) -> None:
        """Logs a trace that succeeded (a failed trace is neither logged nor counted)."""
        with self._lock:
            self._events.append(dataclasses.replace(event, index=len(self._events)))

    def _run(self, static: Any, leaves: Any, state: Any, dyn: Any, dyn_kw: Any, entry: str):
        event = self._begin(static, dyn, dyn_kw, entry)
        if entry == "apply":
            params = leaves
        else:  # a baked call closes over the params: JAX stages them as constants
            baked = self._constants is not None
            params = jax.tree.unflatten(self._treedef, self._constants if baked else leaves)
        result = self._call_model(static, params, state, dyn, dyn_kw)
        self._commit(event)
        return result

    def _call_model(
        self, static: Any, params: Any, state: Any, dyn: Any, dyn_kw: Any, settings=None
    ) -> tuple[Any, Any]:
        """``(out, new_state)`` of the model on a partitioned call, run with the module
        settings its static key holds (what the trace is keyed on), or with ``settings``."""
        if settings is None:
            settings = tuple(v for k, v, _ in static if type(k) is ModuleSetting)
        with self._model.pinned(settings):
            return self._model.call(params, state, *rebuild(static, dyn, dyn_kw))

    def _staged(
        self, static: Any, dyn: Any, dyn_kw: Any, part: int, settings: tuple | None = None
    ) -> Any:
        """The jaxpr of the model's output (``part`` 0) or new state (1) on a partitioned
        call, its params and state as constants (the inputs are its only ``invars``)."""
        params, state = self.params, self.state

        def staged(dyn: Any, dyn_kw: Any) -> Any:
            return self._call_model(static, params, state, dyn, dyn_kw, settings)[part]

        return jax.make_jaxpr(staged)(dyn, dyn_kw).jaxpr

    def _trace(self, static: Any, leaves: list[Any], /, *dyn: Any, **dyn_kw: Any) -> Any:
        return self._run(static, leaves, self.state, dyn, dyn_kw, "call")[0]

    def _trace_stateful(
        self, static: Any, leaves: list[Any], held: list[Any], dyn: Any, dyn_kw: Any
    ) -> Any:
        state = jax.tree.unflatten(self._state_def, wrap_keys(held, self._key_impls))
        out, new_state = self._run(static, leaves, state, dyn, dyn_kw, "call")
        return out, self._flatten_state(new_state)

    def _trace_apply(self, static: Any, params: Any, state: Any, dyn: Any, dyn_kw: Any) -> Any:
        return self._run(static, params, state, dyn, dyn_kw, "apply")

    def _flatten_state(self, state: Any) -> list[Any]:
        """A call's new state as held: its leaves, keys as raw data; the same structure."""
        state_def, key_impls = state_structure(state)
        if state_def != self._state_def or key_impls != self._key_impls:
            raise ConfigError(
                _STATE_STRUCTURE.format(name=self.name, before=self._state_def, after=state_def)
            )
        return unwrap_keys(jax.tree.leaves(state), key_impls)

    def _hold(self, held: list[Any]) -> None:
        if held and isinstance(held[0], jax.core.Tracer):
            raise ControlFlowError(_STATE_UNDER_TRANSFORM.format(name=self.name))
        object.__setattr__(self, "_held", held)
        object.__setattr__(self, "_state_tree", None)

    # -- sharded -----------------------------------------------------------------------------
    def _trace_sharded(self, static: Any, leaves: list[Any], dyn: Any, dyn_kw: Any) -> Any:
        return self._per_example(self._trace(static, leaves, *dyn, **dyn_kw), dyn)

    def _trace_sharded_stateful(
        self, static: Any, leaves: list[Any], held: list[Any], dyn: Any, dyn_kw: Any
    ) -> Any:
        out, new_held = self._trace_stateful(static, leaves, held, dyn, dyn_kw)
        return self._per_example(out, dyn), new_held

    def _per_example(self, out: Any, dyn: Any) -> Any:
        """``out``, checked to have the batch as every leaf's leading dimension."""
        batch = dyn[0].shape[0]
        for path, leaf in jax.tree_util.tree_leaves_with_path(out):
            if leaf.ndim == 0 or leaf.shape[0] != batch:
                raise SignatureError(
                    f"{self.name}: output out{jax.tree_util.keystr(path)} has shape "
                    f"{leaf.shape}, but a sharded call needs per-example outputs with the batch "
                    f"({batch}) as leading dimension. Reduce over the batch after the call."
                )
        return out

    def _call_sharded(self, static: Any, dyn: Any, dyn_kw: Any) -> Any:
        batch, placed, placed_kw = self._prepare(dyn, dyn_kw)
        padded = placed[0].shape[0] != batch
        if not self.stateful:
            out = self._jitted(static, self._leaves, placed, placed_kw)
        else:
            if padded and self._state_sees_rows(static, placed, placed_kw):
                raise SignatureError(
                    _PADDED_STATE.format(name=self.name, batch=batch, n=self.n_shards)
                )
            with self._lock:
                out, held = self._jitted(static, self._leaves, self._held, placed, placed_kw)
                self._hold(held)
        return jax.tree.map(lambda y: y[:batch], out) if padded else out

    def _state_sees_rows(self, static: Any, dyn: Any, dyn_kw: Any) -> bool:
        """Whether a call's new state depends on its inputs (BatchNorm's statistics, in
        training), so that padding rows would change it; staged once per signature."""
        key = (static, *((x.shape, x.dtype) for x in jax.tree.leaves((dyn, dyn_kw))))
        seen = self._sees.get(key)
        if seen is None:
            seen = any(input_dependent(self._staged(static, dyn, dyn_kw, 1)))
            self._sees[key] = seen
        return seen

    def _prepare(self, dyn: tuple[Any, ...], dyn_kw: dict[str, Any]) -> tuple[int, Any, Any]:
        caller = f"{self.name}.shard(...)"
        if not dyn:
            raise SignatureError(f"{caller}: needs at least one batched input.")
        arrays = [*dyn, *dyn_kw.values()]
        batch = _mesh.batch_size(arrays, caller)
        extra = _mesh.padding(batch, self.n_shards, self.pad, caller)

        def put(x: Any) -> jax.Array:
            return _mesh.place(_mesh.pad_rows(x, extra), self._batch_sharding)

        return batch, tuple(map(put, dyn)), {k: put(v) for k, v in dyn_kw.items()}

    def __repr__(self) -> str:
        where = "" if self.mesh is None else f", mesh={dict(self.mesh.shape)}, axis={self.axis!r}"
        mode = "compiled" if self.compiled else "eager"
        state = ", stateful" if self.stateful else ""
        return f"Hybrid({self.name}, {mode}{state}, traces={self.trace_count}{where})"


_ARRAYS = array_types()


def _copies(leaves: list[Any]) -> list[Any]:
    """New buffers with the values of ``leaves``, for a Hybrid to hold and donate."""
    return [jnp.array(leaf, copy=True) for leaf in leaves]
