"""The fresh processes measurements run in, and how to talk to them.

JAX's dispatch mode is fixed when its CPU backend starts, so the serving benchmark and the
main table's latency-mode row time in fresh ``python -c`` processes: one run to its end
(:func:`run_json`, which the device benchmark uses too), or one kept alive and asked for a
round at a time, a JSON line each way over stdin and stdout (:class:`Child`). Every child
runs :data:`ENTRY`: :func:`benchmarks.serving.run_child` with the JSON payload of its
command line; ``scripts/`` is put on its ``PYTHONPATH`` (:func:`child_env`), so it imports
this package as the parent does.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The ``python -c`` code of a child: one measurement, its result the last stdout line.
ENTRY = (
    "import json, sys; from benchmarks.serving import run_child; "
    "print('\\n' + json.dumps(run_child(**json.loads(sys.argv[1]))))"
)
#: ``scripts/``, where ``benchmarks`` is imported from.
SCRIPTS = str(Path(__file__).resolve().parent.parent)


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a subprocess: ours, ``env``, ``scripts/`` on ``PYTHONPATH``, and no
    GPU memory grab (on a GPU the parent already holds JAX's preallocated share)."""
    full = dict(os.environ, **(env or {}))
    paths = [p for p in full.get("PYTHONPATH", "").split(os.pathsep) if p]
    full["PYTHONPATH"] = os.pathsep.join([SCRIPTS, *(p for p in paths if p != SCRIPTS)])
    full.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return full


def run_json(
    code: str, payload: Any, env: Mapping[str, str] | None, timeout: float, what: str
) -> dict:
    """Runs ``python -c code payload-as-json`` to its end; its last stdout line, as JSON.

    Raises:
      RuntimeError: the subprocess failed (``what`` names it), with the end of its stderr.
    """
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(payload)],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Child:
    """A fresh process kept alive: it runs :data:`ENTRY` with ``payload``, says when it is
    ready, then answers one JSON line per :meth:`ask` until :meth:`close`.

    Args:
      payload: the keywords of :func:`benchmarks.serving.run_child` (``kind`` among them).
      env: extra environment (see :func:`child_env`).
      timeout: seconds to wait for any one answer.
      who: names the process in errors.

    Attributes:
      ready: the child's first line (what it announced once set up).

    Raises:
      RuntimeError: the process failed to start or to answer (with the end of its stderr).
    """

    def __init__(
        self, payload: Mapping[str, Any], *, env: Mapping[str, str] | None, timeout: float, who: str
    ) -> None:
        self.who, self.timeout = who, timeout
        self._errors = tempfile.TemporaryFile("w+")  # noqa: SIM115  (a file: never fills up)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", ENTRY, json.dumps(dict(payload))],
            env=child_env(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            text=True,
        )
        try:
            self.ready: dict[str, Any] = self._answer()
        except BaseException:
            self.close()
            raise

    def ask(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Sends ``request`` as one JSON line; the child's answer."""
        self._proc.stdin.write(json.dumps(dict(request)) + "\n")
        self._proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        proc, errors = self._proc, self._errors
        ready = selectors.DefaultSelector()
        ready.register(proc.stdout, selectors.EVENT_READ)
        try:
            if not ready.select(self.timeout):
                raise RuntimeError(f"{self.who} gave no answer within {self.timeout} s")
            line = proc.stdout.readline()
        finally:
            ready.close()
        if not line:
            proc.wait()
            errors.seek(0)
            raise RuntimeError(
                f"{self.who} failed (exit {proc.returncode}):\n{errors.read()[-3000:]}"
            )
        return json.loads(line)

    def close(self) -> None:
        """Asks the child to quit (kills it after 10 s) and closes its files."""
        proc = self._proc
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.stdin.write(json.dumps({"quit": True}) + "\n")
                proc.stdin.flush()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout, self._errors):
            with contextlib.suppress(OSError):
                stream.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_once(kind: str, kw: dict, env: Mapping[str, str] | None, timeout: float) -> dict:
    """Runs one measurement of ``kind`` to its end in a fresh process; its result."""
    what = f"bench_serving: the {kind} subprocess ({kw.get('mode', kw.get('dispatch'))})"
    return run_json(ENTRY, {"kind": kind, **kw}, env, timeout, what)
