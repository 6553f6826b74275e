"""A run's epochs and what they add up to: the shuffle, the padded batches, the step's programs,
the checks of each epoch, and the :class:`TrainResult` that :func:`train` returns."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from symjax_mlp._artifact.reading import Artifact
from symjax_mlp._errors import ConfigError, DivergenceError, RetraceError
from symjax_mlp._export import export
from symjax_mlp._hybrid.hybrid import Hybrid
from symjax_mlp._hybrid.make import hybridize
from symjax_mlp.training._data import Dataset
from symjax_mlp.training._optimizer import states
from symjax_mlp.training._shard import ShardedStep
from symjax_mlp.training._state import EpochRecord, TrainState, eval_point
from symjax_mlp.training._step import ModelVars, apply_model, step_of

#: an artifact of :meth:`TrainResult.export` records in its metadata what it takes
RAW_INPUTS = "raw features: the program standardises them as the model was trained on them"


def moves_its_own(train: Callable[..., Any]) -> Callable[..., Any]:
    """``train`` under ``jax.transfer_guard("allow")``: its data's and keys' trips to the device
    are its own (a global "disallow" refused its first key); ``on_epoch`` runs under the guards
    the caller set, each direction's."""
    c, ways = jax.config, ("host_to_device", "device_to_device", "device_to_host")

    @functools.wraps(train)
    def run(*args: Any, on_epoch: Any = None, **kwargs: Any) -> Any:
        guards = {w: getattr(c, f"jax_transfer_guard_{w}") for w in ways}  # the caller's
        if callable(on_epoch):
            on_epoch = functools.partial(_guarded, on_epoch, guards)
        with jax.transfer_guard("allow"):
            return train(*args, on_epoch=on_epoch, **kwargs)

    return run


def _guarded(f: Callable[..., Any], guards: dict[str, Any], *args: Any) -> Any:
    with contextlib.ExitStack() as stack:
        for way, level in guards.items():
            stack.enter_context(getattr(jax, f"transfer_guard_{way}")(level))
        return f(*args)


