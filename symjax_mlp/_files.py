"""Files on disk: writes through a fsynced temporary sibling renamed into place (a reader sees
the old version or the new one), reads that never follow a link or block on a FIFO and check
a file's size first. :func:`write_file` is the seam the crash-safety tests replace."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import hmac
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from symjax_mlp._errors import ArtifactError, ConfigError, SymjaxError
from symjax_mlp._reader import Reader

MANIFEST = "manifest.json"
SIGNATURE = "model.sig"  # symjax_mlp.sign's, beside the files the manifest lists

_AT_FDCWD, _RENAME_NOREPLACE, _RENAME_EXCHANGE = -100, 1, 2
_UNSUPPORTED = (22, 38, 95)  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem cannot do it


def exhausted(e: OSError, size: int | None = None) -> str | None:
    """What to do about the system limit ``e`` hit writing (``size`` bytes, if known) or opening
    a file: a full disk, a file-size or open-file limit; ``None`` for any other error."""
    big = f"{size:,} bytes is" if size is not None else "The file is"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "Free space there (or raise this user's quota), or write to another filesystem."
    if e.errno == errno.EFBIG and (soft := _soft_limit("RLIMIT_FSIZE")) is not None:
        return (
            f"{big} more than the {soft:,} bytes this process may write to a file (ulimit -f, "
            "RLIMIT_FSIZE): raise that limit (ulimit -f unlimited)."
        )
    if e.errno == errno.EFBIG:
        return f"{big} more than a file there may hold: write to another filesystem."
    if e.errno == errno.EMFILE:
        held = f"the {soft:,} files" if (soft := _soft_limit("RLIMIT_NOFILE")) else "the files"
        return (
            f"This process has open all {held} it may (ulimit -n, RLIMIT_NOFILE): raise that "
            "limit, or open fewer files or connections at once."
        )
    if e.errno == errno.ENFILE:
        return "The system has open all the files it may (fs.file-max): close some, or raise it."
    return None


def _soft_limit(name: str) -> int | None:
    """This process's soft ``resource`` limit ``name``; ``None``: unlimited, or no such limit."""
    try:
        import resource

        soft = resource.getrlimit(getattr(resource, name))[0]
    except (ImportError, AttributeError, OSError, ValueError):  # not POSIX
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def looked_up(path: Path) -> None:
    """Raises :class:`ArtifactError` where the system refuses to look ``path`` up at all (a
    name too long, a directory it may not search); a missing path is for the caller to say."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        raise ArtifactError(f"{path}: {e.strerror or e}; pass another path.") from None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_file(file: Path, data: bytes) -> None:
    """Writes and fsyncs one file (the crash-safety tests' seam)."""
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def cache_dir(*parts: str) -> Path:
    """``$XDG_CACHE_HOME/symjax_mlp/...`` (default, or a relative one: ``~/.cache``), made 0700;
    as pip's, used only if this user owns it and its parents there and nobody else can write
    them, else a path below ``os.devnull`` (nothing is read or written)."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    root = root if os.path.isabs(root) else os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root, "symjax_mlp")
    for part in ("", *parts):
        path = path / part if part else path
        with contextlib.suppress(OSError):
            path.mkdir(mode=0o700, parents=not part, exist_ok=True)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) and _mine(st, 0o022):
                continue
        return Path(os.devnull, "symjax_mlp", *parts)
    return path


def cache_secret() -> bytes | None:
    """This user's key signing cache entries (``key`` in :func:`cache_dir`, 0600, made on first
    use); ``None`` without a private cache directory."""
    key = cache_dir() / "key"
    with contextlib.suppress(OSError):
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        except OSError:  # a full disk: a key cut short would turn the cache off for good
            key.unlink()
            raise
    try:
        with Reader(key, size=32, error=SymjaxError) as r:
            return bytes(r.read(32)) if _mine(os.fstat(r.fd), 0o077) else None
    except (OSError, SymjaxError):
        return None


def read_cached(folder: str, name: str) -> bytes | None:
    """The body of this user's cache entry ``folder/name`` (``"<tag>\\n<body>"``) if signed
    with :func:`cache_secret`, else ``None`` (absent, damaged or planted)."""
    key = cache_secret()
    with contextlib.suppress(OSError):
        tag, _, body = (cache_dir(folder) / name).read_bytes().partition(b"\n")
        if key is not None and hmac.compare_digest(tag, _tag(key, name, body)):
            return body
    return None


def write_cached(folder: str, name: str, body: bytes) -> None:
    """Caches ``body`` as ``folder/name``, signed; without a private cache, nothing is written."""
    key = cache_secret()
    with contextlib.suppress(OSError):
        if key is not None:
            write_file_atomic(cache_dir(folder) / name, _tag(key, name, body) + b"\n" + body)


def _tag(key: bytes, name: str, body: bytes) -> bytes:
    return hmac.new(key, name.encode() + b"\n" + body, "sha256").hexdigest().encode()


def _mine(st: os.stat_result, others: int) -> bool:
    return st.st_uid == getattr(os, "getuid", lambda: st.st_uid)() and not st.st_mode & others


def write_file_atomic(file: Path, data: bytes) -> None:
    tmp = _sibling(file)
    try:
        write_file(tmp, data)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def write_output(*items: tuple[str | os.PathLike[str], bytes]) -> None:
    """Writes each ``(file, data)`` a user asked for (links followed): files through temporary
    siblings replaced once all are written, devices and FIFOs directly, last. Raises
    :class:`ConfigError` naming the path and the system's reason."""
    staged, special, file, done = [], [], None, []
    try:
        for file, data in items:
            if why := planted_link(file):
                raise ConfigError(f"cannot write {os.fspath(file)}: {why}. Pass another path.")
            path = Path(os.path.realpath(file))
            if path.exists() and not path.is_file():
                special.append((file, path, data))
                continue
            tmp = _sibling(path)
            staged.append((tmp, path, file))
            write_file(tmp, data)
        for tmp, path, file in staged:
            os.replace(tmp, path)
            done.append(os.fspath(file))
        for file, path, data in special:  # noqa: B007 (file: named if the write fails)
            with open(path, "wb") as f:
                f.write(data)
    except OSError as e:
        kept = "" if special else f"; what each {'other ' if done else ''}path held is unchanged"
        wrote = f"; written already: {', '.join(done)}" if done else ""
        fix = exhausted(e, len(data)) or "Pass another path."  # else: a directory, no access
        raise ConfigError(
            f"cannot write {os.fspath(file)} ({e.strerror or e}){wrote}{kept}. {fix}"
        ) from None
    finally:
        for tmp, *_ in staged:
            tmp.unlink(missing_ok=True)


