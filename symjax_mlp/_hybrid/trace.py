"""The trace log: what each trace of a Hybrid was specialised on, and why it traced again.

JAX traces a function once per input signature (shapes, dtypes, weak types, tree structure)
and silently traces again when any of it changes. A :class:`TraceEvent` makes each trace
visible, and its ``reason`` names what changed against the nearest earlier trace. This module
also turns JAX's "concrete value needed" errors into :class:`~symjax_mlp.ControlFlowError`,
whose message says how to stay symbolic.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import jax

from symjax_mlp._errors import ConfigError, ControlFlowError
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
    "  - a data-dependent shape (x[: int(n)], jnp.nonzero(x)) -> give it a static size "
    "(jnp.nonzero(x, size=k)), mask with jnp.where, or pad to a fixed length.\n"
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
      signature: one :class:`~symjax_mlp.TensorSpec` per traced input leaf (params not
        included).
      tree: the traced inputs' tree structure, as text.
      reason: ``"first call"`` or what changed against the nearest earlier trace, e.g.
        ``"args[0].shape changed from (1, 512) to (7, 512)"`` or
        ``"kwargs['train'] changed from True to False"``.
      static: the static (Python) arguments the trace was specialised on, as
        ``(path, repr(value))`` pairs.
      entry: ``"call"`` (``h(x)``) or ``"apply"`` (``h.apply(params, x)``).
    """

    index: int
    signature: tuple[TensorSpec, ...]
    tree: str
    reason: str
    static: tuple[tuple[str, str], ...] = ()
    entry: str = "call"

    def __str__(self) -> str:
        static = [f"{k}={v}" for k, v in self.static if _shown(k)]
        sig = ", ".join([*map(str, self.signature), *static])
        where = "" if self.entry == "call" else f" ({self.entry})"
        return f"trace #{self.index}{where} [{sig}]: {self.reason}"


#: nnx's mode attributes (what ``Module.train()`` and ``eval()`` set): of an nnx module's
#: settings, the ones a trace's line shows (the others show in a reason when they change)
MODE_ATTRIBUTES = ("deterministic", "use_running_average")


def _shown(path: str) -> bool:
    if not path.startswith("module."):
        return True
    return path.removeprefix("module.").rpartition("/")[2] in MODE_ATTRIBUTES


# -- static and traced arguments ----------------------------------------------------------------
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def is_static(value: Any) -> bool:
    """A Python setting, not data: None, bool, int, float, complex, str, or a tuple of them."""
    if isinstance(value, _SCALARS):
        return True
    return isinstance(value, tuple) and all(map(is_static, value))


class _Frozen:
    """A concrete array forced static (``static_argnums``): hashed and compared by value."""

    __slots__ = ("_key", "array")

    def __init__(self, array: Any) -> None:
        import numpy as np

        self.array = np.asarray(array)
        self._key = (self.array.shape, str(self.array.dtype), self.array.tobytes())

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Frozen) and self._key == other._key

    def __repr__(self) -> str:
        """The array itself when small; else its shape, dtype and a digest of its bytes, so
        that two arrays NumPy would print alike (``[0, 0, 0, ..., 0]``) read apart in the
        trace log's reasons."""
        a = self.array
        if a.size <= 16:
            return repr(a)
        digest = hashlib.sha256(self._key[2]).hexdigest()[:12]
        return f"array(shape={a.shape}, dtype={a.dtype}, sha256={digest})"


def _static_value(path: str, value: Any) -> Any:
    if is_static(value):
        return value
    if (
        hasattr(value, "shape")
        and hasattr(value, "dtype")
        and not isinstance(value, jax.core.Tracer)
    ):
        return _Frozen(value)
    try:
        hash(value)
    except TypeError:
        raise ConfigError(
            f"{path} is marked static but is a {type(value).__name__}, which cannot be hashed "
            "(a jit cache key). Pass a tuple instead of a list, or do not mark it static."
        ) from None
    return value


def partition(
    args: Sequence[Any],
    kwargs: dict[str, Any],
    static_argnums: frozenset[int] = frozenset(),
    static_argnames: frozenset[str] = frozenset(),
    *,
    caller: str,
) -> tuple[tuple[Any, ...], tuple[Any, ...], dict[str, Any]]:
    """Splits a call into ``(static key, traced args, traced kwargs)``.

    Python settings (see :func:`is_static`) and the arguments named in ``static_argnums`` /
    ``static_argnames`` are static: part of the jit cache key, a plain tuple of
    ``(position or name, value, kind)`` (see :func:`_kind`). Everything else is traced.

    Raises:
      SignatureError: an argument is a list (ambiguous: a pytree of scalars or an array).
    """
    static: list[tuple[Any, Any, Any]] = []
    dyn_args: list[Any] = []
    for i, a in enumerate(args):
        if i in static_argnums:
            v = _static_value(f"{caller}: args[{i}]", a)
            static.append((i, v, _kind(v)))
        elif is_static(a):
            static.append((i, a, _kind(a)))
        else:
            if isinstance(a, list):
                raise _list_error(caller, f"args[{i}]", a)
            dyn_args.append(a)
    dyn_kwargs: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k in static_argnames:
            v = _static_value(f"{caller}: kwargs[{k!r}]", v)
            static.append((k, v, _kind(v)))
        elif is_static(v):
            static.append((k, v, _kind(v)))
        else:
            if isinstance(v, list):
                raise _list_error(caller, f"kwargs[{k!r}]", v)
            dyn_kwargs[k] = v
    return tuple(static), tuple(dyn_args), dyn_kwargs


