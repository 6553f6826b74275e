"""One epoch of training: the shuffle, the padded batches, the step's programs, the checks."""

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
from symjax_mlp.training._step import ShardedStep, apply_model, step_of


@functools.partial(jax.jit, static_argnums=1)
def _shuffle(rng: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    rng, key = jax.random.split(rng)
    return rng, jax.random.permutation(key, n)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The training step and the prediction, and the step's traces (a second one raises)."""

    step: Callable[..., Any]
    predict: Callable[..., Any]
    traces: list[tuple[Any, ...]]
    #: called around each step of a multi-process run (its watchdog); ``None`` in one process
    watch: Callable[[int], Any] | None = None

    @classmethod
    def of(
        cls, model: Any, spec: Any, optimizer: optax.GradientTransformation, *, compiled: bool,
        blocks: int = 1, watch: Callable[[int], Any] | None = None,
    ) -> Programs:  # fmt: skip
        """Jitted (state donated) when ``compiled``, else eager; sharded over every process's
        devices with ``watch``."""
        step = step_of(model, optimizer, train_flags=spec.train_flags, blocks=blocks, known=spec)
        traces: list[tuple[Any, ...]] = []

        def counted(params, opt_state, x, y, w, **kw):
            traces.append(tuple(jax.typeof(a) for a in (x, y, w)))
            if len(traces) > 1:
                raise RetraceError(
                    f"train step traced again (trace #{len(traces) - 1}) with inputs "
                    f"{traces[-1]}; the first trace had {traces[0]}. Every step should see one "
                    "signature."
                )
            return step(params, opt_state, x, y, w, **kw)

        counted.blocks = blocks

        def predict(params, x):
            return jnp.argmax(apply_model(model, spec, params, x, train=False)[0], axis=-1)

        if watch is not None:
            return cls(
                ShardedStep(counted, None, "data", True, False), jax.jit(predict), traces, watch
            )
        if compiled:
            return cls(jax.jit(counted, donate_argnums=(0, 1)), jax.jit(predict), traces)
        return cls(step, predict, traces)

    def local(self, tree: Any) -> Any:
        """``tree`` as this process holds it (a multi-process run's arrays: its copy)."""
        return tree if self.watch is None else jax.tree.map(lambda a: a.addressable_data(0), tree)

    def accuracy(self, params: Any, data: Dataset) -> float:
        """The share of the test split predicted right."""
        predicted = np.asarray(self.predict(self.local(params), data.x_test))
        return int(np.sum(predicted == data.y_test)) / len(data.y_test)

    def epoch(
        self, state: TrainState, data: Dataset, batch_size: int, epoch: int, *, newest: Path | None
    ) -> tuple[TrainState, EpochRecord]:
        """One shuffled pass over the training split (``state`` is donated when compiled),
        then the test split's accuracy: the new state and the epoch's record."""
        t0 = time.perf_counter()
        n_train = len(data.y_train)
        rng, order = _shuffle(state.rng, n_train)
        shape = (math.ceil(n_train / batch_size), batch_size)  # the last padded cyclically
        order = np.resize(np.asarray(order), math.prod(shape))
        xb, yb = data.x_train[order].reshape(*shape, -1), data.y_train[order].reshape(shape)
        wb = (np.arange(math.prod(shape)) < n_train).astype(np.float32).reshape(shape)  # pads: 0
        params, opt_state, metrics = state.params, state.opt_state, []
        for i in range(len(xb)):
            if self.watch is None:
                params, opt_state, m = self.step(params, opt_state, xb[i], yb[i], wb[i])
            else:  # each step waited for, under the watchdog: a stalled peer cannot hang it
                with self.watch(state.step + i):
                    params, opt_state, m = self.step(params, opt_state, xb[i], yb[i], wb[i])
                    m = jax.block_until_ready(self.local(m))
            metrics.append(m)
        metrics = jax.device_get(metrics)
        losses = np.array([m["loss"] for m in metrics])
        _check_finite(losses, self.local(params), first_step=state.step, epoch=epoch, newest=newest)
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
    """Raises at the epoch's first non-finite loss, or if it left a non-finite param."""
    bad = np.flatnonzero(~np.isfinite(losses))
    n = len(losses)
    i = int(bad[0]) if bad.size else n - 1
    what = f"the loss is {losses[i]} at step {first_step + i}"
    if not bad.size:
        leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(params))
        leaf = next((p for p, a in leaves if not np.all(np.isfinite(a))), None)
        if leaf is None:
            return
        where = jax.tree_util.keystr(leaf)
        what = f"the update at step {first_step + i} made params{where} non-finite"
    kept = f"the last good checkpoint is kept: {newest}"
    if not newest:
        kept = "no checkpoint was written (pass checkpoint=DIR to keep one)"
    raise DivergenceError(
        f"training diverged: {what} (epoch {epoch}, batch {i + 1} of {n}; "
        f"{first_step + i} updates applied before it). Training stopped; {kept}. "
        "Lower the learning rate, clip the gradients (optax.clip_by_global_norm) or "
        "check the data.",
        step=first_step + i,
        epoch=epoch,
        checkpoint=newest,
    )
