"""What a model computes, measured: its inference logits on a fixed probe, with fixed weights.

A checkpoint records its run's model by its configuration (the linen module's repr, the nnx
graph) and param shapes, which never see the code: two classes named alike, with the same
layers but another ``__call__`` (relu and tanh, a scale, another order), look the same. So the
run also records the model's answer to a fixed question: the inference call (the spec's eval
flags) with every floating-point param and statistic replaced by a fixed pattern of its shape
(so the values the run was initialised with do not matter: the checkpoint's replace them), on
a fixed input of the data's row shape. Resuming compares the answers within a tolerance that
XLA's fusion choices across CPUs and versions stay inside, as the optimizer's fingerprint
already measures what the optimizer does. A checkpoint written before the probe was recorded
has none, and resumes on its other fields.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from symjax_mlp.training._step import ModelVars, apply_model

ROWS = 2  # rows of the probe input
VALUES = 256  # the most logits recorded
TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


def model_probe(model: Any, spec: Any, params: Any, example: np.ndarray) -> list[Any]:
    """The model's logits on the probe, as JSON (floats; ``"nan"``/``"inf"``/``"-inf"``)."""
    stateful = isinstance(params, ModelVars)
    fixed = _fixed(params.params if stateful else params)
    probe_params = ModelVars(fixed, _fixed(params.state, state=True)) if stateful else fixed
    x = _probe_input(example)
    logits = jax.jit(lambda p, x: apply_model(model, spec, p, x, train=False)[0])(probe_params, x)
    flat = np.asarray(logits, np.float64).ravel()[:VALUES]
    return [float(f"{v:.7g}") if math.isfinite(v) else str(v) for v in flat.tolist()]


def probe_difference(recorded: Any, probe: list[Any]) -> str | None:
    """How ``probe`` differs from the ``recorded`` one, or ``None`` if within tolerance."""
    try:
        want = np.array([float(v) for v in recorded], np.float64)
    except (TypeError, ValueError):
        return "the checkpoint's probe is malformed"
    got = np.array([float(v) for v in probe], np.float64)
    if want.shape != got.shape:
        return f"it gave {want.size} logits, this model gives {got.size}"
    if np.allclose(got, want, equal_nan=True, **TOLERANCE):
        return None
    with np.errstate(invalid="ignore"):
        err = np.nanmax(np.where(got == want, 0.0, np.abs(got - want)))
    return f"its logits differ by up to {err:.3g}"


def _fixed(params: Any, *, state: bool = False) -> Any:
    """Every floating-point leaf as a fixed pattern of its shape, about as large as an
    initialiser would make it (1/sqrt(fan-in)); other leaves (rng keys, counts) as they are.
    A ``state`` leaf (BatchNorm's statistics) is positive, between 0.5 and 1.5: a variance
    must be."""
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for i, leaf in enumerate(leaves):
        a = jnp.asarray(leaf)
        if not jnp.issubdtype(a.dtype, jnp.floating):
            out.append(a)
            continue
        fan_in = math.prod(a.shape[:-1]) if a.ndim >= 2 else 1
        pattern = np.cos(np.arange(a.size, dtype=np.float64) * 0.7 + i)
        pattern = pattern / 2 + 1 if state else pattern / math.sqrt(fan_in)
        out.append(jnp.asarray(pattern.reshape(a.shape), a.dtype))
    return jax.tree.unflatten(treedef, out)


def _probe_input(example: np.ndarray) -> np.ndarray:
    shape = (ROWS, *np.shape(example)[1:])
    n = math.prod(shape)
    dtype = np.asarray(example).dtype
    if jnp.issubdtype(dtype, jnp.floating):
        return np.cos(np.arange(n) * 1.3).reshape(shape).astype(dtype)
    return (np.arange(n) % 3).reshape(shape).astype(dtype)
