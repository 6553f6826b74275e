"""An nnx module as a pure call: its params (its ``Param`` s; a module of none, as nnx's
array leaves, its float arrays), its state (every other variable), and its settings; its layers
named in its programs (:func:`layer_scopes`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import operator
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from symjax_mlp._compat import INTERNALS
from symjax_mlp._errors import ConfigError
from symjax_mlp._hybrid import trace as _trace
from symjax_mlp._hybrid.pure import PINNED, PureModel, StateAdded, leaf_paths, path_diff

_ADDED = (
    "{name}: the call added {added} to an nnx module that held only Params when hybridized, "
    "and this use of it (a staging, an export, training, a sharded call) holds no state. Call "
    "its Hybrid once first, h(x), which turns it stateful to carry them as nnx.jit keeps them "
    "in the module; or call the module once (model(x)) before, or create them in __init__."
)
_PARAMS_MADE = (
    "{name}: the call made the Params {made} of the nnx module (lazily, as it ran), which the "
    "Hybrid does not hold: it holds the module's Params as of sm.hybridize, so each compiled "
    "call would make them anew (untrained, another draw of an rng each time) and export would "
    "leave them out. Create them in __init__, or call the module once (model(x)) before "
    "sm.hybridize(model)."
)
_UNFIT = (
    "{name}: the params and state given do not fit the nnx module: {diff}. Pass "
    "trees shaped as h.params (its Param values) and h.state (its other Variables' values), "
    "as nnx.to_pure_dict(nnx.split(module, nnx.Param, ...)[1:]) gives them."
)

_MODULE_GIVEN = (
    "{name}: the params given are the nnx {kind} itself, not its values: pass them as h.params "
    "holds them, nnx.state(module, nnx.Param) for a module of Params (its other Variables, "
    "nnx.state(module, nnx.Not(nnx.Param)), are the state, as h.state holds it)."
)
_NOT_ARRAY = (
    "{name}: {path} holds {what}, not an array: nnx keeps it in the module's state (it took the "
    "place of a sub-module or array), and a compiled call takes that state as arrays (nnx.jit "
    "refuses it too). Mark it static, model.{attr} = nnx.static(value), or make it an "
    "nnx.Module."
)
_REASSIGNED = (
    "{name}: the call assigned {changed}, a float array of an nnx module holding no Param, "
    "whose float arrays are its weights (as nnx's array-leaves example trains them, "
    "nnx.DiffState(0, is_param)): held as params, what the call wrote would be dropped. Make "
    "what the call changes an nnx.Variable (nnx.BatchStat(jnp.zeros(()))) or an int array "
    "(jnp.array(0)), which the Hybrid carries as state."
)


def nnx_module(module: Any, fn: Callable[..., Any] | None = None) -> tuple:
    """``(PureModel, params, state)`` for an nnx module (or ``fn(module, *args, **kwargs)``):
    its Params (:func:`trainable`), and everything else; its settings (bool attributes) read at
    each call."""
    from flax import nnx

    wrt, module_name = trainable(module), type(module).__name__
    graphdef, split, rest = nnx.split(module, wrt, ...)
    params, state = nnx.to_pure_dict(split), nnx.to_pure_dict(rest)
    _refuse_non_arrays(module_name, state)
    watched = [
        (path, sub, attr)
        for path, sub in nnx.iter_modules(module)
        for attr, value in vars(sub).items()
        if not attr.startswith("_") and (type(value) is bool or attr in _trace.MODE_ATTRIBUTES)
    ]
    owners = tuple((sub, attr) for _, sub, attr in watched)
    names = tuple("/".join(map(str, (*path, attr))) for path, _, attr in watched)

    def settings() -> tuple:
        return tuple([getattr(sub, attr) for sub, attr in owners])

    expected = leaf_paths((params, state))
    graphdefs = {tuple(expected): graphdef}  # and the states calls grew (nnx.jit keeps those)

    def merge(params, state):  # nnx would match the leaves by place, whatever their names
        if (known := graphdefs.get(tuple(got := leaf_paths((params, state))))) is None:
            if isinstance(params, getattr(nnx, "Pytree", nnx.Module)):  # (an nnx.State is not)
                kind = f"module {type(params).__name__}"
                raise ConfigError(_MODULE_GIVEN.format(name=module_name, kind=kind))
            raise ConfigError(_UNFIT.format(name=module_name, diff=path_diff(expected, got)))
        m = nnx.merge(known, params, state) if state else nnx.merge(known, params)
        if watched:
            pin = PINNED.get()
            values = pin[1] if pin is not None and pin[0] is owners else settings()
            subs = dict(nnx.iter_modules(m))
            for (path, _, attr), v in zip(watched, values, strict=True):
                setattr(subs[path], attr, v)  # as set_attributes() does
        return m

    def call(params, state, args, kwargs, keep=False):  # keep: a call may add the first state
        m = merge(params, state)
        try:
            with layer_scopes(m):  # (its layers keep their classes: a function's too)
                out = m(*args, **kwargs) if fn is None else fn(m, *args, **kwargs)
        except TypeError as e:  # target: the module's __call__ (or fn), set below
            if (unfit := _trace.unfit_call(module_name, e, target, params, args, kwargs)) is None:
                raise
            raise unfit from None
        given = set(leaf_paths((params, {})))  # a Param the call made: made anew each call
        if made := [
            p for p in leaf_paths((nnx.to_pure_dict(nnx.state(m, wrt)), {})) if p not in given
        ]:
            made = ", ".join(p.removeprefix("params") for p in made[:5])
            raise ConfigError(_PARAMS_MADE.format(name=module_name, made=made))
        if wrt is not nnx.Param and (changed := _reassigned(params, nnx.state(m, wrt))):
            raise ConfigError(_REASSIGNED.format(name=module_name, changed=", ".join(changed)))
        if not state and not keep:  # a Hybrid that carries none: what a call adds, it would drop
            if added := leaf_paths(({}, nnx.to_pure_dict(nnx.state(m, nnx.Not(wrt))))):
                added = ", ".join(p.removeprefix("state") for p in added)
                kept = functools.partial(call, keep=True)
                grown = dataclasses.replace(model, call=kept, stateful=True)
                raise StateAdded(_ADDED.format(name=module_name, added=added), grown)
            return out, state
        grown, new_params, new_state = nnx.split(m, wrt, ...)
        new_state = nnx.to_pure_dict(new_state)
        if leaf_paths((nnx.to_pure_dict(new_params), {})) == leaf_paths((params, {})):  # none added
            graphdefs.setdefault(tuple(leaf_paths((params, new_state))), grown)
        return out, new_state

    born = [id(a) for a in jax.tree.leaves(params)]  # ids: the arrays are h.params' to keep
    # not a draw's count nor what a call sows: outputs of the module's calls, not their inputs
    moving = nnx.All(nnx.Not(wrt), nnx.Not(nnx.Any(nnx.RngCount, nnx.Intermediate)))
    was = nnx.to_pure_dict(nnx.state(module, moving))  # the state as of hybridize
    held = jax.tree.leaves((split, nnx.state(module, moving)), is_leaf=_is_variable)
    values = [v.get_raw_value() for v in held] if all(map(_is_variable, held)) else None
    n_params = len(jax.tree.leaves(split, is_leaf=_is_variable))

    def trained(given: Any, quick: bool | str = False) -> list[str]:  # nnx.Optimizer, reseed
        if [id(a) for a in (given if quick else jax.tree.leaves(given))] != born:
            return []
        if quick:  # given: the leaves; the Variables split held (a sub-module swapped: unseen)
            at = n_params if quick == "state" else 0  # "state": the other Variables alone
            same = values is not None and all(map(_holds, held[at:], values[at:]))
            return [] if same else ["?"]
        params_now = _changed(given, nnx.state(module, wrt))  # (surgery: a sub-module shared)
        return params_now + [f"state{p}" for p in _changed(was, nnx.state(module, moving))]

    target = type(module).__call__ if fn is None else fn
    model = PureModel(call, bool(state), "nnx", merge, target, settings if watched else None,
                      names, owners, module, trained=trained)  # fmt: skip
    return model, params, state


def _changed(before: Any, now: Any) -> list[str]:
    """The paths of ``before`` (a pure dict) whose values the nnx State ``now`` holds no
    longer: reassigned, then gone (surgery took them away)."""
    pure = sys.modules["flax.nnx"].to_pure_dict(now)
    gone = set(leaf_paths((before, {}))) - set(leaf_paths((pure, {})))
    return _reassigned(before, now, _equal) + [p.removeprefix("params") for p in sorted(gone)]


def _is_variable(x: Any) -> bool:
    return isinstance(x, sys.modules["flax.nnx"].Variable)


def _holds(variable: Any, value: Any) -> bool:
    """Whether the nnx ``variable`` still holds ``value`` (the very array)."""
    return variable.get_raw_value() is value


def refreshed(model: PureModel) -> tuple:
    """:func:`nnx_module` of the module ``model`` was made of, as it is now (``h.refresh()``)."""
    module = model.source
    return nnx_module(module, None if model.target is type(module).__call__ else model.target)


def _refuse_non_arrays(name: str, state: Any) -> None:
    """Refuses a state leaf no compiled call can take (surgery.md's monkey-patching, a function
    assigned where a sub-module was), naming the attribute: else jax.jit's TypeError."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not (isinstance(leaf, int | float | complex) or hasattr(leaf, "dtype")):
            what = f"the {type(leaf).__name__} {getattr(leaf, '__qualname__', '')}".rstrip()
            keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]  # a list's: [2]
            attr = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys)[1:]
            where = f"state{jax.tree_util.keystr(path)}"
            raise ConfigError(_NOT_ARRAY.format(name=name, path=where, what=what, attr=attr))


