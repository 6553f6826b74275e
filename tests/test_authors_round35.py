"""Code we did not write, round thirty-five (tests/zoo35.py; sources and versions there): the
authors' loops that rounds thirty-three and thirty-four left unrun, over our models.

- transformers' ``generate`` (greedy, WITH its cache: ``init_cache``, then ``decode`` with
  ``past_key_values`` in its ``lax.while_loop``) over FlaxT5's decode step hybridized and
  exported (the cache's arrays in and out, symbolic batch and cache length) and its encoder
  loaded: the tokens are the model's own; one cached step's logits and cache equal its own;
  two cached steps over every feature.
- dynamax's README fit (``initialize(method="kmeans")``, ``fit_em(num_iters=20)``) with the
  HMM's ``e_step`` (its smoother, sufficient statistics and the marginal log-prob) a Hybrid's
  ``h.apply`` and a loaded model's ``m.apply``: the log-probs and fitted parameters are
  dynamax's own (the Hybrid's bitwise).
- OTT's ``W2NeuralDual`` trained three steps by its own loop with both ICNN potentials'
  ``potential_value_fn`` a Hybrid's ``h.apply`` or a loaded model's (two entry points: a
  batch of 64 and one point, ``vjp_order=2``: the loss holds the gradient of the map).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo35
from features import close, every_feature

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each compiles a model's loop (a decoder, an EM, a dual)

TOL = {"rtol": 1e-4, "atol": 1e-5}
ALLOW = {"gather", "dynamic_gather", "scatter", "real_dynamic_slice"}  # embeddings, masks
CACHED = ALLOW | {"dynamic_slice", "dynamic_update_slice"}  # the cache, written in place
T5_SMALL = {"d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 2, "num_heads": 2}


@pytest.fixture(scope="module")
def tr():
    """transformers, imported by the tests that run (~5 s), its T5 module over ``T5Jnp``."""
    with warnings.catch_warnings():  # transformers 4 warns its Flax classes are deprecated
        warnings.simplefilter("ignore")
        import transformers
    from transformers.models.t5 import modeling_flax_t5

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_flax_t5, "jnp", zoo35.T5Jnp())
        yield transformers


def _t5(tr, factor=10.0, **sizes):
    """A small random T5; at ``factor`` 10 its greedy tokens change along a sequence (at the
    default, 1, it repeats one token: a cache read wrong could not show)."""
    config = tr.T5Config(vocab_size=100, decoder_start_token_id=0, initializer_factor=factor,
                         **{**T5_SMALL, **sizes})  # fmt: skip
    return tr.FlaxT5ForConditionalGeneration(config, seed=2)


class Cached:
    """The cached decode step as ``decode`` is called in ``generate``'s loop, over ``apply``
    (``h.apply`` or a loaded ``m.apply``) of ``step``: the cache's arrays by place."""

    def __init__(self, model, cache):
        self.model, self.tree = model, jax.tree.structure(cache)

    def step(self, params, dec, states, enc_mask, dec_mask, *cache):
        out = self.model.decode(dec, (states,), encoder_attention_mask=enc_mask,
                                decoder_attention_mask=dec_mask, params=params,
                                past_key_values=jax.tree.unflatten(self.tree, cache))  # fmt: skip
        return (out.logits, *jax.tree.leaves(out.past_key_values))

    def decode_over(self, apply):
        from transformers.modeling_flax_outputs import FlaxCausalLMOutputWithCrossAttentions

        def decode(ids, encoder_outputs, encoder_attention_mask=None, decoder_attention_mask=None,
                   past_key_values=None, params=None, **_):  # fmt: skip
            states = encoder_outputs[0]
            if encoder_attention_mask is None:  # generate's, without an attention mask
                encoder_attention_mask = jnp.ones(states.shape[:2], jnp.int32)
            logits, *cache = apply(params or self.model.params, ids, states,
                                   encoder_attention_mask, decoder_attention_mask,
                                   *jax.tree.leaves(past_key_values))  # fmt: skip
            past = jax.tree.unflatten(self.tree, cache)
            return FlaxCausalLMOutputWithCrossAttentions(logits=logits, past_key_values=past)

        return decode


