"""flax examples/gemma (tests/gemma.py, as its authors wrote it), a Gemma 3 of two layers (one
sliding-window, one global; grouped-query attention, qk norms, soft caps) cut to a tiny size,
run over every feature: its forward (tokens, positions, no cache, a causal mask) hybridized,
drawn and exported with the batch and the sequence length symbolic; its one-token cache step
(the KV cache as ``Sampler._sample_step`` passes it) exported, loaded and driving the authors'
own ``Sampler`` to the tokens the plain model samples; a Batcher over the forward; ``jax.grad``
through the loaded step; and train.py's ``nnx_train_step`` against an optax loop over
``h.apply``."""

import functools

import gemma
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import symjax_mlp as sm

TOL = {"rtol": 2e-5, "atol": 2e-5}
#: the gemma3_1b preset, sizes cut (its two last attention types: sliding, then global)
CONFIG = gemma.TransformerConfig.gemma3_1b(
    num_layers=2, num_embed=32, embed_dim=16, hidden_dim=32, num_heads=4, head_dim=8,
    num_kv_heads=2, sliding_window_size=4, final_logit_softcap=30.0, attn_logits_soft_cap=50.0,
    attention_types=gemma.make_attention_layers_types(gemma.GEMMA3_ATTENTION_PATTERN[-2:], 2),
)  # fmt: skip
CACHE = 16  # the sampler's cache_size
OPS = {"dynamic_slice", "dynamic_update_slice", "gather", "real_dynamic_slice"}


def transformer() -> gemma.Transformer:
    """The model at init, its params moved (a unit normal each, as training moves them): at
    init its greedy samples repeat one token."""
    model = gemma.Transformer(CONFIG, rngs=nnx.Rngs(params=0))
    params = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(9), len(leaves))
    moved = [a + 0.5 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(tree, moved))
    return model


def batch(seed: int, rows: int = 2, length: int = 6) -> tuple[jax.Array, ...]:
    """Tokens (0 pads at the end of some rows), and train.py's eval_step inputs of them."""
    tokens = jax.random.randint(jax.random.key(seed), (rows, length), 1, CONFIG.num_embed)
    tokens = tokens.at[0, length - 2 :].set(0)
    mask = tokens > 0
    positions = gemma.build_positions_from_mask(mask)
    return tokens, positions, gemma.make_causal_attn_mask(mask)


class Vocab:
    """sentencepiece's interface, as Sampler calls it (a character per token)."""

    def pad_id(self):
        return 0

    def eos_id(self):
        return 1

    def bos_id(self):
        return 2

    def EncodeAsIds(self, text):  # sentencepiece's names
        return [3 + ord(c) % (CONFIG.num_embed - 3) for c in text]

    def DecodeIds(self, ids):
        return "".join(chr(96 + i) for i in ids)


def forward(h: sm.Hybrid) -> sm.Hybrid:
    """The module as export's refusal of its output (logits, None) says to export it."""
    return sm.hybridize(
        lambda params, *xs, **kw: tuple(jax.tree.leaves(h.apply(params, *xs, **kw))), h.params
    )


@functools.cache
def _step_parts():
    model = transformer()
    cache = model.init_cache(cache_size=CACHE, batch_size=2)
    leaves, tree = jax.tree.flatten(cache)
    return model, leaves, tree


def cache_step(h: sm.Hybrid, tree) -> sm.Hybrid:
    """The one-token step as the refusals say: the cache dict's leaves in its place, the output
    (logits, new cache) a flat tuple."""
    n = tree.num_leaves

    def step(params, x0, x1, *xs):
        out = h.apply(params, x0, x1, jax.tree.unflatten(tree, xs[:n]), *xs[n:])
        return tuple(jax.tree.leaves(out))

    return sm.hybridize(step, h.params)


def step_inputs(leaves, ends: int):
    """The first prompt token of each row, its position, and the sampler's mask at step ``ends``."""
    tokens, positions, _ = batch(0)
    mask = gemma._compute_attention_masks(jnp.int32(ends), CACHE, jnp.zeros((2, CACHE), bool))
    return tokens[:, :1], positions[:, :1], mask


