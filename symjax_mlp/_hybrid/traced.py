"""What a Hybrid's ``jax.jit`` traces: the model on a partitioned call ``(static, leaves,
...)``, every trace logged, and the state it holds between calls (flat, rng keys as raw
``key_data``); nnx objects given come back mutated, as eager nnx leaves them. Programs named
``jit_<name>_hybrid`` lower their CPU ``threefry2x32`` unrolled (``_compat``)."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from symjax_mlp._compat import clear_dispatch_cache, install_unrolled_threefry, transformed
from symjax_mlp._errors import (
    ConfigError,
    ControlFlowError,
    SignatureError,
    SymjaxError,
    unbound_axis,
    unbound_axis_error,
)
from symjax_mlp._hybrid.args import ARRAYS, ModuleSetting, not_data, rebuild
from symjax_mlp._hybrid.effects import outer_handlers
from symjax_mlp._hybrid.graph import Graph
from symjax_mlp._hybrid.jaxpr import forwarded, input_dependent
from symjax_mlp._hybrid.numbers import warn_growing, warn_numbers
from symjax_mlp._hybrid.params import overflowing
from symjax_mlp._hybrid.pure import (
    PureModel,
    is_key,
    refit,
    refuse_nested_nnx_state,
    state_structure,
    unfit_params,
    unwrap_keys,
    wrap_keys,
)
from symjax_mlp._hybrid.pure.nnx_module import outer_write
from symjax_mlp._hybrid.trace import TraceLog, symbolic

PROGRAM_SUFFIX = "_hybrid"
_TWICE = (
    "{caller}: the same nnx Variable ({kind}) is reached more than once among the inputs "
    "(passed twice, or inside two objects); a compiled call would mutate copies apart and keep "
    "one. Pass it once."
)
_SHARDED = (
    "{caller}: an nnx object (an Rngs, a Variable or a module) among the inputs of a sharded "
    "Hybrid, which splits every input by rows. Call it without the mesh "
    "(h.replace(mesh=None)), or keep the object in the model."
)
install_unrolled_threefry(PROGRAM_SUFFIX)
_STATE_UNDER_TRANSFORM = (
    "{name}: a stateful Hybrid was called inside a JAX transformation (jax.jit, jax.grad, "
    "jax.vmap, ...) in a way that changes its state{changed}, where the new state would be a "
    "tracer (training mode: batch statistics, an rng stream drawn; a linen model's rngs=, which "
    "every call splits; a count). Call it in eval mode there where that keeps the state (a linen "
    "model hybridized without rngs=), or use the pure form: out, state = h.apply(h.params, x) "
    "returns the new state instead of holding it."
)
_STATE_STRUCTURE = (
    "{name}: a call changed the structure of the model's state, from {before} to {after}; a "
    "call may change the held arrays' values, not {what} (a variable made in __call__, a sow). "
    "Create every variable when the model is built, or use the pure form, out, state = "
    "h.apply(h.params, x), which returns whatever state the call makes."
)
#: what a call may not do to the held state, by whether the model's calls may add to it
_MAY_NOT = {False: "add, remove or retype them", True: "remove or retype them (add: as nnx.jit)"}


class TraceFirst(Exception):
    """Raised by a trace begun under the lock (:meth:`HeldState.call` then traces unlocked)."""


_Locked = type("_Locked", (threading.local,), {"on": False})  # on: a trace under call's lock


class HeldState:
    """A Hybrid's flat state as of the last call (``leaves``), and the ``lock`` held around a
    call that moves it; ``own``: held in buffers of its own (a donating Hybrid's)."""

    def __init__(self, name: str, state: Any, *, own: bool = False) -> None:
        self.name = name
        #: whether a call may add to the state, as ``nnx.jit`` keeps the variables a call adds
        #: (an nnx module's; set by :class:`TracedModel`), and the structures calls grew it to
        self.grows, self._grown = False, {}
        self._structure, self._key_impls = state_structure(state)
        leaves = unwrap_keys(jax.tree.leaves(state), self._key_impls)
        self.leaves = _copies(leaves) if own else leaves
        self._tree = None if own else state  # rebuilt on the first read after a call
        self.lock, self._locked = threading.RLock(), _Locked()
        self._gates: dict[Any, threading.RLock] = {}  # a lock per signature traced

    @property
    def tree(self) -> Any:
        """The state as a tree, as of the last call."""
        tree = self._tree
        if tree is None:  # arrays, even when read while tracing
            with self.lock, jax.ensure_compile_time_eval():
                tree = self._tree = self.unflatten(self.leaves)
        return tree

    def view(self) -> Any:
        """A new tree of the held leaves (``h.state``): a write into it reaches nothing held."""
        with self.lock, jax.ensure_compile_time_eval():
            return self.unflatten(self.leaves)

    def unflatten(self, leaves: list[Any]) -> Any:
        """A tree of the held structure from flat ``leaves`` (raw key data wrapped)."""
        return jax.tree.unflatten(self._structure, wrap_keys(leaves, self._key_impls))

    def flatten(self, state: Any) -> list[Any]:
        """A call's new state as held (keys as raw data), its structure checked (:meth:`_grow`)."""
        structure, key_impls = state_structure(state)
        if structure != self._structure or key_impls != self._key_impls:
            self._grow(structure, key_impls)
        return unwrap_keys(jax.tree.leaves(state), key_impls)

    def _grow(self, structure: Any, key_impls: tuple) -> None:
        """Records the structure a call grew the state to; refused unless it only added to it."""
        before, after = (self._structure, self._key_impls), (structure, key_impls)
        at = (*before, structure.num_leaves)
        if self.grows and _adds(before, after) and self._grown.setdefault(at, after) == after:
            return
        raise ConfigError(
            _STATE_STRUCTURE.format(
                name=self.name, before=self._structure, after=structure, what=_MAY_NOT[self.grows]
            )
        )

    def copy(self) -> Any:
        """:attr:`tree` in new buffers, which no donating call consumes."""
        with self.lock, jax.ensure_compile_time_eval():
            return self.unflatten(_copies(self.leaves))

    def call(self, jitted: Any, args: tuple, changes: Callable[..., list] | None = None) -> list:
        """``[out, *rest]`` of ``jitted(static, leaves, held, dyn, dyn_kw)``, the new state held,
        calls one at a time (a trace first unlocked). Under a JAX transform, a call whose new
        state is a tracer is refused, unless ``changes(*args)`` (the paths it changes) is empty."""
        try:
            return self._step(jitted, args, changes, first=True)
        except TraceFirst:
            pass  # traced below, not while handling it (an error there would chain it)
        static, leaves, dyn, dyn_kw = args
        flat, tree = jax.tree.flatten((dyn, dyn_kw))
        with self.lock:  # threads tracing one signature trace it once, one waiting for the other
            gate = self._gates.setdefault((static, tree, *map(jax.typeof, flat)), threading.RLock())
        with gate:
            jitted.trace(static, leaves, self.leaves, dyn, dyn_kw)
        clear_dispatch_cache(jitted)  # (the call given up left its signature on Python's path)
        return self._step(jitted, args, changes, first=False)

    def _step(self, jitted: Any, args: tuple, changes: Any, first: bool) -> list[Any]:
        """One locked call; ``first``: a trace it begins raises :class:`TraceFirst`."""
        static, leaves, dyn, dyn_kw = args
        with self.lock:
            locked = self._locked
            was, locked.on = locked.on, first
            try:
                out, held, *rest = jitted(static, leaves, self.leaves, dyn, dyn_kw)
            finally:
                locked.on = was
            # concrete unless under a transform (there any leaf may be traced)
            if transformed() is not False and any(isinstance(leaf, Tracer) for leaf in held):
                if (changed := None if changes is None else changes(*args)) != []:
                    raise ControlFlowError(self._under_transform(changed))
            else:
                self._adopt(held)
        return [out, *rest]

    def tracing(self) -> None:
        """Called as a trace begins: :class:`TraceFirst` if under :meth:`call`'s lock."""
        if self._locked.on:
            raise TraceFirst

    def hold(self, leaves: list[Any]) -> None:
        """Holds a call's new flat state (under :attr:`lock`); a traced one is refused."""
        if any(isinstance(leaf, Tracer) for leaf in leaves):
            raise ControlFlowError(self._under_transform())
        self._adopt(leaves)

    def _under_transform(self, changed: list[str] | None = None) -> str:
        listed = f" ({', '.join(changed[:5])})" if changed else ""
        return _STATE_UNDER_TRANSFORM.format(name=self.name, changed=listed)

    def _adopt(self, leaves: list[Any]) -> None:
        """Holds ``leaves``; more than held: in the structure :meth:`flatten` recorded."""
        if len(leaves) != len(self.leaves):
            at = (self._structure, self._key_impls, len(leaves))
            self._structure, self._key_impls = self._grown[at]
        self.leaves, self._tree = leaves, None


def _adds(before: tuple, after: tuple) -> bool:
    """Whether ``after`` (a treedef, its key impls) keeps each leaf of ``before`` and adds some."""
    held, new = (dict(zip(_paths(s), impls, strict=True)) for s, impls in (before, after))
    return len(new) > len(held) and all(new.get(p, ()) == i for p, i in held.items())


def _paths(structure: Any) -> list[str]:
    tree = jax.tree.unflatten(structure, [0] * structure.num_leaves)
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _copies(leaves: list[Any]) -> list[Any]:
    return [jnp.array(leaf, copy=True) for leaf in leaves]


@dataclasses.dataclass(frozen=True, eq=False)
class TracedModel:
    """A Hybrid's model as its compiled paths trace it; ``constants``: the flat params a
    baked program closes over (XLA constants), or ``None``."""

    model: PureModel
    treedef: Any
    constants: list[Any] | None
    held: HeldState
    log: TraceLog
    deliberate: frozenset = frozenset()  # static_argnums and static_argnames: never warned of
    warned: threading.Event = dataclasses.field(default_factory=threading.Event)  # numbers'

    def __post_init__(self) -> None:
        self.held.grows = self.model.kind == "nnx"  # nnx.jit keeps what a call adds

    def call(
        self, static: Any, params: Any, state: Any, dyn: Any, dyn_kw: Any, settings=None,
        pure: Callable[..., tuple[Any, Any]] | None = None,
    ) -> tuple[Any, Any]:  # fmt: skip
        """``(out, new_state)``, with the module settings the static key holds (or these)."""
        if settings is None:
            settings = tuple(v for k, v, _ in static if type(k) is ModuleSetting)
        with self.model.pinned(settings), symbolic(self.log.name):
            result = self.call_model(params, state, *rebuild(static, dyn, dyn_kw), pure)
        returned(result[0], self.log.name)
        return result

    def call_model(
        self, params: Any, state: Any, args: tuple, kwargs: dict, pure: Any = None
    ) -> tuple[Any, Any]:
        """The model's ``call`` (or ``pure``); an input no array, or an axis name no transform
        binds, refused."""
        try:
            return (pure or self.model.call)(params, state, args, kwargs)
        except Exception as e:  # an input no array (h("abc") was Flax's error), an unbound axis
            axis, name = unbound_axis(e), self.log.name
            error = (
                unbound_axis_error(self.model, name, axis, state, args, kwargs) if axis else None
            )
            error = error or not_data(name, e, args, kwargs) or overflowing(name, params, e)
            if error is None:  # (overflowing: a baked int, 2**70, was JAX's raw OverflowError)
                raise
            raise error from None

    def staged(
        self, static: Any, leaves: Any, state: Any, dyn: Any, dyn_kw: Any, part: int,
        settings: tuple | None = None, shape: bool = False,
    ) -> Any:  # fmt: skip
        """The jaxpr of the output (``part`` 0) or new state (1), on the state, then the inputs
        (and, with ``shape``, that part's shapes: the same trace's)."""
        params = self.params(leaves)

        def staged(state: Any, dyn: Any, dyn_kw: Any) -> Any:
            return self.call(static, params, state, dyn, dyn_kw, settings)[part]

        closed, shapes = jax.make_jaxpr(staged, return_shape=True)(state, dyn, dyn_kw)
        return (closed.jaxpr, shapes) if shape else closed.jaxpr

    def moved(self, *call: Any) -> list[str]:
        """``state['path']`` of each held leaf a call computes from its inputs (BatchNorm's
        statistics) or whose rng key its output draws on (Dropout); not what the call adds (a
        sow): a new state's leaves, named by its own paths."""
        state, n = self.held.tree, len(self.held.leaves)
        new, grown = self.staged(*call[:2], state, *call[2:], 1, shape=True)
        rows, keys = input_dependent(new, new.invars[n:]), list(map(is_key, jax.tree.leaves(state)))
        draws = False  # whether its output draws on a held rng key
        if any(keys):
            out = self.staged(*call[:2], state, *call[2:], 0)  # its inputs: the state's, then ours
            drawn = [v for v, k in zip(out.invars, keys, strict=False) if k]
            draws = any(input_dependent(out, drawn))
        held = dict(zip(_paths(jax.tree.structure(state)), keys, strict=True))
        paths = zip(_paths(jax.tree.structure(grown)), rows, strict=True)
        return [f"state{p}" for p, r in paths if p in held and (r or (draws and held[p]))]

    def changes(self, *call: Any) -> list[str]:
        """The held state's leaves a call changes, ``state['count']`` (none in eval mode)."""
        jaxpr = self.staged(*call[:2], self.held.tree, *call[2:], 1)
        paths = [f"state{p}" for p in _paths(jax.tree.structure(self.held.tree))]
        if len(jaxpr.outvars) != len(paths):
            return ["a variable added"]
        return [p for i, (p, k) in enumerate(zip(paths, forwarded(jaxpr), strict=True)) if k != i]

    def params(self, leaves: list[Any]) -> Any:
        """``leaves``, or the constants a baked program closes over, as the params tree."""
        return jax.tree.unflatten(self.treedef, self.constants or leaves)

    def run(self, static: Any, leaves: Any, state: Any, dyn: Any, dyn_kw: Any, entry: str):
        """One logged trace: ``(out, new_state)`` (and the given nnx Variables' values)."""
        if entry == "apply":  # once per trace: the params (and state) h.apply was given
            refuse_nested_nnx_state(f"{self.log.name}.apply(params, ...)", leaves)
            if self.model.stateful:  # (h.apply's own state is the held one)
                caller = f"{self.log.name}.apply_with_state(params, state, ...)"
                refit(caller, self.held.tree, state)
        params = leaves if entry == "apply" else self.params(leaves)
        given = variables_in((dyn, dyn_kw))  # copies of the caller's nnx Variables
        held = [f"state{p}" for p in _paths(jax.tree.structure(state))]
        # h.apply of variables holding state (linen's): model.apply's call, (result, None)
        keywords = any(k == "mutable" for k, *_ in static)  # (placed there by _partition)
        pure = self.model.given_state(params, keywords) if entry == "apply" else None
        try:
            with self.log.tracing(static, dyn, dyn_kw, entry, held) as event:
                if event is not None:  # None: jax.disable_jit()'s run, not a trace
                    if not self.warned.is_set() and warn_numbers(
                        self.log, self.deliberate, static, event
                    ):
                        self.warned.set()  # once per Hybrid
                    warn_growing(self.log, event)  # once per run of traces grown alone
                with outer_handlers(self.log.name):  # NumPyro's, entered outside the Hybrid
                    result = self.call(static, params, state, dyn, dyn_kw, pure=pure)
        except (LookupError, TypeError, AttributeError, ValueError) as e:  # the model's own
            caller = f"{self.log.name}.apply(params, ...)"  # (h.apply(None, x): p["w"] of None)
            if entry != "apply" or isinstance(e, SymjaxError):
                raise
            if (unfit := unfit_params(caller, self.treedef, params, e)) is None:
                raise
            raise unfit from e
        except Exception as e:  # flax's: a closed-over module's Variable written (cached_partial)
            if (outer := outer_write(self.log.name, e)) is None:
                raise
            raise outer from None
        return (*result, [v.get_value() for v in given]) if given else result

    def stateless(self, static: Any, leaves: list[Any], /, *dyn: Any, **dyn_kw: Any) -> Any:
        """``h(x)`` of a stateless model: ``out`` (and the given nnx Variables' values)."""
        out, _, *given = self.run(static, leaves, self.held.tree, dyn, dyn_kw, "call")
        return (out, *given) if given else out

    def stateful(
        self, static: Any, leaves: list[Any], held: list[Any], dyn: Any, dyn_kw: Any
    ) -> Any:
        """``h(x)`` of a stateful model: ``out``, the new flat state (and given values)."""
        self.held.tracing()  # traced unlocked, callbacks run unlocked
        state = self.held.unflatten(held)
        out, new_state, *given = self.run(static, leaves, state, dyn, dyn_kw, "call")
        return out, self.held.flatten(new_state), *given

    def graph(self, static: Any, params: Any, state: Any, dyn: Any, dyn_kw: Any) -> Graph:
        """The un-jitted model staged on a partitioned call (not logged)."""
        name = self.log.name

        def staged(params: Any, dyn: Any, dyn_kw: Any) -> Any:
            return self.call(static, params, state, dyn, dyn_kw)[0]

        staged.__name__, staged.__qualname__ = name, f"{name}{PROGRAM_SUFFIX}"  # errors: ours
        return Graph.traced(staged, name, params, dyn, dyn_kw)  # params: any pytree, a list too


_RETURNED = (
    "{name}: the model returned a value of type {kind} at out{path}, which a compiled call "
    "cannot return (XLA gives back arrays; Python numbers come back as arrays). Return arrays "
    "(in tuples, dicts or registered pytrees: jax.tree_util.register_dataclass), and keep a "
    "Python value (a label, a str) outside the model."
)
_OUT_LEAVES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def returned(out: Any, name: str) -> None:
    """Refuses a leaf of ``out`` that a compiled call cannot return (checked per trace)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not isinstance(leaf, _OUT_LEAVES):
            path = jax.tree_util.keystr(path)
            raise ConfigError(_RETURNED.format(name=name, kind=type(leaf).__name__, path=path))


def variables_in(tree: Any) -> list[Any]:
    """The nnx ``Variable`` s in ``tree``, in flattening order."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:  # no nnx object can exist
        return []
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [v for v in leaves if isinstance(v, nnx.Variable)]


def given(dyn: Any, dyn_kw: Any, caller: str, sharded: bool = False) -> list[Any]:
    """The caller's Variables among a call's traced inputs; refused twice, or if sharded."""
    if all(type(a) in ARRAYS for a in (*dyn, *dyn_kw.values())):  # the usual call: no walk
        return []
    found = variables_in((dyn, dyn_kw))
    if found and sharded:
        raise ConfigError(_SHARDED.format(caller=caller))
    if len({id(v) for v in found}) != len(found):
        twice = next(v for i, v in enumerate(found) if any(v is w for w in found[:i]))
        raise SignatureError(_TWICE.format(caller=caller, kind=type(twice).__name__))
    return found
