"""Serving's subprocesses: the fresh process each measurement runs in, and how to talk to it.

JAX's dispatch mode is fixed when its CPU backend starts, so every section of
:func:`~symjax_mlp.bench.bench_serving` runs in a fresh ``python -c`` process: one run to its
end (:func:`_run_child`, on :func:`run_json`, which ``bench_devices`` uses too), or one kept
alive and asked for a round at a time over stdin and stdout (:func:`_answer`, :func:`_stop`).
The child's entry, ``_child``, lives in :mod:`symjax_mlp.bench._serving`, which dispatches
to every section.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

_CHILD = (
    "import json, sys; from symjax_mlp.bench._serving import _child; "
    "print('\\n' + json.dumps(_child(**json.loads(sys.argv[1]))))"
)


def _stop(proc: subprocess.Popen, errors: Any) -> None:
    """Asks a latency subprocess to quit (kills it after 10 s) and closes its files."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.stdin.write(json.dumps({"quit": True}) + "\n")
            proc.stdin.flush()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout, errors):
        with contextlib.suppress(OSError):
            stream.close()


def _answer(proc: subprocess.Popen, errors: Any, timeout: float, who: str) -> dict[str, Any]:
    """The next JSON line a subprocess prints (at most ``timeout`` s away); ``who`` names
    it in the error."""
    ready = selectors.DefaultSelector()
    ready.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not ready.select(timeout):
            raise RuntimeError(f"{who} gave no answer within {timeout} s")
        line = proc.stdout.readline()
    finally:
        ready.close()
    if not line:
        proc.wait()
        errors.seek(0)
        raise RuntimeError(f"{who} failed (exit {proc.returncode}):\n{errors.read()[-3000:]}")
    return json.loads(line)


def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment of a subprocess: ours, ``env``, and no GPU memory grab (on a GPU the
    parent already holds JAX's preallocated share)."""
    full = dict(os.environ, **(env or {}))
    full.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return full


def run_json(code: str, payload: Any, env: Mapping[str, str], timeout: float, what: str) -> dict:
    """Runs ``python -c code payload-as-json`` to its end; its last stdout line, as JSON.

    Raises:
      RuntimeError: the subprocess failed (``what`` names it), with the end of its stderr.
    """
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(payload)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_child(kind: str, kw: dict, env: Mapping[str, str] | None, timeout: float) -> dict:
    what = f"bench_serving: the {kind} subprocess ({kw.get('mode', kw.get('dispatch'))})"
    return run_json(_CHILD, {"kind": kind, **kw}, _child_env(env), timeout, what)
