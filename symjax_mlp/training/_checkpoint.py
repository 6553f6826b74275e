"""Training checkpoints without pickle: a directory ``step_<8 digits>`` holding
``state.safetensors`` (a tensor per leaf, named by its key path; the PRNG key data as ``rng``)
and ``manifest.json``, written atomically. A restore's checks serve Orbax's checkpoints too."""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import numbers
import os
import re
import secrets
import shutil
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save

from symjax_mlp._artifact.format import printable
from symjax_mlp._artifact.weights import MAX_TENSORS, read_safetensors_file, serialized
from symjax_mlp._errors import CheckpointError, ConfigError, as_int
from symjax_mlp._files import MANIFEST, sha256, write_dir
from symjax_mlp._reader import read_regular
from symjax_mlp.training._paths import (
    check_directory,
    check_path,
    check_strays,
    checkpoints,
    latest_checkpoint,
    named_step,
    step_name,
)
from symjax_mlp.training._state import (
    RECORD,
    TrainState,
    check_fit,
    check_others,
    check_state,
    eval_point,
    is_count,
    named_leaves,
    specs,
    started_from,
    state_of,
)

_STATE_FILE = "state.safetensors"
_MAX_MANIFEST_BYTES = 64 << 20
_MAX_TENSORS = 8 * MAX_TENSORS  # params and the optimizer's state of them
_SHA256 = re.compile(r"[0-9a-f]{64}")
_HEADER = {"format": "symjax_mlp.checkpoint", "format_version": 1}
_RESTORE = "symjax_mlp.training.restore_checkpoint"
_SAVE = "symjax_mlp.training.save_checkpoint"
_NO_CHECKPOINT = (
    "{path} {why}. A checkpoint is a step_* directory "
    "holding manifest.json, as save_checkpoint and train(checkpoint=...) write: pass one, or the "
    "directory holding them (its newest is restored)."
)
_WRITE_FAILED = "Then save again: train(resume=True) continues from the newest checkpoint there."
_METADATA = (
    _SAVE + "(metadata=...): the metadata is a dict whose 'config' (if given) is a dict "
    "and whose 'history' (if given) is a list of EpochRecord fields, as train() writes them; "
    "got {got}. restore_checkpoint would refuse that checkpoint: put your own values under "
    "other keys."
)


#: what to do with a checkpoint that cannot be used (``_OLDER``) or that train() did not write
#: (``_FOREIGN``), by who reads it: a resume, or a new run's start (``init_from``), whose reads
#: run in :func:`starting_from`
_OLDER = {
    "resume": "Resume from an older checkpoint (remove this checkpoint's directory: resume=True "
    "picks the newest), or start over in an empty directory.",
    "init_from": "Start from another checkpoint (init_from=DIR/step_N names one), or leave "
    "init_from out to train from the model's own initialisation.",
}
_FOREIGN = {
    "resume": "Resume from a checkpoint train() wrote.",
    "init_from": "A new run starts from the weights of a checkpoint train(checkpoint=DIR) wrote "
    "(an exported artifact is none): pass that directory, or one of its step_* checkpoints, or "
    "leave init_from out to train from the model's own initialisation.",
}
_READING = contextvars.ContextVar("symjax_mlp_checkpoint_reading", default="resume")


def older() -> str:
    """What to do instead of reading a checkpoint that cannot be used, as its reader goes on."""
    return _OLDER[_READING.get()]


def broken_fix() -> str:  # whatever is wrong with the checkpoint's files
    return f"the checkpoint is incomplete, corrupted or was edited. {older()}"


