"""Code we did not write, round thirty-three (tests/zoo33.py; sources and commits there):
Hugging Face Transformers' own Flax training scripts (run_clm_flax.py, run_t5_mlm_flax.py)
over transformers 4.57.6's GPT-2 and T5, built from small configs with random weights.

- run_clm_flax.py's ``p_train_step`` (its ``TrainState`` carrying the dropout rng,
  ``replicate`` with ``shard_prng_key``, adamw under its GPT-2 decay mask, the shifted
  cross-entropy, ``pmean`` under ``jax.pmap``) with ``apply_fn`` a Hybrid's ``h.apply``:
  three steps' metrics, dropout rngs and weights equal those over the model's own
  ``__call__``; its ``p_eval_step`` (``model(...)``) over a loaded model's ``m.apply`` too.
- run_t5_mlm_flax.py's ``FlaxDataCollatorForT5MLM`` (span masking, sentinels from a
  tokenizer built in the test) feeds its ``p_train_step`` (dropout rngs per device,
  ``decoder_input_ids``) over ``h.apply``, and its ``p_eval_step`` over a loaded ``m.apply``:
  equal to the model's own.
- T5 (encoder-decoder): ``__call__(input_ids, decoder_input_ids)`` exported with symbolic
  batch and both lengths, its logits and gradients; its decoder over every feature (encoder
  states in); ``generate``'s greedy tokens from a loaded encoder and a loaded decode step.
"""

import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo35
from features import close, every_feature
from flax.jax_utils import unreplicate
from flax.training.common_utils import shard

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each builds a transformer and compiles it (> 0.5 s)

TOL = {"rtol": 1e-4, "atol": 1e-5}
ALLOW = {"gather", "dynamic_gather", "scatter", "real_dynamic_slice"}  # embeddings, masks
ARGS = SimpleNamespace(  # the fields of TrainingArguments the steps read
    adafactor=False, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.01
)
T5_SMALL = {"d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 2, "num_heads": 2}


@pytest.fixture(scope="module")
def zoo():
    """tests/zoo33.py and transformers, imported by the tests that run (~5 s: not at the
    default selection's collection), T5's ``jnp.clip`` as its authors called it (under
    tests/zoo35.py's ``T5Jnp``)."""
    import zoo33  # imports transformers under a filter of its Flax deprecation warning
    from transformers.models.t5 import modeling_flax_t5

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_flax_t5, "jnp", zoo35.T5Jnp())
        yield zoo33, zoo33.transformers


class Ours:
    """The model as the scripts use it (``model.__call__`` for ``apply_fn``, ``model(...)`` in
    ``eval_step``, ``model.params``): training calls a Hybrid's ``h.apply``, evaluation a
    loaded artifact's ``m.apply``, with the batch's inputs by place in ``names``' order."""

    def __init__(self, params, h, m, names):
        self.params, self.h, self.m, self.names = params, h, m, names

    def __call__(self, params=None, dropout_rng=None, train=False, **batch):
        inputs = [batch[name] for name in self.names]
        if train:
            return (self.h.apply(params, *inputs, dropout_rng),)
        return (self.m.apply(params, *inputs),)


def _ours(model, names, example, shapes, tmp_path, call, constraints=()):
    """An ``Ours`` over ``call(params, *inputs, rng, train)`` (the model's own ``__call__``
    by keyword), its eval side exported with ``shapes`` (and ``constraints``) and loaded."""
    h = sm.hybridize(lambda p, *a: call(p, *a[:-1], rng=a[-1], train=True), model.params)
    h_eval = sm.hybridize(lambda p, *a: call(p, *a, rng=None, train=False), model.params)
    sm.export(h_eval, tmp_path / "eval", example=example, shapes=shapes, constraints=constraints)
    return Ours(model.params, h, sm.load(tmp_path / "eval", allow=ALLOW), names)


