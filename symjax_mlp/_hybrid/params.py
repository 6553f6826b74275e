"""A Hybrid's params as a compiled call passes them: their leaves refused by path where jit
cannot take one (an equinox module given whole, a setting, a Python int past JAX's int)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import jax
import numpy as np

from symjax_mlp._errors import ConfigError, first_line
from symjax_mlp._hybrid.args import JAX_ARRAYS, equinox_modules, traceable, unwalkable
from symjax_mlp._specs import array_like, unfit_array

_PARAM_LEAF = (
    "{name}: params{path} is a {kind}, which a compiled call cannot pass to the model (params "
    "are arrays or numbers, traced). Keep a setting out of the params: close over it "
    "(lambda p, x: f(p, x, setting)) or pass it in the call (h(x, setting)); or bake the params "
    "into the program: hybridize(..., params_as_constants=True)."
)

_FOREIGN_PARAM = (
    "{name}: params{path} is a {kind}, another library's array or variable (a Keras Variable, a "
    "torch tensor), which a compiled call cannot pass (JAX 0.10 no longer converts a leaf by its "
    "__jax_array__). Pass arrays: jax.tree.map(np.asarray, params); of a Keras model, the "
    "variables' values, [v.value for v in model.trainable_variables] (and so for its "
    "non_trainable_variables and an optimizer's variables)."
)

_EQX_PARAM_LEAF = (
    "{name}: params{path} is a {kind}, which a compiled call cannot pass to the model (params "
    "are arrays or numbers, traced): the params hold the whole equinox {module}, its functions "
    "and placeholders (eqx.nn.Shared's SharedNode) with its arrays. A Hybrid takes its float "
    "arrays, shaped as h.params: pass eqx.filter(model, eqx.is_inexact_array)."
)

_EQX_SETTING = (
    "{name}: params{path} is the Python bool {value}, a setting of the whole equinox {module} "
    "given as params (eqx.nn.inference_mode's flag: traced, a Python `if` on it fails). A "
    "Hybrid holds an equinox model's settings as of hybridize and takes its float arrays, shaped "
    "as h.params: for new weights pass eqx.filter(model, eqx.is_inexact_array); for new "
    "settings hybridize the model anew, sm.hybridize(eqx.nn.inference_mode(model))."
)

_PARAM_INT = (
    "{name}: params{path} is the Python int {value}, past {dtype}'s range [{low}, {high}], "
    "{how}. Pass it as a float, float(...), if it is a number to compute with."
)
_PASSED_INT = "which a compiled call passes a Python int as (JAX's weak type)"
_BAKED_INT = (
    "which JAX could not make an array of where the model computed with it ({error}); baked "
    "in (params_as_constants=True), such an int serves only the model's Python arithmetic"
)


_DONATED = (
    "{caller}: params{path} {were} deleted: a jit that donates its arguments "
    "(jax.jit(..., donate_argnums=...), eqx.filter_jit(donate=...)) was given the arrays this "
    "Hybrid holds, and took their buffers. Hold what that jit returned, h = "
    "h.replace(params=new_params), or donate a copy: jax.tree.map(jnp.copy, h.params)."
)


def checked_each_call(leaves: list[Any]) -> bool:
    """Whether the params are checked (:func:`refuse_donated`) before every call: a leaf is
    one array over several devices (where JAX's call of a deleted one crashes the process,
    jaxlib 0.10), or abstract (an nnx.eval_shape model's: jit's raw TypeError else)."""
    return any(
        (isinstance(a, jax.Array) and len(a.sharding.device_set) > 1)
        or isinstance(a, jax.ShapeDtypeStruct)
        for a in leaves
    )


_ABSTRACT_PARAMS = (
    "{caller}: params{path} is a jax.ShapeDtypeStruct ({type}), a shape and dtype without "
    "values (nnx.eval_shape, jax.eval_shape or an abstract checkpoint target makes them), "
    "where this needs values. Restore or initialize the params first (orbax's "
    "checkpointer.restore(path, abstract_state), then nnx.merge; model.init) and hybridize "
    "those, or pass them: h.replace(params=...). h.graph(x) and h.lower(x) take these as they are."
)


def refuse_donated(caller: str, params: Any, *, staging: bool = False) -> None:
    """Raises a :class:`ConfigError` naming the params a donating jit deleted (JAX's own error
    names no path; eager and export raised a bare ``RuntimeError``), or abstract ones unless
    ``staging`` (a graph or lowering needs no values)."""
    leaves = jax.tree.leaves(params)
    if not staging and any(isinstance(a, jax.ShapeDtypeStruct) for a in leaves):  # jit's raw
        paths, _ = jax.tree_util.tree_flatten_with_path(params)
        at, a = next((p, a) for p, a in paths if isinstance(a, jax.ShapeDtypeStruct))
        shown, path = f"{a.dtype}{list(a.shape)}", jax.tree_util.keystr(at)
        raise ConfigError(_ABSTRACT_PARAMS.format(caller=caller, path=path, type=shown))
    if any(map(_deleted, leaves)):  # (a call's cost: no paths walked)
        paths, _ = jax.tree_util.tree_flatten_with_path(params)
        gone = [jax.tree_util.keystr(p) for p, a in paths if _deleted(a)]
        path = gone[0] + (f" (and {len(gone) - 1} more)" if len(gone) > 1 else "")
        were = "were" if len(gone) > 1 else "was"
        raise ConfigError(_DONATED.format(caller=caller, path=path, were=were))


def _deleted(a: Any) -> bool:
    return isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and a.is_deleted()


def flat_params(name: str, params: Any, *, passed: bool) -> tuple[list[Any], Any]:
    """``jax.tree.flatten(params)``; if ``passed`` (not baked), a leaf jit cannot take refused."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=unwalkable)
    for path, leaf in paths if passed else ():
        where, kind = jax.tree_util.keystr(path), type(leaf).__name__
        if type(leaf) is bool and (modules := equinox_modules(params)):  # given whole
            module = type(modules[0]).__name__
            raise ConfigError(_EQX_SETTING.format(name=name, path=where, value=leaf, module=module))
        if not traceable(leaf):
            if not isinstance(leaf, type) and (hasattr(leaf, "__jax_array__") or array_like(leaf)):
                kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
                raise ConfigError(_FOREIGN_PARAM.format(name=name, path=where, kind=kind))
            modules = equinox_modules(params)  # given whole: hybridize(model) had split it
            message = _EQX_PARAM_LEAF if modules else _PARAM_LEAF
            module = type(modules[0]).__name__ if modules else None
            raise ConfigError(message.format(name=name, path=where, kind=kind, module=module))
        if error := _past_int(name, where, leaf) or unfit_array(name, f"params{where}", leaf):
            raise error  # jit's raw OverflowError; big-endian weights (a file's)
    return [leaf for _, leaf in paths], treedef


