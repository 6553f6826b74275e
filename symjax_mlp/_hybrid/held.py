"""The state a Hybrid holds between calls: flat, as its compiled program takes and returns it
(rng keys as raw ``key_data``), the tree rebuilt only when read."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer

from symjax_mlp._compat import transformed
from symjax_mlp._errors import ConfigError, ControlFlowError
from symjax_mlp._hybrid.pure import state_structure, unwrap_keys, wrap_keys

_STATE_UNDER_TRANSFORM = (
    "{name}: a stateful Hybrid was called inside a JAX transformation (jax.jit, jax.grad, "
    "jax.vmap, ...) in a way that changes its state (training mode: batch statistics, an rng "
    "stream drawn; a linen model's rngs=, which every call splits), where the new state would "
    "be a tracer. Call it in eval mode there, which keeps the state (a linen model hybridized "
    "without rngs=), or use the pure form: out, state = h.apply(h.params, x) returns the new "
    "state instead of holding it."
)
_STATE_STRUCTURE = (
    "{name}: a call changed the structure of the model's state, from {before} to {after}; a "
    "call may change the held arrays' values, not add, remove or retype them (a variable made "
    "in __call__, a sow). Create every variable when the model is built, or use the pure form, "
    "out, state = h.apply(h.params, x), which returns whatever state the call makes."
)


class TraceFirst(Exception):
    """Raised by a trace begun under the lock (:meth:`HeldState.call` then traces unlocked)."""


class HeldState:
    """A Hybrid's flat state as of the last call (``leaves``), and the ``lock`` held around a
    call that moves it; ``own``: held in buffers of its own (a donating Hybrid's)."""

    def __init__(self, name: str, state: Any, *, own: bool = False) -> None:
        self.name = name
        self._structure, self._key_impls = state_structure(state)
        leaves = unwrap_keys(jax.tree.leaves(state), self._key_impls)
        self.leaves = _copies(leaves) if own else leaves
        self._tree = None if own else state  # rebuilt on the first read after a call
        self.lock = threading.RLock()
        self._locked = threading.local()  # .call: this thread's call holds the lock
        self._gates: dict[Any, threading.RLock] = {}  # .call: a lock per signature traced

    @property
    def tree(self) -> Any:
        """The state as a tree, as of the last call."""
        tree = self._tree
        if tree is None:
            # not between a call and its hold(); arrays, even when read while tracing
            with self.lock, jax.ensure_compile_time_eval():
                tree = self._tree = self.unflatten(self.leaves)
        return tree

    def unflatten(self, leaves: list[Any]) -> Any:
        """A tree of the held structure from flat ``leaves`` (raw key data wrapped)."""
        return jax.tree.unflatten(self._structure, wrap_keys(leaves, self._key_impls))

    def flatten(self, state: Any) -> list[Any]:
        """A call's new state as held (keys as raw data), checked to keep the structure."""
        structure, key_impls = state_structure(state)
        if structure != self._structure or key_impls != self._key_impls:
            raise ConfigError(
                _STATE_STRUCTURE.format(name=self.name, before=self._structure, after=structure)
            )
        return unwrap_keys(jax.tree.leaves(state), key_impls)

    def copy(self) -> Any:
        """:attr:`tree` in new buffers, which no donating call consumes."""
        with self.lock, jax.ensure_compile_time_eval():
            return self.unflatten(_copies(self.leaves))

    def call(self, jitted: Any, args: tuple, keeps: Callable[..., bool] | None = None) -> list[Any]:
        """``jitted(static, leaves, held, dyn, dyn_kw)`` (``args`` lacking ``held``) from the
        held state, its new one held (``[out, *rest]``), calls one at a time. A call that traces
        is traced first unlocked (``jitted.trace``, which the call then reuses): ``on_trace``
        callbacks may read or call the Hybrid, from any thread. Under a JAX transform, a call
        whose new state is a tracer is refused, unless ``keeps(*args)`` (it keeps the state)."""
        try:
            return self._step(jitted, args, keeps, first=True)
        except TraceFirst:
            pass  # traced below, not while handling it (an error there would chain it)
        static, leaves, dyn, dyn_kw = args
        flat, tree = jax.tree.flatten((dyn, dyn_kw))
        with self.lock:  # threads tracing one signature trace it once, one waiting for the other
            gate = self._gates.setdefault((static, tree, *map(jax.typeof, flat)), threading.RLock())
        with gate:
            jitted.trace(static, leaves, self.leaves, dyn, dyn_kw)
        return self._step(jitted, args, keeps, first=False)

    def _step(self, jitted: Any, args: tuple, keeps: Any, first: bool) -> list[Any]:
        """One locked call; ``first``: a trace it begins raises :class:`TraceFirst`."""
        with self.lock:
            was, self._locked.on = getattr(self._locked, "on", False), first
            try:
                out, held, *rest = jitted(*args[:2], self.leaves, *args[2:])
            finally:
                self._locked.on = was
            # the new state is concrete unless under a transform; there it may be traced (under
            # jax.grad a leaf with no tangent, a counter, comes back concrete: any leaf)
            if transformed() is not False and any(isinstance(leaf, Tracer) for leaf in held):
                if keeps is None or not keeps(*args):
                    raise ControlFlowError(_STATE_UNDER_TRANSFORM.format(name=self.name))
            else:
                self.leaves, self._tree = held, None
        return [out, *rest]

    def tracing(self) -> None:
        """Called as a trace begins: :class:`TraceFirst` if under :meth:`call`'s lock."""
        if getattr(self._locked, "on", False):
            raise TraceFirst

    def hold(self, leaves: list[Any]) -> None:
        """Holds a call's new flat state (under :attr:`lock`); a traced one is refused."""
        if any(isinstance(leaf, Tracer) for leaf in leaves):
            raise ControlFlowError(_STATE_UNDER_TRANSFORM.format(name=self.name))
        self.leaves = leaves
        self._tree = None


def _copies(leaves: list[Any]) -> list[Any]:
    return [jnp.array(leaf, copy=True) for leaf in leaves]