def _equal(got, want):
    """Bitwise: the same program (the script's step) traced over the model's ``__call__`` or
    over ``h.apply``/``m.apply``, compiled by XLA the same."""
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_clm_train_and_eval_steps_over_h_apply_and_a_loaded_model_equal_its_own(zoo, tmp_path):
    """run_clm_flax's ``p_train_step`` three steps over ``h.apply`` (dropout, its rng in the
    state, adamw, pmean over the devices' shards) and ``p_eval_step`` over a loaded model's
    ``m.apply``: losses, learning rates, the state's dropout rngs, weights and eval loss are
    bitwise those over FlaxGPT2LMHeadModel's own ``__call__``."""
    zoo33, tr = zoo
    config = tr.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = tr.FlaxGPT2LMHeadModel(config, seed=0)
    n = jax.local_device_count()
    ids = np.asarray(jax.random.randint(jax.random.key(330), (2 * n, 8), 0, 100), np.int32)
    mask = np.ones_like(ids)

    def call(params, ids, mask, rng, train):
        return model.__call__(ids, mask, params=params, dropout_rng=rng, train=train).logits

    ours = _ours(
        model,
        ("input_ids", "attention_mask"),
        (ids, mask),
        ("b, t", "b, t"),
        tmp_path,
        call,
        ("t <= 32",),
    )  # fmt: skip  (its causal mask: n_positions)
    lr = zoo33.create_learning_rate_fn(6 * n, 2 * n, 1, 1, 1e-3)
    runs = {}
    for name, m in (("own", model), ("ours", ours)):
        _, dropout_rng = jax.random.split(jax.random.PRNGKey(33))  # main's
        state, _, p_train, _, p_eval = zoo33.clm_steps(m, ARGS, lr, dropout_rng)
        metrics = []
        for step in range(3):
            batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
            rows = np.roll(np.arange(2 * n), step)  # each step its own order of the rows
            state, metric = p_train(state, shard({k: v[rows] for k, v in batch.items()}))
            metrics.append(unreplicate(metric))
        evaluated = p_eval(state.params, shard({"input_ids": ids, "attention_mask": mask,
                                                "labels": ids}))  # fmt: skip
        runs[name] = (unreplicate(state.params), metrics, state.dropout_rng, evaluated)
    want, got = runs["own"], runs["ours"]
    assert float(want[1][-1]["loss"]) != float(want[1][0]["loss"])  # it trained
    assert float(want[1][0]["learning_rate"]) == 0.0 < float(want[1][1]["learning_rate"])
    _equal(got, want)


def _tokenizer(tr, words=89, extra=8):
    """A T5-like tokenizer built here (no download): pad 0, eos 1, unk 2, ``words`` words,
    then ``extra`` sentinels at the vocabulary's end, as T5's ``<extra_id_0>`` is last."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = ["<pad>", "</s>", "<unk>", *(f"w{i}" for i in range(words))]
    vocab += [f"<extra_id_{i}>" for i in reversed(range(extra))]
    model = WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>")
    return tr.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model), pad_token="<pad>",
                                      eos_token="</s>", unk_token="<unk>")  # fmt: skip


def _t5(tr, vocab_size, seed=0, **sizes):
    config = tr.T5Config(vocab_size=vocab_size, decoder_start_token_id=0, **{**T5_SMALL, **sizes})
    return tr.FlaxT5ForConditionalGeneration(config, seed=seed)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # theirs: below
def test_t5_mlm_collator_and_train_step_over_h_apply_equal_its_own(zoo, tmp_path):
    """run_t5_mlm_flax's collator masks spans of a batch (its lengths from
    ``compute_input_and_target_lengths``, sentinels counted down from ``len(tokenizer)``);
    its ``p_train_step`` three steps over ``h.apply`` (``input_ids``, ``decoder_input_ids``,
    a dropout rng per device) and ``p_eval_step`` over a loaded model's ``m.apply``: metrics,
    rngs and weights bitwise those over FlaxT5ForConditionalGeneration's own ``__call__``.
    Its ``p_eval_step`` donates the parameters (``donate_argnums=(0,)``), which an eval's
    metrics cannot reuse: JAX warns so over the model's own ``__call__`` too."""
    zoo33, tr = zoo
    tokenizer = _tokenizer(tr)
    model = _t5(tr, len(tokenizer))
    n = jax.local_device_count()
    expanded, targets = zoo33.compute_input_and_target_lengths(16, 0.15, 3.0)
    collator = zoo33.FlaxDataCollatorForT5MLM(
        tokenizer=tokenizer, noise_density=0.15, mean_noise_span_length=3.0, input_length=16,
        target_length=targets, pad_token_id=model.config.pad_token_id,
        decoder_start_token_id=model.config.decoder_start_token_id,
    )  # fmt: skip
    np.random.seed(33)  # the collator shuffles with numpy's global generator (main: set_seed)
    texts = np.random.randint(3, 92, (6 * n, expanded))
    batches = [
        collator([{"input_ids": texts[i]} for i in idx]).data
        for idx in zoo33.generate_batch_splits(np.arange(6 * n), 2 * n)
    ]
    first = batches[0]
    assert first["input_ids"].shape == (2 * n, 16)
    assert first["labels"].shape == (2 * n, targets)
    assert (first["input_ids"] >= len(tokenizer) - 8).any()  # sentinels went in
    np.testing.assert_array_equal(first["decoder_input_ids"][:, 1:], first["labels"][:, :-1])

    def call(params, ids, dec, rng, train):
        return model.__call__(ids, decoder_input_ids=dec, params=params, dropout_rng=rng,
                              train=train).logits  # fmt: skip

    ours = _ours(model, ("input_ids", "decoder_input_ids"),
                 (first["input_ids"], first["decoder_input_ids"]), ("b, s", "b, t"),
                 tmp_path, call)  # fmt: skip
    lr = zoo33.create_learning_rate_fn(6 * n, 2 * n, 1, 1, 1e-3)
    runs = {}
    for name, m in (("own", model), ("ours", ours)):
        state, _, p_train, _, p_eval = zoo33.t5_steps(m, ARGS, lr)
        dropout_rngs = jax.random.split(jax.random.PRNGKey(42), n)
        metrics = []
        for batch in batches:
            state, metric, dropout_rngs = p_train(state, shard(dict(batch)), dropout_rngs)
            metrics.append(unreplicate(metric))
        params = unreplicate(state.params)
        evaluated = p_eval(jax.tree.map(jnp.copy, state.params), shard(dict(batches[0])))
        runs[name] = (params, metrics, dropout_rngs, evaluated)
    want, got = runs["own"], runs["ours"]
    assert float(want[1][-1]["loss"]) != float(want[1][0]["loss"])  # it trained
    _equal(got, want)


