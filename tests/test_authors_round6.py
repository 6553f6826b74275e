"""Code we did not write, round six: research code as its authors wrote it (tests/zoo6.py, each
headed by its source path and commit), run over every feature test_authors_matrix.py runs over
MATRIX (its test functions, called here), or as its source runs where it fits none of the
matrix's shapes.

- google-research/big_vision's ViT (``nn.scan`` of ``nn.remat`` encoder blocks, sincos posemb,
  MAP head; and as a Python loop of blocks with a [cls] token), MLP-Mixer (stochastic depth
  drawing from 'dropout') and BiT (weight-standardized convs, GroupNorm): compiled == eager ==
  linen in train and eval, grads, graph; their ``(logits, out)`` exported flattened as export's
  refusal says, loaded in JAX and IREE, served, under vmap and grad; trained by big_vision's
  own ``update_fn`` over ``h.apply``; its ``pyloop_to_scan`` checkpoints through ``h.replace``.
- flax nnx_toy_examples 02 (a Count variable, nnx.Optimizer, ``nnx.cached_partial``), 03 (a
  flax TrainState over a merge by hand), 04 (data parallel over 8 CPU devices), 06 (``nnx.vmap``
  of ``__init__`` and ``nnx.scan`` of BatchNorm and Dropout blocks: the whole matrix) and 08 (an
  Orbax checkpoint restored into ``nnx.eval_shape``'s model).
- JAX's removed examples kernel_lsq.py (a params-less jitted predictor; its ``minimize`` over
  ``h.apply``) and gaussian_process_regression.py (cholesky and triangular solves; a (b, b)
  covariance output; its training step over ``h.apply``).
"""

from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_authors_matrix as matrix
import test_authors_nnx3 as nnx3
import zoo6
from flax import nnx
from helpers import Case, _x
from test_authors_matrix import exported, loaded  # noqa: F401 - the matrix's fixtures

import symjax_mlp as sm

TOL = {"rtol": 2e-5, "atol": 2e-5}


def _linen(model, *example):
    """``(model, variables)``: big_vision's ``model.init(rng, dummy_input)``."""
    return lambda: (model, model.init(jax.random.key(0), *example))


IMAGES = jnp.ones((1, 8, 8, 3))
VIT_OPS = {"convolution", "dynamic_slice", "dynamic_update_slice", "dynamic_gather",
           "real_dynamic_slice", "scatter"}  # fmt: skip
VIT = zoo6.Model(3, patch_size=(4, 4), width=16, depth=2, mlp_dim=32, num_heads=2,
                 posemb="sincos2d", dropout=0.1, pool_type="map", scan=True,
                 head_zeroinit=False)  # fmt: skip
VIT_TOK = zoo6.Model(3, patch_size=(4, 4), width=16, depth=2, mlp_dim=32, num_heads=2,
                     dropout=0.1, pool_type="tok", rep_size=True, head_zeroinit=False)  # fmt: skip
MIXER = zoo6.MlpMixer(patch_size=(4, 4), num_classes=3, num_blocks=2, hidden_dim=8,
                      tokens_mlp_dim=8, channels_mlp_dim=16, stoch_depth=0.5)  # fmt: skip
BIT = zoo6.BiT(num_classes=3, width=0.5, depth=(1, 1))

CASES = (
    Case("bv_vit", "linen", _linen(VIT, IMAGES), lambda s: (_x(s, (4, 8, 8, 3)),),
         train={"train": True}, eval={"train": False}, rng=jax.random.key(3), classes=3,
         logits=lambda out: out[0]),
    # its encoder a Python loop of blocks, a [cls] token, a learned posemb, a pre-logits layer
    Case("bv_vit_tok", "linen", _linen(VIT_TOK, IMAGES), lambda s: (_x(s, (4, 8, 8, 3)),),
         train={"train": True}, eval={"train": False}, rng=jax.random.key(3), classes=3,
         logits=lambda out: out[0]),
    Case("bv_mixer", "linen", _linen(MIXER, IMAGES), lambda s: (_x(s, (4, 8, 8, 3)),),
         train={"train": True}, eval={"train": False}, rng=jax.random.key(3), classes=3,
         logits=lambda out: out[0]),
    Case("bv_bit", "linen", _linen(BIT, jnp.ones((1, 16, 16, 3))),
         lambda s: (_x(s, (4, 16, 16, 3)),), classes=3, logits=lambda out: out[0]),
)  # fmt: skip


