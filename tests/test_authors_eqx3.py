"""Equinox code we did not write, round three: three more of equinox's own examples, as their
docstrings write them (patrick-kidger/equinox@9336d820b2ef66b360fc6cb3611b3da5cefbb14d), run
over every feature test_authors_matrix.py runs over MATRIX (its test functions, called here on
these cases), and what each stresses apart.

- ``eqx_shared``: equinox/nn/_shared.py, ``eqx.nn.Shared``'s docstring: a language model whose
  embedding matrix is its unembedding's weight, one array in two places (docs/faq.md, "How to
  share a layer across two parts of a model?").
- ``eqx_inference``: equinox/nn/_inference.py, ``eqx.nn.inference_mode``'s docstring: a
  BatchNorm's state (``ctx``), a Dropout's key and a Linear in one model, trained with its state
  threaded and served switched by ``inference_mode``.
- ``eqx_rope``: equinox/nn/_embedding.py, ``eqx.nn.RotaryPositionalEmbedding``'s docstring: a
  ``MultiheadAttention`` with a mask, its heads rotated by ``process_heads``.

The ``...`` the docstrings leave are filled with the smallest sizes that run. Apart: the tied
weight as one param, one tensor, trained as equinox trains it and loaded by ``params=``; the
stateful model trained over ``h.apply`` as equinox trains it; RoPE's sequence made symbolic.
"""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
import safetensors.numpy
import test_authors_matrix as matrix
from helpers import Case, _ints, _x
from test_authors_matrix import exported, loaded  # noqa: F401 - the matrix's fixtures

import symjax_mlp as sm

TOL = {"rtol": 2e-5, "atol": 2e-5}


# -- equinox/nn/_shared.py, Shared's docstring: the embedding and unembedding tied --------------
class LanguageModel(eqx.Module):
    shared: eqx.nn.Shared

    def __init__(self):
        embedding = eqx.nn.Embedding(16, 8, key=jr.key(0))  # Embedding(...): 16 tokens, 8 wide
        linear = eqx.nn.Linear(8, 16, key=jr.key(1))  # Linear(...)
        # These two weights will now be tied together.
        where = lambda embed_and_lin: embed_and_lin[1].weight  # noqa: E731
        get = lambda embed_and_lin: embed_and_lin[0].weight  # noqa: E731
        self.shared = eqx.nn.Shared((embedding, linear), where, get)

    def __call__(self, tokens):
        # Expand back out so we can evaluate these layers.
        embedding, linear = self.shared()
        assert embedding.weight is linear.weight  # same parameter!
        # Now go ahead and evaluate your language model.
        values = jax.vmap(embedding)(tokens)
        # ...  # other layers, probably
        return jax.vmap(linear)(values)


# -- equinox/nn/_inference.py, inference_mode's docstring: BatchNorm, Dropout, Linear ------------
class Model(eqx.Module):
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    linear: eqx.nn.Linear

    def __init__(self, key):
        key1, key2 = jax.random.split(key)  # noqa: RUF059 - key1 was BatchNorm's (no key= now)
        # the docstring's BatchNorm(3, "batch", key=key1): BatchNorm takes no key (equinox
        # 0.13 raises TypeError), and its mode is asked for, as examples/stateful.ipynb gives it
        self.norm = eqx.nn.BatchNorm(3, "batch", mode="batch")
        self.dropout = eqx.nn.Dropout(0.4)
        self.linear = eqx.nn.Linear(3, 1, key=key2)

    def __call__(self, x, ctx, *, key):
        x, ctx = self.norm(x, ctx)
        x = self.dropout(x, key=key)
        x = self.linear(x)
        return x, ctx


def ctx_batch(model, x, ctx, *, key=None):
    """A batch through the model as examples/stateful.ipynb runs one (the batch axis named for
    BatchNorm, one state for the batch), a dropout key per example as examples/bert.ipynb
    splits them."""
    keys = jax.random.split(key, x.shape[0]) if key is not None else None
    run = jax.vmap(lambda x, ctx, key: model(x, ctx, key=key), axis_name="batch",
                   in_axes=(0, None, 0), out_axes=(0, None))  # fmt: skip
    return run(x, ctx, keys)


def infer(model, x):
    """Inference with the state held in the model (discarded), no key: Dropout in inference
    mode draws none."""
    out, _ = jax.vmap(model)(x)
    return out


