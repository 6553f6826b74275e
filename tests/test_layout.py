"""The package layout is the flow: each module imports only from the stages before it.

Read from the code (every ``import`` statement, lazy ones inside functions included), not
from a list someone keeps in sync by hand: a cycle or a backward edge fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import symjax_mlp as sm

ROOT = Path(sm.__file__).parent
SCRIPTS = ROOT.parent / "scripts"

# The flow, first stage first. A module belongs to the longest prefix that names it; inside a
# stage that is a package (training, serving, ...), imports must only be acyclic.
STAGES = (
    "symjax_mlp._compat",
    "symjax_mlp._errors",
    "symjax_mlp._cache",
    "symjax_mlp._export_example",
    "symjax_mlp._specs",
    "symjax_mlp._reader",
    "symjax_mlp._files",
    "symjax_mlp._npy",
    "symjax_mlp._models",
    "symjax_mlp._hybrid.settings",
    "symjax_mlp._hybrid.args",
    "symjax_mlp._hybrid.params",
    "symjax_mlp._hybrid.trace",
    "symjax_mlp._hybrid.numbers",
    "symjax_mlp._hybrid.pure",
    "symjax_mlp._hybrid.mesh",
    "symjax_mlp._hybrid.jaxpr",
    "symjax_mlp._hybrid.graph",
    "symjax_mlp._hybrid.effects",
    "symjax_mlp._hybrid.traced",
    "symjax_mlp._hybrid.staged",
    "symjax_mlp._hybrid.hybrid",
    "symjax_mlp._hybrid.make",
    "symjax_mlp._hybrid",
    "symjax_mlp._artifact.jaxconfig",
    "symjax_mlp._artifact.format",
    "symjax_mlp._artifact.signature",
    "symjax_mlp._artifact.weights",
    "symjax_mlp._artifact.ops",
    "symjax_mlp._artifact.cost",
    "symjax_mlp._artifact.walk",
    "symjax_mlp._artifact.rows",
    "symjax_mlp._artifact.checker",
    "symjax_mlp._artifact.module",
    "symjax_mlp._artifact.reading",
    "symjax_mlp._artifact",
    "symjax_mlp._signing",
    "symjax_mlp._selftest",
    "symjax_mlp._export_options",
    "symjax_mlp._export_batch",
    "symjax_mlp._export_gather",
    "symjax_mlp._export_entry",
    "symjax_mlp._export",
    "symjax_mlp._runtimes",
    "symjax_mlp._loaded",
    "symjax_mlp._load",
    "symjax_mlp._verify",
    "symjax_mlp.serving",
    "symjax_mlp._timeit",
    "symjax_mlp.training",
    "symjax_mlp.chapter",
    "symjax_mlp",
    "symjax_mlp.cli",
    "symjax_mlp.__main__",
)
PUBLIC_NAMESPACES = (
    "symjax_mlp",
    "symjax_mlp.serving",
    "symjax_mlp.training",
    "symjax_mlp.chapter",
)


def _modules() -> dict[str, Path]:
    mods = {}
    for file in ROOT.rglob("*.py"):
        parts = list(file.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = file
    return mods


def _imports(name: str, file: Path, known: set[str]) -> set[str]:
    """The symjax_mlp modules ``file`` imports (``from a import b`` counts a.b if a module)."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            found |= subs if len(subs) == len(node.names) else {base, *subs}
    return {m for m in found if m in known and m != name}


def _stage(module: str) -> int:
    best = max((s for s in STAGES if module == s or module.startswith(s + ".")), key=len)
    return STAGES.index(best)


GRAPH = {name: _imports(name, file, set(_modules())) for name, file in _modules().items()}


def test_every_module_has_a_stage():
    for module in GRAPH:
        assert _stage(module) >= 0, module


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_only_from_earlier_stages(module):
    backward = [m for m in GRAPH[module] if _stage(m) > _stage(module)]
    assert not backward, f"{module} imports from later stages: {backward}"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 2:
            return
        assert state.get(m) != 1, "import cycle: " + " -> ".join([*path, m])
        state[m] = 1
        for dep in sorted(GRAPH[m]):
            visit(dep, [*path, m])
        state[m] = 2

    for m in sorted(GRAPH):
        visit(m, [])


def test_private_modules_have_no_all_and_public_ones_do():
    for module, file in _modules().items():
        tree = ast.parse(file.read_text())
        has_all = any(
            isinstance(n, ast.Assign)
            and any(getattr(t, "id", None) == "__all__" for t in n.targets)
            for n in tree.body
        )
        private = any(p.startswith("_") and not p.startswith("__") for p in module.split("."))
        if private:
            assert not has_all, f"{module} is private but declares __all__"
        elif module in PUBLIC_NAMESPACES:
            assert has_all, f"{module} is public but declares no __all__"


def test_nothing_imports_the_cli():
    users = [m for m, deps in GRAPH.items() if any(d.startswith("symjax_mlp.cli") for d in deps)]
    assert all(m.startswith(("symjax_mlp.cli", "symjax_mlp.__main__")) for m in users), users


