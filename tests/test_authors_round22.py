"""Code we did not write, round twenty-two (tests/zoo22.py, tests/zoo22b.py; sources and
commits there), over every feature: hybridize, ``h(x)`` equal to the plain model, its graph,
export + load + call equal, grads/Hessians over the loaded model, a Batcher's answers, and the
authors' training.

- Flax's ogbg_molpcba ``GraphNet`` and ``GraphConvNet`` on a small padded ``jraph.GraphsTuple``
  (two molecules of 3 and 2 atoms padded to 9 nodes, 12 edges, 3 graphs): ``h(graphs)``
  returns jraph's GraphsTuple; export refuses the GraphsTuple as an input, naming the
  flattening it takes, and the flattened function (its seven arrays in, the GraphsTuple's
  seven out) exports, loads, is called and differentiated twice as the model; a Batcher
  refuses it (nodes, edges and graphs: no one batch). Padded to one count and exported with
  the batch symbolic, the manifest says its rows mix (a node's output reads its
  neighbours'), so a Batcher never merges two requests' graphs. Three of the example's
  ``train_step`` (adam, masked binary cross-entropy, ``rngs`` for dropout) over a
  ``TrainState`` whose ``apply_fn`` is ``h.apply`` equal three over ``model.apply`` (``rngs=``
  was refused: see the test).
- scenic's DETR (sizes cut, scenic's ResNet-9 backbone) in eval over every feature, its
  heads' dict exported as the refusal says; its keyword-only ``padding_mask`` exported as an
  input (the refusal's function once lost DETR's ``train`` given by place: fixed); its
  trainer's forward (``mutable=['batch_stats']``, ``update_batch_stats``, dropout ``rngs``)
  over ``h.apply`` as over ``model.apply``.
- scenic's TokenLearnerViT (an ml_collections ConfigDict attribute; TokenLearner 1.1, and
  1.0 with the TokenFuser) in eval over every feature; scenic's classification trainer's
  ``training_loss_fn`` over ``h.apply`` (was refused: ``mutable=``, ``rngs=``).
"""

import jax
import jax.numpy as jnp
import jraph
import ml_collections
import numpy as np
import optax
import pytest
import zoo22
import zoo22b
from features import close, every_feature
from flax.training import train_state

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each a compile of a model or more (~3 s or more)

GRAPH_OPS = {"gather", "scatter", "reduce_window"}


