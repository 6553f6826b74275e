"""Files on disk: the one atomic writer, bounded safe reads, and sha256 in chunks.

Artifacts, checkpoints and caches are all written the same way: into a temporary sibling,
fsynced, then renamed into place (``renameat2`` on Linux: ``RENAME_NOREPLACE`` for a new
directory, ``RENAME_EXCHANGE`` to replace one), so a reader sees the old version or the new
one, never half of one, and a writer killed mid-way leaves the old version intact.

Reading (one :class:`Reader` pass) never follows a symbolic link, never blocks on a FIFO, and
checks a file's size before reading a byte of it. :func:`write_file` is the documented test
seam: the crash-safety tests replace it to kill a writer half-way through a file.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

from symjax_mlp._errors import SymjaxError

MANIFEST = "manifest.json"
CHUNK = 1 << 20  # hash and read in bounded chunks

_AT_FDCWD, _RENAME_NOREPLACE, _RENAME_EXCHANGE = -100, 1, 2
_UNSUPPORTED = (22, 38, 95)  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem cannot do it


# -- hashing ----------------------------------------------------------------------------------
def sha256(data: bytes) -> str:
    """The hex sha256 of ``data``, hashed in bounded chunks."""
    digest = hashlib.sha256()
    view = memoryview(data)
    for i in range(0, len(view), CHUNK):
        digest.update(view[i : i + CHUNK])
    return digest.hexdigest()


# -- reading ----------------------------------------------------------------------------------
def _open_regular(file: Path, error: type[SymjaxError]) -> int:
    flags = os.O_RDONLY
    for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC", "O_BINARY"):
        flags |= getattr(os, name, 0)
    try:
        fd = os.open(file, flags)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # ELOOP: a symlink; ValueError: a NUL in the name
        if os.path.islink(file):
            raise error(
                f"{file} is a symbolic link; loading never follows a link (it could point out "
                "of the directory, or at /dev/zero). Replace it by the file it points to."
            ) from None
        raise error(f"{file} cannot be read: {e}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(
            f"{file} is not a regular file (a directory, FIFO or device), so it is not what was "
            "written there. Restore the file, or write it again."
        )
    return fd


class Reader:
    """One checked pass over a regular file: its bytes in order, hashed as they are read.

    ``with Reader(file, size=n, error=E) as r: r.read(8); r.readinto(buffer); r.finish(sha)``
    reads a file straight into buffers the caller owns (one per tensor, aligned for zero-copy
    use), so that reading takes the file's size in memory and no more; :meth:`finish` checks
    that the file ended there and had the expected sha256.
    """

    def __init__(
        self, file: Path, *, size: int | None, limit: int | None = None, error: type[SymjaxError]
    ) -> None:
        self.file, self.error = file, error
        self.fd = _open_regular(file, error)
        try:
            self.size = _check_size(file, os.fstat(self.fd).st_size, size, limit, error)
        except BaseException:
            os.close(self.fd)
            raise
        self.done, self.digest = 0, hashlib.sha256()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def readinto(self, view: memoryview) -> None:
        """Fills ``view`` (a writable byte buffer) with the next ``len(view)`` bytes."""
        view = memoryview(view).cast("B")
        got = 0
        try:
            while got < len(view):
                n = os.readv(self.fd, [view[got : got + CHUNK]])
                if n == 0:
                    raise self.error(f"{self.file} changed while it was read; read it again.")
                self.digest.update(view[got : got + n])
                got += n
        except OSError as e:
            raise self.error(f"{self.file} cannot be read: {e}") from e
        self.done += got

    def read(self, n: int) -> bytearray:
        """The next ``n`` bytes (``n`` at most what is left of the file)."""
        if n > self.size - self.done:
            raise self.error(f"{self.file} ends before byte {self.done + n:,}; it is truncated.")
        data = bytearray(n)
        self.readinto(memoryview(data))
        return data

    def finish(self, sha256: str | None) -> str:
        """Checks that the file ends here, and its sha256; returns the sha256."""
        try:
            extra = os.read(self.fd, 1)
        except OSError as e:
            raise self.error(f"{self.file} cannot be read: {e}") from e
        if extra or self.done != self.size:
            raise self.error(f"{self.file} changed while it was read; read it again.")
        digest = self.digest.hexdigest()
        if sha256 is not None:
            _check_digest(self.file, digest, sha256, self.size, self.error)
        return digest


def read_regular(
    file: Path,
    *,
    size: int | None = None,
    limit: int | None = None,
    sha256: str | None = None,
    error: type[SymjaxError],
) -> bytearray:
    """Reads one regular file: never a link, FIFO or device, its size checked first.

    Reading takes the file's size in memory, in one buffer, and no more.

    Args:
      file: the file.
      size: the size it must have (a manifest's record), or ``None``.
      limit: the most bytes it may have, or ``None``.
      sha256: the hex sha256 it must have, or ``None``; compared before returning.
      error: the :class:`~symjax_mlp.SymjaxError` subclass to raise.

    Raises:
      FileNotFoundError: ``file`` does not exist (callers say what that means).
      SymjaxError: of type ``error``, for anything else that makes it unreadable.
    """
    with Reader(file, size=size, limit=limit, error=error) as r:
        try:
            data = bytearray(r.size)
        except MemoryError:
            raise error(
                f"{file} has {r.size:,} bytes, more than this process can hold in memory."
            ) from None
        r.readinto(memoryview(data))
        r.finish(sha256)
    return data


def hash_regular(
    file: Path, *, size: int | None = None, sha256: str | None = None, error: type[SymjaxError]
) -> str:
    """The sha256 of a regular file, checked as :func:`read_regular` checks it but read
    through one chunk of memory: for files that are checked but not used."""
    with Reader(file, size=size, error=error) as r:
        chunk = memoryview(bytearray(min(CHUNK, r.size)))
        while r.done < r.size:
            r.readinto(chunk[: r.size - r.done])
        return r.finish(sha256)


def _check_size(
    file: Path, actual: int, size: int | None, limit: int | None, error: type[SymjaxError]
) -> int:
    if size is not None and actual != size:
        raise error(
            f"{file} is corrupted: it has {actual} bytes but the manifest records {size}. "
            "Nothing was deserialized. Restore the file, or write it again."
        )
    if limit is not None and actual > limit:
        raise error(
            f"{file} has {actual} bytes, more than the {limit} such a file can have; it is "
            "not one written by symjax_mlp. Write it again."
        )
    return actual


def _check_digest(file: Path, digest: str, want: str, n: int, error: type[SymjaxError]) -> None:
    if digest != want:
        raise error(
            f"{file} is corrupted: its sha256 is {digest[:16]}... but the manifest records "
            f"{str(want)[:16]}... ({n} bytes). Nothing was deserialized. Restore the file, or "
            "write it again (export the artifact again)."
        )


# -- writing ----------------------------------------------------------------------------------
def write_file(file: Path, data: bytes) -> None:
    """Writes and fsyncs one file (the test seam: crash-safety tests replace it)."""
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def cache_dir(*parts: str) -> Path:
    """A per-user cache directory of symjax_mlp: ``$XDG_CACHE_HOME/symjax_mlp/...`` (default
    ``~/.cache/symjax_mlp/...``), the convention JAX, pip and IREE's own tools follow. What is
    cached there is derived on this machine; nothing in it ever comes from an artifact."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root, "symjax_mlp", *parts)


def write_file_atomic(file: Path, data: bytes) -> None:
    """Writes ``file`` through a temporary sibling and one ``os.replace``."""
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write_file(tmp, data)
        os.replace(tmp, file)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_dir(
    path: Path,
    files: Mapping[str, bytes],
    *,
    overwrite: bool,
    check: Callable[[Path, bool], None],
    error: type[SymjaxError],
    what: str = "",
) -> None:
    """Writes ``files`` (in order: put the manifest last) into a new directory at ``path``.

    Args:
      path: the directory to create, or replace when ``overwrite``.
      files: file name -> bytes, written in this order, each fsynced.
      overwrite: replace an existing ``path``.
      check: ``check(path, overwrite)`` raises if ``path`` may not be written; called before
        and again just before the rename.
      error: the :class:`~symjax_mlp.SymjaxError` subclass to raise.
      what: what ``path`` is, for messages (``"the artifact"``); default: just the path.

    Raises:
      SymjaxError: of type ``error``; any previous directory at ``path`` is then unchanged.
    """
    target = f"{what} {path}" if what else str(path)
    check(path, overwrite)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise error(f"cannot write {target}: {e}") from e
    try:
        for name, data in files.items():
            write_file(tmp / name, data)
        _fsync_dir(tmp)
        check(path, overwrite)  # it may have appeared while we were writing
        # Replace only when asked: a path that appeared after that check (another writer's
        # artifact) must make the no-replace rename below fail, not be swapped out.
        if overwrite and (path.exists() or path.is_symlink()):
            _replace(tmp, path)  # tmp now holds the previous directory
            shutil.rmtree(tmp)
        elif not _rename(tmp, path, _RENAME_NOREPLACE):
            os.rename(tmp, path)  # not Linux: fails on a non-empty directory that appeared
        _fsync_dir(path.parent)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
        check(path, False)  # another writer won the race: say so, as for an existing path
        raise error(f"cannot write {target}: another writer created it meanwhile.") from None
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise error(f"cannot write {target}: {e}. Anything there before is unchanged.") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    remove_stale(path)


def _replace(tmp: Path, path: Path) -> None:
    """Swaps ``tmp`` into ``path``; afterwards ``tmp`` holds what ``path`` held."""
    if _rename(tmp, path, _RENAME_EXCHANGE):
        return
    old = path.parent / f".{path.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(path, old)  # not Linux: two renames, a tiny window without path
    try:
        os.rename(tmp, path)
    except OSError:
        os.rename(old, path)  # put the previous one back
        raise
    os.rename(old, tmp)


def _rename(a: Path, b: Path, flags: int) -> bool:
    """Linux ``renameat2(a, b, flags)``; False where unsupported, FileExistsError if taken."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    if err == 17:  # EEXIST, with RENAME_NOREPLACE
        raise FileExistsError(err, os.strerror(err), str(b))
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_stale(path: Path) -> None:
    """Removes temporary siblings left by writers of ``path`` whose process has died."""
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
