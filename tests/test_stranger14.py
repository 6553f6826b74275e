"""Round fourteen of a stranger's attacks (session 61): whole, self-consistent inputs on what
sessions 60 and 61 added. A manifest's ``weak_type`` and ``signature.strong``, ``m.apply`` over
params trees JAX cannot flatten or leaves that are no arrays, the notebook's view of an error
and of a hostile artifact, and the compilation cache's check (a relative folder, a link it may
not read). Each way in that got through has a test failing without its fix; each surface that
held keeps one test showing it. The rounds before: test_stranger13.py, ..., test_security.py.
A self-test tolerance of NaN, -1e-3, 1e308, a string or past MAX_TOLERANCE: refused, as
test_selftest_tolerance.py shows (not repeated here)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm

pytest.importorskip("IPython")  # (day five's shell, below)
from helpers import manifest_edited
from helpers import run_cell as run

X = np.ones((2, 3), np.float32)
ONE = np.ones((1, 8), np.float32)


@pytest.fixture(scope="module")
def scalar_art(tmp_path_factory):
    """An artifact of a model over an array and a scalar that changes its dtype (a bfloat16
    weight times np.float32(1.5) answers float32): args[1] is exported ``strong``."""
    h = sm.hybridize(
        lambda p, x, s: (p["w"] * s, x * s), {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)}
    )
    path = tmp_path_factory.mktemp("scalar") / "m"
    return sm.export(h, path, example=(X, np.float32(1.5)), batch=None).path


def _strong(value):
    return lambda m: m["signature"].__setitem__("strong", value)


def _both(*edits):
    return lambda m: [edit(m) for edit in edits]


def _weak(where, i, value):
    def edit(m):
        (m["signature"]["inputs"] if where == "inputs" else m["params"])[i]["weak_type"] = value

    return edit


@pytest.mark.slow  # an export, then eleven manifests read: ~2 s
def test_a_manifests_strong_list_or_weak_type_no_export_writes_is_refused_at_load(
    scalar_art, tmp_path
):
    """``signature.strong`` and an input's ``"weak_type"`` were read as they came: a strong list
    of 10^5 (or 10^6) names loaded and each call scanned it (20 ms a call, not 12 us: a
    thousandfold slower, in silence), one naming inputs that do not exist loaded as if it said
    nothing, a ``"weak_type": "yes"`` or ``1`` was read as strong, one on a param or an array
    input was kept. Each is now refused at load, naming the field, as is a strong list naming
    an input that takes only Python numbers; what an export writes (args[1], arrays too) loads."""
    assert sm.load(scalar_art).signature.strong == ("args[1]",)
    arrays = manifest_edited(scalar_art, tmp_path / "arrays", _strong(["args[0]", "args[1]"]))
    assert sm.load(arrays).signature.strong == ("args[0]", "args[1]")  # as an export may write
    hostile = {
        "strong names no input": _strong(["args[7]"]),
        "strong twice": _strong(["args[1]", "args[1]"]),
        "strong a weak input": _both(_strong(["args[1]"]), _weak("inputs", 1, True)),
        "strong not a string": _strong([1]),
        "strong not a list": _strong("args[1]"),
        "strong 10^5 names": _strong([f"args[{i}]" for i in range(1, 10**5)]),
        "weak a string": _weak("inputs", 1, "yes"),
        "weak a number": _weak("inputs", 1, 1),
        "weak an array input": _weak("inputs", 0, True),
        "weak a param": _weak("params", 0, True),
    }
    for i, (name, edit) in enumerate(hostile.items()):
        art = manifest_edited(scalar_art, tmp_path / str(i), edit)
        with pytest.raises(sm.ArtifactError) as e:
            sm.load(art)
        said = str(e.value)
        field = "params" if "param" in name else "signature.inputs" if name[:4] == "weak" else (
            "signature.strong")  # fmt: skip
        assert f"manifest.json: {field} is " in said and "corrupted or was edited" in said, name


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The chapter's MLP, loaded."""
    net = sm.mlp((4, 2))
    h = sm.hybridize(net, net.init(jax.random.key(0), jnp.asarray(ONE)))
    return sm.load(sm.export(h, tmp_path_factory.mktemp("mlp") / "m", example=ONE).path)


class _Raising:
    """A leaf whose ``__array__`` and ``shape`` are its own code: both raise."""

    dtype = None

    @property
    def shape(self):
        raise KeyError("shape")

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("__array__")


class _Liar:
    """A leaf of the right shape and dtype whose ``__array__`` gives another shape."""

    def __init__(self, w):
        self.shape, self.dtype = w.shape, w.dtype

    def __array__(self, dtype=None, copy=None):
        return np.zeros((3,), np.float32)


class _JaxArray(_Liar):
    def __jax_array__(self):
        raise ValueError("__jax_array__")