def _scan_mlp(mode="train"):
    """06_scan_over_layers.py's ``ScanMLP(10, n_layers=5, rngs=nnx.Rngs(0))``; ``.eval()`` in
    eval mode (its BatchNorms' averages, its Dropouts off)."""
    model = zoo6.ScanMLP(10, n_layers=5, rngs=nnx.Rngs(0))
    if mode == "eval":
        model.eval()
    return model, None


#: Models that fit every shape of the matrix: each runs all its features.
WHOLE = (
    # (no classifier: the example trains nothing, and its 5 Dropouts of rate 0.5 leave a
    # 2-epoch loss to noise)
    Case("nnx_scan_over_layers", "nnx", _scan_mlp, lambda s: (_x(s, (4, 10)),),
         served=lambda: _scan_mlp("eval"),
         allow=frozenset({"dynamic_slice", "dynamic_update_slice", "real_dynamic_slice"})),
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", WHOLE, ids=lambda c: c.name)
def test_every_matrix_feature(case, exported, loaded, tmp_path, monkeypatch):  # noqa: F811
    """Each feature test_authors_matrix.py runs over MATRIX, as round three runs them."""
    nnx3.test_every_matrix_feature(case, exported, loaded, tmp_path, monkeypatch)


def _flat(case):
    """The module's eval call as export's refusal of its ``(logits, out)`` says to export it:
    ``tuple(jax.tree.leaves(out))`` of a function of its apply."""

    def build():
        model, variables = case.build()
        return lambda v, image, **kw: tuple(jax.tree.leaves(model.apply(v, image, **kw))), variables

    return build


FLAT = tuple(Case(f"{c.name}_flat", "fn", _flat(c), c.inputs, train=c.eval, allow=allow)
             for c, allow in zip(CASES, (
                 VIT_OPS,
                 {"convolution", "dynamic_gather", "real_dynamic_slice", "scatter"},
                 {"convolution"},
                 {"convolution", "reduce_window", "real_dynamic_slice", "select_and_scatter"},
             ), strict=True))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_matrix_feature_of_the_module(case, monkeypatch):
    """Compiled == eager == linen (train and eval: its dropout and stochastic depth drawing from
    the Hybrid's 'dropout' stream), grads through h.apply, graph and stage."""
    if case.name.startswith("bv_vit"):  # grads reach 2e2 (the loss squares every output in `out`)
        monkeypatch.setattr(matrix, "TOL", {"rtol": 2e-5, "atol": 1e-4})
    for mode in ("train", "eval") if case.eval else ("train",):
        matrix.test_compiled_equals_eager_equals_the_plain_framework(case, mode)
    matrix.test_grads_through_apply_equal_the_frameworks(case)
    matrix.test_stage_and_graph_count_the_same_layers(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", FLAT, ids=lambda c: c.name)
def test_every_matrix_feature_of_the_flat_export(case, exported, loaded, tmp_path, monkeypatch):  # noqa: F811
    """Its eval call flattened, as the refusal says: export (batch symbolic) -> load in JAX and
    IREE, a Batcher, vmap and grad over the loaded model, equal to the source."""
    if case.name.startswith("bv_vit"):
        monkeypatch.setattr(matrix, "TOL", {"rtol": 2e-5, "atol": 1e-4})
    matrix.test_compiled_equals_eager_equals_the_plain_framework(case, "train")
    matrix.test_export_loads_in_jax_and_iree_as_the_source(case, exported, tmp_path, monkeypatch)
    matrix.test_a_batcher_on_the_artifact_and_on_the_hybrid_gives_the_direct_rows(case, loaded)
    matrix.test_vmap_and_grad_over_the_loaded_model_equal_the_sources(case, loaded)


@pytest.mark.slow
def test_a_pyloop_vits_params_converted_to_scan_serve_the_scan_vits_hybrid_as_it():
    """vit.py's ``pyloop_to_scan`` and ``scan_to_pyloop`` (its checkpoints' conversions): the
    Python-loop ViT's params, stacked, given to the nn.scan ViT's Hybrid by ``h.replace``, give
    the loop's eval outputs; and back. (In training each draws its masks: the scan splits the
    'dropout' stream per block, the loop folds it by name.)"""
    sizes = {"patch_size": (4, 4), "width": 16, "depth": 2, "mlp_dim": 32, "num_heads": 2}
    loop, scan = (zoo6.Model(3, **sizes, dropout=0.1, head_zeroinit=False, scan=s)
                  for s in (False, True))  # fmt: skip
    variables, x = loop.init(jax.random.key(0), IMAGES), _x(1, (4, 8, 8, 3))
    h_loop = sm.hybridize(loop, variables, rngs=jax.random.key(3))
    h_scan = sm.hybridize(scan, scan.init(jax.random.key(1), IMAGES), rngs=jax.random.key(3))
    h_scan = h_scan.replace(params={"params": zoo6.pyloop_to_scan(variables["params"])})
    chex.assert_trees_all_close(h_scan(x, train=False)[0], h_loop(x, train=False)[0], **TOL)
    chex.assert_trees_all_close(
        zoo6.scan_to_pyloop(h_scan.params["params"]), variables["params"], **TOL
    )
    logits = [h(x, train=True)[0] for h in (h_loop, h_scan)]  # dropout on: the stream split
    assert not np.allclose(logits[0], h_loop(x, train=False)[0])
    assert logits[0].shape == logits[1].shape == (4, 3)


@pytest.mark.slow
def test_a_vit_computing_in_bfloat16_loads_under_iree_within_bfloat16s_tolerance(tmp_path):
    """vit.py's ``dtype_mm="bfloat16"`` (float32 images and logits, bfloat16 matmuls and convs):
    its artifact's self-test compared IREE's logits with XLA's at float32's tolerance, and load
    refused them ('do not trust its answers', off by 0.0047 where 1.3e-05 was allowed) though
    XLA's own bfloat16 logits are as far from float32's; now at bfloat16's (the narrowest float
    the program computes in, kept beside the vectors), and loads: its answers are XLA's within
    it. A float32 program keeps float32's tolerance."""
    from symjax_mlp import _selftest as selftest

    model = zoo6.Model(3, patch_size=(4, 4), width=16, depth=2, mlp_dim=32, num_heads=2,
                       posemb="sincos2d", pool_type="map", scan=True, head_zeroinit=False,
                       dtype_mm="bfloat16")  # fmt: skip
    x = _x(0, (4, 8, 8, 3))
    h = sm.hybridize(model, model.init(jax.random.key(0), IMAGES))
    sm.export(sm.hybridize(lambda p, x: h.apply(p, x)[0], h.params), tmp_path / "m", example=x)
    m = sm.load(tmp_path / "m", runtime="iree", allow=VIT_OPS)
    want, tol = h(x)[0], selftest.tolerance(np.float32, jnp.bfloat16)
    assert want.dtype == jnp.float32 and tol["rtol"] > 1e-2
    np.testing.assert_allclose(m(np.asarray(x[:2])), want[:2], **tol)
    assert selftest.narrowest(jax.jit(lambda x: x * 2).lower(jnp.ones(2)).as_text()) is None


# -- export's refusal of (logits, out), for a Hybrid holding rng streams ------------------------
@pytest.mark.slow  # an export and a load: 1 s warm
def test_a_stateful_modules_dict_output_is_refused_naming_its_output_alone(tmp_path):
    """mlp_mixer.py's MlpMixer returns ``(logits, out)``; its Hybrid holds the 'dropout' stream
    its stochastic depth draws from, so ``h.apply`` returns ``((logits, out), new_state)``. The
    refusal named ``tuple(jax.tree.leaves(h.apply(...)))``, which exported the Hybrid's next
    rng key as a last output (8 outputs for 7 leaves: jax.tree.unflatten of the tree it named
    raised); now it names ``h.apply(...)[0]``, which loads as the tree's leaves."""
    model = zoo6.MlpMixer(patch_size=(4, 4), num_classes=2, num_blocks=1, hidden_dim=4,
                          tokens_mlp_dim=4, channels_mlp_dim=4, stoch_depth=0.5)  # fmt: skip
    x = _x(0, (2, 4, 4, 3))
    h = sm.hybridize(model, model.init(jax.random.key(0), x), rngs=jax.random.key(3))
    with pytest.raises(sm.SignatureError, match=r"returns PyTreeDef\(\(\*, \{'block_0'") as e:
        sm.export(h, tmp_path / "m", example=x, kwargs={"train": False})
    code = "lambda params, *xs, **kw: tuple(jax.tree.leaves(h.apply(params, *xs, **kw)[0]))"
    assert f"sm.hybridize({code}, h.params) (h.apply returns (out, new_state)" in str(e.value)
    flat = sm.hybridize(  # as it says
        lambda params, *xs, **kw: tuple(jax.tree.leaves(h.apply(params, *xs, **kw)[0])), h.params
    )
    sm.export(flat, tmp_path / "m", example=x, kwargs={"train": False})
    want = h(x, train=False)
    got = sm.load(tmp_path / "m", allow={"convolution"})(np.asarray(x))
    chex.assert_trees_all_close(jax.tree.unflatten(jax.tree.structure(want), got), want, **TOL)


# -- big_vision/train.py's update_fn over the Hybrid, as the original steps ----------------------
class _KeyedApply:
    """``model.apply(variables, images, train=True, rngs={"dropout": key})`` through the Hybrid
    that the refusal of ``rngs=`` names: ``sm.hybridize(lambda variables, x, key: ...)``."""

    def __init__(self, model, variables):
        self.h = sm.hybridize(
            lambda v, x, key: model.apply(v, x, train=True, rngs={"dropout": key}), variables
        )

    def apply(self, variables, images, *, train, rngs):
        assert train
        return self.h.apply(variables, images, rngs["dropout"])


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.name != "bv_vit_tok"], ids=lambda c: c.name)
def test_big_visions_update_fn_steps_over_the_hybrid_as_over_linen(case):
    """train.py's update_fn (sigmoid_xent of one-hot labels, a 'dropout' key folded from the
    step count) over ``h.apply``: three steps' params and losses equal the original's over
    ``model.apply``, the ViT's grads through its nn.scan of nn.remat blocks, the Mixer's
    through its stochastic depth, BiT's through its standardized kernels and GroupNorms. The
    Hybrid of the module itself, holding rng streams of its own, refuses ``rngs=``, naming
    this function of the key; BiT's, holding none, takes it as ``model.apply`` does."""
    model, variables = case.build()
    images = case.inputs(5)[0]
    batch = {"image": images, "labels": jax.nn.one_hot(jnp.arange(4) % 3, 3)}
    given = {"dropout": jax.random.key(0)}
    if case.rng is None:  # (round twenty-two: scenic's trainers call apply so)
        chex.assert_trees_all_close(case.hybridize().apply(variables, images, train=True,
                                    rngs=given), model.apply(variables, images, train=True,
                                    rngs=given), **TOL)  # fmt: skip
    else:
        said = r"rngs= is .*\.apply's own keyword.*lambda variables, x, key: model\.apply\("
        with pytest.raises(sm.ConfigError, match=said + r"variables, x, rngs="):
            case.hybridize().apply(variables, images, train=True, rngs=given)
    # sgd: adam scales the zero grads of attention's key bias (float noise) to full steps
    tx, rng = optax.sgd(0.1), jax.random.key(9)
    runs = []
    for apply in (model, _KeyedApply(model, variables)):
        update_fn = jax.jit(zoo6.make_update_fn(apply, tx))
        state, losses = {"params": variables["params"]}, []
        state["opt"] = tx.init(state["params"])
        for step in range(3):
            state, measurements = update_fn(state, rng, batch, step)
            losses.append(float(measurements["training_loss"]))
        runs.append((state["params"], losses))
    (want, want_losses), (got, losses) = runs
    chex.assert_trees_all_close(got, want, **TOL)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert losses[-1] < losses[0]


