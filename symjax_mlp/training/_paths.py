"""Where checkpoints live: a directory holding one directory per step, ``step_<8+ digits>``
(Orbax's ``<n>``, committed once its marker file is written), oldest first by step."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

from symjax_mlp._artifact.format import printable
from symjax_mlp._cache import shared_by_others
from symjax_mlp._errors import CheckpointError, ConfigError
from symjax_mlp._files import MANIFEST, planted_link

_STEP_DIR = re.compile(r"^step_(\d{8,})$")  # 8 digits, more past step 99,999,999
_ORBAX_DIR = re.compile(r"^(\d+)$")
COMMITTED = "_CHECKPOINT_METADATA"  # what Orbax writes last, committing a save


def check_path(path: Any, caller: str) -> None:
    """Refuses anything but a str or ``os.PathLike`` of a str, ``''`` (the working directory)
    and a NUL (os's ValueError)."""
    if not isinstance(path, str | os.PathLike) or not isinstance(os.fspath(path), str):
        raise ConfigError(
            f"{caller}: the checkpoint path must be a str or os.PathLike directory; got "
            f"{type(path).__name__} {repr(path)[:80]}. Pass e.g. 'checkpoints' or "
            "pathlib.Path('checkpoints') (bytes: os.fsdecode(path))."
        )
    text = os.fspath(path)
    if not text or "\0" in text:
        what = (
            f"{text[:80]!r} holds a NUL" if text else "is '' (the working directory, by accident?)"
        )
        raise ConfigError(
            f"{caller}: the checkpoint directory {what}. Pass a directory, e.g. 'checkpoints'."
        )


def check_own(step: Path, found: list[Path]) -> None:
    """Refuses another run's checkpoint ``step`` (``init_from``'s) where another user may write
    one of its ``found`` files or folders, or a folder above (:func:`shared_by_others`)."""
    below = {entry.parent for entry in found}  # each check covers the folders above it
    for entry in (entry for entry in found if entry not in below):
        if why := shared_by_others(str(entry), make=False):
            raise CheckpointError(
                f"{step} is not yours alone: {printable(why)}. A multi-process run's checkpoint "
                "(Orbax) is read by its files' names after they are checked: whoever may write "
                "there could swap one in since (a FIFO: the run would hang for ever). Copy it "
                f"into a folder only you can write (mkdir -p ~/checkpoints && cp -r {step} "
                f"~/checkpoints/) and start from the copy (init_from=os.path.expanduser('~/"
                f"checkpoints/{step.name}'))."
            )


def check_directory(directory: str | os.PathLike, caller: str) -> None:
    """Refuses a path that cannot be a directory of checkpoints this user writes; one that does
    not exist yet is fine below one this user can write."""

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(
            f"{caller}: the checkpoint directory {why}. Checkpoints are step_* directories inside "
            "a checkpoint directory: pass a directory, or a path where one can be made."
        )

    check_path(directory, caller)
    if why := planted_link(directory):  # (Orbax's directory too: train passes it resolved)
        raise refuse(f"{directory} cannot be used: {why}")
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
        where = " (the working directory)" if probe == Path(".") else ""
        if _read_only(probe):  # no user may: making it writable is no fix
            raise refuse(f"{directory} cannot be written: '{probe}'{where} is on a read-only "
                         "file system; pass a path on a writable one")  # fmt: skip
        raise refuse(
            f"{directory} cannot be written: this user may not write to '{probe}'{where}; make "
            "it writable, or pass a path this user may write"
        )
    if probe == path and not os.access(path, os.R_OK):  # its checkpoints could not be listed
        raise refuse(f"{directory} cannot be read: this user may not list what it holds")
    if probe == path and os.path.lexists(path / MANIFEST):  # step_* written inside a checkpoint
        raise refuse(
            f"{directory} holds a {MANIFEST}: it is a checkpoint (or an exported artifact), not "
            f"a directory of checkpoints; pass its parent, {path.parent}, or another directory"
        )


def named_step(path: Path) -> int | None:  # the step a step_<n> directory's name says
    return None if (found := _STEP_DIR.match(path.name)) is None else int(found.group(1))


def entries(directory: Path, orbax: bool = False) -> list[tuple[int, Path, bool]]:
    """``(step, path, complete)`` of each entry named like a checkpoint, by step: complete if a
    directory, not a symlink (Orbax's: with the marker of a committed save)."""
    pattern = _ORBAX_DIR if orbax else _STEP_DIR
    try:  # os.path: False past NAME_MAX, where Path's raises
        listed = os.listdir(directory) if os.path.isdir(directory) else ()
    except OSError as e:  # a directory this user may not read
        raise CheckpointError(
            f"{directory} cannot be listed ({e.strerror}), so its checkpoints cannot be found. "
            "Pass a checkpoint directory this user may read."
        ) from None
    found = sorted((int(m.group(1)), directory / n) for n in listed if (m := pattern.match(n)))
    return [
        (step, p, p.name == step_name(step, orbax) and p.is_dir() and not p.is_symlink()
         and (not orbax or (p / COMMITTED).exists()))
        for step, p in found
    ]  # fmt: skip


def step_name(step: int, orbax: bool = False) -> str:
    """The name a save gives step ``step``'s directory: Orbax's reads no other (``00004`` is
    not its step 4), ours one step once (not ``step_000000004`` beside ``step_00000004``)."""
    return str(step) if orbax else f"step_{step:08d}"


def checkpoints(directory: Path, orbax: bool = False) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints in ``directory``, oldest first."""
    return [(step, p) for step, p, complete in entries(directory, orbax) if complete]


_PASSED_OVER = (  # what an entry named like a newer step that is none makes of a run or a read
    "a resume would pass it over or fail on it, and saving that step fail on it or delete it, "
    "after its epoch's work. Remove it, or use another checkpoint directory.",
    "reading the directory's newest checkpoint would pass it over for {newest}, an older one. "
    "Remove it, or name the checkpoint to read ({newest} or another of its steps).",
)


def check_strays(
    directory: str | os.PathLike, caller: str, orbax: bool = False, *, reading: bool = False
) -> None:
    """Refuses the other format's checkpoints (unless ``reading``: a directory's newest is
    read, not resumed), and an entry named like a step newer than the newest checkpoint that
    is none; ``caller`` heads the refusal (``""``: none)."""
    if not reading and checkpoints(Path(directory), not orbax):
        them = "single-process run (step_* safetensors)" if orbax else "multi-process run (Orbax)"
        raise CheckpointError(
            f"{caller}: {directory} holds checkpoints of a {them}, which this run cannot resume. "
            "Resume it as it was written (several processes: each after "
            "symjax_mlp.training.initialize(...)), or use another directory."
        )
    found = entries(Path(directory), orbax)
    done = [(step, p) for step, p, complete in found if complete]
    newest = done[-1] if done else (-1, Path("any checkpoint there"))
    for step, p, complete in found:
        if step > newest[0] and not complete:
            kind = (
                "a symlink" if p.is_symlink() else "a file" if not p.is_dir()
                else f"a directory whose name no save writes (step {step}'s is "
                f"{step_name(step, orbax)})" if p.name != step_name(step, orbax)
                else f"a directory without {COMMITTED} (an Orbax save never committed)"
            )  # fmt: skip
            raise CheckpointError(
                f"{caller}: " * bool(caller) + f"{p} is {kind}, not a checkpoint directory, but "
                f"is named like a step newer than {newest[1].name}: "
                + _PASSED_OVER[reading].format(newest=newest[1])
            )


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint in ``directory``, or ``None`` if it holds none.

    Raises:
      ConfigError: ``directory`` is not a str or ``os.PathLike``, or is ``''``.
    """
    check_path(directory, "symjax_mlp.training.latest_checkpoint")
    return next((p for _, p in reversed(checkpoints(Path(directory)))), None)


def _read_only(path: Path) -> bool:
    """Whether ``path`` is on a file system mounted read-only (where the system says)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # not POSIX
        return False