@pytest.mark.slow  # an export and its load: ~1 s
def test_m_apply_refuses_params_jax_cannot_flatten_and_leaves_that_are_no_arrays(model):
    """``m.apply(params, x)`` leaked JAX's ValueError ("Comparator raised exception while
    sorting pytree dictionary keys") for a dict of int and str keys, a KeyError or a TypeError
    ('NoneType' object is not iterable) from a leaf's own ``shape``, and for a leaf whose shape
    and dtype are right but that is no array, an ArtifactError blaming the artifact ("running
    the program ... failed"). Each is a SignatureError naming params and what to pass. What
    held: 10^5 leaves and a NumPy object array are refused, a registered tree whose flatten
    raises raises its own error, as jax.jit does."""
    own, x = model.params, ONE
    first = next(iter(own))
    refused = {
        "several types": {**own, 1: np.ones(3)},
        "its own shape raises": {**own, first: _Raising()},
        "no array": {k: _Liar(w) for k, w in own.items()},
        "__jax_array__": {k: _JaxArray(w) for k, w in own.items()},
        "10^5 leaves": {f"k{i}": np.float32(i) for i in range(10**5)},
        "object arrays": {k: np.asarray(w).astype(object) for k, w in own.items()},
    }
    for name, params in refused.items():
        with pytest.raises(sm.SignatureError) as e:
            model.apply(params, x)
        said = str(e.value)
        assert said.startswith(f'symjax_mlp.load("{model.path}").apply(params, ...): params'), said
        if name == "several types":
            assert "keys are of several types (int, str)" in said, said
        if name in ("its own shape raises", "no array", "__jax_array__"):
            assert "not an array. Pass NumPy or JAX arrays" in said, said

    @jax.tree_util.register_pytree_node_class
    class Tree:
        def tree_flatten(self):
            raise RuntimeError("the user's flatten")

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls()

    with pytest.raises(RuntimeError, match="the user's flatten"):
        model.apply({**own, "t": Tree()}, x)
    np.testing.assert_array_equal(model.apply(own, x), model(x))  # still answers


# one process (a regression breaks its interpreter, not pytest's): m.apply over params that
# hold themselves, then over its own
_CYCLES = """
import sys
import numpy as np, symjax_mlp as sm
m, x = sm.load(sys.argv[1]), np.ones((1, 8), np.float32)
cyclic = dict(m.params)
cyclic["self"] = cyclic
for params in (cyclic, [cyclic], {"a": (cyclic,)}, {"a": m.params, "b": m.params}):
    try:
        m.apply(params, x)
    except sm.SignatureError as e:
        print(str(e).split(": ", 1)[1][:60])
print(bool((np.asarray(m.apply(m.params, x)) == np.asarray(m(x))).all()))
"""


@pytest.mark.slow  # a fresh process: ~4 s
def test_m_apply_refuses_params_that_contain_themselves_leaving_the_process_working(model):
    """A params dict that contains itself: JAX's flatten recursed until nanobind raised a
    SystemError, and the interpreter was left broken (every later call in the process raised
    RecursionError, pytest's own report included). Now refused before JAX flattens it; a tree
    holding one dict twice is no cycle (refused as any tree not of m.params' paths); the
    model answers after."""
    r = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _CYCLES, str(model.path)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    said = r.stdout.splitlines()
    assert said[:3] == ["params holds a dict that contains itself, which JAX cannot f"] * 3, said
    assert said[3].startswith("params must be a dict by the names of m.params"), said
    assert said[4:] == ["True"], said


DEEP = """
def deep(n):
    e = None
    for i in range(n):
        try:
            raise ValueError(i) from e
        except ValueError as x:
            e = x
    return e

raise sm.ConfigError("top") from deep(600)
"""