def _inference():
    training_model, ctx = eqx.nn.make_with_state(Model)(jax.random.PRNGKey(0))
    return training_model, ctx


def _inference_served():
    training_model, ctx = _inference()
    for i in range(2):  # its state moved, as after training
        _, ctx = ctx_batch(training_model, _x(70 + i, (4, 3)), ctx, key=jr.key(i))
    inference_model = eqx.nn.inference_mode(training_model)
    return infer, eqx.Partial(inference_model, ctx=ctx, key=None)


# -- equinox/nn/_embedding.py, RotaryPositionalEmbedding's docstring: rotated heads, masked ------
class TransformerBlock(eqx.Module):
    rope_embeddings: eqx.nn.RotaryPositionalEmbedding
    mha_attention: eqx.nn.MultiheadAttention

    def __init__(self, key):
        self.rope_embeddings = eqx.nn.RotaryPositionalEmbedding(4)  # its heads' qk_size
        self.mha_attention = eqx.nn.MultiheadAttention(2, 8, key=key)  # 2 heads, 8 wide

    def __call__(self, x, mask):
        def process_heads(query_heads, key_heads, value_heads):
            query_heads = jax.vmap(self.rope_embeddings, in_axes=1, out_axes=1)(query_heads)
            key_heads = jax.vmap(self.rope_embeddings, in_axes=1, out_axes=1)(key_heads)

            return query_heads, key_heads, value_heads

        x = self.mha_attention(x, x, x, mask=mask, process_heads=process_heads)
        return x


def _rope_inputs(seed: int) -> tuple[jax.Array, jax.Array]:
    """Six tokens of 8 features, a causal mask that also hides the padding at the end."""
    valid = jnp.arange(6) < 6 - seed % 3
    mask = jnp.tril(jnp.ones((6, 6), bool)) & valid[None, :] & valid[:, None]
    mask = mask | jnp.eye(6, dtype=bool)  # each token sees itself: no row all masked
    return _x(seed, (4, 6, 8)), jnp.broadcast_to(mask, (4, 6, 6))


CASES = (
    Case("eqx_shared", "eqx", lambda: (eqx.filter_vmap(LanguageModel()), None),
         lambda s: (_ints(s, (2, 6), 16),), allow=frozenset({"gather", "scatter"})),
    Case("eqx_inference", "eqx", lambda: (ctx_batch, _inference()[0]),
         lambda s: (_x(s, (4, 3)),), train={"key": jr.key(1)}, carry=lambda: _inference()[1],
         served=_inference_served),
    Case("eqx_rope", "eqx", lambda: (eqx.filter_vmap(TransformerBlock(jr.key(0))), None),
         _rope_inputs, allow=frozenset({"real_dynamic_slice"})),
)  # fmt: skip
IDS = [c.name for c in CASES]
MODES = [(c, m) for c in CASES for m in ("train", "eval") if m == "train" or c.eval or c.served]


