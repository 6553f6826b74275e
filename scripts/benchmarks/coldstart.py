"""Cold start: a fresh process that imports symjax_mlp, loads an artifact and calls it once.

Each row runs in its own fresh Python process, twice in a row: the first run fills JAX's
persistent compilation cache and symjax_mlp's per-user caches (directories given to the
child, empty at first), the second reuses them. Stages are timed apart: ``import``,
``load`` (manifest, checksums, deserialize, self-test) and the ``first call``. The floor is
the same for plain JAX: ``import jax`` and one jitted call of a tiny function, with the same
cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from symjax_mlp import export, hybridize, mlp

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import numpy as np
if sys.argv[1] == "jax":
    t1 = time.perf_counter()
    f = jax.jit(lambda x: x * 2 + 1)
    t2 = time.perf_counter()
    f(np.ones((1, 512), np.float32)).block_until_ready()
else:
    import symjax_mlp as sm
    t1 = time.perf_counter()
    m = sm.load(sys.argv[1])
    t2 = time.perf_counter()
    m(np.ones((1, 512), np.float32)).block_until_ready()
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "first call": t3 - t2, "total": t3 - t0}))
"""


def _child(target: str, cache: Path) -> dict[str, float]:
    env = dict(  # symjax_mlp's own per-user caches (the op check's reports) start empty too
        os.environ,
        JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
        XDG_CACHE_HOME=str(cache / "xdg"),
    )
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, target, str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"cold-start child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_coldstart(*, repeats: int = 3, sizes: tuple[int, ...] = (256, 128, 2)) -> dict[str, Any]:
    """Fresh-process cold starts of the chapter MLP's artifact against plain JAX.

    Returns:
      ``{"rows": {name: {"first": stages, "second": [stages, ...]}}, "ratio": float}``;
      ``ratio`` is the median second-run total of symjax_mlp over plain JAX's.

    Example:
      >>> from benchmarks.coldstart import bench_coldstart
      >>> r = bench_coldstart(repeats=1, sizes=(4, 2))
      >>> sorted(r["rows"]), r["ratio"] > 0
      (['import jax + one jit call', 'symjax_mlp: import, load, first call'], True)
    """
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        net, x = mlp(tuple(sizes)), jnp.zeros((1, 512), jnp.float32)
        h = hybridize(net, net.init(jax.random.key(0), x))
        art = export(h, Path(tmp) / "m", example=x)
        targets = {
            "symjax_mlp: import, load, first call": str(art.path),
            "import jax + one jit call": "jax",
        }
        caches = {name: Path(tmp) / f"cache-{i}" for i, name in enumerate(targets)}
        for name, target in targets.items():
            rows[name] = {"first": _child(target, caches[name]), "second": []}
        for _ in range(repeats):  # interleaved, so load from elsewhere lands on both
            for name, target in targets.items():
                rows[name]["second"].append(_child(target, caches[name]))
    med = {
        k: sorted(r["total"] for r in v["second"])[len(v["second"]) // 2] for k, v in rows.items()
    }
    names = list(rows)
    return {"rows": rows, "ratio": med[names[0]] / med[names[1]]}


def format_coldstart(result: dict[str, Any]) -> str:
    """The cold starts as a table: stages of the first run and the median later run."""
    lines = [
        "cold start in a fresh process (persistent compilation cache: first run fills it)",
        f"{'row':<40}{'run':<8}{'import':>9}{'load':>9}{'1st call':>10}{'total':>9}",
    ]
    for name, r in result["rows"].items():
        second = sorted(r["second"], key=lambda s: s["total"])[len(r["second"]) // 2]
        for run, s in (("first", r["first"]), ("later", second)):
            lines.append(
                f"{name:<40}{run:<8}{s['import']:>8.3f}s{s['load']:>8.3f}s"
                f"{s['first call']:>9.3f}s{s['total']:>8.3f}s"
            )
    lines.append(f"later runs: symjax_mlp / plain JAX = {result['ratio']:.3f}x (target <= 1.25)")
    return "\n".join(lines)
