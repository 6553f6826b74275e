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
    named neither load nor what to transform instead."""
    path, x, _ = art
    m = sm.load(path)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), dict(m.params))
    run = lambda p: sm.load(path, params=p)(x).sum()  # noqa: E731
    f = {"vmap": jax.vmap(run), "grad": jax.grad(run), "jit": jax.jit(run)}[transform]
    with pytest.raises(sm.ConfigError, match=r"params/layers_0/bias \(float32\[.*m\.apply"):
        f(stacked if transform == "vmap" else dict(m.params))


def test_an_ensemble_of_loaded_weights_under_vmap_of_m_apply(art):
    """A loaded model had no function of its weights: an ensemble of artifacts of one
    architecture (other seeds, other fine-tunings) could only loop over loaded models.
    ``m.apply(params, x)`` is the program over other weights; under jax.vmap over stacked
    weights each set runs as its own (the program's vmap rule kept the first set only, as it
    did for the copies lax.cond makes: every member gave the first one's answer)."""
    path, x, other = art
    m, mo = sm.load(path), sm.load(path, params=other)
    assert jnp.array_equal(m.apply(m.params, x), m(x))
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), dict(m.params), dict(mo.params))
    out = jax.jit(jax.vmap(m.apply, in_axes=(0, None)))(stacked, x)
    assert jnp.allclose(out[0], m(x)) and jnp.allclose(out[1], mo(x))
    assert not jnp.allclose(out[0], out[1])
    with pytest.raises(sm.SignatureError, match=r"params\['params/layers_0/bias'\] is bfloat16"):
        m.apply(jax.tree.map(lambda a: a.astype(jnp.bfloat16), dict(m.params)), x)
    with pytest.raises(sm.ConfigError, match=r"m\.apply runs the program over other weights"):
        sm.load(path, params_as_constants=True).apply(m.params, x)
    for torch_name in ("state_dict", "backward"):  # PyTorch's names point to it
        with pytest.raises(AttributeError, match=r"m\.apply\("):
            getattr(m, torch_name)


def test_gradients_of_a_loaded_models_weights(tmp_path):
    """Fine-tuning an artifact whose source is lost: jax.grad of m.apply with respect to the
    weights, and per example (vmap of grad), equal jax.grad of h.apply over the source."""
    net, x = sm.mlp((8, 2)), jax.random.normal(jax.random.key(1), (3, 4))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    m = sm.load(sm.export(h, tmp_path / "m", example=x, batch="b", vjp_order=1).path)
    loss = lambda p, x: (m.apply(p, x) ** 2).sum()  # noqa: E731
    g = jax.grad(loss)(m.params, x)
    want = jax.grad(lambda p: (h.apply(p, x) ** 2).sum())(h.params)["params"]["layers_0"]
    assert jnp.allclose(g["params/layers_0/kernel"], want["kernel"], atol=1e-5)
    each = jax.vmap(jax.grad(loss), in_axes=(None, 0))(m.params, x[:, None])
    assert jnp.allclose(each["params/layers_0/kernel"].sum(0), want["kernel"], atol=1e-5)


def test_a_loaded_model_exported_again_over_fine_tuned_weights(art, tmp_path):
    """sm.export(m, ...) of a loaded model said to write sm.export(sm.hybridize(model,
    variables), ...): the source this researcher does not have. It now says that m is an
    artifact already and how to export its program over other weights, which works."""
    path, x, other = art
    m = sm.load(path)
    with pytest.raises(sm.ConfigError, match=r"sm\.hybridize\(m\.apply, params\)"):
        sm.export(m, tmp_path / "again", example=x)
    tuned = dict(sm.load(path, params=other).params)
    sm.export(sm.hybridize(m.apply, tuned), tmp_path / "again", example=x, batch="b")
    assert jnp.allclose(sm.load(tmp_path / "again")(x), m.apply(tuned, x))


def test_m_apply_names_the_key_too_many_or_missing(art):
    """Raw MCMC samples (NumPyro's get_samples(), with the noise's ``prec_obs``) passed to
    m.apply were refused with a list of what it got and what it expected, naming neither the
    extra key nor the missing one: each is now named, with how to keep the model's only."""
    path, x, _ = art
    m = sm.load(path)
    samples = {**m.params, "prec_obs": jnp.ones(())}
    with pytest.raises(sm.SignatureError, match=r"has 'prec_obs', not a weight.*k in m\.params"):
        m.apply(samples, x)
    fewer = {k: v for k, v in m.params.items() if k != "params/layers_0/bias"}
    with pytest.raises(sm.SignatureError, match=r"lacks 'params/layers_0/bias'"):
        m.apply(fewer, x)
    assert jnp.array_equal(m.apply({k: samples[k] for k in m.params}, x), m(x))
