"""The training step: pure and un-jitted.

:func:`train_step` is ``jax.value_and_grad`` of the softmax cross-entropy followed by the optax
update, as a pure function of ``(params, opt_state, batch)``; callers apply ``jax.jit`` (with
the params and optimizer state donated) at their own boundary, as
:func:`~symjax_mlp.training.train` does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from symjax_mlp.training._nnx import NnxSpec, spec_of
from symjax_mlp.training._spec import STEP_FORM, ModelSpec

#: ``step(params, opt_state, x, y, w) -> (params, opt_state, {"loss", "correct"})``.
Step = Callable[..., tuple[Any, Any, dict[str, jax.Array]]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelVars:
    """The trainable params of a model with state, and that state, as one pytree.

    Attributes:
      params: the ``"params"`` collection: what the optimizer updates.
      state: what the forward pass carries: the model's other collections (``batch_stats``)
        and, under ``"rng"``, the raw key data of its ``dropout`` stream (split every step).
    """

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
    :class:`ModelVars` of its params and that state instead. Compiled because eagerly each
    initializer op is compiled on its own, and cached on the (hashable) module,
    so repeated runs of one model pay it once.

    An nnx module is initialised when it is built: its ``Param`` values (and a
    :class:`ModelVars` of them and its other variables, rng keys as raw key data), copied so
    that a donating step leaves the module alone; ``key`` is not used.

    Args:
      model: a ``flax.linen`` classifier, or an ``nnx.Module`` one.
      key: the initialisation key.
      example: one batch of inputs (its shape and dtype).
      train_flags: the keyword settings of a training call, as for :func:`train_step`
        (default: found by name).

    Raises:
      ConfigError: without ``train_flags``, training with the model's defaults would silently
        be inference (its flag has another name).
    """
    name = type(model).__name__
    caller = f"symjax_mlp.training.init_params({name}, ...)"
    spec = spec_of(model, example, train_flags, caller=caller, form=STEP_FORM)
    if isinstance(spec, NnxSpec):  # built initialised: its values, in buffers of its own
        params = _copy(spec.params)
        return ModelVars(params, _copy(spec.raw(spec.state))) if spec.stateful else params
    return _init(model, spec.mutable, spec.rng, key, example)


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _init(model: nn.Module, mutable: tuple[str, ...], rng: bool, key: jax.Array, example: Any):
    variables = model.init(key, example)
    if not mutable and not rng:
        return variables["params"]
    state = {c: variables[c] for c in mutable}
    if rng:
        state["rng"] = jax.random.key_data(jax.random.fold_in(key, 1))
    return ModelVars(variables["params"], state)


def apply_model(model: Any, spec: ModelSpec | NnxSpec, params: Any, x: jax.Array, *, train: bool):
    """Logits of ``model`` for ``x``, and the new params (a :class:`ModelVars` moves its state).

    Returns:
      ``(logits, params)``; ``params`` is unchanged unless it is a :class:`ModelVars` and
      ``train`` (then its collections and rng move on, exactly as eager Flax would).
    """
    if isinstance(spec, NnxSpec):
        if not isinstance(params, ModelVars):
            return spec.call(params, {}, x, train=train)[0], params
        logits, state = spec.call(params.params, spec.typed(params.state), x, train=train)
        return logits, ModelVars(params.params, spec.raw(state)) if train else params
    flags = spec.train_flags if train else spec.eval_flags
    if not isinstance(params, ModelVars):
        return model.apply({"params": params}, x, **flags), params
    collections = {c: params.state[c] for c in spec.mutable}
    variables = {"params": params.params, **collections}
    if not train:
        return model.apply(variables, x, **flags), params
    state = dict(params.state)
    rngs = None
    if spec.rng:
        key, sub = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        state["rng"], rngs = jax.random.key_data(key), {"dropout": sub}
    logits, updates = model.apply(variables, x, rngs=rngs, mutable=list(spec.mutable), **flags)
    return logits, ModelVars(params.params, {**state, **updates})


def train_step(
    model: Any,
    optimizer: optax.GradientTransformation,
    *,
    train_flags: Mapping[str, Any] | None = None,
) -> Step:
    """The pure training step ``step(params, opt_state, x, y, w) -> (params, opt_state, metrics)``.

    ``params`` is the ``"params"`` collection, or a :class:`ModelVars` for a model with
    BatchNorm or Dropout (its state moves on every step; the optimizer state is of
    ``params.params``); :func:`init_params` gives the right one.

    The loss is the softmax cross-entropy of ``model`` against integer labels ``y``, averaged
    with per-example weights ``w`` (0 marks padding); ``metrics`` holds the batch ``"loss"``
    and the weighted count of ``"correct"`` predictions (before the update). The step is not
    jitted: wrap it in ``jax.jit(step, donate_argnums=(0, 1))`` to compile it.

    An nnx module's steps run with its attributes as ``module.train()`` sets them, whatever
    mode it is in, and its flags (found by name or given) as a linen model's.

    Args:
      model: a ``flax.linen`` classifier, or an ``nnx.Module`` one.
      optimizer: any ``optax.GradientTransformation``.
      train_flags: the keyword settings of a training call, e.g. ``{"is_training": True}``
        (default: ``train=True``, ``training=True`` or ``deterministic=False``, whichever
        ``__call__`` takes); pass the same to :func:`init_params`.

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

    caller = f"symjax_mlp.training.train_step({type(model).__name__}, ...)"

    def loss_fn(spec, trainable: Any, rest: Any, x: jax.Array, y: jax.Array, w: jax.Array):
        params = trainable if rest is None else ModelVars(trainable, rest)
        logits, params = apply_model(model, spec, params, x, train=True)
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, y)
        loss = jnp.sum(w * losses) / jnp.maximum(jnp.sum(w), 1.0)
        correct = jnp.sum(w * (jnp.argmax(logits, axis=-1) == y))
        return loss, (correct, params)

    specs: dict[tuple[Any, ...], Any] = {}  # per input row signature, derived once (eagerly
    # run, every step would split an nnx module and stage it twice again)

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array, w: jax.Array):
        row = (tuple(x.shape[1:]), x.dtype)
        spec = specs.get(row)
        if spec is None:
            spec = specs[row] = spec_of(model, x[:1], train_flags, caller=caller, form=STEP_FORM)
        stateful = isinstance(params, ModelVars)
        trainable, rest = (params.params, params.state) if stateful else (params, None)
        grad_fn = jax.value_and_grad(functools.partial(loss_fn, spec), has_aux=True)
        (loss, (correct, moved)), grads = grad_fn(trainable, rest, x, y, w)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        params = ModelVars(trainable, moved.state) if stateful else trainable
        return params, opt_state, {"loss": loss, "correct": correct}

    return step