def test_t5_generate_with_its_cache_over_a_hybridized_and_a_loaded_decode_step(tr, tmp_path):
    """``generate(ids, do_sample=False)``: its greedy loop's ``decode`` (``past_key_values``
    in, the written cache out) a Hybrid's ``h.apply``, then a loaded model's (batch and cache
    length symbolic) with a loaded encoder: the tokens are the model's own. One cached step
    (the loop's first, from ``init_cache``) gives the model's logits and cache."""
    from transformers.modeling_flax_outputs import FlaxBaseModelOutput

    model = _t5(tr)
    ids = jax.random.randint(jax.random.key(335), (2, 7), 3, 100)  # round 33's inputs
    want = np.asarray(model.generate(ids, max_new_tokens=8, do_sample=False).sequences)
    assert min(len(set(row)) for row in want.tolist()) > 3  # not one token repeated

    states = model.encode(ids).last_hidden_state
    cache = model.init_cache(2, 9, (states,))
    cached = Cached(model, cache)
    start = jnp.zeros((2, 1), jnp.int32)
    example = (start, states, jnp.ones((2, 7), jnp.int32), jnp.ones((2, 9), jnp.int32),
               *jax.tree.leaves(cache))  # fmt: skip
    h = sm.hybridize(cached.step, model.params)
    theirs = cached.step(model.params, *example)
    close(h(*example), theirs, **TOL)
    indices = [1 + i for i, a in enumerate(jax.tree.leaves(cache)) if a.ndim == 0]
    assert [int(theirs[i]) for i in indices] == [1] * len(indices)  # the step wrote its cache
    spec = [None if a.ndim == 0 else "b, L, 2, 4" for a in jax.tree.leaves(cache)]
    sm.export(h, tmp_path / "dec", example=example, shapes=("b, 1", "b, s, 16", "b, s", "b, L",
              *spec))  # fmt: skip
    m = sm.load(tmp_path / "dec", allow=CACHED)
    close(m(*(np.asarray(a) for a in example)), theirs, **TOL)

    def encode(params, ids):
        return model.encode(ids, params=params).last_hidden_state

    sm.export(sm.hybridize(encode, model.params), tmp_path / "enc", example=(ids,),
              shapes=("b, s",))  # fmt: skip
    enc = sm.load(tmp_path / "enc", allow=ALLOW)

    def loaded_encode(input_ids, params=None, **_):
        return FlaxBaseModelOutput(last_hidden_state=enc.apply(params or model.params, input_ids))

    for apply, encoder in ((h.apply, None), (m.apply, loaded_encode)):
        ours = _t5(tr)  # the same weights; its decode (and encode) ours, by instance
        ours.decode = cached.decode_over(apply)
        if encoder:
            ours.encode = encoder
        got = ours.generate(ids, max_new_tokens=8, do_sample=False).sequences
        np.testing.assert_array_equal(got, want)


def test_t5_two_cached_decode_steps_over_every_feature(tr, tmp_path):
    """Two cached decode steps (``init_cache``, then ``decode`` with ``past_key_values``,
    fixed tokens) as a function of the encoder's states: every feature equals the model's."""
    model = _t5(tr, factor=1.0, num_layers=1)  # a Hessian per row: one block each side
    tokens = jax.random.randint(jax.random.key(351), (2,), 3, 100).at[0].set(0)

    def decode(params, states):
        cache = model.init_cache(states.shape[0], 2, (states,))
        mask = jnp.ones((states.shape[0], 2), jnp.int32)  # the cache's length, as generate's
        for token in tokens:
            ids = jnp.full((states.shape[0], 1), token, jnp.int32)
            out = model.decode(ids, (states,), decoder_attention_mask=mask,
                               past_key_values=cache, params=params)  # fmt: skip
            cache = out.past_key_values
        return out.logits[:, -1]

    x = jax.random.normal(jax.random.key(352), (4, 3, T5_SMALL["d_model"]))
    h = sm.hybridize(decode, model.params)
    every_feature(tmp_path, h, lambda s: decode(model.params, s), x, allow=CACHED, **TOL)


