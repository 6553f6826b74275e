"""Code we did not write, round fifteen: Equinox's docstring examples (tests/zoo15.py; sources
and commit there) over every feature: hybridize, ``h(x)`` equal to the plain model, its graph,
export (a symbolic batch where the model allows one) + load + call equal, grads/Hessians over
the loaded model (``vjp_order=2``), a Batcher's answers, and equinox's own steps where it trains.

- ``filter_custom_vjp``'s usage: its rule trains the params through ``h.apply``; export with
  ``vjp_order=1`` (its ``*args`` cannot be differentiated) is refused naming ``vjp_order=0``
  (it was equinox's raw RuntimeError).
- ``ConvTranspose``'s FAQ: the ``tree_at`` surgery before hybridize; the hybrid is the
  convolution's transpose.
- ``LayerNorm``'s FAQ, ``filter_vmap``'s ``f``/``g``, ``tree_at``'s MLP surgery trained as
  equinox trains it.
- Ours: ``MultiheadAttention`` with a mask and a dropout key (passed by keyword, as equinox
  passes keys; exported by place as the refusal says), ``inference_mode`` (a model so given
  whole to ``h.replace``/``h.apply`` is refused naming a new Hybrid); Embedding, the 1d
  pools, GroupNorm and ``MLP(use_final_bias=False)`` on int tokens.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import zoo15
from features import close, every_feature

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each compiles a model or more: over 0.5 s apiece

CONV = {"convolution"}
POOLS = {
    "gather",
    "convolution",
    "reduce_window",
    "select_and_scatter",
    "scatter",
    "real_dynamic_slice",
}


def _x(seed, shape):
    return jr.normal(jr.PRNGKey(seed), shape)


def _steps(h, model, loss, n=3, lr=0.1):
    """``n`` SGD steps over ``h.apply`` and over ``eqx.filter_grad`` of ``model``: both."""
    params = h.params
    for _ in range(n):
        grads = jax.grad(lambda p: loss(lambda *a, **k: h.apply(p, *a, **k)))(params)
        params = jax.tree.map(lambda a, b: a - lr * b, params, grads)
        grads = eqx.filter_grad(loss)(model)
        model = eqx.apply_updates(model, jax.tree.map(lambda b: -lr * b, grads))
    return params, model


# -- equinox/_ad.py, filter_custom_vjp -----------------------------------------------------------


def test_filter_custom_vjp_export_with_a_vjp_is_refused_naming_vjp_order_0(tmp_path):
    """The usage's ``fn`` (its ``*args`` cannot be autodifferentiated): ``sm.export(h,
    vjp_order=1)`` raised equinox's raw RuntimeError ('Unexpected tangent'); now refused
    naming ``vjp_order=0`` and the fix; so exported, the loaded model equals ``fn``."""
    p, x = {"w": jnp.ones(3)}, _x(1, (5, 3))
    h = sm.hybridize(zoo15.fn, p)
    said = r"export\(filter_custom_vjp, vjp_order=1\): JAX could not build .*Unexpected tangent"
    with pytest.raises(sm.ConfigError, match=said) as e:
        sm.export(h, tmp_path / "m", example=(x,), vjp_order=1)
    assert "Export it with vjp_order=0" in str(e.value)
    assert "filter_custom_vjp moved into its first argument" in str(e.value)
    sm.export(h, tmp_path / "m", example=(x,), vjp_order=0)  # as it says
    close(sm.load(tmp_path / "m")(np.asarray(x[:2])), zoo15.fn(p, x[:2]))


def test_filter_custom_vjps_own_rule_trains_the_params_through_apply():
    """Grads of ``h.apply`` by the params are the rule's (twice the true ones), as
    ``jax.grad`` of ``fn`` gives them; three steps equal three of ``fn``'s own."""
    p, x = {"w": jnp.ones(3)}, _x(1, (5, 3))
    h = sm.hybridize(zoo15.fn, p)
    grads = jax.grad(lambda q: h.apply(q, x).sum())(p)
    close(grads, {"w": 2.0 * jnp.sin(x).sum(0)})
    theirs = p
    for _ in range(3):
        theirs = jax.tree.map(
            lambda a, b: a - 0.1 * b, theirs, jax.grad(lambda q: zoo15.fn(q, x).sum())(theirs)
        )
    ours = p
    for _ in range(3):
        ours = jax.tree.map(
            lambda a, b: a - 0.1 * b, ours, jax.grad(lambda q: h.apply(q, x).sum())(ours)
        )
    close(ours, theirs)


# -- equinox/nn/_conv.py, ConvTranspose's FAQ ----------------------------------------------------


