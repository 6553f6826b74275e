"""The trace log: what each trace of a Hybrid was specialised on, and why it traced again.

JAX traces a function once per input signature (shapes, dtypes, weak types, tree structure)
and silently traces again when any of it changes. A :class:`TraceEvent` makes each trace
visible, and its ``reason`` names what changed against the nearest earlier trace. This module
also turns JAX's "concrete value needed" errors into :class:`~symjax_mlp.ControlFlowError`,
whose message says how to stay symbolic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from symjax_mlp._errors import ControlFlowError
from symjax_mlp._specs import TensorSpec

# The errors JAX raises when Python needs a concrete value from a tracer.
TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,  # includes TracerBoolConversionError
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)

_CONTROL_FLOW_HELP = (
    "The same code runs fine eagerly (h.eager(x), or h.hybridize(False)(x)), because there "
    "every array has a value. Under compilation only shapes and dtypes are known, so a Python "
    "`if`/`while` on an array, float(x), int(x) or np.asarray(x) cannot be decided. Fix it by "
    "staying symbolic:\n"
    "  - `if x > 0: a else b`       ->  jnp.where(x > 0, a, b) or jax.lax.cond\n"
    "  - `while cond(x): ...`       ->  jax.lax.while_loop / jax.lax.fori_loop\n"
    "  - np.asarray(x) / float(x)   ->  keep using jnp operations on x\n"
    "  - a value that is really a setting -> pass it as a Python constant (static), not as an "
    "array input.\n"
    "A Python `for` over a fixed range is fine: it unrolls into the graph."
)


def control_flow_error(name: str, e: Exception) -> ControlFlowError:
    """The :class:`~symjax_mlp.ControlFlowError` for JAX's tracer error ``e`` in ``name``."""
    first_line = str(e).strip().splitlines()[0]
    return ControlFlowError(
        f"{name}: Python needed a concrete value from a traced (symbolic) array while "
        f"compiling: {type(e).__name__}: {first_line}\n{_CONTROL_FLOW_HELP}"
    )


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One trace of a :class:`~symjax_mlp.Hybrid`: the input signature, and why it (re)traced.

    Attributes:
      index: 0 for the first trace, 1 for the first retrace, ...
      signature: one :class:`~symjax_mlp.TensorSpec` per input leaf (params not included).
      tree: the input tree structure, as text.
      reason: ``"first call"`` or what changed against the nearest earlier trace, e.g.
        ``"args[0].shape changed from (1, 512) to (7, 512)"``.
    """

    index: int
    signature: tuple[TensorSpec, ...]
    tree: str
    reason: str

    def __str__(self) -> str:
        sig = ", ".join(map(str, self.signature))
        return f"trace #{self.index} [{sig}]: {self.reason}"


def signature(args: Sequence[Any]) -> tuple[tuple[TensorSpec, ...], str]:
    """The specs of ``args``' leaves (``args[0]``, ``args[1]["x"]``, ...) and their tree."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tuple(args))
    specs = []
    for path, leaf in leaves:
        aval = jax.typeof(leaf)
        specs.append(
            TensorSpec(
                path="args" + jax.tree_util.keystr(path),
                shape=tuple(aval.shape),
                dtype=str(aval.dtype),
                weak_type=bool(getattr(aval, "weak_type", False)),
            )
        )
    return tuple(specs), str(treedef)


def explain(sig: tuple[TensorSpec, ...], tree: str, events: Sequence[TraceEvent]) -> str:
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
