"""Code we did not write, round twenty-three (tests/zoo23.py; sources and commits there): two
libraries never run here before, over every feature (hybridize, ``h(x)`` equal to the plain
model, its graph, export + load + call equal, grads/Hessians over the loaded model, a
Batcher's answers) and the authors' own training.

- penzai's how_to_think_in_penzai.ipynb: ``SimpleMLP`` (named axes ``batch`` and ``features``; its
  Parameters mutable variables, unbound frozen as the jitting notebook does,
  ``pz.unbind_params(model, freeze=True)``, run by ``stateless_call``) hybridized over its
  NamedArray, equal to the model; over plain arrays, a row named inside under ``jax.vmap``,
  over every feature; an export of the NamedArray itself is refused (an artifact takes
  positional arrays), and the refusal's route, as a batch named inside, exports with
  ``batch=None`` only: penzai's axis sizes are ints, held in the NamedArray's tree;
  three of penzai's ``StatefulTrainer`` steps of the notebook's ``loss_fn`` equal three of
  ours over ``h.apply``. Hybridized without params (as a model, or a function holding one) it is
  refused, naming penzai's unbinding: the generic refusal's advice baked its variables in.
- distrax's flow.py: ``log_prob`` (``hk.without_apply_rng``'s ``Transformed`` of a
  ``MaskedCoupling`` flow of rational-quadratic splines, cut to 2 layers of a 16 x 16 MLP,
  4 x 4 images) over every feature; three of the example's ``update`` equal three of ours over
  ``h.apply``; the flow's ``sample`` (ours: flow.py draws none) under ``hk.transform`` as
  ``h(key, n=3)``, raw and typed keys, exported and loaded with ``kwargs={"n": 3}``.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo23
from features import close, every_feature
from penzai import pz
from penzai.toolshed import basic_training

import symjax_mlp as sm

AXES = ("batch", "features")
X = jax.random.normal(jax.random.key(100), (4, 8))
Y = jax.random.normal(jax.random.key(101), (4, 8))


def _named(a):
    return pz.nx.wrap(a).tag(*AXES)


def _mlp():
    """The notebook's ``SimpleMLP``, as its cell 83 builds it."""
    return zoo23.SimpleMLP.from_config(name="mlp", init_base_rng=jax.random.key(42),
                                       feature_sizes=[8, 32, 32, 8], activation=jax.nn.relu,
                                       features_axis="features")  # fmt: skip


def test_penzai_model_without_params_names_unbind_params():
    """A penzai model hybridized as a model, or a function holding one, with no params: its
    Parameters are mutable variables, which ``hybridize(lambda _, x: model(x), {})`` (the
    generic refusal's advice) bakes into the program, h.params empty and the model's training
    in place unseen (h(x) 1.8 off after 3 of penzai's trainer steps). The refusal names
    penzai's own route, ``pz.unbind_params(model, freeze=True)`` and ``stateless_call``. The
    model as the notebook's cell 81 builds it, ``init_base_rng=None`` (no arrays made)."""
    model = zoo23.SimpleMLP.from_config(name="mlp", init_base_rng=None,
                                        feature_sizes=[8, 32, 32, 8], activation=jax.nn.relu,
                                        features_axis="features")  # fmt: skip
    said = r"a penzai SimpleMLP holds its Parameters.*pz.unbind_params\(model, freeze=True\)"
    for f in (model, lambda x: model(x)):
        with pytest.raises(sm.ConfigError, match=said):
            sm.hybridize(f)


@pytest.mark.slow  # a compile or more (~0.5 s or more)
def test_penzai_simple_mlp_over_named_arrays_and_every_feature(tmp_path):
    """``stateless_call`` of the unbound model over its frozen params: over the NamedArray
    itself (the same named shape back), and over plain arrays, a row named ``features``
    under ``jax.vmap`` (penzai's named axes are of int sizes: a symbolic batch can only be
    vmapped over, see the next test), every feature."""
    model = _mlp()
    unbound, params = pz.unbind_params(model, freeze=True)
    h = sm.hybridize(lambda p, x: unbound.stateless_call(p, x)[0], params)
    got, want = h(_named(X)), model(_named(X))
    assert got.named_shape == want.named_shape == {"batch": 4, "features": 8}
    close(got.unwrap(*AXES), want.unwrap(*AXES))

    def run(p, x):
        one = lambda r: unbound.stateless_call(p, pz.nx.wrap(r).tag("features"))[0]  # noqa: E731
        return jax.vmap(lambda r: one(r).unwrap("features"))(x)

    every_feature(tmp_path, sm.hybridize(run, params), lambda x: model(_named(x)).unwrap(*AXES), X)


