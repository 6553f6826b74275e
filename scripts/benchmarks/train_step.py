"""The training step timed compiled (jit, donated) against eager, in steps per second."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from symjax_mlp import ConfigError, mlp
from symjax_mlp.training import Step, init_params, train_step


def time_train_step(
    *,
    sizes: tuple[int, ...] = (128, 64, 10),
    in_features: int = 64,
    batch_size: int = 64,
    steps: int = 200,
    eager_steps: int = 20,
    optimizer: optax.GradientTransformation | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Measures the training step compiled (jit, donated) and eager, in steps per second.

    Both run :func:`train_step` on the same synthetic batch. The compiled step's first call
    (trace + compile + run) is timed separately as ``compile_seconds``; each path runs two
    warm-up steps, then ``steps`` (``eager_steps``) timed ones, ending on a
    ``block_until_ready``.

    Returns:
      A dict: ``compiled_steps_per_s``, ``eager_steps_per_s``, ``speedup`` (their ratio),
      ``compile_seconds``, ``steps``, ``eager_steps``, ``batch_size``, ``in_features``,
      ``sizes``, ``backend`` and ``device``.

    Example:
      >>> from benchmarks.train_step import time_train_step
      >>> r = time_train_step(steps=5, eager_steps=2)
      >>> r["speedup"] > 0
      True
    """
    if steps < 1 or eager_steps < 1:
        raise ConfigError(f"steps and eager_steps must be >= 1; got {steps}, {eager_steps}.")
    model = mlp(tuple(sizes))
    optimizer = optax.adam(1e-3) if optimizer is None else optimizer
    kx, ky, kp = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (batch_size, in_features), jnp.float32)
    y = jax.random.randint(ky, (batch_size,), 0, sizes[-1], jnp.int32)
    w = jnp.ones(batch_size, jnp.float32)
    step = train_step(model, optimizer)

    def run(fn: Step, n: int) -> tuple[float, float]:
        params = init_params(model, kp, x)
        opt_state = optimizer.init(params)
        t0 = time.perf_counter()
        params, opt_state, _ = fn(params, opt_state, x, y, w)
        jax.block_until_ready(params)
        first = time.perf_counter() - t0
        for _ in range(2):
            params, opt_state, _ = fn(params, opt_state, x, y, w)
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        for _ in range(n):
            params, opt_state, _ = fn(params, opt_state, x, y, w)
        jax.block_until_ready(params)
        return n / (time.perf_counter() - t0), first

    compiled_rate, compile_seconds = run(jax.jit(step, donate_argnums=(0, 1)), steps)
    eager_rate, _ = run(step, eager_steps)
    return {
        "compiled_steps_per_s": compiled_rate,
        "eager_steps_per_s": eager_rate,
        "speedup": compiled_rate / eager_rate,
        "compile_seconds": compile_seconds,
        "steps": steps,
        "eager_steps": eager_steps,
        "batch_size": batch_size,
        "in_features": in_features,
        "sizes": list(sizes),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
    }


def _train_processes(processes: int, epochs: int, every: int, workdir: str) -> dict[str, Any]:
    """``symjax-mlp train`` in ``processes`` processes on loopback; process 0's ``--json``."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = os.path.join(workdir, "run.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "symjax_mlp",
                "train",
                "--quiet",
                "--epochs",
                str(epochs),
                "--checkpoint",
                os.path.join(workdir, f"ck{epochs}"),
                "--checkpoint-every",
                str(every),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                str(processes),
                "--process-id",
                str(i),
                "--json",
                out,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a training process failed:\n" + "\n---\n".join(errors))
    with open(out) as f:
        return json.load(f)


def time_checkpoint_wait(
    *, processes: int = 2, epochs: int = 40, checkpoint_every: int = 2
) -> dict[str, Any]:
    """How long a multi-process run's asynchronous Orbax saves hold up its steps.

    Runs ``symjax-mlp train`` (the digits MLP) in ``processes`` processes, saving every
    ``checkpoint_every`` epochs, and reads each save's wait (``TrainResult.checkpoint_waits``:
    what the training thread spends in it, i.e. one device copy (an array per dtype) and the
    hand-off to the writer thread, which unpacks the copy and runs the metadata's optimizer
    probe). Orbax's commit runs beside the steps, and a save made while one commits is
    superseded, not waited for: a save waits only when the writer thread is two saves behind
    (back-pressure from Orbax's blocking part: its barriers and host copies). A save's own work
    is a copy's dispatch and a hand-off; on a machine whose ``load`` passes its ``cpus``, a
    wait also holds the time the thread was ready but the OS ran other work (a few ms, at any
    moment of a step as in a save).

    Returns:
      A dict: ``first_save_ms`` (Orbax's start-up and the copy's compile included),
      ``save_ms`` (the median of the later saves: the wait when the writer keeps up),
      ``step_ms`` (the median epoch after the first, per step, its evaluation included),
      ``save_min_ms`` and ``save_max_ms`` (the later saves' spread; the max is the
      back-pressure wait, if any), ``save_over_step`` and ``save_max_over_step`` (the median's
      and the max's share of a step; target <= 0.10 for both), ``saves``, ``processes``,
      ``epochs``, ``checkpoint_every``, ``cpus`` and ``load`` (the 1-minute load average as
      the run ended).
    """
    import os
    import statistics
    import tempfile

    with tempfile.TemporaryDirectory() as workdir:
        run = _train_processes(processes, epochs, checkpoint_every, workdir)
    waits, history = run["checkpoint_waits"], run["history"]
    step_ms = 1e3 * statistics.median(r["seconds"] for r in history[1:]) / history[0]["step"]
    save_ms, save_max_ms = 1e3 * statistics.median(waits[1:]), 1e3 * max(waits[1:])
    return {
        "first_save_ms": 1e3 * waits[0],
        "save_ms": save_ms,
        "save_min_ms": 1e3 * min(waits[1:]),
        "save_max_ms": save_max_ms,
        "step_ms": step_ms,
        "save_over_step": save_ms / step_ms,
        "save_max_over_step": save_max_ms / step_ms,
        "saves": len(waits),
        "superseded": len(run["checkpoints_superseded"]),
        "processes": processes,
        "epochs": epochs,
        "checkpoint_every": checkpoint_every,
        "cpus": os.cpu_count(),
        "load": os.getloadavg()[0],
    }
