"""Where checkpoints may live: a path, to a directory this user can make and write."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from symjax_mlp._errors import CheckpointError, ConfigError

MANIFEST = "manifest.json"  # a step_* checkpoint's (and an exported artifact's)


def check_path(path: Any, caller: str) -> None:
    """Refuses anything but a str or ``os.PathLike`` of a str (pathlib's TypeError, else), and
    ``''`` (``Path('')`` is the working directory)."""
    if not isinstance(path, str | os.PathLike) or not isinstance(os.fspath(path), str):
        raise ConfigError(
            f"{caller}: the checkpoint path must be a str or os.PathLike directory; got "
            f"{type(path).__name__} {repr(path)[:80]}. Pass e.g. 'checkpoints' or "
            "pathlib.Path('checkpoints') (bytes: os.fsdecode(path))."
        )
    if not os.fspath(path):  # Path("") is the working directory
        raise ConfigError(
            f"{caller}: the checkpoint directory is '' (the working directory, by accident?). "
            "Pass a directory, e.g. 'checkpoints'."
        )


def check_directory(directory: str | os.PathLike, caller: str) -> None:
    """Refuses a file, a dangling symlink, a path below a file, a checkpoint (not a directory
    of them), or a directory this user cannot write or list; a path that does not exist yet is
    fine below a directory this user can write."""

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(
            f"{caller}: the checkpoint directory {why}. Checkpoints are step_* directories inside "
            "a checkpoint directory: pass a directory, or a path where one can be made."
        )

    check_path(directory, caller)
    path = Path(directory)
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:  # a name too long, a directory that may not be searched
        raise refuse(f"{directory} cannot be used: {e.strerror}") from None
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            try:
                os.stat(probe)  # raises, as exists() said
                end = "does not exist"
            except OSError as e:  # dangling, or a chain that returns to itself
                end = "loops back" if e.errno == errno.ELOOP else "does not exist"
            to = f"{probe} is a symlink to {os.readlink(probe)}, which {end}"
            raise refuse(f"{directory} cannot be made: {to}")
        if probe.parent == probe:  # nothing exists up to the root: mkdir will say
            return
        probe = probe.parent
    if not probe.is_dir():
        what = "is" if probe == path else f"is below {probe}, which is"
        raise refuse(f"{directory} {what} a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise refuse(f"{directory} cannot be written: this user may not write to {probe}")
    if probe == path and not os.access(path, os.R_OK):  # its checkpoints could not be listed
        raise refuse(f"{directory} cannot be read: this user may not list what it holds")
    if probe == path and os.path.lexists(path / MANIFEST):  # step_* written inside a checkpoint
        raise refuse(
            f"{directory} holds a {MANIFEST}: it is a checkpoint (or an exported artifact), not "
            f"a directory of checkpoints; pass its parent, {path.parent}, or another directory"
        )
