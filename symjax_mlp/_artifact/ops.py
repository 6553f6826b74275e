"""What an artifact's program may do: its StableHLO ops, read from the module that runs.

``jax.export`` checks custom-call targets and host callbacks when a model is *exported*; a
loader that takes an artifact from someone else must check the module itself, before anything
compiles it. :func:`analyze` parses the StableHLO bytecode (``model.mlirbc``, which the loader
has checked is the very module of ``model.jaxexport``) with jaxlib's MLIR bindings and walks
every op of every function. :func:`check` then refuses, unless the caller allows it by name:

- an op outside :data:`ALLOWED_OPS` (what MLPs, the model zoo, sharded and multi-platform
  exports use: derived by exporting each of them and collecting their ops);
- a ``custom_call`` other than those ``jax.export`` itself emits (:data:`JAX_CUSTOM_CALLS`):
  LAPACK and GPU kernels read and write buffers the module sizes, and a host callback refers
  to a Python function of the process that exported it (``allow={"custom_call:NAME"}``);
- a ``while`` loop unless its trip count is a constant of at most :data:`MAX_LOOP_TRIPS` (a
  counter from a constant, compared ``<`` a constant, incremented by a constant: what
  ``fori_loop`` and JAX's own PRNG emit); others may never end (``allow={"while"}``);
- recursion between functions (the inliner would never finish, or overflow its stack);
- more than :data:`MAX_WORK` element operations, or a tensor of more than
  :data:`MAX_ELEMENTS` elements, counting dynamic (batch) dimensions as 1 and multiplying by
  loop trip counts and call counts: a few kB of module can ask for hours of compute
  (``allow={"compute"}``).

``trust=True`` skips all of it (for artifacts you made, or trust as you trust code).
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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from symjax_mlp._errors import ArtifactError
from symjax_mlp._files import cache_dir, sha256, write_file_atomic

ALLOWED_OPS = frozenset(
    {
        "builtin.module",
        "func.func", "func.return", "func.call",
        "stablehlo.constant", "stablehlo.iota", "stablehlo.dynamic_iota",
        "stablehlo.get_dimension_size", "stablehlo.custom_call",  # custom calls: by target
        "stablehlo.broadcast_in_dim", "stablehlo.dynamic_broadcast_in_dim",
        "stablehlo.reshape", "stablehlo.dynamic_reshape", "stablehlo.transpose",
        "stablehlo.concatenate", "stablehlo.slice", "stablehlo.pad", "stablehlo.reverse",
        "stablehlo.convert", "stablehlo.bitcast_convert",
        "stablehlo.dot_general", "stablehlo.reduce", "stablehlo.return",
        "stablehlo.compare", "stablehlo.select", "stablehlo.clamp",
        "stablehlo.case", "stablehlo.if", "stablehlo.while", "stablehlo.optimization_barrier",
        # elementwise arithmetic
        "stablehlo.add", "stablehlo.subtract", "stablehlo.multiply", "stablehlo.divide",
        "stablehlo.remainder", "stablehlo.maximum", "stablehlo.minimum", "stablehlo.negate",
        "stablehlo.abs", "stablehlo.sign", "stablehlo.power", "stablehlo.atan2",
        "stablehlo.floor", "stablehlo.ceil", "stablehlo.round_nearest_even",
        "stablehlo.round_nearest_afz", "stablehlo.is_finite",
        "stablehlo.and", "stablehlo.or", "stablehlo.xor", "stablehlo.not",
        "stablehlo.shift_left", "stablehlo.shift_right_logical",
        "stablehlo.shift_right_arithmetic",
        # elementwise transcendental
        "stablehlo.exponential", "stablehlo.exponential_minus_one", "stablehlo.log",
        "stablehlo.log_plus_one", "stablehlo.logistic", "stablehlo.tanh", "stablehlo.sqrt",
        "stablehlo.rsqrt", "stablehlo.cbrt", "stablehlo.sine", "stablehlo.cosine",
        "stablehlo.tan",
    }
)  # fmt: skip
ALLOWED_DIALECTS = ("sdy.",)  # Shardy's sharding annotations of sharded exports
JAX_CUSTOM_CALLS = frozenset(
    {"shape_assertion", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}
)  # what jax.export itself emits: symbolic-shape checks, sharding annotations
HOST_CALLBACKS = frozenset(
    {
        "xla_python_cpu_callback", "xla_python_gpu_callback", "xla_ffi_python_cpu_callback",
        "xla_ffi_python_gpu_callback", "xla_ffi_partitioned_python_cpu_callback",
        "xla_ffi_partitioned_python_gpu_callback",
    }
)  # fmt: skip
MAX_LOOP_TRIPS = 1 << 16
MAX_ELEMENTS = 1 << 32
MAX_WORK = 1 << 32  # element operations: ~10-30 s of the slowest ops on one core
MAX_OPS = 1 << 20  # ops after inlining every call
_INT_MAX = (1 << 31) - 1


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing the module does that is refused by default."""

    key: str  # what allow= takes: "while", "custom_call:NAME", "compute", an op name
    what: str  # for the message


@dataclasses.dataclass(frozen=True)
class ModuleReport:
    """What a StableHLO module does: op counts, custom-call targets, work, problems."""

    counts: dict[str, int]
    custom_calls: dict[str, int]
    work: int  # element operations, dynamic dimensions counted as 1
    problems: tuple[Problem, ...]


def parse(mlirbc: bytes, *, file: Path) -> Any:
    """The StableHLO module of portable-artifact bytecode, as a jaxlib ``ir.Module``.

    In this process: only for bytes :func:`analyze` has read safely in its child process.
    """
    import jax.extend.mlir as jex
    from jax._src.interpreters import mlir as jax_mlir

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

    The bytes are read by StableHLO's bytecode reader, native code that a crafted module
    can crash (a single flipped bit did, with SIGSEGV): so they are read, and walked, in a
    child process (:class:`Checker`), and only a module that reads there is ever read here.
    A crash or a hang of the child is an :class:`ArtifactError`.

    A module read before, in any process of this user, is not read again: its report is
    cached in ``~/.cache/symjax_mlp/ops`` under the sha256 of its bytes and of this checker
    (so a new symjax_mlp or jaxlib reads every module afresh), which takes a second off
    every later cold start.
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
    import jaxlib

    checker = Path(__file__).read_bytes()  # the rules: a changed checker reads modules anew
    return sha256(b"%s %s %s" % (module_sha256.encode(), jaxlib.__version__.encode(), checker))


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
            f"from symjax_mlp._artifact.ops import serve; serve({os.getpid()})"
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


def analyze_module(module: Any, *, file: Path | str = "the module") -> ModuleReport:
    """:func:`analyze` of an ``ir.Module`` already parsed (in its context)."""
    try:
        return _Walk(module).report()
    except RecursionError:
        raise ArtifactError(f"{file}: its regions nest too deeply to check; refused.") from None
    except (RuntimeError, ValueError, TypeError, UnicodeDecodeError) as e:  # MLIR bindings
        raise ArtifactError(
            f"{file}: the StableHLO module cannot be checked ({type(e).__name__}: "
            f"{str(e)[:200]}); refused."
        ) from e


def normalize_allow(allow: Iterable[str] | None) -> frozenset[str]:
    """``allow=`` as keys: ``"while"``, ``"stablehlo.while"`` and ``"op:while"`` are one key."""
    if allow is None:
        return frozenset()
    if isinstance(allow, str):
        allow = (allow,)
    keys = set()
    for item in allow:
        if not isinstance(item, str) or not item:
            raise ArtifactError(
                f"load(allow=...): expected names such as 'while' or 'custom_call:NAME'; "
                f"got {item!r}."
            )
        item = item.removeprefix("op:").removeprefix("stablehlo.")
        keys.add(item)
    return frozenset(keys)


def check(report: ModuleReport, *, file: Path, allow: frozenset[str], caller: str) -> None:
    """Raises :class:`ArtifactError` for each problem of ``report`` not in ``allow``."""
    refused = [p for p in report.problems if p.key not in allow]
    if not refused:
        return
    keys = sorted({p.key for p in refused})
    lines = "\n".join(f"  - {p.what}" for p in refused[:12])
    more = f"\n  ... and {len(refused) - 12} more" if len(refused) > 12 else ""
    raise ArtifactError(
        f"{file}: {caller} refuses to compile this module; it does what an MLP artifact "
        f"never needs:\n{lines}{more}\nIf you trust whoever made the artifact as you trust "
        f"code you run, pass allow={show_keys(keys)} (just these) or trust=True (anything) to "
        f"{caller} (symjax-mlp run/verify/serve: {' '.join(f'--allow {k}' for k in keys)}, or "
        "--trust). An untrusted artifact is untrusted code: run it in a sandbox."
    )


def show_keys(keys: Iterable[str]) -> str:
    """``{'a', 'b'}``, sorted (a set's own repr is in hash order)."""
    return "{" + ", ".join(repr(k) for k in sorted(keys)) + "}"


# -- the walk ---------------------------------------------------------------------------------
def _short(name: str) -> str:
    return name.removeprefix("stablehlo.")


