"""A call's arguments, split as equinox's ``filter_jit`` splits them: arrays (in tuples/dicts)
traced; Python settings and the ``static_argnums``/``static_argnames`` static (the jit key)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import sys
from collections.abc import Callable, Iterator, Sequence, ValuesView
from typing import Any

import jax
import numpy as np

from symjax_mlp._errors import ConfigError, SignatureError, SymjaxError, first_line, message
from symjax_mlp._export_example import hijax_value
from symjax_mlp._specs import TensorSpec, array_like, array_types, foreign_array, unfit_array

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
ARRAYS = array_types()  # what a hot path takes as it is
JAX_ARRAYS, NDARRAY = ARRAYS - {np.ndarray}, np.ndarray  # (a NumPy array's byte order read)
_TRACEABLE = (bool, int, float, complex, np.ndarray, np.generic, jax.Array, jax.ShapeDtypeStruct)
_NANS: dict[Any, Any] = {}  # the first NaN of each repr and kind seen (_settled's)


def is_static(value: Any) -> bool:
    """A Python setting, not data: None, bool, int, float, complex, str, or a tuple of them."""
    return isinstance(value, _SCALARS) or (isinstance(value, tuple) and all(map(is_static, value)))


class _Frozen:
    """A concrete array forced static (``static_argnums``): hashed and compared by value."""

    __slots__ = ("_key", "array")

    def __init__(self, array: Any) -> None:
        self.array = np.asarray(array)
        self._key = (self.array.shape, str(self.array.dtype), self.array.tobytes())

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Frozen) and self._key == other._key

    def __repr__(self) -> str:  # a large one by digest: what NumPy elides may differ
        if (a := self.array).size <= 16:
            return repr(a)
        digest = hashlib.sha256(self._key[2]).hexdigest()[:12]
        return f"array(shape={a.shape}, dtype={a.dtype}, sha256={digest})"


def _static_value(path: str, value: Any) -> Any:
    if is_static(value):
        return value
    if array_like(value) and not isinstance(value, jax.core.Tracer):
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
    args: Sequence[Any], kwargs: dict[str, Any], static_argnums: frozenset[int] = frozenset(),
    static_argnames: frozenset[str] = frozenset(), *, caller: str, lists: bool = False,
    own: tuple[Any, ...] = (),
) -> tuple[tuple[Any, ...], tuple[Any, ...], dict[str, Any]]:  # fmt: skip
    """``(static key, traced args, traced kwargs)``, the key's entries ``(place or name,
    value, kind)``; a list is refused, but with ``lists`` one holding arrays is traced; a
    traced leaf neither array nor number is refused, and ``own`` (the Hybrid, its model)."""
    list(_walk(caller, args, kwargs))  # each input checked: a masked array, a str one refused
    static: list[tuple[Any, Any, Any]] = []
    dyn_args, dyn_kwargs = [], {}  # type: list[Any], dict[str, Any]
    for key, value in (*enumerate(args), *kwargs.items()):
        if key in static_argnums or key in static_argnames:
            value = _static_value(f"{caller}: {path_of(key)}", value)
        elif not is_static(value):
            if isinstance(value, list) and not (lists and _holds_arrays(value)):
                raise _list_error(caller, path_of(key), value)
            if type(value) not in ARRAYS:
                _refuse_objects(caller, key, value, own)
            if isinstance(key, int):
                dyn_args.append(value)
            else:
                dyn_kwargs[key] = value
            continue
        static.append((key, _settled(value), _kind(value)))
    return tuple(static), tuple(dyn_args), dyn_kwargs


NOT_AN_INPUT = (
    "{caller}: {path} is {what}, which a compiled call can neither trace (it is not an array) "
    "nor key on (it is not a Python setting: None, bool, int, float, complex, str or a tuple "
    "of them). {fix}"
)
NOT_AN_INPUT_FIX = (
    "Pass an array (jnp.asarray(list(...)) for a generator or a set) or a Python setting, or "
    "mark a hashable one static (static_argnames=)."
)
_OWN_FIX = "The Hybrid holds its model and params: pass only the model's inputs (arrays), h(x)."
_SETTING_AMONG_ARRAYS = (
    "{caller}: {path} is the str {leaf!r:.60}, a leaf of an input that holds arrays (a "
    "tuple's or NamedTuple's every field is one): a compiled call traces that input's leaves, "
    "and a str is no array. A setting is keyed on only as an argument of its own (a str, or a "
    "tuple of settings): pass it so, or make it static in its container (the meta_fields= of "
    "jax.tree_util.register_dataclass, a flax.struct.field(pytree_node=False))."
)


def unwalkable(v: Any) -> bool:
    """An iterator (a generator, a ``map``) or a ``dict.values()``, which JAX flattens as a
    leaf with a DeprecationWarning (an error in a later JAX): to pass as a leaf (``is_leaf``)."""
    return type(v) not in ARRAYS and isinstance(v, (Iterator, ValuesView))  # (ABCs: slow)


def _refuse_objects(caller: str, key: Any, value: Any, own: tuple[Any, ...]) -> None:
    """Refuses, by path, a leaf neither array nor number, one of ``own``, or such an eqx module."""
    eqx = sys.modules.get("equinox")

    def is_own(v: Any) -> bool:  # None is no model: a plain function's Hybrid has none
        return v is not None and any(v is o for o in own)

    def is_module(v: Any) -> bool:
        return eqx is not None and isinstance(v, eqx.Module)

    def is_leaf(v: Any) -> bool:
        return unwalkable(v) or is_own(v) or is_module(v)

    for path, leaf in jax.tree_util.tree_flatten_with_path(value, is_leaf=is_leaf)[0]:
        at = path_of(key) + jax.tree_util.keystr(path)
        if not is_own(leaf) and is_module(leaf):  # an equinox module: traced if all arrays
            if all(map(eqx.is_array, jax.tree.leaves(leaf))):
                continue
            raise ConfigError(_EQX_INPUT.format(caller=caller, path=at, kind=type(leaf).__name__))
        if is_own(leaf) or not traceable(leaf):
            if not is_own(leaf) and (error := foreign_array(caller, at, leaf)):  # torch's
                raise error
            what, fix = f"of type {type(leaf).__name__}", NOT_AN_INPUT_FIX
            if isinstance(leaf, str):  # a setting, but among the arrays of a container
                raise ConfigError(_SETTING_AMONG_ARRAYS.format(caller=caller, path=at, leaf=leaf))
            if is_own(leaf):  # own: the Hybrid, then its model
                what = "the Hybrid itself" if leaf is own[0] else f"the model, {what}"
                what, fix = f"{what}, given as its own input", _OWN_FIX
            raise ConfigError(NOT_AN_INPUT.format(caller=caller, path=at, what=what, fix=fix))


_NOT_DATA = (
    "{caller}: {path} is {what}, not an array, and the model raised on it ({error}). If {path} "
    "is data, pass an array (jnp.asarray(...)); if a setting the model takes, the error is its own."
)
#: what a model raises on an input it cannot take (Flax: IndexError; JAX: OverflowError, 2**70)
MODEL_ERRORS = (TypeError, ValueError, IndexError, AttributeError, KeyError, OverflowError)
_KEPT = (SymjaxError, jax.errors.JAXTypeError)  # ours, or a tracer's (a ControlFlowError)


def not_data(caller: str, error: Exception, args: Sequence[Any], kwargs: dict[str, Any]):
    """The :class:`~symjax_mlp.SignatureError` naming the first input no array (a str, bytes,
    None; dict, tuple, list; number; by keyword, a str) if the model raised ``error`` (not ours)."""
    if not isinstance(error, MODEL_ERRORS) or isinstance(error, _KEPT):
        return None
    inputs = [*enumerate(args), *((k, v) for k, v in kwargs.items() if isinstance(v, str | bytes))]
    trees = (dict, tuple, list)  # a namedtuple counts as a tuple (a list: stage's; h refuses it)
    kinds = ((str, bytes, np.str_, np.bytes_, type(None)), trees, (int, float, complex))
    typed = [(k, v, next((t for t in trees if isinstance(v, t)), type(v))) for k, v in inputs]
    for path, v in ((path_of(k), v) for ks in kinds for k, v, t in typed if t in ks):
        if _own(error, v):
            continue
        shown = f"keys {sorted(map(str, v))[:5]}" if isinstance(v, dict) else repr(v)[:40]
        kind = ("NumPy " if isinstance(v, np.generic) else "Python ") + type(v).__name__
        what = "None" if v is None else f"a {kind} ({shown})"  # (a bool: a setting, not here)
        said = first_line(error, 200, typed=True)
        return SignatureError(_NOT_DATA.format(caller=caller, path=path, what=what, error=said))
    return None


def _own(error: Exception, value: Any) -> bool:
    """Whether ``error`` is the model's own on a tree of arrays it takes (h(batch) of a tuple
    it unpacks): a TypeError that names no tree (dot_general's contracting dimensions, a shape
    its arrays disagree in), not one of Python on the tree itself ('dict' and ...)."""
    leaves = jax.tree.leaves(value) if isinstance(value, dict | tuple | list) else ()
    if not leaves or not all(isinstance(x, np.ndarray | jax.Array) for x in leaves):
        return False
    return isinstance(error, TypeError) and f"'{type(value).__name__}'" not in message(error)


def traceable(leaf: Any) -> bool:
    """What jit traces: a JAX or NumPy array (or its spec), a number, a hijax type's value
    (hijax-types.md's QArray); no ``__jax_array__`` (a Keras Variable's): JAX 0.10 refuses it."""
    return isinstance(leaf, _TRACEABLE) or hijax_value(leaf)


_EQX_INPUT = (
    "{caller}: {path} is an equinox module holding non-array leaves ({kind}: functions, "
    "sizes), which a compiled call cannot trace. Pass its arrays, params, static = "
    "eqx.partition(model, eqx.is_array), and rebuild it inside with eqx.combine(params, "
    "static); or pass the module as the params, sm.hybridize(fn, model), which splits it so."
)


def split_equinox(
    args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], Callable[[tuple, dict], tuple[tuple, dict]]]:
    """``(args, kwargs, join)``: each argument holding an equinox module split as
    ``eqx.filter_make_jaxpr`` splits it, its arrays kept; ``join`` combines them back."""
    eqx = sys.modules.get("equinox")
    pairs = (*enumerate(args), *kwargs.items())
    held = {k: eqx.partition(v, eqx.is_array) for k, v in pairs if equinox_modules(v)}
    args = tuple(held[i][0] if i in held else a for i, a in enumerate(args))
    kwargs = {k: held[k][0] if k in held else v for k, v in kwargs.items()}

    def join(a: tuple, k: dict) -> tuple[tuple, dict]:
        a = tuple(eqx.combine(v, held[i][1]) if i in held else v for i, v in enumerate(a))
        return a, {n: eqx.combine(v, held[n][1]) if n in held else v for n, v in k.items()}

    return args, kwargs, join


def inputs_after(target: Any, skip: int) -> list[inspect.Parameter]:
    """``target``'s parameters after its first ``skip`` (params, ``self``); a ``*args`` first is
    kept, taking them and the inputs (``checkify.checkify(f)``'s ``(*args, **kwargs)``).
    Raises ``TypeError``/``ValueError`` where it has no signature to read. A ``__signature__``
    declared over a function of ``(params, *args, **kwargs)`` (its own arguments, then any)
    gains the ``*args``/``**kwargs``: Haiku's apply declares ``params, rng`` then ``f``'s, where
    an ``f`` argument named ``rng``, ``state`` or ``params`` is lost (or, with a default,
    invalid unchecked: a ValueError here). A wrapper of ``(*args, **kwargs)`` is as declared."""
    given = list(inspect.signature(target).parameters.values())
    code = getattr(target, "__code__", None)
    own = code.co_varnames[: code.co_argcount] if inspect.isfunction(target) else ()
    if own and "__signature__" in vars(target) and tuple(p.name for p in given[: len(own)]) == own:
        inspect.Signature(given)  # ValueError: a default before a required argument
        flags, kinds, p = code.co_flags, {p.kind for p in given}, inspect.Parameter
        if flags & inspect.CO_VARARGS and p.VAR_POSITIONAL not in kinds:
            at = next((i for i, q in enumerate(given) if q.kind > p.VAR_POSITIONAL), len(given))
            given.insert(at, p("args", p.VAR_POSITIONAL))
        if flags & inspect.CO_VARKEYWORDS and p.VAR_KEYWORD not in kinds:
            given.append(p("kwargs", p.VAR_KEYWORD))
    return given if given and given[0].kind is given[0].VAR_POSITIONAL else given[skip:]


def equinox_modules(value: Any) -> list[Any]:
    """The equinox modules in ``value`` (never importing equinox)."""
    eqx = sys.modules.get("equinox")  # (an array's class has dtype; the cookbook's dot_dict's
    if eqx is None or hasattr(type(value), "dtype"):  # __getattr__ raises KeyError for one)
        return []
    leaves = jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, eqx.Module) or unwalkable(x))
    return [m for m in leaves if isinstance(m, eqx.Module)]


def _kind(v: Any) -> Any:
    """``type(v)`` (each element's in a tuple) and a float's sign, in the jit key: Python
    equates ``4 == 4.0 == True`` and ``-0.0 == 0.0``, which trace differently."""
    if type(v) is float:
        return float, math.copysign(1.0, v)
    if type(v) is complex:
        return complex, math.copysign(1.0, v.real), math.copysign(1.0, v.imag)
    return (tuple, tuple(map(_kind, v))) if type(v) is tuple else type(v)


def _settled(v: Any) -> Any:
    """``v``, each NaN in it the first one seen alike (``nan != nan``: a trace per call)."""
    if type(v) is tuple:
        return tuple(map(_settled, v))
    if type(v) in (float, complex) and v != v:
        return _NANS.setdefault((repr(v), _kind(v)), v)
    return v


_CYCLE = (
    "{caller}: {path} is the {kind} that holds it (a cycle), so the input is no tree of "
    "arrays and has no end to walk. Pass a tree of arrays (tuples/dicts, each holding new ones)."
)
_UNSORTED = (
    "{caller}: {path} is a dict whose keys ({keys}) cannot be sorted, which JAX does to "
    "flatten it. Give its keys one type: all str, or all int."
)


def _walk(caller: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each input and what its tuples, lists and dicts hold, by path; a container holding
    itself, a dict of unsortable keys, an array JAX cannot hold (str) refused. First to last."""
    todo = [(path_of(k), v, ()) for k, v in (*enumerate(args), *kwargs.items())][::-1]
    while todo:
        path, value, within = todo.pop()
        if error := unfit_array(caller, f"input {path}", value):  # masked, str, big-endian: named
            raise error from None  # (not after jit's error on it, in h's hot path)
        yield path, value
        if isinstance(value, (tuple, list, dict)):
            if any(value is v for v in within):
                kind = type(value).__name__
                raise ConfigError(_CYCLE.format(caller=caller, path=path, kind=kind))
            within = (*within, value)
        if isinstance(value, (tuple, list)):
            todo += [(f"{path}[{i}]", v, within) for i, v in enumerate(value)][::-1]
        elif isinstance(value, dict):
            todo += [(f"{path}[{k!r}]", v, within) for k, v in value.items()][::-1]
            try:  # as JAX flattens a dict: by sorted keys
                sorted(value)
            except TypeError:
                keys = ", ".join(sorted({type(k).__name__ for k in value}))
                raise ConfigError(_UNSORTED.format(caller=caller, path=path, keys=keys)) from None


_ABSTRACT = (
    "{caller}: {path} is a jax.ShapeDtypeStruct ({type}), a shape and dtype without values, "
    "and a call computes on values. Pass an array, e.g. jnp.zeros({shape}, jnp.{dtype}); to "
    "see the program for that shape without running it, call {name}.graph(spec) (its jaxpr), "
    "{name}.lower(spec) (StableHLO) or {name}.compile(spec) (XLA's optimized HLO)."
)


def refuse_abstract(caller: str, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Refuses a ``jax.ShapeDtypeStruct`` among a call's inputs (a call needs values), naming
    the Hybrid ``name``'s methods that stage one."""
    for at, leaf in _walk(caller, args, kwargs):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise SignatureError(
                _ABSTRACT.format(caller=caller, path=at, name=name, shape=tuple(leaf.shape),
                                 dtype=leaf.dtype, type=f"{leaf.dtype}{list(leaf.shape)}")
            )  # fmt: skip


def _holds_arrays(value: Any) -> bool:
    return any(not isinstance(leaf, _SCALARS) for leaf in jax.tree.leaves(value))


def _list_error(caller: str, path: str, value: list) -> Exception:
    if value and all(isinstance(v, (str, bytes)) for v in value):  # no array to make of it
        shown = repr(tuple(value))
        return SignatureError(
            f"{caller}: {path} is a Python list of {len(value)} name(s), but an input must be "
            "an array and a setting hashable, which a list is not. A list of names is a "
            f"setting, as flax's mutable= is: pass the tuple "
            f"{shown if len(shown) <= 120 else f'tuple({path})'}."
        )
    holding, fix = "", f"Pass jnp.asarray({path}), or a tuple if it is a setting."
    if _holds_arrays(value):
        holding = " holding arrays"
        fix = (
            f"Pass tuple({path}) to trace it as one pytree of arrays (a list of (W, b) pairs "
            "too), or pass it as the params: sm.hybridize(fn, params)."
        )
    return SignatureError(
        f"{caller}: {path} is a Python list of {len(value)} element(s){holding}, but an input "
        f"must be an array or a tuple/dict of arrays (a list is traced as separate scalars). {fix}"
    )


def rebuild(
    static: tuple[Any, ...], dyn_args: Sequence[Any], dyn_kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's ``(args, kwargs)`` from :func:`partition`'s pieces."""
    fixed = {k: v.array if isinstance(v, _Frozen) else v for k, v, _ in static}
    positional = {k: v for k, v in fixed.items() if isinstance(k, int)}
    kwargs = {**dyn_kwargs, **{k: v for k, v in fixed.items() if isinstance(k, str)}}
    dyn, n = iter(dyn_args), len(dyn_args) + len(positional)
    return tuple(positional[i] if i in positional else next(dyn) for i in range(n)), kwargs


@dataclasses.dataclass(frozen=True)
class ModuleSetting:
    """An nnx module's setting in a static key (``"drop/deterministic"``), not in the call."""

    path: str


def path_of(key: Any) -> str:
    """``args[0]``, ``kwargs['train']`` or ``module.drop/deterministic``."""
    if isinstance(key, ModuleSetting):
        return f"module.{key.path}"
    return f"args[{key}]" if isinstance(key, int) else f"kwargs[{key!r}]"


def signature(
    args: Sequence[Any], kwargs: dict[str, Any], static: tuple[Any, ...]
) -> tuple[tuple[TensorSpec, ...], str, tuple[tuple[str, str], ...]]:
    """The traced leaves' specs (each at its place in the call), their tree, the static values."""
    fixed = {k for k, *_ in static if isinstance(k, int)}
    places = [i for i in range(len(args) + len(fixed)) if i not in fixed]
    specs, trees = [], []
    for prefix, tree in (("args", tuple(args)), ("kwargs", dict(kwargs))):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        trees.append(str(treedef))
        for path, leaf in leaves:
            aval = jax.typeof(leaf)
            at = prefix + jax.tree_util.keystr(path)
            if prefix == "args":  # the first key is the place among the traced args
                at = f"args[{places[path[0].idx]}]" + jax.tree_util.keystr(path[1:])
            weak = bool(getattr(aval, "weak_type", False))
            dtype = getattr(aval, "dtype", type(aval).__name__)  # (a hijax type has none)
            specs.append(TensorSpec(at, tuple(aval.shape), str(dtype), weak))
    tree = trees[0] if trees[1] == str(jax.tree.structure({})) else " ".join(trees)
    return tuple(specs), tree, tuple((path_of(k), repr(v)) for k, v, _ in static)