def trainable(module: Any) -> Any:
    """The nnx filter of ``module``'s params: ``nnx.Param``; for a module holding none (nnx's
    array leaves, examples/nnx_toy_examples/07_array_leaves.py: plain jax arrays as weights),
    its float arrays, as that example's ``nnx.DiffState(0, is_param)`` trains them (its int
    and bool arrays, a count, stay state). Else its weights would be state: no gradient."""
    from flax import nnx

    if jax.tree.leaves(nnx.state(module, nnx.Param)):
        return nnx.Param
    floating = jax.numpy.floating
    return lambda _, v: isinstance(v, jax.Array) and jax.numpy.issubdtype(v.dtype, floating)


def _reassigned(params: Any, now: Any, same: Callable[[Any, Any], bool] = operator.is_) -> list:
    """The paths of the params in ``now`` that are not the arrays given: the float arrays a
    call assigned or added (a module of no Param), the Params training assigned in place."""
    from flax import nnx

    given = dict(zip(leaf_paths((params, {})), jax.tree.leaves(params), strict=True))
    now = nnx.to_pure_dict(now)
    pairs = zip(leaf_paths((now, {})), jax.tree.leaves(now), strict=True)
    return [p.removeprefix("params") for p, v in pairs if not same(given.get(p), v)]


