"""Training checkpoints without pickle: a directory ``step_<8 digits>`` holding
``state.safetensors`` (a tensor per leaf, named by its key path; the PRNG key data as ``rng``)
and ``manifest.json``, written atomically. A restore's checks serve Orbax's checkpoints too."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
import os
import re
import shutil
import stat
import typing
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save

from symjax_mlp._artifact.weights import MAX_TENSORS, read_safetensors_file
from symjax_mlp._errors import CheckpointError, ConfigError
from symjax_mlp._files import MANIFEST, read_regular, sha256, write_dir
from symjax_mlp.training._paths import (
    check_directory,
    check_path,
    checkpoints,
    latest_checkpoint,
    named_step,
)

_STATE_FILE = "state.safetensors"
_MAX_MANIFEST_BYTES = 64 << 20
_MAX_TENSORS = 8 * MAX_TENSORS  # params and the optimizer's state of them
_SHA256 = re.compile(r"[0-9a-f]{64}")
_HEADER = {"format": "symjax_mlp.checkpoint", "format_version": 1}
_NO_CHECKPOINT = (
    "symjax_mlp.training.restore_checkpoint: {path} {why}. A checkpoint is a step_* directory "
    "holding manifest.json, as save_checkpoint and train(checkpoint=...) write: pass one, or the "
    "directory holding them (its newest is restored)."
)


_METADATA = (
    "save_checkpoint(metadata=...): the metadata is a dict whose 'config' (if given) is a dict "
    "and whose 'history' (if given) is a list of EpochRecord fields, as train() writes them; "
    "got {got}. restore_checkpoint would refuse that checkpoint: put your own values under "
    "other keys."
)


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One epoch of the history: mean training loss and accuracies after it."""

    epoch: int
    step: int
    loss: float
    train_accuracy: float
    test_accuracy: float
    seconds: float


_RECORD = typing.get_type_hints(EpochRecord)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a training run needs to continue exactly, as a pytree.

    Attributes:
      params: the model parameters (the ``"params"`` collection).
      opt_state: the optax optimizer state.
      rng: a typed PRNG key; split once per epoch for the shuffle.
      step, epoch: optimizer updates applied and epochs completed so far.
    """

    params: Any
    opt_state: Any
    rng: jax.Array
    step: int = dataclasses.field(default=0, metadata={"static": True})
    epoch: int = dataclasses.field(default=0, metadata={"static": True})


def is_count(x: Any, low: int = 0) -> bool:
    """Whether ``x`` is an int (not a bool) ``>= low``."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def as_int(x: Any) -> Any:
    """``x`` as an int if it is an integer of any kind (``np.int64``, a 0-d int array) but a
    bool; else ``x`` as it is, for its check to refuse."""
    if isinstance(x, bool | np.bool_):
        return x
    try:
        return operator.index(x)
    except TypeError:
        return x


def _name(prefix: str, path: Any) -> str:
    return prefix + "/" + jax.tree_util.keystr(path, simple=True, separator="/")


def _is_key(leaf: Any) -> bool:
    """A typed PRNG key (optax.noisy_sgd's state holds one): stored as its key data."""
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def named_leaves(state: TrainState) -> dict[str, Any]:
    """A checkpoint's tensors: ``{key path: leaf}`` of params and optimizer state, and ``rng``."""
    tensors: dict[str, Any] = {}
    for prefix in ("params", "opt_state"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(state, prefix)):
            name = _name(prefix, path)
            if name in tensors:
                raise CheckpointError(
                    f"two leaves of the training state are both named {name!r}; rename the "
                    "dict keys that contain '/' so every leaf has its own checkpoint name."
                )
            tensors[name] = jax.random.key_data(leaf) if _is_key(leaf) else leaf
    tensors["rng"] = jax.random.key_data(state.rng)
    return tensors


def state_of(arrays: dict[str, Any], like: TrainState, manifest: dict[str, Any]) -> TrainState:
    """The state of ``arrays`` (as :func:`named_leaves` names them) in ``like``'s structure."""

    def leaf(a: Any, like_leaf: Any) -> Any:
        if not _is_key(like_leaf):
            return a
        return jax.random.wrap_key_data(a, impl=jax.random.key_impl(like_leaf))

    def tree(prefix: str, like_tree: Any) -> Any:
        paths, treedef = jax.tree_util.tree_flatten_with_path(like_tree)
        leaves = [leaf(arrays[_name(prefix, p)], like_leaf) for p, like_leaf in paths]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    rng = jax.random.wrap_key_data(np.asarray(arrays["rng"]), impl=jax.random.key_impl(like.rng))
    params, opt_state = tree("params", like.params), tree("opt_state", like.opt_state)
    return TrainState(params, opt_state, rng, step=manifest["step"], epoch=manifest["epoch"])


