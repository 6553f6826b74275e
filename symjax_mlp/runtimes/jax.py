"""Run an artifact with JAX: ``load(path)`` (the default runtime).

``model.jaxexport`` is deserialized with ``jax.export.deserialize`` (flatbuffers, no pickle)
and called through one ``jax.jit`` of ``Exported.call``, with the params as device arrays
passed as the first argument. XLA compiles once per input shape, and a module loaded again in
the same process (same sha256) reuses the compilations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from symjax_mlp.errors import ArtifactError
from symjax_mlp.manifest import (
    JAXEXPORT,
    check_calling_convention,
    compatibility_note,
    shape_dims,
)

__all__ = ["check_supported", "runner"]


def check_supported(path: Path, manifest: Mapping[str, Any]) -> None:
    """Refuses artifacts this JAX cannot run: calling convention, platform, device count."""
    check_calling_convention(manifest, file=path / JAXEXPORT)
    here = jax.export.default_export_platform()
    listed = tuple(manifest["platforms"])
    if here not in listed:
        raise ArtifactError(
            f"{path / 'manifest.json'}: the artifact was exported for {', '.join(listed)}, but "
            f"JAX here runs on {here}. Re-export it for this platform too, e.g. "
            f"export(h, path, example=x, platforms={(*listed, here)!r}, overwrite=True)."
        )
    need, have = manifest["nr_devices"], jax.device_count()
    if need > have:
        raise ArtifactError(
            f"{path / 'manifest.json'}: the artifact is sharded over {need} devices, but JAX "
            f"here sees {have} {here} device(s). Run it where {need} devices are visible, or "
            "re-export it unsharded."
        )


# sha256 of model.jaxexport -> (Exported, its jitted call), most recently loaded last.
_CALLS: dict[str, tuple[Any, Callable[..., Any]]] = {}
_MAX_CALLS = 8


def runner(
    path: Path,
    manifest: Mapping[str, Any],
    blobs: Mapping[str, bytes],
    params: Sequence[np.ndarray],
) -> Callable[[list[Any]], list[Any]]:
    """Deserializes ``model.jaxexport`` and returns ``run(inputs) -> [jax.Array, ...]``."""
    key = manifest["files"][JAXEXPORT]["sha256"]
    cached = _CALLS.pop(key, None)  # the same module loaded again: reuse its compilations
    if cached:
        exported, call = cached
    else:
        try:
            exported = jax.export.deserialize(bytearray(blobs[JAXEXPORT]))
        except Exception as e:  # an unreadable module: most likely made by an incompatible JAX
            raise ArtifactError(
                f"{path / JAXEXPORT}: jax.export could not deserialize it ({type(e).__name__}: "
                f"{e}). {compatibility_note(manifest)}"
            ) from e
        call = jax.jit(exported.call)
    want = [tuple(p["shape"]) for p in manifest["params"]] + [
        tuple(s["shape"]) for s in manifest["signature"]["inputs"]
    ]
    got = [shape_dims(a.shape) for a in exported.in_avals]
    agree = (
        got == want
        and list(exported.platforms) == list(manifest["platforms"])
        and exported.calling_convention_version == manifest["calling_convention_version"]
    )
    if not agree:
        raise ArtifactError(
            f"{path / JAXEXPORT} does not match {path / 'manifest.json'}: the module takes "
            f"{got} on {exported.platforms}, the manifest lists {want} on "
            f"{manifest['platforms']}. The artifact was edited; export it again."
        )
    _CALLS[key] = exported, call
    while len(_CALLS) > _MAX_CALLS:
        _CALLS.pop(next(iter(_CALLS)))  # least recently loaded
    leaves = [jax.numpy.asarray(a) for a in params]

    def run(inputs: list[Any]) -> list[Any]:
        return jax.tree.leaves(call(leaves, *inputs))

    return run