def _equal(given: Any, now: Any) -> bool:
    """Whether ``now`` holds ``given``'s values: an ``nnx.jit`` step writes a module's Params
    back as new arrays, of the same values where it trained nothing (an eval step)."""
    if given is now:
        return True
    if given is None or (given.shape, given.dtype) != (now.shape, now.dtype):
        return False
    try:
        return bool(jax.numpy.array_equal(given, now, equal_nan=True))
    except Exception:  # shards of other processes' (not addressable here): taken as trained
        return False


_CLOSED = (
    "{name}: {what} made outside the compiled call{how}, which a compiled call cannot write "
    "(flax's TraceContextError): its calls write its Variables in place (a BatchNorm's "
    "statistics, an Rngs' count, the Params nnx.jit writes back). Give the Hybrid the module: "
    "sm.hybridize(model) for its own call, or sm.hybridize(f, model) to call f(model, *inputs) "
    "(f the function nnx.cached_partial was given), which splits it and carries its state; for "
    "a step over more nnx objects (an nnx.Optimizer), graphdef, state = "
    "nnx.split((model, optimizer)) and sm.hybridize(lambda state, *xs: step(graphdef, state, "
    "*xs), state), the step merging them."
)
_CACHED = " (as nnx.cached_partial(f, model) holds it)"
_JITTED = (
    "{name}: fn is nnx.jit (or jax.jit) of an nnx {kind}, which hybridize cannot split into "
    "params and state. Hybridize the module itself, sm.hybridize(model) (the model given to the "
    "jit): its calls are jit-compiled already."
)