def _kind(v: Any) -> Any:
    """``type(v)``, and of each element of a tuple setting: part of the jit cache key, since
    Python equates ``4 == 4.0 == True`` (and hashes them alike) but a program traced for one
    is not the program for another (``jnp.asarray(n)`` takes its dtype from the setting's
    type, ``x // d`` differs from ``x / d``)."""
    return (tuple, tuple(map(_kind, v))) if type(v) is tuple else type(v)


def _list_error(caller: str, path: str, value: list) -> Exception:
    from symjax_mlp._errors import SignatureError

    return SignatureError(
        f"{caller}: {path} is a Python list of {len(value)} element(s), but an input must be an "
        "array (or a tuple/dict of arrays). A list would be traced element by element as "
        f"separate scalars. Pass jnp.asarray({path.split('[')[0]}) instead, or a tuple if it "
        "is a setting."
    )


def rebuild(
    static: tuple[Any, ...], dyn_args: Sequence[Any], dyn_kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's ``(args, kwargs)`` from :func:`partition`'s pieces."""
    positional = {k: v for k, v, _ in static if isinstance(k, int)}
    kwargs = dict(dyn_kwargs)
    kwargs.update((k, _unfreeze(v)) for k, v, _ in static if isinstance(k, str))
    dyn = iter(dyn_args)
    n = len(dyn_args) + len(positional)
    args = tuple(_unfreeze(positional[i]) if i in positional else next(dyn) for i in range(n))
    return args, kwargs


def _unfreeze(v: Any) -> Any:
    return v.array if isinstance(v, _Frozen) else v


@dataclasses.dataclass(frozen=True)
class ModuleSetting:
    """The key of an nnx module's setting in a static key (``"drop/deterministic"``): neither
    a place nor a keyword, so :func:`rebuild` leaves it out of the call."""

    path: str


def settings_key(names: tuple[ModuleSetting, ...], values: tuple) -> tuple:
    """A module's settings as static entries, as :func:`partition` makes them."""
    return tuple((k, v, type(v)) for k, v in zip(names, values, strict=True))


def _path(key: Any) -> str:
    if isinstance(key, ModuleSetting):
        return f"module.{key.path}"
    return f"args[{key}]" if isinstance(key, int) else f"kwargs[{key!r}]"


def signature(
    args: Sequence[Any], kwargs: dict[str, Any] | None = None, static: tuple[Any, ...] = ()
) -> tuple[tuple[TensorSpec, ...], str, tuple[tuple[str, str], ...]]:
    """The specs of the traced leaves (``args[0]``, ``kwargs['mask']``...: each at its place
    in the call, the static ones in between counted), their tree, and the static values."""
    fixed = {k for k, *_ in static if isinstance(k, int)}
    places = [i for i in range(len(args) + len(fixed)) if i not in fixed]
    specs = []
    trees = []
    for prefix, tree in (("args", tuple(args)), ("kwargs", dict(kwargs or {}))):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        trees.append(str(treedef))
        for path, leaf in leaves:
            aval = jax.typeof(leaf)
            if prefix == "args":  # the first key is the place among the traced args
                at = f"args[{places[path[0].idx]}]" + jax.tree_util.keystr(path[1:])
            else:
                at = prefix + jax.tree_util.keystr(path)
            specs.append(
                TensorSpec(
                    path=at,
                    shape=tuple(aval.shape),
                    dtype=str(aval.dtype),
                    weak_type=bool(getattr(aval, "weak_type", False)),
                )
            )
    tree = trees[0] if trees[1] == str(jax.tree.structure({})) else " ".join(trees)
    return tuple(specs), tree, tuple((_path(k), repr(v)) for k, v, _ in static)


def explain(
    sig: tuple[TensorSpec, ...],
    tree: str,
    events: Sequence[TraceEvent],
    static: tuple[tuple[str, str], ...] = (),
) -> str:
    """Why ``(sig, tree, static)`` traced again: its differences from the nearest earlier trace."""
    if not events:
        return "first call"

    def distance(e: TraceEvent) -> int:
        if e.tree != tree:
            return 1 << 30
        return sum(a != b for a, b in zip(e.signature, sig, strict=True)) + len(
            set(e.static) ^ set(static)
        )

    old = min(reversed(events), key=distance)
    changes = []
    if old.tree != tree:
        changes.append(f"input tree structure changed from {old.tree} to {tree}")
    for n, o in zip(sig, old.signature, strict=True) if old.tree == tree else ():
        for field in ("shape", "dtype", "weak_type"):
            if getattr(n, field) != getattr(o, field):
                changes.append(
                    f"{n.path}.{field} changed from {getattr(o, field)} to {getattr(n, field)}"
                )
    was, now = dict(old.static), dict(static)
    for path in sorted(set(was) | set(now)):
        if was.get(path) != now.get(path):
            changes.append(
                f"{path} (static) changed from {was.get(path, '(absent)')} to "
                f"{now.get(path, '(absent)')}"
            )
    return "; ".join(changes) or "same signature traced again (a new jax.jit cache entry)"