# -- flax nnx_toy_examples 02_lifted_transforms.py and 03_train_state.py -------------------------
X = np.linspace(0, 1, 8, dtype=np.float32)[:, None]  # their X, cut to 8 rows
#: Their Linear and MLP read ``.value``, which flax 0.12 deprecates (pytest makes it an error).
OLD_VALUE = pytest.mark.filterwarnings("ignore:'.value' (access|setter) is now deprecated")
BATCH = X, 0.8 * X**2 + 0.1  # their Y, less its noise


def _mlp():
    return zoo6.MLP(din=1, dhidden=8, dout=1, rngs=nnx.Rngs(0))


def _hybrid_steps(h, tx, n=3):
    """An optax loop over ``h.apply_with_state``, the counts carried: ``(params, counts)``."""
    x, y = BATCH

    def loss_fn(params, counts):
        y_pred, counts = h.apply_with_state(params, counts, x)
        return jnp.mean((y - y_pred) ** 2), counts

    @jax.jit
    def step(params, opt_state, counts):
        grads, counts = jax.grad(loss_fn, has_aux=True)(params, counts)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, counts

    params, opt_state, counts = h.params, tx.init(h.params), h.state
    for _ in range(n):
        params, opt_state, counts = step(params, opt_state, counts)
    return params, counts


