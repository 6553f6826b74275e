"""Several processes, one run: joining them, agreeing on the run, never waiting in silence.

:func:`initialize` names who never connected; :func:`agree` compares every process's config
before the first collective; :class:`Watchdog` ends a process whose step waits past the timeout
(gloo never times out, and Python cannot interrupt a collective), naming the peers behind, or
whose step's collective failed as a peer went (else JAX aborts the process at exit).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

from symjax_mlp._errors import ConfigError, DistributedError, as_int, first_line
from symjax_mlp.training._state import is_count

#: The exit status of a process ended because another did not arrive or stalled (EX_TEMPFAIL:
#: relaunch every process; ``resume=True`` continues from the last committed checkpoint).
EXIT_STATUS = 75
#: how the caller spells resuming, in what a run says: ``resume=True``, the CLI's ``--resume``
RESUME: contextvars.ContextVar[str] = contextvars.ContextVar("resume", default="resume=True")
_runs = itertools.count()  # every process starts its runs in the same order
_settings = {"timeout": 60}  # initialize's
_MAX_S = 10**9  # ~31 years: JAX's runtime takes int32 seconds, its store int64 milliseconds
_TIMEOUT = "timeout must be an int >= 1 (seconds), at most 10**9"


def initialize(coordinator: str, num_processes: int, process_id: int, *, timeout: int = 60) -> None:
    """Joins this process to a run of ``num_processes`` (``jax.distributed.initialize``).

    Call it first, in every process, with the same ``coordinator`` and ``num_processes``;
    then :func:`~symjax_mlp.training.train` trains data-parallel over every process's devices.

    Args:
      coordinator: ``"host:port"`` where process 0 serves the coordinator.
      num_processes: how many processes the run has.
      process_id: this process's id, ``0 .. num_processes - 1``.
      timeout: seconds any process waits for another (to connect, to reach a step, to post
        its config, to finish a save) before the run fails, naming the missing process.

    Raises:
      ConfigError: an argument is out of range, or JAX's distributed runtime already started.
      (A process that waits past ``timeout`` for the others ends with :data:`EXIT_STATUS`.)
    """
    caller = "symjax_mlp.training.initialize"
    given = (  # each by name: the CLI names the option of each keyword a message shows
        f"{caller}(coordinator={coordinator!r}, num_processes={num_processes!r}, "
        f"process_id={process_id!r}, timeout={timeout!r})"
    )
    num_processes, process_id, timeout = (as_int(v) for v in (num_processes, process_id, timeout))
    host, port = host_port(coordinator)
    checks = {
        "coordinator must be 'host:port'": bool(host),
        "num_processes must be an int >= 1": is_count(num_processes, 1),
        "process_id must be an int in 0 .. num_processes - 1": is_count(process_id)
        and is_count(num_processes, 1)
        and process_id < num_processes,
        _TIMEOUT: is_count(timeout, 1) and timeout <= _MAX_S,
    }
    bad = [what for what, ok in checks.items() if not ok]
    if bad:
        raise ConfigError(f"{given}: {'; '.join(bad)}.")
    if jax.distributed.is_initialized():
        raise ConfigError(f"{given}: jax.distributed is already initialized in this process.")
    if process_id == 0 and (taken := _port_taken(port)):
        raise ConfigError(
            f"{given}: process 0 serves the coordinator on port {port}, but another process "
            f"holds that port already ({taken}): a process 0 of another run, or of this one "
            "started twice (each peer would join one of them at random). Stop it, or start "
            "every process with another port."
        )
    others = [i for i in range(num_processes) if i != process_id]

    def missing() -> str:
        fix = (
            f"Start every process, ids 0..{num_processes - 1}, with the same coordinator and "
            "number of processes."
        )
        if unknown := _unknown(host, port):  # no process reaches it, process 0 included
            who = f"its host {host} is not found ({unknown}), so no process can reach it"
            fix = "Pass process 0's address: its IP, or a name this machine resolves."
        elif process_id and not _reachable(host, port):
            who = f"process 0 (the coordinator, serving {coordinator}) is not running"
        elif process_id and len(others) == 1:  # this run's process 0 would have let it join
            who = (
                "a process answers there, but not as process 0 of this run (one started with "
                "another number of processes, or another program on that port)"
            )
        elif len(others) == 1:
            who = f"process {others[0]} never connected"
        else:  # JAX tells no one who has connected until all have
            who = f"one or more of processes {others} never connected"
        return (
            f"{caller}: process {process_id} of {num_processes} waited {timeout} s at the "
            f"coordinator {coordinator}: {who}. {fix}"
        )

    timer = threading.Timer(timeout, lambda: end(missing()))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            coordinator, num_processes=num_processes, process_id=process_id,
            initialization_timeout=timeout + 5,  # after the alarm, which names the missing
            heartbeat_timeout_seconds=timeout, shutdown_timeout_seconds=timeout,
        )  # fmt: skip
    finally:
        timer.cancel()
    _settings["timeout"] = timeout


def run_timeout(timeout: int | None, caller: str) -> int:
    """The run's timeout: ``timeout``, else :func:`initialize`'s."""
    if timeout is None:
        return _settings["timeout"]
    if not (is_count(timeout, 1) and timeout <= _MAX_S):
        raise ConfigError(f"{caller}: {_TIMEOUT}; got {timeout!r}.")
    return timeout


def end(message: str) -> None:
    """Ends this process with ``message``: the main thread may be stuck in a collective."""
    sys.stderr.write(message + " Ending this process (exit status 75) rather than hang.\n")
    sys.stderr.flush()
    os._exit(EXIT_STATUS)


def host_port(coordinator: Any) -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"`` (an IPv6 host bracketed: ``"[::1]:1234"``, host
    ``"::1"``, a port of 1 .. 65535); ``("", 0)`` for anything else."""
    host, _, port = coordinator.rpartition(":") if isinstance(coordinator, str) else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    number = int(port) if port.isascii() and port.isdigit() else 0
    return (host, number) if host and 0 < number < 65536 else ("", 0)


