"""Training with optax: :func:`train` checks its settings, data and model before the first step,
then runs the epochs (:mod:`._epoch`), checkpoints them, and resumes exactly (:mod:`._resume`)."""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from symjax_mlp._cache import refuse_shared_cache
from symjax_mlp._errors import (
    CheckpointError,
    ConfigError,
    ControlFlowError,
    SymjaxError,
    as_int,
    first_line,
)
from symjax_mlp._hybrid.trace import TRACER_ERRORS
from symjax_mlp._models import mlp
from symjax_mlp.training._checkpoint import save_checkpoint
from symjax_mlp.training._data import (
    Dataset,
    check_dataset,
    check_outputs,
    default_classes,
    load_digits,
)
from symjax_mlp.training._epoch import Programs, TrainResult, evaluated, moves_its_own
from symjax_mlp.training._optimizer import Moved, checked_optimizer, init_state, only
from symjax_mlp.training._orbax import OrbaxCheckpoints
from symjax_mlp.training._paths import check_directory
from symjax_mlp.training._processes import Watchdog, agree, run_timeout
from symjax_mlp.training._resume import (
    OPTIMIZER_PROBE,
    check_init_from,
    optimizer_probe,
    resume_run,
    run_config,
)
from symjax_mlp.training._shard import check_batches
from symjax_mlp.training._spec import TRAIN_FORM, NnxSpec, spec_of
from symjax_mlp.training._state import EpochRecord, TrainState, is_count
from symjax_mlp.training._step import ModelVars, check_model, check_trainable, init_of, owned

_CALLER = "symjax_mlp.training.train"
_CONTROL_FLOW = (
    "{caller}: the model needs a concrete value from a traced array ({error}). train() traces "
    "the model, to initialise it and for jax.grad (compiled or not), where only shapes and "
    "dtypes are known: a Python if/while on an array, float(x), int(x) or np.asarray(x) in "
    "__call__ cannot be decided. Stay symbolic: jnp.where or jax.lax.cond for an if, "
    "jax.lax.while_loop for a while, jnp operations for float(x)."
)
_ONE_ROW = (  # a note on what the model raised
    "{caller}: raised by the model on one row of x_train, shape {shape}: train() looks at the "
    "model on one row, and trains it on batches of any size up to batch_size (the last one "
    "smaller). A model whose params fix its rows (an ensemble, one member per row: nnx.vmap or "
    "eqx.filter_vmap over stacked params) trains in a loop of your own over h.apply: "
    "h = sm.hybridize(model), jax.grad of your loss of h.apply(params, x), an optax update, "
    "h.replace(params=params)."
)
_NNX_TREE = (  # a note on the optimizer's refusal of an nnx module's params
    f"{_CALLER}: an nnx module's params reach the optimizer as nnx.to_pure_dict(nnx.state("
    "model, nnx.Param)) gives them, a dict of arrays by path: no nnx.State (labels made by "
    "nnx.map_state do not fit it) and no Variable types (a label function's isinstance(v, "
    "nnx.LoRAParam) is never true). To train some params only, pass wrt= an nnx filter: "
    "train(model, data, optimizer=tx, wrt=nnx.LoRAParam)."
)
_PAST = (
    "symjax_mlp.training.train(epochs={epochs}, resume=True): the newest checkpoint, {found}, "
    "is at epoch {s.epoch} (step {s.step}), past the {epochs} epoch(s) asked for; epochs counts "
    "the epochs done before the checkpoint too. Pass epochs >= {s.epoch} to continue that run, "
    "or resume=False with an empty checkpoint directory to train {epochs} epoch(s) afresh."
)


