"""JAX's persistent compilation cache, read only from a folder that is yours alone.

An entry of that cache is an executable: native code XLA runs as the program whose key names
it. So every place that compiles (``load``, ``train``, a Hybrid's trace, export's self-test, a
Batcher, ``shard_step``) first refuses a cache folder that another user may write or swap, and
makes JAX open the folder it checked (JAX keeps the one it opened at its first compilation).
"""

from __future__ import annotations

import contextlib
import getpass
import grp
import os
import stat
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from symjax_mlp._errors import ConfigError

_LIVE: dict[str, Any] = {}  # "seen": the cache settings JAX was last made to open (reset_cache)


def refuse_shared_cache(head: str) -> None:
    """Refuses JAX's persistent compilation cache where others may write (or swap) its folder:
    its entries are executables, native code XLA runs as the program whose key names them. The
    settings checked are those JAX opens at its next compilation (JAX's reset_cache, public)."""
    folder, enabled = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    on = folder and enabled and "://" not in folder
    if on and not os.path.isabs(folder):  # JAX opens it from each later working directory:
        folder = os.path.abspath(folder)  # it is the folder checked here that JAX keeps
        jax.config.update("jax_compilation_cache_dir", folder)
    if on and (why := shared_by_others(folder)):
        raise ConfigError(
            f"{head}: JAX's compilation cache, jax_compilation_cache_dir={folder!r}, is not "
            f"yours alone: {why}. An entry there is native code XLA would run in this process "
            "as this program's. Point JAX_COMPILATION_CACHE_DIR (or jax.config.update("
            "'jax_compilation_cache_dir', ...)) at a folder only you can write, such as "
            "$HOME/.cache/jax, or unset it."
        )
    if _LIVE.get("seen") != (folder, enabled):  # JAX keeps the folder it opened at its first
        compilation_cache.reset_cache()  # compilation, whatever is set since: this one, next
        _LIVE["seen"] = folder, enabled


_PASSED: set[tuple[str, bool]] = set()  # (folder, enabled) checked by refuse_shared_cache_once


def refuse_shared_cache_once(head: str) -> None:
    """:func:`refuse_shared_cache`, once per process per cache folder: where a Hybrid traces (a
    compilation follows), a step or a batcher is made, an export's self-test compiles."""
    seen = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    if seen not in _PASSED:
        refuse_shared_cache(head)
        _PASSED.add(seen)


def shared_by_others(folder: str) -> str | None:
    """Why another user could write in ``folder`` (made 0700 if missing) or swap it for theirs:
    it, a folder above it, a link on the way or where it leads is not this user's nor root's,
    or others may write there (one's own private group aside, as umask 002 makes; above it, a
    sticky folder such as /tmp is fine); else ``None``."""
    with contextlib.suppress(OSError):
        os.makedirs(folder, mode=0o700, exist_ok=True)
    me, own = getattr(os, "getuid", lambda: None)(), -1
    with contextlib.suppress(KeyError, OSError):  # this user's private group
        g = grp.getgrgid(os.getgid())
        own = os.getgid() if {g.gr_name, *g.gr_mem} <= {getpass.getuser()} else -1
    try:  # (a link it may not read, as /proc/1/root, fails realpath: PermissionError)
        leaves = dict.fromkeys((os.path.abspath(folder), os.path.realpath(folder)))
    except OSError as e:
        return f"{folder} cannot be checked ({e.strerror or e})"
    for leaf in leaves:
        path = leaf
        while me is not None:
            try:
                st = os.lstat(path)
            except OSError as e:
                return f"{path} cannot be checked ({e.strerror or e})"
            mode = stat.S_IMODE(st.st_mode) & (0o1757 if st.st_gid == own else 0o1777)
            if st.st_uid not in (me, 0):
                return f"{path} belongs to user id {st.st_uid}, not to you"
            sticky = path != leaf and mode & 0o1000  # others may add there, not swap it
            if mode & 0o022 and not (stat.S_ISLNK(st.st_mode) or sticky):
                return f"others may write in {path} (mode {stat.S_IMODE(st.st_mode):o})"
            if path == (path := os.path.dirname(path)):
                break
    return None