def _graphs(seed=0, classes=4, pad=(9, 12, 3)):
    """Two molecules (3 and 2 atoms), as ogbg_molpcba's input pipeline pads them
    (``jraph.pad_with_graphs``), int32 as JAX holds them; ``globals``: labels, NaN unknown."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, (2, classes)).astype(np.float32)
    labels[0, 1] = labels[1, 2] = np.nan
    graphs = jraph.GraphsTuple(
        nodes=rng.normal(size=(5, 3)).astype(np.float32),
        edges=rng.normal(size=(6, 2)).astype(np.float32),
        senders=np.array([0, 1, 2, 1, 3, 4]), receivers=np.array([1, 0, 1, 2, 4, 3]),
        n_node=np.array([3, 2]), n_edge=np.array([4, 2]), globals=labels,
    )  # fmt: skip
    padded = jraph.pad_with_graphs(graphs, *pad)
    return jax.tree.map(lambda a: a.astype(np.int32) if a.dtype == np.int64 else a, padded)


def _model(kind, **kw):
    cls = {"graph_net": zoo22b.GraphNet, "graph_conv_net": zoo22b.GraphConvNet}[kind]
    return cls(latent_size=8, num_mlp_layers=2, message_passing_steps=2,
               output_globals_size=4, **kw)  # fmt: skip


@pytest.mark.parametrize("kind", ["graph_net", "graph_conv_net"])
def test_ogbg_graph_nets_over_every_feature(kind, tmp_path):
    """The example's eval model (``deterministic=True``) on a GraphsTuple: ``h(graphs)`` is
    jraph's; export takes the flattened function its refusal names; the artifact's call,
    grads and Hessian (of the graphs' logits in the nodes' features) and a Batcher's answer
    equal the model's."""
    graphs = zoo22b.replace_globals(_graphs())
    model = _model(kind)
    variables = model.init(jax.random.key(0), graphs)
    h = sm.hybridize(model, variables)
    out = h(graphs)
    assert isinstance(out, jraph.GraphsTuple)
    close(out, model.apply(variables, graphs))
    assert h.graph(graphs).flops > 0
    with pytest.raises(sm.SignatureError, match=r"GraphsTuple of 7 arrays.*jax.tree.unflatten"):
        sm.export(h, tmp_path / "refused", example=(graphs,), batch=None)

    leaves, tree = jax.tree.flatten(graphs)
    flat = sm.hybridize(
        lambda v, *xs: tuple(jax.tree.leaves(h.apply(v, jax.tree.unflatten(tree, xs)))), h.params
    )
    sm.export(flat, tmp_path / "m", example=tuple(leaves), batch=None, vjp_order=2)
    m = sm.load(tmp_path / "m", allow=GRAPH_OPS)
    close(m(*leaves), tuple(jax.tree.leaves(model.apply(variables, graphs))))

    def logits(f, nodes):  # the graphs' logits, as a function of the nodes' features
        return f(nodes).sum()

    theirs = lambda n: model.apply(variables, graphs._replace(nodes=n)).globals  # noqa: E731
    ours = lambda n: m(n, *leaves[1:])[4]  # noqa: E731 - globals: the fifth leaf
    close(jax.grad(lambda n: logits(ours, n))(graphs.nodes),
          jax.grad(lambda n: logits(theirs, n))(graphs.nodes))  # fmt: skip
    hess = lambda f: jax.jacrev(jax.jacrev(lambda n: (f(n) ** 2).sum()))(graphs.nodes)  # noqa: E731
    close(hess(ours), hess(theirs), rtol=1e-4, atol=1e-4)
    # nodes, edges, graphs: no rows to merge (see the next test); it named no way on
    said = r"dimensions .*\[0\]: float32\[9, 3\], args\[1\]: float32\[12, 2\].* disagree.*directly"
    with pytest.raises(sm.ConfigError, match=said):
        sm.serving.Batcher(m)


def test_a_graph_nets_symbolic_batch_is_its_nodes_and_its_rows_are_never_merged(tmp_path):
    """Padded to 8 nodes, 8 edges and 8 graphs and exported with ``batch='b'``, the
    GraphConvNet's every input is ``b`` rows; the manifest says its rows mix, and a Batcher
    given two such graphs answers each as the artifact alone does (never merged: merged, the
    second's senders would index the first's nodes)."""
    model = _model("graph_conv_net")
    graphs = zoo22b.replace_globals(_graphs(pad=(8, 8, 8)))
    variables = model.init(jax.random.key(0), graphs)
    h = sm.hybridize(model, variables)
    leaves, tree = jax.tree.flatten(graphs)
    flat = sm.hybridize(
        lambda v, *xs: tuple(jax.tree.leaves(h.apply(v, jax.tree.unflatten(tree, xs)))), h.params
    )
    art = sm.export(flat, tmp_path / "m", example=tuple(leaves), vjp_order=1)
    assert not art.manifest["rows"]["independent"]
    # (jraph's pool: jnp.repeat of a symbolic total, a cumsum: XLA's dynamic_reduce_window)
    dynamic = {"real_dynamic_slice", "custom_call:stablehlo.dynamic_reduce_window"}
    m = sm.load(tmp_path / "m", allow={"gather", "scatter"} | dynamic)
    other = jax.tree.leaves(zoo22b.replace_globals(_graphs(seed=5, pad=(8, 8, 8))))
    with sm.serving.Batcher(m, max_batch=32) as b:
        got = [b.submit(*xs) for xs in (leaves, other)]
        got = [g.result(30) for g in got]
    close(got, [m(*leaves), m(*other)])
    close(got[0], tuple(jax.tree.leaves(model.apply(variables, graphs))))


