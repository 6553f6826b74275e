"""The errors symjax_mlp raises. Every one derives from :class:`SymjaxError`."""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "ControlFlowError",
    "RetraceError",
    "SignatureError",
    "SymjaxError",
]


class SymjaxError(Exception):
    """Base class of every error raised by symjax_mlp; catch this to catch them all."""


class ArtifactError(SymjaxError):
    """An artifact directory is missing, corrupted, incompatible or cannot be written."""


class SignatureError(SymjaxError, ValueError):
    """An input does not match the shape or dtype a compiled program or artifact expects."""


class RetraceError(SymjaxError):
    """A :class:`~symjax_mlp.Hybrid` traced more often than its ``max_traces`` budget allows."""


class ControlFlowError(SymjaxError, TypeError):
    """Python control flow or a host conversion was applied to a traced (symbolic) value."""
