"""symjax_mlp: hybrid programming for Flax MLPs.

Write the model imperatively, flip one switch (:func:`hybridize`) and get the symbolic program
(:class:`Graph`), an XLA-compiled call, and a portable StableHLO artifact (:func:`export`).

The flow, one stage per private module, each importing only from the stages before it::

    _errors, _specs, _files -> _models -> _hybrid -> _artifact -> _export -> _runtimes
      -> _load -> _verify -> serving -> _timeit -> training, chapter -> cli
"""

import importlib as _importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING as _TYPE_CHECKING

from symjax_mlp._errors import ArtifactError as ArtifactError
from symjax_mlp._errors import CheckpointError as CheckpointError
from symjax_mlp._errors import ConfigError as ConfigError
from symjax_mlp._errors import ControlFlowError as ControlFlowError
from symjax_mlp._errors import DataError as DataError
from symjax_mlp._errors import DivergenceError as DivergenceError
from symjax_mlp._errors import RetraceError as RetraceError
from symjax_mlp._errors import RetraceWarning as RetraceWarning
from symjax_mlp._errors import SignatureError as SignatureError
from symjax_mlp._errors import SymjaxError as SymjaxError

__version__ = _metadata.version("symjax_mlp")  # pyproject.toml is the one source

if _TYPE_CHECKING:  # imported on first use, below: `import symjax_mlp` imports no JAX (the CLI
    # imports it where a Ctrl-C is handled), loading an artifact none of the models
    from symjax_mlp._artifact.reading import Artifact as Artifact
    from symjax_mlp._artifact.reading import inspect as inspect
    from symjax_mlp._artifact.signature import Signature as Signature
    from symjax_mlp._export import export as export
    from symjax_mlp._hybrid.graph import Graph as Graph
    from symjax_mlp._hybrid.graph import stage as stage
    from symjax_mlp._hybrid.hybrid import Hybrid as Hybrid
    from symjax_mlp._hybrid.make import hybridize as hybridize
    from symjax_mlp._hybrid.make import shard as shard
    from symjax_mlp._hybrid.mesh import data_mesh as data_mesh
    from symjax_mlp._hybrid.trace import TraceEvent as TraceEvent
    from symjax_mlp._load import load as load
    from symjax_mlp._loaded import LoadedModel as LoadedModel
    from symjax_mlp._models import ACTIVATIONS as ACTIVATIONS
    from symjax_mlp._models import Dense as Dense
    from symjax_mlp._models import HybridConcurrent as HybridConcurrent
    from symjax_mlp._models import HybridSequential as HybridSequential
    from symjax_mlp._models import mlp as mlp
    from symjax_mlp._signing import sign as sign
    from symjax_mlp._signing import verify_signature as verify_signature
    from symjax_mlp._specs import TensorSpec as TensorSpec
    from symjax_mlp._timeit import CallTiming as CallTiming
    from symjax_mlp._timeit import timeit as timeit
    from symjax_mlp._verify import VerifyCheck as VerifyCheck
    from symjax_mlp._verify import VerifyReport as VerifyReport
    from symjax_mlp._verify import verify as verify

_LAZY = {  # imported on first use, from these modules
    "symjax_mlp._artifact.reading": ("Artifact", "inspect"),
    "symjax_mlp._artifact.signature": ("Signature",),
    "symjax_mlp._export": ("export",),
    "symjax_mlp._hybrid.graph": ("Graph", "stage"),
    "symjax_mlp._hybrid.hybrid": ("Hybrid",),
    "symjax_mlp._hybrid.make": ("hybridize", "shard"),
    "symjax_mlp._hybrid.mesh": ("data_mesh",),
    "symjax_mlp._hybrid.trace": ("TraceEvent",),
    "symjax_mlp._load": ("load",),
    "symjax_mlp._loaded": ("LoadedModel",),
    "symjax_mlp._models": ("ACTIVATIONS", "Dense", "HybridConcurrent", "HybridSequential", "mlp"),
    "symjax_mlp._signing": ("sign", "verify_signature"),
    "symjax_mlp._specs": ("TensorSpec",),
    "symjax_mlp._timeit": ("CallTiming", "timeit"),
    "symjax_mlp._verify": ("VerifyCheck", "VerifyReport", "verify"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}
_PACKAGES = ("chapter", "serving", "training")


def __getattr__(name: str):
    """Hybrid, export, the models (flax) and the sub-packages (optax, ...) load on first use:
    ``import symjax_mlp; symjax_mlp.load(path)`` imports none of them."""
    if name in _PACKAGES:
        return _importlib.import_module(f"symjax_mlp.{name}")
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'symjax_mlp' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF, *_PACKAGES})


__all__ = [
    "ACTIVATIONS",
    "Artifact",
    "ArtifactError",
    "CallTiming",
    "CheckpointError",
    "ConfigError",
    "ControlFlowError",
    "DataError",
    "Dense",
    "DivergenceError",
    "Graph",
    "Hybrid",
    "HybridConcurrent",
    "HybridSequential",
    "LoadedModel",
    "RetraceError",
    "RetraceWarning",
    "Signature",
    "SignatureError",
    "SymjaxError",
    "TensorSpec",
    "TraceEvent",
    "VerifyCheck",
    "VerifyReport",
    "chapter",
    "data_mesh",
    "export",
    "hybridize",
    "inspect",
    "load",
    "mlp",
    "serving",
    "shard",
    "sign",
    "stage",
    "timeit",
    "training",
    "verify",
    "verify_signature",
]