def test_ogbg_train_step_over_ours_equals_over_model_apply():
    """Three of the example's ``train_step`` (its ``@jax.jit``, adam, masked BCE, dropout 0.3
    from the ``rngs`` passed in) over a TrainState whose ``apply_fn`` is ``h.apply`` (called
    as ``apply_fn(params, graphs, rngs=rngs)``) equal three over ``model.apply``: the losses
    and the params. ``h.apply`` of a Hybrid holding no state took ``rngs=`` as an input of
    ``GraphNet.__call__`` and refused it (now Flax's, as model.apply takes it); one holding
    rng streams of its own still refuses it (see round six)."""
    graphs = _graphs()
    model = _model("graph_net", dropout_rate=0.3, deterministic=False)
    variables = model.init(jax.random.key(0), zoo22b.replace_globals(graphs))
    h = sm.hybridize(model, variables)
    tx = optax.adam(1e-3)
    ours = train_state.TrainState.create(apply_fn=h.apply, params=h.params, tx=tx)
    theirs = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    losses = []
    for step in range(3):
        rngs = {"dropout": jax.random.key(step)}
        ours, mine = zoo22b.train_step(ours, graphs, rngs)
        theirs, want = zoo22b.train_step(theirs, graphs, rngs)
        losses.append((mine, want))
    close(*zip(*losses, strict=True))
    assert len({float(w) for _, w in losses}) == 3  # the params move, each step's loss its own
    close(ours.params, theirs.params)


# --- scenic's DETR --------------------------------------------------------------------------

#: scenic's DETR, sizes cut: hidden size 8, two heads, one encoder and one decoder layer, four
#: queries; its backbone scenic's ResNet of ``num_layers=9`` (four stages of one block, stride
#: 32) with 2 filters: a 32 x 64 image is 1 x 2 tokens.
DETR = zoo22.DETR(num_classes=3, hidden_dim=8, num_queries=4, transformer_num_heads=2,
                  transformer_num_encoder_layers=1, transformer_num_decoder_layers=1,
                  transformer_qkv_dim=8, transformer_mlp_dim=8, backbone_num_filters=2,
                  backbone_num_layers=9, dropout_rate=0.1, attention_dropout_rate=0.1)  # fmt: skip
IMAGES = jax.random.normal(jax.random.key(1), (3, 32, 64, 1))
MASK = np.ones((3, 32, 64), bool)
MASK[1, :, 32:] = False  # the second image padded on its right half: its second token
DETR_OPS = {"convolution", "dynamic_gather", "real_dynamic_slice", "reduce_window",
            "select_and_scatter"}  # fmt: skip


def _detr_variables():
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    return jax.jit(lambda: DETR.init(keys, IMAGES, False, padding_mask=MASK))()


@pytest.fixture(scope="module")
def detr():
    """DETR, its variables, images and ops, as round thirty-four's tests take them."""
    return DETR, _detr_variables(), IMAGES, DETR_OPS