def test_the_exact_transpose_made_by_tree_at_is_the_convolutions_transpose(tmp_path):
    """The FAQ's ``cnn_t`` (its weight set by ``eqx.tree_at`` before hybridize): every
    feature, batch symbolic; its answer is the VJP of ``cnn`` (the linear transpose)."""
    cnn, cnn_t = zoo15.exact_transpose(jr.PRNGKey(0))
    model = eqx.filter_vmap(cnn_t)
    x = _x(1, (4, 4, 4))  # (batch, 4 channels, 4 steps): cnn's output of 9 steps
    h = sm.hybridize(model)
    every_feature(tmp_path, h, model, x, allow=CONV)
    primal = _x(2, (4, 3, 9))
    _, vjp = jax.vjp(jax.vmap(cnn), primal)
    close(h(x), vjp(x)[0])


# -- equinox/nn/_normalisation.py, LayerNorm's FAQ -----------------------------------------------


def test_layer_norm_over_all_but_the_first_dimension(tmp_path):
    """``jax.vmap(layer)(array)`` of a ``LayerNorm((4,))`` over ``(3, 4)`` samples: every
    feature, batch symbolic; each sample's each row normalised (mean 0)."""
    layer = eqx.nn.LayerNorm((4,))
    ref = jax.vmap(lambda a: zoo15.layer_norm_but_first(layer, a))
    h = sm.hybridize(lambda m, r: jax.vmap(lambda a: zoo15.layer_norm_but_first(m, a))(r), layer)
    x = _x(1, (5, 3, 4))
    every_feature(tmp_path, h, ref, x, rtol=1e-4, atol=1e-4)
    close(h(x).mean(-1), jnp.zeros((5, 3)), atol=1e-5, rtol=0)


# -- equinox/_vmap_pmap.py, filter_vmap's examples -----------------------------------------------


def test_filter_vmaps_f_and_g(tmp_path):
    """``f`` (an array param vectorised, a number broadcast) and ``g`` (``in_axes=(None,
    1)``: its static batch exported and loaded, grads too) as pure functions of params."""
    x = jnp.array([1.0, 2.0])
    hf = sm.hybridize(lambda p, x: zoo15.f(x, p), jnp.array([3.0, 4.0]))  # both vectorised
    close(hf(x), zoo15.f(x, jnp.array([3.0, 4.0])))
    hf = sm.hybridize(lambda _, x, y: zoo15.f(x, y), {})  # the 3 a setting: broadcast
    close(hf(x, 3), zoo15.f(x, 3))
    hg = sm.hybridize(zoo15.g, jnp.array(1.0))
    y = jnp.array([[2.0, 3.0]])
    close(hg(y), zoo15.g(jnp.array(1.0), y))  # (2, 1): mapped down y's axis 1, no row each
    sm.export(hg, tmp_path / "g", example=(y,), batch=None, vjp_order=1)
    m = sm.load(tmp_path / "g")
    close(m(np.asarray(y)), zoo15.g(jnp.array(1.0), y))
    close(jax.grad(lambda r: m(r).sum())(y), jax.grad(lambda r: zoo15.g(1.0, r).sum())(y))


# -- equinox/_tree.py, tree_at's surgery ---------------------------------------------------------


def test_tree_at_surgery_before_hybridize_trains_as_equinox_trains_it(tmp_path):
    """``new_mlp`` (the last Linear replaced, 5 outputs): its params are the new layer's;
    every feature, batch symbolic; three SGD steps over ``h.apply`` equal
    ``eqx.filter_grad``'s."""
    _, new_mlp = zoo15.surgery(jr.PRNGKey(0))
    model = eqx.filter_vmap(new_mlp)
    h, x = sm.hybridize(model), _x(1, (5, 3))
    assert jax.tree.leaves(h.params)[-1].shape == (5,)
    every_feature(tmp_path, h, model, x)
    loss = lambda m: jnp.mean(m(x) ** 2)  # noqa: E731
    params, trained = _steps(h, model, loss)
    close(params, eqx.filter(trained, eqx.is_inexact_array))
    close(h.replace(params=params)(x), trained(x))


# -- ours: MultiheadAttention with a mask and a key, Dropout's key, inference_mode ---------------


