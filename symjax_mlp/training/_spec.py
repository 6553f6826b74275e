"""How a classifier is called in training and in inference: its flags, the state a training
call moves, its rng. A flax.linen model's are found with ``jax.eval_shape``; an nnx module's
``Param`` values are trained, all else is its state, read from its staged program, its steps in
``module.train()``'s mode (a ``__call__`` taking ``rngs`` gets a fresh ``nnx.Rngs`` each step).
A model that would silently train in inference mode is refused, naming the fix."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
from collections.abc import Mapping
from typing import Any

import flax
import flax.linen as nn
import jax
from flax import nnx

from symjax_mlp._errors import ConfigError, unbound_axis
from symjax_mlp._hybrid.pure import (
    PureModel,
    mode_settings,
    state_structure,
    unwrap_keys,
    wrap_keys,
)
from symjax_mlp._hybrid.pure.linen_module import LIFTED_RNG
from symjax_mlp._hybrid.pure.nnx_module import nnx_module


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How to call a flax.linen classifier in training and in inference: each call's keyword
    settings, the collections a training call updates (``mutable``), whether it draws from a
    ``dropout`` rng stream (``rng``) and the flags ``init`` needs (``__call__``'s required)."""

    train_flags: dict[str, Any]
    eval_flags: dict[str, Any]
    mutable: tuple[str, ...]
    rng: bool
    init_flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: an inference call's output (shape and dtype), found for train() (``TRAIN_FORM``) only
    out: Any = None
    #: the axis names its calls reduce over that no transform binds, bound over the whole batch
    axes: tuple[str, ...] = ()


_FLAGS = (("train", True), ("training", True), ("deterministic", False))
#: How a fix is spelt for train() and for the pieces (``{on}``/``{off}``: the flags).
TRAIN_FORM = "train(..., train_flags={on}, eval_flags={off})"
STEP_FORM = "train_step(..., train_flags={on}) and init_params(..., train_flags={on})"

_NO_FLAG = (
    "{caller}: {model}'s __call__ takes none of the flags that training finds by name "
    "(train, training, deterministic), and a call with its defaults draws no rng and updates "
    "{state}: every step would run it in inference mode, {lost}. {fix}"
)
NOT_INFERENCE = (
    "{caller}: {model}'s inference call ({call}) {does}, so it is not in inference mode: "
    "train() evaluates the model, and export() ships it, without rngs or state updates. {fix}"
)
_OTHER_STREAM = (
    "{caller}: a training call of {model} draws from the rng stream {stream!r}, but training "
    "provides only 'dropout' (split from the seed on every step). Draw from 'dropout' "
    "(nn.Dropout's default rng_collection), or write your own loop around "
    "model.apply(..., rngs={{{stream!r}: key}})."
)
_BAD_FLAGS = (
    "{caller}: {arg} must be a dict of keyword settings of {model}.__call__, such as "
    "{{'is_training': True}}; got {flags!r}."
)
_UNKNOWN_FLAG = (
    "{caller}: {arg} names {flag!r}, which {model}.__call__ does not take (its parameters: "
    "{names}). {fix}"
)
_REQUIRED = (
    "{caller}: {model}.__call__ requires {names} (no default), and training cannot tell how to "
    "set {them}. Pass {them} for each call: {fix}."
)
_GIVE_A_FLAG = (
    "Give __call__ a flag, def __call__(self, x, train: bool = False), and pass it on: "
    "nn.Dropout(rate, deterministic=not train), nn.BatchNorm(use_running_average=not train)."
)
_STREAM, _COLLECTION = r'needs PRNG for "([^"]+)"', r'collection "([^"]+)"'


def bound(fn: Any, axes: tuple[str, ...]) -> Any:
    """``fn`` with each axis bound as ``jax.pmap`` on one device binds it, unless a transform
    around the call binds it (``shard_step``'s mesh axis): then the reduction spans shards."""

    def call(*args: Any) -> Any:
        run = fn
        for axis in axes:
            try:
                jax.lax.axis_size(axis)  # bound by a transform around the call
            except NameError:
                run = jax.vmap(run, in_axes=None, out_axes=None, axis_name=axis, axis_size=1)
        return run(*args)

    return call if axes else fn