def test_t5_call_exported_with_symbolic_batch_and_lengths_answers_its_own(zoo, tmp_path):
    """``__call__(input_ids, decoder_input_ids)``'s logits exported with ``shapes=("b, s",
    "b, t")``: the loaded model's at two sizes each, and their gradients with respect to the
    weights, equal the model's own."""
    tr = zoo[1]
    model = _t5(tr, 100)
    ids = jax.random.randint(jax.random.key(331), (4, 8), 3, 100)
    dec = jax.random.randint(jax.random.key(332), (4, 5), 3, 100).at[:, 0].set(0)

    def logits(params, ids, dec):
        return model.__call__(ids, decoder_input_ids=dec, params=params).logits

    h = sm.hybridize(logits, model.params)
    close(h(ids, dec), logits(model.params, ids, dec), **TOL)
    sm.export(h, tmp_path / "m", example=(ids, dec), shapes=("b, s", "b, t"), vjp_order=1)
    m = sm.load(tmp_path / "m", allow=ALLOW)
    for a, b in ((ids, dec), (ids[:3, :6], dec[:3, :2])):
        close(m(np.asarray(a), np.asarray(b)), logits(model.params, a, b), **TOL)
    loss = lambda apply: lambda p: apply(p, ids, dec)[:, -1, 7].sum()  # noqa: E731
    close(jax.grad(loss(m.apply))(model.params), jax.grad(loss(logits))(model.params), **TOL)


def test_t5_decoder_over_every_feature(zoo, tmp_path):
    """T5's decoder (``model.decode``) as a function of the encoder's states, its
    ``decoder_input_ids`` fixed: every feature equals the model's own."""
    tr = zoo[1]
    model = _t5(tr, 100, seed=1, num_layers=1)  # a Hessian per row: one block each side
    dec = jax.random.randint(jax.random.key(333), (1, 4), 3, 100).at[:, 0].set(0)

    def decode(params, states):
        ids = jnp.broadcast_to(dec, (states.shape[0], dec.shape[1]))
        return model.decode(ids, (states,), params=params).logits

    x = jax.random.normal(jax.random.key(334), (4, 3, T5_SMALL["d_model"]))
    h = sm.hybridize(decode, model.params)
    every_feature(tmp_path, h, lambda s: decode(model.params, s), x, allow=ALLOW, **TOL)


