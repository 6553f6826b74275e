"""The training step: pure and un-jitted.

:func:`train_step` is ``jax.value_and_grad`` of the softmax cross-entropy followed by the optax
update, as a pure function of ``(params, opt_state, batch)``; callers apply ``jax.jit`` (with
the params and optimizer state donated) at their own boundary, as
:func:`~symjax_mlp.training.train` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

#: ``step(params, opt_state, x, y, w) -> (params, opt_state, {"loss", "correct"})``.
Step = Callable[..., tuple[Any, Any, dict[str, jax.Array]]]


@functools.partial(jax.jit, static_argnums=0)
def init_params(model: nn.Module, key: jax.Array, example: jax.Array) -> Any:
    """``model.init(key, example)["params"]``, compiled once per model and input signature.

    Compiled because eagerly each initializer op compiles on its own (seconds on a CPU), and
    cached on the (hashable) module, so repeated runs of one model pay it once.
    """
    return model.init(key, example)["params"]


def train_step(model: nn.Module, optimizer: optax.GradientTransformation) -> Step:
    """The pure training step ``step(params, opt_state, x, y, w) -> (params, opt_state, metrics)``.

    The loss is the softmax cross-entropy of ``model`` against integer labels ``y``, averaged
    with per-example weights ``w`` (0 marks padding); ``metrics`` holds the batch ``"loss"``
    and the weighted count of ``"correct"`` predictions (before the update). The step is not
    jitted: wrap it in ``jax.jit(step, donate_argnums=(0, 1))`` to compile it.

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

    def loss_fn(params: Any, x: jax.Array, y: jax.Array, w: jax.Array):
        logits = model.apply({"params": params}, x)
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, y)
        loss = jnp.sum(w * losses) / jnp.maximum(jnp.sum(w), 1.0)
        correct = jnp.sum(w * (jnp.argmax(logits, axis=-1) == y))
        return loss, correct

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array, w: jax.Array):
        (loss, correct), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y, w)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "correct": correct}

    return step
