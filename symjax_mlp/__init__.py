"""symjax_mlp: hybrid programming for Flax MLPs.

Write the model imperatively, flip one switch (:func:`hybridize`) and get the symbolic program
as a jaxpr (:class:`Graph`), an XLA-compiled call, and a portable StableHLO artifact.
"""

from symjax_mlp.errors import (
    ArtifactError,
    ControlFlowError,
    RetraceError,
    SignatureError,
    SymjaxError,
)
from symjax_mlp.graph import Graph, stage
from symjax_mlp.hybrid import ArgSpec, Hybrid, TraceEvent, hybridize
from symjax_mlp.models import ACTIVATIONS, Dense, HybridConcurrent, HybridSequential, mlp

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "ArgSpec",
    "ArtifactError",
    "ControlFlowError",
    "Dense",
    "Graph",
    "Hybrid",
    "HybridConcurrent",
    "HybridSequential",
    "RetraceError",
    "SignatureError",
    "SymjaxError",
    "TraceEvent",
    "hybridize",
    "mlp",
    "stage",
]
