"""Training with optax: one jit-compiled step, the same step eagerly, checkpoints, exact resume.

:func:`train` applies ``jax.jit`` to :func:`~symjax_mlp.training.train_step` at one boundary,
with the params and the optimizer state donated, and runs it over shuffled, padded batches, so every
step has one signature and the step traces exactly once per run (a second trace raises
:class:`~symjax_mlp.RetraceError`). ``compiled=False`` runs the very same step op by op.

:func:`train` reads as its pieces: the settings are checked, the model is fitted to the data
and its state initialised, or resumed from a checkpoint (``_resume.py``), and
:class:`~symjax_mlp.training._epoch.Programs` runs one epoch at a time (``_epoch.py``), until
the result gathers the trained model.
"""

from __future__ import annotations

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

from symjax_mlp._errors import ConfigError
from symjax_mlp._models import mlp
from symjax_mlp.training._checkpoint import TrainState, check_directory
from symjax_mlp.training._data import Dataset, check_dataset, load_digits
from symjax_mlp.training._epoch import Programs
from symjax_mlp.training._nnx import NnxSpec, spec_of
from symjax_mlp.training._result import EpochRecord, TrainResult
from symjax_mlp.training._resume import resume_run, run_config, save_run
from symjax_mlp.training._spec import TRAIN_FORM, inference_shape
from symjax_mlp.training._step import ModelVars, init_params

_NOT_FLAX = (
    "train() trains a flax.linen or nnx module; got a {kind}. For another model, write the "
    "loop with optax over the Hybrid's pure form: h = sm.hybridize(fn, params); "
    "loss(params) on h.apply(params, x) (every keyword is your function's: an equinox-style "
    "out, state = h.apply(params, x, state=state) passes your state), jax.grad of it, and "
    "h.replace(params=...) for the trained model."
)


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
      CheckpointError: ``checkpoint`` cannot hold checkpoints (a file, a dangling symlink, a
        path below a file, a directory this user cannot write), before any step runs; it
        already holds checkpoints and ``resume`` is false; or the checkpoint does not fit this
        model (what it computes), optimizer, data, seed or batch size.
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
    optimizer = _checked_settings(
        model,
        optimizer,
        learning_rate,
        epochs=epochs,
        batch_size=batch_size,
        checkpoint_every=checkpoint_every,
        checkpoint=checkpoint,
        resume=resume,
    )
    start = time.perf_counter()
    data = check_dataset(load_digits() if data is None else data)
    model, spec, num_outputs = _classifier(model, data, train_flags, eval_flags)
    data = check_dataset(data, num_outputs=num_outputs)
    state = _initial_state(model, spec, data.x_train[:1], optimizer, seed)
    config = run_config(
        model, spec, state.params, data, optimizer,
        seed=seed, batch_size=batch_size, num_outputs=num_outputs,
    )  # fmt: skip
    state, history, resumed_from = resume_run(checkpoint, state, config, resume=resume)
    newest = resumed_from
    programs = Programs.of(model, spec, optimizer, compiled=compiled)
    for epoch in range(state.epoch + 1, epochs + 1):
        state, record = programs.epoch(state, data, batch_size, epoch, newest=newest)
        history.append(record)
        if checkpoint is not None and (epoch % checkpoint_every == 0 or epoch == epochs):
            newest = save_run(checkpoint, state, config, history)
        if on_epoch is not None:
            on_epoch(record)
    return _result(
        model, spec, state, history, programs, data,
        start=start, resumed_from=resumed_from, checkpoint=newest,
    )  # fmt: skip


# -- the settings, the model and its initial state -------------------------------------------
def _checked_settings(
    model: Any,
    optimizer: optax.GradientTransformation | None,
    learning_rate: float | None,
    *,
    epochs: int,
    batch_size: int,
    checkpoint_every: int,
    checkpoint: str | os.PathLike | None,
    resume: bool,
) -> optax.GradientTransformation:
    """The optimizer to use (``optax.adam`` by default), once every setting is in range."""
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
    if checkpoint is not None:  # refused now, not after the first epoch
        check_directory(checkpoint, "symjax_mlp.training.train")
    if model is not None and not isinstance(model, nn.Module | nnx.Module):
        raise ConfigError(_NOT_FLAX.format(kind=type(model).__name__))
    return optimizer


def _classifier(
    model: Any,
    data: Dataset,
    train_flags: Mapping[str, Any] | None,
    eval_flags: Mapping[str, Any] | None,
) -> tuple[Any, Any, int]:
    """``(model, spec, classes)``: the model (default: an MLP as wide as the labels), how it
    is called in training and in inference, and its number of output logits."""
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
    return model, spec, int(out.shape[-1])


def _initial_state(
    model: Any, spec: Any, example: np.ndarray, optimizer: optax.GradientTransformation, seed: int
) -> TrainState:
    """Params initialised from ``seed`` (an nnx module's own values), the optimizer's state."""
    rng, init_key = jax.random.split(jax.random.key(seed))
    params = init_params(model, init_key, example, train_flags=spec.train_flags)
    trainable = params.params if isinstance(params, ModelVars) else params
    return TrainState(params, _unaliased(params, optimizer.init(trainable)), rng)


def _unaliased(params: Any, opt_state: Any) -> Any:
    """Copies optimizer-state leaves that are params (or repeat): both trees are donated."""
    seen = {id(leaf) for leaf in jax.tree.leaves(params)}

    def own(leaf: Any) -> Any:
        if id(leaf) in seen:
            return jnp.array(leaf, copy=True)
        seen.add(id(leaf))
        return leaf

    return jax.tree.map(own, opt_state)


# -- the result --------------------------------------------------------------------------------
def _result(
    model: Any,
    spec: Any,
    state: TrainState,
    history: list[EpochRecord],
    programs: Programs,
    data: Dataset,
    *,
    start: float,
    resumed_from: Path | None,
    checkpoint: Path | None,
) -> TrainResult:
    """The trained model (an nnx module rebuilt from its trained values), its history and how
    it ran."""
    stateful = isinstance(state.params, ModelVars)
    params = state.params.params if stateful else state.params
    model_state = state.params.state if stateful else None
    if isinstance(spec, NnxSpec):
        model_state = spec.typed(model_state) if stateful else None
        model = spec.module(params, model_state or {})
    return TrainResult(
        model=model,
        params=params,
        opt_state=state.opt_state,
        step=state.step,
        epoch=state.epoch,
        history=tuple(history),
        test_accuracy=programs.accuracy(state.params, data),
        train_seconds=time.perf_counter() - start,
        compiled=programs.compiled,
        trace_count=len(programs.traces),
        resumed_from=resumed_from,
        checkpoint=checkpoint,
        num_features=data.num_features,
        model_state=model_state,
        eval_flags=spec.eval_flags,
        standardize=None if data.mean is None else (data.mean, data.std),
    )
