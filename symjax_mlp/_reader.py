"""Reads of a file that never follow a link or block on a FIFO, check its size first and hash
what they read; a refusal names the file, what is wrong with it and its fix (or the caller's:
a checkpoint's); and the bound on what such a read's JSON may hold once parsed."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from symjax_mlp._errors import SymjaxError

CHUNK = 1 << 20


def refusal(
    error: Callable[[str], Exception], file: Any, what: str, fix: str = "", own: str | None = None
) -> Exception:
    """``error`` refusing ``file``: ``{file} {what}. {fix}``; a caller with a fix of its own
    (``own``: a checkpoint's, whatever the file's problem) has ``{file}: {what}; {own}``."""
    if own is not None:
        return error(f"{file}: {what}; {own}")
    return error(f"{file} {what}." + (f" {fix}" if fix else ""))


class Reader(contextlib.AbstractContextManager):
    """One checked, hashed pass over a regular file of ``size`` bytes (at most ``limit``):
    ``with Reader(file, size=n, error=E) as r: r.read(8); r.readinto(buf); r.finish(sha)``.
    ``fix``: the caller's fix, said in place of each refusal's own (see :func:`refusal`)."""

    def __init__(
        self, file: Path, *, size: int | None, limit: int | None = None,
        error: type[SymjaxError], fix: str | None = None,
    ) -> None:  # fmt: skip
        self.file, self.error, self.fix = file, error, fix
        flags = os.O_RDONLY  # never follow a link, never block on a FIFO
        for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC", "O_BINARY"):
            flags |= getattr(os, name, 0)
        try:
            self.fd = os.open(file, flags)
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as e:  # ELOOP: a symlink; ValueError: a NUL in the name
            if os.path.islink(file):
                raise self.refuse(
                    "is a symbolic link; loading never follows a link (it could point out of the "
                    "directory, or at /dev/zero)", "Replace it by the file it points to."
                ) from None  # fmt: skip
            raise self.refuse(f"cannot be read: {e}") from e
        st = os.fstat(self.fd)
        self.size, problem = st.st_size, None
        if not stat.S_ISREG(st.st_mode):
            problem = (
                "is not a regular file (a directory, FIFO or device); nothing was read from it",
                "Restore the file written there, or pass a regular file.",
            )
        elif size is not None and self.size != size:
            problem = (
                f"is corrupted: it has {self.size} bytes but the manifest records {size}",
                "Nothing was deserialized. Restore the file, or write it again.",
            )
        elif limit is not None and self.size > limit:
            problem = (
                f"has {self.size} bytes, more than the {limit} such a file can have; it is not "
                "one written by symjax_mlp",
                "Write it again.",
            )
        if problem:
            os.close(self.fd)
            raise self.refuse(*problem)
        self.done, self.digest = 0, hashlib.sha256()

    def refuse(self, what: str, fix: str = "") -> Exception:
        """The error of this file: ``what`` is wrong with it, and ``fix`` (or the caller's)."""
        return refusal(self.error, self.file, what, fix, self.fix)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def readinto(self, view: memoryview) -> None:
        view = memoryview(view).cast("B")
        got = 0
        try:
            while got < len(view):
                n = os.readv(self.fd, [view[got : got + CHUNK]])
                if n == 0:
                    raise self.refuse("changed while it was read; read it again")
                self.digest.update(view[got : got + n])
                got += n
        except OSError as e:
            raise self.refuse(f"cannot be read: {e}") from e
        self.done += got

    def skip(self, n: int) -> None:
        """Hashes the next ``n`` bytes through one chunk, holding none of them."""
        chunk = memoryview(bytearray(min(CHUNK, n)))
        while n:
            self.readinto(chunk[: min(n, len(chunk))])
            n -= min(n, len(chunk))

    def read(self, n: int) -> bytearray:
        if n > self.size - self.done:
            raise self.refuse(f"ends before byte {self.done + n:,}; it is truncated")
        data = bytearray(n)
        self.readinto(memoryview(data))
        return data

    def finish(self, sha256: str | None) -> str:
        """Checks that the file ends here, and its sha256; returns the sha256."""
        try:
            extra = os.read(self.fd, 1)
        except OSError as e:
            raise self.refuse(f"cannot be read: {e}") from e
        if extra or self.done != self.size:
            raise self.refuse("changed while it was read; read it again")
        digest = self.digest.hexdigest()
        if sha256 is not None and digest != sha256:
            raise self.refuse(
                f"is corrupted: its sha256 is {digest[:16]}... but the manifest records "
                f"{str(sha256)[:16]}... ({self.size} bytes)",
                "Nothing was deserialized. Restore the file, or write it again (export the "
                "artifact again).",
            )
        return digest


def read_regular(
    file: Path, *, size: int | None = None, limit: int | None = None,
    sha256: str | None = None, error: type[SymjaxError],
) -> bytearray:  # fmt: skip
    """A regular file's bytes, its ``size``, ``limit`` and ``sha256`` checked where given.
    Raises ``FileNotFoundError`` (callers say what that means), else ``error``."""
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
    """The sha256 of a file checked as :func:`read_regular` does, read through one chunk."""
    with Reader(file, size=size, error=error) as r:
        r.skip(r.size)
        return r.finish(sha256)


def too_many_values(data: bytes | bytearray, limit: int) -> str | None:
    """Why JSON ``data`` may hold more than ``limit`` values (each ``,`` ``[`` ``{`` counted),
    or ``None``: ``[]`` is 2 bytes of text and 150 of Python's memory once parsed."""
    n = data.count(b",") + data.count(b"[") + data.count(b"{")
    return f"holds up to {n:,} JSON values, more than the {limit:,} allowed" if n > limit else None


def depth(x: Any, limit: int) -> int:
    """How deeply JSON data nests its lists and objects (a scalar: 0), without recursion; the
    walk stops once past ``limit``."""
    deepest, todo = 0, [(x, 1)]
    while todo:
        v, d = todo.pop()
        if not isinstance(v, (dict, list)):
            continue
        deepest = max(deepest, d)
        if deepest > limit:  # deep enough to refuse: stop walking
            return deepest
        todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest
