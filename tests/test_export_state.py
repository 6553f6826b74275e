"""Export of a model whose calls move state (an rng stream drawn, a collection written then read
again): an artifact carries none between calls, so it is refused naming the state, and the fix
each message gives runs for that model (flax's seq2seq, nnx VAE, lm1b decode, BatchNorm)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    LM1B,
    LinenBatchNorm,
    Seq2seq,
    TransformerLM,
    _binary,
    _lm1b_variables,
    _vae,
    seq2seq_inputs,
)

import symjax_mlp as sm


def _close(a, b):
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_baked_rng_stream_is_refused_naming_the_stream_the_model_draws(tmp_path):
    # it said 'dropout' and training=True: Seq2seq draws 'lstm' and takes no training flag
    model = Seq2seq(teacher_force=True, hidden_size=8, vocab_size=5)
    variables = jax.jit(model.init)(
        {"params": jax.random.key(0), "lstm": jax.random.key(1)}, *seq2seq_inputs(0)
    )
    h = sm.hybridize(model, variables, rngs={"lstm": jax.random.key(3)})
    with pytest.raises(sm.ConfigError, match=r"every call would") as e:
        sm.export(h, tmp_path / "m", example=seq2seq_inputs(0))
    message = str(e.value)
    assert "'lstm'" in message and "rngs={'lstm': jax.random.wrap_key_data(key)}" in message
    assert "dropout" not in message and "training" not in message
    assert "lambda params, x0, x1, key: model.apply(params, x0, x1, rngs=" in message
    assert not (tmp_path / "m").exists()


def test_an_nnx_module_drawing_from_its_rngs_is_refused_naming_the_stream_and_an_nnx_fix(
    tmp_path,
):
    """flax's nnx toy VAE draws self.rngs.noise() (no eval mode): the message was linen's
    (model.apply, 'dropout'); the nnx fix it gives (nnx.reseed from a key input) exports and
    draws per key, and the deterministic part exports as it is."""
    model, _ = _vae()
    x = _binary(0)
    with pytest.raises(sm.ConfigError, match=r"'noise'") as e:
        sm.export(sm.hybridize(model), tmp_path / "m", example=x)
    message = str(e.value)
    assert "model.apply" not in message and "dropout" not in message
    assert "nnx.reseed(model, noise=jax.random.wrap_key_data(key))" in message
    fix = sm.hybridize(
        lambda model, x, key: (nnx.reseed(model, noise=jax.random.wrap_key_data(key)), model(x))[1],
        model,
    )
    k1, k2 = (jax.random.key_data(jax.random.key(i)) for i in (1, 2))
    m = sm.load(sm.export(fix, tmp_path / "k", example=(x, k1), shapes=("b, ...", None)).path)
    assert not np.allclose(m(x, k1), m(x, k2))  # a draw per key, not one baked in
    generate = sm.hybridize(lambda m, z: m.generate(z), model)  # the example's sampler
    sm.export(generate, tmp_path / "g", example=jax.random.normal(jax.random.key(0), (3, 4)))


def _decoding():
    predict = TransformerLM(LM1B.replace(deterministic=True, decode=True))
    cache = jax.jit(predict.init)(jax.random.key(0), jnp.ones((2, 8), jnp.int32))["cache"]
    variables = {"params": _lm1b_variables()["params"], "cache": cache}
    return predict, variables, jnp.full((2, 1), 3, jnp.int32)


def test_a_linen_decode_cache_is_refused_at_export_naming_the_collection(tmp_path):
    # it exported the cache as constants: every call of the artifact decoded position 0
    predict, variables, token = _decoding()
    h = sm.hybridize(predict, variables)
    with pytest.raises(sm.ConfigError, match=r"writes the collection 'cache' that the next"):
        sm.export(h, tmp_path / "m", example=token, batch=None)
    assert not (tmp_path / "m").exists()
    # the step the message gives: the cache's arrays in and out, decoding as the Hybrid does
    model, params = predict, variables["params"]
    leaves, tree = jax.tree.flatten(variables["cache"])
    step = sm.hybridize(lambda p, x, *state: (lambda out, new: (out, *jax.tree.leaves(new)))(
        *model.apply({"params": p, "cache": jax.tree.unflatten(tree, state)}, x,
                     mutable=["cache"])), params)  # fmt: skip
    art = sm.export(step, tmp_path / "step", example=(token, *leaves), batch=None)
    m, state = sm.load(art.path, trust=True), leaves
    for _ in range(3):
        out, *state = m(token, *state)
        np.testing.assert_allclose(out, h(token), rtol=1e-4, atol=1e-4)


def test_a_linen_batch_norm_in_training_mode_is_refused_and_its_eval_mode_exports(tmp_path):
    # batch_stats were baked in silently, as nnx's training mode no longer is
    model, x = LinenBatchNorm(), jnp.linspace(-1, 1, 20).reshape(4, 5)
    h = sm.hybridize(model, model.init(jax.random.key(0), x))
    with pytest.raises(sm.ConfigError, match=r"collection 'batch_stats'") as e:
        sm.export(h, tmp_path / "m", example=x, kwargs={"train": True})
    assert "kwargs={'train': False}" in str(e.value)
    assert not (tmp_path / "m").exists()
    art = sm.export(h, tmp_path / "m", example=x, kwargs={"train": False})
    np.testing.assert_allclose(sm.load(art.path)(x), h(x, train=False), rtol=1e-5, atol=1e-6)


def test_a_function_drawing_from_a_key_in_its_params_is_refused_with_a_fix_for_a_function(
    tmp_path,
):
    # the stream's name was read from the key's path, one key long: an IndexError, not a refusal
    h = sm.hybridize(
        lambda p, x: x + jax.random.normal(p["key"], x.shape), {"key": jax.random.key(0)}
    )
    with pytest.raises(sm.ConfigError, match=r"every call would draw the same numbers") as e:
        sm.export(h, tmp_path / "m", example=jnp.ones((2, 3)))
    assert "model.apply" not in str(e.value) and "'key'" in str(e.value)
    assert not (tmp_path / "m").exists()


def test_the_flax_vae_draws_from_the_key_each_call_passes_and_exports_it_as_an_input(tmp_path):
    """flax examples/vae: ``model.apply({'params': params}, batch, z_rng)``, the key an argument
    (no rng stream): drawn anew per call, trained through, and exported as an input without a
    batch (the default batch refused it saying ``shapes=`` and no value for it)."""
    from helpers import compute_metrics, eval_f, vae_loss_fn, vae_model, vae_params

    model, params, x = vae_model(4), vae_params(), _binary(0).reshape(4, 16)
    variables, keys = {"params": params}, jax.random.split(jax.random.key(5))
    h, apply = sm.hybridize(model, variables), jax.jit(model.apply)  # references jitted
    for call in (h, h.eager):  # a new key each call: drawn anew, never retraced
        _close(outs := [call(x, k) for k in keys], [apply(variables, x, k) for k in keys])
        assert not np.allclose(outs[0][0], outs[1][0])
    assert h.trace_count == 1

    def loss(p):  # train_step's loss_fn (compute_metrics' loss), the Hybrid applying the model
        recon_x, mean, logvar = h.apply(p, x, keys[0])
        return compute_metrics(recon_x, x, mean, logvar)["loss"]

    want = jax.jit(jax.grad(vae_loss_fn), static_argnums=3)(params, x, keys[0], 4)
    _close(jax.jit(jax.grad(loss))(h.params)["params"], want)
    z = jax.random.normal(jax.random.key(2), (4, 4))  # eval_f's latents; `latents` a setting
    got = sm.hybridize(eval_f, params, static_argnames="latents")(x, z, keys[1], latents=4)
    _close(got, jax.jit(eval_f, static_argnums=4)(params, x, z, keys[1], 4))
    with pytest.raises(sm.SignatureError, match=r"scalar.*shapes=\('b, \.\.\.', None\)"):
        sm.export(h, tmp_path / "m", example=(x, keys[0]))
    sm.export(h, tmp_path / "m", example=(x, keys[0]), shapes=("b, ...", None))  # as it says
    m = sm.load(tmp_path / "m")
    for rows, k in ((4, keys[0]), (1, jax.random.key(6))):  # another batch, another key
        _close(m(np.asarray(x[:rows]), k), apply(variables, x[:rows], k))


def test_jax_stax_vae_trains_with_its_key_first_and_exports_its_list_as_a_tuple(tmp_path):
    """JAX's examples/mnist_vae.py: ``elbo(rng, params, images)`` takes its key before the
    params, and its encoder returns stax.parallel's list (an artifact returns a flat tuple: refused,
    naming it); its images are bool, as random.bernoulli binarizes them."""
    from helpers import binarized, elbo, encode, stax_vae_params

    params, images, rng = stax_vae_params(), binarized(0), jax.random.key(3)
    h = sm.hybridize(lambda params, rng, images: elbo(rng, params, images), params)
    grads = jax.jit(jax.grad(lambda p: -h.apply(p, rng, images) / 4))(h.params)  # run_epoch's
    want = jax.jit(jax.grad(lambda p: -elbo(rng, p, images) / 4))(params)
    _close(grads, want)
    with pytest.raises(sm.SignatureError, match=r"Return tuple\(jax\.tree\.leaves\(out\)\)"):
        sm.export(sm.hybridize(encode, params[0]), tmp_path / "m", example=images)
    flat = sm.hybridize(lambda p, x: tuple(jax.tree.leaves(encode(p, x))), params[0])  # as it says
    sm.export(flat, tmp_path / "m", example=images)
    got = sm.load(tmp_path / "m")(np.asarray(images[:1]))
    chex.assert_trees_all_close(got, tuple(y[:1] for y in encode(params[0], images)), rtol=1e-5)
