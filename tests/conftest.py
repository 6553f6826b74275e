"""Test setup, done once: 8 virtual CPU devices, so sharding runs in process; one JAX
persistent compilation cache for the run; XLA's LLVM back end at -O0 (compiles faster).

``jax_num_cpu_devices`` must be set before JAX starts its CPU backend, which is why it is set
here, at import, before any test touches a device. The suite compiles the same small programs
in many tests and in the processes it starts (CLI, workers, servers); a compilation cache in a
fresh directory per run, inherited by those processes through the environment, compiles each
once (about a fifth of the suite's time). It starts empty, so no run sees another's entries;
so does the library's own cache (``$XDG_CACHE_HOME``): the suite never writes the user's.
Fixtures live in ``helpers.py``. ``scripts/`` goes on ``sys.path``, so that the laboratory's
tests import it (``import benchmarks``) as ``python scripts/bench.py`` does.
"""

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

_CACHE = tempfile.mkdtemp(prefix="symjax-test-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
_XDG = tempfile.mkdtemp(prefix="symjax-test-xdg-cache-")
atexit.register(shutil.rmtree, _XDG, ignore_errors=True)
os.environ.setdefault("SYMJAX_TEST_XDG_CACHE_HOME", _XDG)  # the run's one, in every worker
os.environ["XDG_CACHE_HOME"] = os.environ["SYMJAX_TEST_XDG_CACHE_HOME"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite's time is mostly XLA compiling small programs: with LLVM at -O0 the suite takes
# about a fifth less CPU (measured: 1,101 -> 900 s), and with XLA's older loop emitter for
# fusions in place of its MLIR fusion emitters about as much again (the matrix's eager and
# grads features, two runs each: 108 -> 61 and 114 -> 63 CPU-s; one small jit 31 -> 22 ms to
# compile). The HLO XLA optimizes is the same; results agree to round-off (the kernels differ),
# and a test comparing bitwise compares runs made under the same flags (the processes a test
# starts inherit them). The README runs as a reader runs it (tests/test_readme.py), and
# scripts/bench.py, run by a user, compiles as users do.
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
if jax.config.jax_compilation_cache_dir is None:  # JAX was imported before this file ran
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402
from helpers import chapter, shell  # noqa: E402, F401  (fixtures, shared by every test module)


def _jax_config():
    """JAX's settings as this thread sees them (a ``with`` block's value included)."""
    return {name: repr(getattr(jax.config, name, None)) for name in jax.config.values}


_SETTINGS = _jax_config()  # as this file left them, before any test module is imported
_INITIAL = dict(jax.config.values)


def _changed(since):
    now = _jax_config()
    return {name: (was, now.get(name)) for name, was in since.items() if now.get(name) != was}


def _put_back(changed, values):
    from jax._src.config import config_ext  # the "no value in this thread" of a with block

    holders = getattr(jax.config, "_value_holders", {})
    for name in changed:
        with contextlib.suppress(Exception):  # a flag JAX refuses to change once started
            jax.config.update(name, values[name])
        with contextlib.suppress(Exception):  # a with block entered and never exited: its
            holders[name].set_local(config_ext.unset)  # value is this thread's, not global


def pytest_collection_finish(session):
    """A test module that imports, at its top, a library setting JAX's config at import
    changes every later test in that process (CI, sessions 62-63: dynamax's matmul precision
    changed the bytes test_day_six exports): refused here, naming the flags."""
    if changed := _changed(_SETTINGS):
        raise pytest.UsageError(
            f"importing the test modules changed jax.config: {changed} (was, now). Import that "
            "library inside a fixture that puts the setting back."
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its fixtures torn down), JAX's config is as it was: a test
    or a library it imported that leaves a flag changed fails here, naming the flag, and the
    flag is put back, so no later test in this worker runs under it."""
    yield
    if nextitem is not None and getattr(nextitem, "module", 0) is getattr(item, "module", 1):
        return
    if changed := _changed(_SETTINGS):
        _put_back(changed, _INITIAL)
        raise AssertionError(
            f"{item.module.__name__ if hasattr(item, 'module') else item.nodeid} left "
            f"jax.config changed: {changed} (was, now). Put each back when the test or its "
            "fixture ends (a library that sets one at import: import it in such a fixture)."
        )


# Keras reads KERAS_BACKEND when it is first imported, and without it imports TensorFlow: the
# zoo's Keras modules are imported only by test_authors_round30.py, under its own setting, never
# by --doctest-modules' collection (they hold no doctest). zoo33b imports dynamax, whose import
# sets JAX's matmul precision for the whole process: only test_authors_round33.py's fixture
# imports it, and puts the setting back (collected, it changed every test in every worker).
collect_ignore_glob = ["zoo30*.py", "zoo33b.py"]