@pytest.mark.slow  # a compile or more (~0.5 s or more)
def test_penzai_named_array_export_is_refused_and_its_routes(tmp_path):
    """An artifact's inputs are positional arrays: a NamedArray is refused, naming the function
    of its leaves to export, and (once unsaid) that its tree holds the named axes' sizes
    (static metadata): that function fixes the batch at the example's 4 rows; the route it
    names for any batch, a row named inside under ``jax.vmap``, exports as said. Rebuilt from
    its tree, or made inside of a symbolic batch (penzai's sizes are ints), it is refused with
    a symbolic batch, naming penzai's complaint and ``batch=None``; exported with that."""
    model = _mlp()
    unbound, params = pz.unbind_params(model, freeze=True)
    h = sm.hybridize(lambda p, x: unbound.stateless_call(p, x)[0], params)
    said = r"NamedArray \(a registered pytree\) of 1 arr.*fixes the batch.*batch=None.*pz.nx.wrap"
    with pytest.raises(sm.SignatureError, match=said):
        sm.export(h, tmp_path / "named", example=(_named(X),))

    def row(p, x):  # as the refusal writes it
        return jax.vmap(lambda r: h.apply(p, pz.nx.wrap(r).tag("features")).unwrap("features"))(x)

    sm.export(sm.hybridize(row, h.params), tmp_path / "row", example=(X,))
    close(sm.load(tmp_path / "row")(np.asarray(X[:3])), model(_named(X[:3])).unwrap(*AXES))
    leaves, tree = jax.tree.flatten(_named(X))
    flat = lambda p, *xs: tuple(jax.tree.leaves(h.apply(p, jax.tree.unflatten(tree, xs))))  # noqa: E731
    inside = lambda p, x: h.apply(p, _named(x)).unwrap(*AXES)  # noqa: E731
    want = model(_named(X)).unwrap(*AXES)
    for i, f in enumerate((flat, inside)):
        hf = sm.hybridize(f, h.params)
        with pytest.raises(sm.SignatureError, match=r"named_axes.*Or pass batch=None"):
            sm.export(hf, tmp_path / f"b{i}", example=tuple(leaves))
        sm.export(hf, tmp_path / f"m{i}", example=tuple(leaves), batch=None)
        close(sm.load(tmp_path / f"m{i}")(np.asarray(X)), (want,) if f is flat else want)


@pytest.mark.slow  # a compile or more (~0.5 s or more)
def test_penzai_stateful_trainer_steps_equal_ours():
    """Three of penzai's ``StatefulTrainer`` steps (adam 0.01) of the notebook's ``loss_fn``
    equal three adam steps of that ``loss_fn`` over ``h.apply`` (a callable as its model):
    the losses, then the params the trainer wrote into the model's variables."""
    model = _mlp()
    _, params = pz.unbind_params(model, freeze=True)
    params = jax.tree.map(jnp.copy, params)  # the trainer donates the model's arrays
    unbound, _ = pz.unbind_params(model)
    h = sm.hybridize(lambda p, x: unbound.stateless_call(p, x)[0], params)
    inputs, targets = _named(X), _named(Y)
    trainer = basic_training.StatefulTrainer.build(root_rng=jax.random.key(42), model=model,
                                                   optimizer_def=optax.adam(0.01),
                                                   loss_fn=zoo23.mlp_loss_fn)  # fmt: skip
    tx = optax.adam(0.01)
    p, opt, ours, theirs = h.params, tx.init(h.params), [], []

    def loss(p):
        return zoo23.mlp_loss_fn(lambda x: h.apply(p, x), None, None, inputs, targets)[0]

    for _ in range(3):
        value, grads = jax.value_and_grad(loss)(p)
        updates, opt = tx.update(grads, opt, p)
        p = optax.apply_updates(p, updates)
        ours.append(value)
        theirs.append(trainer.step(current_input=inputs, current_target=targets)["my_loss"])
    close(ours, theirs)
    close(p, pz.unbind_params(model, freeze=True)[1])


