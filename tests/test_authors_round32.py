"""Code we did not write, round thirty-two (tests/zoo32.py; sources and commits there):
Hugging Face Transformers' Flax models (transformers 4.57.6), built from small configs with
random weights, through every door.

- ``FlaxBertForSequenceClassification``'s ``__call__`` as a function of (params, input_ids,
  attention_mask): exported with a symbolic batch and sequence length, the loaded logits at
  two lengths and their gradients with respect to the weights equal the model's own.
- run_flax_glue.py's ``train_step`` (its ``TrainState``, adamw under a mask, dropout rng,
  ``pmean`` under ``jax.pmap`` as ``main`` runs it) with ``apply_fn`` a Hybrid's ``h.apply``:
  three steps' losses, learning rates and weights equal those of the model's own ``__call__``;
  its ``eval_step`` over a loaded model's ``m.apply`` equal too.
- ``FlaxGPT2LMHeadModel.generate`` (greedy): a decode step (the last position's argmax)
  exported with a symbolic sequence length (``constraints=("t <= 32",)``: its causal mask
  is n_positions long) and looped from the loaded model gives the same tokens; so does its
  cache-carrying ``__call__`` (``init_cache``, ``past_key_values``' leaves by place), one
  token a call.
- ``FlaxViTForImageClassification`` at inference over every feature (a Batcher included) and
  ``symjax-mlp run`` on .npy files.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from features import close, every_feature
from flax.jax_utils import replicate, unreplicate

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each builds a transformer and compiles it (> 0.5 s)

TOL = {"rtol": 1e-4, "atol": 1e-5}
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
IDS = jax.random.randint(jax.random.key(320), (4, 8), 0, 100)
MASK = jnp.ones((4, 8), jnp.int32).at[1, 6:].set(0)
ALLOW = {"gather", "dynamic_gather", "scatter", "real_dynamic_slice"}  # embeddings, masks


@pytest.fixture(scope="module")
def zoo():
    """tests/zoo32.py and transformers, imported by the tests that run (~5 s: not at the
    default selection's collection)."""
    import zoo32  # imports transformers under a filter of its Flax deprecation warning

    return zoo32, zoo32.transformers


def _bert(tr, num_labels=2):
    config = tr.BertConfig(vocab_size=100, intermediate_size=64, num_labels=num_labels, **SMALL)
    return tr.FlaxBertForSequenceClassification(config, seed=0)


def test_bert_call_exported_with_symbolic_batch_and_length_answers_its_own(zoo, tmp_path):
    """``model.__call__(input_ids, attention_mask, params=...)``'s logits: the Hybrid's, the
    loaded artifact's (``shapes=("b, t", "b, t")``) at 8 and 5 tokens, and the gradient of
    the loaded logits with respect to the weights, equal the model's own."""
    model = _bert(zoo[1])

    def logits(params, ids, mask):
        return model.__call__(ids, mask, params=params, train=False).logits

    h = sm.hybridize(logits, model.params)
    close(h(IDS, MASK), model(IDS, MASK).logits, **TOL)
    sm.export(h, tmp_path / "m", example=(IDS, MASK), shapes=("b, t", "b, t"), vjp_order=1)
    m = sm.load(tmp_path / "m", allow=ALLOW)
    for ids, mask in ((IDS, MASK), (IDS[:3, :5], MASK[:3, :5])):
        close(m(np.asarray(ids), np.asarray(mask)), model(ids, mask).logits, **TOL)
    loss = lambda apply: lambda p: apply(p, IDS, MASK)[:, 1].sum()  # noqa: E731
    close(jax.grad(loss(m.apply))(model.params), jax.grad(loss(logits))(model.params), **TOL)


def _state(zoo32, apply_fn, params, lr):
    model = type("Shim", (), {})()  # create_train_state reads model.__call__ and model.params
    model.__call__, model.params = apply_fn, params
    return zoo32.create_train_state(model, lr, False, num_labels=3, weight_decay=0.01)


def test_glue_train_step_over_h_apply_equals_its_own(zoo, tmp_path):
    """run_flax_glue's ``p_train_step`` (pmap, pmean, dropout, adamw under its decay mask)
    three steps over ``apply_fn`` calling ``h.apply``: losses, learning rates, dropout rngs
    and weights equal those over the model's own ``__call__``; ``p_eval_step`` over a loaded
    model's ``m.apply`` with the trained weights predicts the same labels."""
    zoo32, tr = zoo
    model = _bert(tr, num_labels=3)
    lr = zoo32.create_learning_rate_fn(12, 4, 3, 1, 1e-3)

    def forward(params, ids, mask, rng):
        return model.__call__(ids, mask, params=params, dropout_rng=rng, train=True).logits

    h = sm.hybridize(forward, model.params)
    h_eval = sm.hybridize(
        lambda p, ids, mask: model.__call__(ids, mask, params=p).logits, model.params
    )
    sm.export(h_eval, tmp_path / "e", example=(IDS, MASK))
    m = sm.load(tmp_path / "e", allow=ALLOW)

    def ours(input_ids, attention_mask, params, dropout_rng=None, train=False):
        if train:
            return (h.apply(params, input_ids, attention_mask, dropout_rng),)
        return (m.apply(params, input_ids, attention_mask),)

    _, p_train, _, p_eval = zoo32.make_steps(lr)
    n = jax.local_device_count()  # main's batches are sharded over the local devices
    rows = lambda a: jnp.stack([a] * n)  # noqa: E731 - each device the same rows
    labels = jnp.array([0, 2, 1, 2])
    runs = {}
    for name, apply_fn in (("own", model.__call__), ("h", ours)):
        state = replicate(_state(zoo32, apply_fn, model.params, lr))
        rngs = jax.random.split(jax.random.PRNGKey(3), n)
        metrics = []
        for _ in range(3):
            batch = {"input_ids": rows(IDS), "attention_mask": rows(MASK), "labels": rows(labels)}
            state, metric, rngs = p_train(state, batch, rngs)
            metrics.append(unreplicate(metric))
        preds = p_eval(state, {"input_ids": rows(IDS), "attention_mask": rows(MASK)})
        runs[name] = (unreplicate(state).params, metrics, rngs, preds)
    want, got = runs["own"], runs["h"]
    assert float(want[1][-1]["loss"]) != float(want[1][0]["loss"])  # it trained
    close(got[0], want[0], **TOL)
    close(got[1:3], want[1:3], **TOL)
    np.testing.assert_array_equal(got[3], want[3])


def test_gpt2_greedy_generate_equals_a_loaded_decode_step_looped(zoo, tmp_path):
    """``model.generate(ids, do_sample=False)``'s new tokens equal a loop over a loaded
    decode step (logits at the last position, argmax) of symbolic batch and length."""
    tr = zoo[1]
    config = tr.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = tr.FlaxGPT2LMHeadModel(config, seed=1)
    prompt = IDS[:2, :5]
    want = model.generate(prompt, max_new_tokens=6, do_sample=False).sequences

    def step(params, ids):
        return jnp.argmax(model.__call__(ids, params=params).logits[:, -1], -1)

    h = sm.hybridize(step, model.params)
    sm.export(
        h, tmp_path / "g", example=(prompt,), shapes=("b, t",), constraints=("t <= 32",)
    )  # its causal mask is n_positions long
    m = sm.load(tmp_path / "g", allow=ALLOW)
    ids = np.asarray(prompt)
    for _ in range(6):
        ids = np.concatenate([ids, np.asarray(m(ids))[:, None].astype(ids.dtype)], 1)
    np.testing.assert_array_equal(ids, want)


def test_vit_over_every_feature_and_symjax_mlp_run(zoo, tmp_path):
    """``FlaxViTForImageClassification`` at inference (logits of pixel values): every
    feature equals the model's own; ``symjax-mlp run`` on .npy files answers the same."""
    from symjax_mlp.cli import main

    tr = zoo[1]
    config = tr.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, intermediate_size=64, num_labels=3, **SMALL
    )
    model = tr.FlaxViTForImageClassification(config, seed=2)
    x = jax.random.normal(jax.random.key(321), (4, 3, 8, 8))
    h = sm.hybridize(lambda p, x: model.__call__(x, params=p).logits, model.params)
    allow = {"convolution", "dynamic_gather", "scatter", "real_dynamic_slice"}  # the patches
    every_feature(tmp_path, h, lambda x: model(x).logits, x, allow=allow, **TOL)
    np.save(tmp_path / "x.npy", np.asarray(x[:3]))
    argv = [
        "run",
        str(tmp_path / "m"),
        "--input",
        str(tmp_path / "x.npy"),
        *(a for op in sorted(allow) for a in ("--allow", op)),
    ]
    assert main([*argv, "--output", str(tmp_path / "y.npy")]) == 0
    close(np.load(tmp_path / "y.npy"), model(x[:3]).logits, **TOL)


