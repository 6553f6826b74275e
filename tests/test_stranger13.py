"""Round thirteen of a stranger's attacks (session 61): whole, self-consistent inputs on surfaces
no round reached. Here JAX's persistent compilation cache (``jax_compilation_cache_dir``,
JAX_COMPILATION_CACHE_DIR): an entry is a serialized executable, native code that XLA runs as
the program whose cache key names it. Each way in that got through has a test failing without
its fix; each surface that held keeps one test showing it. The rounds before:
test_stranger12.py, test_stranger11.py, ..., test_security.py, test_checker_limits.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm

X = np.ones((1, 8), np.float32)
X3 = np.ones((3, 8), np.float32)

# one process of JAX with the cache at argv[2]: load argv[1], call it on (3, 8) ones; prints the
# answer and which cache entries the call wrote (a new signature: the program JAX compiles)
_RUN = """
import json, os, sys
import numpy as np, symjax_mlp as sm
folder, seen = sys.argv[2], set(os.listdir(sys.argv[2]))
m = sm.load(sys.argv[1])
before = set(os.listdir(folder))
y = np.asarray(m(np.ones((3, 8), np.float32)))
print(json.dumps({"y": y.tolist(), "new": sorted(set(os.listdir(folder)) - before)}))
"""


def _artifacts(tmp_path):
    """The victim (the chapter's ReLU MLP) and the stranger's program of the same signature
    (the same layers, no ReLU): two artifacts, and the victim's true answer."""
    out = {}
    for name, activation in (("victim", "relu"), ("stranger", None)):
        net = sm.mlp((4, 2), activation=activation)
        h = sm.hybridize(net, net.init(jax.random.key(0), jnp.asarray(X)))
        out[name] = sm.export(h, tmp_path / name, example=X).path
        out[name + "_y"] = np.asarray(h(X3))
    return out


def _run(art, cache, **env):
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), **env}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "true"  # (CI runs the slow tests with it off)
    r = subprocess.run(
        [sys.executable, "-c", _RUN, str(art), str(cache)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    return r, (json.loads(r.stdout.splitlines()[-1]) if r.returncode == 0 else None)


@pytest.mark.slow  # five fresh processes (~20 s)
def test_a_compilation_cache_others_may_write_is_never_read(tmp_path):
    """JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache, a folder every user may write (as /tmp
    guides suggest): a stranger who ran the victim's public artifact under the same JAX knows
    the cache key of its program, and puts there the executable of a program of their own with
    the same signature. ``load`` checked the artifact (hash, ops, self-test on its own
    vectors) and then ran the stranger's native code as the model: a silent wrong answer for
    every new input shape. It is refused at load now, naming the folder and what to do."""
    made = _artifacts(tmp_path)
    cache = tmp_path / "jax_cache"
    cache.mkdir(mode=0o700)
    keys = {}
    for name in ("stranger", "victim"):  # the stranger learns both keys under the same path
        r, got = _run(made[name], cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        assert got is not None, r.stderr[-2000:]
        np.testing.assert_allclose(got["y"], made[name + "_y"], rtol=1e-5)
        (keys[name],) = [k for k in got["new"] if k.startswith("jit_call")]
    assert not np.allclose(made["victim_y"], made["stranger_y"])  # the plant would show
    (cache / keys["victim"]).write_bytes((cache / keys["stranger"]).read_bytes())
    cache.chmod(0o777)  # the folder anyone may write, where that entry was put

    r, got = _run(made["victim"], cache)
    assert got is None, f"the planted executable ran as the model: {got}"
    assert "ConfigError" in r.stderr and "jax_compilation_cache_dir" in r.stderr, r.stderr[-2000:]
    assert f"others may write in {cache} (mode 777)" in r.stderr
    assert "JAX_COMPILATION_CACHE_DIR" in r.stderr.splitlines()[-1]  # what to do

    shared = tmp_path / "shared"  # a private cache inside a folder others may write: swappable
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (shared / "cache").mkdir(mode=0o700)
    r, got = _run(made["victim"], shared / "cache")
    assert got is None and f"others may write in {shared} (mode 777)" in r.stderr, r.stderr


@pytest.mark.slow  # two fresh processes (~8 s)
@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_a_damaged_entry_in_ones_own_cache_is_compiled_again(tmp_path, damage):
    """Held: an entry cut short (a writer killed, another process writing it) or bytes that are
    no executable, in one's own private cache: JAX warns and compiles again, no crash, the
    model's own answer."""
    made = _artifacts(tmp_path)
    cache = tmp_path / "jax_cache"
    cache.mkdir(mode=0o700)
    r, got = _run(made["victim"], cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert got is not None, r.stderr[-2000:]
    for entry in cache.glob("jit_*-cache"):
        raw = entry.read_bytes()
        if damage == "truncated":
            entry.write_bytes(raw[: len(raw) // 2])
        else:  # a well-formed zlib stream and time header over random bytes
            exe = np.random.default_rng(0).bytes(len(zlib.decompress(raw)) - 4)
            entry.write_bytes(zlib.compress(zlib.decompress(raw)[:4] + exe))
    r, got = _run(made["victim"], cache)
    assert got is not None, r.stderr[-2000:]
    np.testing.assert_allclose(got["y"], made["victim_y"], rtol=1e-5)
    assert "Error reading persistent compilation cache entry" in r.stderr


@pytest.mark.slow  # an export (~0.6 s)
def test_a_private_cache_below_a_sticky_folder_such_as_tmp_loads(tmp_path):
    """Held (no false alarm): a cache folder of one's own (0700, made by load if missing) in a
    folder every user may write but not rename in (sticky, as /tmp); while one others may write
    is refused in this process too. (JAX settles whether it uses a cache at the process's first
    compilation, so here the folder is only checked, never read.)"""
    net = sm.mlp((2,))
    h = sm.hybridize(net, net.init(jax.random.key(0), jnp.asarray(X)))
    art = sm.export(h, tmp_path / "m", example=X).path
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    jax.block_until_ready(jax.jit(lambda v: v + 1)(1.0))  # JAX's choice is made: no cache here
    old = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    try:
        jax.config.update("jax_enable_compilation_cache", True)  # (CI's slow run turns it off)
        jax.config.update("jax_compilation_cache_dir", str(sticky / "jax_cache"))
        assert sm.load(art)(X).shape == (1, 2)
        assert oct((sticky / "jax_cache").stat().st_mode & 0o777) == oct(0o700)
        (sticky / "jax_cache").chmod(0o707)
        with pytest.raises(sm.ConfigError, match=r"others may write in .*jax_cache \(mode 707\)"):
            sm.load(art)
    finally:
        jax.config.update("jax_compilation_cache_dir", old[0])
        jax.config.update("jax_enable_compilation_cache", old[1])