def check_fit(path: Any, stored: dict[str, tuple], wanted: dict[str, tuple]) -> None:
    """Refuses a checkpoint whose tensors (``{name: (shape, dtype)}``) are not ``wanted``'s."""
    missing, extra = sorted(set(wanted) - set(stored)), sorted(set(stored) - set(wanted))
    if missing or extra:
        raise CheckpointError(
            f"{path} does not fit this model and optimizer: missing tensors {missing[:5]}, "
            f"unexpected tensors {extra[:5]}. Resume with the model and optimizer that wrote it."
        )
    for name, (shape, dtype) in wanted.items():
        got_shape, got_dtype = stored[name]
        if tuple(got_shape) != tuple(shape) or str(got_dtype) != str(dtype):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(got_shape)} and dtype {got_dtype}, but "
                f"this model expects shape {tuple(shape)} and dtype {dtype}. The checkpoint was "
                "written for another model or feature width; resume with the same ones."
            )


def specs(tensors: dict[str, Any]) -> dict[str, tuple]:
    """``{name: (shape, dtype)}``; a Python number's as save_checkpoint stores it."""
    arrays = {n: a if hasattr(a, "dtype") else np.asarray(a) for n, a in tensors.items()}
    return {name: (tuple(a.shape), str(a.dtype)) for name, a in arrays.items()}


def broken(path: Any, what: str) -> CheckpointError:
    """The error for a checkpoint that is incomplete, corrupted or was edited."""
    return CheckpointError(
        f"{path}: {what}; the checkpoint is incomplete, corrupted or was edited. Resume from an "
        "older checkpoint (remove this checkpoint's directory: resume=True picks the newest), or "
        "start over in an empty directory."
    )


def check_manifest(
    file: Path, manifest: Any, header: dict[str, Any], step: int | None, **fields: bool
) -> None:
    """Refuses a manifest without ``header``, with a field missing or mistyped, or of a step
    other than ``step`` (its directory's); ``fields``: the format's own fields' checks."""
    if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in header.items()):
        got = {k: manifest.get(k) for k in header} if isinstance(manifest, dict) else manifest
        raise CheckpointError(
            f"{file.parent} is not a symjax_mlp checkpoint of {header} (its manifest holds "
            f"{str(got)[:80]}). Resume from a checkpoint train() wrote."
        )
    meta = manifest.get("metadata", {})
    records = meta if isinstance(meta, dict) else {}
    ok = {
        "step": is_count(manifest.get("step")),
        "epoch": is_count(manifest.get("epoch")),
        **fields,
        "metadata": isinstance(meta, dict),
        "metadata.config": isinstance(records.get("config", {}), dict),
        "metadata.history": _history_ok(records.get("history", [])),
    }
    bad = [k for k, good in ok.items() if not good]
    if bad:
        raise broken(file, f"the field(s) {', '.join(bad)} are missing or of the wrong type")
    if step is not None and step != manifest["step"]:
        raise broken(
            file, f"its step is {manifest['step']}, but the directory is {file.parent.name}"
        )


