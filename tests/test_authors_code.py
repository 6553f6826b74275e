"""JAX code as its authors write it: NumPy float64 params (issue 33, item 4)."""

import json

import jax.numpy as jnp
import numpy as np
import numpy.random as npr
import safetensors.numpy
from jax.scipy.special import logsumexp

import symjax_mlp as sm


# -- JAX's examples/mnist_classifier_fromscratch.py, as written there ---------------------------
def init_random_params(scale, layer_sizes, rng=npr.RandomState(0)):  # noqa: B008 (JAX's code)
    return [
        (scale * rng.randn(m, n), scale * rng.randn(n))
        for m, n in zip(layer_sizes[:-1], layer_sizes[1:])  # noqa: B905, RUF007
    ]


def mnist_predict(params, inputs):
    activations = inputs
    for w, b in params[:-1]:
        outputs = jnp.dot(activations, w) + b
        activations = jnp.tanh(outputs)

    final_w, final_b = params[-1]
    logits = jnp.dot(activations, final_w) + final_b
    return logits - logsumexp(logits, axis=1, keepdims=True)


# -- 4. float64 params export an artifact that loads ---------------------------------------------
def test_float64_numpy_params_export_an_artifact_that_loads(tmp_path):
    h = sm.hybridize(lambda p, x: x @ p, np.ones((3, 2)))
    x = np.ones((4, 3))  # float64 too: the artifact takes what JAX traced, float32
    art = sm.export(h, tmp_path / "m", example=x)
    m = sm.load(art.path)
    np.testing.assert_array_equal(m(x.astype(np.float32)), h(x))
    manifest = json.loads((art.path / "manifest.json").read_text())
    assert [p["dtype"] for p in manifest["params"]] == ["float32"]
    assert [s["dtype"] for s in manifest["signature"]["inputs"]] == ["float32"]
    stored = safetensors.numpy.load_file(art.path / "params.safetensors")
    assert {k: v.dtype for k, v in stored.items()} == {"params": np.float32}


def test_mnist_from_scratch_params_export_load_and_run_as_jax_does(tmp_path):
    params = init_random_params(0.1, [784, 32, 10])
    images = npr.RandomState(1).rand(8, 784).astype(np.float32)
    h = sm.hybridize(mnist_predict, params)
    art = sm.export(h, tmp_path / "mnist", example=images)
    m = sm.load(art.path)
    np.testing.assert_allclose(m(images), mnist_predict(params, images), rtol=1e-5, atol=1e-5)
    assert {str(a.dtype) for a in m.params.values()} == {"float32"}
    assert sorted(m.params) == ["0/0", "0/1", "1/0", "1/1"]


def test_int64_numpy_params_are_stored_as_traced(tmp_path):
    h = sm.hybridize(lambda p, x: x * p["scale"] + p["shift"], {"scale": np.arange(3), "shift": 1})
    x = np.ones((2, 3), np.int32)
    art = sm.export(h, tmp_path / "m", example=x)
    m = sm.load(art.path)
    np.testing.assert_array_equal(m(x), h(x))
    assert {k: str(a.dtype) for k, a in m.params.items()} == {"scale": "int32", "shift": "int32"}