def test_the_checker_sees_a_backward_edge():
    # the staged forms import the graph (an earlier stage): the reverse edge would be refused
    assert "symjax_mlp._hybrid.graph" in GRAPH["symjax_mlp._hybrid.staged"]
    assert _stage("symjax_mlp._hybrid.graph") < _stage("symjax_mlp._hybrid.staged")
    assert _stage("symjax_mlp._load") > _stage("symjax_mlp._export")


# -- the laboratory: scripts/ is a consumer of the public API, and not part of the package --
def _symjax_imports(file: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every symjax_mlp import in ``file``, lazy ones included; a
    ``from symjax_mlp import _x`` counts as ``symjax_mlp._x``."""
    found = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(n, m) for n, m in found if m == "symjax_mlp" or m.startswith("symjax_mlp.")]


def _private(module: str) -> bool:
    return any(p.startswith("_") for p in module.split(".")[1:])


def test_the_laboratory_uses_only_the_public_api():
    files = sorted(SCRIPTS.rglob("*.py"))
    assert len(files) >= 10, "scripts/benchmarks is the laboratory"
    private = [
        f"{f.relative_to(SCRIPTS)}:{line}: {m}"
        for f in files
        for line, m in _symjax_imports(f)
        if _private(m)
    ]
    assert not private, "the laboratory imports library internals:\n" + "\n".join(private)


def test_the_public_api_check_sees_a_private_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import symjax_mlp as sm\nfrom symjax_mlp.serving import Batcher\n"
        "def f():\n    from symjax_mlp._hybrid.make import hybridize\n"
        "    import symjax_mlp._models\n    from symjax_mlp import _errors\n"
    )
    assert [m for _, m in _symjax_imports(probe) if _private(m)] == [
        "symjax_mlp._hybrid.make",
        "symjax_mlp._hybrid.make.hybridize",
        "symjax_mlp._models",
        "symjax_mlp._errors",
    ]


def test_laboratory_modules_reach_into_no_other_modules_privates():
    """One concept a module: what another module of the lab uses has a public name."""
    reaches = []
    for f in sorted((SCRIPTS / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
                reaches += [f"{f.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not reaches, reaches


def test_the_package_is_the_library():
    assert not (ROOT / "bench").exists(), "the benchmark lives in scripts/benchmarks"
    with pytest.raises(ModuleNotFoundError):
        __import__("symjax_mlp.bench")
    heavy = {"torch", "matplotlib"}
    users = []
    for file in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            users += [f"{file.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in heavy]
    assert not users, f"the library never imports torch or matplotlib: {users}"


def test_no_module_is_two_concepts():
    """A module past ~400 lines is two concepts (STYLE.md): split it by concept."""
    long = {name: n for name, file in _modules().items()
            if (n := len(file.read_text().splitlines())) > 400}  # fmt: skip
    assert not long, long


# -- no module reaches into another's privates: what it uses of another object has a public name --
#: ``name._attr`` kept, by file: each an object of the module's own class (or JAX's, in _compat)
REACHES_KEPT = {
    "_compat.py": {"*"},  # JAX's and concurrent.futures' internals: what that module holds
    "_hybrid/hybrid.py": {"twin._log", "twin._set"},  # replace()'s, snapshot()'s own Hybrid
    "_hybrid/staged.py": {"twin._log"},  # refresh()'s own Hybrid (Staged is Hybrid's base)
    "_hybrid/trace.py": {"earlier._events", "earlier._held", "earlier._running"},  # a TraceLog
    "_hybrid/args.py": {"other._key"},  # _Frozen.__eq__ against another _Frozen
}


def _reaches(source: str) -> list[str]:
    """Each ``name._attr`` (one underscore) of ``source`` where ``name`` is neither self/cls nor
    an imported module (``os._exit``; a class is no module): ``line: name._attr``, by line."""
    tree = ast.parse(source)
    imported = {"self", "cls"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            imported |= {(a.asname or a.name).partition(".")[0] for a in node.names}
    imported = {name for name in imported if not name[:1].isupper()}
    return sorted([
        f"{node.lineno}: {node.value.id}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.attr.startswith("_") and not node.attr.startswith("__")
        and node.value.id not in imported
    ], key=lambda r: int(r.partition(":")[0]))  # fmt: skip


def test_no_module_reaches_into_another_objects_privates():
    reaches = []
    for file in sorted(ROOT.rglob("*.py")):
        kept = REACHES_KEPT.get(file.relative_to(ROOT).as_posix(), set())
        found = [r for r in _reaches(file.read_text()) if r.partition(" ")[2] not in kept]
        reaches += [f"{file.relative_to(ROOT)}:{r}" for r in found if "*" not in kept]
    assert not reaches, "give what another module uses a public name:\n" + "\n".join(reaches)


def test_the_reach_check_sees_a_reach():
    probe = "import os\nfrom a import B, c\ndef f(h, self):\n    os._exit(c._d(self._e, h._f))\n"
    assert _reaches(probe + "    B._g(h)\n") == ["4: h._f", "5: B._g"]


# -- no module rewrites another's message: the heading (or fix) is passed in, the text written once
#: the functions whose rewrites of an exception's text are kept, by file: each a third party's
#: text, or the user's, never a message of this library's
REWRITES_KEPT = {
    # the user's own argv (a path with a newline) escaped as the terminal shows it: its words kept
    "cli/__init__.py": {"main"},
    # MLIR's file:line locations and JAX's "Module shape refinement failed: " dropped from JAX's
    "_runtimes/transforms.py": {"_unresolved"},
    # the user's model's error, as an HTTP client may see it: paths, addresses and NULs scrubbed
    "serving/_app.py": {"text"},
}
_REWRITES = {"replace", "removeprefix", "removesuffix", "sub", "subn"}
_CALLS = re.compile(r"\.(replace|removeprefix|removesuffix|subn?)\(")
_EXCEPTION = re.compile(r"\b(BaseException|Exception|\w+Error)\b")


def _rewrites(source: str) -> list[str]:
    """Each ``x.replace/removeprefix/removesuffix(...)`` or ``pattern.sub(..., x)`` of an
    exception's text: ``x`` holds an ``except ... as e`` name, a parameter annotated as an
    exception, or a name assigned from one (``said = str(e)``): ``line: function: x.method``."""
    found: dict[tuple[int, str], str] = {}
    every = list(ast.walk(ast.parse(source)))  # outer scopes first: a call's own is the last
    handlers = [n for n in every if isinstance(n, ast.ExceptHandler) and n.name]
    defs = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    for scope in every:
        if isinstance(scope, ast.Module):  # its own code, not its functions' (each walked)
            nodes = [n for t in scope.body if not isinstance(t, defs) for n in ast.walk(t)]
            held = {n.name for n in nodes if isinstance(n, ast.ExceptHandler) and n.name}
        elif isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            span = range(scope.lineno, (scope.end_lineno or scope.lineno) + 1)
            held = {h.name for h in handlers if h.lineno in span}
            params = scope.args.args + scope.args.kwonlyargs
            held |= {
                a.arg
                for a in params
                if a.annotation and _EXCEPTION.search(ast.unparse(a.annotation))
            }
            nodes = list(ast.walk(scope)) if held else []
        else:
            continue
        for _ in range(3):  # said = str(e); text = said[:300]: the text travels
            for n in nodes:
                value = getattr(n, "value", None)
                if isinstance(n, ast.Assign | ast.AnnAssign | ast.NamedExpr) and _holds(
                    value, held
                ):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    held |= {t.id for t in targets if isinstance(t, ast.Name)}
        for n in nodes:
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in _REWRITES
            ):
                subject = [n.func.value, *(n.args if n.func.attr in ("sub", "subn") else ())]
                if any(_holds(a, held) for a in subject):
                    found[n.lineno, ast.unparse(n.func)] = getattr(scope, "name", "<module>")
    return [f"{line}: {scope}: {call}" for (line, call), scope in sorted(found.items())]


def _holds(node: ast.AST | None, names: set[str]) -> bool:
    return node is not None and any(
        isinstance(n, ast.Name) and n.id in names for n in ast.walk(node)
    )


def test_no_module_rewrites_an_exceptions_message():
    """A module that rewrote another's message (str(e).removeprefix("serve: "), str(e).replace(
    "symjax_mlp.mlp(", ...)) broke when that message changed, and said what it did not write:
    the heading, or the fix, is passed in (ops.normalize_allow(allow, call))."""
    rewrites = []
    for file in sorted(ROOT.rglob("*.py")):
        if not _CALLS.search(text := file.read_text()):  # no such call: nothing to parse
            continue
        kept = REWRITES_KEPT.get(file.relative_to(ROOT).as_posix(), set())
        found = [r for r in _rewrites(text) if r.split(": ")[1] not in kept]
        rewrites += [f"{file.relative_to(ROOT)}:{r}" for r in found]
    assert not rewrites, "pass the heading in; never rewrite a message:\n" + "\n".join(rewrites)


def test_the_rewrite_check_sees_a_rewrite():
    probe = (
        "import re, dataclasses\ndef f(x, e: ValueError):\n    try:\n        g()\n"
        "    except OSError as err:\n        said = str(err)[:200]\n"
        "        said.replace('a', 'b')\n        str(err).removeprefix('serve: ')\n"
        "        dataclasses.replace(x, a=1)\n        re.sub('a', '', f'{e}')\n"
        "        x.replace('a', 'b')\n        def g(m):\n            return said.strip()\n"
    )
    assert _rewrites(probe) == [
        "7: f: said.replace",
        "8: f: str(err).removeprefix",
        "10: f: re.sub",
    ]


def test_importing_the_package_imports_no_jax():
    """`import symjax_mlp` (and the CLI's module) import neither JAX nor NumPy: the CLI imports
    them where a Ctrl-C is handled, and each public name is imported on first use."""
    import subprocess
    import sys

    probe = (
        "import sys, symjax_mlp, symjax_mlp.cli; print(sorted({'jax', 'numpy'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    assert sm.load.__module__ == "symjax_mlp._load"  # and the names still resolve
