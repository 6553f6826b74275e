"""The training step, pure and un-jitted: the loss is a ``w``-weighted mean (0 marks padding),
so the same step runs data-parallel (:mod:`._shard`) and XLA inserts the gradients' all-reduce."""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.errors import ScopeParamShapeError

from symjax_mlp._errors import ConfigError, SignatureError, as_int
from symjax_mlp._hybrid.trace import unfit_input
from symjax_mlp.training._optimizer import update
from symjax_mlp.training._spec import STEP_FORM, ModelSpec, NnxSpec, bound, init_variables, spec_of
from symjax_mlp.training._state import is_count


class Step(Protocol):
    """The type of what :func:`train_step` returns (and :func:`shard_step` runs in parallel).

    ``step(params, opt_state, x, y, w) -> (params, opt_state, {"loss", "correct"})``: the
    params and optimizer state after one optax update on the batch ``x``, ``y`` with
    per-example weights ``w`` (0 marks padding), and the batch's metrics.
    """

    def __call__(
        self, params: Any, opt_state: Any, x: Any, y: Any, w: Any, /
    ) -> tuple[Any, Any, dict[str, jax.Array]]:
        """One update of ``params`` and ``opt_state`` on inputs ``x``, labels ``y`` and weights
        ``w``: the new params, the new optimizer state and the batch's metrics."""