def unbound_axes(fn: Any, *args: Any, axes: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``axes``, and the axis names that ``fn(*args)`` reduces over and no transform binds."""
    try:
        jax.eval_shape(bound(fn, axes), *args)
    except NameError as e:
        if (axis := unbound_axis(e)) is None or axis in axes:
            raise
        return unbound_axes(fn, *args, axes=(*axes, axis))
    return axes


def shown_flags(flags: dict[str, Any]) -> str:
    return "".join(f", {k}={v!r}" for k, v in flags.items())


def _parameters(model: nn.Module) -> dict[str, inspect.Parameter]:  # __call__'s, less self
    return dict(list(inspect.signature(type(model).__call__).parameters.items())[1:])


def _quoted(pattern: str, error: Exception) -> str:
    return found.group(1) if (found := re.search(pattern, str(error))) else "?"


def init_variables(model: nn.Module, key: jax.Array, example: Any, flags: dict[str, Any]) -> Any:
    """``model.init(key, example, **flags)``, a ``dropout`` stream given when ``flags`` train."""
    rngs = {"params": key, "dropout": jax.random.fold_in(key, 2)} if flags else key
    return model.init(rngs, example, **flags)


def _bool_keyword(model: nn.Module) -> tuple[str, bool] | None:
    """The first parameter of ``__call__`` with a bool default: the likeliest mode flag."""
    found = ((f, p.default) for f, p in _parameters(model).items() if isinstance(p.default, bool))
    return next(found, None)


def _fix(model: nn.Module, form: str = TRAIN_FORM) -> str:
    """The likeliest fix for a model whose mode train() cannot switch: its flag, or why not."""
    if (found := _bool_keyword(model)) is not None:
        flag, default = found
        spelt = form.format(on={flag: not default}, off={flag: default})
        return f"If {flag} is its mode, name it: {spelt}."
    for field in dataclasses.fields(model) if dataclasses.is_dataclass(model) else ():
        value = getattr(model, field.name, None)
        if field.name not in ("parent", "name") and isinstance(value, bool):
            return (
                f"Its mode looks like the attribute {type(model).__name__}({field.name}={value}), "
                f"fixed for every call, while training switches the mode per call. {_GIVE_A_FLAG}"
            )
    return _GIVE_A_FLAG


def _training_part(model: nn.Module, variables: Any, example: Any, flags: dict, axes=()) -> tuple:
    """What a call with ``flags`` does that an inference call must not (``None``: nothing), and
    its output's shape (``None`` unless it does nothing of that); ``axes`` bound."""
    try:
        run = bound(lambda v, x: model.apply(v, x, **flags), axes)
        return None, jax.eval_shape(run, variables, example)
    except flax.errors.InvalidRngError as e:
        return f"draws from the rng stream {_quoted(_STREAM, e)!r}", None
    except flax.errors.ModifyScopeVariableError as e:
        return f"updates the collection {_quoted(_COLLECTION, e)!r}", None


def find_flags(
    model: Any, train_flags: Any, eval_flags: Any, caller: str, form: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword settings of a training and an inference call: as given (checked against
    ``__call__``'s parameters), else found by name."""
    params = _parameters(model)
    if train_flags is None and eval_flags is None:
        found = [(flag, on) for flag, on in _FLAGS if flag in params]
        return {f: on for f, on in found}, {f: not on for f, on in found}
    for arg, flags in (("train_flags", train_flags), ("eval_flags", eval_flags)):
        what = {"caller": caller, "arg": arg, "model": type(model).__name__}
        flags = {} if flags is None else flags
        if not isinstance(flags, Mapping) or not all(isinstance(k, str) for k in flags):
            raise ConfigError(_BAD_FLAGS.format(**what, flags=flags))
        unknown = [f for f in flags if f not in params]
        if unknown and all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values()):
            names, fix = ", ".join(params), _fix(model, form)
            raise ConfigError(_UNKNOWN_FLAG.format(**what, flag=unknown[0], names=names, fix=fix))
    return dict(train_flags or {}), dict(eval_flags or {})


def model_spec(
    model: nn.Module, example: Any, train: dict[str, Any], evals: dict[str, Any], *,
    given: bool, caller: str, form: str,
) -> ModelSpec:  # fmt: skip
    """The :class:`ModelSpec` of a linen model; with no flags found or ``given``, refuses one that
    would silently train in inference mode. For train() (``TRAIN_FORM``) each call must set
    the flags ``__call__`` requires, and its inference call must be one (:attr:`ModelSpec.out`)."""
    name = type(model).__name__
    # init is called with the flags __call__ requires: train()'s as its steps set them, the
    # pieces' as an inference (else a training) call does
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = list(_parameters(model).values())[1:]  # the input first
    required = [p.name for p in params if p.default is p.empty and p.kind in kinds]
    both = form == TRAIN_FORM  # train() makes training and inference calls; the pieces, one
    calls = (train, evals) if both else ({**train, **evals},)
    if missing := [n for n in required if any(n not in call for call in calls)]:
        fix = form.format(on=dict.fromkeys(missing, True), off=dict.fromkeys(missing, False))
        names, them = ", ".join(map(repr, missing)), "it" if len(missing) == 1 else "them"
        what = {"caller": caller, "model": name, "names": names, "them": them, "fix": fix}
        raise ConfigError(_REQUIRED.format(**what))
    init = {n: calls[0][n] for n in required}  # train(): as its steps call
    init_call = functools.partial(init_variables, model, flags=init)
    variables = jax.eval_shape(init_call, jax.random.key(0), example)
    mutable = tuple(c for c in variables if c != "params")

    def run(v: Any, x: Any, rngs: Any = None) -> Any:
        return model.apply(v, x, rngs=rngs, mutable=list(mutable), **train)

    try:
        axes, rng = unbound_axes(run, variables, example), False
    except flax.errors.InvalidRngError:
        try:
            axes, rng = unbound_axes(run, variables, example, {"dropout": jax.random.key(0)}), True
        except flax.errors.InvalidRngError as e:
            what = {"caller": caller, "model": name, "stream": _quoted(_STREAM, e)}
            if what["stream"] == "dropout":  # given, and dropped by a lifted transform inside
                error = f"a training call of {name}: {str(e).split(' (')[0]}"
                what = {"name": caller, "error": error, "giver": "training", "stream": "dropout"}
                raise ConfigError(LIFTED_RNG.format(**what)) from None
            raise ConfigError(_OTHER_STREAM.format(**what)) from None
    if not given and not train:
        _refuse_inference_mode(model, variables, example, mutable, caller, form, axes)
    does, out = _training_part(model, variables, example, evals, axes) if both else (None, None)
    if does is None:  # its inference call is one (train()'s), or none is made (the pieces')
        return ModelSpec(train, evals, mutable, rng, init, out, axes)
    off = "Pass eval_flags that turn training off. " if _bool_keyword(model) is not None else ""
    call = f"model.apply(variables, x{shown_flags(evals)})"
    what = {"caller": caller, "model": name, "call": call, "does": does}
    raise ConfigError(NOT_INFERENCE.format(**what, fix=off + _fix(model)))


def _refuse_inference_mode(
    model: nn.Module, variables: Any, example: Any, mutable: tuple, caller: str, form: str, axes
) -> None:
    """Raises if training with the model's defaults would silently be inference."""
    if _training_part(model, variables, example, {}, axes)[0] is not None:
        return  # its defaults train (a mode set as an attribute): an inference call will tell
    flipped = None
    if (found := _bool_keyword(model)) is not None:
        flag, default = found
        with contextlib.suppress(Exception):  # not a mode switch: it cannot run flipped
            flipped = _training_part(model, variables, example, {flag: not default}, axes)[0]
    if flipped is not None:
        fix = f"A call with {flag}={not default} {flipped}. {_fix(model, form)}"
    elif mutable:
        none = "train_flags={}, eval_flags={}" if form == TRAIN_FORM else "train_flags={}"
        fix = f"{_GIVE_A_FLAG} For a model with no mode to switch, pass {none}."
    else:
        return  # stateless, and no keyword makes it train: nothing is lost
    state = f"none of its state ({', '.join(map(repr, mutable))})" if mutable else "no state"
    lost = f"its {' and '.join(mutable)} never moving and no dropout" if mutable else "no dropout"
    name = type(model).__name__
    raise ConfigError(_NO_FLAG.format(caller=caller, model=name, state=state, lost=lost, fix=fix))


_NNX_FLAG = (
    "Give __call__ a flag and pass it on, def __call__(self, x, train: bool = False): "
    "self.drop(x, deterministic=not train), self.norm(x, use_running_average=not train); or "
    "leave the mode to the attributes that module.train() sets (deterministic, "
    "use_running_average), which training sets for its steps."
)
_NNX_STILL = (
    "{caller}: a training call of {model} (its attributes as module.train() sets them{flags}) "
    "updates none of its state ({state}): every step would run it in inference mode. {fix} "
    "For a model whose state never moves, pass train_flags={{}}."
)


#: where the state carries the key of :attr:`NnxSpec.call_rngs` (no attribute's name)
CALL_RNG = "__call_rngs__"


@dataclasses.dataclass(frozen=True)
class NnxSpec:
    """How to call an nnx classifier in each mode: its flags, the module as a pure function,
    its bool attributes, ``Param`` values and other variables, an inference call's output."""

    train_flags: dict[str, Any]
    eval_flags: dict[str, Any]
    pure: PureModel
    train_mode: tuple
    eval_mode: tuple
    params: Any
    state: Any
    out: jax.ShapeDtypeStruct
    #: the keyword a training call passes a fresh ``nnx.Rngs`` to, or ``None``
    call_rngs: str | None = None
    axes: tuple[str, ...] = ()  #: as :attr:`ModelSpec.axes`

    @property
    def stateful(self) -> bool:
        return self.pure.stateful or self.call_rngs is not None

    def raw(self, state: Any, key: Any = None) -> Any:
        """``state`` with its rng keys as raw key data (and :attr:`call_rngs`' ``key``)."""
        treedef, impls = state_structure(state)
        raw = jax.tree.unflatten(treedef, unwrap_keys(jax.tree.leaves(state), impls))
        return raw if self.call_rngs is None else {**raw, CALL_RNG: jax.random.key_data(key)}

    def typed(self, raw: Any) -> Any:
        """The inverse of :meth:`raw` (the :attr:`call_rngs` key dropped)."""
        if self.call_rngs is not None:
            raw = {k: v for k, v in raw.items() if k != CALL_RNG}
        treedef, impls = state_structure(self.state)
        return jax.tree.unflatten(treedef, wrap_keys(jax.tree.leaves(raw), impls))

    def call(
        self, params: Any, state: Any, x: Any, *, train: bool, key: Any = None
    ) -> tuple[Any, Any]:
        """``(logits, new state)`` of a call in either mode (``key``: :attr:`call_rngs`')."""
        flags, rngs = self.train_flags if train else self.eval_flags, self.call_rngs
        key, rngs = jax.random.key(0) if key is None else key, rngs if train else None

        def run(params: Any, state: Any, x: Any, key: Any) -> Any:  # its Rngs made in the trace
            kw = flags if rngs is None else {**flags, rngs: nnx.Rngs(key)}
            return self.pure.call(params, state, (x,), kw)

        with self.pure.pinned(self.train_mode if train else self.eval_mode):
            return bound(run, self.axes)(params, state, x, key)

    def step(self, params: Any, raw: Any, x: Any, *, train: bool) -> tuple[Any, Any]:
        """``(logits, new raw state)`` of a call from :meth:`raw` state."""
        key = sub = None
        if train and self.call_rngs is not None:
            key, sub = jax.random.split(jax.random.wrap_key_data(raw[CALL_RNG]))
        logits, state = self.call(params, self.typed(raw), x, train=train, key=sub)
        return logits, self.raw(state, key) if train else raw

    def module(self, params: Any, state: Any) -> nnx.Module:
        """A new module holding ``params`` and ``state``, in eval mode."""
        with self.pure.pinned(self.eval_mode):
            return self.pure.module(params, state)


def spec_of(
    module: Any, example: Any, train_flags: Mapping[str, Any] | None,
    eval_flags: Mapping[str, Any] | None = None, *, caller: str, form: str,
) -> ModelSpec | NnxSpec:  # fmt: skip
    """:func:`model_spec` of a linen model; the :class:`NnxSpec` of an nnx module, whose training
    call must move its state (if it has any and no flags were given), its inference call not."""
    train, evals = find_flags(module, train_flags, eval_flags, caller, form)
    example = jax.ShapeDtypeStruct(example.shape, example.dtype)
    if not isinstance(module, nnx.Module):
        given = train_flags is not None
        return model_spec(module, example, train, evals, given=given, caller=caller, form=form)
    named = "rngs" if "rngs" in _parameters(module) else None
    rngs = next((k for k, v in train.items() if isinstance(v, nnx.Rngs)), named)
    train = {k: v for k, v in train.items() if k != rngs}
    required = _parameters(module).get(rngs or "")
    if required is not None and required.default is required.empty and rngs not in evals:
        evals = {**evals, rngs: None}  # inference draws nothing, but the call requires rngs
    pure, params, state = nnx_module(module)
    now = pure.settings() if pure.settings is not None else ()
    modes = mode_settings(pure, now, train=True), mode_settings(pure, now, train=False)
    spec = NnxSpec(train, evals, pure, *modes, params, state, None, rngs)  # type: ignore[arg-type]
    name, run = type(module).__name__, functools.partial(spec.call, train=True)
    spec = dataclasses.replace(spec, axes=unbound_axes(run, params, state, example))
    moved, _ = _moves(spec, example, train=True)
    if pure.stateful and train_flags is None and not moved:
        fix = _fix(module, form) if _bool_keyword(module) is not None else _NNX_FLAG
        flags, names = shown_flags(train), ", ".join(_paths(state))
        what = {"caller": caller, "model": name, "flags": flags, "state": names, "fix": fix}
        raise ConfigError(_NNX_STILL.format(**what))
    moved, out = _moves(spec, example, train=False)
    if moved:
        call = f"its attributes as module.eval() sets them{shown_flags(evals)}"
        fix = "Pass eval_flags that turn training off, e.g. eval_flags={'train': False}."
        what = {"caller": caller, "model": name, "call": call, "does": f"updates {moved}"}
        raise ConfigError(NOT_INFERENCE.format(**what, fix=fix))
    return dataclasses.replace(spec, out=out)


def _moves(spec: NnxSpec, example: Any, *, train: bool) -> tuple[str, Any]:
    """The state a call updates (its leaves' names, ``""`` for none) and its output's shape."""
    run = functools.partial(spec.call, train=train)
    closed, shapes = jax.make_jaxpr(run, return_shape=True)(spec.params, spec.state, example)
    jaxpr = closed.jaxpr  # its inputs: params, then state; its outputs end with the state
    n_params, n_state = len(jax.tree.leaves(spec.params)), len(jax.tree.leaves(spec.state))
    ins = jaxpr.invars[n_params : n_params + n_state]
    outs = jaxpr.outvars[len(jaxpr.outvars) - n_state :]
    moved = [p for p, i, o in zip(_paths(spec.state), ins, outs, strict=True) if o is not i]
    return ", ".join(moved), shapes[0]


def _paths(state: Any) -> list[str]:
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in leaves]
