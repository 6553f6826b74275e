"""Training checkpoints without pickle: safetensors for the arrays, JSON for the rest.

A checkpoint is a directory ``step_<8 digits>`` inside a checkpoint directory:

* ``state.safetensors``: one tensor per leaf of the params and the optimizer state, named by
  its key path (``params/layers_0/kernel``, ``opt_state/0/mu/layers_0/kernel``), plus the
  PRNG key data as ``rng``;
* ``manifest.json`` (written last): format version, step, epoch, the sha256 and the name,
  shape and dtype of every tensor, and any JSON-able ``metadata`` (the history, the config).

Each checkpoint is written into a temporary directory beside it and renamed into place, so a
crash never leaves a half-written ``step_*``; older ones are pruned only after the new one is
in place. Restoring reads the tensors back into the tree structure of a freshly initialised
state, checking every name, shape and dtype, so no code object is ever deserialized.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from symjax_mlp.errors import ArtifactError

__all__ = ["TrainState", "latest_checkpoint", "restore_checkpoint", "save_checkpoint"]

FORMAT_VERSION = 1
_STATE_FILE = "state.safetensors"
_MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a training run needs to continue exactly: a pytree.

    Attributes:
      params: the model parameters (the ``"params"`` collection).
      opt_state: the optax optimizer state.
      rng: a typed PRNG key; split once per epoch for the shuffle.
      step: optimizer updates applied so far.
      epoch: epochs completed so far.
    """

    params: Any
    opt_state: Any
    rng: jax.Array
    step: int = dataclasses.field(default=0, metadata={"static": True})
    epoch: int = dataclasses.field(default=0, metadata={"static": True})


def _tensors(state: TrainState) -> dict[str, np.ndarray]:
    """Flattens ``state`` into ``{key path: array}``; names must be unique."""
    tensors: dict[str, np.ndarray] = {}
    for prefix in ("params", "opt_state"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(state, prefix)):
            name = prefix + "/" + jax.tree_util.keystr(path, simple=True, separator="/")
            if name in tensors:
                raise ArtifactError(
                    f"two leaves of the training state are both named {name!r}; rename the "
                    "dict keys that contain '/' so every leaf has its own checkpoint name."
                )
            tensors[name] = np.asarray(leaf)
    tensors["rng"] = np.asarray(jax.random.key_data(state.rng))
    return tensors


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    directory: str | os.PathLike,
    state: TrainState,
    *,
    metadata: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Writes ``state`` as ``directory/step_<step>`` atomically; keeps the newest ``keep``.

    Args:
      directory: the checkpoint directory (created if missing).
      state: the state to save; its arrays are copied to host memory.
      metadata: JSON-able extras stored in the manifest (e.g. the history).
      keep: how many checkpoints to keep, newest first (at least 1).

    Returns:
      The path of the new checkpoint.

    Raises:
      ArtifactError: a checkpoint for this step already exists, or a leaf name is ambiguous.

    Example:
      >>> import optax
      >>> p = {"w": jnp.zeros(2)}
      >>> s = TrainState(p, optax.adam(1e-3).init(p), jax.random.key(0), step=3)
      >>> save_checkpoint(tempfile.mkdtemp(), s).name
      'step_00000003'
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1; got {keep!r}.")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step_{state.step:08d}"
    if final.exists():
        raise ArtifactError(
            f"checkpoint {final} already exists; a step is written once. Resume from it, or "
            "use another checkpoint directory."
        )
    tensors = _tensors(state)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=directory))
    try:
        save_file(tensors, tmp / _STATE_FILE)
        manifest = {
            "format": "symjax_mlp.checkpoint",
            "format_version": FORMAT_VERSION,
            "step": state.step,
            "epoch": state.epoch,
            "files": {_STATE_FILE: _sha256(tmp / _STATE_FILE)},
            "tensors": {
                name: {"shape": list(a.shape), "dtype": str(a.dtype)} for name, a in tensors.items()
            },
            "jax_version": jax.__version__,
            "metadata": metadata or {},
        }
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1, allow_nan=False) + "\n")
        for name in (_STATE_FILE, _MANIFEST):
            _fsync(tmp / name)
        os.rename(tmp, final)  # atomic: a step_* directory is complete or absent
        _fsync(directory)  # make the rename itself durable
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in _checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint in ``directory``, or ``None`` if it holds none."""
    found = _checkpoints(Path(directory))
    return found[-1] if found else None


def restore_checkpoint(
    path: str | os.PathLike, like: TrainState
) -> tuple[TrainState, dict[str, Any]]:
    """Reads a checkpoint into the tree structure of ``like`` (a freshly initialised state).

    Args:
      path: a ``step_*`` checkpoint, or a checkpoint directory (its newest checkpoint).
      like: a state of the same model and optimizer; only its structure, shapes and dtypes
        are used.

    Returns:
      ``(state, metadata)``: the restored state and the manifest's ``metadata``.

    Raises:
      ArtifactError: no checkpoint, a corrupted or foreign one, or one whose tensors do not
        match ``like`` (another model, feature width or optimizer); the message names the
        tensor, what the checkpoint holds and what was expected.
    """
    path = Path(path)
    if not (path / _MANIFEST).is_file():
        newest = latest_checkpoint(path)
        if newest is None:
            raise ArtifactError(f"no checkpoint in {path}: expected step_* directories in it.")
        path = newest
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path / _MANIFEST} cannot be read as JSON: {e}") from e
    if (
        manifest.get("format") != "symjax_mlp.checkpoint"
        or manifest.get("format_version") != FORMAT_VERSION
    ):
        raise ArtifactError(
            f"{path} is not a symjax_mlp checkpoint of format version {FORMAT_VERSION} "
            f"(manifest says {manifest.get('format')!r} v{manifest.get('format_version')!r})."
        )
    state_file = path / _STATE_FILE
    expected = manifest.get("files", {}).get(_STATE_FILE)
    if not state_file.is_file() or _sha256(state_file) != expected:
        raise ArtifactError(
            f"{state_file} is missing or does not match its sha256 in the manifest; the "
            "checkpoint is corrupted. Restore from an older step_* directory."
        )
    stored = load_file(state_file)
    wanted = _tensors(like)
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    if missing or extra:
        raise ArtifactError(
            f"{path} does not fit this model and optimizer: missing tensors {missing[:5]}, "
            f"unexpected tensors {extra[:5]}. Resume with the model and optimizer that wrote it."
        )
    for name, want in wanted.items():
        got = stored[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ArtifactError(
                f"{path}: tensor {name!r} has shape {got.shape} and dtype {got.dtype}, but this "
                f"model expects shape {want.shape} and dtype {want.dtype}. The checkpoint was "
                "written for another model or feature width; resume with the same ones."
            )

    def leaves(prefix: str, tree: Any) -> Any:
        paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        names = [
            prefix + "/" + jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in paths
        ]
        return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(stored[n]) for n in names])

    rng = jax.random.wrap_key_data(stored["rng"], impl=jax.random.key_impl(like.rng))
    state = TrainState(
        params=leaves("params", like.params),
        opt_state=leaves("opt_state", like.opt_state),
        rng=rng,
        step=int(manifest["step"]),
        epoch=int(manifest["epoch"]),
    )
    return state, manifest.get("metadata", {})