@pytest.mark.slow
def test_the_forward_hybridizes_draws_exports_with_batch_and_length_symbolic_and_serves(tmp_path):
    model = transformer()
    tokens, positions, mask = batch(0)
    want, none = model(tokens, positions, None, mask)
    h = sm.hybridize(model)
    got = h(tokens, positions, None, mask)
    np.testing.assert_allclose(got[0], want, **TOL)
    assert none is None and got[1] is None
    np.testing.assert_allclose(h.eager(tokens, positions, None, mask)[0], want, **TOL)
    counts = h.graph(tokens, positions, None, mask).primitive_counts
    staged = sm.stage(model)(tokens, positions, None, mask).primitive_counts
    assert counts["dot_general"] == staged["dot_general"] >= 2 * 7 + 1  # 7 einsums a layer
    with pytest.raises(sm.SignatureError, match=r"returns PyTreeDef\(\(\*, None\)\)") as e:
        sm.export(h, tmp_path / "m", example=(tokens, positions, None, mask))
    assert "sm.hybridize(lambda params, *xs, **kw: tuple(jax.tree.leaves(h.apply(" in str(e.value)
    fwd, example = forward(h), (tokens, positions, None, mask)  # as it says: output (logits,)
    with pytest.raises(sm.ConfigError, match=r"args\[2\] \(None\) is a setting") as e:
        sm.export(fwd, tmp_path / "m", example=example, shapes=("b, l", "b, l", None, "b, l, l"))
    assert str(e.value).endswith("Pass shapes=('b, l', 'b, l', 'b, l, l').")  # was: "has 3 inputs"
    sm.export(fwd, tmp_path / "m", example=example, shapes=("b, l", "b, l", "b, l, l"))
    m = sm.load(tmp_path / "m", allow=OPS)
    for seed, rows, length in ((1, 3, 3), (2, 1, 9), (0, 2, 6)):
        xs = batch(seed, rows, length)
        (out,) = m(*map(np.asarray, xs))
        np.testing.assert_allclose(out, model(xs[0], xs[1], None, xs[2])[0], **TOL)
    stacked = [jnp.stack(xs) for xs in zip(batch(5), batch(6), strict=True)]  # 2 batches of 2
    (out,) = jax.vmap(m)(*stacked)
    for i in range(2):
        np.testing.assert_allclose(
            out[i], model(*(x[i] for x in stacked[:2]), None, stacked[2][i])[0], **TOL
        )
    with pytest.raises(
        sm.ConfigError, match=r"args\[0\] is int32\[b, l\], but .* its size l is symbolic"
    ):
        sm.serving.Batcher(m, max_batch=4)  # was: "Export ... with a symbolic batch", as it was
    sm.export(fwd, tmp_path / "b", example=(tokens, positions, None, mask))  # as it says
    m = sm.load(tmp_path / "b", allow=OPS)
    xs = tuple(map(np.asarray, batch(3, 3)))
    with sm.serving.Batcher(m, max_batch=4) as b:  # a row per request, batched
        got = [f.result(30) for f in [b.submit(*(x[i : i + 1] for x in xs)) for i in range(3)]]
    np.testing.assert_allclose(np.concatenate([g[0] for g in got]), m(*xs)[0], **TOL)