@pytest.mark.slow
@OLD_VALUE
def test_the_lifted_transforms_example_trains_exports_and_serves_as_nnx(tmp_path):
    """02_lifted_transforms.py: its MLP counts its calls in a Count Variable. The Hybrid's call
    equals nnx's and counts as it does; an optax loop over ``h.apply_with_state`` steps as the
    example's nnx.jit train_step (nnx.Optimizer, sgd) does, params and count; its test_step,
    cached as it caches it, equals the trained Hybrid's loss; the trained Hybrid exports (batch
    symbolic, a VJP), loads equal, under jax.vmap and jax.grad, and a Batcher serves it."""
    model, h = _mlp(), sm.hybridize(_mlp())
    chex.assert_trees_all_close(h(X), model(X), **TOL)
    assert int(h.state["count"]) == int(model.count[...]) == 1
    assert h.graph(X).primitive_counts["dot_general"] == 2
    tx = optax.sgd(0.1)  # (the example's 1e-3 moves 3 steps' params by as little as the noise)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    cached_train_step = nnx.cached_partial(zoo6.train_step, model, optimizer)
    for _ in range(3):
        cached_train_step(BATCH)
    params, counts = _hybrid_steps(h, tx)
    chex.assert_trees_all_close(params, nnx.to_pure_dict(nnx.state(model, nnx.Param)), **TOL)
    assert int(counts["count"]) == int(model.count[...]) == 4
    trained = h.replace(params=params, state=counts)
    logs = nnx.cached_partial(zoo6.test_step, model)(BATCH)
    chex.assert_trees_all_close(jnp.mean((BATCH[1] - trained(X)) ** 2), logs["loss"], **TOL)
    sm.export(trained, tmp_path / "m", example=X, vjp_order=1)
    m, want = sm.load(tmp_path / "m", allow={"real_dynamic_slice"}), model(X)
    chex.assert_trees_all_close(m(X), want, **TOL)
    chex.assert_trees_all_close(
        jax.vmap(m)(np.stack([X, X[::-1]])), np.stack([want, want[::-1]]), **TOL
    )
    graphdef, variables = nnx.split(model)  # merged inside jax.grad: its count written there
    want = jax.grad(lambda x: nnx.merge(graphdef, variables, copy=True)(x).sum())(X)
    chex.assert_trees_all_close(jax.grad(lambda x: m(x).sum())(X), want, **TOL)
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [f.result(30) for f in [b.submit(X[i : i + 1]) for i in range(3)]]
    chex.assert_trees_all_close(np.concatenate(got), m(X)[:3], **TOL)