def planted_link(file: str | os.PathLike[str]) -> str | None:
    """Why following ``file`` would let another user choose where it leads: it is a link (or
    leads through links) they made in a sticky folder anyone may write (/tmp), as the kernel's
    protected_symlinks refuses; ``None`` for a path or one's own link."""
    path = os.path.abspath(file)
    for _ in range(40):  # the kernel's own limit
        with contextlib.suppress(OSError):
            st, folder = os.lstat(path), os.stat(os.path.dirname(path))
            if not stat.S_ISLNK(st.st_mode):
                break
            shared = folder.st_mode & stat.S_ISVTX and folder.st_mode & stat.S_IWOTH
            if shared and st.st_uid not in (folder.st_uid, getattr(os, "getuid", int)()):
                return (
                    f"{path} is a link that user id {st.st_uid} made in a folder anyone may "
                    "write (sticky, as /tmp), so they would choose where it leads (the kernel's "
                    "protected_symlinks refuses it too)"
                )
            path = os.path.join(os.path.dirname(path), os.readlink(path))
            continue
        break
    return None


def write_stream(stream: Any, data: bytes) -> None:
    """Writes all of ``data`` to the binary ``stream`` (stdout): a short write (a file-size
    limit reached), which Python's own writes take for all, is followed by the next, which
    raises; a :class:`ConfigError` naming the stream, what got there and what to do."""
    done = 0
    try:
        while done < len(data):
            done += stream.write(memoryview(data)[done:]) or 0
        stream.flush()
    except BrokenPipeError:  # its reader left (`| head`): the CLI stops quietly, as cat does
        raise
    except OSError as e:
        raise ConfigError(
            f"cannot write {getattr(stream, 'name', 'the stream')} ({e.strerror or e}): it got at "
            f"most the first {done:,} of the {len(data):,} bytes, so what is there is incomplete. "
            + (exhausted(e, len(data)) or "Write to a file path instead.")
        ) from None


