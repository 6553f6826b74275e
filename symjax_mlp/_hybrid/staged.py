"""A Hybrid's staged forms, mixed into it: its program lowered and compiled (``h.lower``,
``h.compile``), its model as a :class:`~symjax_mlp.Graph` (``h.graph``), and what staging a
call shows: the module settings that change it, the held state it moves."""

from __future__ import annotations

import functools
from typing import Any

import jax

from symjax_mlp._compat import INTERNALS, clear_dispatch_cache, transformed
from symjax_mlp._errors import ConfigError
from symjax_mlp._hybrid.args import JAX_ARRAYS, NDARRAY, partition
from symjax_mlp._hybrid.graph import Graph
from symjax_mlp._hybrid.params import check_given, flat_params, held, refuse_donated
from symjax_mlp._hybrid.pure.nnx_module import refreshed, write_back
from symjax_mlp._hybrid.settings import keyed, remember
from symjax_mlp._hybrid.trace import MODEL_FIX, symbolic, unbindable
from symjax_mlp._hybrid.traced import given

#: model.apply's keywords h.apply takes as Flax's (capture_intermediates=: Flax's guides')
_APPLY = frozenset(("mutable", "rngs", "capture_intermediates"))
#: what Hybrid.replace() takes besides params and state, as the Hybrid's attributes
_SETTINGS = ("name", "max_traces", "compiled", "mesh", "axis", "pad", "static_argnums",
             "static_argnames", "donate", "params_as_constants")  # fmt: skip

_TRAINED = (
    "{caller}: the nnx module holds other {kind} ({paths}) than the Hybrid was made of: it was "
    "trained in place since sm.hybridize (an nnx.Optimizer's update, model.kernel[...] = ..., "
    "nnx.update, a view's training step), reseeded (nnx.reseed) or operated on (a sub-module "
    "shared, swapped or replaced), and the Hybrid holds them as of sm.hybridize (h(x) runs "
    "those), so {what} the ones before. Take the module as it is now: h = h.refresh() (as "
    "sm.hybridize(model) anew; or h.replace(params=..., state=...) of its nnx.state); for a "
    "Hybrid that keeps them as hybridized whatever the module does, take copy.deepcopy(h) "
    "before you change the module."
)
_NO_MODULE = (
    "{name}.refresh(): the Hybrid is of a {kind} model, whose params it was given; only an nnx "
    "module's Variables (sm.hybridize(model), sm.hybridize(f, model)) are read again. For "
    "new params write h = h.replace(params=...)."
)


def refuse_trained_in_place(
    h: Any, caller: str, what: str, quick: bool = False, state: bool = False
) -> None:
    """Raises a ``ConfigError`` if ``h``'s nnx module's Variables changed since it was
    hybridized: ``what`` (export's artifact, a Batcher) would hold the old ones. ``quick``:
    only the Variables it was split into are compared (``is``), not the module walked;
    ``state``: refused only if its other Variables (not its Params) changed."""
    trained = h.trained_in_place(quick=quick)
    if state:  # its other Variables alone (h.apply is given params)
        trained = [p for p in trained if p.startswith("state")]
    if trained:
        paths = ", ".join(trained[:3]) + (
            f" and {len(trained) - 3} more" if len(trained) > 3 else ""
        )
        kind = "Params" if not any(p.startswith("state") for p in trained) else "Variables"
        raise ConfigError(_TRAINED.format(caller=caller, kind=kind, paths=paths, what=what))


def hot(statics: dict[tuple, Any] | None, args: tuple, kwargs: dict[str, Any], modes: Any):
    """The static entries a call with ``kwargs`` gave (:func:`remember`; none given: ``()``),
    with the nnx module's ``modes`` as they are now, where every input is a JAX array or a
    NumPy one of numbers in this machine's byte order (jit's C++ path reads a big-endian one's
    bytes as native ones, and gives its own error for str, objects or long doubles); else
    ``None``."""
    static = None if statics is None else statics.get(keyed(kwargs)) if kwargs else ()
    if static is None:
        return None
    for a in args:
        if type(a) not in JAX_ARRAYS and not (
            type(a) is NDARRAY
            and a.dtype.isnative
            and a.dtype.kind in "biufc"
            and a.dtype.char not in "gG"  # np.longdouble, np.clongdouble: no JAX dtype
        ):
            return None
    return static if modes is None else modes.key(static)