def _train_state(h=None):
    """03_train_state.py's ``TrainState.create``: of its model split by hand, or (``h``) of a
    Hybrid's params and state (its graphdef then unused)."""
    if h is None:
        graphdef, params, counts = nnx.split(_mlp(), nnx.Param, zoo6.Count)
    else:
        graphdef, params, counts = None, h.params, h.state
    return zoo6.TrainState.create(apply_fn=None, graphdef=graphdef, params=params,
                                  tx=optax.sgd(0.1), counts=counts)  # fmt: skip


@pytest.mark.slow
@OLD_VALUE
def test_the_train_state_example_steps_over_the_hybrid_as_over_its_merge(tmp_path):
    """03_train_state.py: its jax.jit train_step merges the model inside jax.grad (copy=True)
    and carries the counts in a flax TrainState. The same TrainState over
    ``h.apply_with_state`` steps equal, params and counts; its test_step hybridized over the
    TrainState equals it, and exports by the refusal's function of its batch's leaves."""
    state, h = _train_state(), sm.hybridize(_mlp())
    ours = _train_state(h)

    @jax.jit
    def train_step(state, batch):  # the example's, its merge as h.apply_with_state
        x, y = batch

        def loss_fn(params):
            y_pred, counts = h.apply_with_state(params, state.counts, x)
            return jnp.mean((y - y_pred) ** 2), counts

        grads, counts = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, counts=counts)

    for _ in range(3):
        state, ours = zoo6.ts_train_step(state, BATCH), train_step(ours, BATCH)
    chex.assert_trees_all_close(ours.params, nnx.to_pure_dict(state.params), **TOL)
    assert int(ours.counts["count"]) == int(state.counts["count"][...]) == 3
    h = sm.hybridize(zoo6.ts_test_step, state)
    chex.assert_trees_all_close(h(BATCH), zoo6.ts_test_step(state, BATCH), **TOL)
    with pytest.raises(sm.SignatureError, match=r"args\[0\] is a tuple of 2 arrays"):
        sm.export(h, tmp_path / "m", example=(BATCH,))
    leaves, tree = jax.tree.flatten(BATCH)  # as it says, its loss the output
    f = sm.hybridize(lambda params, *xs: h.apply(params, jax.tree.unflatten(tree, xs))["loss"],
                     h.params)  # fmt: skip
    sm.export(f, tmp_path / "m", example=tuple(leaves))
    got = sm.load(tmp_path / "m")(*leaves)
    chex.assert_trees_all_close(got, zoo6.ts_test_step(state, BATCH)["loss"], **TOL)


