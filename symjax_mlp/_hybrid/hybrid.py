"""The Hybrid: a model plus its params (and state), eager or XLA-compiled at one switch; the
one place ``jax.jit`` is applied."""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from symjax_mlp._cache import refuse_shared_cache
from symjax_mlp._errors import ConfigError, NoPickle, one_device, refuse_two_devices
from symjax_mlp._hybrid import args as _args
from symjax_mlp._hybrid import mesh as _mesh
from symjax_mlp._hybrid import params as _params
from symjax_mlp._hybrid import pure as _pure
from symjax_mlp._hybrid import trace as _trace
from symjax_mlp._hybrid.args import JAX_ARRAYS, NDARRAY
from symjax_mlp._hybrid.pure import ModuleModes, PureModel, plain, refit
from symjax_mlp._hybrid.pure.nnx_module import write_back
from symjax_mlp._hybrid.settings import check_settings, keyed, remember, static_args
from symjax_mlp._hybrid.staged import Staged
from symjax_mlp._hybrid.trace import TraceEvent, TraceLog, symbolic
from symjax_mlp._hybrid.traced import PROGRAM_SUFFIX, HeldState, TracedModel, given

_FROZEN = (
    "{name}: a Hybrid is a frozen result (like jax.stages.Compiled): its {field!r} cannot be "
    "assigned (the compiled and eager paths would disagree). Write h = h.replace({field}=...)."
)
_STATELESS = (
    "{caller}(params, state, ...): the model is stateless, so there is no state to pass. Call "
    "{name}.apply(params, *args, **kwargs); a keyword state=... reaches the model as any does."
)


