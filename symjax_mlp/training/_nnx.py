"""How training calls an nnx module: its ``Param`` values are trained, all else is its state.

Steps run in ``module.train()``'s mode, evaluations in ``eval()``'s; the module is never changed.
The state a call moves is read from its staged program: a model that would train in inference
mode is refused. A ``__call__`` taking ``rngs`` gets a fresh ``nnx.Rngs`` every step.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from symjax_mlp._errors import ConfigError
from symjax_mlp._hybrid.pure import (
    PureModel,
    mode_settings,
    nnx_module,
    state_structure,
    unwrap_keys,
    wrap_keys,
)
from symjax_mlp.training._spec import (
    NOT_INFERENCE,
    ModelSpec,
    _bool_keyword,
    _fix,
    _parameters,
    find_flags,
    model_spec,
    shown_flags,
)

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
        flags = self.train_flags if train else self.eval_flags
        if train and self.call_rngs is not None:
            flags = {**flags, self.call_rngs: nnx.Rngs(jax.random.key(0) if key is None else key)}
        with self.pure.pinned(self.train_mode if train else self.eval_mode):
            return self.pure.call(params, state, (x,), flags)

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
    module: Any,
    example: Any,
    train_flags: Mapping[str, Any] | None,
    eval_flags: Mapping[str, Any] | None = None,
    *,
    caller: str,
    form: str,
) -> ModelSpec | NnxSpec:
    """:func:`model_spec` of a linen model; the :class:`NnxSpec` of an nnx module, checked: a
    training call must move its state (when it has any and no flags were given), an inference
    call must not."""
    if not isinstance(module, nnx.Module):
        return model_spec(module, example, train_flags, eval_flags, caller=caller, form=form)
    train, evals = find_flags(module, train_flags, eval_flags, caller, form)
    named = "rngs" if "rngs" in _parameters(module) else None
    rngs = next((k for k, v in train.items() if isinstance(v, nnx.Rngs)), named)
    train = {k: v for k, v in train.items() if k != rngs}
    required = _parameters(module).get(rngs or "")
    if required is not None and required.default is required.empty and rngs not in evals:
        evals = {**evals, rngs: None}  # inference draws nothing, but the call requires rngs
    pure, params, state = nnx_module(module)
    now = pure.settings() if pure.settings is not None else ()
    modes = mode_settings(pure, now, train=True), mode_settings(pure, now, train=False)
    example = jax.ShapeDtypeStruct(example.shape, example.dtype)
    spec = NnxSpec(train, evals, pure, *modes, params, state, None, rngs)  # type: ignore[arg-type]
    name = type(module).__name__
    moved, _ = _moves(spec, example, train=True)
    if pure.stateful and train_flags is None and not moved:
        fix = _fix(module, form) if _bool_keyword(module) is not None else _NNX_FLAG
        flags, names = shown_flags(train), ", ".join(_paths(state))
        raise ConfigError(
            _NNX_STILL.format(caller=caller, model=name, flags=flags, state=names, fix=fix)
        )
    moved, out = _moves(spec, example, train=False)
    if moved:
        call = f"its attributes as module.eval() sets them{shown_flags(evals)}"
        fix = "Pass eval_flags that turn training off, e.g. eval_flags={'train': False}."
        does = f"updates {moved}"
        raise ConfigError(
            NOT_INFERENCE.format(caller=caller, model=name, call=call, does=does, fix=fix)
        )
    return dataclasses.replace(spec, out=out)


def _moves(spec: NnxSpec, example: Any, *, train: bool) -> tuple[str, Any]:
    """The state a call updates (its leaves' names, ``""`` for none) and its output's shape."""
    run = functools.partial(spec.call, train=train)
    closed, shapes = jax.make_jaxpr(run, return_shape=True)(spec.params, spec.state, example)
    jaxpr = closed.jaxpr
    n_params, n_state = len(jax.tree.leaves(spec.params)), len(jax.tree.leaves(spec.state))
    ins = jaxpr.invars[n_params : n_params + n_state]
    outs = jaxpr.outvars[len(jaxpr.outvars) - n_state :]
    moved = [p for p, i, o in zip(_paths(spec.state), ins, outs, strict=True) if o is not i]
    return ", ".join(moved), shapes[0]


def _paths(state: Any) -> list[str]:
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in leaves]


def fingerprint(spec: NnxSpec) -> str:
    """The module's eval-mode ``nnx.graphdef`` (layers, widths, rates), without addresses."""
    text = repr(nnx.graphdef(spec.module(spec.params, spec.state)))
    return re.sub(r"0x[0-9a-f]+", "0x", text)