def test_a_batch_tuple_example_is_refused_naming_a_function_of_its_leaves(tmp_path):
    """``export(h, example=((x, y),))`` of a function of a ``batch`` (03_train_state.py's
    test_step): 'args[0] is a tuple; pass an array (or a tuple of arrays)', which it was;
    now it names the function of its leaves that exports (the dict refusal's)."""
    h = sm.hybridize(lambda p, batch: jnp.mean((batch[1] - batch[0] * p) ** 2), jnp.float32(2))
    said = r"^export\(<lambda>, example=\.\.\.\): args\[0\] is a tuple of 2 arrays, but an artif"
    with pytest.raises(sm.SignatureError, match=said) as e:
        sm.export(h, tmp_path / "m", example=(BATCH,))
    assert "leaves, tree = jax.tree.flatten(d); sm.hybridize(lambda params, *xs: h.apply(" in str(
        e.value
    )
    assert "jax.tree.unflatten(tree, xs)), h.params) with example=tuple(leaves)" in str(e.value)
    assert not (tmp_path / "m").exists()


# -- JAX examples/kernel_lsq.py ------------------------------------------------------------------
@pytest.mark.slow
def test_kernel_least_squares_predicts_exports_and_minimizes_over_the_hybrid(tmp_path):
    """kernel_lsq.py's ``train(linear_kernel, xs, ys)`` (its 10,000 momentum steps; n=8, d=3 for
    its 100 and 20): the jitted ``vmap(predict)`` it returns, params-less, hybridizes as the
    refusal says, equals it, counts its one dot_general, exports with its batch symbolic and
    a VJP, loads equal, under jax.vmap and jax.grad, and a Batcher serves it. Its ``predict``
    of ``v`` over ``h.apply`` is the ``gram_mat @ v`` its objective fits: ``minimize`` of
    that objective steps as of the original's."""
    rng = np.random.RandomState(0)
    truth, xs = rng.randn(3), rng.randn(8, 3).astype(np.float32)
    ys = jnp.dot(xs, truth)
    predict = zoo6.train(zoo6.linear_kernel, xs, ys)
    assert float(jnp.sum((predict(xs) - ys) ** 2.0)) < 1e-3  # its MSE
    with pytest.raises(sm.ConfigError, match=r"hybridize\(lambda _, x: f\(x\), \{\}\)"):
        sm.hybridize(predict)
    h = sm.hybridize(lambda _, x: predict(x), {})  # as it says
    chex.assert_trees_all_close(h(xs), predict(xs), **TOL)
    assert h.graph(xs).primitive_counts["dot_general"] == 1
    sm.export(h, tmp_path / "m", example=xs, vjp_order=1)
    m = sm.load(tmp_path / "m", allow={"real_dynamic_slice"})
    chex.assert_trees_all_close(m(xs[:3]), predict(xs[:3]), **TOL)
    stacked = np.stack([predict(xs), predict(-xs)])
    chex.assert_trees_all_close(jax.vmap(m)(np.stack([xs, -xs])), stacked, **TOL)
    want = jax.grad(lambda x: predict(x).sum())(xs)
    chex.assert_trees_all_close(jax.grad(lambda x: m(x).sum())(xs), want, **TOL)
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [f.result(30) for f in [b.submit(xs[i : i + 2]) for i in (0, 2, 4)]]
    chex.assert_trees_all_close(np.concatenate(got), predict(xs[:6]), **TOL)

    def predict_of(v, x):  # train's predict, v its argument (train closes over its own)
        prods = jax.vmap(lambda x_: zoo6.linear_kernel(x, x_))(xs)
        return jnp.sum(v * prods)

    hv = sm.hybridize(jax.vmap(predict_of, in_axes=(None, 0)), jnp.zeros(8))
    gram_mat = zoo6.gram(zoo6.linear_kernel, xs)

    def objective(v, fit):  # train's objective, its fit gram_mat @ v or the Hybrid's
        risk = 0.5 * jnp.sum((fit(v) - ys) ** 2.0)
        return risk + 0.01 * jnp.sum(v**2.0)

    steps = [zoo6.minimize(partial(objective, fit=fit), jnp.zeros(8), num_steps=5)
             for fit in (lambda v: jnp.dot(gram_mat, v), lambda v: hv.apply(v, xs))]  # fmt: skip
    chex.assert_trees_all_close(steps[1], steps[0], **TOL)
    assert float(jnp.abs(steps[0]).sum()) > 0