def held_values(fn: Any) -> Any:
    """What ``fn`` holds: its closure's values, a ``functools.partial``'s arguments and function
    (a module, or the module whose method it is), and the globals its code names (a script's
    ``model``, read by ``lambda x: model(x)``)."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    if isinstance(fn, functools.partial):
        yield from (*fn.args, *fn.keywords.values(), fn.func, getattr(fn.func, "__self__", None))
    code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    yield from (names[n] for n in getattr(code, "co_names", ()) if n in names)


def closed_module_error(name: str, fn: Any) -> ConfigError | None:
    """The refusal of ``hybridize(fn)`` (no params) of a function holding an nnx graph node
    (a module, an optimizer) or Variable (``held_values``), directly or in a tuple
    (``nnx.cached_partial(f, model)``'s cached arguments), or a jit of a module
    (``nnx.jit(model)``); ``None`` if it holds none."""
    if (nnx := sys.modules.get("flax.nnx")) is None:
        return None
    if isinstance(module := getattr(fn, "__wrapped__", None), nnx.Module):
        return ConfigError(_JITTED.format(name=name, kind=type(module).__name__))
    for value in held_values(fn):
        for v in value if type(value) is tuple else (value,):
            if isinstance(v, (nnx.Module, nnx.Pytree, nnx.Variable)):
                what = f"the function closes over an nnx {type(v).__name__}"
                how = _CACHED if hasattr(fn, "__wrapped__") else ""
                return ConfigError(_CLOSED.format(name=name, what=what, how=how))
    return None


def _outer(error: Exception) -> bool:
    """Whether ``error`` is flax's ``TraceContextError``: a Variable made outside the JAX
    transform (or compiled call) written from inside it."""
    return isinstance(error, getattr(sys.modules.get("flax.errors"), "TraceContextError", ()))


def outer_write(name: str, error: Exception) -> ConfigError | None:
    """The refusal of a call that wrote an nnx Variable made outside the compiled call (of a
    module a function closes over): flax's ``TraceContextError``; ``None`` for another."""
    if not _outer(error):
        return None
    how = " (of a module the function closes over)"
    return ConfigError(_CLOSED.format(name=name, what="the call wrote an nnx Variable", how=how))


_OUTER = (
    "{caller}: the nnx {kind} given{why} was made outside the JAX transform the call runs under "
    "(jax.grad, jax.vmap, ...), so nnx cannot write the new value into it (TraceContextError). "
    "Make it inside the transformed function{fix}, or use nnx.grad."
)
_RNG_FIX = (
    " (an nnx.Rngs advances per draw)",
    " from a key split each step, jax.grad(lambda p: loss(h.apply(p, x, rngs=nnx.Rngs(key))))"
    "(h.params)",
)
_COPY_FIX = ("", ", a copy of what you pass, nnx.clone(state) inside the loss (nnx.merge, "
             "nnx.split and nnx.state keep the Variables they are given)")  # fmt: skip


def write_back(variables: list[Any], new: list[Any], caller: str = "Hybrid") -> None:
    """Sets the caller's nnx ``variables`` to a compiled call's ``new`` values."""
    from flax import nnx

    for v, value in zip(variables, new, strict=True):
        try:
            v.set_value(value)
        except Exception as e:
            if not _outer(e):
                raise
            why, fix = _RNG_FIX if isinstance(v, nnx.RngState) else _COPY_FIX
            kind = type(v).__name__
            raise ConfigError(_OUTER.format(caller=caller, kind=kind, why=why, fix=fix)) from None


# -- an nnx module's layers, named in its programs ------------------------------------------
# Why: linen names each submodule's ops by layer, nnx does not. While a block runs, the class
# owning a layer's __call__ holds a wrapper running it under jax.named_scope of the layer's path
# (other calls pass through); no layer changes class, as type(layer) is nnx.Linear needs. No
# private name: a class's __call__, replaced for the block (off, INTERNALS['layer_scopes'] in
# _compat: no scopes). nnx.scan and nnx.vmap's copies of layers are not named (nothing ties a
# copy to its layer). _LAYERS: the blocks' layers, by id.
_LAYERS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("symjax_layers", default=None)
_CALLER: contextvars.ContextVar[tuple] = contextvars.ContextVar("symjax_caller", default=())
_WRAPPED: dict[type, list] = {}  # owner: [its own __call__, the wrapper, blocks running]
_WRAPPED_LOCK = threading.Lock()


@contextlib.contextmanager
def layer_scopes(module: Any) -> Iterator[None]:
    """Within the block, each submodule of the nnx ``module`` runs its ``__call__`` under
    ``jax.named_scope`` of its path relative to its caller's (``"hidden/0"``); no layer changes
    class, nor do concurrent blocks see each other's scopes."""
    if not INTERNALS["layer_scopes"]:
        yield
        return
    from flax import nnx

    found = {id(s): (s, tuple(p)) for p, s in nnx.iter_modules(module) if p and callable(s)}
    layers = {**found, **(_LAYERS.get() or {})}
    owners = {next(k for k in type(s).__mro__ if "__call__" in vars(k)) for s, _ in layers.values()}
    _wrap(owners, 1)
    token = _LAYERS.set(layers)
    try:
        yield
    finally:
        _LAYERS.reset(token)
        _wrap(owners, -1)


def _wrap(owners: set[type], step: int) -> None:
    """One block more (1) or fewer (-1) on each owner: the first wraps its call, the last not."""
    with _WRAPPED_LOCK:
        for owner in owners:
            entry = _WRAPPED.setdefault(owner, [None, None, 0])
            if not inspect.isfunction(own := vars(owner)["__call__"]):
                continue  # (a staticmethod, a C function: left as is)
            if entry[2] == 0 and entry[0] is not own:
                entry[:2] = own, _wrapper(own)  # (first block, or the class's call reassigned)
            entry[2] += step
            if entry[2] == (step > 0):  # 1 block after the first's start, 0 after the last's
                type.__setattr__(owner, "__call__", entry[1] if step > 0 else entry[0])


def _wrapper(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, run under the named scope of ``self``'s path for a layer of a block."""
    import jax

    @functools.wraps(call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        layer, caller = (_LAYERS.get() or {}).get(id(self)), _CALLER.get()
        if layer is None or layer[0] is not self or layer[1] == caller:  # (super().__call__)
            return call(self, *args, **kwargs)
        inner = layer[1][len(caller) :] if layer[1][: len(caller)] == caller else layer[1]
        token = _CALLER.set(layer[1])
        try:
            with jax.named_scope("/".join(map(str, inner))):
                return call(self, *args, **kwargs)
        finally:
            _CALLER.reset(token)

    return __call__
