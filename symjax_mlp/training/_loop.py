"""Training with optax: one jit-compiled step, the same step eagerly, checkpoints, exact resume.

:func:`train` applies ``jax.jit`` to :func:`~symjax_mlp.training.train_step` at one boundary,
with the params and the optimizer state donated, and runs it over shuffled, padded batches, so every
step has one signature and the step traces exactly once per run (a second trace raises
:class:`~symjax_mlp.RetraceError`). ``compiled=False`` runs the very same step op by op.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from symjax_mlp._errors import CheckpointError, ConfigError, DivergenceError, RetraceError
from symjax_mlp._models import mlp
from symjax_mlp.training._checkpoint import (
    TrainState,
    latest_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from symjax_mlp.training._data import Dataset, check_dataset, load_digits
from symjax_mlp.training._nnx import NnxSpec, fingerprint, spec_of
from symjax_mlp.training._result import EpochRecord, TrainResult
from symjax_mlp.training._spec import TRAIN_FORM, inference_shape
from symjax_mlp.training._step import ModelVars, apply_model, init_params, train_step

_NOT_FLAX = (
    "train() trains a flax.linen or nnx module; got a {kind}. For another model, write the "
    "loop with optax over the Hybrid's pure form: h = sm.hybridize(fn, params); "
    "loss(params) on out, state = h.apply(params, x, state=state), jax.grad of it, and "
    "h.replace(params=..., state=...) for the trained model."
)


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


def _fingerprint(data: Dataset) -> str:
    digest = hashlib.sha256()
    for a in (data.x_train, data.y_train):
        digest.update(str(a.shape).encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def _unaliased(params: Any, opt_state: Any) -> Any:
    """Copies optimizer-state leaves that are params (or repeat): both trees are donated."""
    seen = {id(leaf) for leaf in jax.tree.leaves(params)}

    def own(leaf: Any) -> Any:
        if id(leaf) in seen:
            return jnp.array(leaf, copy=True)
        seen.add(id(leaf))
        return leaf

    return jax.tree.map(own, opt_state)


def _nonfinite_leaf(tree: Any) -> str | None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(tree)):
        if not np.all(np.isfinite(leaf)):
            return jax.tree_util.keystr(path)
    return None


def _model_fingerprint(model: Any, spec: Any, params: Any) -> str:
    """The model's configuration (its repr: layers, widths, activations) and param tree."""
    tree = jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), params)
    config = fingerprint(spec) if isinstance(spec, NnxSpec) else repr(model)
    return hashlib.sha256(f"{config}|{tree}".encode()).hexdigest()


def _optimizer_fingerprint(optimizer: optax.GradientTransformation) -> str:
    """What the optimizer does, measured: its first two updates of a fixed small problem.

    An optax transformation is a pair of closures, so its hyperparameters cannot be read;
    two steps on fixed gradients tell adam(1e-3) from adam(3e-2) or sgd, deterministically.
    """
    w = {"w": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)}
    g = {"w": jnp.cos(jnp.arange(8, dtype=jnp.float32))}
    digest = hashlib.sha256(type(optimizer).__name__.encode())
    try:
        opt_state = optimizer.init(w)
        for _ in range(2):
            updates, opt_state = optimizer.update(g, opt_state, w)
            digest.update(np.asarray(updates["w"], np.float32).tobytes())
    except Exception:  # an optimizer that cannot run on a toy tree: its type only
        pass
    return digest.hexdigest()


def _history(found: Path, meta: dict[str, Any], state: TrainState) -> list[EpochRecord]:
    """The history a checkpoint records, checked against its step and epoch."""
    try:
        history = [EpochRecord(**r) for r in meta["history"]]
    except (KeyError, TypeError) as e:
        raise CheckpointError(
            f"{found}: its history is missing or malformed ({e}); the checkpoint was edited or "
            "is corrupted. Resume from an older step_* directory, or start over."
        ) from None
    last = history[-1] if history else None
    if len(history) != state.epoch or (last is not None and last.step != state.step):
        raise CheckpointError(
            f"{found}: it records epoch {state.epoch} and step {state.step}, but its history "
            f"has {len(history)} epoch(s) ending at step {last.step if last else 0}. The "
            "manifest was edited; resuming would skip or repeat epochs. Resume from an older "
            "step_* directory, or start over."
        )
    return history