def _history_ok(history: Any) -> bool:
    """A list of epoch records: each exactly the fields of ``EpochRecord``, as numbers."""

    def number(v: Any, kind: type) -> bool:  # json reads NaN and Infinity
        return type(v) in (int, kind) and (type(v) is int or math.isfinite(v))

    return isinstance(history, list) and all(
        isinstance(r, dict)
        and set(r) == set(_RECORD)
        and all(number(r[k], kind) for k, kind in _RECORD.items())
        for r in history
    )


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
      CheckpointError: ``directory`` cannot hold checkpoints; a checkpoint for this step, or a
        newer one, already exists; or a leaf name is ambiguous.
      ConfigError: ``state`` is not a :class:`TrainState`; ``keep`` below 1, a negative step,
        or ``metadata`` that is not JSON or whose ``config``/``history`` a restore refuses.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from symjax_mlp.training import TrainState, save_checkpoint
      >>> p = {"w": jnp.zeros(2)}
      >>> s = TrainState(p, optax.adam(1e-3).init(p), jax.random.key(0), step=3)
      >>> save_checkpoint(getfixture("tmp_path"), s).name
      'step_00000003'
    """
    keep = as_int(keep)  # as train()'s settings
    if not is_count(keep, 1):
        raise ConfigError(
            f"save_checkpoint(keep={keep!r}): pass how many checkpoints to keep, an int >= 1."
        )
    check_state(state, "save_checkpoint")
    if not all(isinstance(n, numbers.Integral) and n >= 0 for n in (state.step, state.epoch)):
        raise ConfigError(
            f"save_checkpoint: step and epoch are counts (ints >= 0); got step {state.step!r}, "
            f"epoch {state.epoch!r}."
        )
    check_directory(directory, "save_checkpoint")
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # raced, or a file system that refuses: still the user's to fix
        raise CheckpointError(
            f"save_checkpoint: cannot make the checkpoint directory {directory} ({e}). Pass a "
            "directory path that can be created and written."
        ) from None
    final = directory / f"step_{state.step:08d}"
    if (done := checkpoints(directory)) and done[-1][0] > state.step:
        raise CheckpointError(
            f"{directory} already holds {done[-1][1].name}, newer than step {state.step}: a resume "
            "picks the newest, so this one would be pruned or passed over. Save to another "
            "directory, or remove the newer checkpoints first."
        )
    tensors = {name: np.asarray(leaf) for name, leaf in named_leaves(state).items()}
    state_bytes = save(tensors)
    manifest = {
        **_HEADER,
        "step": int(state.step),
        "epoch": int(state.epoch),
        "files": {_STATE_FILE: sha256(state_bytes)},
        "tensors": {n: {"shape": list(a.shape), "dtype": str(a.dtype)} for n, a in tensors.items()},
        "jax_version": jax.__version__,
        "metadata": metadata or {},
    }
    try:
        text = json.dumps(manifest, indent=1, allow_nan=False)
    except (TypeError, ValueError) as e:  # NaN, a NumPy scalar, an object
        raise ConfigError(
            f"save_checkpoint(metadata=...): {e}. The metadata is JSON: strings, finite "
            "numbers, lists and dicts (convert NumPy values with .item() or .tolist())."
        ) from None
    try:  # what restore_checkpoint checks of the metadata: refused now, not found unreadable
        check_manifest(final / MANIFEST, json.loads(text), _HEADER, None, files=True)
    except CheckpointError:
        raise ConfigError(_METADATA.format(got=str(metadata)[:200])) from None
    files = {_STATE_FILE: state_bytes, MANIFEST: (text + "\n").encode()}
    write_dir(final, files, overwrite=False, check=_check_new, error=CheckpointError)
    for _, old in checkpoints(directory)[:-keep]:
        if old != final:  # a writer racing ours saved a newer step: ours stays, for it
            shutil.rmtree(old, ignore_errors=True)
    return final


def check_state(state: Any, caller: str) -> None:
    """Refuses anything but a :class:`TrainState` whose ``rng`` is a PRNG key."""
    try:
        ok = isinstance(state, TrainState) and jax.random.key_data(state.rng) is not None
    except TypeError:
        ok = False
    if not ok:
        got = type(state).__name__
        got = f"a TrainState whose rng is {state.rng!r}" if got == "TrainState" else f"a {got}"
        raise ConfigError(
            f"{caller}: the state must be a TrainState(params, opt_state, rng, step=, epoch=) "
            f"with rng a PRNG key; got {got}. Wrap yours: TrainState(params, opt_state, "
            "jax.random.key(seed), step=step)."
        )


def _check_new(final: Path, overwrite: bool) -> None:
    if final.exists() or final.is_symlink():
        raise CheckpointError(
            f"checkpoint {final} already exists; a step is written once. Resume from it, or "
            "use another checkpoint directory."
        )


def restore_checkpoint(
    path: str | os.PathLike, like: TrainState
) -> tuple[TrainState, dict[str, Any]]:
    """Reads a checkpoint into the tree structure of ``like`` (a freshly initialised state).

    Args:
      path: a ``step_*`` checkpoint, or a checkpoint directory (its newest checkpoint).
      like: a state of the same model and optimizer (only its structure, shapes and dtypes).

    Returns:
      ``(state, metadata)``: the restored state and the manifest's ``metadata``.

    Raises:
      CheckpointError: no checkpoint, a file, a corrupted or foreign one, or one whose tensors
        do not match ``like``.
      ConfigError: ``path`` is not a str or ``os.PathLike``, or is ``''``; ``like`` is not a
        :class:`TrainState`.
    """
    check_path(path, "symjax_mlp.training.restore_checkpoint")
    check_state(like, "restore_checkpoint(like=...)")
    path = Path(path)
    try:  # os.stat: Path's raises past NAME_MAX where this names the error
        why = None if stat.S_ISDIR(os.stat(path).st_mode) else "is a file, not a checkpoint"
    except FileNotFoundError:
        why = "does not exist"
    except OSError as e:  # a name past NAME_MAX, a symlink loop, a file above it
        why = f"cannot be read ({e.strerror})"
    if why is None and named_step(path) is None and not os.path.lexists(path / MANIFEST):
        newest = latest_checkpoint(path)  # a checkpoint directory: its newest
        path, why = (path, "holds no step_* checkpoint") if newest is None else (newest, None)
    if why is not None:
        raise CheckpointError(_NO_CHECKPOINT.format(path=path, why=why))
    file, step = path / MANIFEST, named_step(path)
    try:
        manifest = json.loads(read_regular(file, limit=_MAX_MANIFEST_BYTES, error=CheckpointError))
    except FileNotFoundError:
        raise broken(file, "the file is missing") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise broken(file, f"not valid JSON ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    digest = files.get(_STATE_FILE) if isinstance(files, dict) else None
    sha_ok = isinstance(digest, str) and _SHA256.fullmatch(digest) is not None
    check_manifest(file, manifest, _HEADER, step, files=sha_ok)
    try:  # the artifact reader's own checks: no link or FIFO, strict, hashed as it is read
        stored, _ = read_safetensors_file(
            path / _STATE_FILE, sha256=digest, error=CheckpointError, max_tensors=_MAX_TENSORS
        )
    except FileNotFoundError:
        raise broken(path / _STATE_FILE, "the file is missing") from None
    check_fit(path, specs(stored), specs(named_leaves(like)))
    arrays = {name: jnp.asarray(a) for name, a in stored.items()}
    return state_of(arrays, like, manifest), manifest.get("metadata", {})