@moves_its_own
def train(
    model: nn.Module | None = None,
    data: Dataset | None = None,
    *,
    optimizer: optax.GradientTransformation | None = None,
    wrt: Any = None,
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
    init_from: str | os.PathLike | None = None,
    on_epoch: Callable[[EpochRecord], None] | None = None,
    blocks: int | None = None,
    timeout: int | None = None,
) -> TrainResult:
    """Trains a classifier with optax; the step is jit-compiled (or eager, for comparison).

    The same ``seed`` gives bitwise-identical params on the CPU; resuming continues exactly as
    the uninterrupted run would have.

    Args:
      model: a ``flax.linen`` module mapping ``(batch, features)`` to ``(batch, classes)``
        logits (default: ``mlp((128, 64, num_classes))``), or an ``nnx.Module`` one, trained
        from the values it was built with (``seed`` then seeds the shuffle only) in the modes
        ``train()`` and ``eval()`` set; ``result.model`` is a new module, trained.
      data: a :class:`Dataset` (default: :func:`load_digits`).
      optimizer: any ``optax.GradientTransformation`` or ``optax.MultiSteps`` (default: adam);
        one whose update takes ``value=`` gets the batch's loss (``reduce_on_plateau``); a
        schedule-free one's params are evaluated and exported as ``schedule_free_eval_params``;
        ``optax.apply_if_finite``'s non-finite losses are its steps to skip (not a divergence;
        each epoch's loss is its finite steps' mean).
        Its ``init`` gets the params as a dict of dicts of arrays, a linen model's as ``init``
        gives them, an nnx module's as ``nnx.to_pure_dict`` (no Variable types: see ``wrt``).
      wrt: the params to train, the others held bitwise as they are (the optimizer's state
        the trained params' only, as ``nnx.Optimizer(model, tx, wrt=...)`` keeps): an nnx
        filter (``nnx.LoRAParam``, ``nnx.PathContains('head')``), of a linen model's params by
        path (a tuple of names) and array, e.g. ``lambda path, _: path[0] == 'head'``;
        ``result.opt_state`` is then ``optax.multi_transform``'s. Default: every param.
      learning_rate: the default adam's learning rate (default 1e-3); not used otherwise.
      epochs: total epochs to reach, counting those done before a resumed checkpoint.
      batch_size: examples per step.
      seed: seeds the initialisation and the shuffle.
      train_flags, eval_flags: the keyword settings of a training and of an inference call
        of ``model``, e.g. ``{"is_training": True}`` and ``{"is_training": False}`` (given
        one, the other defaults to ``{}``). Default: ``train``, ``training`` or
        ``deterministic``, whichever ``__call__`` takes. ``{}`` and ``{}``: no mode to switch.
      compiled: run the step jit-compiled, params and optimizer state donated (else eagerly).
      checkpoint: a directory for checkpoints (``None``: none are written).
      checkpoint_every: write a checkpoint every this many epochs (and after the last one).
      resume: continue from the newest checkpoint in ``checkpoint``, if it holds one (else a
        warning says it trains from the start); the ``"symjax_mlp.training"`` logger says
        ``resuming from PATH`` at INFO once that checkpoint is checked.
      init_from: a checkpoint directory (its newest) or ``step_*`` checkpoint, only read: a new
        run (a fresh optimizer state, epoch 0) starts from its params and model state, which
        this model must have written; optimizer, data and seed may differ (fine-tuning, a new
        schedule). Not used where ``resume`` continues a checkpoint of ``checkpoint``.
      on_epoch: called with each :class:`EpochRecord` as soon as the epoch ends.
      blocks: each batch's gradient is the sum of this many equal blocks' gradients, added in
        block order (see :func:`train_step`): runs with the same ``blocks`` give bitwise the
        same params in one process and in several. Default: 1 in one process, the number of
        devices after :func:`~symjax_mlp.training.initialize`.
      timeout: in a multi-process run, the seconds a process waits for another (default:
        :func:`~symjax_mlp.training.initialize`'s) before the run fails naming it.

    After :func:`~symjax_mlp.training.initialize`, every process calls ``train`` with the same
    arguments; each step runs data-parallel over every process's devices, checkpoints via Orbax,
    asynchronously: one due while the one before it is still being written is skipped
    (superseded; process 0 decides for all), never the last.

    Returns:
      A :class:`TrainResult`; ``result.hybridize()`` is the trained model.

    Raises:
      DataError: bad data (empty, wrong feature width, NaN, labels out of range or, for the
        default model, like IDs: over 65536 classes, most never a label), before any step.
      DivergenceError: the loss became NaN or infinite; the last good checkpoint is kept.
      CheckpointError: ``checkpoint`` cannot hold checkpoints (checked before any step); it
        already holds some and ``resume`` is false; or the one found does not fit this model,
        optimizer, data, seed or batch size, or is past ``epochs``; ``init_from`` holds none
        of this model.
      ConfigError: a hyperparameter is out of range; the model's flags do not switch its mode;
        it has no params, or an int one; another process was started with other settings.
      ControlFlowError: the model applies Python control flow to an array (``if``, float(x)).
      DistributedError: another process did not post its settings within ``timeout``.

    Example:
      >>> import symjax_mlp as sm
      >>> result = sm.training.train(epochs=2)
      >>> result.step, len(result.history), result.trace_count
      (46, 2, 1)
    """
    epochs, batch_size, checkpoint_every, seed, blocks, timeout = (  # a sweep's np.int64: int
        as_int(v) for v in (epochs, batch_size, checkpoint_every, seed, blocks, timeout)
    )
    _check_settings(epochs, batch_size, checkpoint_every, seed, compiled, resume, on_epoch)
    refuse_shared_cache(_CALLER)  # before XLA reads an executable from there
    compiled, resume = bool(compiled), bool(resume)  # np.True_, 1: JSON's true in the results
    optimizer = checked_optimizer(optimizer, learning_rate, _CALLER)
    timeout = run_timeout(timeout, _CALLER)  # checked in one process too, not once scaled out
    if resume and checkpoint is None:
        raise ConfigError(f"{_CALLER}: resume=True needs checkpoint=DIR, the directory to resume "
                          "from.")  # fmt: skip
    if checkpoint is not None:  # refused now, not after the first epoch
        check_directory(checkpoint, _CALLER)
    if init_from is not None:
        check_init_from(init_from, checkpoint)
    if model is not None:
        check_model(model, _CALLER)
    start = time.perf_counter()
    data = check_dataset(load_digits() if data is None else data)
    model, spec, num_outputs = _classifier(model, data, train_flags, eval_flags)
    check_outputs(data, num_outputs)
    blocks = check_batches(batch_size, blocks, len(data.x_train), _CALLER)
    state, wrapped, trained = _initial_state(model, spec, data.x_train[:1], optimizer, seed, wrt)
    config = run_config(
        model, spec, state.params, data, optimizer,
        seed=seed, batch_size=batch_size, num_outputs=num_outputs,
    )  # fmt: skip
    optimizer = wrapped  # the one given is the run's fingerprint, the params wrt trains its own
    if trained is not None:  # recorded only when set, as blocks
        config["wrt"] = trained
    if blocks != 1:  # recorded only when set: older checkpoints resume as they are
        config["blocks"] = blocks
    programs, store, watch = _processes(
        model, spec, optimizer, config, compiled=compiled, blocks=blocks, timeout=timeout,
        checkpoint=checkpoint, run={"epochs": epochs, "every": checkpoint_every, "resume": resume,
        "init_from": init_from and os.path.realpath(init_from)},
    )  # fmt: skip

    probe = optimizer_probe(optimizer)

    def update(s: TrainState) -> list[Any]:  # the optimizer's next update, measured
        return probe(*programs.local((s.params, s.opt_state)))

    parts = {"its checkpoints": store, "its watchdog": watch}
    try:
        state, history, resumed_from = resume_run(  # or a new run's (from init_from's weights)
            checkpoint, state, config, resume=resume, store=store, update=update,
            init_from=init_from,
        )  # fmt: skip
        if state.epoch > epochs:  # the run asked for is shorter than the one found
            raise CheckpointError(_PAST.format(epochs=epochs, found=resumed_from, s=state))
        newest = resumed_from
        moved = Moved(programs.local(_trainable(state.params))) if state.epoch == 0 else None
        for epoch in range(state.epoch + 1, epochs + 1):
            state, record = programs.epoch(state, data, batch_size, epoch, newest=newest)
            history.append(record)
            if moved is not None:  # a first epoch that trained nothing: said, once
                now = programs.local((_trainable(state.params), state.opt_state))
                moved = None if moved.check(*now, record, _CALLER) else moved
            if checkpoint is not None and (epoch % checkpoint_every == 0 or epoch == epochs):
                meta = {"config": config, "history": [dataclasses.asdict(r) for r in history]}
                if store:  # superseded while the one before commits, unless it is the last;
                    newest = store.save(  # the update is measured on the writer thread
                        state, meta, last=epoch == epochs,
                        derived=lambda s: {OPTIMIZER_PROBE: update(s)},
                    )  # fmt: skip
                else:
                    meta[OPTIMIZER_PROBE] = update(state)
                    newest = save_checkpoint(checkpoint, state, metadata=meta)
            if on_epoch is not None:
                on_epoch(record)
    except BaseException as e:  # its own error is raised, a failed save's a note on it
        _close(parts, e)
        raise
    _close(parts)
    opt_state = programs.local(state.opt_state)  # the params evaluated as the optimizer says
    params = evaluated(programs.local(state.params), opt_state)
    stateful = isinstance(params, ModelVars)
    params, model_state = (params.params, params.state) if stateful else (params, None)
    if isinstance(spec, NnxSpec):  # the trained module, rebuilt from its trained values
        model_state = spec.typed(model_state) if stateful else None
        model = spec.module(params, model_state or {})
    return TrainResult(
        model=model, params=params, opt_state=opt_state, step=state.step, epoch=state.epoch,
        history=tuple(history),
        test_accuracy=programs.accuracy(state.params, state.opt_state, data),
        train_seconds=time.perf_counter() - start,
        compiled=compiled,  # a multi-process run's too: refused unless compiled
        trace_count=len(programs.traces), resumed_from=resumed_from, checkpoint=newest,
        num_features=data.num_features, model_state=model_state, eval_flags=spec.eval_flags,
        standardize=None if data.mean is None else (data.mean, data.std),
        checkpoint_waits=() if store is None else tuple(store.waits),
        checkpoints_superseded=() if store is None else tuple(store.superseded),
    )  # fmt: skip


