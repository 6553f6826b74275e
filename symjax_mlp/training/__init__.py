"""Training with optax: the pure step, data-parallel steps, checkpoints, the loop.

The pieces of :func:`train` are public for research code that writes its own loop.
"""

from symjax_mlp._errors import DistributedError as DistributedError
from symjax_mlp.training._checkpoint import restore_checkpoint as restore_checkpoint
from symjax_mlp.training._checkpoint import save_checkpoint as save_checkpoint
from symjax_mlp.training._data import Dataset as Dataset
from symjax_mlp.training._data import load_digits as load_digits
from symjax_mlp.training._epoch import TrainResult as TrainResult
from symjax_mlp.training._loop import train as train
from symjax_mlp.training._paths import latest_checkpoint as latest_checkpoint
from symjax_mlp.training._processes import EXIT_STATUS as EXIT_STATUS
from symjax_mlp.training._processes import initialize as initialize
from symjax_mlp.training._shard import ShardedStep as ShardedStep
from symjax_mlp.training._shard import shard_step as shard_step
from symjax_mlp.training._state import EpochRecord as EpochRecord
from symjax_mlp.training._state import TrainState as TrainState
from symjax_mlp.training._step import Step as Step
from symjax_mlp.training._step import init_params as init_params
from symjax_mlp.training._step import train_step as train_step

__all__ = [
    "EXIT_STATUS",
    "Dataset",
    "DistributedError",
    "EpochRecord",
    "ShardedStep",
    "Step",
    "TrainResult",
    "TrainState",
    "init_params",
    "initialize",
    "latest_checkpoint",
    "load_digits",
    "restore_checkpoint",
    "save_checkpoint",
    "shard_step",
    "train",
    "train_step",
]