class _Walk:
    def __init__(self, module: Any) -> None:
        self.module = module
        self.counts: collections.Counter[str] = collections.Counter()
        self.custom: collections.Counter[str] = collections.Counter()
        self.problems: dict[tuple[str, str], Problem] = {}
        self.funcs: dict[str, dict[str, Any]] = {}  # name -> {"work", "ops", "calls"}
        self.n_modules = 0

    def report(self) -> ModuleReport:
        self._op(self.module.operation, None, 1)
        if self.n_modules != 1:
            self._problem("module", f"{self.n_modules} nested modules")
        work = self._inline()
        if work > MAX_WORK:
            self._problem(
                "compute",
                f"about {work:.3g} element operations per call beyond the batch (at most "
                f"{MAX_WORK:.3g}): compiling or running it could take hours",
            )
        return ModuleReport(
            dict(self.counts.most_common()),
            dict(self.custom.most_common()),
            work,
            tuple(self.problems.values()),
        )

    def _problem(self, key: str, what: str) -> None:
        self.problems.setdefault((key, what), Problem(key, what))

    def _op(self, op: Any, func: dict[str, Any] | None, mult: int) -> None:
        name = op.name
        self.counts[name] += 1
        if name == "builtin.module":
            self.n_modules += 1
        elif name == "func.func":
            fname = _str_attr(op, "sym_name") or f"#{len(self.funcs)}"
            func = self.funcs.setdefault(fname, {"work": 0, "ops": 0, "calls": []})
            if not op.regions or not len(op.regions[0].blocks):
                self._problem(  # jax.export writes none; lowering one crashed JAX (SIGSEGV)
                    "call", f"the function @{fname} is declared without a body (an external symbol)"
                )
            if func["ops"]:
                self._problem("module", f"two functions named @{fname}")
            mult = 1
        elif name not in ALLOWED_OPS and not name.startswith(ALLOWED_DIALECTS):
            self._problem(_short(name), f"the op {name}")
        if func is not None:
            func["ops"] += 1  # inlining copies a loop body once, not once per iteration
            func["work"] += mult * self._cost(op)
        if name == "stablehlo.custom_call":
            target = _str_attr(op, "call_target_name") or "?"
            self.custom[target] += 1
            if target in HOST_CALLBACKS:
                self._problem(
                    f"custom_call:{target}",
                    f"a host callback ({target}): it calls a Python function of the process "
                    "that exported the model, which here is no function or another one",
                )
            elif target not in JAX_CUSTOM_CALLS:
                self._problem(
                    f"custom_call:{target}",
                    f"custom_call @{target}: a native kernel that reads and writes buffers of "
                    "the sizes the module declares, unchecked",
                )
            else:
                self._jax_custom_call(op, target)
                self._attributes(op, name)
        elif name == "func.call" and func is not None:
            callee = _symbol_attr(op, "callee")
            func["calls"].append((callee, mult))
        if name != "stablehlo.custom_call":  # a kernel allowed by name: its attributes too
            self._attributes(op, name)
        inner = mult
        if name == "stablehlo.while":
            trips = _trip_count(op)
            if trips is None:
                self._problem("while", "a while loop whose trip count is not a constant")
                trips = MAX_LOOP_TRIPS
            elif trips > MAX_LOOP_TRIPS:
                self._problem(
                    "while", f"a while loop of {trips:,} iterations (at most {MAX_LOOP_TRIPS:,})"
                )
            inner = mult * max(trips, 1)
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    self._op(child.operation, func, inner)

    def _attributes(self, op: Any, name: str) -> None:
        """Dialect-prefixed attributes (``jax.*``, ``mhlo.*``: nothing verifies those) must
        be ones jax.export writes, of the type it writes: JAX and XLA read them unchecked."""
        from jaxlib.mlir import ir

        for attr_name in op.attributes:
            a = op.attributes[attr_name]
            if "." in attr_name:
                self._attribute(name, attr_name, a)
            elif attr_name in ("arg_attrs", "res_attrs") and name == "func.func":
                for entry in a if isinstance(a, ir.ArrayAttr) else [None]:
                    if not isinstance(entry, ir.DictAttr):
                        self._problem("attribute", f"{name} with {attr_name} of {entry}")
                        continue
                    for i in range(len(entry)):
                        named = entry[i]
                        self._attribute(f"{name} argument", named.name, named.attr)

    def _attribute(self, where: str, attr_name: str, a: Any) -> None:
        if attr_name.startswith("sdy."):
            return  # Shardy verifies its own attributes
        kinds = _ATTRIBUTES.get(attr_name)
        if kinds is None or not isinstance(a, kinds):
            self._problem(
                "attribute",
                f"the attribute {attr_name} ({type(a).__name__}) of {where}, which jax.export "
                "does not write so",
            )

    def _jax_custom_call(self, op: Any, target: str) -> None:
        """A custom call jax.export emits must look exactly like what it emits: JAX's shape
        refinement read a forged ``shape_assertion`` (an error_message that was no string)
        and crashed (SIGSEGV)."""
        from jaxlib.mlir import ir

        attrs = {n: op.attributes[n] for n in op.attributes}
        if target == "shape_assertion":
            want = {
                "call_target_name": ir.StringAttr,
                "api_version": ir.IntegerAttr,
                "error_message": ir.StringAttr,
                "has_side_effect": ir.BoolAttr,
            }
            operands = list(op.operands)
            ok = (
                set(attrs) <= set(want)
                and {"error_message", "has_side_effect"} <= set(attrs)
                and all(isinstance(attrs[k], want[k]) for k in attrs)
                and not list(op.results)
                and operands
                and all(
                    _scalar_type(v.type, {1} if i == 0 else {32, 64})
                    for i, v in enumerate(operands)
                )
            )
        else:  # sharding annotations: one array in, the same array out
            want = {
                "call_target_name": ir.StringAttr,
                "api_version": ir.IntegerAttr,
                "backend_config": ir.StringAttr,
                "has_side_effect": ir.BoolAttr,
                "mhlo.sharding": ir.StringAttr,
                "mhlo.frontend_attributes": ir.DictAttr,
            }
            ok = (
                set(attrs) <= set(want)
                and all(isinstance(attrs[k], want[k]) for k in attrs)
                and len(list(op.operands)) == 1
                and len(list(op.results)) == 1
            )
        if not ok:
            self._problem(
                f"custom_call:{target}",
                f"custom_call @{target} with operands, results or attributes other than those "
                "jax.export writes",
            )

    def _cost(self, op: Any) -> int:
        sizes = [_elements(v.type) for v in (*op.operands, *op.results)]
        for n in sizes:
            if n > MAX_ELEMENTS:
                self._problem(
                    "compute", f"a tensor of {n:,} elements in {op.name} (at most {MAX_ELEMENTS:,})"
                )
        cost = max(sizes, default=1)
        if op.name == "stablehlo.dot_general" and op.results:
            cost = _elements(op.results[0].type) * _contracting(op)
        return cost

    def _inline(self) -> int:
        """Work of ``main`` with every call inlined; flags recursion and call explosions."""
        order, state = [], {}

        def visit(name: str, path: list[str]) -> None:
            if state.get(name) == 2:
                return
            if state.get(name) == 1:
                cycle = " -> ".join([*path[path.index(name) :], name])
                self._problem("recursion", f"recursive calls ({cycle}), which never finish")
                return
            state[name] = 1
            for callee, _ in self.funcs.get(name, {}).get("calls", []):
                if callee not in self.funcs:
                    self._problem("call", f"a call of @{callee}, which the module does not define")
                else:
                    visit(callee, [*path, name])
            state[name] = 2
            order.append(name)

        for name in self.funcs:
            visit(name, [])
        if any(p.key == "recursion" for p in self.problems.values()):
            return sum(f["work"] for f in self.funcs.values())
        total_work: dict[str, int] = {}
        total_ops: dict[str, int] = {}
        for name in order:  # callees first
            f = self.funcs[name]
            total_work[name] = f["work"] + sum(
                m * total_work.get(c, 0) for c, m in f["calls"] if c in self.funcs
            )
            total_ops[name] = f["ops"] + sum(
                total_ops.get(c, 0) for c, _ in f["calls"] if c in self.funcs
            )
        roots = [n for n in self.funcs if not any(n == c for f in self.funcs.values()
                                                  for c, _ in f["calls"])]  # fmt: skip
        ops = sum(total_ops[n] for n in roots)
        if ops > MAX_OPS:
            self._problem(
                "compute", f"{ops:,} ops once every call is inlined (at most {MAX_OPS:,})"
            )
        return sum(total_work[n] for n in roots)


