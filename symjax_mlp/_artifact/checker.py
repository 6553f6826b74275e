"""The checker: a stranger's StableHLO module is read and walked in a child process.

jaxlib's MLIR bindings parse and walk a module in C++, and a crafted or corrupted module can
crash them; so :func:`analyze` hands the bytes to a long-lived child process (:class:`Checker`,
running :func:`serve`) and takes back a :class:`~symjax_mlp._artifact.ops.ModuleReport` as
JSON. Verdicts are remembered per module digest and jaxlib version in the cache directory,
so a module checked once is not walked again.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from symjax_mlp._artifact.ops import ModuleReport, Problem
from symjax_mlp._artifact.walk import analyze_module
from symjax_mlp._errors import ArtifactError
from symjax_mlp._files import cache_dir, sha256, write_file_atomic


def parse(mlirbc: bytes, *, file: Path) -> Any:
    """The StableHLO module of portable-artifact bytecode, as a jaxlib ``ir.Module``.

    In this process: only for bytes :func:`analyze` has read safely in its child process.
    """
    import jax.extend.mlir as jex
    from jax.interpreters import mlir as jax_mlir

    context = jax_mlir.make_ir_context()
    try:
        with context:
            return jex.deserialize_portable_artifact(bytes(mlirbc)), context
    except Exception as e:  # MLIR reports an unreadable module as a plain Exception
        raise ArtifactError(
            f"{file}: the StableHLO module cannot be read ({type(e).__name__}: "
            f"{str(e)[:300]}); the artifact is corrupted or was made by an incompatible JAX."
        ) from e


def analyze(mlirbc: bytes, *, file: Path) -> ModuleReport:
    """Walks every op of the module in ``mlirbc``; see :mod:`symjax_mlp._artifact.ops`.

    The bytes are read and walked in the child process (see the module docstring); a crash
    or a hang of the child is an :class:`ArtifactError`. A report is cached in
    ``~/.cache/symjax_mlp/ops`` under the sha256 of the module and of this checker, so a
    module read once by this user is not read again.
    """
    data = bytes(mlirbc)
    cache = cache_dir("ops") / _cache_key(sha256(data))
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return _from_json(json.loads(cache.read_bytes()))  # else damaged or absent: read it
    report = CHECKER.report(data, file=file)
    with contextlib.suppress(OSError):  # an unwritable cache directory: just not cached
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(cache, json.dumps(_to_json(report)).encode())
    return report


def remembered(verdict: str) -> bool:
    """Whether the checker found ``verdict`` (a statement about a module by its sha256) true
    before, in any process of this user (see :func:`remember`)."""
    return (cache_dir("ops") / _cache_key(verdict)).is_file()


def remember(verdict: str) -> None:
    """Records that ``verdict`` holds, keyed like a report (the checker's source included)."""
    with contextlib.suppress(OSError):
        file = cache_dir("ops") / _cache_key(verdict)
        file.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(file, verdict.encode())


def _cache_key(module_sha256: str) -> str:
    from jaxlib import __version__ as jaxlib_version

    # the rules (ops.py), the walk and this reader: a changed one reads every module anew
    here = Path(__file__)
    checker = b"".join(
        here.with_name(n).read_bytes() for n in ("ops.py", "cost.py", "walk.py", here.name)
    )
    return sha256(b"%s %s %s" % (module_sha256.encode(), jaxlib_version.encode(), checker))


def _to_json(r: ModuleReport) -> dict[str, Any]:
    return {
        "counts": r.counts,
        "custom_calls": r.custom_calls,
        "work": r.work,
        "problems": [[p.key, p.what] for p in r.problems],
    }


def _from_json(r: dict[str, Any]) -> ModuleReport:
    report = ModuleReport(
        dict(r["counts"]),
        dict(r["custom_calls"]),
        int(r["work"]),
        tuple(Problem(str(k), str(w)) for k, w in r["problems"]),
    )
    counts = (*report.counts.values(), *report.custom_calls.values())
    if not all(isinstance(n, int) for n in counts):
        raise ValueError("not a report")
    return report


class Checker:
    """A child process that reads and walks modules for this one: one at a time, started on
    first use (about a second: it imports JAX's MLIR bindings), restarted after a crash."""

    TIMEOUT = 10.0  # seconds one module may take to read and walk (a model's: milliseconds)
    START_TIMEOUT = 120.0  # seconds the child may take to import JAX and say it is ready

    def __init__(self) -> None:
        self.proc: Any = None
        self.log: Any = None
        self.lock = threading.Lock()

    def _start(self, file: Path) -> Any:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.close()
        # -I: nothing from the caller's cwd or environment; the modules this process imports
        # are found where this process found them (absolute entries of its sys.path only:
        # never a cwd, which may be the artifact's directory or a shared /tmp)
        paths = [p for p in sys.path if os.path.isabs(p)]
        code = (
            f"import sys; sys.path[:] = {paths!r}; "
            f"from symjax_mlp._artifact.checker import serve; serve({os.getpid()})"
        )
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the child)
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=tempfile.gettempdir(),
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], self.START_TIMEOUT)
        if ready and self.proc.stdout.readline() == b"ready\n":
            return self.proc
        self.log.seek(0)
        said = self.log.read()[-800:].decode("utf-8", "replace").strip().splitlines()
        self.close()
        raise ArtifactError(
            f"{file}: the module checker, the child process that reads StableHLO for the "
            f"loader, did not start ({said[-1] if said else 'it said nothing'}). It runs "
            f"{sys.executable} -I with this process's sys.path and imports symjax_mlp and "
            "jax from there: check that this Python can import both, or load with "
            "trust=True an artifact you trust as you trust code you run."
        )

    def report(self, data: bytes, *, file: Path) -> ModuleReport:
        with self.lock:
            for attempt in (0, 1):
                proc = self._start(file)
                try:
                    proc.stdin.write(len(data).to_bytes(8, "little") + data)
                    proc.stdin.flush()
                except (BrokenPipeError, OSError):
                    self.close()
                    if attempt:
                        raise ArtifactError(f"{file}: the module checker does not start.") from None
                    continue  # it had exited (idle, killed): a new one
                line = self._answer(proc, file)
                break
        answer = json.loads(line)
        if "error" in answer:
            raise ArtifactError(f"{file}: {answer['error']}")
        return _from_json(answer["report"])

    def _answer(self, proc: Any, file: Path) -> bytes:
        ready, _, _ = select.select([proc.stdout], [], [], self.TIMEOUT)
        line = proc.stdout.readline() if ready else None
        if line:
            return line
        self.close()
        if line is None:
            raise ArtifactError(
                f"{file}: reading the StableHLO module took more than {self.TIMEOUT:g} s; "
                "refused (no model's module takes that)."
            )
        why = f"signal {-proc.returncode}" if (proc.returncode or 0) < 0 else "an exit"
        raise ArtifactError(
            f"{file}: StableHLO's bytecode reader crashed ({why}) on this module, in the "
            "child process that reads modules for the loader: the module is corrupted or "
            "crafted. Refused; nothing was compiled."
        )

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
        log, self.log = self.log, None
        if log is not None:
            log.close()


CHECKER = Checker()
atexit.register(CHECKER.close)


def serve(parent: int) -> None:
    """The child of :class:`Checker`: reads modules from stdin, writes one JSON line each;
    dies with its parent (a parent killed mid-check leaves no child running)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        return  # the parent died before the line above
    import jax.extend.mlir  # noqa: F401  (what parse needs, imported before "ready")

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b"ready\n")
    stdout.flush()
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return
        data = stdin.read(int.from_bytes(head, "little"))
        try:
            module, context = parse(data, file=Path("module"))
            with context:
                answer: dict[str, Any] = {"report": _to_json(analyze_module(module))}
        except ArtifactError as e:
            answer = {"error": str(e).removeprefix("module: ")}
        stdout.write(json.dumps(answer).encode() + b"\n")
        stdout.flush()