@pytest.fixture
def small_flow(monkeypatch):
    """flow.py's FLAGS cut (2 layers, hidden 16); its params from ``log_prob.init`` moved off
    the identity it starts at (the conditioners' last layer is zero): the flow does work."""
    monkeypatch.setattr(zoo23.FLAGS, "flow_num_layers", 2)
    monkeypatch.setattr(zoo23.FLAGS, "hidden_size", 16)
    params = zoo23.log_prob.init(jax.random.key(0), np.zeros((1, 4, 4, 1)))
    noise = lambda i, w: 0.1 * jax.random.normal(jax.random.key(i), w.shape)  # noqa: E731
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [w + noise(i, w) for i, w in enumerate(leaves)])


def _images(n=4, seed=1):
    return jax.random.randint(jax.random.key(seed), (n, 4, 4, 1), 0, 256).astype(jnp.uint8)


FLOW_OPS = {"dynamic_gather", "real_dynamic_slice", "reduce_window", "scatter"}


@pytest.mark.slow  # a compile or more (~0.5 s or more)
def test_distrax_flow_log_prob_every_feature(tmp_path, small_flow):
    """``log_prob.apply`` and its params over every feature, on the example's eval data
    (``prepare_data``: pixels / 256); the spline's bin search is a gather and a
    ``reduce_window``, which the loaded artifact is allowed."""
    params = small_flow
    x = zoo23.prepare_data({"image": _images()})
    h = sm.hybridize(zoo23.log_prob.apply, params)
    want = zoo23.log_prob.apply(params, x)
    assert np.all(np.isfinite(want)) and np.ptp(want) > 0.1  # the flow is no identity
    every_feature(tmp_path, h, lambda r: zoo23.log_prob.apply(params, r), x, allow=FLOW_OPS)
    close(-jnp.mean(h(x)), zoo23.eval_fn(params, {"image": _images()}))


@pytest.mark.slow  # a compile or more (~0.5 s or more)
def test_distrax_flow_the_examples_update(small_flow):
    """Three of flow.py's ``update`` (adam 1e-4, dequantizing noise from its key) equal three
    of ours over ``h.apply`` of the example's ``prepare_data``."""
    optimizer = optax.adam(zoo23.FLAGS.learning_rate)
    update = zoo23.authors_update(optimizer)
    h = sm.hybridize(zoo23.log_prob.apply, small_flow)
    theirs, opt_theirs = small_flow, optimizer.init(small_flow)
    p, opt = h.params, optimizer.init(h.params)

    def loss(p, key, batch):
        return -jnp.mean(h.apply(p, zoo23.prepare_data(batch, key)))

    for step in range(3):
        batch, key = {"image": _images(seed=step)}, jax.random.key(10 + step)
        close(jax.grad(loss)(p, key, batch), jax.grad(zoo23.loss_fn)(theirs, key, batch))
        theirs, opt_theirs = update(theirs, key, opt_theirs, batch)
        updates, opt = optimizer.update(jax.grad(loss)(p, key, batch), opt)
        p = optax.apply_updates(p, updates)
    close(p, theirs)


@pytest.mark.slow  # a compile or more (~0.5 s or more)
def test_distrax_flow_sample_from_a_key(tmp_path, small_flow):
    """The flow's ``sample`` (the model flow.py builds, a key from Haiku's ``next_rng_key``) as
    ``h(key, n=3)``: Haiku's draws for a raw and a typed key, other keys other draws; exported
    with ``kwargs={"n": 3}``, the loaded model draws them too, in the flow's [0, 1) range."""

    def draw(n):
        model = zoo23.make_flow_model(event_shape=(4, 4, 1), num_layers=2, hidden_sizes=[16] * 2,
                                      num_bins=zoo23.FLAGS.num_bins)  # fmt: skip
        return model.sample(seed=hk.next_rng_key(), sample_shape=(n,))

    sample = hk.transform(draw)
    h = sm.hybridize(sample.apply, small_flow)
    for i, key in enumerate((jax.random.PRNGKey(5), jax.random.key(5))):
        want = sample.apply(small_flow, key, n=3)
        close(h(key, n=3), want)
        assert np.abs(h(jax.random.fold_in(key, 1), n=3) - want).max() > 0.1
        sm.export(h, tmp_path / f"s{i}", example=(key,), kwargs={"n": 3}, batch=None)
        got = sm.load(tmp_path / f"s{i}", allow=FLOW_OPS)(key)
        close(got, want)
        assert got.shape == (3, 4, 4, 1) and np.all((got >= 0) & (got <= 1))
