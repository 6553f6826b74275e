"""A training step run data-parallel: batch split over a mesh axis, state replicated.

The step's loss is a ``w``-weighted mean over the batch, so XLA inserts the all-reduce of the
gradients itself; a batch that does not divide over the shards is padded with weight-0 rows,
which the weighted loss ignores exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from symjax_mlp._hybrid.mesh import batch_size, pad_rows, padding, place, shardings


class ShardedStep:
    """A training step run data-parallel; create it with :func:`shard_step`.

    ``s(params, opt_state, x, y, w=None)`` replicates params and optimizer state, pads the
    batch to a multiple of ``n_shards`` with weight 0, splits it over ``axis``, and runs one
    ``jax.jit`` (params and optimizer state donated). Gradients of the weighted-mean loss are
    summed across devices by XLA (an all-reduce in the compiled program).
    """

    def __init__(
        self, step: Callable[..., Any], mesh: Mesh | None, axis: str, donate: bool, pad: bool
    ):
        self.step = step
        self.mesh, self.replicated, self.batch_sharding, self.n_shards = shardings(mesh, axis)
        self.axis, self.pad = axis, pad
        rep, dat = self.replicated, self.batch_sharding
        self._jitted = jax.jit(
            step,
            in_shardings=(rep, rep, dat, dat, dat),
            out_shardings=(rep, rep, rep),
            donate_argnums=(0, 1) if donate else (),
        )

    def replicate(self, tree: Any) -> Any:
        """``tree`` placed on every device of the mesh (params, optimizer state)."""
        return jax.tree.map(lambda a: place(a, self.replicated), tree)

    def shard_batch(self, x: Any, y: Any, w: Any = None) -> tuple[jax.Array, ...]:
        """``(x, y, w)`` padded with weight-0 rows to a multiple of ``n_shards``, then split."""
        batch = batch_size((x, y) if w is None else (x, y, w), "shard_step(...)")
        w = np.ones(batch, np.float32) if w is None else w
        extra = padding(batch, self.n_shards, self.pad, "shard_step(...)")
        arrays = (pad_rows(x, extra), pad_rows(y, extra), pad_rows(w, extra, fill=0))
        return tuple(place(a, self.batch_sharding) for a in arrays)

    def __call__(self, params: Any, opt_state: Any, x: Any, y: Any, w: Any = None) -> Any:
        """One step: ``(params, opt_state, metrics)``, all replicated."""
        return self._jitted(
            self.replicate(params), self.replicate(opt_state), *self.shard_batch(x, y, w)
        )

    def lower(self, params: Any, opt_state: Any, x: Any, y: Any, w: Any = None):
        """The lowered step; ``.compile().as_text()`` shows XLA's all-reduce of the gradients."""
        return self._jitted.lower(
            self.replicate(params), self.replicate(opt_state), *self.shard_batch(x, y, w)
        )


def shard_step(
    step: Callable[..., Any],
    mesh: Mesh | None = None,
    *,
    axis: str = "data",
    donate: bool = True,
    pad: bool = True,
) -> ShardedStep:
    """Runs a training step data-parallel: batch split over ``axis``, state replicated.

    Args:
      step: ``step(params, opt_state, x, y, w) -> (params, opt_state, metrics)`` whose loss is
        a ``w``-weighted mean over the batch, e.g. :func:`symjax_mlp.training.train_step`.
      mesh: a ``jax.sharding.Mesh`` (default: :func:`~symjax_mlp.data_mesh` over every device, all
        processes included after ``jax.distributed.initialize``).
      axis: the mesh axis the batch is split over.
      donate: donate params and optimizer state to the step (their old buffers are reused).
      pad: pad an indivisible batch with weight-0 rows, exact for a ``w``-weighted loss
        (``False``: raise :class:`~symjax_mlp.SignatureError`).

    Returns:
      A :class:`ShardedStep`; its params after N steps equal single-device training up to
      float rounding.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import symjax_mlp as sm
      >>> net, x, y = sm.mlp((8, 3)), jnp.ones((4, 5)), jnp.array([0, 1, 2, 0])
      >>> params = net.init(jax.random.key(0), x)["params"]
      >>> step = sm.training.shard_step(sm.training.train_step(net, optax.sgd(0.1)))
      >>> params, opt_state, metrics = step(params, optax.sgd(0.1).init(params), x, y)
      >>> sorted(metrics)
      ['correct', 'loss']
    """
    return ShardedStep(step, mesh, axis, donate, pad)