class Staged:
    """A :class:`~symjax_mlp.Hybrid`'s staged forms (mixed into it): its program lowered and
    compiled, its model as a :class:`Graph`, the module settings that change it, the held
    state it moves."""

    #: whether the params given to ``h.apply`` are walked at every call (:meth:`_apply_pure`),
    #: and how many of its calls C++ did not serve though their program was traced
    _walked, _unserved = False, 0

    def lower(self, /, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Traces and lowers for the inputs: ``.as_text()`` is the StableHLO module (sharded:
        one SPMD module for every device)."""
        return self._lower("lower", args, kwargs)

    def compile(self, /, *args: Any, **kwargs: Any) -> jax.stages.Compiled:
        """Lowers and compiles: ``.as_text()`` is XLA's optimized HLO (``.cost_analysis()``...)."""
        return self._lower("compile", args, kwargs).compile()

    def _lower(self, method: str, args: tuple, kwargs: dict) -> jax.stages.Lowered:
        static, dyn, dyn_kw = self._split(method, args, kwargs)  # refused as h.<method>
        held = (self._held.leaves,) if self.stateful else ()
        jitted = self._jitted
        with symbolic(self.name):
            if self._parallel is not None:
                jitted, dyn, dyn_kw = self._parallel.prepare(jitted, dyn, dyn_kw)
            elif not self.stateful:
                return jitted.lower(static, self._leaves, *dyn, **dyn_kw)
            return jitted.lower(static, self._leaves, *held, dyn, dyn_kw)

    def graph(self, /, *args: Any, **kwargs: Any) -> Graph:
        """Stages the un-jitted model on the inputs into a :class:`~symjax_mlp.Graph`, every
        layer shown (not counted in :attr:`trace_count`)."""
        static, dyn, dyn_kw = self._split("graph", args, kwargs)
        refuse_trained_in_place(self, f"{self.name}.graph", "the graph would show")
        params, state = self._read("params", checked=False), self._held.tree
        try:
            return self._traced.graph(static, params, state, dyn, dyn_kw)
        except OverflowError as e:  # a baked Python int past JAX's (2**70): graph traces params
            overflow = e
        flat_params(f"{self.name}.graph", params, passed=True)  # refused by its path
        raise overflow

    def _partition(
        self, args: Any, kwargs: Any, caller: str, failed: bool = False, params: Any = None,
        staging: bool = False, modes: bool = True,
    ) -> tuple:  # fmt: skip
        """The call's static key (with the module's settings unless not ``modes``), traced
        args, kwargs; the params it runs (``params``, else the held ones) refused first if a
        donating jit deleted them (or, unless ``staging``, they are abstract), where a call of
        them crashes (several devices), or once a call ``failed``."""
        if failed or self._spans:
            given = self._read("params", checked=False) if params is None else params
            refuse_donated(caller, given, staging=staging)
        # model.apply's own mutable= and rngs=, in h.apply of linen variables holding state
        flax = not _APPLY.isdisjoint(kwargs) and self._model.given_state(params, True) is not None
        rest = {k: v for k, v in kwargs.items() if k not in _APPLY} if flax else kwargs
        self._model.refuse_keywords(caller, rest)  # linen's h(x, method=...)
        if flax:  # (mutable= a list, as Flax's guides pass it: a tuple, static)
            mutable = kwargs.get("mutable", False)
            mutable = tuple(mutable) if isinstance(mutable, list) else mutable
            capture = kwargs.get("capture_intermediates", False)
            kwargs = {**rest, "mutable": mutable, "rngs": kwargs.get("rngs"),
                      "capture_intermediates": capture}  # fmt: skip
        nums, names, own = self.static_argnums, self.static_argnames, (self, self._model.source)
        if flax:  # its filter, a function of (module, method name), keyed on as jax.jit's static
            names = names | {"capture_intermediates"}
        static, dyn, dyn_kw = partition(args, kwargs, nums, names, caller=caller, own=own)
        if not modes or self._modes is None:
            return static, dyn, dyn_kw
        return self._modes.key(static), dyn, dyn_kw

    def _apply_pure(self, caller: str, params: Any, state: Any, args: tuple, kwargs: dict):
        """``(out, new_state)`` of :meth:`apply`'s compiled pure function, the nnx objects given
        written back. For settings an earlier call gave (bools, strs, None) and arrays alone,
        its static entries are reused (:func:`hot`), and the params walked (:func:`check_given`)
        only where jit's C++ dispatch does not serve the call (it then makes an entry for it):
        at every call once an entry took a NumPy array among them (it would take a big-endian
        one's bytes as native ones; an entry of JAX arrays never serves a NumPy one), or once
        C++ did not serve twice a program it had traced, outside any JAX transformation (one with
        effects, ``jax.debug.print``; NumPy inputs; shapes taking turns)."""
        static = hot(self._applied, args, kwargs, self._modes)
        tried = static is not None and not (self._walked or jax.config.jax_disable_jit)
        tried = tried and INTERNALS["dispatch_cache"]  # (else a call given up: Python's for good)
        if tried:
            try:
                with jax.no_tracing(True):  # raised before the call runs, where C++ cannot serve
                    out, new_state = self._apply_run(static, params, state, args, {})
                return out, new_state
            except Exception as e:  # not run (no_tracing's RuntimeError, JAX's walk): walked
                if isinstance(e, jax.errors.JaxRuntimeError):  # run: XLA's, the model's
                    raise
                clear_dispatch_cache(self._apply)  # a signature given up: jaxlib's Python path
        if static is None:
            static, dyn, dyn_kw, variables = self._apply_split(caller, params, args, kwargs)
        else:
            dyn, dyn_kw, variables = args, {}, []
            leaves, traces = check_given(caller, params), len(self._log.events)
            if leaves == "numpy":
                self._set(_walked=True)  # (jit's C++ path: a big-endian array's [0., 0.])
        out, new_state, *new = self._apply_run(static, params, state, dyn, dyn_kw)
        if tried and leaves == "jax" and len(self._log.events) == traces and not transformed():
            unserved = self._unserved + 1  # (one: a call after an entry dropped)
            self._set(_unserved=unserved, _walked=unserved > 1)  # C++ does not serve: walked
        if variables:
            write_back(variables, new[0], caller)
        return out, new_state

    def _apply_run(self, *call: Any) -> Any:
        try:
            return self._apply(*call)
        except Exception:  # named as in any call (no context manager on the path that succeeds)
            with symbolic(self.name):
                raise

    def _apply_split(self, caller: str, params: Any, args: tuple, kwargs: dict) -> tuple:
        """:meth:`apply`'s partition and the nnx objects given, the params checked; the static
        entries kept for calls with the same settings and arrays alone."""
        raw, dyn, dyn_kw = self._partition(args, kwargs, caller, params=params, modes=False)
        static = raw if self._modes is None else self._modes.key(raw)
        variables = given(dyn, dyn_kw, caller)
        if check_given(caller, params) == "numpy":
            self._set(_walked=True)
        if not (variables or dyn_kw) and _APPLY.isdisjoint(kwargs):
            remember(self._applied, kwargs, raw, every_arg=len(dyn) == len(args))
        return static, dyn, dyn_kw, variables

    def _split(self, method: str, args: tuple, kwargs: dict) -> tuple:
        """The call's partition; arguments the model does not take named, with ``h.method``."""
        split = self._partition(args, kwargs, self.name, staging=True)  # (inputs refused first)
        fix = MODEL_FIX.replace("h(", f"h.{method}(")  # (a trace would name h(...))
        if unbound := unbindable(f"{self.name}.{method}", self, args, kwargs, skip=0, fix=fix):
            raise unbound
        return split

    def moved_state(self, /, *args: Any, **kwargs: Any) -> list[str]:
        """The held state a call on these inputs moves, as ``state['path']``: what it computes
        from them (BatchNorm's statistics), or draws its output from (Dropout's rng key)."""
        static, dyn, dyn_kw = self._split("moved_state", args, kwargs)
        return self._traced.moved(static, self._leaves, dyn, dyn_kw) if self.stateful else []

    def _apply_state(self) -> Any:
        """The held state :meth:`apply` runs from, refused as :attr:`state` is once the nnx
        module's other Variables changed in place (its Params alone: ``apply`` is given some)."""
        if self.stateful and self.trained_in_place(quick="state"):
            what = "h.apply(params, ...) would run from the held state: its Variables are"
            refuse_trained_in_place(self, f"{self.name}.apply", what, state=True)
        return self._held.copy() if self.donate else self._held.tree

    def trained_in_place(self, quick: bool | str = False) -> list[str]:
        """The Params an nnx module holds now in place of those it was hybridized with (trained
        in place since: an nnx.Optimizer's update, a view's), as ``"['w1']"``, then its other
        Variables changed since (``nnx.reseed``'s keys, a BatchNorm's statistics; not an rng
        count, which a draw moves), as ``"state['bn']['mean']"``; none once other params were
        given (``h.replace(params=...)``), and for other models. ``quick``: the module walked
        only if a Variable it was split into holds another value (a sub-module swapped in, then
        unseen); ``"state"``: only if one of its other Variables does (``["?"]``, not walked)."""
        if self._model.trained is None:
            return []
        mesh = self.mesh is not None  # the params given: a mesh's leaves are their replicas
        leaves = self._leaves if self._leaves and not mesh else jax.tree.leaves(self._given)
        if quick and not self._model.trained(leaves, quick):  # (baked: no leaves held)
            return []
        if quick == "state":
            return ["?"]
        return self._model.trained(self._given if mesh else self._read("params", checked=False))

    def _read(self, what: str, checked: bool = True) -> Any:
        """:attr:`params` or :attr:`state` (``what``), refused first if ``checked`` and the nnx
        module's Variables changed since hybridize (a quick check: no walk of the module)."""
        if checked:
            refuse_trained_in_place(self, f"{self.name}.{what}", f"h.{what} would be", True)
        if what == "state":
            return self._held.view()
        baked = self._traced.constants or ()  # (what the program holds: a write is not in it)
        return held(self._given, self._treedef, self._leaves or baked, mesh=self.mesh)

    def _settings(self) -> dict[str, Any]:
        """What :meth:`replace` takes, as it is now: the params, state and settings."""
        settings = {"params": self._read("params", False), "state": self._held.tree}
        settings |= {k: getattr(self, k) for k in _SETTINGS}
        return settings | {k: tuple(settings[k]) for k in ("static_argnums", "static_argnames")}

    def refresh(self) -> Any:
        """A new Hybrid of the nnx module as it is now: its Params and other Variables read
        again (after the module was trained in place, ``nnx.Optimizer``'s update, or reseeded,
        ``nnx.reseed``), this one's settings and ``on_trace`` callbacks kept; as
        ``sm.hybridize(model)`` anew. A Hybrid holds the Variables as of ``sm.hybridize``:
        ``h(x)`` runs those, and export, a Batcher, :attr:`params` and :attr:`state` refuse
        them once the module's changed (``apply``, which is given params: once its state has).

        Raises:
          ConfigError: the model is no nnx module (its params were given: ``h.replace``).

        Example:
          >>> import jax.numpy as jnp, optax
          >>> import symjax_mlp as sm
          >>> from flax import nnx
          >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
          >>> h = sm.hybridize(model)
          >>> model.kernel[...] = jnp.zeros((2, 1))  # trained in place
          >>> h.refresh()(jnp.ones((1, 2))) == model(jnp.ones((1, 2)))
          Array([[ True]], dtype=bool)
        """
        if self._model.trained is None:
            raise ConfigError(_NO_MODULE.format(name=self.name, kind=self.kind))
        model, params, state = refreshed(self._model)
        settings = self._settings()
        del settings["params"], settings["state"]
        twin = type(self)(model, params, state=state, **settings)
        twin._log.callbacks = self._log.callbacks
        return twin

    def training_mode(self, /, *args: Any, **kwargs: Any) -> tuple[str, ...]:
        """An nnx module's settings that ``module.eval()`` would flip and that change the
        program on these inputs, as ``"path=value"``; ``()`` in eval mode or for other models."""
        if self._modes is None:
            return ()
        static, dyn, dyn_kw = self._split("training_mode", args, kwargs)
        staged = functools.partial(self._traced.staged, static, self._leaves, self._held.tree, dyn)
        with symbolic(self.name):
            return self._modes.training(lambda v: str(staged(dyn_kw, 0, v)))
