"""What carrying state costs: a stateful Hybrid against the same function carried by hand.

Two models researchers write: a linen MLP with BatchNorm called in train mode (its
``batch_stats`` move on every call) and an nnx MLP with Dropout (its rng count moves). Each is
timed, interleaved and synced per call, as

- ``hybrid``: ``h(x, train=True)``, the state held by the Hybrid;
- ``h.apply``: the Hybrid's compiled pure function, the state passed in and returned by the
  caller (``h.apply_with_state(params, state, x)``): the same program as ``hybrid`` (on CPU a
  Hybrid lowers threefry unrolled), so the two rows differ only by holding the state; the
  ratio column is against it;
- ``by hand``: one ``jax.jit`` of the same pure function, the state carried by the caller, as
  a user writes it without the library (lowered as JAX lowers it by default: on CPU, threefry
  as a rolled ``while`` loop, each step of which costs XLA's CPU runtime tens of µs);
- ``compiled``: that function lowered and compiled once (``jax.jit(f).lower(...).compile()``)
  and the ``jax.stages.Compiled`` called directly, the state carried as by hand: what one call
  of the executable costs from Python, with no wrapper at all;
- ``nnx.jit`` (nnx only): flax's own transform of the stateful module.

Every row of a model runs the very same model, rng implementation included. The nnx Dropout
model is timed twice: with the keys ``nnx.Rngs`` makes by default (threefry) and with
``jax.random.key(1, impl="unsafe_rbg")`` in every row, which draws with XLA's
``RngBitGenerator`` and has no loop at all; it is a setting of the user's model, not of the
Hybrid, and changes the random stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.timing import Progress, Timing, format_seconds, time_interleaved
from symjax_mlp import Hybrid, hybridize


def _carried(step: Callable[..., tuple[Any, Any]], fixed: Any, state: Any, x: jax.Array):
    """``() -> out`` for ``step(fixed, state, x) -> (out, state)``, the state held in a cell."""
    cell = [state]

    def call() -> Any:
        out, cell[0] = step(fixed, cell[0], x)
        return out

    return call


def _carried_apply(h: Hybrid, x: jax.Array, **kw: Any) -> Callable[[], Any]:
    """``() -> out`` of ``h.apply_with_state(h.params, state, x)``, the state carried by the
    caller."""
    cell = [h.state]

    def call() -> Any:
        out, cell[0] = h.apply_with_state(h.params, cell[0], x, **kw)
        return out

    return call


def _by_hand_rows(
    step: Callable[..., tuple[Any, Any]], fixed: Any, state: Any, x: jax.Array
) -> dict[str, Callable[[], Any]]:
    jitted = jax.jit(step)
    return {
        "by hand": _carried(jitted, fixed, state, x),
        "compiled": _carried(jitted.lower(fixed, state, x).compile(), fixed, state, x),
    }


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
    params = {c: v for c, v in variables.items() if c != "batch_stats"}

    def step(params, batch_stats, x):
        out, updates = model.apply(
            {**params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
        )
        return out, updates["batch_stats"]

    hand = _by_hand_rows(step, params, variables["batch_stats"], x)
    applied = _carried_apply(h, x, train=True)
    return {"hybrid": lambda: h(x, train=True), "h.apply": applied, **hand}


def _nnx_rows(x: jax.Array, key_impl: str | None = None) -> dict[str, Any]:
    from flax import nnx

    class DropoutMLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.a = nnx.Linear(x.shape[-1], 256, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.b = nnx.Linear(256, 2, rngs=rngs)

        def __call__(self, x):
            return self.b(self.drop(nnx.relu(self.a(x))))

    def model() -> DropoutMLP:  # a fresh one per row, each from the same seeds and key impl
        dropout = 1 if key_impl is None else jax.random.key(1, impl=key_impl)
        return DropoutMLP(nnx.Rngs(0, dropout=dropout))

    h = hybridize(model())
    graphdef, params, rest = nnx.split(model(), nnx.Param, ...)

    def step(params, rest, x):
        m = nnx.merge(graphdef, params, rest)
        out = m(x)
        return out, nnx.split(m, nnx.Param, ...)[2]

    hand = _by_hand_rows(step, params, rest, x)
    module = model()
    stepped = nnx.jit(lambda m, x: m(x))
    applied = _carried_apply(h, x)
    return {
        "hybrid": lambda: h(x),
        "h.apply": applied,
        **hand,
        "nnx.jit": lambda: stepped(module, x),
    }


_MODELS: dict[str, Callable[[jax.Array], dict[str, Any]]] = {
    "linen BatchNorm (train)": _linen_rows,
    "nnx Dropout": _nnx_rows,
    "nnx Dropout (unsafe_rbg)": lambda x: _nnx_rows(x, key_impl="unsafe_rbg"),
}


def bench_stateful(
    *, calls: int = 500, repeats: int = 7, in_features: int = 512, progress: Progress | None = None
) -> dict[str, dict[str, Timing]]:
    """Times the stateful models at batch 1; see the module docstring for the rows.

    Returns:
      ``{"linen BatchNorm (train)": {row: Timing}, "nnx Dropout": {row: Timing},
      "nnx Dropout (unsafe_rbg)": {row: Timing}}``.

    Example:
      >>> from benchmarks.stateful import bench_stateful
      >>> rows = bench_stateful(calls=5, repeats=2, in_features=8)
      >>> sorted(rows["nnx Dropout"])
      ['by hand', 'compiled', 'h.apply', 'hybrid', 'nnx.jit']
    """
    x = jax.random.normal(jax.random.key(0), (1, in_features), jnp.float32)
    out = {}
    for name, rows in _MODELS.items():
        if progress:
            progress(f"stateful: {name}")
        out[name] = time_interleaved(rows(x), calls=calls, repeats=repeats)
    return out


def format_stateful(result: dict[str, dict[str, Timing]]) -> str:
    """The rows as a table: per call (min, median), the ratio to ``h.apply`` (the same program,
    the state carried by the caller) and, where the model has an ``nnx.jit`` row, how many
    times faster than it each row is."""
    lines = [
        "stateful models at batch 1, every call synced (state carried across calls)",
        f"{'model':<26}{'row':<10}{'min/call':>11}{'median/call':>13}{'vs h.apply':>12}"
        f"{'nnx.jit / row':>15}",
    ]
    for model, rows in result.items():
        floor = rows["h.apply"].per_call_min
        flax_jit = rows.get("nnx.jit")
        for row, t in rows.items():
            ratio = t.per_call_min / floor
            faster = f"{flax_jit.per_call_min / t.per_call_min:>14.2f}x" if flax_jit else ""
            lines.append(
                f"{model:<26}{row:<10}{format_seconds(t.per_call_min):>11}"
                f"{format_seconds(t.per_call_median):>13}{ratio:>11.3f}x{faster}"
            )
    return "\n".join(lines)