# -- the matrix's features over these cases -----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("case", "mode"), MODES, ids=[f"{c.name}-{m}" for c, m in MODES])
def test_compiled_equals_eager_equals_equinox(case, mode):
    matrix.test_compiled_equals_eager_equals_the_plain_framework(case, mode)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grads_through_apply_equal_equinoxs(case):
    matrix.test_grads_through_apply_equal_the_frameworks(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stage_and_graph_count_the_same_layers(case):
    matrix.test_stage_and_graph_count_the_same_layers(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_export_loads_in_jax_and_iree_as_the_source(case, exported, tmp_path, monkeypatch):  # noqa: F811
    matrix.test_export_loads_in_jax_and_iree_as_the_source(case, exported, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_batcher_gives_the_direct_rows(case, loaded):  # noqa: F811
    matrix.test_a_batcher_on_the_artifact_and_on_the_hybrid_gives_the_direct_rows(case, loaded)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_vmap_and_grad_over_the_loaded_model(case, loaded):  # noqa: F811
    matrix.test_vmap_and_grad_over_the_loaded_model_equal_the_sources(case, loaded)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_timeit_times_the_hybrid_and_the_loaded_model(case, loaded):  # noqa: F811
    matrix.test_timeit_times_the_hybrid_and_the_loaded_model(case, loaded)


# -- eqx.nn.Shared: one array in two places, in the params, the grads, the artifact, training -----
def _shared_steps(h, x, n=3):
    """Adam over h.apply, as train()'s refusal names it, and over the model as equinox trains it
    (eqx.filter_grad, eqx.apply_updates): ``(params, model)`` after ``n`` steps."""
    opt, model = optax.adam(1e-2), eqx.filter_vmap(LanguageModel())

    def loss(out):
        return jnp.mean(out**2)

    params, state = h.params, opt.init(h.params)
    theirs = opt.init(eqx.filter(model, eqx.is_inexact_array))
    for _ in range(n):
        grads = jax.grad(lambda p: loss(h.apply(p, x)))(params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        grads = eqx.filter_grad(lambda m: loss(m(x)))(model)
        updates, theirs = opt.update(grads, theirs, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
    return params, model


@pytest.mark.slow
def test_a_tied_weight_is_one_param_trained_exported_and_loaded_as_one(tmp_path):
    """The embedding and unembedding share one array: one leaf of h.params, its grads summed
    over both uses (equinox's), one tensor in params.safetensors; the trained params given to
    ``sm.load(params=h.params)``, which refused an equinox model's params as 'a _VmapWrapper'
    though its message names h.params as what it takes; the model whole refused naming them
    (it said to cast its SharedNode 'object' to a dtype)."""
    case = CASES[0]
    h, (x,) = case.hybridize(), case.inputs(0)
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(h.params)]
    assert names == ["._fun.shared.pytree[0].weight", "._fun.shared.pytree[1].bias"]
    params, model = _shared_steps(h, x)
    trained = h.replace(params=params)
    chex.assert_trees_all_close(trained(x), model(x), **TOL)  # trained as equinox trains it
    embedding, linear = model.__wrapped__.shared()  # (eqx.filter_vmap wraps it)
    assert embedding.weight is linear.weight  # still tied
    with pytest.raises(sm.ConfigError, match=r"SharedNode.*eqx\.filter\(model, eqx\.is_inexa"):
        h.replace(params=model)  # the model whole, as equinox holds it
    trained = h.replace(params=eqx.filter(model, eqx.is_inexact_array))  # as it says
    chex.assert_trees_all_close(trained(x), model(x), **TOL)

    sm.export(h, tmp_path / "m", example=x)  # the untrained weights
    tensors = safetensors.numpy.load_file(tmp_path / "m" / "params.safetensors")
    assert {k: v.shape for k, v in tensors.items()} == {
        "_fun/shared/pytree/0/weight": (16, 8), "_fun/shared/pytree/1/bias": (16,)
    }  # fmt: skip
    with pytest.raises(sm.ArtifactError, match=r"pytree/1/weight is a SharedNode, not an array.*"
                       r"eqx\.filter\(model, eqx\.is_inexact_array\)"):  # fmt: skip
        sm.load(tmp_path / "m", params=model, allow=case.allow)  # it said: cast the object
    m = sm.load(tmp_path / "m", params=trained.params, allow=case.allow)
    chex.assert_trees_all_close(m(np.asarray(x)), model(x), **TOL)
    tokens, labels = np.asarray(x), np.arange(2)
    data = sm.training.Dataset(tokens, labels, tokens, labels, 16)
    with pytest.raises(sm.ConfigError, match=r"h\.apply\(params, x\).*h\.replace\(params="):
        sm.training.train(model, data, epochs=1)


@pytest.mark.slow  # building the MLP: its initializers compile, 1 s cold
def test_an_equinox_model_given_whole_as_params_is_refused_naming_its_filtered_arrays():
    """h.apply(model, x) and h.replace(params=model), the model as equinox trains and holds it
    (its activation a function): refused naming eqx.filter (it named closing over a setting
    or params_as_constants, which do not fit)."""
    mlp = eqx.nn.MLP(5, 3, 8, 1, key=jr.key(0))
    h, x = sm.hybridize(eqx.filter_vmap(mlp)), _x(0)
    fix = r"params\.activation is a custom_jvp.* the whole equinox MLP.*eqx\.filter\(model, eqx"
    with pytest.raises(sm.ConfigError, match=r"^_VmapWrapper\.apply: " + fix):
        h.apply(mlp, x)
    with pytest.raises(sm.ConfigError, match=r"^_VmapWrapper: " + fix):
        h.replace(params=mlp)
    params = eqx.filter(eqx.filter_vmap(mlp), eqx.is_inexact_array)  # as it says (the tied
    assert h.replace(params=params).params is params  # model's test above runs it so)


# -- RotaryPositionalEmbedding: a symbolic sequence length -----------------------------------------
@pytest.mark.slow
def test_a_symbolic_sequence_rope_takes_as_a_number_is_refused_naming_static_shapes(tmp_path):
    """RoPE computes its frequencies with ``float(seq_len)``, cached by size, then compares the
    length with the cached one's: exported with the sequence symbolic, shapes=("b, s, 8",
    "b, s, s"), export raised equinox's raw TypeError ('float() argument must be ... not
    _DimExpr') before any call, and after one named the batch 'b' for 's' > '6'."""
    case = CASES[2]
    h, (x, mask) = case.hybridize(), case.inputs(0)
    head = (r"^export\(_VmapWrapper, shapes=\.\.\.\): with the dimensions shapes= makes symbolic "
            r"\(float32\[b, s, 8\], bool\[b, s, s\]\) the trace fails \({}\), while the "
            r"example's own shapes trace")  # fmt: skip
    fix = "Keep only the batch symbolic, e.g. shapes=('b, 6, 8', 'b, 6, 6')"
    eqx.clear_caches()  # RoPE's frequencies among them: as before any call
    for error in (
        r"float\(\) argument .*_DimExpr'",
        r"Symbolic dimension comparison 's' > '6' is inconclusive",
    ):
        with pytest.raises(sm.SignatureError, match=head.format(error)) as e:
            sm.export(h, tmp_path / "m", example=(x, mask), shapes=("b, s, 8", "b, s, s"))
        assert fix in str(e.value)
        h(x, mask)  # its frequencies cached for 6 tokens
    sm.export(h, tmp_path / "m", example=(x, mask), shapes=("b, 6, 8", "b, 6, 6"))  # as it says
    m = sm.load(tmp_path / "m", allow=case.allow)
    chex.assert_trees_all_close(m(np.asarray(x[:3]), np.asarray(mask[:3])), h(x[:3], mask[:3]),
                                **TOL)  # fmt: skip


# -- inference_mode's model: trained with its state threaded, as train()'s refusal says ------------
@pytest.mark.slow
def test_a_stateful_dropout_model_trains_over_apply_as_equinox_trains_it():
    """Three adam steps over ``h.apply(params, x, ctx, key=key)``, its BatchNorm state threaded
    and a dropout key per step, equal equinox's own (eqx.filter_value_and_grad, has_aux); then
    served by inference_mode with the trained state."""
    case = CASES[1]
    model, ctx = _inference()
    h, x = case.hybridize(), case.inputs(0)[0]
    y = jnp.sin(x[:, :1])
    with pytest.raises(sm.ConfigError, match=r"h\.apply\(params, x\).*h\.replace\(params="):
        data = sm.training.Dataset(np.asarray(x), np.arange(4) % 2, np.asarray(x), np.arange(4), 2)
        sm.training.train(model, data, epochs=1)
    opt = optax.adam(1e-2)

    def loss(p, ctx, key):
        out, ctx = h.apply(p, x, ctx, key=key)
        return jnp.mean((out - y) ** 2), ctx

    @eqx.filter_value_and_grad(has_aux=True)
    def theirs(m, ctx, key):
        out, ctx = ctx_batch(m, x, ctx, key=key)
        return jnp.mean((out - y) ** 2), ctx

    params, state, ours_ctx = h.params, opt.init(h.params), ctx
    their_state, their_ctx = opt.init(eqx.filter(model, eqx.is_inexact_array)), _inference()[1]
    for i in range(3):
        key = jr.key(10 + i)
        (value, ours_ctx), grads = jax.value_and_grad(loss, has_aux=True)(params, ours_ctx, key)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        (want, their_ctx), grads = theirs(model, their_ctx, key)
        updates, their_state = opt.update(grads, their_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        np.testing.assert_allclose(value, want, **TOL)
    chex.assert_trees_all_close(
        jax.tree.leaves(params), jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)), **TOL
    )
    chex.assert_trees_all_close(jax.tree.leaves(ours_ctx), jax.tree.leaves(their_ctx), **TOL)
    trained = eqx.combine(params, eqx.filter(model, eqx.is_inexact_array, inverse=True))
    served = sm.hybridize(
        infer, eqx.Partial(eqx.nn.inference_mode(trained), ctx=ours_ctx, key=None)
    )
    want = infer(eqx.Partial(eqx.nn.inference_mode(model), ctx=their_ctx, key=None), x)
    chex.assert_trees_all_close(served(x), want, **TOL)