NOT_FLAX = (
    "{caller}: the model must be a flax.linen or nnx module; got a {kind}. "
    "For another model, write the loop with optax over the Hybrid's pure form: "
    "h = sm.hybridize(fn, params) (an equinox module: h = sm.hybridize(model), h.params its "
    "arrays); loss(params) on h.apply(params, x) (every keyword is your function's: an "
    "equinox-style out, state = h.apply(params, x, state=state) passes your state), jax.grad "
    "of it, and h.replace(params=...) for the trained model."
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelVars:
    """The ``params`` a model's optimizer updates, and its ``state``, as one pytree: its other
    collections (``batch_stats``) and, under ``"rng"``, its ``dropout`` stream's raw key data."""

    params: Any
    state: Any


def init_params(
    model: Any,
    key: jax.Array,
    example: jax.Array,
    *,
    train_flags: Mapping[str, Any] | None = None,
) -> Any:
    """``model.init(key, example)["params"]``, compiled once per model and input signature.

    A model with state (BatchNorm's ``batch_stats``, a ``dropout`` rng) gets a
    :class:`ModelVars` of its params and that state. An nnx module, initialised when built,
    gives copies of its values (rng keys as raw key data); ``key`` is not used.

    Args:
      model: a ``flax.linen`` classifier, or an ``nnx.Module`` one.
      key: the initialisation key.
      example: one batch of inputs (its shape and dtype).
      train_flags: as for :func:`train_step`.

    Raises:
      ConfigError: without ``train_flags``, training with the model's defaults would silently
        be inference (its flag has another name).
    """
    caller = f"symjax_mlp.training.init_params({type(model).__name__}, ...)"
    check_model(model, caller)
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == np.uint32 and np.shape(key) == (2,)  # jax.random.PRNGKey's
    if not (isinstance(model, nnx.Module) or typed or raw):  # else flax's InvalidRngError
        raise ConfigError(
            f"{caller}: key must be a PRNG key, e.g. jax.random.key(0); got "
            f"{type(key).__name__} {key!r:.60}."
        )
    example = example if hasattr(example, "shape") else np.asarray(example)  # lists
    spec = spec_of(model, example, train_flags, caller=caller, form=STEP_FORM)
    return init_of(model, spec, key, example)


def check_model(model: Any, caller: str) -> None:
    if not isinstance(model, nn.Module | nnx.Module):
        raise ConfigError(NOT_FLAX.format(caller=caller, kind=type(model).__name__))


def init_of(model: Any, spec: ModelSpec | NnxSpec, key: jax.Array, example: jax.Array) -> Any:
    """:func:`init_params` of a model whose spec is known (train()'s)."""
    if isinstance(spec, NnxSpec):  # built initialised: its values, in buffers of its own
        params, state = owned((spec.params, spec.raw(spec.state, jax.random.fold_in(key, 1))))
        return ModelVars(params, state) if spec.stateful else params
    settings = (model, spec.mutable, spec.rng, tuple(spec.init_flags.items()))
    try:
        hash(settings)
    except TypeError:  # a module holding a dict or a namespace (a ConfigDict): not a jit key
        return strong(_init.__wrapped__(*settings, key, example))
    return strong(_init(*settings, key, example))


def strong(tree: Any) -> Any:
    """``tree`` with its weakly typed leaves (a ``1.0``) strongly typed, as a step returns them
    (a jitted step would trace again for them)."""
    return jax.tree.map(
        lambda a: jnp.asarray(a, jnp.result_type(a)) if getattr(a, "weak_type", True) else a, tree
    )


def owned(tree: Any) -> Any:
    """:func:`strong` ``tree``, each leaf a buffer of its own, for a step to donate: one may be
    a param (aliased) or the optimizer's (noisy_sgd's key, found deleted by a second train())."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True), strong(tree))


def check_trainable(params: Any, caller: str) -> None:
    """Refuses params with nothing to differentiate, or a leaf jax.grad cannot (an int)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    odd = [(p, a) for p, a in leaves if not jnp.issubdtype(jnp.result_type(a), jnp.inexact)]
    if not leaves or odd:
        got = "no params"
        if odd:
            got = f"params{jax.tree_util.keystr(odd[0][0])} of dtype {jnp.result_type(odd[0][1])}"
        raise ConfigError(
            f"{caller}: the model has {got}; train() differentiates every param, so it needs at "
            "least one, all floats. Make an int param a float one, or a constant of the module "
            "(an attribute, not a param)."
        )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _init(model: nn.Module, mutable: tuple, rng: bool, flags: tuple, key: jax.Array, example: Any):
    variables = init_variables(model, key, example, dict(flags))
    if not mutable and not rng:
        return variables.get("params", {})
    state = {c: variables[c] for c in mutable}
    if rng:
        state["rng"] = jax.random.key_data(jax.random.fold_in(key, 1))
    return ModelVars(variables.get("params", {}), state)


def apply_model(model: Any, spec: ModelSpec | NnxSpec, params: Any, x: jax.Array, *, train: bool):
    """``(logits, params)``: a :class:`ModelVars`' state moves on when ``train``, as in Flax."""
    if isinstance(spec, NnxSpec):
        if not isinstance(params, ModelVars):
            return spec.call(params, {}, x, train=train)[0], params
        logits, state = spec.step(params.params, params.state, x, train=train)
        return logits, ModelVars(params.params, state)
    flags = spec.train_flags if train else spec.eval_flags

    def apply(variables: Any, **kw: Any) -> Any:  # spec.axes bound (BatchNorm(axis_name=...))
        return bound(lambda v, x: model.apply(v, x, **kw, **flags), spec.axes)(variables, x)

    if not isinstance(params, ModelVars):
        return apply({"params": params}), params
    variables = {"params": params.params, **{c: params.state[c] for c in spec.mutable}}
    if not train:
        return apply(variables), params
    state, rngs = dict(params.state), None
    if spec.rng:
        key, sub = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        state["rng"], rngs = jax.random.key_data(key), {"dropout": sub}
    logits, updates = apply(variables, rngs=rngs, mutable=list(spec.mutable))
    return logits, ModelVars(params.params, {**state, **updates})


def train_step(
    model: Any,
    optimizer: optax.GradientTransformation,
    *,
    train_flags: Mapping[str, Any] | None = None,
    blocks: int = 1,
) -> Step:
    """The pure training step ``step(params, opt_state, x, y, w) -> (params, opt_state, metrics)``.

    ``params`` is what :func:`init_params` gives: the ``"params"`` collection, or a
    :class:`ModelVars` whose state moves on every step. The loss is the softmax cross-entropy
    against integer labels ``y``, averaged with per-example weights ``w`` (0 marks padding);
    ``metrics`` holds the ``"loss"`` and the weighted count of ``"correct"`` predictions. Not
    jitted: compile it with ``jax.jit(step, donate_argnums=(0, 1))``. An nnx module's steps
    run with its attributes as ``module.train()`` sets them. A reduction over an axis name no
    transform binds (``BatchNorm(axis_name='batch')``, as Flax's imagenet ResNet, which its
    ``train.py`` runs under ``jax.pmap``) is over the whole batch, as ``jax.pmap`` on one device
    makes it.

    Args:
      model: a ``flax.linen`` classifier, or an ``nnx.Module`` one.
      optimizer: any ``optax.GradientTransformation``.
      train_flags: the keyword settings of a training call, e.g. ``{"is_training": True}``
        (default: ``train``, ``training`` or ``deterministic``, whichever ``__call__`` takes).
      blocks: split the batch into this many equal blocks and add their gradients in block
        order: the params are then bitwise the same on one device and, under
        :func:`shard_step`, on any number of shards that divides ``blocks`` (a model without
        state; the batch a multiple of ``blocks``). ``1``: one gradient of the whole batch.

    Returns:
      The step; its first call (its trace) raises :class:`~symjax_mlp.ConfigError` for a
      model with state or a ``dropout`` rng whose flag was neither found nor given.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import symjax_mlp as sm
      >>> net, opt = sm.mlp((8, 3)), optax.adam(1e-2)
      >>> x, y, w = jnp.ones((4, 5)), jnp.array([0, 1, 2, 0]), jnp.ones(4)
      >>> params = net.init(jax.random.key(0), x)["params"]
      >>> step = jax.jit(sm.training.train_step(net, opt), donate_argnums=(0, 1))
      >>> params, opt_state, metrics = step(params, opt.init(params), x, y, w)
      >>> sorted(metrics)
      ['correct', 'loss']
    """
    return step_of(model, optimizer, train_flags=train_flags, blocks=blocks)


def step_of(
    model: Any, optimizer: optax.GradientTransformation, *, train_flags: Any = None,
    blocks: int = 1, known: ModelSpec | NnxSpec | None = None,
) -> Step:  # fmt: skip
    """:func:`train_step`; given train()'s spec (``known``), it is not worked out again."""
    caller, blocks = f"symjax_mlp.training.train_step({type(model).__name__}, ...)", as_int(blocks)
    check_model(model, caller)
    if not is_count(blocks, 1):
        raise ConfigError(f"{caller}: blocks must be an int >= 1; got {blocks!r}.")
    if not all(callable(getattr(optimizer, f, None)) for f in ("init", "update")):
        raise ConfigError(  # refused now, not as an AttributeError at the step's first call
            f"{caller}: optimizer must be an optax.GradientTransformation, e.g. optax.adam(1e-3) "
            f"(called: optax.adam makes one); got {type(optimizer).__name__} {optimizer!r:.80}."
        )
    specs: dict[tuple[Any, ...], Any] = {}  # per input row signature, derived once

    def step(
        params: Any, opt_state: Any, x: jax.Array, y: jax.Array, w: jax.Array, *,
        axis_name: str | None = None,
    ):  # fmt: skip
        rows, y_dtype = jnp.shape(x)[:1], jnp.result_type(y)
        if jnp.shape(y) != rows or jnp.shape(w) != rows or not jnp.issubdtype(y_dtype, jnp.integer):
            got = f"x {jnp.shape(x)}, y {y_dtype}{list(jnp.shape(y))}, w {list(jnp.shape(w))}"
            raise SignatureError(_LABELS.format(caller=caller, got=got, n=rows[0] if rows else 1))
        row = (tuple(x.shape[1:]), x.dtype)
        if (spec := specs.get(row, known)) is None:
            spec = specs[row] = spec_of(model, x[:1], train_flags, caller=caller, form=STEP_FORM)
        stateful = isinstance(params, ModelVars)
        trainable = params.params if stateful else params

        def loss_fn(trainable: Any) -> tuple:
            moved = ModelVars(trainable, params.state) if stateful else trainable
            total, correct, moved = _weighted_loss(model, spec, moved, x, y, w)
            return total / jnp.maximum(jnp.sum(w), 1.0), (correct, moved)

        try:
            if blocks == 1:
                grad = jax.value_and_grad(loss_fn, has_aux=True)
                (loss, (correct, moved)), grads = grad(trainable)
            elif stateful:
                raise ConfigError(_BLOCKS_STATE.format(caller=caller, blocks=blocks))
            else:
                batch = (x, y, w)
                loss, correct, grads = _blocked(model, spec, trainable, batch, blocks, axis_name)
        except ScopeParamShapeError as e:  # x of another width than the params were made for
            if (unfit := unfit_input(caller, e, (x,), {})) is None:
                raise
            raise unfit from None
        updates, moved_state = update(optimizer, grads, opt_state, trainable, loss, caller)
        trainable = optax.apply_updates(trainable, updates)
        params = ModelVars(trainable, moved.state) if stateful else trainable
        return params, moved_state, {"loss": loss, "correct": correct}

    step.blocks = blocks
    return step


def _weighted_loss(model: Any, spec: Any, params: Any, x: Any, y: Any, w: Any) -> tuple:
    """``(sum of w * cross-entropy, weighted count correct, params moved)``."""
    logits, params = apply_model(model, spec, params, x, train=True)
    if not jnp.issubdtype(getattr(logits, "dtype", object), jnp.floating):  # raw JAX/optax errors
        got = f"{logits.dtype}{list(jnp.shape(logits))}" if hasattr(logits, "dtype") else None
        raise ConfigError(
            _NOT_LOGITS.format(got=got or f"a {type(logits).__name__}", x=jnp.shape(x))
        )
    if jnp.shape(logits)[:1] != jnp.shape(x)[:1]:  # optax would broadcast them: a wrong loss
        raise ConfigError(_NOT_LOGITS.format(got=f"logits of shape {logits.shape}", x=jnp.shape(x)))
    losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, y)
    hits = (jnp.argmax(logits, axis=-1) == y).astype(w.dtype)  # (strict promotion: no bool * w)
    return jnp.sum(w * losses), jnp.sum(w * hits), params


