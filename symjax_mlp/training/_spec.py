"""How a classifier is called in training and in inference: its flags, state and rng.

:func:`model_spec` finds, with ``jax.eval_shape``, a flax.linen model's train/inference flags,
the collections a training call updates and whether it draws a ``dropout`` rng. A model that
would silently train in inference mode is refused with a message that names the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import flax
import flax.linen as nn
import jax

from symjax_mlp._errors import ConfigError, ControlFlowError
from symjax_mlp._hybrid.trace import TRACER_ERRORS


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


_CONTROL_FLOW = (
    "{caller}: the model needs a concrete value from a traced array ({error}). train() traces "
    "the model, to initialise it and for jax.grad (compiled or not), where only shapes and "
    "dtypes are known: a Python if/while on an array, float(x), int(x) or np.asarray(x) in "
    "__call__ cannot be decided. Stay symbolic: jnp.where or jax.lax.cond for an if, "
    "jax.lax.while_loop for a while, jnp operations for float(x)."
)


@contextlib.contextmanager
def traced(caller: str) -> Iterator[None]:
    """Raises JAX's tracer errors (the model's Python control flow) as a ControlFlowError."""
    try:
        yield
    except TRACER_ERRORS as e:
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
        raise ControlFlowError(_CONTROL_FLOW.format(caller=caller, error=error)) from e


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


def shown_flags(flags: dict[str, Any]) -> str:
    return "".join(f", {k}={v!r}" for k, v in flags.items())


def _parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    """``__call__``'s parameters after ``self``."""
    return dict(list(inspect.signature(type(model).__call__).parameters.items())[1:])


def _quoted(pattern: str, error: Exception) -> str:
    found = re.search(pattern, str(error))
    return found.group(1) if found else "?"


def _checked(model: nn.Module, flags: Any, arg: str, caller: str, form: str) -> dict[str, Any]:
    name = type(model).__name__
    if not isinstance(flags, Mapping) or not all(isinstance(k, str) for k in flags):
        raise ConfigError(_BAD_FLAGS.format(caller=caller, arg=arg, model=name, flags=flags))
    params = _parameters(model)
    unknown = [f for f in flags if f not in params]
    if unknown and all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values()):
        names, fix = ", ".join(params), _fix(model, form)
        what = {"caller": caller, "arg": arg, "flag": unknown[0], "model": name, "names": names}
        raise ConfigError(_UNKNOWN_FLAG.format(**what, fix=fix))
    return dict(flags)


def init_variables(model: nn.Module, key: jax.Array, example: Any, flags: dict[str, Any]) -> Any:
    """``model.init(key, example, **flags)``, a ``dropout`` stream given when ``flags`` train."""
    rngs = {"params": key, "dropout": jax.random.fold_in(key, 2)} if flags else key
    return model.init(rngs, example, **flags)


def _abstract(model: nn.Module, example: Any, flags: dict[str, Any]) -> tuple[Any, Any]:
    """``example``'s shape and dtype, and the shapes of ``model``'s variables."""
    example = jax.ShapeDtypeStruct(example.shape, example.dtype)
    init = partial(init_variables, model, flags=flags)
    return example, jax.eval_shape(init, jax.random.key(0), example)


def _bool_keyword(model: nn.Module) -> tuple[str, bool] | None:
    """The first parameter of ``__call__`` with a bool default: the likeliest mode flag."""
    for flag, p in _parameters(model).items():
        if isinstance(p.default, bool):
            return flag, p.default
    return None


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


def _training_part(model: nn.Module, variables: Any, example: Any, flags: dict) -> tuple:
    """What a call with ``flags`` does that an inference call must not (``None``: nothing), and
    its output's shape (``None`` unless it does nothing of that)."""
    try:
        return None, jax.eval_shape(lambda v, x: model.apply(v, x, **flags), variables, example)
    except flax.errors.InvalidRngError as e:
        return f"draws from the rng stream {_quoted(_STREAM, e)!r}", None
    except flax.errors.ModifyScopeVariableError as e:
        return f"updates the collection {_quoted(_COLLECTION, e)!r}", None