@pytest.fixture(scope="module")
def hmm_case():
    """tests/zoo33b.py (dynamax's README): its Gaussian HMM and sample, and the README's fit
    over them. ``hmm.initialize`` samples tfp-nightly's Wishart, whose gamma sampler calls
    ``jnp.shape(None)``: JAX 0.10 warns (theirs). dynamax's import sets
    ``jax_default_matmul_precision`` for the whole process (theirs): put back after this
    module, or later tests' matmuls in this worker change."""
    precision = jax.config.jax_default_matmul_precision
    try:
        pytest.importorskip("dynamax")
        import zoo33b

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "shape requires ndarray or scalar arguments")
            hmm, _, _, emissions, _ = zoo33b.readme()
            fit = zoo35.readme_fit(hmm, emissions)
        yield hmm, emissions, fit, zoo33b.readme
    finally:
        jax.config.update("jax_default_matmul_precision", precision)


@pytest.mark.filterwarnings("ignore:shape requires ndarray or scalar arguments")  # theirs: above
def test_dynamax_readme_fit_em_over_a_hybridized_and_a_loaded_e_step(hmm_case, tmp_path):
    """The README's ``fit_em`` (20 iterations from its k-means start) with ``hmm.e_step`` (the
    two-filter smoother's statistics and marginal log-prob of the 1,000 steps, static shapes:
    dynamax reads the number of steps as a Python int) a Hybrid's ``h.apply``, then a loaded
    model's ``m.apply`` (the params of each iteration passed in): the log-probs and fitted
    parameters are dynamax's own; over the Hybrid, bitwise."""
    hmm, emissions, (want_params, want_lls), readme = hmm_case
    params = want_params  # the structure, shapes and dtypes: the values are each iteration's
    stats = jax.tree.structure(jax.eval_shape(hmm.e_step, params, emissions))

    def e_step(params, emissions):
        return tuple(jax.tree.leaves(hmm.e_step(params, emissions)))

    h = sm.hybridize(e_step, params)
    sm.export(h, tmp_path / "e", example=(emissions,), batch=None)
    allow = CACHED | {"custom_call:lapack_spotrf_ffi", "custom_call:lapack_strsm_ffi"}
    m = sm.load(tmp_path / "e", allow=allow)
    assert want_lls[-1] > want_lls[0]  # EM climbed
    for apply, equal in ((h.apply, np.testing.assert_array_equal), (m.apply, None)):
        ours = readme()[0]  # the README's HMM anew, its e_step ours, by instance
        ours.e_step = lambda p, y, inputs=None, apply=apply: jax.tree.unflatten(stats, apply(p, y))
        got_params, got_lls = zoo35.readme_fit(ours, emissions)
        if equal:
            jax.tree.map(equal, (got_params, got_lls), (want_params, want_lls))
        else:  # a loaded program compiles apart: its statistics round apart, and EM's first
            # steps from k-means (this HMM's narrow emissions) amplify that, then converge
            close(got_lls, want_lls, rtol=5e-4, atol=0)
            close(got_lls[-1], want_lls[-1], rtol=2e-5, atol=0)  # float32 sums of 1,000 steps
            close(got_params, want_params, rtol=1e-4, atol=1e-5)


