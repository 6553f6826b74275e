"""Serving's timer and subject: synced calls timed one at a time, and the chapter's net.

Every section of :func:`benchmarks.serving.bench_serving` times requests one by one (a
request's latency is the figure, not a mean over a loop) and summarises them the same way
(:func:`percentiles`, :func:`summary`); concurrent clients start together behind a barrier
(:func:`gated`); :func:`chapter_net` builds the net they serve, its params as a trained
model's (:func:`trained`), in the subprocess that times it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


# -- timing one call at a time ---------------------------------------------------------------
def percentiles(samples: Sequence[float]) -> dict[str, float]:
    a = np.asarray(samples, np.float64)
    return {
        "p50_s": float(np.percentile(a, 50)),
        "p90_s": float(np.percentile(a, 90)),
        "p99_s": float(np.percentile(a, 99)),
        "mean_s": float(a.mean()),
        "n": len(a),
    }


def per_call(fn: Callable[[], Any], calls: int, repeats: int, warmup: int = 200) -> dict:
    """Times ``calls * repeats`` synced calls one by one: percentiles, and the fastest
    repeat's mean."""
    for _ in range(warmup):
        fn()
    samples = [one_round(fn, calls) for _ in range(repeats)]
    return summary(samples)


def one_round(fn: Callable[[], Any], calls: int) -> list[float]:
    """``calls`` synced calls, each timed on its own (seconds)."""
    clock = time.perf_counter
    samples = np.empty(calls)
    for i in range(calls):
        t0 = clock()
        fn()
        samples[i] = clock() - t0
    return samples.tolist()


def summary(rounds: Sequence[Sequence[float]]) -> dict:
    """Percentiles over every round's calls, and the fastest round's mean."""
    means = [float(np.mean(r)) for r in rounds]
    return {**percentiles([x for r in rounds for x in r]), "best_repeat_mean_s": min(means)}


def gated(client: Callable[[int], None], c: int, gate: threading.Barrier) -> float:
    """Runs ``client(j)`` on ``c`` threads that all wait at ``gate`` (a barrier of ``c + 1``,
    this thread included) before they start: the seconds from the gate to the last's end."""
    threads = [threading.Thread(target=client, args=(j,)) for j in range(c)]
    for t in threads:
        t.start()
    gate.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def chapter_net(
    sizes: Sequence[int], in_features: int, activation: str | None, seed: int
) -> tuple[Any, Any, np.ndarray]:
    """``(h, variables, x)``: the chapter's MLP hybridized, its variables as a trained model
    has them (:func:`trained`), and a batch-1 input, all from ``seed`` (the same in every
    process)."""
    import symjax_mlp as sm

    net, variables, xn = chapter_init(sizes, in_features, activation, seed)
    variables = trained(net, variables, xn, seed)
    return sm.hybridize(net, variables, name="mlp"), variables, xn


def chapter_init(
    sizes: Sequence[int], in_features: int, activation: str | None, seed: int
) -> tuple[Any, Any, np.ndarray]:
    """``(net, variables, x)``: the chapter's MLP, its variables at init (every bias zero)
    and a batch-1 input, from ``seed``."""
    import jax

    import symjax_mlp as sm

    net = sm.mlp(tuple(sizes), activation=activation)
    rng = np.random.default_rng(seed)
    xn = rng.standard_normal((1, in_features), dtype=np.float32)
    return net, jax.jit(net.init)(jax.random.key(seed), xn), xn


def trained(net: Any, variables: Any, x: np.ndarray, seed: int) -> Any:
    """``variables`` after one Adam step (lr 1e-3) on a regression batch shaped as ``x``, drawn
    from ``seed``: every bias non-zero, as a trained model's. At init a Dense's bias is all
    zeros, which XLA folds out of a program that holds the params as constants (no add), never
    out of one that takes them as arguments: a floor measured at init is not the program a
    user serves."""
    import jax
    import jax.numpy as jnp
    import optax

    rng = np.random.default_rng(seed + 1)
    xb = rng.standard_normal((64, *x.shape[1:]), dtype=np.float32)
    yb = rng.standard_normal(jax.eval_shape(net.apply, variables, xb).shape, dtype=np.float32)
    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(v: Any) -> Any:
        grads = jax.grad(lambda v: jnp.mean((net.apply(v, xb) - yb) ** 2))(v)
        updates, _ = optimizer.update(grads, optimizer.init(v), v)
        return optax.apply_updates(v, updates)

    return step(variables)
