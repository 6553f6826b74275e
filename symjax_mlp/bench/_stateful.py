"""What carrying state costs: a stateful Hybrid against the same function jitted by hand.

Two models researchers write: a linen MLP with BatchNorm called in train mode (its
``batch_stats`` move on every call) and an nnx MLP with Dropout (its rng count moves). Each is
timed, interleaved and synced per call, as

- ``hybrid``: ``h(x, train=True)``, the state held by the Hybrid;
- ``by hand``: one ``jax.jit`` of the same pure function, the state passed in and returned
  by the caller: the floor a Hybrid's bookkeeping is measured against;
- ``nnx.jit`` (nnx only): flax's own transform of the stateful module.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from symjax_mlp._hybrid.hybrid import hybridize
from symjax_mlp.bench._timing import Progress, Timing, format_seconds, time_interleaved


def _linen_rows(x: jax.Array) -> dict[str, Any]:
    import flax.linen as nn

    class BatchNormMLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.Dense(256)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
            return nn.Dense(2)(nn.Dense(128)(x))

    model = BatchNormMLP()
    variables = model.init(jax.random.key(0), x)
    h = hybridize(model, variables)
    state = {"v": variables}

    @jax.jit
    def by_hand(variables, x):
        out, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
        return out, {**variables, **updates}

    def hand() -> Any:
        out, state["v"] = by_hand(state["v"], x)
        return out

    return {"hybrid": lambda: h(x, train=True), "by hand": hand}


def _nnx_rows(x: jax.Array) -> dict[str, Any]:
    from flax import nnx

    class DropoutMLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.a = nnx.Linear(x.shape[-1], 256, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.b = nnx.Linear(256, 2, rngs=rngs)

        def __call__(self, x):
            return self.b(self.drop(nnx.relu(self.a(x))))

    h = hybridize(DropoutMLP(nnx.Rngs(0, dropout=1)))
    graphdef, params, rest = nnx.split(DropoutMLP(nnx.Rngs(0, dropout=1)), nnx.Param, ...)
    held = {"rest": rest}

    @jax.jit
    def by_hand(params, rest, x):
        m = nnx.merge(graphdef, params, rest)
        out = m(x)
        return out, nnx.split(m, nnx.Param, ...)[2]

    def hand() -> Any:
        out, held["rest"] = by_hand(params, held["rest"], x)
        return out

    module = DropoutMLP(nnx.Rngs(0, dropout=1))
    stepped = nnx.jit(lambda m, x: m(x))
    return {"hybrid": lambda: h(x), "by hand": hand, "nnx.jit": lambda: stepped(module, x)}


def bench_stateful(
    *, calls: int = 500, repeats: int = 7, in_features: int = 512, progress: Progress | None = None
) -> dict[str, dict[str, Timing]]:
    """Times both stateful models at batch 1; see the module docstring for the rows.

    Returns:
      ``{"linen BatchNorm (train)": {row: Timing}, "nnx Dropout": {row: Timing}}``.

    Example:
      >>> from symjax_mlp.bench import bench_stateful
      >>> rows = bench_stateful(calls=5, repeats=2, in_features=8)
      >>> sorted(rows["nnx Dropout"])
      ['by hand', 'hybrid', 'nnx.jit']
    """
    x = jax.random.normal(jax.random.key(0), (1, in_features), jnp.float32)
    out = {}
    for name, rows in (("linen BatchNorm (train)", _linen_rows), ("nnx Dropout", _nnx_rows)):
        if progress:
            progress(f"stateful: {name}")
        out[name] = time_interleaved(rows(x), calls=calls, repeats=repeats)
    return out


def format_stateful(result: dict[str, dict[str, Timing]]) -> str:
    """The rows as a table: per call (min, median) and the ratio to the by-hand floor."""
    lines = [
        "stateful models at batch 1, every call synced (state carried across calls)",
        f"{'model':<26}{'row':<10}{'min/call':>11}{'median/call':>13}{'vs by hand':>12}",
    ]
    for model, rows in result.items():
        floor = rows["by hand"].per_call_min
        for row, t in rows.items():
            ratio = t.per_call_min / floor
            lines.append(
                f"{model:<26}{row:<10}{format_seconds(t.per_call_min):>11}"
                f"{format_seconds(t.per_call_median):>13}{ratio:>11.3f}x"
            )
    return "\n".join(lines)