def test_t5_greedy_generate_from_a_loaded_encoder_and_decode_step(zoo, tmp_path):
    """``model.generate(ids, do_sample=False)`` (its cache, its stop at eos) gives the tokens
    of a loaded encoder (symbolic batch and length) and a loaded decode step (the last
    position's argmax, symbolic decoded length) looped from ``decoder_start_token_id``."""
    tr = zoo[1]
    model = _t5(tr, 100, seed=2)
    ids = jax.random.randint(jax.random.key(335), (2, 7), 3, 100)
    want = np.asarray(model.generate(ids, max_new_tokens=6, do_sample=False).sequences)

    def encode(params, ids):
        return model.encode(ids, params=params).last_hidden_state

    def step(params, dec, states):
        return jnp.argmax(model.decode(dec, (states,), params=params).logits[:, -1], -1)

    sm.export(sm.hybridize(encode, model.params), tmp_path / "enc", example=(ids,),
              shapes=("b, s",))  # fmt: skip
    states = encode(model.params, ids)
    start = jnp.zeros((2, 1), jnp.int32)
    sm.export(sm.hybridize(step, model.params), tmp_path / "dec", example=(start, states),
              shapes=("b, t", f"b, s, {T5_SMALL['d_model']}"))  # fmt: skip
    enc, dec = (sm.load(tmp_path / p, allow=ALLOW) for p in ("enc", "dec"))
    states = enc(np.asarray(ids))
    tokens = np.zeros((2, 1), np.int32)
    for _ in range(want.shape[1] - 1):
        tokens = np.concatenate([tokens, np.asarray(dec(tokens, states))[:, None]], 1)
    done = np.cumsum(tokens == model.config.eos_token_id, 1) > 0  # generate pads after eos
    after = np.concatenate([np.zeros((2, 1), bool), done[:, :-1]], 1)
    np.testing.assert_array_equal(np.where(after, model.config.pad_token_id, tokens), want)


@pytest.fixture(scope="module")
def readme():
    """tests/zoo33b.py (dynamax's README): its Gaussian HMM, true parameters and sample.
    ``hmm.initialize`` samples tfp-nightly's Wishart, whose gamma sampler calls
    ``jnp.shape(None)``: JAX 0.10 warns that a future JAX will refuse it (theirs). dynamax's
    import sets ``jax_default_matmul_precision`` to float32 for the whole process (theirs):
    put back after this module, or every later test's matmuls in this worker change (and
    test_day_six's exports differ from a fresh process's, byte for byte)."""
    precision = jax.config.jax_default_matmul_precision
    pytest.importorskip("dynamax")
    import zoo33b

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "shape requires ndarray or scalar arguments")
        case = zoo33b.readme()
    yield case
    jax.config.update("jax_default_matmul_precision", precision)


def test_dynamax_hmm_log_prob_filter_and_smoother_hybridized_equal_their_own(readme):
    """The README's GaussianHMM: ``marginal_log_prob``, ``filter``'s filtered probabilities
    and ``smoother``'s smoothed ones (the README's call) as Hybrids of (params, emissions)
    over its 1,000 sampled steps equal dynamax's own, and so do their gradients with respect
    to the emission means."""
    hmm, params, _, emissions, _ = readme

    def inference(p, y):
        return (hmm.marginal_log_prob(p, y), hmm.filter(p, y).filtered_probs,
                hmm.smoother(p, y).smoothed_probs)  # fmt: skip

    h = sm.hybridize(inference, params)
    close(h(emissions), inference(params, emissions), **TOL)
    means = lambda f: lambda m: f(params._replace(emissions=params.emissions._replace(  # noqa: E731
        means=m)), emissions)[0]  # fmt: skip
    close(jax.grad(means(h.apply))(params.emissions.means),
          jax.grad(means(inference))(params.emissions.means), **TOL)  # fmt: skip


def test_dynamax_hmm_log_prob_over_every_feature(readme, tmp_path):
    """The README's GaussianHMM's ``marginal_log_prob`` under ``vmap`` over a batch of
    sequences (the README's ``vmap(partial(hmm.sample, ...))``, 12 steps each): every feature
    equals dynamax's own. (Not ``filter``: its probabilities are saturated at steps of this
    HMM's narrow emissions, where its second derivatives are round-off; under the suite's XLA
    flags JAX's own ``jacfwd(jacrev)`` and ``jacrev(jacrev)`` of it disagree there.)"""
    from functools import partial

    hmm, params, _, _, key2 = readme
    _, batch = jax.vmap(partial(hmm.sample, params, num_timesteps=12))(jax.random.split(key2, 4))

    def log_prob(p, y):
        return jax.vmap(partial(hmm.marginal_log_prob, p))(y)

    h = sm.hybridize(log_prob, params)
    allow = ALLOW | {"dynamic_slice", "dynamic_update_slice"}  # the scan over the steps
    allow |= {"custom_call:lapack_spotrf_ffi", "custom_call:lapack_strsm_ffi"}  # Cholesky
    every_feature(tmp_path, h, lambda y: log_prob(params, y), batch, allow=allow, **TOL)
