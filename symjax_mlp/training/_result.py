"""What training returns: the trained model, its history of :class:`EpochRecord`, how it ran."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from symjax_mlp._artifact.reading import Artifact
from symjax_mlp._export import export
from symjax_mlp._hybrid.hybrid import Hybrid
from symjax_mlp._hybrid.make import hybridize


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One epoch of the history: mean training loss and accuracies after it."""

    epoch: int
    step: int
    loss: float
    train_accuracy: float
    test_accuracy: float
    seconds: float


@dataclasses.dataclass(frozen=True, eq=False)
class TrainResult:
    """What :func:`train` returns: the trained params, their history, and how it ran.

    Attributes:
      model: the ``flax.linen`` module trained, or a new nnx module, trained, in eval mode.
      params: its trained ``"params"`` collection (an nnx module's ``Param`` values).
      opt_state: the final optimizer state.
      step, epoch: optimizer steps and epochs completed (including resumed ones).
      history: one :class:`EpochRecord` per completed epoch, oldest first.
      test_accuracy: accuracy on the test split of the final params.
      train_seconds: wall time of this call (init, compile, epochs, evaluation).
      compiled: whether the step was jit-compiled.
      trace_count: how often this call traced the step (1 when compiled, 0 eagerly).
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
    """

    model: Any
    params: Any
    opt_state: Any
    step: int
    epoch: int
    history: tuple[EpochRecord, ...]
    test_accuracy: float
    train_seconds: float
    compiled: bool
    trace_count: int
    resumed_from: Path | None
    checkpoint: Path | None
    num_features: int
    model_state: Any = None
    eval_flags: dict[str, bool] = dataclasses.field(default_factory=dict)
    standardize: tuple[np.ndarray, np.ndarray] | None = None
    checkpoint_waits: tuple[float, ...] = ()

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
        call it in inference mode with :attr:`eval_flags` (``h(x, train=False)``)."""
        if isinstance(self.model, nnx.Module):
            return hybridize(self.model, **kwargs)
        return hybridize(self.model, self.variables, **kwargs)

    def export(
        self, path: str | os.PathLike, *, raw_inputs: bool = True, **kwargs: Any
    ) -> Artifact:
        """Exports the trained model in inference mode, with a symbolic batch.

        With ``raw_inputs`` the data's :attr:`standardize` is baked in: the artifact takes raw
        features. ``kwargs`` go to :func:`~symjax_mlp.export`.
        """
        example = np.zeros((1, self.num_features), np.float32)
        kwargs.setdefault("batch", "b")
        trained, flags = self.hybridize(), self.eval_flags
        # a model in training mode is exported as it is: export() refuses it, naming why
        if not raw_inputs or self.standardize is None or trained.training_mode(example, **flags):
            return export(trained, path, example=example, **{"kwargs": flags, **kwargs})
        mean, std = (np.asarray(a, np.float32) for a in self.standardize)
        fn = trained.fn

        def raw_model(variables: Any, x: jax.Array) -> jax.Array:
            return fn(variables, (x - mean) / std, **flags)

        h = hybridize(raw_model, trained.variables, name=type(self.model).__name__)
        return export(h, path, example=example, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able summary: accuracy, timing, steps and the per-epoch history."""
        names = ("test_accuracy", "train_seconds", "step", "epoch", "compiled", "trace_count")
        summary = {n: getattr(self, n) for n in names}
        for n in ("resumed_from", "checkpoint"):
            summary[n] = None if getattr(self, n) is None else str(getattr(self, n))
        summary["checkpoint_waits"] = list(self.checkpoint_waits)
        return {**summary, "history": [dataclasses.asdict(r) for r in self.history]}