def _check_settings(
    epochs: Any, batch_size: Any, every: Any, seed: Any, compiled: Any, resume: Any, on_epoch: Any
) -> None:
    """Refuses a setting out of range before anything runs."""
    counts = {"epochs": (epochs, 0, 20), "batch_size": (batch_size, 1, 64)}
    for name, (value, low, e) in {**counts, "checkpoint_every": (every, 1, 1)}.items():
        if not is_count(value, low):
            raise ConfigError(f"{_CALLER}: {name} must be an int >= {low}; got {value!r}. "
                              f"Pass a whole number, e.g. {name}={e}.")  # fmt: skip
    for name, value in (("compiled", compiled), ("resume", resume)):
        if value not in (False, True):
            raise ConfigError(f"{_CALLER}: {name} must be True or False; got {value!r}.")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed.bit_length() > 63:
        raise ConfigError(f"{_CALLER}: seed must be an int from -2**63 + 1 to 2**63 - 1; got "
                          f"{seed!r}. Pass e.g. seed=0.")  # fmt: skip
    if on_epoch is not None and not callable(on_epoch):  # refused now, not after an epoch
        raise ConfigError(f"{_CALLER}: on_epoch must be a function called with each EpochRecord; "
                          f"got {on_epoch!r}.")  # fmt: skip


