"""A training step run data-parallel: its batch padded with weight-0 rows and split over a mesh
axis, its state replicated; a ``w``-weighted loss makes XLA's all-reduce of the gradients exact."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from symjax_mlp._cache import refuse_shared_cache
from symjax_mlp._errors import ConfigError, SignatureError, as_bool
from symjax_mlp._hybrid.jaxpr import input_dependent
from symjax_mlp._hybrid.mesh import batch_size, pad_rows, padding, place, shardings
from symjax_mlp.training._state import is_count
from symjax_mlp.training._step import UNEVEN, ModelVars

_CALL = "symjax_mlp.training.shard_step(...)"
_PADDED_STATE = (
    "{caller}: a batch of {rows} rows does not divide over {n} shards, and the model's state "
    "moves with the rows (BatchNorm's batch statistics): padding rows would enter the "
    "statistics, and through them every row's gradient, whatever their weight. Pass a batch "
    "that is a multiple of {n} (drop or add real rows)."
)


class ShardedStep:
    """A training step run data-parallel (see :func:`shard_step`): ``s(params, opt_state, x,
    y, w=None)`` replicates the state, pads and splits the batch, and runs one ``jax.jit``."""

    def __init__(
        self, step: Callable[..., Any], mesh: Mesh | None, axis: str, donate: bool, pad: bool
    ):
        self.step = step
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ConfigError(
                f"{_CALL}: mesh is a {type(mesh).__name__}; expected a jax.sharding.Mesh. Pass "
                "mesh=sm.data_mesh() (every device), sm.data_mesh(n), or None for the former."
            )
        try:  # an axis not of the mesh: said by the one check, after the call
            self.mesh, self.replicated, self.batch_sharding, self.n_shards = shardings(mesh, axis)
        except ConfigError as e:
            raise ConfigError(f"{_CALL}: {e}") from None
        self.axis, self.pad = axis, pad
        self._sees: dict[Any, bool] = {}  # a padded call's signature -> its rows reach the state
        rep, dat = self.replicated, self.batch_sharding
        self.blocks = getattr(step, "blocks", 1)
        if self.blocks > 1:  # each device its blocks, gathered in the step: a fixed order
            if self.blocks % self.n_shards:
                raise ConfigError(
                    f"{_CALL}: a step of blocks={self.blocks} over {self.n_shards} "
                    f"shards; the shards must divide the blocks. Use blocks={self.n_shards} "
                    "(or a multiple), or a mesh whose axis size divides it."
                )
            step = jax.shard_map(
                functools.partial(step, axis_name=axis),
                mesh=self.mesh,
                in_specs=(P(), P(), P(axis), P(axis), P(axis)),
                out_specs=P(),
                check_vma=False,
            )
        refuse_shared_cache(_CALL)  # its jax.jit compiles through JAX's cache
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
        x, y, w = (a if a is None or hasattr(a, "shape") else np.asarray(a) for a in (x, y, w))
        batch = batch_size((x, y) if w is None else (x, y, w), _CALL)
        w = np.ones(batch, np.float32) if w is None else w
        extra = padding(batch, self.n_shards, self.pad, _CALL)
        if self.blocks > 1 and batch % self.blocks:  # padding would change the blocks
            raise SignatureError(UNEVEN.format(caller=_CALL, rows=batch, blocks=self.blocks))
        arrays = (pad_rows(x, extra), pad_rows(y, extra), pad_rows(w, extra, fill=0))
        return tuple(place(a, self.batch_sharding) for a in arrays)

    def __call__(self, params: Any, opt_state: Any, x: Any, y: Any, w: Any = None) -> Any:
        """One step of ``params`` and ``opt_state`` (replicated) on the batch ``x``, ``y`` and
        row weights ``w`` (``None``: ones), padded with weight-0 rows to divide over the shards
        and split: the new ``(params, opt_state, metrics)``, all replicated."""
        return self._jitted(*self._placed(params, opt_state, x, y, w))

    def lower(self, params: Any, opt_state: Any, x: Any, y: Any, w: Any = None):
        """The step lowered for these ``params``, ``opt_state``, ``x``, ``y`` and ``w``, placed
        as :meth:`__call__` places them; ``.compile().as_text()`` shows XLA's all-reduce of the
        gradients."""
        return self._jitted.lower(*self._placed(params, opt_state, x, y, w))

    def _placed(self, params: Any, opt_state: Any, x: Any, y: Any, w: Any) -> tuple[Any, ...]:
        batch = self.shard_batch(x, y, w)
        if isinstance(params, ModelVars) and batch[0].shape[0] != len(x):  # padded
            self._refuse_rows_in_state(params, opt_state, batch, len(x))
        return self.replicate(params), self.replicate(opt_state), *batch

    def _refuse_rows_in_state(self, params: ModelVars, opt_state: Any, batch: Any, rows: int):
        """Refuses a padded batch whose rows the model's new state depends on (BatchNorm's
        statistics, each row's output through them); a dropout key's does not."""
        args = (params, opt_state, *batch)
        key = (jax.tree.structure(args), *map(jax.typeof, jax.tree.leaves(args)))
        if (seen := self._sees.get(key)) is None:
            jaxpr = jax.make_jaxpr(self.step)(*args).jaxpr
            x_at = len(jax.tree.leaves((params, opt_state)))  # its outputs: params, state, ...
            state = slice(len(jax.tree.leaves(params.params)), len(jax.tree.leaves(params)))
            moved = input_dependent(jaxpr, [jaxpr.invars[x_at]])[state]
            seen = self._sees[key] = any(moved)
        if seen:
            raise SignatureError(_PADDED_STATE.format(caller=_CALL, rows=rows, n=self.n_shards))


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
        (``False``: raise :class:`~symjax_mlp.SignatureError`); a model whose state moves with
        the rows (BatchNorm's statistics) raises it padded, as the rows would enter them.

    Returns:
      A :class:`ShardedStep`; its params after N steps equal single-device training up to
      float rounding, and bit for bit for a ``train_step(..., blocks=B)`` step (run under
      ``shard_map``; the shards must divide B).

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
    donate, pad = as_bool(donate), as_bool(pad)  # a sweep's np.True_: as jit takes it
    if not (callable(step) and isinstance(donate, bool) and isinstance(pad, bool)):
        raise ConfigError(
            f"symjax_mlp.training.shard_step(step, donate=, pad=): got step "
            f"{type(step).__name__}, donate {donate!r}, pad {pad!r}; expected a step function "
            "such as sm.training.train_step(model, optimizer) and donate, pad True or False."
        )
    return ShardedStep(step, mesh, axis, donate, pad)


def check_batches(batch_size: int, blocks: int | None, examples: int, caller: str) -> int:
    """The run's blocks (default: its devices), refused unless they split each batch evenly."""
    if batch_size > examples:  # each epoch is padded to whole batches of it
        raise ConfigError(
            f"{caller}: batch_size={batch_size} is more than the {examples} training examples: "
            f"every step would be mostly padding. Pass batch_size <= {examples}."
        )
    devices = jax.device_count() if jax.process_count() > 1 else 1
    blocks = devices if blocks is None else blocks
    if not is_count(blocks, 1):
        raise ConfigError(
            f"{caller}: blocks must be an int >= 1; got {blocks!r}. Pass e.g. blocks={devices}."
        )
    if batch_size % blocks or blocks % devices:
        raise ConfigError(
            f"{caller}: blocks={blocks} must divide batch_size={batch_size} and be a multiple "
            f"of the run's {devices} device(s) (each device computes whole blocks). Pass e.g. "
            f"blocks={devices} with a batch_size that is a multiple of it."
        )
    return blocks