def _neural_dual(potentials=None, steps=3):
    """``W2NeuralDual`` as ott makes it (its default ICNNs, optimizers, conjugate solver)
    trained ``steps`` steps by its own loop on its Gaussian mixtures (its logged losses);
    ``potentials`` (a value function and a gradient function) in place of its ICNNs' in both
    train states."""
    from ott import datasets
    from ott.neural.methods import neuraldual

    train, valid, dim = datasets.create_gaussian_mixture_samplers(
        name_source="square_five", name_target="square_four", train_batch_size=64,
        valid_batch_size=64, rng=jax.random.key(353))  # fmt: skip
    dual = neuraldual.W2NeuralDual(dim, num_train_iters=steps, logging=True, log_freq=1,
                                   rng=jax.random.key(354))  # fmt: skip
    if potentials:
        value, gradient = potentials
        for name in ("state_f", "state_g"):
            state = getattr(dual, name)
            setattr(dual, name, state.replace(potential_value_fn=value,
                                              potential_gradient_fn=gradient))  # fmt: skip
    _, logs = dual(train.source_iter, train.target_iter, valid.source_iter, valid.target_iter)
    return dual, {k: logs["train_logs"][k] for k in ("loss_f", "loss_g", "w_dist")}


def _potentials(call):
    """ott's ``potential_value_fn``/``potential_gradient_fn`` (``is_potential``) over
    ``call(params, x)``, x one point or a batch."""

    def value(params, other_potential_value_fn=None):
        return lambda x: call(params, x)

    return value, lambda params: jax.vmap(jax.grad(value(params)))


@pytest.mark.filterwarnings("ignore:Setting of ICNN and the positive weights")  # theirs: below
def test_ott_w2_neural_dual_trains_over_a_hybridized_and_a_loaded_icnn(tmp_path):
    """Three steps of ``W2NeuralDual``'s own loop with both ICNNs a Hybrid's ``h.apply``:
    losses and weights bitwise those with the ICNN under a plain ``jax.jit``; with a loaded
    model's (a batch of 64 and one point, ``vjp_order=2``): ott's own within round-off.

    ott's own (the ICNN inlined in its step) differs from either in the fourth digit: its
    conjugate solver stops LBFGS at 20 iterations, unconverged, and an ICNN compiled as its
    own computation (``jax.jit``'s, ours alike) rounds apart enough to move the point it
    stops at. (ott warns that its default ICNN's ``pos_weights`` and its dual's differ.)"""
    pytest.importorskip("ott")
    with warnings.catch_warnings():  # jaxopt, which ott imports, warns it is unmaintained
        warnings.filterwarnings("ignore", "JAXopt is no longer maintained", DeprecationWarning)
        own, own_logs = _neural_dual()
    icnn = own.neural_f  # neural_g's architecture too (ott's defaults: the same ICNN)

    def potential(params, x):
        return icnn.apply({"params": params}, x)

    jitted = jax.jit(potential)
    dual_jit, want = _neural_dual(_potentials(jitted))
    h = sm.hybridize(potential, own.state_f.params)
    dual, got = _neural_dual(_potentials(h.apply))
    assert got == want
    jax.tree.map(np.testing.assert_array_equal, dual.state_f.params, dual_jit.state_f.params)
    close(want, own_logs, rtol=1e-3, atol=0)
    assert own_logs["loss_f"][0] != own_logs["loss_f"][-1]  # it trained

    batch, point = jnp.ones((64, 2)), jnp.ones((2,))
    sm.export({"batch": h, "point": h}, tmp_path / "icnn", batch=None, vjp_order=2,
              example={"batch": (batch,), "point": (point,)})  # fmt: skip
    m = sm.load(tmp_path / "icnn")
    loaded = lambda params, x: m["batch" if x.ndim == 2 else "point"].apply(params, x)  # noqa: E731
    _, got_m = _neural_dual(_potentials(loaded))
    close(got_m, want, rtol=1e-3, atol=0)
    # what the loss's gradient holds: the weights' gradient of the transport map's values
    x = jax.random.normal(jax.random.key(355), (64, 2))
    params = dual.state_g.params
    moved = lambda call: jax.grad(lambda p: (_potentials(call)[1](p)(x) ** 2).sum())  # noqa: E731
    close(moved(loaded)(params), moved(potential)(params), **TOL)