def _port_taken(port: int) -> str:
    """Why JAX's coordinator could not serve ``port`` (on ``JAX_COORDINATOR_BIND_ADDRESS``, else
    every address), or ``""``: gRPC binds with SO_REUSEPORT, so a second coordinator on a port
    served already (a stale run's) shares it, and each peer joins one of them at random."""
    host, bound = host_port(os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", f"[::]:{port}"))
    tried = [(socket.AF_INET6 if ":" in host else socket.AF_INET, host)]
    for family, host in [*tried, (socket.AF_INET, "0.0.0.0")]:  # no IPv6 here: IPv4's
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT's: free
                s.bind((host, bound))
                return ""
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return e.strerror or "address in use"
    return ""  # no address of ours to test: JAX's own error, if any, comes


def _unknown(host: str, port: int) -> str:
    """Why ``host`` does not resolve (a name looked up at the timeout only: a cluster's DNS
    may name process 0 only once it runs), or ``""``."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return ""
    except (OSError, UnicodeError) as e:
        return getattr(e, "strerror", None) or str(e)


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _client() -> Any:
    import orbax.checkpoint as ocp  # the coordinator's client, as Orbax reaches it

    return ocp.multihost.get_jax_distributed_client()


def agree(config: dict[str, Any], *, timeout: int, caller: str) -> str:
    """Posts ``config`` and compares it with every other process's (ConfigError if they differ,
    DistributedError if one posts nothing in ``timeout`` s); returns the run's key prefix."""
    client, me, n = _client(), jax.process_index(), jax.process_count()
    run = f"symjax_mlp/run{next(_runs)}"
    client.key_value_set(f"{run}/config/{me}", json.dumps(config, sort_keys=True))
    for other in (i for i in range(n) if i != me):
        try:
            posted = client.blocking_key_value_get(f"{run}/config/{other}", timeout * 1000)
        except Exception:  # the store's deadline: JAX raises its runtime error
            raise DistributedError(
                f"{caller}: process {me} of {n} waited {timeout} s for process {other} to start "
                f"the run (it posts its settings first): process {other} stalled, died or was "
                "started with another coordinator. Relaunch every process."
            ) from None
        theirs = json.loads(posted)
        changed = sorted(k for k in set(config) | set(theirs) if config.get(k) != theirs.get(k))
        if changed:
            mine = {k: _short(config.get(k)) for k in changed}
            them = {k: _short(theirs.get(k)) for k in changed}
            raise ConfigError(
                f"{caller}: process {other} was started with {them}, but process {me} with "
                f"{mine}. Every process of a run trains the same model on the same data with "
                "the same settings; refused before the first step. Start them all alike."
            )
    return run


def _short(v: Any) -> Any:
    """``v`` as the refusal shows it: a long one cut in its middle (two paths differ at the end)."""
    text = v if isinstance(v, str) else json.dumps(v)
    return v if len(text) <= 80 else f"{text[:38]}...{text[-39:]}"


class Watchdog:
    """Ends this process, naming the peers behind, when one step waits over ``timeout`` s:
    ``with watchdog(step):`` wraps each step; a thread posts where it is and checks its age."""

    def __init__(self, run: str, timeout: int, caller: str):
        self.client, self.me, self.n = _client(), jax.process_index(), jax.process_count()
        self.run, self.timeout, self.caller = run, timeout, caller
        self.resume = RESUME.get()  # read here: the watching thread has a context of its own
        self.busy: tuple[int, float] | None = None
        self.done = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="symjax_mlp-watch")
        self._thread.start()

    @contextlib.contextmanager
    def __call__(self, step: int) -> Iterator[None]:
        self.busy = (step, time.monotonic())
        try:
            yield
        except jax.errors.JaxRuntimeError as e:  # a peer gone (Ctrl-C, a crash) closes gloo's
            if "gloo" not in str(e).lower():  # pairs: the step fails at once, before any wait
                raise
            end(self._lost(step, e))
        finally:
            self.busy, self.done = None, step

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            busy = self.busy
            place = {"in": busy and busy[0], "done": self.done}
            with contextlib.suppress(Exception):  # the coordinator gone: JAX's own error comes
                self.client.key_value_set(
                    f"{self.run}/place/{self.me}", json.dumps(place), allow_overwrite=True
                )
            if busy is not None and time.monotonic() - busy[1] > self.timeout:
                end(self._message(busy[0]))

    def _lost(self, step: int, error: Exception) -> str:
        who = f"process {1 - self.me}" if self.n == 2 else "another process"
        return (
            f"{self.caller}: process {self.me} of {self.n} lost {who} in step {step}: its "
            f"collective failed ({first_line(error, 200)}), as when a process is "
            f"interrupted or dies. Relaunch every process with {self.resume} to continue from "
            "the last committed checkpoint."
        )

    def _message(self, step: int) -> str:
        behind = []
        for other in (i for i in range(self.n) if i != self.me):
            try:
                place = json.loads(self.client.key_value_try_get(f"{self.run}/place/{other}"))
            except Exception:
                place = None
            if place is None:
                behind.append(f"process {other} (posted nothing)")
            elif place["in"] != step and place["done"] < step:
                behind.append(f"process {other} (done with step {place['done']})")
        who = ", ".join(behind) or "another process"
        return (
            f"{self.caller}: process {self.me} of {self.n} waited {self.timeout} s in step "
            f"{step} for {who}: it stalled or died. Relaunch every process with {self.resume} "
            "to continue from the last committed checkpoint."
        )