def find_flags(
    model: Any, train_flags: Any, eval_flags: Any, caller: str, form: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword settings of a training and an inference call: as given (checked against
    ``__call__``'s parameters), else found by name."""
    if train_flags is None and eval_flags is None:
        found = [(flag, on) for flag, on in _FLAGS if flag in _parameters(model)]
        return {f: on for f, on in found}, {f: not on for f, on in found}
    train = {} if train_flags is None else _checked(model, train_flags, "train_flags", caller, form)
    evals = {} if eval_flags is None else _checked(model, eval_flags, "eval_flags", caller, form)
    return train, evals


def model_spec(
    model: nn.Module,
    example: Any,
    train_flags: Mapping[str, Any] | None,
    eval_flags: Mapping[str, Any] | None,
    *,
    caller: str,
    form: str,
) -> ModelSpec:
    """The :class:`ModelSpec` of a linen model; with no flags found or given, refuses one that
    would silently train in inference mode. For train() (``TRAIN_FORM``) each call must set
    the flags ``__call__`` requires, and its inference call must be one (:attr:`ModelSpec.out`)."""
    name = type(model).__name__
    train, evals = find_flags(model, train_flags, eval_flags, caller, form)
    # init is called with the flags __call__ requires: train()'s as its steps set them, the
    # pieces' as an inference (else a training) call does
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = list(_parameters(model).values())[1:]  # the input first
    required = [p.name for p in params if p.default is p.empty and p.kind in kinds]
    flags = {**train, **evals}
    both = form == TRAIN_FORM  # train() makes training and inference calls; the pieces, one
    calls = (train, evals) if both else (flags,)
    if missing := [n for n in required if any(n not in call for call in calls)]:
        fix = form.format(on=dict.fromkeys(missing, True), off=dict.fromkeys(missing, False))
        names, them = ", ".join(map(repr, missing)), "it" if len(missing) == 1 else "them"
        raise ConfigError(
            _REQUIRED.format(caller=caller, model=name, names=names, them=them, fix=fix)
        )
    init = {n: calls[0][n] for n in required}  # train(): as its steps call
    example, variables = _abstract(model, example, init)
    mutable = tuple(c for c in variables if c != "params")
    if train_flags is None and not train:
        _refuse_inference_mode(model, variables, example, mutable, caller, form)

    def run(v: Any, x: Any, rngs: Any = None) -> Any:
        return model.apply(v, x, rngs=rngs, mutable=list(mutable), **train)

    try:
        jax.eval_shape(run, variables, example)
        rng = False
    except flax.errors.InvalidRngError:
        try:
            jax.eval_shape(run, variables, example, {"dropout": jax.random.key(0)})
        except flax.errors.InvalidRngError as e:
            stream = _quoted(_STREAM, e)
            raise ConfigError(
                _OTHER_STREAM.format(caller=caller, model=name, stream=stream)
            ) from None
        rng = True
    spec = ModelSpec(train, evals, mutable, rng, init)
    if both:
        out = inference_shape(model, example, variables, spec, caller=caller)
        return dataclasses.replace(spec, out=out)
    return spec


def _refuse_inference_mode(
    model: nn.Module, variables: Any, example: Any, mutable: tuple[str, ...], caller: str, form: str
) -> None:
    """Raises if training with the model's defaults would silently be inference."""
    if _training_part(model, variables, example, {})[0] is not None:
        return  # its defaults train (a mode set as an attribute): an inference call will tell
    flipped = None
    if (found := _bool_keyword(model)) is not None:
        flag, default = found
        with contextlib.suppress(Exception):  # not a mode switch: it cannot run flipped
            flipped = _training_part(model, variables, example, {flag: not default})[0]
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


def inference_shape(
    model: nn.Module, example: Any, variables: Any, spec: ModelSpec, *, caller: str
) -> Any:
    """The shape of an inference call's output; ConfigError if the call is not inference."""
    flags = spec.eval_flags
    does, out = _training_part(model, variables, example, flags)
    if does is None:
        return out
    fix = _fix(model)
    if _bool_keyword(model) is not None:
        fix = f"Pass eval_flags that turn training off. {fix}"
    call = f"model.apply(variables, x{shown_flags(flags)})"
    name = type(model).__name__
    raise ConfigError(
        NOT_INFERENCE.format(caller=caller, model=name, call=call, does=does, fix=fix)
    )
