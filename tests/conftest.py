"""Test setup, done once: 8 virtual CPU devices, so sharding runs in process; and one JAX
persistent compilation cache for the run.

``jax_num_cpu_devices`` must be set before JAX starts its CPU backend, which is why it is set
here, at import, before any test touches a device. The suite compiles the same small programs
in many tests and in the processes it starts (CLI, workers, servers); a compilation cache in a
fresh directory per run, inherited by those processes through the environment, compiles each
once (about a fifth of the suite's time). It starts empty, so no run sees another's entries.
Fixtures live in ``helpers.py``. ``scripts/`` goes on ``sys.path``, so that the laboratory's
tests import it (``import benchmarks``) as ``python scripts/bench.py`` does.
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

_CACHE = tempfile.mkdtemp(prefix="symjax-test-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
if jax.config.jax_compilation_cache_dir is None:  # JAX was imported before this file ran
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from helpers import chapter  # noqa: E402, F401  (a fixture, shared by every test module)