@pytest.mark.slow
def test_the_cache_step_exports_and_drives_the_authors_sampler_to_the_same_tokens(tmp_path):
    model, leaves, tree = _step_parts()
    h = sm.hybridize(model)
    token, position, mask = step_inputs(leaves, 0)
    with pytest.raises(sm.SignatureError, match=r"args\[2\] is a dict with keys \['layer_0'"):
        sm.export(
            h, tmp_path / "s", example=(token, position, jax.tree.unflatten(tree, leaves), mask)
        )
    kv = ("b", "b, s, 2, 8", "b, s, 2, 8")  # end_index, k, v of each layer, in leaf order
    shapes = ("b, 1", "b, 1", *kv * CONFIG.num_layers, "b, 1, s")
    sm.export(cache_step(h, tree), tmp_path / "s", example=(token, position, *leaves, mask),
              shapes=shapes)  # fmt: skip
    m = sm.load(tmp_path / "s", allow=OPS)

    class Served(nnx.Module):
        """The loaded step where Sampler wants a Transformer (what it reads of one)."""

        def __init__(self):
            self.step, self.num_embed, self.sow_config = m, model.num_embed, model.sow_config
            self.init_cache = functools.partial(gemma.Transformer.init_cache, model)

        def __call__(self, last_tokens, positions, cache, attention_mask):
            out = self.step(last_tokens, positions, *jax.tree.leaves(cache), attention_mask)
            return out[0], jax.tree.unflatten(jax.tree.structure(cache), out[1:])

    prompts = ["Paris is", "Flax is a", "ab"]  # three rows, as the sampler pads them
    want = gemma.Sampler(vocab=Vocab(), cache_size=CACHE, transformer=model)(prompts, 6)
    got = gemma.Sampler(vocab=Vocab(), cache_size=CACHE, transformer=Served())(
        prompts, 6, dtype=jnp.float32
    )
    assert got.tokens == want.tokens and len({t[0] for t in want.tokens}) > 1
    for a, b in zip(got.logits, want.logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_grad_through_the_loaded_step_equals_the_sources(tmp_path):
    """A loss of the next token's log-probability, differentiated w.r.t. the cache's keys and
    values (five tokens in), through the loaded step (vjp_order=1) and through the source."""
    model, leaves, tree = _step_parts()
    step = cache_step(sm.hybridize(model), tree)
    token, position, mask = step_inputs(leaves, 5)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    kv = [jnp.full_like(x, 5) if x.dtype == jnp.int32 else jax.random.normal(k, x.shape)
          for k, x in zip(keys, leaves, strict=True)]  # fmt: skip
    sm.export(step, tmp_path / "g", example=(token, position, *kv, mask), vjp_order=1)
    m = sm.load(tmp_path / "g", allow=OPS | {"scatter"})  # the VJP's scatter, as load says

    def loss(run, *floats):
        given = iter(floats)  # the keys and values, in place; the end indices as they are
        xs = [next(given) if x.dtype == jnp.float32 else x for x in kv]
        logits = run(token, position, *xs, mask)[0]
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3])

    floats = [x for x in kv if x.dtype == jnp.float32]
    argnums = tuple(range(1, len(floats) + 1))
    want = jax.grad(loss, argnums=argnums)(lambda *a: step.apply(step.params, *a), *floats)
    got = jax.grad(loss, argnums=argnums)(m, *floats)
    assert all(float(jnp.abs(w).max()) > 1e-3 for w in want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_training_over_h_apply_equals_the_authors_nnx_train_step():
    """train.py's optimizer (adamw of its warmup-then-rsqrt schedule) and nnx_train_step on
    three batches, against the same optax transform over ``h.apply``'s params."""

    def tx():
        lr = gemma.create_learning_rate_schedule(learning_rate=0.0016, warmup_steps=2)
        return optax.adamw(lr, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)

    batches = []
    for seed in range(3):
        tokens, positions, _ = batch(seed, 2, 7)
        batches.append({"inputs": tokens[:, :-1], "inputs_position": positions[:, :-1],
                        "targets": tokens[:, 1:]})  # fmt: skip
    model, ours = transformer(), transformer()
    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    rngs = nnx.Rngs(params=0, dropout=0)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
    train_step = nnx.jit(gemma.nnx_train_step, static_argnames=("label_smoothing", "pad_id"))
    for b in batches:
        train_step(model, optimizer, rngs, b, metrics, 0.0, 0)

    h = sm.hybridize(ours)

    def loss(params, b):
        input_mask = b["inputs"] > 0
        mask = gemma.make_causal_attn_mask(input_mask)
        logits, _ = h.apply(params, b["inputs"], b["inputs_position"], None, mask)
        weights = input_mask.astype(jnp.float32)
        return gemma.compute_weighted_cross_entropy(logits, b["targets"], weights).mean()

    params, opt = h.params, tx()
    state = opt.init(params)
    for b in batches:
        grads = jax.jit(jax.grad(loss))(params, b)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    tokens, positions, mask = batch(4)
    want = model(tokens, positions, None, mask)[0]
    got = h.replace(params=params)(tokens, positions, None, mask)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert float(jnp.abs(want - h(tokens, positions, None, mask)[0]).max()) > 1e-2  # trained


@pytest.mark.slow  # an export: about a second
def test_a_batcher_over_an_artifact_with_a_symbolic_size_beside_the_batch_names_what_serves(
    tmp_path,
):
    """A Batcher over an artifact exported with ``shapes=("b, l", ...)`` said to export it with
    a symbolic batch, which it has; now it names the size and what serves (the loaded model
    called directly, or one artifact per size)."""
    h = sm.hybridize(lambda p, t, x: (t * p + x).sum(-1), 2)
    sm.export(h, tmp_path / "m", example=(jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3))),
              shapes=("b, l", "b, l"))  # fmt: skip
    m = sm.load(tmp_path / "m")
    said = r"args\[0\] is int32\[b, l\], but .* the batch 'b', and its size l is symbolic.*directly"
    with pytest.raises(sm.ConfigError, match=said):
        sm.serving.Batcher(m, max_batch=4)
    np.testing.assert_allclose(m(np.ones((1, 5), np.int32), np.ones((1, 5), np.float32)), [15.0])