# -- attribute and type helpers ----------------------------------------------------------------
def _attribute_kinds() -> dict[str, tuple[type, ...]]:
    from jaxlib.mlir import ir

    string, integer, boolean = (ir.StringAttr,), (ir.IntegerAttr,), (ir.BoolAttr,)
    return {
        "jax.uses_shape_polymorphism": boolean,
        "jax.global_constant": string,
        "jax.result_info": string,
        "jax.buffer_donor": boolean,
        "mhlo.num_partitions": integer,
        "mhlo.num_replicas": integer,
        "mhlo.sharding": string,
        "mhlo.layout_mode": string,
        "mhlo.memory_kind": string,
        "mhlo.frontend_attributes": (ir.DictAttr,),
        "mhlo.backend_config": (ir.DictAttr, ir.StringAttr),
        "tf.aliasing_output": integer,
        "stablehlo.mesh": (ir.DictAttr,),  # on sdy.mesh, as Shardy writes it
    }


class _Kinds(dict):  # built on first use: jaxlib.mlir imports only in the checker
    def get(self, key: str, default: Any = None) -> Any:
        if not self:
            self.update(_attribute_kinds())
        return super().get(key, default)


_ATTRIBUTES = _Kinds()


def _scalar_type(t: Any, widths: set[int]) -> bool:
    from jaxlib.mlir import ir

    return (
        isinstance(t, ir.RankedTensorType)
        and t.rank == 0
        and isinstance(t.element_type, ir.IntegerType)
        and t.element_type.width in widths
    )


def _attr(op: Any, name: str) -> Any:
    try:
        return op.attributes[name]
    except (KeyError, IndexError, ValueError):
        return None


def _str_attr(op: Any, name: str) -> str | None:
    from jaxlib.mlir import ir

    a = _attr(op, name)  # value_bytes: a forged name need not be UTF-8
    return a.value_bytes.decode("utf-8", "replace") if isinstance(a, ir.StringAttr) else None