def _close(parts: dict[str, Any], error: BaseException | None = None) -> None:
    """Closes each part; a failure is a note on the run's ``error``, else raised at the end."""
    raised = error
    for what, part in parts.items():
        try:
            if part is not None:
                part.close()
        except Exception as e:
            if raised is None:
                raised = e
            else:
                raised.add_note(f"{_CALLER}: closing {what} failed too: {type(e).__name__}: {e}")
    if raised is not error:
        raise raised


def _processes(
    model: Any, spec: Any, optimizer: optax.GradientTransformation, config: dict[str, Any], *,
    compiled: bool, blocks: int, timeout: int, checkpoint: Any, run: dict[str, Any],
) -> tuple[Programs, OrbaxCheckpoints | None, Watchdog | None]:  # fmt: skip
    """The run's programs; in several processes, once all agree, its Orbax store and watchdog."""
    if jax.process_count() == 1:
        return Programs.of(model, spec, optimizer, compiled=compiled, blocks=blocks), None, None
    if not compiled:
        raise ConfigError(f"{_CALLER}: a multi-process run is compiled; got compiled=False.")
    where = checkpoint and os.path.realpath(checkpoint)  # Orbax's one directory (links, ..)
    key = agree({**config, **run, "checkpoint": where}, timeout=timeout, caller=_CALLER)
    watch = Watchdog(key, timeout, _CALLER)
    programs = Programs.of(model, spec, optimizer, compiled=True, blocks=blocks, watch=watch)
    if checkpoint is None:
        return programs, None, watch
    store = OrbaxCheckpoints(checkpoint, timeout=timeout, sharding=programs.step.replicated)
    return programs, store, watch


