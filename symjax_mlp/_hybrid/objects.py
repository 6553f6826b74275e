"""The nnx objects a call is given, mutated inside it, come back mutated as eager nnx leaves them.

Flax's guides pass an ``nnx.Rngs`` to ``__call__`` (``self.dropout(x, rngs=rngs)``); a model may
also bump a ``Variable`` or move a sub-module's batch statistics that the caller owns. Eagerly
nnx mutates those objects in place. ``jax.jit`` traces copies of them, so a compiled call would
leave them as they were (every call the same dropout mask). A Hybrid's compiled paths return
the values of the ``Variable`` s they were given, as the call left them (:func:`values`), and
write them back into the caller's objects (:func:`write_back`).
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from symjax_mlp._errors import ConfigError, SignatureError
from symjax_mlp._specs import array_types

_TWICE = (
    "{caller}: the same nnx Variable ({kind}) is reached more than once among the inputs "
    "(the same object passed twice, or inside two objects passed). A compiled call traces a "
    "copy of each input, so the copies would be mutated apart and only one kept. Pass it once."
)
_SHARDED = (
    "{caller}: an nnx object (an Rngs, a Variable or a module) among the inputs of a sharded "
    "Hybrid, which splits every input over the mesh by rows. Call the Hybrid without the mesh "
    "(h.replace(mesh=None)), or keep the object in the model."
)


def variables_in(tree: Any) -> list[Any]:
    """The nnx ``Variable`` s in ``tree`` (an ``Rngs``' counts and keys, a module's), in
    flattening order: the caller's own, or a trace's copies of them (same order)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:  # no nnx object can exist
        return []
    kind = nnx.Variable
    return [
        v
        for v in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kind))
        if isinstance(v, kind)
    ]


def given(dyn: Any, dyn_kw: Any, caller: str, sharded: bool = False) -> list[Any]:
    """The caller's Variables among a call's traced inputs, each once.

    Raises:
      SignatureError: a Variable is reached twice.
      ConfigError: there are Variables and the Hybrid is sharded.
    """
    if all(type(a) in _ARRAYS for a in (*dyn, *dyn_kw.values())):  # the usual call: no walk
        return []
    found = variables_in((dyn, dyn_kw))
    if found and sharded:
        raise ConfigError(_SHARDED.format(caller=caller))
    if len({id(v) for v in found}) != len(found):
        twice = next(v for i, v in enumerate(found) if any(v is w for w in found[:i]))
        raise SignatureError(_TWICE.format(caller=caller, kind=type(twice).__name__))
    return found


_ARRAYS = array_types()


def values(variables: list[Any]) -> list[Any]:
    """The values of ``variables`` (a trace's copies) as the call left them."""
    return [v.get_value() for v in variables]


def write_back(variables: list[Any], new: list[Any]) -> None:
    """Sets the caller's ``variables`` to a compiled call's ``new`` values, as eager nnx would
    have left them."""
    for v, value in zip(variables, new, strict=True):
        v.set_value(value)