def broken(path: Any, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; {broken_fix()}")


@contextlib.contextmanager
def starting_from() -> Iterator[None]:
    """The reads of a new run's start (``init_from``), whose fixes are :data:`_OLDER`'s."""
    token = _READING.set("init_from")
    try:
        yield
    finally:
        _READING.reset(token)


def check_manifest(
    file: Path, manifest: Any, header: dict[str, Any], step: int | None, **fields: bool
) -> None:
    """Refuses a manifest without ``header``, with a field missing or mistyped, or of a step
    other than ``step`` (its directory's); ``fields``: the format's own fields' checks."""
    if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in header.items()):
        got = {k: manifest.get(k) for k in header} if isinstance(manifest, dict) else manifest
        raise CheckpointError(
            f"{file.parent} is not a symjax_mlp checkpoint of {header} (its manifest holds "
            f"{printable(str(got)[:80])}). {_FOREIGN[_READING.get()]}"
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

    def number(v: Any, kind: type) -> bool:  # json reads NaN and Infinity, and 10**400
        if type(v) not in (int, kind):
            return False
        return abs(v) <= sys.float_info.max if type(v) is int else math.isfinite(v)

    return isinstance(history, list) and all(
        isinstance(r, dict)
        and set(r) == set(RECORD)
        and all(number(r[k], kind) for k, kind in RECORD.items())
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
    if not is_count(keep := as_int(keep), 1):  # as_int: as train()'s settings
        raise ConfigError(
            f"{_SAVE}(keep={keep!r}): pass how many checkpoints to keep, an int >= 1."
        )
    check_state(state, _SAVE)
    if not all(isinstance(n, numbers.Integral) and n >= 0 for n in (state.step, state.epoch)):
        raise ConfigError(f"{_SAVE}: step and epoch are counts (ints >= 0); got step "
                          f"{state.step!r}, epoch {state.epoch!r}.")  # fmt: skip
    check_directory(directory, _SAVE)
    try:
        (directory := Path(directory)).mkdir(parents=True, exist_ok=True)
    except OSError as e:  # raced, or a file system that refuses: still the user's to fix
        raise CheckpointError(f"{_SAVE}: cannot make the checkpoint directory {directory} "
                              f"({e}). Pass a directory path that can be created and written."
                              ) from None  # fmt: skip
    final = directory / step_name(state.step)
    if (done := checkpoints(directory)) and done[-1][0] > state.step:
        raise CheckpointError(
            f"{_SAVE}: {directory} already holds {done[-1][1].name}, newer than step "
            f"{state.step}: a resume picks the newest, so this one would be pruned or passed "
            "over. Save to another directory, or remove the newer checkpoints first."
        )
    tensors = {name: np.asarray(leaf) for name, leaf in named_leaves(state).items()}
    try:
        state_bytes = serialized(lambda: save(tensors), sum(a.nbytes for a in tensors.values()))
    except SafetensorError:  # a str, object or complex128 leaf: no safetensors dtype
        name, a = next((n, a) for n, a in tensors.items() if not _storable(a))
        raise ConfigError(
            f"{_SAVE}: the state's leaf {name!r} is {a.dtype}{list(a.shape)}, which a "
            "checkpoint cannot store (numbers, bools and PRNG keys only). Keep it out of the "
            "state (metadata= takes JSON), or convert it, e.g. to float32."
        ) from None
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
            f"{_SAVE}(metadata=...): {e}. The metadata is JSON: strings, finite "
            "numbers, lists and dicts (convert NumPy values with .item() or .tolist())."
        ) from None
    try:  # what restore_checkpoint checks of the metadata: refused now, not found unreadable
        check_manifest(final / MANIFEST, json.loads(text), _HEADER, None, files=True)
    except CheckpointError:
        raise ConfigError(_METADATA.format(got=str(metadata)[:200])) from None
    files = {_STATE_FILE: state_bytes, MANIFEST: (text + "\n").encode()}
    try:
        write_dir(final, files, overwrite=False, check=_check_new, error=CheckpointError,
                  then=_WRITE_FAILED)  # fmt: skip
    except CheckpointError as e:  # a full disk, a failing device: the call first
        if isinstance(e.__cause__, OSError):
            raise CheckpointError(f"{_SAVE}: {e}") from e.__cause__
        raise
    for _, old in checkpoints(directory)[:-keep]:
        if old != final:  # a writer racing ours saved a newer step: ours stays, for it
            with contextlib.suppress(OSError):  # another writer pruned it first
                os.rename(old, old.with_name(f".{old.name}.old-{secrets.token_hex(8)}"))
    for gone in directory.glob(".step_*.old-*"):  # out of sight first: a Ctrl-C in the removal
        shutil.rmtree(gone, ignore_errors=True)  # leaves no step_* half deleted (removed next)
    return final


def _storable(a: np.ndarray) -> bool:
    try:
        save({"a": a.reshape(-1)[:0]})  # safetensors' own dtype check, on no data
    except SafetensorError:
        return False
    return True


def _check_new(final: Path, overwrite: bool) -> None:
    if final.exists() or final.is_symlink():
        raise CheckpointError(
            f"{_SAVE}: checkpoint {final} already exists; a step is written once. Resume from "
            "it, or use another checkpoint directory."
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
    check_path(path, _RESTORE)
    check_state(like, f"{_RESTORE}(like=...)")
    try:
        return read_checkpoint(Path(path), like)
    except CheckpointError as e:  # each names the checkpoint; the call first, as the others do
        raise CheckpointError(f"{_RESTORE}: {e}") from None


def read_checkpoint(
    path: Path, like: TrainState, *, weights: Callable[[Path, dict], None] | None = None
) -> tuple[TrainState, dict[str, Any]]:
    """:func:`restore_checkpoint`, its errors naming the checkpoint, not the call. With
    ``weights``, a new run's start: only its params are read (the rest are ``like``'s, step and
    epoch 0), once ``weights(checkpoint, metadata)`` has checked its metadata."""
    try:  # os.stat: Path's raises past NAME_MAX where this names the error
        why = None if stat.S_ISDIR(os.stat(path).st_mode) else "is a file, not a checkpoint"
    except FileNotFoundError:
        why = "does not exist"
    except OSError as e:  # a name past NAME_MAX, a symlink loop, a file above it
        why = f"cannot be read ({e.strerror})"
    if why is None and named_step(path) is None and not os.path.lexists(path / MANIFEST):
        newest = latest_checkpoint(path)  # a checkpoint directory: its newest
        if newest is not None:  # none newer that is no checkpoint (a symlink), passed over
            check_strays(path, "", reading=True)
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
    metadata = manifest.get("metadata", {})
    if weights is not None:  # its model checked before its tensors: a refusal says which differs
        weights(path, metadata)
    wanted = {  # with weights: its params (model state too) only
        n: a for n, a in named_leaves(like).items() if not weights or n.startswith("params/")
    }

    def select(declared: dict[str, np.ndarray]) -> set[str]:  # before a tensor is held
        mine = {n: a for n, a in declared.items() if not weights or n.startswith("params/")}
        check_fit(path, specs(mine), specs(wanted))
        others = {n: (a.shape, a.dtype) for n, a in declared.items() if n not in mine}  # init_from
        check_others(path, others, wanted)  # another run's optimizer state, hashed: bounded
        if not weights or (evaluation := _evaluation(declared)) is None:
            return set(mine)  # init_from: the optimizer's tensors unread (another's, any size)
        prefix, made = evaluation
        return {*mine, prefix + "b1", prefix + "weight_sum", *made.values()}

    try:  # the artifact reader's own checks (no link or FIFO, strict, hashed), a checkpoint's fix
        stored, _ = read_safetensors_file(
            path / _STATE_FILE, sha256=digest, error=CheckpointError, max_tensors=_MAX_TENSORS,
            fix=broken_fix(), select=select,
        )  # fmt: skip
    except FileNotFoundError:
        raise broken(path / _STATE_FILE, "the file is missing") from None
    if weights:
        return started_from(evaluated_weights(stored), like), metadata
    return state_of({n: jnp.asarray(a) for n, a in stored.items()}, like, manifest), metadata


def _evaluation(tensors: dict[str, np.ndarray]) -> tuple[str, dict[str, str]] | None:
    """A schedule-free run's state among ``tensors``: its prefix (of scalars ``b1`` and
    ``weight_sum``), and each param's ``z`` by the param's name; ``None`` for another run's."""
    ends = [
        n.removesuffix("b1") for n in tensors if n.startswith("opt_state/") and n.endswith("/b1")
    ]
    found = [
        p
        for p in ends
        if tensors[p + "b1"].ndim == 0 == getattr(tensors.get(p + "weight_sum"), "ndim", 1)
    ]
    if len(found) != 1:  # none, or several (each of some params): as train() leaves them
        return None
    (prefix,), made = found, {}
    for name, z in tensors.items():  # z/PATH: params/PATH (a model's state: params/params/PATH)
        if name.startswith(prefix + "z/"):
            path = name.removeprefix(prefix + "z/")
            ys = [f"params/{path}", f"params/params/{path}"]
            y = next((n for n in ys if getattr(tensors.get(n), "shape", None) == z.shape), None)
            if y is not None:  # a param wrt= froze has no z: as it is
                made[y] = name
    return prefix, made


def evaluated_weights(stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A schedule-free run's params as its eval params, as train() reported and exported them
    (``schedule_free_eval_params``): its checkpoint holds the point its gradients were taken
    at, ``y``, and ``z``: ``x = (y - (1 - b1) z) / b1``. Any other run's, as they are."""
    if (evaluation := _evaluation(stored)) is None:
        return stored
    (prefix, made), out = evaluation, dict(stored)
    b1 = stored[prefix + "b1"]
    for y, z in made.items():
        out[y] = eval_point(stored[y], stored[z], b1)
    return out