@functools.partial(jax.jit, static_argnums=1)
def _shuffle(rng: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    rng, key = jax.random.split(rng)
    return rng, jax.random.permutation(key, n)


def _unplaced(tree: Any) -> tuple[Any, ...]:
    """``tree``'s structure and each leaf's shape, dtype and weak type: its avals, mesh aside."""
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple((a.shape, a.dtype, a.weak_type) for a in map(jax.typeof, leaves))


@dataclasses.dataclass(frozen=True)
class Programs:
    """The training step and the prediction, and the step's traces (a second one raises but
    for the params' placement on the model's own mesh, once)."""

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
        states: list[Any] = []  # each trace's params and optimizer state, placement aside

        def counted(params, opt_state, x, y, w, **kw):
            if jax.config.jax_disable_jit:  # jax.disable_jit(): each step op by op, no trace
                return step(params, opt_state, x, y, w, **kw)
            traces.append(tuple(jax.typeof(a) for a in (x, y, w)))
            states.append(_unplaced((params, opt_state)))
            # a model pinning its activations to its own mesh (with_sharding_constraint, as
            # flax's pjit guide writes it) returns its params placed there: the second step
            # traces once more for that placement, and every later step reuses it
            placed = len(traces) == 2 and traces[1] == traces[0] and states[1] == states[0]
            if len(traces) > 1 and not placed:
                raise RetraceError(
                    f"train step traced again (trace #{len(traces) - 1}) with inputs "
                    f"{traces[-1]}; the first trace had {traces[0]}. Every step should see one "
                    "signature."
                )
            return step(params, opt_state, x, y, w, **kw)

        counted.blocks = blocks

        def predict(params, x):
            return jnp.argmax(apply_model(model, spec, params, x, train=False)[0], axis=-1)

        run = step  # eager: uncounted, as it is never traced
        if watch is not None:
            run = ShardedStep(counted, None, "data", True, False)
        elif compiled:
            run = jax.jit(counted, donate_argnums=(0, 1))
        return cls(run, jax.jit(predict) if compiled else predict, traces, watch)

    def local(self, tree: Any) -> Any:
        """``tree`` as this process holds it (a multi-process run's arrays: its copy)."""
        return tree if self.watch is None else jax.tree.map(lambda a: a.addressable_data(0), tree)

    def accuracy(self, params: Any, opt_state: Any, data: Dataset) -> float:  # of the test split
        params = evaluated(*self.local((params, opt_state)))
        predicted = np.asarray(self.predict(params, data.x_test))
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
        for i in range(len(xb)):  # a multi-process run's each waited for, under the watchdog:
            with self.watch(state.step + i) if self.watch else contextlib.nullcontext():
                params, opt_state, m = self.step(params, opt_state, xb[i], yb[i], wb[i])
                if self.watch:  # a stalled peer cannot hang it
                    m = jax.block_until_ready(self.local(m))
            metrics.append(m)
        metrics = jax.device_get(metrics)
        losses = np.array([m["loss"] for m in metrics])
        # optax.apply_if_finite skips a step whose gradients are not finite: its non-finite
        # losses are batches skipped, not a divergence
        skips = bool(states(opt_state, optax.ApplyIfFiniteState))
        skipped = skips & ~np.isfinite(losses)
        _check_finite(
            np.where(skipped, 0.0, losses), self.local(params),
            first_step=state.step, epoch=epoch, newest=newest,
        )  # fmt: skip
        counted = wb.sum(axis=1) * ~skipped
        record = EpochRecord(
            epoch=epoch,
            step=state.step + len(xb),
            loss=float(np.sum(np.where(skipped, 0.0, losses) * counted) / max(counted.sum(), 1)),
            train_accuracy=float(sum(float(m["correct"]) for m in metrics) / n_train),
            test_accuracy=self.accuracy(params, opt_state, data),
            seconds=time.perf_counter() - t0,
        )
        return TrainState(params, opt_state, rng, step=record.step, epoch=epoch), record


def evaluated(params: Any, opt_state: Any) -> Any:
    """The params to evaluate and export: a schedule-free optimizer's (optax.contrib's
    ``schedule_free``, found anywhere in ``opt_state``) as ``schedule_free_eval_params`` gives
    them, its ``x`` and not the ``y`` its steps take gradients at; else ``params``."""
    found = states(opt_state, optax.contrib.ScheduleFreeState)
    if len(found) != 1:  # none, or several (each of some params): ours to leave as they are
        return params
    b1, z = found[0].b1, found[0].z

    def x(y: jax.Array, z: Any) -> jax.Array:  # a param wrt= froze has no z (a MaskedNode)
        return y if isinstance(z, optax.MaskedNode) else eval_point(y, z, b1)

    if isinstance(params, ModelVars):
        return ModelVars(jax.tree.map(x, params.params, z), params.state)
    return jax.tree.map(x, params, z)


def _check_finite(
    losses: np.ndarray, params: Any, *, first_step: int, epoch: int, newest: Path | None
) -> None:
    """Raises at the epoch's first non-finite loss, or if it left a non-finite param."""
    bad, n = np.flatnonzero(~np.isfinite(losses)), len(losses)
    i = int(bad[0]) if bad.size else n - 1
    what = f"the loss is {losses[i]} at step {first_step + i}"
    if not bad.size:
        leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(params))
        if (leaf := next((p for p, a in leaves if not np.all(np.isfinite(a))), None)) is None:
            return
        where = jax.tree_util.keystr(leaf)
        what = f"the update at step {first_step + i} made params{where} non-finite"
    kept = f"the last good checkpoint is kept: {newest}"
    if not newest:
        kept = "no checkpoint was written (pass checkpoint=DIR to keep one)"
    raise DivergenceError(
        f"symjax_mlp.training.train: training diverged: {what} (epoch {epoch}, batch {i + 1} "
        f"of {n}; {first_step + i} updates applied before it). Training stopped; {kept}. Lower "
        "the learning rate, clip the gradients (optax.clip_by_global_norm) or check the data.",
        step=first_step + i,
        epoch=epoch,
        checkpoint=newest,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class TrainResult:
    """What :func:`train` returns: the trained params, their history, and how it ran.

    Attributes:
      model: the ``flax.linen`` module trained, or a new nnx module, trained, in eval mode.
      params: its trained ``"params"`` collection (an nnx module's ``Param`` values); a
        schedule-free optimizer's as ``optax.contrib.schedule_free_eval_params`` gives them.
      opt_state: the final optimizer state.
      step, epoch: optimizer steps and epochs completed (including resumed ones).
      history: one :class:`EpochRecord` per completed epoch, oldest first.
      test_accuracy: accuracy on the test split of the final params.
      train_seconds: wall time of this call (init, compile, epochs, evaluation).
      compiled: whether the step was jit-compiled.
      trace_count: how often this call traced the step (1 when compiled, 2 for a model that
        places its params on its own mesh, 0 eagerly).
      resumed_from: the checkpoint this call continued from, or ``None``.
      checkpoint: the newest checkpoint written or resumed from, or ``None``.
      num_features: the model's input width.
      model_state: a BatchNorm/Dropout model's trained state (``batch_stats``, the raw key of
        its ``dropout`` stream; an nnx module's other variables), or ``None``.
      eval_flags: the keyword settings of an inference call, e.g. ``{"train": False}``.
      standardize: the data's per-feature ``(mean, std)``: raw features ``x`` enter the model
        as ``(x - mean) / std``; or ``None``.
      checkpoint_waits: the seconds each asynchronous save of a multi-process run held up its
        steps; ``()`` in one process, whose saves are synchronous.
      checkpoints_superseded: the steps whose asynchronous save (a multi-process run) was not
        written because the one before it was still being committed; never the last.
    """

    # repr: the figures, not the arrays (a notebook's `train(...)` ending a cell showed pages)
    model: Any = dataclasses.field(repr=False)
    params: Any = dataclasses.field(repr=False)
    opt_state: Any = dataclasses.field(repr=False)
    step: int
    epoch: int
    history: tuple[EpochRecord, ...] = dataclasses.field(repr=False)
    test_accuracy: float
    train_seconds: float
    compiled: bool
    trace_count: int
    resumed_from: Path | None
    checkpoint: Path | None
    num_features: int
    model_state: Any = dataclasses.field(default=None, repr=False)
    eval_flags: dict[str, bool] = dataclasses.field(default_factory=dict)
    standardize: tuple[np.ndarray, np.ndarray] | None = dataclasses.field(default=None, repr=False)
    checkpoint_waits: tuple[float, ...] = ()
    checkpoints_superseded: tuple[int, ...] = ()

    @property
    def variables(self) -> dict[str, Any]:
        """The trained model's flax variables: ``{"params": ..., "batch_stats": ...}``, or
        an nnx module's ``nnx.state``."""
        if isinstance(self.model, nnx.Module):
            return nnx.state(self.model)
        collections = {c: v for c, v in (self.model_state or {}).items() if c != "rng"}
        return {"params": self.params, **collections}

    def hybridize(self, **kwargs: Any) -> Hybrid:
        """The trained model as a :class:`~symjax_mlp.Hybrid` (``kwargs`` go to ``hybridize``);
        call it in inference mode with :attr:`eval_flags` (``h(x, train=False)``). It takes the
        features standardised, as the model was trained on them (as ``data.x_test`` holds
        them), and so does ``sm.export`` of it; :meth:`export`'s artifact takes raw ones."""
        if isinstance(self.model, nnx.Module):
            return hybridize(self.model, **kwargs)
        return hybridize(self.model, self.variables, **kwargs)

    def export(
        self, path: str | os.PathLike, *, raw_inputs: bool = True, **kwargs: Any
    ) -> Artifact:
        """Exports the trained model in inference mode, with a symbolic batch.

        Args:
          path: the artifact directory, as for :func:`~symjax_mlp.export`.
          raw_inputs: bake the data's :attr:`standardize` in: the artifact takes raw features,
            as its metadata's ``"inputs"`` says (``False``: standardised ones, as the model was
            trained on).
          kwargs: the other options of :func:`~symjax_mlp.export` (``overwrite``,
            ``metadata``, ``batch=None`` for a static batch of one row...); its ``kwargs=``
            (the model's keywords) add to :attr:`eval_flags`. Not ``example``: a row of
            :attr:`num_features` features is the result's own.

        Returns:
          The :class:`~symjax_mlp.Artifact`; ``sm.load(path)`` runs it.

        Raises:
          ConfigError: ``raw_inputs`` not True or False, ``example=`` given, ``kwargs=`` not
            a dict, or an option :func:`~symjax_mlp.export` refuses (an nnx module left in
            training mode among them).
          ArtifactError: ``path`` exists (without ``overwrite=True``) or cannot be written.
        """
        where = "symjax_mlp.training.TrainResult.export"
        if raw_inputs not in (False, True):  # "no" was truthy: the standardisation baked in
            raise ConfigError(f"{where}: raw_inputs must be True or False; got {raw_inputs!r}.")
        if "example" in kwargs:  # was Python's 'got multiple values for keyword argument'
            raise ConfigError(
                f"{where}: the example is the result's own, a row of its {self.num_features} "
                "features; drop example= (batch= names the batch dimension, as in sm.export)."
            )
        flags = kwargs.pop("kwargs", None)  # the model's keywords, over its eval_flags
        if not isinstance(flags, Mapping | None):
            raise ConfigError(
                f"{where}: kwargs must be a dict of the model's keyword arguments; got "
                f"{type(flags).__name__} {flags!r:.80}. Pass e.g. kwargs={{'train': False}}."
            )
        flags = {**self.eval_flags, **(flags or {})}
        example = np.zeros((1, self.num_features), np.float32)
        kwargs.setdefault("batch", "b")
        trained = self.hybridize()
        # a model in training mode is exported as it is: export() refuses it, naming why
        if not raw_inputs or self.standardize is None or trained.training_mode(example, **flags):
            return export(trained, path, example=example, kwargs=flags, **kwargs)
        mean, std = (np.asarray(a, np.float32) for a in self.standardize)
        fn = trained.fn

        def raw_model(variables: Any, x: jax.Array) -> jax.Array:
            return fn(variables, (x - mean) / std, **flags)

        h = hybridize(raw_model, trained.variables, name=type(self.model).__name__)
        card = kwargs.get("metadata")  # says so to whoever gets it (inspect shows it)
        if card is None or isinstance(card, Mapping):  # export() refuses anything else
            kwargs["metadata"] = {"inputs": RAW_INPUTS, **(card or {})}
        return export(h, path, example=example, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able summary: accuracy, timing, steps and the per-epoch history."""
        names = ("test_accuracy", "train_seconds", "step", "epoch", "compiled", "trace_count")
        summary = {n: getattr(self, n) for n in names}
        for n in ("resumed_from", "checkpoint"):
            summary[n] = None if getattr(self, n) is None else str(getattr(self, n))
        history = [dataclasses.asdict(r) for r in self.history]
        saves = {"checkpoint_waits": list(self.checkpoint_waits),
                 "checkpoints_superseded": list(self.checkpoints_superseded)}  # fmt: skip
        return {**summary, **saves, "history": history}