def test_detr_over_every_feature(tmp_path):
    """DETR in eval (``train`` False, as scenic's eval step calls it) over every feature, its
    ``{'pred_boxes', 'pred_logits'}`` refused by export, exported as one array (the heads
    concatenated, as every_feature takes one), batch symbolic; then with its ``padding_mask``
    (a keyword-only input): export of ``example=(x, False)``, ``kwargs={'padding_mask':
    mask}`` is refused, naming the function that gives the mask a place, ``train=False`` kept
    in it (was: left out, and the function it named failed: DETR takes ``train`` by place);
    that function exported, its artifact's calls, grads and a Batcher's answers are DETR's,
    the padded image's unlike the unpadded one's."""
    variables = _detr_variables()
    h = sm.hybridize(DETR, variables)
    ref = lambda x, mask=None: DETR.apply(variables, x, False, padding_mask=mask)  # noqa: E731
    close(h(IMAGES, False, padding_mask=MASK), ref(IMAGES, MASK))
    with pytest.raises(sm.SignatureError, match=r"returns PyTreeDef\(\{'pred_boxes'.*\[0\] is"):
        sm.export(h, tmp_path / "dict", example=(IMAGES, False))
    heads = lambda out: jnp.concatenate(jax.tree.leaves(out), -1)  # noqa: E731 - boxes, logits
    flat = sm.hybridize(lambda v, x: heads(h.apply(v, x, False)[0]), h.params)
    one = IMAGES[:, :, :32]  # 32 x 32: one token, a Hessian of 1024 x 1024 (2048's takes minutes)
    every_feature(tmp_path, flat, lambda x: heads(ref(x)), one, allow=DETR_OPS,
                  rtol=1e-4, atol=1e-4)  # fmt: skip

    with pytest.raises(sm.SignatureError, match="padding_mask=padding_mask, train=False\\)"):
        sm.export(h, tmp_path / "x", example=(IMAGES, False), kwargs={"padding_mask": MASK})
    masked = sm.hybridize(
        lambda params, x, padding_mask: tuple(jax.tree.leaves(
            h.apply(params, x, padding_mask=padding_mask, train=False)[0])), h.params,
    )  # fmt: skip
    sm.export(masked, tmp_path / "masked", example=(IMAGES, MASK), vjp_order=1)
    m = sm.load(tmp_path / "masked", allow=DETR_OPS)
    want = tuple(jax.tree.leaves(ref(IMAGES, MASK)))
    close(m(np.asarray(IMAGES), MASK), want, rtol=1e-4, atol=1e-4)
    unpadded = tuple(jax.tree.leaves(ref(IMAGES)))
    assert not np.allclose(want[0][1], unpadded[0][1])
    grad = lambda f: jax.grad(lambda x: f(x)[1].sum())(IMAGES)  # noqa: E731 - the logits'
    close(grad(lambda x: m(x, MASK)), grad(lambda x: tuple(jax.tree.leaves(ref(x, MASK)))),
          rtol=1e-4, atol=1e-4)  # fmt: skip
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [b.submit(np.asarray(IMAGES[i : i + 1]), MASK[i : i + 1]) for i in range(3)]
        got = [np.concatenate(parts) for parts in zip(*(g.result(30) for g in got), strict=True)]
    close(tuple(got), want, rtol=1e-4, atol=1e-4)


def test_detr_scenic_train_steps_forward_over_h_apply():
    """scenic's DETR ``train_step``'s forward (trainer.py's ``loss_fn``: ``flax_model.apply``
    of ``{'params': params, **model_state}``, ``padding_mask=``, ``update_batch_stats=True``,
    ``mutable=['batch_stats']``, ``train=True``, ``rngs={'dropout': rng}``) called on
    ``h.apply`` as written: the predictions (dropout 0.1 from that rng), the backbone's new
    batch stats and the grads of a loss of them equal Flax's."""
    variables = _detr_variables()
    h = sm.hybridize(DETR, variables)

    def forward(apply, params, rng):
        return apply({"params": params, "batch_stats": variables["batch_stats"]}, IMAGES,
                     padding_mask=MASK, update_batch_stats=True, mutable=["batch_stats"],
                     train=True, rngs={"dropout": rng}, debug=False)  # fmt: skip

    def loss(apply, params, rng):
        predictions, new_model_state = forward(apply, params, rng)
        return (predictions["pred_logits"] ** 2).sum() + predictions["pred_boxes"].sum(), (
            predictions, new_model_state)  # fmt: skip

    rng = jax.random.key(7)
    ours = jax.value_and_grad(loss, argnums=1, has_aux=True)(h.apply, h.params["params"], rng)
    theirs = jax.value_and_grad(jax.jit(loss, static_argnums=0), argnums=1, has_aux=True)(
        DETR.apply, variables["params"], rng
    )
    close(ours, theirs, rtol=1e-4, atol=1e-4)
    other = forward(h.apply, h.params["params"], jax.random.key(8))[0]
    assert not np.allclose(other["pred_logits"], ours[0][1][0]["pred_logits"])  # dropout on


# --- scenic's TokenLearner ------------------------------------------------------------------