# -- JAX examples/gaussian_process_regression.py -------------------------------------------------
LAPACK = {"custom_call:lapack_spotrf_ffi", "custom_call:lapack_strsm_ffi"}  # cholesky, solves


@pytest.mark.slow
def test_gaussian_process_regression_predicts_exports_and_trains_over_the_hybrid(tmp_path):
    """gaussian_process_regression.py: ``predict(params, x, y, xtest)`` (a cholesky of the 7
    training points' covariance; the mean and the (b, b) covariance of b test points) equals
    it through a Hybrid. Its export names its fixes: batch='b' (x and y are no batch: shapes=),
    then a VJP with 'b' symbolic, which was JAX's raw InconclusiveDimensionOperation ('b' < '7')
    from serialize; each fix named loads equal (static shapes: under jax.vmap and jax.grad).
    Its train_step over ``h.apply`` of the marginal likelihood steps as the original's."""
    marginal_likelihood, predict, train_step = zoo6.gp_functions(7)
    params, momentums, scales, x, y, xtest = zoo6.gp_data(7)
    xtest = xtest[::25]  # 8 of its 200 test points
    h = sm.hybridize(predict, params)
    chex.assert_trees_all_close(h(x, y, xtest), predict(params, x, y, xtest), **TOL)
    counts = h.graph(x, y, xtest).primitive_counts
    assert (counts["cholesky"], counts["triangular_solve"]) == (1, 3)
    with pytest.raises(sm.SignatureError, match=r"'args\[2\]': 8.*pass shapes="):
        sm.export(h, tmp_path / "m", example=(x, y, xtest))
    shapes = ("7, 1", "7, 1", "b, 1")  # as it says
    said = r"^export\(partial, vjp_order=1\): the model's VJP .*'b' < '7' is inconclusive\. "
    with pytest.raises(sm.SignatureError, match=said + "Export it with vjp_order=0"):
        sm.export(h, tmp_path / "m", example=(x, y, xtest), shapes=shapes, vjp_order=1)
    assert not (tmp_path / "m").exists()
    sm.export(h, tmp_path / "m", example=(x, y, xtest), shapes=shapes)  # as it says: either
    sm.export(h, tmp_path / "s", example=(x, y, xtest), batch=None, vjp_order=1)
    m, s = sm.load(tmp_path / "m", allow=LAPACK), sm.load(tmp_path / "s", allow=LAPACK)
    for t in (xtest, xtest[:3]):
        chex.assert_trees_all_close(m(x, y, t), predict(params, x, y, t), **TOL)
    stacked = jax.vmap(s, in_axes=(None, None, 0))(x, y, jnp.stack([xtest, xtest + 1]))
    chex.assert_trees_all_close(stacked[0][1], predict(params, x, y, xtest + 1)[0], **TOL)
    got = jax.grad(lambda t: s(x, y, t)[0].sum())(xtest)
    chex.assert_trees_all_close(got, jax.grad(lambda t: predict(params, x, y, t)[0].sum())(xtest),
                                **TOL)  # fmt: skip
    hm, want = sm.hybridize(marginal_likelihood, params), (params, momentums, scales)
    chex.assert_trees_all_close(hm(x, y), marginal_likelihood(params, x, y), **TOL)
    grad_fun, got = jax.jit(jax.grad(hm.apply)), jax.tree.map(jnp.copy, want)
    for _ in range(3):
        want = train_step(*want, x, y)
        params, momentums, scales, grads = *got, grad_fun(got[0], x, y)
        for k in params:  # train_step's, grad_fun over the Hybrid
            momentums[k] = 0.9 * momentums[k] + 0.1 * grads[k][0]
            scales[k] = 0.9 * scales[k] + 0.1 * grads[k][0] ** 2
            params[k] -= 0.01 * momentums[k] / jnp.sqrt(scales[k] + 1e-5)
        got = params, momentums, scales
    chex.assert_trees_all_close(got, want, **TOL)
    assert float(hm.apply(got[0], x, y)) < float(hm(x, y))  # its neg marginal likelihood


