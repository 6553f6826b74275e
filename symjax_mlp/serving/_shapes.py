"""What a batcher's request takes: per-input specs (from an example or an artifact), and
the batch sizes compiled ahead of time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from symjax_mlp._errors import ConfigError
from symjax_mlp._loaded import LoadedModel
from symjax_mlp._specs import TensorSpec


def example_specs(example: Any) -> tuple[TensorSpec, ...]:
    arrays = example if isinstance(example, tuple) else (example,)
    specs = []
    for i, x in enumerate(arrays):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise ConfigError(
                f"Batcher(example=...): input {i} is a {type(x).__name__}; pass arrays (a "
                "tuple of arrays for several inputs), each with the batch as leading dimension."
            )
        if len(x.shape) == 0:
            raise ConfigError(
                f"Batcher(example=...): input {i} is a scalar; batching needs a leading batch "
                "dimension, e.g. x[None]."
            )
        specs.append(TensorSpec(f"args[{i}]", ("b", *map(int, x.shape[1:])), str(x.dtype)))
    return tuple(specs)


def artifact_specs(model: LoadedModel) -> tuple[tuple[TensorSpec, ...], int | None]:
    """The per-request specs of an artifact, and its static batch (``None``: symbolic)."""
    sig = model.signature
    specs, static = [], set()
    for spec in sig.inputs:
        lead = spec.shape[0] if spec.shape else None
        rest = spec.shape[1:]
        if lead is None or any(isinstance(d, str) for d in rest):
            raise ConfigError(
                f"Batcher({model.path}): input {spec.path} is {spec.type}, but batching needs "
                "the batch as leading dimension and static sizes elsewhere. Export the model "
                "with a symbolic batch: export(..., batch='b')."
            )
        if isinstance(lead, int):
            static.add(lead)
        specs.append(TensorSpec(spec.path, ("b", *rest), spec.dtype))
    if len(static) > 1 or (static and sig.batch is not None):
        raise ConfigError(
            f"Batcher({model.path}): the inputs' leading dimensions {sig} disagree; batching "
            "needs one batch dimension shared by every input."
        )
    return tuple(specs), (static.pop() if static else None)


def bucket_sizes(
    name: str, max_batch: int | None, buckets: Sequence[int] | None, static: int | None
) -> tuple[int, ...]:
    if static is not None:
        if (max_batch not in (None, static)) or (buckets is not None and list(buckets) != [static]):
            raise ConfigError(
                f"{name}: the artifact was exported for a static batch of {static}, so every "
                f"model call runs {static} rows; drop max_batch/buckets (or pass {static}), or "
                "export it with a symbolic batch (batch='b') to batch freely."
            )
        return (static,)
    if max_batch is None:
        max_batch = max(buckets) if buckets else 64
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ConfigError(f"{name}: max_batch must be an int >= 1; got {max_batch!r}.")
    if buckets is None:
        return power_buckets(max_batch)
    sizes = sorted(set(buckets))
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes) or sizes[-1] != max_batch:
        raise ConfigError(
            f"{name}: buckets must be ints >= 1 whose largest is max_batch={max_batch}; got "
            f"{list(buckets)!r}."
        )
    return tuple(sizes)


def power_buckets(max_batch: int) -> tuple[int, ...]:
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch]
    return tuple(sorted({*sizes, max_batch}))