def held(given: Any, treedef: Any, leaves: list[Any], *, mesh: Any) -> Any:
    """A Hybrid's params: ``given`` while it still holds the ``leaves`` its compiled call reads,
    else those leaves (replicated over a ``mesh``: always). A container mutated since hybridize
    (``p["w"] = ...``, a registered pytree's static field set) is not what ``h(x)`` reads, so
    eager, graph and export do not read it either (``h.replace(params=...)`` takes new ones).
    Baked params: ``leaves`` are the constants their program holds."""
    if not leaves:
        return given
    if mesh is None:
        now, tree = jax.tree_util.tree_flatten(given, is_leaf=unwalkable)
        try:
            same = len(now) == len(leaves) and all(map(operator.is_, now, leaves))
            if same and tree == treedef:  # an aux field == cannot compare (an array): changed
                return given
        except Exception:  # (then held, as changed)
            pass
    return jax.tree.unflatten(treedef, leaves)


def check_given(caller: str, params: Any) -> str:
    """:func:`flat_params`' refusals of params given to a call (``h.apply``), made only where a
    leaf is no JAX array or JAX's walk raised (an iterator leaf's warning under ``-W error``).
    Returns what the leaves are: ``"jax"`` (JAX arrays alone), ``"numpy"`` (a NumPy array
    among them, which jit's dispatch of that signature takes from then on, its byte order
    unread) or ``"other"`` (tracers, Python numbers)."""
    try:
        leaves = jax.tree.leaves(params)
    except Exception as e:  # (refused below, out of the except: no warning chained to it)
        walk_error = e
    else:
        if all(map(JAX_ARRAYS.__contains__, map(type, leaves))):
            return "jax"
        walk_error = None
    flat_params(caller, params, passed=True)
    if walk_error is not None:  # nothing to refuse: JAX's own error
        raise walk_error
    return "numpy" if any(isinstance(a, np.ndarray) for a in leaves) else "other"


