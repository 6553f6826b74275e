"""symjax_mlp: hybrid programming for Flax MLPs.

Write the model imperatively, flip one switch (:func:`hybridize`) and get the symbolic program
as a jaxpr (:class:`Graph`), an XLA-compiled call, and a portable StableHLO artifact.
"""

from importlib import metadata as _metadata

from symjax_mlp.artifact import Artifact, inspect
from symjax_mlp.checkpoint import (
    TrainState,
    latest_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from symjax_mlp.data import Dataset, load_digits
from symjax_mlp.distributed import (
    LoadedSharded,
    Sharded,
    ShardedStep,
    bench_devices,
    data_mesh,
    load_sharded,
    shard,
    shard_step,
)
from symjax_mlp.errors import (
    ArtifactError,
    ControlFlowError,
    DataError,
    DivergenceError,
    RetraceError,
    SignatureError,
    SymjaxError,
)
from symjax_mlp.export import LoadedModel, export, export_mlp, load
from symjax_mlp.graph import Graph, stage
from symjax_mlp.hybrid import ArgSpec, Hybrid, TraceEvent, hybridize
from symjax_mlp.manifest import Signature, TensorSpec
from symjax_mlp.models import ACTIVATIONS, Dense, HybridConcurrent, HybridSequential, mlp
from symjax_mlp.step import time_train_step, train_step
from symjax_mlp.train import EpochRecord, TrainResult, train
from symjax_mlp.verify import VerifyCheck, VerifyReport, verify

__version__ = _metadata.version("symjax_mlp")  # pyproject.toml is the one source

__all__ = [
    "ACTIVATIONS",
    "ArgSpec",
    "Artifact",
    "ArtifactError",
    "ControlFlowError",
    "DataError",
    "Dataset",
    "Dense",
    "DivergenceError",
    "EpochRecord",
    "Graph",
    "Hybrid",
    "HybridConcurrent",
    "HybridSequential",
    "LoadedModel",
    "LoadedSharded",
    "RetraceError",
    "Sharded",
    "ShardedStep",
    "Signature",
    "SignatureError",
    "SymjaxError",
    "TensorSpec",
    "TraceEvent",
    "TrainResult",
    "TrainState",
    "VerifyCheck",
    "VerifyReport",
    "bench_devices",
    "data_mesh",
    "export",
    "export_mlp",
    "hybridize",
    "inspect",
    "latest_checkpoint",
    "load",
    "load_digits",
    "load_sharded",
    "mlp",
    "restore_checkpoint",
    "save_checkpoint",
    "shard",
    "shard_step",
    "stage",
    "time_train_step",
    "train",
    "train_step",
    "verify",
]
