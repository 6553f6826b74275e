"""Throughput of sharded inference and training against the number of devices.

On fewer real devices than asked, and on the CPU, the rows run in a subprocess with virtual
CPU devices: those share the host's cores, so they show correctness (every count gives the
1-device result), not scaling.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.children import run_json
from symjax_mlp import ConfigError, data_mesh, hybridize, mlp
from symjax_mlp.training import shard_step, train_step

CPU_NOTE = (
    "CPU virtual devices share this machine's cores: these rows show correctness (each device "
    "count gives the 1-device result), not how it scales. Run on a multi-GPU/TPU host for scaling."
)


def _counts(n: int) -> list[int]:
    return sorted({2**i for i in range(int(math.log2(n)) + 1)} | {n})


def bench_here(n_devices, sizes, in_features, batch, repeats, train_steps, seed) -> dict:
    """:func:`bench_devices` on the devices this process sees (the subprocess's side)."""
    net, optimizer = mlp(tuple(sizes)), optax.sgd(1e-2)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, in_features), np.float32)
    y = rng.integers(0, sizes[-1], batch).astype(np.int32)
    variables = jax.device_get(jax.jit(net.init)(jax.random.key(seed), x[:1]))
    h, step = hybridize(net, variables), train_step(net, optimizer)
    rows, ref = [], None
    for k in _counts(n_devices):
        mesh = data_mesh(k)
        s = h.shard(mesh)
        xs = jax.device_put(
            x, NamedSharding(s.mesh, P(s.axis))
        )  # time the program, not the host-to-device copy
        t0 = time.perf_counter()
        out = jax.block_until_ready(s(xs))
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = s(xs)
        jax.block_until_ready(out)
        infer = repeats * batch / (time.perf_counter() - t0)
        ds = shard_step(step, mesh)
        params, data = variables["params"], ds.shard_batch(x, y)
        params, state, _ = ds(
            params, jax.jit(optimizer.init)(params), *data
        )  # compile + first step
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        for _ in range(train_steps):
            params, state, _ = ds(params, state, *data)
        jax.block_until_ready(params)
        trained = train_steps * batch / (time.perf_counter() - t0)
        got = (np.asarray(out), [np.asarray(a) for a in jax.tree.leaves(params)])
        ref = got if ref is None else ref
        rows.append(
            {
                "devices": k,
                "inference_examples_per_s": infer,
                "train_examples_per_s": trained,
                "inference_speedup": infer / rows[0]["inference_examples_per_s"] if rows else 1.0,
                "compile_seconds": compile_s,
                "max_abs_diff": float(np.max(np.abs(got[0] - ref[0]))),
                "params_max_abs_diff": max(
                    float(np.max(np.abs(a - b))) for a, b in zip(got[1], ref[1], strict=True)
                ),
            }
        )
    for row in rows:
        row["matches_1_device"] = row["max_abs_diff"] <= 1e-5 and row["params_max_abs_diff"] <= 1e-5
    backend = jax.default_backend()
    return {
        "backend": backend,
        "device_kind": jax.devices()[0].device_kind,
        "n_devices": n_devices,
        "virtual_cpu_devices": backend == "cpu",
        "note": CPU_NOTE if backend == "cpu" else "real devices: rows show data-parallel scaling",
        "batch": batch,
        "sizes": list(sizes),
        "in_features": in_features,
        "repeats": repeats,
        "train_steps": train_steps,
        "rows": rows,
    }


_CHILD = (
    "import json, sys; from benchmarks.devices import bench_here; "
    "print(json.dumps(bench_here(**json.loads(sys.argv[1]))))"
)


def bench_devices(
    n_devices: int,
    *,
    sizes: Sequence[int] = (256, 128, 2),
    in_features: int = 512,
    batch: int = 4096,
    repeats: int = 20,
    train_steps: int = 10,
    seed: int = 0,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Throughput of sharded inference and training on 1, 2, 4, ... ``n_devices`` devices.

    Each count gets a :func:`~symjax_mlp.data_mesh` of that many devices; the global
    ``batch`` is fixed (strong scaling) and every row is checked against the 1-device row.
    When fewer than ``n_devices`` devices are visible and JAX runs on the CPU, the benchmark
    runs in a fresh
    subprocess with ``n_devices`` virtual CPU devices; those share the host's cores, so the
    rows show correctness, not scaling (``result["note"]`` says so).

    Returns:
      A dict: ``backend``, ``device_kind``, ``n_devices``, ``virtual_cpu_devices``, ``note``,
      ``batch``, ``sizes``, ``in_features``, ``repeats``, ``train_steps``, ``in_subprocess``
      and ``rows``, one per device count, with ``devices``, ``inference_examples_per_s``,
      ``train_examples_per_s``, ``inference_speedup``, ``compile_seconds``,
      ``max_abs_diff``, ``params_max_abs_diff`` and ``matches_1_device``.

    Raises:
      ValueError: ``n_devices < 1``, or more accelerators are asked for than are visible.
      RuntimeError: the subprocess failed (its stderr is in the message).
    """
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ConfigError(f"bench_devices: n_devices must be an int >= 1; got {n_devices!r}.")
    kwargs = {
        "n_devices": n_devices,
        "sizes": list(sizes),
        "in_features": in_features,
        "batch": batch,
        "repeats": repeats,
        "train_steps": train_steps,
        "seed": seed,
    }
    if n_devices <= jax.device_count():
        return {**bench_here(**kwargs), "in_subprocess": False}
    if jax.default_backend() != "cpu":
        raise ConfigError(
            f"bench_devices({n_devices}): only {jax.device_count()} {jax.default_backend()} "
            f"device(s) are visible. Ask for at most {jax.device_count()}."
        )
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n_devices))
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "force_host_platform_device_count" not in f)
    what = f"bench_devices({n_devices}): the {n_devices}-device subprocess"
    return {**run_json(_CHILD, kwargs, env, timeout, what), "in_subprocess": True}