def write_dir(
    path: Path, files: Mapping[str, bytes], *, overwrite: bool,
    check: Callable[[Path, bool], None], error: type[SymjaxError], what: str = "",
    then: str = "",
) -> None:  # fmt: skip
    """Writes ``files`` (name -> bytes, in order: the manifest last) as the directory ``path``,
    replacing one only when ``overwrite``; ``check(path, overwrite)`` raises if ``path`` may
    not be written (first and before the rename); other failures raise ``error``, naming the
    file, what to do and ``then`` (what to do after)."""
    target = f"{what} {path}" if what else str(path)
    check(path, overwrite)
    tmp = _sibling(path)
    try:
        lock = _locked_dir(path, tmp)
    except OSError as e:  # its directory takes no new entry (read-only, not ours): not its name
        fix = (
            exhausted(e)
            or "Write it in a directory this user may write, or make that one writable."
        )
        raise error(
            f"cannot write {target}: {e.strerror or e} in {path.parent}, so nothing was written. "
            + fix
        ) from e
    name, data = "", b""  # the file being written: named if that fails
    try:
        for name, data in files.items():
            write_file(tmp / name, data)
        name = ""
        _fsync_dir(tmp)
        check(path, overwrite)  # it may have appeared while we were writing
        if overwrite and (path.exists() or path.is_symlink()):
            _replace(tmp, path)  # tmp now holds the previous directory
            shutil.rmtree(tmp, ignore_errors=True)  # unlocked: another's cleanup may race us
        elif not _rename(tmp, path, _RENAME_NOREPLACE):
            os.rename(tmp, path)  # not Linux: fails on a non-empty directory that appeared
        _fsync_dir(path.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, FileExistsError):  # another writer won the race
            check(path, False)  # says so, as for an existing path
            raise error(f"cannot write {target}: another writer created it meanwhile.") from None
        if isinstance(e, OSError):
            at = f" (its file {name}, {len(data):,} bytes)" if name else ""
            fix = exhausted(e, len(data) if name else None) or (
                f"Check that this user may write {path.parent} and has room there, or write "
                "elsewhere."
            )
            raise error(
                f"cannot write {target}{at}: {e.strerror or e}. Anything there before is "
                f"unchanged. {fix}" + (f" {then}" if then else "")
            ) from e
        raise
    finally:
        os.close(lock)
    remove_stale(path)


def _sibling(path: Path, kind: str = "tmp") -> Path:
    """``.{name}.{kind}-{pid}-{random}`` beside ``path``; a name past 200 bytes by its hash."""
    name = path.name if len(os.fsencode(path.name)) <= 200 else sha256(os.fsencode(path.name))
    return path.parent / f".{name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _replace(tmp: Path, path: Path) -> None:
    """Swaps ``tmp`` into ``path``; then ``tmp`` holds what ``path`` held."""
    if _rename(tmp, path, _RENAME_EXCHANGE):
        return
    old = _sibling(path, "old")
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
    if (err := ctypes.get_errno()) in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(b))  # EEXIST: a FileExistsError


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _locked_dir(path: Path, tmp: Path) -> int:
    """Makes the directory ``tmp`` under an exclusive ``flock`` (its fd, to close when done),
    made under another name and renamed: a cleanup never finds it unlocked."""
    new = _sibling(path, "new")
    path.parent.mkdir(parents=True, exist_ok=True)
    new.mkdir()
    try:
        fd = os.open(new, os.O_RDONLY)
    except OSError:  # out of descriptors: not left behind
        new.rmdir()
        raise
    try:
        with contextlib.suppress(OSError):  # a filesystem without locks: age decides
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(new, tmp)
    except BaseException:
        os.close(fd)
        shutil.rmtree(new, ignore_errors=True)
        raise
    return fd


STALE_AGE = 24 * 3600.0  # seconds: an unlockable temporary sibling this old is abandoned


def remove_stale(path: Path) -> None:
    """Removes temporary siblings of ``path`` whose writers are gone: no live process has their
    pid and none holds their lock (a pid alone says nothing across PID namespaces), or,
    without locks, a day old."""
    stem = _sibling(path).name[1:].rsplit(".tmp-", 1)[0]
    pattern = re.compile(rf"^\.{re.escape(stem)}\.(tmp|old|new)-(\d+)-[0-9a-f]+$")
    for sibling in path.parent.iterdir():
        m = pattern.match(sibling.name)
        if m and not _alive(int(m.group(2))) and _abandoned(sibling, m.group(1) == "tmp"):
            shutil.rmtree(sibling, ignore_errors=True)


def _abandoned(sibling: Path, locked: bool) -> bool:
    age = 0.0
    with contextlib.suppress(OSError):  # where locks fail, age decides; no directory: not ours
        fd = os.open(sibling, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            age = time.time() - os.fstat(fd).st_mtime
            if locked:  # a writer holds it until it is done: nobody does, so it is gone
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
    return age > STALE_AGE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True
