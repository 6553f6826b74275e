"""The property examples of ``tests/test_properties.py``: strategies, model builder, one part.

``test_properties.py`` runs part 0 in process and the other parts as processes of this file,
never collected by pytest::

    python tests/workers/properties_worker.py PART DIRECTORY   # prints what the part covered

Hypothesis draws the model (depth 1-6, widths 1-300 with small widths most likely, any
activation of ``sm.ACTIVATIONS`` or none per layer, sometimes a ``HybridConcurrent`` block of
2-3 branches), the batch (1-64) and the dtype (float32 or bfloat16, params included). Each part
has a fixed seed and no example database, so CI sees the same examples every time.

Two Hypothesis settings profiles, chosen by ``SYMJAX_PROPERTY_PROFILE``: ``ci`` (the default:
16 drawn examples, plus two written ones that between them use every activation and none, which
16 draws would not all reach) and ``long`` (1000 drawn, the release run);
``SYMJAX_PROPERTY_EXAMPLES=N`` sets the count of either.
"""

import collections
import json
import math
import os
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

import symjax_mlp as sm

# Registered, never loaded: other Hypothesis tests in the same process keep their defaults.
# ``ci`` is sized so that the suite stays under 10 minutes on 2 cores.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=16, deadline=None, database=None, suppress_health_check=_QUIET
)
settings.register_profile("long", settings.get_profile("ci"), max_examples=1000)
PROFILE = settings.get_profile(os.environ.get("SYMJAX_PROPERTY_PROFILE", "ci"))
EXAMPLES = int(os.environ.get("SYMJAX_PROPERTY_EXAMPLES", PROFILE.max_examples))  # drawn ones
PARTS = 2  # processes the examples are split over (CI has two cores)
# (eager vs compiled, loaded vs compiled): rtol, and atol as a fraction of max(1, max|y|).
TOL = {"float32": ((2e-5, 2e-5), (1e-6, 1e-6)), "bfloat16": ((6e-2, 6e-2), (1e-2, 1e-2))}

# Cheap examples dominate: each compiles its ops eagerly (once per new shape), then the whole
# program twice (hybridized, loaded), so small and recurring shapes keep the run short, while
# every width in 1-300, depth in 1-6 and batch in 1-64 stays reachable.
WIDTHS = st.one_of(st.sampled_from((1, 3, 8)), st.integers(1, 300))
DEPTHS = st.one_of(st.just(1), st.just(2), st.integers(1, 6))
BATCHES = st.one_of(st.sampled_from((1, 5)), st.integers(1, 64))
ACTIVATION = st.sampled_from((*sm.ACTIVATIONS, None))


@st.composite
def specs(draw):
    layers = [("dense", draw(WIDTHS), draw(ACTIVATION)) for _ in range(draw(DEPTHS))]
    if draw(st.sampled_from(range(5))) == 0:  # a fifth of the models: a HybridConcurrent block
        branch = st.lists(st.tuples(WIDTHS, ACTIVATION), min_size=1, max_size=2)
        block = ("concurrent", draw(st.lists(branch, min_size=2, max_size=3)))
        layers.insert(draw(st.integers(0, len(layers))), block)
    return {
        "layers": layers,
        "features": draw(WIDTHS),
        "batch": draw(BATCHES),
        "dtype": draw(st.sampled_from(["float32", "bfloat16"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _every_activation() -> list[dict]:
    """Two written examples (one float32, one bfloat16) that between them use every activation
    and none, each in a depth-6 model with a ``HybridConcurrent`` block of three branches."""
    acts = [*sm.ACTIVATIONS, None]
    written = []
    for i, dtype in enumerate(("float32", "bfloat16")):
        a = acts[i * 11 : (i + 1) * 11]
        layers = [("dense", w, act) for w, act in zip((8, 3, 130, 1, 8), a[:5], strict=True)]
        branches = [[(3, a[5]), (8, a[6])], [(1, a[7]), (8, a[8])], [(3, a[9]), (2, a[10])]]
        layers.insert(2, ("concurrent", branches))
        written.append({"layers": layers, "features": 8, "batch": 5, "dtype": dtype, "seed": i})
    return written


EVERY_ACTIVATION = _every_activation()


def build(spec):
    """The model, and its params drawn with NumPy (no init program to compile), ~1/sqrt(fan_in)
    so that every layer's outputs stay O(1)."""
    dtype = jnp.dtype(spec["dtype"])
    rng = np.random.default_rng(spec["seed"])

    def dense(width, act, fan_in):
        kernel = rng.normal(0, 1 / math.sqrt(fan_in), (fan_in, width))
        bias = rng.normal(0, 0.1, (width,))
        params = {"kernel": jnp.asarray(kernel, dtype), "bias": jnp.asarray(bias, dtype)}
        return sm.Dense(width, activation=act, dtype=dtype, param_dtype=dtype), params, width

    def sequential(layers, fan_in):
        modules, params = [], {}
        for i, layer in enumerate(layers):
            if layer[0] == "dense":
                module, p, fan_in = dense(*layer[1:], fan_in)
            else:
                branches = [sequential([("dense", *d) for d in b], fan_in) for b in layer[1]]
                module = sm.HybridConcurrent(tuple(b[0] for b in branches))
                p = {f"branches_{j}": b[1] for j, b in enumerate(branches)}
                fan_in = sum(b[2] for b in branches)
            modules.append(module)
            params[f"layers_{i}"] = p
        return sm.HybridSequential(tuple(modules)), params, fan_in

    net, params, _ = sequential(spec["layers"], spec["features"])
    x = rng.standard_normal((spec["batch"], spec["features"]))
    return net, {"params": params}, jnp.asarray(x, dtype)


def close(got, want, tol, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    rtol, atol = tol
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale, err_msg=what)


def run(part: int, path: Path) -> collections.Counter:
    """Runs part ``part`` of the examples (its own fixed seed); returns what they covered."""
    seen: collections.Counter = collections.Counter()

    @settings(PROFILE, max_examples=EXAMPLES // PARTS)
    @seed(part)  # reproducible: the same examples in every run
    @given(spec=specs())
    def check(spec):
        net, params, x = build(spec)
        h = sm.hybridize(net, params)
        eager, compiled = h.eager(x), h(x)
        sm.export(h, path, example=x, overwrite=True)  # one directory, replaced each time
        loaded = sm.load(path)(x)
        assert eager.dtype == compiled.dtype == loaded.dtype == x.dtype
        assert h.trace_count == 1
        eager_tol, loaded_tol = TOL[spec["dtype"]]
        close(compiled, eager, eager_tol, f"compiled vs eager: {spec}")
        close(loaded, compiled, loaded_tol, f"loaded vs compiled: {spec}")
        seen["examples"] += 1
        seen[spec["dtype"]] += 1
        seen["concurrent"] += any(layer[0] == "concurrent" for layer in spec["layers"])
        for layer in spec["layers"]:
            dense = [layer[1:]] if layer[0] == "dense" else [d for b in layer[1] for d in b]
            for width, act in dense:
                seen[f"act:{act}"] += 1
                seen["wide"] += width > 100

    for written in EVERY_ACTIVATION[part::PARTS]:  # run first, as Hypothesis runs @example
        check = example(spec=written)(check)
    check()
    return seen


if __name__ == "__main__":  # one part, in another process
    print(json.dumps(run(int(sys.argv[1]), Path(sys.argv[2]))))
