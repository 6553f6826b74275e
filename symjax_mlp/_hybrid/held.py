"""The state a Hybrid holds between calls: flat, as its compiled program takes and returns it
(rng keys as raw ``key_data``), the tree rebuilt only when read."""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp

from symjax_mlp._errors import ConfigError, ControlFlowError
from symjax_mlp._hybrid.pure import state_structure, unwrap_keys, wrap_keys

_STATE_UNDER_TRANSFORM = (
    "{name}: a stateful Hybrid was called inside a JAX transformation (jax.jit, jax.grad, "
    "jax.vmap, ...), where its new state would be a tracer. Use the pure form there: "
    "out, state = h.apply(h.params, x) returns the new state instead of holding it."
)
_STATE_STRUCTURE = (
    "{name}: a call changed the structure of the model's state, from {before} to {after}; a "
    "call may change the held arrays' values, not add, remove or retype them (a variable made "
    "in __call__, a sow). Create every variable when the model is built, or use the pure form, "
    "out, state = h.apply(h.params, x), which returns whatever state the call makes."
)


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

    @property
    def tree(self) -> Any:
        """The state as a tree, as of the last call."""
        tree = self._tree
        if tree is None:
            with self.lock:  # not between a call and its hold()
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
        with self.lock:
            raw = _copies(self.leaves)
        return self.unflatten(raw)

    def hold(self, leaves: list[Any]) -> None:
        """Holds a call's new flat state (under :attr:`lock`); a traced one is refused."""
        # any: under jax.grad a leaf with no tangent (a counter) comes back concrete
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            raise ControlFlowError(_STATE_UNDER_TRANSFORM.format(name=self.name))
        self.leaves = leaves
        self._tree = None


def _copies(leaves: list[Any]) -> list[Any]:
    return [jnp.array(leaf, copy=True) for leaf in leaves]
