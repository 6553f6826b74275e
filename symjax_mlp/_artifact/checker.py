"""The checker: a stranger's StableHLO module is read and walked in a child process.

A crafted module can crash jaxlib's MLIR bindings, so :func:`analyze` hands the bytes to a
long-lived child (:class:`Checker`, running :func:`serve`) and takes back a
:class:`~symjax_mlp._artifact.ops.ModuleReport` as JSON, cached per module digest and jaxlib
version in this user's private cache, signed with this user's key.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from symjax_mlp._artifact.format import MAX_VJP_ORDER
from symjax_mlp._artifact.ops import ModuleReport, Problem, check_main
from symjax_mlp._errors import ArtifactError
from symjax_mlp._files import exhausted, read_cached, sha256, write_cached


def analyze(mlirbc: bytes, *, file: Path) -> ModuleReport:
    """Walks every op of the module in ``mlirbc`` in the child process (its crash or hang is
    an :class:`ArtifactError`); cached, signed, per module and checker (see above)."""
    data = bytes(mlirbc)
    name = _cache_key(sha256(data))
    with contextlib.suppress(ValueError, KeyError, TypeError):
        entry = read_cached("ops", name)
        if entry is not None:
            return _from_json(json.loads(entry))  # else damaged or absent: read it
    report = CHECKER.report(data, file=file)
    write_cached("ops", name, json.dumps(dataclasses.asdict(report)).encode())
    return report


# sha256 of model.jaxexport -> the ops report of it and its VJPs, each VJP's sizes; recent last
_REPORTS: dict[str, tuple[ModuleReport, tuple[tuple[int, int], ...]]] = {}


def program(
    file: Path, key: str, exported: Any
) -> tuple[ModuleReport, tuple[tuple[int, int], ...]]:
    """The ops report of the program (``file``, of sha256 ``key``) and its VJP modules, and
    each VJP module's static (work, bytes made) by order, which ``Guard`` bounds calls by."""
    found = _REPORTS.pop(key, None)
    if found is None:
        report = analyze(exported.mlir_module_serialized, file=file)
        problems, calls = list(report.problems), collections.Counter(report.custom_calls)
        module, order, works = exported, 0, []
        while module.has_vjp():  # jax.grad of the loaded model runs these modules
            order += 1
            if order > MAX_VJP_ORDER:
                problems.append(Problem("vjp", f"more than {MAX_VJP_ORDER} orders of VJP modules"))
                break
            try:
                module = module.vjp()
            except Exception as e:
                raise ArtifactError(
                    f"{file}: its VJP module of order {order} cannot be read ({e})."
                ) from e
            vjp = analyze(module.mlir_module_serialized, file=file)
            check_main(vjp, module, file=file, what=f" (its VJP of order {order})")
            calls.update(vjp.custom_calls)
            works.append((vjp.work, vjp.bytes_made))
            problems += [Problem(p.key, f"{p.what} (in its VJP of order {order})")
                         for p in vjp.problems]  # fmt: skip
        report = dataclasses.replace(report, custom_calls=dict(calls), problems=tuple(problems))
        found = report, tuple(works)
    _REPORTS[key] = found
    while len(_REPORTS) > 32:
        _REPORTS.pop(next(iter(_REPORTS)))
    return found


def remembered(verdict: str) -> bool:
    """Whether the checker found ``verdict`` (a statement about a module by its sha256) true
    before, in any process of this user (see :func:`remember`)."""
    return read_cached("ops", _cache_key(verdict)) == verdict.encode()


def remember(verdict: str) -> None:
    """Records that ``verdict`` holds, keyed like a report (the checker's source included)."""
    write_cached("ops", _cache_key(verdict), verdict.encode())


def _cache_key(module_sha256: str) -> str:
    from jaxlib import __version__ as jaxlib_version

    # the rules (ops.py), the walk and this reader: a changed one reads every module anew
    here = Path(__file__)
    names = ("ops.py", "cost.py", "walk.py", "rows.py", here.name)
    checker = b"".join(here.with_name(n).read_bytes() for n in names)
    return sha256(b"%s %s %s" % (module_sha256.encode(), jaxlib_version.encode(), checker))