class Pair(nnx.Module):
    """A forward as Gemma's: ``(out, None)`` where it is given no cache."""

    def __init__(self):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def __call__(self, x, cache):
        return self.lin(x), cache


@pytest.mark.slow  # two exports: about a second
def test_a_modules_tree_output_and_a_spec_for_a_setting_are_refused_naming_what_exports(tmp_path):
    """An nnx module returning ``(y, None)``: export said to return ``tuple(jax.tree.leaves(
    out))`` "from the function you export", a module's output no function of the user's; now
    the code (over ``h.apply``). Exported with ``example=(x, None)``, a spec per example item
    was refused as "the example has 1 input(s)"; now it names the None a setting and the
    shapes= to pass."""
    h, x = sm.hybridize(Pair()), jnp.ones((2, 3))
    with pytest.raises(sm.SignatureError, match=r"returns PyTreeDef\(\(\*, None\)\)") as e:
        sm.export(h, tmp_path / "m", example=(x, None))
    code = "lambda params, *xs, **kw: tuple(jax.tree.leaves(h.apply(params, *xs, **kw))), h.params)"
    assert f"sm.hybridize({code}" in str(e.value)  # forward's, here
    assert "the leaves of PyTreeDef((*, None)) in order" in str(e.value)
    flat = forward(h)
    said = r"one spec per input array, and the example has 1: args\[1\] \(None\) is a setting"
    with pytest.raises(sm.ConfigError, match=said) as e:
        sm.export(flat, tmp_path / "m", example=(x, None), shapes=("b, 3", None))
    assert str(e.value).endswith("Pass shapes=('b, 3',).")
    sm.export(flat, tmp_path / "m", example=(x, None), shapes=("b, 3",))
    (y,) = sm.load(tmp_path / "m")(np.ones((4, 3), np.float32))
    np.testing.assert_allclose(y, h(jnp.ones((4, 3)), None)[0], **TOL)


@pytest.mark.slow  # three exports: about two seconds
def test_an_embedding_lookup_keeps_rows_apart_and_a_gather_across_rows_does_not(tmp_path):
    """Gemma's first op, ``nnx.Embed``'s gather of a table at each row's tokens, was "not known
    to keep rows apart": every token model's rows ran one request at a time under a Batcher and
    ``jax.vmap`` of the loaded model called it once per example. A gather from a table (no row)
    at indices of the batch axis now keeps that axis; one from the rows stays refused."""
    table = jax.random.normal(jax.random.key(0), (7, 3))
    tokens = jax.random.randint(jax.random.key(1), (2, 4, 5), 0, 7)
    lookups = {
        "embed": (lambda p, t: jnp.take(p, t, axis=0).sum(1), True),
        "embed-t": (lambda p, t: jnp.take(p, t.T, axis=0).sum(0), True),  # batch axis 1 of idx
        "rows": (lambda p, t: jnp.take(p[t].sum(1), t[:, 0] % t.shape[0], axis=0), False),
    }
    for name, (fn, apart) in lookups.items():
        h = sm.hybridize(fn, table)
        sm.export(h, tmp_path / name, example=tokens[0])
        m = sm.load(tmp_path / name, trust=True)
        rows = m.manifest["rows"]
        assert rows["independent"] is apart, (name, rows)
        assert apart or "gather" in rows["why"]
        want = jnp.stack([h(t) for t in tokens])
        np.testing.assert_allclose(jax.vmap(m)(tokens), want, **TOL)
        requests = [np.asarray(t[i : i + 1]) for t in tokens for i in range(4)]
        with sm.serving.Batcher(m, max_batch=8) as b:  # merged where rows are apart
            got = np.concatenate([f.result(30) for f in [b.submit(r) for r in requests]])
        np.testing.assert_allclose(got, np.concatenate([m(r) for r in requests]), **TOL)
        assert np.allclose(got, want.reshape(8, 3), **TOL) is apart  # a row alone: its own mix
