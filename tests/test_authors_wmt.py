"""flax examples/wmt's decoding, as train.py runs it (tests/wmt.py): ``predict_step`` encodes
(``method=Transformer.encode``) and beam-searches a ``lax.while_loop`` whose body applies the
one-step decoder (``method=Transformer.decode``, ``mutable=["cache"]``) to a cache it threads.
The whole translation is hybridized, exported and served; the one-step decoder (decode.py's
``tokens_ids_to_logits``, its params split off) exports as the refusals on the way say, and
the beam search driven by the loaded step translates as ``predict_step`` does. Its
Transformer's ``__call__`` (two int token inputs, 0 pads masked; dropout in training, the eval
config served) runs over every feature test_authors_matrix.py runs over MATRIX (its test
functions, called here: about twice lm1b's time, too long for the default selection)."""

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_authors_matrix as matrix
import wmt
from helpers import Case, _ints
from test_authors_matrix import exported, loaded  # noqa: F401 - the matrix's fixtures

import symjax_mlp as sm

pytestmark = pytest.mark.slow
#: train.py's config, tiny; its eval_config is config.replace(deterministic=True)
WMT = wmt.TransformerConfig(vocab_size=8, output_vocab_size=8, emb_dim=8, num_heads=2,
                            num_layers=1, qkv_dim=8, mlp_dim=8, max_len=16)  # fmt: skip
MAX_DECODE_LEN, EOS_ID, BEAMS = 5, wmt.EOS_ID, 4
CONFIG = WMT.replace(deterministic=True, decode=True)  # train.py's predict_config
#: what a translation's artifact holds: the beam search's while loop, top_k's sort, gathers
TRANSLATE_OPS = {"dynamic_gather", "dynamic_slice", "dynamic_update_slice", "gather",
                 "real_dynamic_slice", "sort", "while"}  # fmt: skip


@functools.cache
def wmt_variables():
    """train.py's: ``jax.jit(m.init)`` of the eval model on float ones."""
    model = wmt.Transformer(WMT.replace(deterministic=True))
    ones = jnp.ones((2, 6), jnp.float32)
    return jax.jit(model.init)(jax.random.key(0), ones, ones)


def _wmt(mode: str):
    config = WMT if mode == "train" else WMT.replace(deterministic=True)
    return lambda: (wmt.Transformer(config), wmt_variables())


CASES = (
    Case("wmt", "linen", _wmt("train"), lambda s: (_ints(s, (2, 6), 8), _ints(s + 50, (2, 6), 8)),
         rng=jax.random.key(3), served=_wmt("eval"),
         allow=frozenset({"dynamic_gather", "gather", "scatter"})),
)  # fmt: skip
MODES = [(c, m) for c in CASES for m in ("train", "eval")]


@pytest.mark.parametrize(("case", "mode"), MODES, ids=[f"{c.name}-{m}" for c, m in MODES])
def test_compiled_equals_eager_equals_flax(case, mode):
    matrix.test_compiled_equals_eager_equals_the_plain_framework(case, mode)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_grads_stage_and_graph(case):
    matrix.test_grads_through_apply_equal_the_frameworks(case)
    matrix.test_stage_and_graph_count_the_same_layers(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_export_load_batcher_vmap_grad_and_timeit(case, exported, loaded, tmp_path, monkeypatch):  # noqa: F811
    matrix.test_export_loads_in_jax_and_iree_as_the_source(case, exported, tmp_path, monkeypatch)
    matrix.test_a_batcher_on_the_artifact_and_on_the_hybrid_gives_the_direct_rows(case, loaded)
    matrix.test_vmap_and_grad_over_the_loaded_model_equal_the_sources(case, loaded)
    matrix.test_timeit_times_the_hybrid_and_the_loaded_model(case, loaded)


def _inputs(seed: int, rows: int = 2) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (rows, 6), 1, 8, jnp.int32)