def _token_learner(fuse, v11):
    """scenic's TokenLearnerViT, sizes cut (hidden size 8, three layers, two heads, 4 x 4
    patches of a 16 x 16 image, four learned tokens from the second layer on), its tokenizer
    an ml_collections.ConfigDict as scenic's configs give it; its variables (its head
    zero-initialised: every logit 0) moved off their init, as a trained model's are."""
    tokenizer = ml_collections.ConfigDict(dict(
        type="dynamic", patches=dict(size=(4, 4)), num_tokens=4, tokenlearner_loc=1,
        use_tokenfuse=fuse, use_v11=v11))  # fmt: skip
    model = zoo22.TokenLearnerViT(num_classes=3, mlp_dim=16, num_layers=3, num_heads=2,
                                  tokenizer=tokenizer, hidden_size=8, representation_size=None,
                                  dropout_rate=0.1, attention_dropout_rate=0.1)  # fmt: skip
    variables = jax.jit(lambda: model.init(jax.random.key(0), TL_IMAGES, train=False))()
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(4), len(leaves))
    moved = [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys, strict=True)]
    return model, jax.tree.unflatten(tree, moved)


TL_IMAGES = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))


@pytest.mark.parametrize(("fuse", "v11"), [(False, True), (True, False)],
                         ids=["tokenlearner_v11", "tokenfuser_v10"])  # fmt: skip
def test_token_learner_vit_over_every_feature(fuse, v11, tmp_path):
    """TokenLearnerViT (its ConfigDict attribute, version 1.1's MLP tokenizer, or 1.0's convs
    with the TokenFuser) in eval over every feature, batch symbolic: ``h(x, train=False)`` is
    Flax's, the eval call hybridized as a function of ``h.apply``."""
    model, variables = _token_learner(fuse, v11)
    h = sm.hybridize(model, variables)
    ref = jax.jit(lambda x: model.apply(variables, x, train=False))
    close(h(TL_IMAGES, train=False), ref(TL_IMAGES))
    assert float(jnp.abs(ref(TL_IMAGES)).min()) > 0  # (not the zero head's init)
    evaluated = sm.hybridize(lambda v, x: h.apply(v, x, train=False), h.params)
    every_feature(tmp_path, evaluated, ref, TL_IMAGES, allow={"convolution"}, rtol=1e-4,
                  atol=1e-4)  # fmt: skip


def test_token_learner_scenic_classification_train_steps_loss_over_h_apply():
    """scenic's classification_trainer.train_step's ``training_loss_fn`` (train_lib, as it
    calls ``flax_model.apply({'params': params, **model_state}, x, mutable=['batch_stats'],
    train=True, rngs={'dropout': dropout_rng}, debug=debug)``, ``model_state`` empty for a
    model of no BatchNorm) on ``h.apply``: the logits (dropout 0.1 from that rng), the empty
    new state and the grads of a cross-entropy equal Flax's. It was refused (``mutable=`` taken
    as an input of ``TokenLearnerViT.__call__``)."""
    model, variables = _token_learner(False, True)
    h = sm.hybridize(model, variables)
    labels = jax.nn.one_hot(jnp.arange(4) % 3, 3)

    def training_loss_fn(apply, params, dropout_rng):
        variables = {"params": params, **{}}  # **train_state.model_state
        logits, new_model_state = apply(
            variables, TL_IMAGES, mutable=["batch_stats"], train=True,
            rngs={"dropout": dropout_rng}, debug=False)  # fmt: skip
        loss = -(jax.nn.log_softmax(logits) * labels).sum(-1).mean()
        return loss, (new_model_state, logits)

    rng = jax.random.key(3)
    grad = jax.value_and_grad(training_loss_fn, argnums=1, has_aux=True)
    ours = grad(h.apply, h.params["params"], rng)
    theirs = jax.jit(grad, static_argnums=0)(model.apply, variables["params"], rng)
    close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert ours[0][1][0] == {}
    other = training_loss_fn(h.apply, h.params["params"], jax.random.key(4))[1][1]
    assert not np.allclose(other, ours[0][1][1])  # dropout drawn from the rng given
