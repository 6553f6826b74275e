"""JAX's persistent compilation cache, read only from a folder that is yours alone.

An entry of that cache is an executable: native code XLA runs as the program whose key names
it. So every place that compiles (``load``, ``train``, a Hybrid's trace, export's self-test, a
Batcher, ``shard_step``) first refuses a cache folder that another user may write or swap, and
makes JAX open the folder it checked (JAX keeps the one it opened at its first compilation);
so too what ``XLA_FLAGS`` names that XLA reads kernels or autotuning results back from.
"""

from __future__ import annotations

import contextlib
import getpass
import grp
import os
import re
import shlex
import stat
import warnings
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from symjax_mlp._errors import ConfigError

_LIVE: dict[str, Any] = {}  # "seen": the cache settings JAX was last made to open (reset_cache)


# XLA_FLAGS naming a file or folder XLA reads compiled code or autotuning results back from
# (what only writes, as --xla_dump_to or --xla_gpu_dump_autotune_results_to, is not checked)
XLA_READS = {
    "xla_gpu_kernel_cache_file": "compiled GPU kernels",
    "xla_gpu_ptx_file": "PTX it compiles in place of its own",
    "xla_gpu_llvm_ir_file": "LLVM IR it compiles in place of its own",
    "xla_gpu_per_fusion_autotune_cache_dir": "autotuning results (the kernel each fusion runs)",
    "xla_gpu_experimental_autotuner_cache_dir": "autotuning results (the kernel each fusion runs)",
    "xla_gpu_load_autotune_results_from": "autotuning results (the kernel each fusion runs)",
    "xla_gpu_gemm_autotuner_override_file": "autotuning results (the kernel each matmul runs)",
}
_FLAG = re.compile(r"--?(" + "|".join(XLA_READS) + r")=(.+)")
_WARNED: set[str] = set()  # remote caches warned of in this process


def refuse_shared_cache(head: str) -> None:
    """Refuses JAX's persistent compilation cache where others may write (or swap) its folder:
    its entries are executables, native code XLA runs as the program whose key names them; so
    too the files and folders named in ``XLA_FLAGS`` that XLA reads kernels or autotuning
    results back from, and those JAX points XLA at inside its cache. Checked at each place that
    compiles, every time (a few ``lstat`` calls, next to a trace and a compilation): a folder
    made others' since is seen. The settings checked are those JAX opens at its next
    compilation (JAX's reset_cache, public). A remote cache (``gs://...``) cannot be checked
    from here: it is warned of once per process."""
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
    for flag, path, named in _xla_paths(folder if on else None):
        if why := shared_by_others(path, make=False):
            raise ConfigError(
                f"{head}: {named} --{flag}={path!r}, is not yours alone: {why}. XLA reads "
                f"{XLA_READS[flag]} back from there into what it compiles for this program. "
                + (f"Remove --{flag} from XLA_FLAGS or point it at a folder only you can write."
                   if named == "XLA_FLAGS'" else
                   "Make it yours alone (or remove it), or set jax_persistent_cache_enable_xla"
                   "_caches to '' (JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=) to keep XLA out.")
            )  # fmt: skip
    if folder and enabled and "://" in folder and folder not in _WARNED:
        _WARNED.add(folder)
        warnings.warn(
            f"{head}: JAX's compilation cache, jax_compilation_cache_dir={folder!r}, is remote: "
            "whether others may write there cannot be checked from here, and an entry there is "
            "native code XLA runs in this process as this program's. Use it only where no one "
            "but you (and your own jobs) may write in it.",
            UserWarning,
            stacklevel=3,
        )
    if _LIVE.get("seen") != (folder, enabled):  # JAX keeps the folder it opened at its first
        compilation_cache.reset_cache()  # compilation, whatever is set since: this one, next
        _LIVE["seen"] = folder, enabled


def _xla_paths(folder: str | None) -> list[tuple[str, str, str]]:
    """(flag, absolute path, what names it) XLA reads back from: ``XLA_FLAGS``' own, and those
    JAX's ``jax_persistent_cache_enable_xla_caches`` sets inside the cache ``folder``."""
    out = []
    try:
        words = shlex.split(os.environ.get("XLA_FLAGS", ""))
    except ValueError:  # a quote left open: its words as they stand
        words = os.environ.get("XLA_FLAGS", "").split()
    for word in words:
        if match := _FLAG.fullmatch(word):
            out.append((match[1], os.path.abspath(match[2]), "XLA_FLAGS'"))
    caches = jax.config.jax_persistent_cache_enable_xla_caches or ""
    for flag in ("xla_gpu_kernel_cache_file", "xla_gpu_per_fusion_autotune_cache_dir"):
        path = os.path.join(folder or "", flag)  # (where missing, the folder checked is it)
        if folder and (caches == "all" or flag in caches) and os.path.lexists(path):
            out.append((flag, path, "JAX's cache, as"))
    return out


def shared_by_others(folder: str, make: bool = True) -> str | None:
    """Why another user could write in ``folder`` (made 0700 if missing, or else checked from
    the folder above that is there) or swap it for theirs:
    it, a folder above it, a link on the way or where it leads is not this user's nor root's,
    or others may write there (one's own private group aside, as umask 002 makes; above it, a
    sticky folder such as /tmp is fine); else ``None``."""
    if make:
        with contextlib.suppress(OSError):
            os.makedirs(folder, mode=0o700, exist_ok=True)
    while not make and not os.path.lexists(folder) and folder != os.path.dirname(folder):
        folder = os.path.dirname(folder)  # (who may write here may make it)
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