def _symbol_attr(op: Any, name: str) -> str:
    from jaxlib.mlir import ir

    a = _attr(op, name)
    if not isinstance(a, ir.FlatSymbolRefAttr):
        return "?"
    try:
        return a.value
    except (RuntimeError, UnicodeDecodeError):  # a forged name need not be UTF-8
        return str(a).removeprefix("@")


def _elements(t: Any) -> int:
    from jaxlib.mlir import ir

    if not isinstance(t, ir.RankedTensorType):
        return 1
    rt = t
    n = 1
    for i in range(rt.rank):
        if not rt.is_dynamic_dim(i):
            n *= max(rt.get_dim_size(i), 0)
    return n


def _contracting(op: Any) -> int:
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo as hlo

    try:
        dims = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
        lhs = op.operands[0].type
        if not isinstance(lhs, ir.RankedTensorType):
            return 1
        n = 1
        for d in dims.lhs_contracting_dimensions:
            if not lhs.is_dynamic_dim(d):
                n *= max(lhs.get_dim_size(d), 0)
        return max(n, 1)
    except (ValueError, KeyError, IndexError, TypeError):
        return max((_elements(v.type) for v in op.operands), default=1)


def _scalar_int(value: Any) -> int | None:
    """The value of a scalar integer ``stablehlo.constant``, else None."""
    from jaxlib.mlir import ir

    if not isinstance(value, ir.OpResult):
        return None
    op = value.owner.operation
    if op.name != "stablehlo.constant":
        return None
    dense = _attr(op, "value")
    if not isinstance(dense, ir.DenseIntElementsAttr) or not dense.is_splat:
        return None
    t = dense.type
    if not isinstance(t, ir.RankedTensorType) or t.rank != 0:
        return None
    et = t.element_type
    if not isinstance(et, ir.IntegerType) or et.width not in (32, 64) or et.is_unsigned:
        return None
    return int(dense.get_splat_value().value)


def _block_arg(value: Any, block: Any) -> int | None:
    from jaxlib.mlir import ir

    if not isinstance(value, ir.BlockArgument):
        return None
    return value.arg_number if value.owner == block else None


def _trip_count(op: Any) -> int | None:
    """The trip count of a counted ``stablehlo.while``, or None if it is not one.

    Counted: the condition is ``counter < limit`` (signed) of a loop-carried ``counter``
    that starts at a constant and that the body increments by a constant ``step >= 1``, with
    ``limit`` a constant and ``limit + step`` within int32 (no wrap-around).
    """
    try:
        cond, body = op.regions[0].blocks[0], op.regions[1].blocks[0]
        pred = list(cond.operations)[-1].operands
        if len(pred) != 1:
            return None
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import stablehlo as hlo

        if not isinstance(pred[0], ir.OpResult):
            return None
        cmp = pred[0].owner.operation
        if cmp.name != "stablehlo.compare" or cmp.block != cond:
            return None
        if hlo.ComparisonDirectionAttr(cmp.attributes["comparison_direction"]).value != "LT":
            return None
        kind = _attr(cmp, "compare_type")
        if kind is not None and hlo.ComparisonTypeAttr(kind).value != "SIGNED":
            return None
        k = _block_arg(cmp.operands[0], cond)
        limit = _scalar_int(cmp.operands[1])
        if k is None or limit is None:
            return None
        start = _scalar_int(op.operands[k])
        returned = list(body.operations)[-1].operands
        if start is None or k >= len(returned) or not isinstance(returned[k], ir.OpResult):
            return None
        add = returned[k].owner.operation
        if add.name != "stablehlo.add" or add.block != body:
            return None
        a, b = add.operands[0], add.operands[1]
        if _block_arg(a, body) == k:
            step = _scalar_int(b)
        elif _block_arg(b, body) == k:
            step = _scalar_int(a)
        else:
            return None
        if step is None or step < 1 or limit + step > _INT_MAX:
            return None
        return max(0, -(-(limit - start) // step))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