def translate(params, inputs):
    """train.py's p_pred_step (pmap of predict_step) on one device, the cache made as
    translate_and_calculate_bleu makes it (p_init_cache of the batch)."""
    cache = wmt.initialize_cache(inputs, MAX_DECODE_LEN, CONFIG)
    return wmt.predict_step(inputs, params, cache, EOS_ID, MAX_DECODE_LEN, CONFIG, BEAMS)


def decode_step(params, encoded, raw_inputs, flat_ids, flat_cache):
    """predict_step's tokens_ids_to_logits, its params an argument (not closed over)."""
    flat_logits, new_vars = wmt.Transformer(CONFIG).apply(
        {"params": params, "cache": flat_cache}, encoded, raw_inputs, flat_ids,
        mutable=["cache"], method=wmt.Transformer.decode)  # fmt: skip
    return flat_logits.squeeze(axis=1), new_vars["cache"]


@functools.cache
def _params():
    """train.py's initial params, moved as training moves them (a unit normal each): at init,
    every sentence's translation is EOS alone."""
    leaves, tree = jax.tree.flatten(wmt_variables()["params"])
    keys = jax.random.split(jax.random.key(9), len(leaves))
    moved = (a + jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True))
    return tree.unflatten(list(moved))


def test_a_beam_search_translation_exports_and_serves_as_predict_step(tmp_path):
    params, inputs = _params(), _inputs(3, 3)
    want = jax.jit(translate)(params, inputs)
    assert len({tuple(r) for r in np.asarray(want)}) == 3  # three translations, not EOS alone
    h = sm.hybridize(translate, params)
    np.testing.assert_array_equal(h(inputs), want)
    np.testing.assert_array_equal(h.eager(inputs), want)
    sm.export(h, tmp_path / "m", example=inputs)
    m = sm.load(tmp_path / "m", allow=TRANSLATE_OPS)
    np.testing.assert_array_equal(m(np.asarray(inputs)), want)
    other = _inputs(2, 2)  # another batch than the export's
    np.testing.assert_array_equal(m(np.asarray(other)), jax.jit(translate)(params, other))
    with sm.serving.Batcher(m, max_batch=4) as b:  # each sentence a request, batched
        got = [f.result(30) for f in [b.submit(np.asarray(inputs[i : i + 1])) for i in range(3)]]
    np.testing.assert_array_equal(np.concatenate(got), want)