@pytest.mark.slow  # an IPython shell showing 600 tracebacks: ~2-7 s
def test_a_symjax_error_raised_from_a_chain_thousands_long_shows_in_a_notebook(shell):
    """A SymjaxError raised from a model's error whose own causes are 3,000 deep (a model that
    raises anything; here 600 under a limit of 500, as fast): our IPython hook walked the chain
    by recursion, hit Python's limit, and the notebook showed "Unexpected exception formatting
    exception" and a RecursionError's traceback through IPython's internals, where a ValueError
    of that chain shows as IPython shows any. Now the chain is walked in a loop: every link
    shown, the error last."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(500)  # (Python's 1,000, reached by a shorter chain: a faster test)
    try:
        error, shown = run(shell, DEEP)
    finally:
        sys.setrecursionlimit(limit)
    assert isinstance(error, sm.ConfigError)
    assert "Unexpected exception formatting" not in shown and "RecursionError" not in shown
    assert shown.count("The above exception was the direct cause") == 600
    assert shown.rstrip().endswith("ConfigError: top"), shown[-300:]


@pytest.mark.slow  # an export, a load and an IPython shell: ~2 s
def test_a_hostile_artifact_shows_one_clean_line_in_a_notebook(shell, model, tmp_path):
    """What held: an artifact named with terminal escapes (clear the screen, set the window's
    title, a right-to-left override) and a 10 MB model card of them: repr of the Artifact and
    LoadedModel, as a notebook shows a cell ending in one, are one line with no escape;
    ``str(inspect(...))`` shows the name escaped and is a few kB, not 10 MB."""
    escapes = "\x1b[2J\x1b]0;pwned\x07\u202e"

    def hostile(m):
        m["name"] = escapes + "model"
        m["metadata"] = {"card" + escapes: escapes * 1000, "big": "x" * (10 << 20)}

    art = manifest_edited(model.path, tmp_path / "hostile", hostile)
    shell.user_ns["where"] = str(art)
    for cell in ("sm.inspect(where)", "sm.load(where)", "print(sm.inspect(where))"):
        error, shown = run(shell, cell)
        assert error is None, shown
        assert not {"\x1b", "\x07", "\u202e"} & set(shown), (cell, shown[:300])
        assert len(shown) < 10_000, (cell, len(shown))
    assert "\\x1b[2J" in shown  # the name, escaped


# one process: the cache at a relative folder checked in argv[1], then a new call from argv[2]
_CHDIR = """
import os, sys
import numpy as np, jax, jax.numpy as jnp, symjax_mlp as sm
os.chdir(sys.argv[1])
m = sm.load(sys.argv[3])
m(np.ones((3, 8), np.float32))
h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.ones(8)})
h(np.ones((2, 8), np.float32))
os.chdir(sys.argv[2])
m(np.ones((5, 8), np.float32))  # a new shape: a new program compiled
h(np.ones((7, 8), np.float32))
print(jax.config.jax_compilation_cache_dir)
"""


@pytest.mark.slow  # a fresh process: ~5 s
def test_a_relative_cache_folder_is_the_one_checked_after_a_chdir(model, tmp_path):
    """JAX_COMPILATION_CACHE_DIR=jax_cache, a relative folder: checked once from the working
    directory of the first compilation (one's own, private), while JAX opens it again from each
    later working directory. After os.chdir into a folder where ``jax_cache`` is others' to
    write, a loaded model's new shape and a Hybrid's new trace wrote (and would read) their
    executables there, in silence. The folder checked is now the one JAX keeps: the absolute
    path of the first check."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    (mine / "jax_cache").mkdir(parents=True, mode=0o700)
    (theirs / "jax_cache").mkdir(parents=True)
    os.chmod(theirs / "jax_cache", 0o777)
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": "jax_cache"}
    env |= {
        "JAX_ENABLE_COMPILATION_CACHE": "true",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    r = subprocess.run(
        [sys.executable, "-c", _CHDIR, str(mine), str(theirs), str(model.path)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == str(mine / "jax_cache")
    assert os.listdir(mine / "jax_cache") and not os.listdir(theirs / "jax_cache")


_FOLDERS = """
import sys
import numpy as np, jax, symjax_mlp as sm
for folder in sys.argv[2:]:
    jax.config.update("jax_compilation_cache_dir", folder)
    try:
        print(sm.load(sys.argv[1])(np.ones((2, 8), np.float32)).shape)
    except sm.ConfigError as e:
        print("refused:", str(e).splitlines()[0])
"""


@pytest.mark.slow  # a fresh process: ~4 s
def test_a_cache_folder_through_a_link_one_may_not_read_is_refused_not_raised(model, tmp_path):
    """A cache folder below /proc/1/root (a link that only root may read, and not every root
    in a container): the check's realpath raised PermissionError out of load, a traceback
    through os.path. Now a ConfigError saying the folder cannot be checked (where the link
    reads, the folder is checked as any). What held: a FIFO or a file where the folder is, and
    a path through /proc/self/cwd or with "..": checked, the model answers (JAX warns that it
    cannot use a file as its cache)."""
    fifo, file = tmp_path / "fifo", tmp_path / "file"
    os.mkfifo(fifo)
    file.write_bytes(b"")
    folders = [f"/proc/1/root{tmp_path}/a", str(fifo), str(file)]
    folders += [f"/proc/self/cwd/{tmp_path.name}_b", f"{tmp_path}/x/../c"]
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "true"}
    r = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _FOLDERS, str(model.path), *folders],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path.parent,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    said = r.stdout.splitlines()
    assert len(said) == len(folders), r.stdout
    assert said[0] == "(2, 2)" or (
        said[0].startswith("refused: load(") and "cannot be checked" in said[0]
    ), said[0]
    assert said[1:] == ["(2, 2)"] * 4, said