def train(
    model: nn.Module | None = None,
    data: Dataset | None = None,
    *,
    optimizer: optax.GradientTransformation | None = None,
    learning_rate: float | None = None,
    epochs: int = 20,
    batch_size: int = 64,
    seed: int = 0,
    train_flags: Mapping[str, Any] | None = None,
    eval_flags: Mapping[str, Any] | None = None,
    compiled: bool = True,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 1,
    resume: bool = False,
    on_epoch: Callable[[EpochRecord], None] | None = None,
) -> TrainResult:
    """Trains a classifier with optax; the step is jit-compiled (or eager, for comparison).

    Every epoch shuffles the training split with a key split from ``seed``, pads the last
    batch (padding has weight 0, so each example counts once), runs one step per batch and
    evaluates the test split. The same ``seed`` gives bitwise-identical params on the CPU, and
    resuming from a checkpoint continues exactly as the uninterrupted run would have.

    Args:
      model: a ``flax.linen`` module mapping ``(batch, features)`` to ``(batch, classes)``
        logits (default: ``mlp((128, 64, num_classes))``), or an ``nnx.Module`` one: it is
        trained from the values it was built with (``seed`` then seeds the shuffle only), its
        steps run as ``module.train()`` sets it and its evaluations as ``module.eval()`` does,
        and ``result.model`` is the trained module (the one given is left as it was).
      data: a :class:`~symjax_mlp.training.Dataset` (default:
        :func:`~symjax_mlp.training.load_digits`).
      optimizer: any ``optax.GradientTransformation`` (default: ``optax.adam``).
      learning_rate: the default adam's learning rate (default 1e-3); not used otherwise.
      epochs: total epochs to reach, counting those done before a resumed checkpoint.
      batch_size: examples per step.
      seed: seeds the initialisation and the shuffle.
      train_flags, eval_flags: the keyword settings of a training and of an inference call
        of ``model``, e.g. ``{"is_training": True}`` and ``{"is_training": False}`` (given
        one, the other defaults to ``{}``, the call's defaults). Default: found by name,
        ``train=True``/``False``, ``training=True``/``False`` or
        ``deterministic=False``/``True``, whichever ``__call__`` takes. ``{}`` and ``{}``
        say that the model has no mode to switch.
      compiled: ``True`` runs the step jit-compiled with params and optimizer state donated;
        ``False`` runs the same step eagerly, op by op.
      checkpoint: a directory for checkpoints (``None``: none are written).
      checkpoint_every: write a checkpoint every this many epochs (and after the last one).
      resume: continue from the newest checkpoint in ``checkpoint`` (a fresh start if it
        holds none).
      on_epoch: called with each :class:`EpochRecord` as soon as the epoch ends.

    Returns:
      A :class:`TrainResult`; ``result.hybridize()`` is the trained model.

    Raises:
      DataError: bad data (empty, wrong feature width, NaN, labels out of range), before any
        step runs.
      DivergenceError: the loss became NaN or infinite; names the step and keeps the last good
        checkpoint.
      CheckpointError: ``checkpoint`` already holds checkpoints and ``resume`` is false, or the
        checkpoint does not fit this model, optimizer, data, seed or batch size.
      ConfigError: a hyperparameter is out of range, or the model's flags do not switch it
        between training and inference: none found or given while a call with its defaults
        would train BatchNorm or Dropout in inference mode, or an inference call that still
        draws an rng or updates state (a mode set as an attribute).

    Example:
      >>> import symjax_mlp as sm
      >>> result = sm.training.train(epochs=2)
      >>> result.step, len(result.history), result.trace_count
      (46, 2, 1)
    """
    for name, value, low in (
        ("epochs", epochs, 0),
        ("batch_size", batch_size, 1),
        ("checkpoint_every", checkpoint_every, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{name} must be an int >= {low}; got {value!r}.")
    if optimizer is None:
        optimizer = optax.adam(1e-3 if learning_rate is None else learning_rate)
    elif learning_rate is not None:
        raise ConfigError(
            "learning_rate sets the default adam only; with an explicit optimizer, give it the "
            f"learning rate instead, e.g. optax.sgd({learning_rate!r})."
        )
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ConfigError(
            f"optimizer must be an optax.GradientTransformation such as optax.adam(1e-3); "
            f"got {type(optimizer).__name__}."
        )
    if resume and checkpoint is None:
        raise ConfigError("resume=True needs checkpoint=DIR, the directory to resume from.")
    if model is not None and not isinstance(model, nn.Module | nnx.Module):
        raise ConfigError(_NOT_FLAX.format(kind=type(model).__name__))

    start = time.perf_counter()
    data = check_dataset(load_digits() if data is None else data)
    if model is None:
        classes = data.num_classes or int(max(data.y_train.max(), data.y_test.max())) + 1
        model = mlp((128, 64, classes))
    example = data.x_train[:1]
    caller = f"symjax_mlp.training.train({type(model).__name__})"
    spec = spec_of(model, example, train_flags, eval_flags, caller=caller, form=TRAIN_FORM)
    if isinstance(spec, NnxSpec):
        out = spec.out
    else:
        out = inference_shape(model, example, spec, caller=caller)
    if out.ndim != 2:
        raise ConfigError(
            f"train() needs a model whose output is (batch, classes) logits; {type(model).__name__}"
            f" returns shape {out.shape} for input shape {example.shape}."
        )
    data = check_dataset(data, num_outputs=out.shape[-1])

    rng, init_key = jax.random.split(jax.random.key(seed))
    params = init_params(model, init_key, example, train_flags=spec.train_flags)
    trainable = params.params if isinstance(params, ModelVars) else params
    state = TrainState(params, _unaliased(params, optimizer.init(trainable)), rng)
    config = {
        "seed": seed,
        "batch_size": batch_size,
        "data": data.name,
        "data_sha256": _fingerprint(data),
        "num_features": data.num_features,
        "num_outputs": int(out.shape[-1]),
        "model_sha256": _model_fingerprint(model, spec, params),
        "optimizer_sha256": _optimizer_fingerprint(optimizer),
    }
    history: list[EpochRecord] = []
    resumed_from = newest = None
    if checkpoint is not None and (found := latest_checkpoint(checkpoint)) is not None:
        if not resume:
            raise CheckpointError(
                f"{checkpoint} already holds checkpoints (newest: {found.name}). Pass "
                "resume=True to continue from it, or use an empty directory."
            )
        state, meta = restore_checkpoint(found, state)
        changed = [k for k, v in config.items() if meta.get("config", {}).get(k) != v]
        if changed:
            was = {k: meta.get("config", {}).get(k) for k in changed}
            raise CheckpointError(
                f"{found} was written with {was}, but this run has "
                f"{ {k: config[k] for k in changed} }. Resuming would not continue that run; "
                "resume with the same settings, or start over in an empty directory."
            )
        history = _history(found, meta, state)
        resumed_from = newest = found

    step = train_step(model, optimizer, train_flags=spec.train_flags)
    traces: list[tuple[Any, ...]] = []

    def counted(params, opt_state, x, y, w):
        traces.append(tuple(jax.typeof(a) for a in (x, y, w)))
        if len(traces) > 1:
            raise RetraceError(
                f"train step traced again (trace #{len(traces) - 1}) with inputs {traces[-1]}; "
                f"the first trace had {traces[0]}. Every step should see one signature."
            )
        return step(params, opt_state, x, y, w)

    def predict(params, x):
        return jnp.argmax(apply_model(model, spec, params, x, train=False)[0], axis=-1)

    if compiled:
        step_fn = jax.jit(counted, donate_argnums=(0, 1))
        predict_fn = jax.jit(predict)
    else:
        step_fn, predict_fn = step, predict

    def accuracy(params) -> float:
        return int(np.sum(np.asarray(predict_fn(params, data.x_test)) == data.y_test)) / len(
            data.y_test
        )

    params, opt_state, rng = state.params, state.opt_state, state.rng
    n_train = len(data.y_train)
    for epoch in range(state.epoch + 1, epochs + 1):
        t0 = time.perf_counter()
        rng, order = _shuffle(rng, n_train)
        xb, yb, wb = _batches(np.asarray(order), data.x_train, data.y_train, batch_size)
        metrics = []
        for i in range(len(xb)):
            params, opt_state, m = step_fn(params, opt_state, xb[i], yb[i], wb[i])
            metrics.append(m)
        metrics = jax.device_get(metrics)
        losses = np.array([m["loss"] for m in metrics])
        first_step = state.step
        bad = np.flatnonzero(~np.isfinite(losses))
        bad_leaf = None if bad.size else _nonfinite_leaf(params)
        if bad.size or bad_leaf is not None:
            i = int(bad[0]) if bad.size else len(xb) - 1
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
                f"training diverged: {what} (epoch {epoch}, batch {i + 1} of {len(xb)}; "
                f"{first_step + i} updates applied before it). Training stopped; {kept}. "
                "Lower the learning rate, clip the gradients (optax.clip_by_global_norm) or "
                "check the data.",
                step=first_step + i,
                epoch=epoch,
                checkpoint=newest,
            )
        real = wb.sum(axis=1)
        record = EpochRecord(
            epoch=epoch,
            step=first_step + len(xb),
            loss=float(np.sum(losses * real) / n_train),
            train_accuracy=float(sum(float(m["correct"]) for m in metrics) / n_train),
            test_accuracy=accuracy(params),
            seconds=time.perf_counter() - t0,
        )
        history.append(record)
        state = TrainState(params, opt_state, rng, step=record.step, epoch=epoch)
        if checkpoint is not None and (epoch % checkpoint_every == 0 or epoch == epochs):
            meta = {"config": config, "history": [dataclasses.asdict(r) for r in history]}
            newest = save_checkpoint(checkpoint, state, metadata=meta)
        if on_epoch is not None:
            on_epoch(record)

    stateful = isinstance(params, ModelVars)
    model_state = params.state if stateful else None
    if isinstance(spec, NnxSpec):
        model_state = spec.typed(model_state) if stateful else None
        model = spec.module(params.params if stateful else params, model_state or {})
    return TrainResult(
        model=model,
        params=params.params if stateful else params,
        opt_state=opt_state,
        step=state.step,
        epoch=state.epoch,
        history=tuple(history),
        test_accuracy=accuracy(params),
        train_seconds=time.perf_counter() - start,
        compiled=compiled,
        trace_count=len(traces),
        resumed_from=resumed_from,
        checkpoint=newest,
        num_features=data.num_features,
        model_state=model_state,
        eval_flags=spec.eval_flags,
        standardize=None if data.mean is None else (data.mean, data.std),
    )