def overflowing(name: str, params: Any, error: Exception) -> ConfigError | None:
    """For a model's ``OverflowError``: the refusal of a baked Python int among ``params`` past
    JAX's int (baked, one may serve the model's Python arithmetic, so it is not refused early)."""
    if not isinstance(error, OverflowError):
        return None
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=unwalkable)[0]:
        if refusal := _past_int(name, jax.tree_util.keystr(path), leaf, error):
            return refusal
    return None


def _past_int(name: str, where: str, leaf: Any, error: Exception | None = None):
    """The :class:`ConfigError` for a Python int past JAX's int (2**70; 2**40 without x64)."""
    info = np.iinfo(jax.dtypes.canonicalize_dtype(np.int64)) if type(leaf) is int else None
    if info is None or info.min <= leaf <= info.max:
        return None
    said = None if error is None else first_line(error, 200, typed=True)
    how = _PASSED_INT if said is None else _BAKED_INT.format(error=said)
    fields = {"dtype": info.dtype, "low": info.min, "high": info.max, "value": leaf}
    return ConfigError(_PARAM_INT.format(name=name, path=where, how=how, **fields))


def unflattenable(tree: Any) -> str | None:
    """Why JAX cannot flatten ``tree``'s dicts, lists and tuples, or ``None``: walked without
    recursion, each once (a subtree held twice is fine; one holding itself is not)."""
    todo, inside, done = [(tree, False)], set(), set()
    while todo:
        x, leaving = todo.pop()
        if leaving:
            inside.discard(id(x))
            done.add(id(x))
            continue
        if not isinstance(x, (dict, list, tuple)) or id(x) in done:
            continue
        if id(x) in inside:
            return f"holds a {type(x).__name__} that contains itself"
        if isinstance(x, dict) and len(kinds := {type(k).__name__ for k in x}) > 1:
            return f"holds a dict whose keys are of several types ({', '.join(sorted(kinds))})"
        inside.add(id(x))
        todo.append((x, True))
        todo.extend((c, False) for c in (x.values() if isinstance(x, dict) else x))
    return None


def param_fields(params: Any, at: tuple[Any, ...] = ()) -> list[tuple[str, Any, None]]:
    """What a compiled call bakes into its program from the params' tree beside its leaves: the
    static fields of its dataclass nodes (``flax.struct.field(pytree_node=False)``, the
    ``meta_fields`` of ``jax.tree_util.register_dataclass``), as ``("params.path.field", value,
    None)``, the triples of static settings."""
    node = _dataclass_node(params)  # its children one level down; else the dataclasses below
    kids = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: x is not params and (node or _dataclass_node(x))
    )[0]
    named = {getattr(k[0], "name", None) for k, _ in kids} if node else {None}
    where = f"params{jax.tree_util.keystr(at)}"
    fields = [] if None in named else dataclasses.fields(params)  # (children unnamed: none)
    found = [(f"{where}.{f.name}", getattr(params, f.name), None) for f in fields
             if f.name not in named]  # fmt: skip
    for path, x in kids:
        if x is not params and not jax.tree_util.all_leaves([x]):
            found += param_fields(x, at + path)
    return found


def _dataclass_node(x: Any) -> bool:
    """A dataclass instance a pytree node (registered), not a leaf."""
    return (
        dataclasses.is_dataclass(x)
        and not isinstance(x, type)
        and not jax.tree_util.all_leaves([x])
    )