def test_attention_with_a_mask_and_a_dropout_key_trains_and_exports_by_place(tmp_path):
    """``h(x, mask, key=key)`` is the module's own (its dropouts drawn from the key), without
    a key its inference; grads through ``h.apply(..., key=)`` equal ``eqx.filter_grad``'s;
    ``inference_mode`` of it is the keyless answer. Export of the key as ``kwargs=`` is
    refused naming a place for it; so exported, the loaded model takes a new key each call."""
    model, x = zoo15.Attention(jr.PRNGKey(0)), _x(1, (4, 8))
    mask = jnp.tril(jnp.ones((4, 4), bool))
    h, key = sm.hybridize(model), jr.PRNGKey(3)
    close(h(x, mask, key=key), model(x, mask, key=key))
    close(h(x, mask), model(x, mask))
    assert not np.allclose(h(x, mask, key=key), h(x, mask))
    inference = eqx.nn.inference_mode(model)
    close(sm.hybridize(inference)(x, mask, key=key), model(x, mask))
    loss = lambda m: jnp.mean(m(x, mask, key=key) ** 2)  # noqa: E731
    params, trained = _steps(h, model, loss)
    close(params, eqx.filter(trained, eqx.is_inexact_array))

    with pytest.raises(
        sm.SignatureError, match=r"kwargs\['key'\] is an array.*example=\(x0, x1, key\)"
    ):
        sm.export(h, tmp_path / "refused", example=(x, mask), kwargs={"key": key})
    placed = sm.hybridize(lambda p, x, mask, key: h.apply(p, x, mask, key=key), h.params)
    sm.export(placed, tmp_path / "m", example=(x, mask, key), batch=None, vjp_order=1)
    m = sm.load(tmp_path / "m")
    for k in (key, jr.PRNGKey(4)):
        close(m(np.asarray(x), np.asarray(mask), np.asarray(k)), model(x, mask, key=k))
    grads = jax.grad(lambda r: m(r, mask, key).sum())(x)
    close(grads, jax.grad(lambda r: model(r, mask, key=key).sum())(x))


def test_an_inference_mode_model_given_whole_is_refused_naming_a_new_hybrid():
    """``h.replace(params=eqx.nn.inference_mode(model))`` and ``h.apply(that, ...)``: its
    Python bool flag was traced and equinox's ``if inference`` failed as a ControlFlowError
    advising ``jnp.where``; refused naming the flag and ``sm.hybridize(...)`` anew, which is
    the inference model's answer."""
    model, x = zoo15.Attention(jr.PRNGKey(0)), _x(1, (4, 8))
    mask, key = jnp.tril(jnp.ones((4, 4), bool)), jr.PRNGKey(3)
    h, inference = sm.hybridize(model), eqx.nn.inference_mode(model)
    said = (
        r"params\.mha\.dropout\.inference is the Python bool True, a setting of the whole "
        r"equinox Attention.*sm\.hybridize\(eqx\.nn\.inference_mode\(model\)\)"
    )
    with pytest.raises(sm.ConfigError, match=r"^Attention: " + said):
        h.replace(params=inference)
    with pytest.raises(sm.ConfigError, match=r"^Attention\.apply: " + said):
        h.apply(inference, x, mask, key=key)
    close(sm.hybridize(inference)(x, mask, key=key), model(x, mask))  # as it says


def test_attention_without_a_key_over_every_feature(tmp_path):
    """The keyless (inference) attention, a causal mask, batch symbolic: every feature."""
    model = zoo15.Attention(jr.PRNGKey(0))
    mask = jnp.tril(jnp.ones((4, 4), bool))
    run = lambda m, r: jax.vmap(lambda a: m(a, mask))(r)  # noqa: E731
    h, x = sm.hybridize(run, model), _x(1, (5, 4, 8))
    every_feature(tmp_path, h, lambda r: run(model, r), x)


# -- ours: Embedding, the 1d pools, GroupNorm, MLP(use_final_bias=False) -------------------------


def test_pooled_embedding_takes_int_tokens_exports_and_trains(tmp_path):
    """Int tokens through an Embedding, a Conv1d, max/avg/adaptive pools, GroupNorm and an MLP
    without its final bias (no such param): call, graph, export with the batch symbolic, load
    and call equal, a Batcher's rows; three SGD steps equal ``eqx.filter_grad``'s."""
    model = eqx.filter_vmap(zoo15.Pooled(jr.PRNGKey(0)))
    tokens = jr.randint(jr.PRNGKey(1), (5, 12), 0, 10)
    h = sm.hybridize(model)
    assert jax.tree.leaves(h.params)[-1].shape == (2, 8)  # the final Linear's weight, no bias
    close(h(tokens), model(tokens))
    assert h.graph(tokens).flops > 0
    sm.export(h, tmp_path / "m", example=(tokens,), vjp_order=1)
    m = sm.load(tmp_path / "m", allow=POOLS)
    close(m(np.asarray(tokens[:3])), model(tokens[:3]))
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [b.submit(np.asarray(tokens[i : i + 1])).result(30) for i in range(2)]
    close(np.concatenate(got), model(tokens[:2]))
    loss = lambda f: jnp.mean(f(tokens) ** 2)  # noqa: E731
    params, trained = _steps(h, model, loss)
    close(params, eqx.filter(trained, eqx.is_inexact_array))