def test_gpt2_cache_carrying_decode_step_loaded_and_looped_equals_greedy_generate(zoo, tmp_path):
    """GPT-2's ``__call__`` with ``init_cache``'s ``past_key_values``, one token a call, its
    cache's leaves in and out by place (as export's refusal of the dict says): loaded and
    looped over the prompt then its own argmax, the tokens of ``model.generate`` (greedy)."""
    tr = zoo[1]
    config = tr.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = tr.FlaxGPT2LMHeadModel(config, seed=1)
    prompt = IDS[:1, :5]
    want = model.generate(prompt, max_new_tokens=6, do_sample=False).sequences
    leaves, tree = jax.tree.flatten(model.init_cache(1, 16))
    mask = jnp.ones((1, 16), jnp.int32)

    def step(params, token, pos, *cache):
        out = model.__call__(token, mask, pos, params=params,
                             past_key_values=jax.tree.unflatten(tree, cache))  # fmt: skip
        return (jnp.argmax(out.logits[:, -1], -1), *jax.tree.leaves(out.past_key_values))

    h = sm.hybridize(step, model.params)
    example = (prompt[:, :1], jnp.zeros((1, 1), jnp.int32), *leaves)
    sm.export(h, tmp_path / "d", example=example, batch=None)
    m = sm.load(tmp_path / "d", allow=ALLOW | {"dynamic_slice", "dynamic_update_slice"})
    tokens, cache = list(np.asarray(prompt[0])), [np.asarray(x) for x in leaves]
    for i in range(prompt.shape[1] + 5):
        token = np.array([[tokens[i]]], np.int32)
        nxt, *cache = m(token, np.array([[i]], np.int32), *cache)
        if i >= prompt.shape[1] - 1:
            tokens.append(int(nxt[0]))
    np.testing.assert_array_equal(tokens, np.asarray(want[0]))
