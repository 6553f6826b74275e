"""The training step: pure, un-jitted, and timed compiled against eager.

:func:`train_step` is ``jax.value_and_grad`` of the softmax cross-entropy followed by the optax
update, as a pure function of ``(params, opt_state, batch)``; callers apply ``jax.jit`` (with
the params and optimizer state donated) at their own boundary, as :func:`~symjax_mlp.train`
does. :func:`time_train_step` measures the same step both ways, in steps per second.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from symjax_mlp.models import mlp

__all__ = ["Step", "init_params", "time_train_step", "train_step"]

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
      >>> net, opt = mlp((8, 3)), optax.adam(1e-2)
      >>> x, y, w = jnp.ones((4, 5)), jnp.array([0, 1, 2, 0]), jnp.ones(4)
      >>> params = net.init(jax.random.key(0), x)["params"]
      >>> step = jax.jit(train_step(net, opt), donate_argnums=(0, 1))
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


def time_train_step(
    *,
    sizes: tuple[int, ...] = (128, 64, 10),
    in_features: int = 64,
    batch_size: int = 64,
    steps: int = 200,
    eager_steps: int = 20,
    optimizer: optax.GradientTransformation | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Measures the training step compiled (jit, donated) and eager, in steps per second.

    Both run :func:`train_step` on the same synthetic batch. The compiled step's first call
    (trace + compile + run) is timed separately as ``compile_seconds``; each path runs two
    warm-up steps, then ``steps`` (``eager_steps``) timed ones, ending on a
    ``block_until_ready``.

    Returns:
      A dict: ``compiled_steps_per_s``, ``eager_steps_per_s``, ``speedup`` (their ratio),
      ``compile_seconds``, ``steps``, ``eager_steps``, ``batch_size``, ``in_features``,
      ``sizes``, ``backend`` and ``device``.

    Example:
      >>> r = time_train_step(steps=5, eager_steps=2)
      >>> r["speedup"] > 0
      True
    """
    if steps < 1 or eager_steps < 1:
        raise ValueError(f"steps and eager_steps must be >= 1; got {steps}, {eager_steps}.")
    model = mlp(tuple(sizes))
    optimizer = optax.adam(1e-3) if optimizer is None else optimizer
    kx, ky, kp = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (batch_size, in_features), jnp.float32)
    y = jax.random.randint(ky, (batch_size,), 0, sizes[-1], jnp.int32)
    w = jnp.ones(batch_size, jnp.float32)
    step = train_step(model, optimizer)

    def run(fn: Step, n: int) -> tuple[float, float]:
        params = init_params(model, kp, x)
        opt_state = optimizer.init(params)
        t0 = time.perf_counter()
        params, opt_state, _ = fn(params, opt_state, x, y, w)
        jax.block_until_ready(params)
        first = time.perf_counter() - t0
        for _ in range(2):
            params, opt_state, _ = fn(params, opt_state, x, y, w)
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        for _ in range(n):
            params, opt_state, _ = fn(params, opt_state, x, y, w)
        jax.block_until_ready(params)
        return n / (time.perf_counter() - t0), first

    compiled_rate, compile_seconds = run(jax.jit(step, donate_argnums=(0, 1)), steps)
    eager_rate, _ = run(step, eager_steps)
    return {
        "compiled_steps_per_s": compiled_rate,
        "eager_steps_per_s": eager_rate,
        "speedup": compiled_rate / eager_rate,
        "compile_seconds": compile_seconds,
        "steps": steps,
        "eager_steps": eager_steps,
        "batch_size": batch_size,
        "in_features": in_features,
        "sizes": list(sizes),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
    }
