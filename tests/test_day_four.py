"""A researcher's day four (session 60, Part F): research with the artifacts.

The models of days one to three, exported and loaded, used as a JAX user uses any function,
without reading the library's code: an ensemble of loaded models, per-example gradients,
``jax.jit`` / ``lax.scan`` / ``jax.checkpoint`` / ``jax.eval_shape`` around a loaded model and a
Hybrid together, a bfloat16 copy of the weights exported, the graph drawn for a paper, calls
profiled.

Each cheap test is a stumble of that walk: it failed before its fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each export and load: about a second on 2 cores


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """An artifact of a small MLP, its input, and other weights for it."""
    net, x = sm.mlp((8, 2)), jnp.ones((3, 4))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    path = tmp_path_factory.mktemp("day4") / "a"
    sm.export(h, path, example=x, batch="b")
    return path, x, jax.tree.map(lambda p: p + 1, h.params)


@pytest.mark.parametrize("transform", ["vmap", "grad", "jit"])
def test_load_of_traced_params_says_what_to_do(art, transform):
    """An ensemble as a JAX user writes it, jax.vmap(lambda p: sm.load(path, params=p)(x))
    over stacked weights (or jax.grad over them, to fine-tune an artifact whose source is
    lost), raised JAX's TracerArrayConversionError from load's NumPy copy of the weights: it
    named neither load nor that a loaded model's weights are fixed, nor the ensemble that
    works."""
    path, x, other = art
    m = sm.load(path)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), dict(m.params), dict(m.params))
    run = lambda p: sm.load(path, params=p)(x).sum()  # noqa: E731
    f = {"vmap": jax.vmap(run), "grad": jax.grad(run), "jit": jax.jit(run)}[transform]
    with pytest.raises(sm.ConfigError, match=r"params/layers_0/bias \(float32\[.*is traced"):
        f(stacked if transform == "vmap" else dict(m.params))
    # what the message says instead works, and is the ensemble
    models = [sm.load(path, params=p) for p in (dict(m.params), other)]
    out = jnp.stack([model(x) for model in models])
    assert jnp.array_equal(out[0], m(x))
    assert not jnp.array_equal(out[1], out[0])