def _from_json(r: dict[str, Any]) -> ModuleReport:
    """A report as :func:`dataclasses.asdict` wrote it (the child's, or a cache entry it signed)."""
    return ModuleReport(**{**r, "problems": tuple(Problem(**p) for p in r["problems"])})


class Checker:
    """A child process that reads and walks modules for this one: one at a time, started on
    first use (about a second: it imports JAX's MLIR bindings), restarted after a crash."""

    TIMEOUT = 10.0  # seconds one module may take to read and walk (a model's: milliseconds)
    START_TIMEOUT = 120.0  # seconds the child may take to import JAX and say it is ready

    def __init__(self) -> None:
        with contextlib.suppress(OSError):  # none usable: said when the checker starts
            tempfile.gettempdir()  # found now: out of files, its search says there is none
        self.proc: Any = None
        self.log: Any = None
        self.lock = threading.Lock()

    def _start(self, file: Path) -> Any:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.close()
        # -I, and only the absolute entries of sys.path: never a cwd (maybe the artifact's)
        paths = [p for p in sys.path if os.path.isabs(p)]
        code = (
            f"import sys; sys.path[:] = {paths!r}; "
            f"from symjax_mlp._artifact.checker import serve; serve({os.getpid()})"
        )
        try:  # out of files or processes (ulimit -n, -u): this process's limit, said
            self.log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the child)
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self.log, cwd=tempfile.gettempdir(),
            )  # fmt: skip
        except OSError as e:
            self.close()
            raise ArtifactError(
                f"{file}: the module checker, the child process that reads StableHLO for the "
                f"loader, cannot be started ({e.strerror or e}); nothing was compiled. "
                + (exhausted(e) or "Free memory or processes, and try again.")
            ) from e
        try:  # Ctrl-C (a notebook's stop button) here: its "ready" would be the next's answer
            ready, _, _ = select.select([self.proc.stdout], [], [], self.START_TIMEOUT)
            if ready and self.proc.stdout.readline() == b"ready\n":
                return self.proc
        except BaseException:
            self.close()
            raise
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
            try:  # interrupted (Ctrl-C) between the module sent and its answer read, the child
                line, proc = self._ask(data, file)  # is ended: else the next module's answer
            except BaseException:  # would be this one's, or a half-sent module its start
                self.close()
                raise
            if line:
                answer = json.loads(line)
                if "error" in answer:
                    raise ArtifactError(f"{file}: {answer['error']}")
                return _from_json(answer["report"])
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

    def _ask(self, data: bytes, file: Path) -> tuple[bytes | None, Any]:
        """Sends ``data`` to the child; its answer's line (``None``: none within the timeout)."""
        for _ in (0, 1):
            proc = self._start(file)
            try:
                proc.stdin.write(len(data).to_bytes(8, "little") + data)
                proc.stdin.flush()
                break
            except OSError:  # it had exited (idle, killed): a new one
                self.close()
        else:
            raise ArtifactError(f"{file}: the module checker does not start.")
        ready, _, _ = select.select([proc.stdout], [], [], self.TIMEOUT)
        return (proc.stdout.readline() if ready else None), proc

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
    import jax.extend.mlir as jex
    from jax.interpreters import mlir as jax_mlir

    from symjax_mlp._artifact import rows  # MLIR's bindings: the child's alone
    from symjax_mlp._artifact.walk import analyze_module

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b"ready\n")
    stdout.flush()
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return
        data = stdin.read(int.from_bytes(head, "little"))
        try:
            with jax_mlir.make_ir_context():
                try:
                    module = jex.deserialize_portable_artifact(data)
                except Exception as e:  # MLIR reports an unreadable module as a plain Exception
                    raise ArtifactError(
                        f"the StableHLO module cannot be read ({type(e).__name__}: "
                        f"{str(e)[:300]}); the artifact is corrupted or was made by an "
                        "incompatible JAX."
                    ) from e
                report = analyze_module(module, head="")  # the parent heads it with the file
                report = dataclasses.replace(report, rows=rows.analyze(module))
                answer: dict[str, Any] = {"report": dataclasses.asdict(report)}
        except ArtifactError as e:
            answer = {"error": str(e)}
        stdout.write(json.dumps(answer).encode() + b"\n")
        stdout.flush()