def test_a_batcher_of_outputs_whose_rows_grow_with_the_batch_says_so_not_an_ensemble():
    """The GP's predict of test points returns their (b, b) covariance, and its params are
    (1, 1): a Batcher of it (example 1 row) said every param leads with the example's 1 rows,
    an ensemble to serve by jax.vmap(h); now the outputs' rows that grow with the batch."""
    h = sm.hybridize(lambda p, t: (t * p["amplitude"], t @ t.T), {"amplitude": jnp.ones((1, 1))})
    with pytest.raises(sm.ConfigError, match=r"rows float32\[1\], float32\[2\], but for a batch "
                       r"of 1, .*rows do not depend on the batch's size") as e:  # fmt: skip
        sm.serving.Batcher(h, example=np.ones((1, 1), np.float32), max_batch=2)
    assert "ensemble" not in str(e.value)


# -- flax nnx_toy_examples 04_data_parallel_with_jit.py and 08_save_load_checkpoints.py ----------
@pytest.mark.slow
def test_the_data_parallel_example_trains_over_the_hybrid_as_its_train_step(tmp_path):
    """04_data_parallel_with_jit.py over conftest's 8 CPU devices: the model and its adamw
    optimizer replicated (P()), the data sharded on 'data'. The Hybrid holds the replicated
    params, answers the sharded batch as nnx does, and an optax loop over ``h.apply`` steps as
    the example's nnx.jit train_step, loss by loss; trained, it exports from the sharded example,
    loads equal, and a Batcher serves it."""
    from jax.experimental import mesh_utils

    mesh = jax.sharding.Mesh(mesh_utils.create_device_mesh((jax.local_device_count(),)),
                             ("data",))  # fmt: skip
    model_sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec())
    data_sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    model = zoo6.DataParallelMLP(1, 16, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    state = jax.device_put(nnx.state((model, optimizer)), model_sharding)  # replicate state
    nnx.update((model, optimizer), state)
    h = sm.hybridize(model)
    assert h.params["linear1"]["kernel"].sharding == model_sharding
    X = np.linspace(-2, 2, 16, dtype=np.float32)[:, None]
    x, y = jax.device_put((X, 0.8 * X**2 + 0.1), data_sharding)  # shard data
    assert len(x.sharding.device_set) == jax.local_device_count() > 1
    chex.assert_trees_all_close(h(x), model(x), **TOL)
    tx = optax.adamw(1e-2)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((y - h.apply(p, x)) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, losses = h.params, tx.init(h.params), []
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state)
        losses.append([float(loss), float(zoo6.dp_train_step(model, optimizer, x, y))])
    np.testing.assert_allclose(*zip(*losses, strict=True), rtol=1e-5)
    assert losses[-1][0] < losses[0][0]
    chex.assert_trees_all_close(params, nnx.to_pure_dict(nnx.state(model, nnx.Param)), **TOL)
    sm.export(h.replace(params=params), tmp_path / "m", example=x)
    m = sm.load(tmp_path / "m")
    chex.assert_trees_all_close(m(X), model(x), **TOL)
    with sm.serving.Batcher(m, max_batch=4) as b:
        chex.assert_trees_all_close(b(X[:3]), m(X[:3]), **TOL)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")  # the example's
def test_a_model_restored_from_the_checkpoint_example_hybridizes_and_exports(tmp_path):
    """08_save_load_checkpoints.py: ``create_and_save(42, path)`` (Orbax's PyTreeCheckpointer of
    ``nnx.state(model)``), then ``load_model(path)`` (``nnx.eval_shape``, restore, nnx.update).
    The restored model's Hybrid equals the one saved, exports and loads equal, under jax.vmap
    and jax.grad."""
    zoo6.create_and_save(42, str(tmp_path))
    model, saved = zoo6.load_model(str(tmp_path)), zoo6.create_model(42)
    x = _x(1, (4, 10))
    h = sm.hybridize(model)
    chex.assert_trees_all_close(h(jnp.ones((1, 10))), saved(jnp.ones((1, 10))), **TOL)
    sm.export(h, tmp_path / "m", example=x, vjp_order=1)
    m = sm.load(tmp_path / "m", allow={"real_dynamic_slice"})
    chex.assert_trees_all_close(m(x), saved(x), **TOL)
    chex.assert_trees_all_close(jax.vmap(m)(jnp.stack([x, -x])), jnp.stack([saved(x), saved(-x)]),
                                **TOL)  # fmt: skip
    want = jax.grad(lambda x: saved(x).sum())(x)
    chex.assert_trees_all_close(jax.grad(lambda x: m(x).sum())(x), want, **TOL)
