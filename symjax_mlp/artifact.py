"""The artifact directory: writing it atomically, and reading it back as an :class:`Artifact`.

An export is written into a temporary sibling directory, manifest last, and then swapped in
with one ``rename`` (``renameat2(RENAME_EXCHANGE)`` on Linux when replacing), so a reader sees
either the previous artifact or the new one, never half of one, and an export killed mid-way
leaves the previous artifact intact.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from symjax_mlp.errors import ArtifactError
from symjax_mlp.manifest import (
    MANIFEST,
    MLIR,
    Signature,
    TensorSpec,
    read_artifact,
)

__all__ = ["Artifact", "inspect"]

_OP = re.compile(r'^\s*(?:%[^=]*=\s*)?"?((?:stablehlo|chlo|func|sdy|mhlo)\.[a-z_0-9]+|call)\b')


@dataclasses.dataclass(frozen=True)
class Artifact:
    """An exported model on disk: its directory and its (checked) manifest.

    Returned by :func:`~symjax_mlp.export` and :func:`inspect`; ``str(artifact)`` is the
    summary ``symjax-mlp inspect`` prints. Run it with :func:`~symjax_mlp.load`.

    Example:
      >>> art = sm.export(h, "my_mlp", example=x)
      >>> art.signature.inputs[0].shape
      ('b', 512)
    """

    path: Path
    manifest: Mapping[str, Any]

    @property
    def signature(self) -> Signature:
        """The input/output :class:`~symjax_mlp.manifest.Signature`, symbolic dims by name."""
        return Signature.from_json(self.manifest["signature"])

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(self.manifest["platforms"])

    @property
    def params(self) -> tuple[TensorSpec, ...]:
        """The param tree, flattened: one :class:`TensorSpec` per param, in call order."""
        return tuple(TensorSpec.from_json(p) for p in self.manifest["params"])

    @property
    def size_bytes(self) -> int:
        """Bytes of the artifact's files, manifest included (caches excluded)."""
        files = self.manifest["files"].values()
        return sum(f["bytes"] for f in files) + (self.path / MANIFEST).stat().st_size

    def op_counts(self) -> dict[str, int]:
        """How often each StableHLO (and func) op occurs in ``model.mlir``, most frequent first."""
        return count_ops((self.path / MLIR).read_text())

    def __str__(self) -> str:
        m = self.manifest
        v = m["versions"]
        n_values = sum(_numel(p.shape) for p in self.params)
        lines = [
            f"artifact   {self.path}  ({len(m['files']) + 1} files, {_kb(self.size_bytes)}; "
            f"format {m['format']} v{m['format_version']})",
            f"function   {m['name']}  exported {m['created']}",
            f"signature  {self.signature}",
            f"platforms  {', '.join(self.platforms)}   devices {m['nr_devices']}   "
            f"calling convention {m['calling_convention_version']}",
            "versions   " + ", ".join(f"{k} {val}" for k, val in v.items()),
            f"params     {len(self.params)} tensors, {n_values:,} values",
        ]
        lines += [f"  {p}" for p in self.params]
        lines.append("mlir args  " + ", ".join(m["mlir_arguments"]))
        lines.append("files      sha256")
        for k, f in m["files"].items():
            lines.append(f"  {k:<20} {f['sha256'][:16]}...  {f['bytes']:>10,} B")
        counts = self.op_counts()
        lines.append(f"stablehlo  {sum(counts.values())} ops")
        lines += [f"  {name:<36} {n:>5}" for name, n in counts.items()]
        return "\n".join(lines)


def inspect(path: str | os.PathLike[str]) -> Artifact:
    """Reads an artifact's manifest and checks every file's sha256; deserializes nothing.

    Args:
      path: an artifact directory written by :func:`~symjax_mlp.export`.

    Returns:
      The :class:`Artifact`; ``print(inspect(path))`` shows manifest, signature, platforms,
      versions and StableHLO op counts.

    Raises:
      ArtifactError: the directory is missing, incomplete or corrupted.
    """
    path = Path(path)
    manifest, _ = read_artifact(path)
    return Artifact(path, freeze(manifest))


def count_ops(mlir_text: str) -> dict[str, int]:
    """Counts op names in StableHLO text (one op per line, as MLIR prints it)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in mlir_text.splitlines():
        m = _OP.match(line)
        if m:
            counts["func.call" if m.group(1) == "call" else m.group(1)] += 1
    return dict(counts.most_common())


def _numel(shape: tuple[int | str, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _kb(n: int) -> str:
    return f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def freeze(x: Any) -> Any:
    if isinstance(x, dict):
        return MappingProxyType({k: freeze(v) for k, v in x.items()})
    if isinstance(x, list):
        return tuple(freeze(v) for v in x)
    return x


def thaw(x: Any) -> Any:
    """A frozen manifest back to plain JSON data (dicts and lists)."""
    if isinstance(x, Mapping):
        return {k: thaw(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [thaw(v) for v in x]
    return x


# -- atomic writing ---------------------------------------------------------------------------
def write_dir(
    path: Path, files: Mapping[str, bytes], manifest: Mapping[str, Any], *, overwrite: bool
) -> None:
    """Writes ``files`` then ``manifest.json`` to a temporary sibling and swaps it into ``path``.

    Raises:
      ArtifactError: ``path`` exists and ``overwrite`` is false, it is not an artifact, or
        writing failed (then the previous artifact, if any, is unchanged).
    """
    check_target(path, overwrite)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise ArtifactError(f"cannot write the artifact {path}: {e}") from e
    try:
        for name, data in files.items():
            write_file(tmp / name, data)
        write_file(tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
        _fsync_dir(tmp)
        check_target(path, overwrite)  # it may have appeared while we were writing
        if path.exists():
            if not _exchange(tmp, path):  # not Linux: two renames, a tiny window without path
                old = path.parent / f".{path.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
                os.rename(path, old)
                try:
                    os.rename(tmp, path)
                except OSError:
                    os.rename(old, path)  # put the previous artifact back
                    raise
                tmp = old
            shutil.rmtree(tmp)  # after the swap, tmp holds the previous artifact
        else:
            os.rename(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ArtifactError(
            f"cannot write the artifact {path}: {e}. Any previous artifact there is unchanged."
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_stale(path)


def write_file(file: Path, data: bytes) -> None:
    """Writes and fsyncs one file (a seam for the kill-mid-write test)."""
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def check_target(path: Path, overwrite: bool) -> None:
    if not path.exists() and not path.is_symlink():
        return
    if not overwrite:
        raise ArtifactError(
            f"{path} already exists; export does not replace it silently. Pass "
            "overwrite=True (CLI: --overwrite) to replace it, or choose another path."
        )
    if path.is_symlink() or not path.is_dir():
        raise ArtifactError(f"{path} exists and is not a directory; refusing to replace it.")
    if any(path.iterdir()) and not (path / MANIFEST).exists():
        raise ArtifactError(
            f"{path} is a non-empty directory without {MANIFEST}, so not an artifact; "
            "refusing to replace it even with overwrite=True. Choose another path."
        )


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_stale(path: Path) -> None:
    """Removes temporary siblings left by exports of ``path`` whose process has died."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?:tmp|old)-(\d+)-[0-9a-f]+$")
    for sibling in path.parent.iterdir():
        m = pattern.match(sibling.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(sibling, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