_NOT_LOGITS = (
    "symjax_mlp.training.train_step: the model's training call returns {got} for a batch of "
    "shape {x}; expected (batch, classes) float logits, one row per example, which the step's "
    "softmax cross-entropy takes. Return the logits alone, as floats, computed row by row (no "
    "reduction or slicing over the batch axis); another output or loss trains in a loop of your "
    "own (jax.grad of your loss, an optax update)."
)
_LABELS = (
    "{caller}: the step got {got}; expected one integer label y and one weight w per row of "
    "x, y int32[{n}] and w float32[{n}] (its shape (batch,) too, not (batch, 1)). Pass "
    "y.astype(jnp.int32).reshape(-1) and w.reshape(-1)."
)
UNEVEN = (
    "{caller}: a batch of {rows} rows does not split into the step's {blocks} equal blocks. "
    "Pass a batch that is a multiple of {blocks}."
)
_BLOCKS_STATE = (
    "{caller}: blocks={blocks} computes each block's gradient alone, but this model has state "
    "(BatchNorm statistics, a dropout rng) that would then move per block, not per batch. "
    "Train it with blocks=1."
)


def _blocked(model: Any, spec: Any, params: Any, batch: tuple, blocks: int, axis: str | None):
    """``(loss, correct, grads)`` of ``blocks`` blocks added in order (under ``shard_map``, each
    device's blocks gathered first)."""
    n = 1 if axis is None else jax.lax.axis_size(axis)
    rows = batch[0].shape[0]
    if rows % (blocks // n):
        raise SignatureError(
            UNEVEN.format(caller=f"train_step(..., blocks={blocks})", rows=rows * n, blocks=blocks)
        )

    def part(p: Any, x: jax.Array, y: jax.Array, w: jax.Array):
        total, correct, _ = _weighted_loss(model, spec, p, x, y, w)
        return total, (correct, jnp.sum(w))

    split = [a.reshape(blocks // n, -1, *a.shape[1:]) for a in batch]
    per = jax.lax.map(lambda b: jax.value_and_grad(part, has_aux=True)(params, *b), split)
    if axis is not None:
        per = jax.lax.all_gather(per, axis, tiled=True)
    in_order = functools.partial(functools.reduce, operator.add)  # block 0 + block 1 + ...
    (loss, (correct, weight)), grads = jax.tree.map(in_order, per)
    weight = jnp.maximum(weight, 1.0)
    return loss / weight, correct, jax.tree.map(lambda g: g / weight, grads)