def _classifier(
    model: Any,
    data: Dataset,
    train_flags: Mapping[str, Any] | None,
    eval_flags: Mapping[str, Any] | None,
) -> tuple[Any, Any, int]:
    """``(model, spec, classes)``: the model (default: an MLP as wide as the labels)."""
    if model is None:
        model = mlp((128, 64, default_classes(data)))
    example = data.x_train[:1]
    caller = f"symjax_mlp.training.train({type(model).__name__})"
    try:
        spec = spec_of(model, example, train_flags, eval_flags, caller=caller, form=TRAIN_FORM)
    except TRACER_ERRORS as e:  # the model's Python control flow on an array
        error = first_line(e, typed=True)
        raise ControlFlowError(_CONTROL_FLOW.format(caller=caller, error=error)) from e
    except Exception as e:  # the model's own, raised as it is: on the one row it is looked at
        if not isinstance(e, SymjaxError):
            e.add_note(_ONE_ROW.format(caller=caller, shape=example.shape))
        raise
    out = spec.out  # an inference call's, as its spec found it
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape is None or len(shape) != 2 or not jnp.issubdtype(dtype, jnp.floating):
        got = f"a {type(out).__name__}" if shape is None else f"shape {shape}, dtype {dtype}"
        raise ConfigError(
            f"{caller}: train() needs a model whose output is (batch, classes) float logits; "
            f"{type(model).__name__} returns {got} for input shape {example.shape}. Return "
            "the logits alone, as floats; a model of several outputs trains in a loop of your "
            "own (jax.grad of your loss, an optax update)."
        )
    return model, spec, int(out.shape[-1])


def _trainable(params: Any) -> Any:  # the params an optimizer moves (no model state)
    return params.params if isinstance(params, ModelVars) else params


def _initial_state(
    model: Any, spec: Any, example: np.ndarray, optimizer: Any, seed: int, wrt: Any
) -> tuple[TrainState, optax.GradientTransformation, list[str] | None]:
    """Params from ``seed`` and the optimizer's state, its leaves copied (both trees are
    donated); the optimizer over the params ``wrt`` selects (:func:`only`), their paths."""
    rng, init_key = jax.random.split(jax.random.key(seed))
    params = init_of(model, spec, init_key, example)
    trainable = _trainable(params)
    check_trainable(trainable, f"symjax_mlp.training.train({type(model).__name__})")
    trained = None
    if wrt is not None:
        optimizer, trained = only(optimizer, wrt, model, trainable, _CALLER)
    try:
        opt_state = init_state(optimizer, trainable, _CALLER)
    except ConfigError as e:  # an nnx user's labels, of an nnx.State: what the optimizer gets
        if isinstance(spec, NnxSpec):
            e.add_note(_NNX_TREE)
        raise
    return TrainState(params, owned(opt_state), rng), optimizer, trained