def test_the_one_step_decoder_exports_as_its_refusals_say_and_drives_the_beam_search(tmp_path):
    """The cache is a nested dict among the step's inputs: the refusal said to pass
    ``dict(zip(['decoder'], xs))`` as the only input (the three others dropped, the nesting
    lost), code that fails; now the dict rebuilt from its leaves, the others kept in place."""
    params, inputs = _params(), _inputs(3, 3)
    encoded = wmt.Transformer(CONFIG).apply({"params": params}, inputs,
                                            method=wmt.Transformer.encode)  # fmt: skip
    cache, ids = wmt.initialize_cache(inputs, MAX_DECODE_LEN, CONFIG), jnp.full((3, 1), 3)
    h = sm.hybridize(decode_step, params)
    dict_input = r"args\[3\] is a dict with keys \['decoder'\]"
    with pytest.raises(sm.SignatureError, match=dict_input) as e:
        sm.export(h, tmp_path / "m", example=(encoded, inputs, ids, cache))
    fix = "h.apply(params, x0, x1, x2, jax.tree.unflatten(tree, xs)), h.params)"
    assert fix in str(e.value) and "example=(x0, x1, x2, *leaves)" in str(e.value)
    leaves, tree = jax.tree.flatten(cache)

    def step(params, x0, x1, x2, *xs):  # as it says, and the output's refusal: a flat tuple
        return tuple(jax.tree.leaves(h.apply(params, x0, x1, x2, jax.tree.unflatten(tree, xs))))

    example = (encoded, inputs, ids, *leaves)
    with pytest.raises(sm.SignatureError, match=r"args\[3\] is a scalar.*shapes=") as e:
        sm.export(sm.hybridize(step, params), tmp_path / "m", example=example)
    shapes = tuple("b, ..." if x.ndim else None for x in example)  # the cache indices whole
    assert repr(shapes) in str(e.value)
    sm.export(sm.hybridize(step, params), tmp_path / "m", example=example, shapes=shapes)
    m = sm.load(tmp_path / "m", allow={"dynamic_slice", "dynamic_update_slice", "gather"})
    want, got, plain = cache, leaves, jax.jit(decode_step)
    for i in range(1, 4):  # each call on the cache the last returned, as the beam search does
        logits, want = plain(params, encoded, inputs, ids, want)
        out, *got = m(encoded, inputs, ids, *got)
        np.testing.assert_allclose(out, logits, rtol=1e-5, atol=1e-5)
        assert got[-1] == i  # posembed's cache index, one step on
    with pytest.raises(sm.ConfigError, match=r"input args\[3\] is int32\[\], without the batch"):
        sm.serving.Batcher(m, max_batch=4)  # the cache index is one for the batch: no merging

    beamed = [wmt.flat_batch_beam_expand(x, BEAMS) for x in (encoded, inputs)]

    def tokens_ids_to_logits(flat_ids, flat_cache):  # predict_step's, on the loaded step
        out, *new = m(*beamed, flat_ids, *jax.tree.leaves(flat_cache))
        return out, jax.tree.unflatten(tree, new)

    search = partial(wmt.beam_search, inputs, tokens_to_logits=tokens_ids_to_logits,
                     beam_size=BEAMS, eos_id=EOS_ID, max_decode_len=MAX_DECODE_LEN)  # fmt: skip
    seqs, _ = jax.jit(search)(cache)
    np.testing.assert_array_equal(seqs[:, -1, 1:], jax.jit(translate)(params, inputs))


def test_applys_own_keywords_in_a_call_of_a_linen_hybrid_are_refused_naming_what_runs():
    """``h(..., method=Transformer.decode)`` was refused as a function a call can neither trace
    nor key on, saying to mark it static (static_argnames=), whose call then fails;
    ``mutable=['cache']`` said to pass ``jnp.asarray(kwargs['mutable'])``; ``rngs=`` named
    only the inputs. Each now names apply's keyword and what runs instead."""
    params, inputs = _params(), _inputs(3, 3)
    cache, ids = wmt.initialize_cache(inputs, MAX_DECODE_LEN, CONFIG), jnp.full((3, 1), 3)
    encoded = wmt.Transformer(CONFIG).apply({"params": params}, inputs,
                                            method=wmt.Transformer.encode)  # fmt: skip
    h = sm.hybridize(wmt.Transformer(CONFIG), {"params": params, "cache": cache})
    said = r"^Transformer(\.eager|\.apply)?: method= is Transformer\.apply's own keyword, not"
    for call in (h, h.eager, partial(h.apply, h.params)):
        with pytest.raises(sm.ConfigError, match=said) as e:
            call(encoded, inputs, ids, method=wmt.Transformer.decode)
        assert "method=Transformer.decode, mutable=['cache'])" in str(e.value)
    with pytest.raises(sm.ConfigError, match=r"mutable= is Transformer\.apply's own keyword"):
        h(inputs, ids, mutable=["cache"])
    trained = sm.hybridize(wmt.Transformer(WMT), wmt_variables(), rngs=jax.random.key(0))
    with pytest.raises(sm.ConfigError, match=r"rngs= is .*give them once") as e:
        trained(inputs, inputs, rngs={"dropout": jax.random.key(1)})
    assert "rngs={'dropout': key}), variables)" in str(e.value)
    step = sm.hybridize(decode_step, params)  # the function the first names, as decode.py's
    want = jax.jit(decode_step)(params, encoded, inputs, ids, cache)
    np.testing.assert_allclose(step(encoded, inputs, ids, cache)[0], want[0], rtol=1e-5, atol=1e-5)