class Hybrid(Staged, NoPickle):
    """A model bound to its params, compiled by XLA on call, or run eagerly; a frozen result.

    Made by :func:`~symjax_mlp.hybridize`. ``h(x)`` runs the compiled program (one trace per
    input signature and static setting), ``h.eager(x)`` the function op by op.

    Attributes:
      fn: the pure inference function ``fn(variables, *args, **kwargs) -> out`` (see
        :attr:`variables`); what :func:`~symjax_mlp.export` exports.
      kind: what was hybridized: ``"linen"``, ``"nnx"``, ``"eqx"`` or ``"plain"`` (a function).
      name: shown in trace logs and errors.
      stateful: whether calls carry state.
      max_traces, compiled, static_argnums, static_argnames, donate, params_as_constants,
        mesh, axis, pad: the settings, as :func:`~symjax_mlp.hybridize` and
        :func:`~symjax_mlp.shard` take them (``compiled=False``: eager; ``mesh=None``: one
        device); ``n_shards`` is the size of the mesh's ``axis``.
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
        self, fn: Callable[..., Any] | PureModel, params: Any, *, state: Any = None,
        name: str | None = None, max_traces: int | None = None, compiled: bool = True,
        mesh: Mesh | None = None, axis: str = "data", pad: bool = True,
        static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
        donate: bool = False, params_as_constants: bool = False,
    ) -> None:  # fmt: skip
        max_traces, name, axis, compiled, pad, donate, params_as_constants = check_settings(
            max_traces, name=(name, str, "'mlp'"), axis=(axis, str, "'data' (a mesh axis name)"),
            compiled=(compiled, bool, "True"), pad=(pad, bool, "True"),
            donate=(donate, bool, "False"),
            params_as_constants=(params_as_constants, bool, "False"),
        )  # fmt: skip
        model = fn if isinstance(fn, PureModel) else plain(fn)
        name, inputs = name or model.name, model.parameters()
        nums, names = static_args(inputs, name, static_argnums, static_argnames)
        over = _mesh.DataParallel.over  # a mesh refuses params_as_constants
        parallel = None if mesh is None else over(name, mesh, axis, pad, params_as_constants)
        leaves, treedef = _params.flat_params(name, params, passed=not params_as_constants)
        # a donating call consumes the held state: never the caller's buffers nor another's
        owned = donate and model.stateful and mesh is None
        held = HeldState(name, {} if state is None else state, own=owned)
        log, baked = TraceLog(name, max_traces), params_as_constants
        traced = TracedModel(model, treedef, leaves if baked else None, held, log, nums | names)
        trace = traced.stateful if model.stateful else traced.stateless
        if parallel is None:
            options = {"fun": trace, "donate_argnums": (2,) if model.stateful and donate else ()}
        else:  # params and state replicated; a call's new state too
            options, leaves = parallel.jit(trace, model.stateful), parallel.replicate(leaves)
            if model.stateful:
                held.hold(parallel.replicate(held.leaves))
        spans = parallel is not None or _params.checked_each_call(leaves)
        self._set(
            fn=model.inference(name), name=name, max_traces=max_traces, compiled=compiled,
            axis=axis, pad=pad, static_argnums=nums, static_argnames=names, donate=donate,
            params_as_constants=params_as_constants, stateful=model.stateful, kind=model.kind,
            mesh=None if parallel is None else parallel.mesh,
            n_shards=1 if parallel is None else parallel.n_shards,
            __signature__=None if inputs is None else inspect.Signature(inputs),
            _model=model, _given=params, _treedef=treedef, _held=held, _log=log, _statics={},
            _modes=None if model.settings is None else ModuleModes(model), _traced=traced,
            _parallel=parallel, _leaves=() if baked else leaves, _spans=spans,
            _fast=compiled and not nums and not spans, _applied=None if nums or spans else {},
        )  # fmt: skip
        apply = functools.partial(traced.run, entry="apply")  # never donating: the caller's
        self._set(_jitted=self._jit(options.pop("fun"), static_argnums=0, **options),
                  _apply=self._jit(apply, static_argnums=0))  # fmt: skip

    def _jit(self, trace: Callable[..., Any], **options: Any) -> Any:
        """``jax.jit`` of ``trace``, its module named ``jit_<name>_hybrid`` (see ``traced``)."""

        def program(*args: Any, **kwargs: Any) -> Any:
            refuse_shared_cache(self.name)  # traced: XLA compiles (or reads an entry) next
            return trace(*args, **kwargs)

        program.__name__ = program.__qualname__ = f"{self.name}{PROGRAM_SUFFIX}"
        program.__signature__ = "no signature"  # inputs named args[i], kwargs['k'] (and 'args')
        return jax.jit(program, **options)

    def _set(self, **fields: Any) -> None:
        self.__dict__.update(fields)  # (__setattr__ refuses)

    def __setattr__(self, field: str, value: Any) -> None:
        raise AttributeError(_FROZEN.format(name=self.name, field=field))

    @property
    def params(self) -> Any:
        """What gradients are taken of (read-only): a linen model's variables but the mutable
        collections, an nnx module's ``Param`` values, or the params given, as of hybridize
        (refused once the nnx module's Variables changed since: :meth:`refresh`)."""
        return self._read("params")

    @property
    def state(self) -> Any:
        """What calls carry forward, as of the last call (read-only; ``{}`` when stateless): a
        linen model's mutable collections and rng streams, or an nnx module's other variables
        (refused once the nnx module's Variables changed since hybridize: :meth:`refresh`)."""
        return self._read("state")

    @property
    def variables(self) -> Any:
        """What :attr:`fn` takes: ``{"params": ..., "state": ...}`` if stateful, else params."""
        return {"params": self.params, "state": self.state} if self.stateful else self.params

    @property
    def module(self) -> Any:
        """The model: an nnx module rebuilt with the params and current state, a new one at each
        read (refused once the module given was trained in place: :meth:`refresh`), or the
        linen module."""
        if self._model.kind != "nnx":
            return self._model.module
        return self._model.module(self.params, self._held.copy() if self.donate else self.state)

    def replace(self, **changes: Any) -> Hybrid:
        """A new Hybrid with ``changes`` to ``params``, ``state`` or a setting (an attribute);
        it has its own trace log and shares the ``on_trace`` callbacks.

        Example:
          >>> import jax.numpy as jnp
          >>> import symjax_mlp as sm
          >>> h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
          >>> h.replace(params=jnp.float32(3))(jnp.ones(2))
          Array([3., 3.], dtype=float32)
        """
        settings = self._settings()
        if bad := sorted(set(changes) - set(settings)):
            raise ConfigError(
                f"{self.name}.replace({bad[0]}=...): not a setting of a Hybrid; choose from "
                f"{', '.join(sorted(settings))}."
            )
        settings |= changes
        params, state = settings.pop("params"), settings.pop("state")
        if "params" in changes:  # (None: refused, as hybridize(fn, None) is)
            _pure.refuse_new_params(self.name, self.kind, self._read("params", False), params)
        tail = ", or leave state out to keep the held one"
        state = refit(f"{self.name}.replace(state=...)", self._held.tree, state, tail)
        if self.donate and not settings["donate"] and "state" not in changes:
            state = self._held.copy()  # self's next call consumes what it holds
        twin = Hybrid(self._model, params, state=state, **settings)
        twin._log.callbacks = self._log.callbacks
        return twin

    def snapshot(self) -> Hybrid:
        """This Hybrid as it runs now, whatever happens to its model later (what a Batcher
        serves): an nnx module's settings fixed, a donating one's state copied; else ``self``.

        Example:
          >>> import jax.numpy as jnp
          >>> import symjax_mlp as sm
          >>> h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
          >>> h.snapshot() is h
          True
        """
        owned = self.donate and self.stateful  # its next call consumes what self holds
        if self._modes is None and not owned:
            return self
        twin = self.replace(state=self._held.copy()) if owned else self.replace()
        if self._modes is not None:
            twin._set(_modes=self._modes.fixed())
        return twin

    _INSTEAD = (
        "Export it, sm.export(h, path, example=x), and run it anywhere with sm.load(path); "
        "a twin in this process is copy.deepcopy(h) or h.replace()."
    )

    def __deepcopy__(self, memo: dict[int, Any]) -> Hybrid:
        """A twin with its own copies of the params and state, as :meth:`snapshot` fixes it."""
        both = (self._read("params", False), self._held.tree)  # (untied: a copy of each array)
        params, state = jax.tree.map(lambda a: copy.deepcopy(a, memo), both)
        return self.replace(params=params, state=state).snapshot()

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        """Runs the compiled program (or :meth:`eager`, for a ``hybridize(False)`` twin)."""
        static = self._statics.get(keyed(kwargs)) if kwargs else ()  # settings seen: train=False
        if self._fast and static is not None:  # the hot path: arrays in, one dispatch
            for a in args:  # (jit's fast path reads a big-endian array's bytes as native ones)
                if type(a) not in JAX_ARRAYS and not (type(a) is NDARRAY and a.dtype.isnative):
                    break
            else:
                key = static if self._modes is None else self._modes.key(static)
                try:
                    if not self.stateful:
                        return self._jitted(key, self._leaves, *args)
                    return self._call_held(key, args, {})
                except _trace.TRACER_ERRORS as e:
                    raise _trace.control_flow_error(self.name, e) from e
                except _pure.StateAdded as e:
                    return self._stateful(e)(*args, **kwargs)
                except (TypeError, ValueError) as e:  # jit's: an array of str, two devices
                    self._partition(args, kwargs, self.name, failed=True)  # (an array of str)
                    refuse_two_devices(self.name, e)
                    raise
        if not self.compiled:
            return self.eager(*args, **kwargs)
        _args.refuse_abstract(self.name, self.name, args, kwargs)
        with symbolic(self.name):  # the slow path: settings, nnx objects, a mesh
            raw, dyn, dyn_kw = self._partition(args, kwargs, self.name, modes=False)
            static = raw if self._modes is None else self._modes.key(raw)  # (nnx: now's modes)
            variables = given(dyn, dyn_kw, self.name, sharded=self._parallel is not None)
            if self._fast and not (dyn_kw or variables):  # for the hot path
                remember(self._statics, kwargs, raw, every_arg=len(dyn) == len(args))
            if self._parallel is not None:
                held = self._held if self.stateful else None
                return self._parallel.call(self._jitted, static, self._leaves, held, dyn, dyn_kw)
            if self.stateful:
                return self._call_held(static, dyn, dyn_kw, variables)
            try:
                out = self._jitted(static, self._leaves, *dyn, **dyn_kw)
            except _pure.StateAdded as e:
                return self._stateful(e)(*args, **kwargs)
            if variables:
                write_back(variables, out[1], self.name)
            return out[0] if variables else out

    def fn_with_state(self, params: Any, state: Any, /, *args: Any, **kwargs: Any) -> Any:
        """The model's pure function of ``params``, un-jitted (no trace logged): ``(out,
        new_state)`` as :meth:`apply_with_state` gives; stateless, its new_state is ``state``."""
        try:
            return self._model.call(params, state, args, kwargs)
        except (TypeError, KeyError):  # Flax's, reading a state that is no h.state: named so
            caller = f"{self.name}.fn_with_state(params, state, ...)"
            if not (unfit := self.stateful and _pure.unfit_state(caller, self._held.tree, state)):
                raise
        raise unfit

    def _call_held(self, static: Any, dyn: Any, dyn_kw: Any, variables: Any = ()) -> Any:
        """A stateful call: the held state passed, the new one held."""
        args = (static, self._leaves, dyn, dyn_kw)
        out, *new = self._held.call(self._jitted, args, self._traced.changes)
        if variables:
            write_back(variables, new[0], self.name)
        return out

    def eager(self, /, *args: Any, **kwargs: Any) -> Any:
        """Runs the model op by op, its Python and the ``on_trace`` callbacks on every call; a
        stateful model's state is carried as in compiled calls."""
        _args.refuse_abstract(f"{self.name}.eager", self.name, args, kwargs)
        _params.refuse_donated(f"{self.name}.eager", self.params)
        self._log.run_callbacks(args, kwargs)
        with self._held.lock, one_device(f"{self.name}.eager"):  # else JAX's, naming an op
            try:
                out, state = self._traced.call_model(self.params, self.state, args, kwargs)
            except _pure.StateAdded as e:  # (the callbacks ran: the call is made, not run again)
                model = self._stateful(e, traced=False)._traced
                out, state = model.call_model(self.params, {}, args, kwargs)
            except _args.MODEL_ERRORS:  # raised on an input h(...) refuses (a Decimal, a set)
                self._partition(args, kwargs, f"{self.name}.eager")  # refused as h's call does
                raise
            if self.stateful:
                self._held.hold(self._held.flatten(state))
        return out

    def apply(self, params: Any, /, *args: Any, **kwargs: Any) -> Any:
        """The compiled pure function, for ``jax.grad`` and optax: ``h.apply(h.params, x)``.

        Traced as ``entry="apply"`` (counted against ``max_traces``). Returns ``out``, or
        ``(out, new_state)`` from :attr:`state` if stateful; every keyword goes to the model.
        A linen model's ``{'params': p, **state}`` runs as ``model.apply`` does (mutable=, rngs=).

        Example:
          >>> import jax, jax.numpy as jnp
          >>> import symjax_mlp as sm
          >>> h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.float32(2)})
          >>> jax.grad(lambda p: h.apply(p, jnp.ones(3)).sum())(h.params)
          {'w': Array(3., dtype=float32)}
        """
        state = self._apply_state()  # (a donating one's copied: a call may consume it)
        try:
            out, new_state = self._apply_pure(f"{self.name}.apply", params, state, args, kwargs)
        except _pure.StateAdded as e:
            return self._stateful(e).apply(params, *args, **kwargs)
        return (out, new_state) if self.stateful and new_state is not None else out  # (Flax's)

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
        if self._model.given_state(params):  # a state in the params too: refused as fn's is
            self.fn_with_state(params, state, *args, **kwargs)
        return self._apply_pure(caller, params, state, args, kwargs)

    def _stateful(self, added: _pure.StateAdded, traced: bool = True) -> Hybrid:
        """Self, turned stateful in place by an nnx module's call that added variables (as
        ``nnx.jit`` keeps them), its trace log and modes kept; the call made again holds them."""
        with self._held.lock:  # (a call in another thread may have turned it)
            if not self.stateful:
                log, modes = self._log, self._modes
                self.__init__(added.model, **self._settings())  # its state: {}
                self._log.follow(log, traced)
                self._set(_modes=modes)
        return self

    def hybridize(self, active: bool = True) -> Hybrid:
        """A twin compiled if ``active``, else eager; it shares params and callbacks, not traces."""
        return self.replace(compiled=active)

    def shard(self, mesh: Mesh | None = None, *, axis: str = "data", pad: bool = True) -> Hybrid:
        """This Hybrid run data-parallel over ``mesh`` (default: every device) along its
        ``axis``, a batch the shards do not divide padded and trimmed (``pad``) or refused; see
        :func:`~symjax_mlp.shard`."""
        mesh = _mesh.data_mesh(axis=axis) if mesh is None else mesh
        return self.replace(mesh=mesh, axis=axis, pad=pad)

    @property
    def trace_count(self) -> int:
        """How many times the compiled paths (``h(x)``, ``h.apply``) have traced the model."""
        return len(self._log.events)

    @property
    def trace_log(self) -> tuple[TraceEvent, ...]:
        """One :class:`~symjax_mlp.TraceEvent` per trace, oldest first."""
        return self._log.events

    def on_trace(self, callback: Callable[..., Any]) -> Callable[..., Any]:
        """Registers ``callback(*args, **kwargs)``, run once per trace with the traced inputs
        (eagerly: every call); returns it (a decorator). It may read the Hybrid, or call it on
        inputs already traced, from any thread."""
        self._log.add(callback)
        return callback

    def __repr__(self) -> str:
        where = "" if self.mesh is None else f", mesh={dict(self.mesh.shape)}, axis={self.axis!r}"
        mode = "compiled" if self.compiled else "eager"
        state = ", stateful" if self.stateful else ""
        return f"Hybrid({self.name}, {mode}{state}, traces={self.trace_count}{where})"
