"""Room for connections in this process's open-file limit (``ulimit -n``, RLIMIT_NOFILE): each
connection holds a file descriptor, and a server out of them cannot even refuse one (uvloop
accepts and closes it: the client sees a reset, the log nothing). A refusal past
``max_connections`` lingers (its client's request read and dropped) while files are left."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

from symjax_mlp._errors import user_stacklevel
from symjax_mlp.serving._requests import headed

SPARE = 16  # descriptors kept for the server's own (its event loop, a refusal's, logs)


def room(heads: Any, max_connections: int, where: str) -> int:
    """The connections this process can hold open, ``max_connections`` at most, and as many
    refusals lingering (``heads.files``), the soft limit raised as they need (else a warning)."""
    try:
        import resource
    except ImportError:  # not POSIX: nothing to read
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    used = _open_now()
    need = used + 2 * max_connections + SPARE
    raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft < raised:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    heads.files = max(1, soft - used - SPARE)
    fits = max(1, heads.files // 2)
    if fits < max_connections:
        warnings.warn(
            f"{headed(where)}max_connections={max_connections}, but this process may open only "
            f"{soft} files (ulimit -n; {used} open now): past {fits} connections, a client gets "
            f"the 503, where it would be reset. For {max_connections}, raise ulimit -n to "
            f"{need}.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
    return min(fits, max_connections)


def _open_now() -> int:
    """The file descriptors this process has open (0 where the system does not list them)."""
    for listing in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(listing))
    return 0
