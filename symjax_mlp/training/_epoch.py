"""One epoch of training: shuffled, padded batches through the step, checked for divergence.

:class:`Programs` holds the training step and the prediction, jit-compiled at one boundary
(params and optimizer state donated) or eager; its :meth:`Programs.epoch` shuffles the
training split with a key split from the state's, pads the last batch cyclically (padding has
weight 0, so each example counts once), runs one step per batch and evaluates the test split.
A non-finite loss or param stops it with a :class:`~symjax_mlp.DivergenceError` that names the
step and the checkpoint kept.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from symjax_mlp._errors import DivergenceError, RetraceError
from symjax_mlp.training._checkpoint import TrainState
from symjax_mlp.training._data import Dataset
from symjax_mlp.training._result import EpochRecord
from symjax_mlp.training._step import apply_model, train_step


@functools.partial(jax.jit, static_argnums=1)
def _shuffle(rng: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    rng, key = jax.random.split(rng)
    return rng, jax.random.permutation(key, n)


def _batches(
    order: np.ndarray, x: np.ndarray, y: np.ndarray, batch_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One epoch in ``order``, padded cyclically to whole batches (padding has weight 0)."""
    n = len(x)
    steps = math.ceil(n / batch_size)
    order = np.resize(order, steps * batch_size)
    w = np.zeros(steps * batch_size, np.float32)
    w[:n] = 1.0
    shape = (steps, batch_size)
    return x[order].reshape(*shape, -1), y[order].reshape(shape), w.reshape(shape)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The training step and the prediction, jit-compiled (or eager), and the step's traces.

    The compiled step counts its traces: a second one, a step with another input signature,
    raises :class:`~symjax_mlp.RetraceError` instead of compiling again.
    """

    step: Callable[..., Any]
    predict: Callable[..., Any]
    traces: list[tuple[Any, ...]]
    compiled: bool

    @classmethod
    def of(
        cls, model: Any, spec: Any, optimizer: optax.GradientTransformation, *, compiled: bool
    ) -> Programs:
        """The programs of ``model`` under ``optimizer``: ``jax.jit`` with the params and the
        optimizer state donated when ``compiled``, else the same functions run eagerly."""
        step = train_step(model, optimizer, train_flags=spec.train_flags)
        traces: list[tuple[Any, ...]] = []

        def counted(params, opt_state, x, y, w):
            traces.append(tuple(jax.typeof(a) for a in (x, y, w)))
            if len(traces) > 1:
                raise RetraceError(
                    f"train step traced again (trace #{len(traces) - 1}) with inputs "
                    f"{traces[-1]}; the first trace had {traces[0]}. Every step should see one "
                    "signature."
                )
            return step(params, opt_state, x, y, w)

        def predict(params, x):
            return jnp.argmax(apply_model(model, spec, params, x, train=False)[0], axis=-1)

        if compiled:
            return cls(jax.jit(counted, donate_argnums=(0, 1)), jax.jit(predict), traces, True)
        return cls(step, predict, traces, False)

    def accuracy(self, params: Any, data: Dataset) -> float:
        """The share of the test split predicted right."""
        right = np.sum(np.asarray(self.predict(params, data.x_test)) == data.y_test)
        return int(right) / len(data.y_test)

    def epoch(
        self, state: TrainState, data: Dataset, batch_size: int, epoch: int, *, newest: Path | None
    ) -> tuple[TrainState, EpochRecord]:
        """One shuffled pass over the training split, then the test split's accuracy.

        ``state``'s params and optimizer state are donated to the step (when compiled); the
        state after the epoch is returned with its record.
        """
        t0 = time.perf_counter()
        rng, order = _shuffle(state.rng, len(data.y_train))
        xb, yb, wb = _batches(np.asarray(order), data.x_train, data.y_train, batch_size)
        params, opt_state, metrics = state.params, state.opt_state, []
        for i in range(len(xb)):
            params, opt_state, m = self.step(params, opt_state, xb[i], yb[i], wb[i])
            metrics.append(m)
        metrics = jax.device_get(metrics)
        losses = np.array([m["loss"] for m in metrics])
        _check_finite(losses, params, first_step=state.step, epoch=epoch, newest=newest)
        n_train = len(data.y_train)
        record = EpochRecord(
            epoch=epoch,
            step=state.step + len(xb),
            loss=float(np.sum(losses * wb.sum(axis=1)) / n_train),
            train_accuracy=float(sum(float(m["correct"]) for m in metrics) / n_train),
            test_accuracy=self.accuracy(params, data),
            seconds=time.perf_counter() - t0,
        )
        return TrainState(params, opt_state, rng, step=record.step, epoch=epoch), record


def _check_finite(
    losses: np.ndarray, params: Any, *, first_step: int, epoch: int, newest: Path | None
) -> None:
    """Raises :class:`~symjax_mlp.DivergenceError` at the epoch's first non-finite loss, or
    if its updates left a non-finite param; names the step and the checkpoint kept."""
    bad = np.flatnonzero(~np.isfinite(losses))
    bad_leaf = None if bad.size else _nonfinite_leaf(params)
    if not bad.size and bad_leaf is None:
        return
    n = len(losses)
    i = int(bad[0]) if bad.size else n - 1
    what = (
        f"the loss is {losses[i]} at step {first_step + i}"
        if bad.size
        else f"the update at step {first_step + i} made params{bad_leaf} non-finite"
    )
    kept = (
        f"the last good checkpoint is kept: {newest}"
        if newest
        else "no checkpoint was written (pass checkpoint=DIR to keep one)"
    )
    raise DivergenceError(
        f"training diverged: {what} (epoch {epoch}, batch {i + 1} of {n}; "
        f"{first_step + i} updates applied before it). Training stopped; {kept}. "
        "Lower the learning rate, clip the gradients (optax.clip_by_global_norm) or "
        "check the data.",
        step=first_step + i,
        epoch=epoch,
        checkpoint=newest,
    )


def _nonfinite_leaf(tree: Any) -> str | None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(tree)):
        if not np.all(np.isfinite(leaf)):
            return jax.tree_util.keystr(path)
    return None
