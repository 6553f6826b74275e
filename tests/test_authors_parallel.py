"""Data parallelism as its authors write it, over conftest's 8 CPU devices: equinox's
docs/examples/parallelism.ipynb (patrick-kidger/equinox@9336d820b2ef66b360fc6cb3611b3da5cefbb14d:
``eqx.filter_shard`` inside ``eqx.filter_jit(donate=...)`` steps, a mesh of Auto axes, the model
replicated and the batch split) and JAX's examples/spmd_mnist_classifier_fromscratch.py
(jax-ml/jax@cec06d116c05f0d52adfceee3d3b730fdbcb0ce5: an Explicit-axes mesh, the params
``device_put`` replicated, each batch split over ``"batch"``, the step run under
``jax.set_mesh``), as written there; sizes made tiny (64 rows of 4 channels, hidden 8; 16
pixels, 8 hidden units). Each is hybridized, differentiated, trained and exported as the source
runs; the artifact holds the 8-device sharding, which IREE refuses by name."""

import functools

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.sharding as jshard
import numpy as np
import optax
import pytest
from helpers import init_random_params, predict
from jax import NamedSharding
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import symjax_mlp as sm

pytestmark = pytest.mark.slow
TOL = {"rtol": 2e-5, "atol": 2e-5}

# -- equinox's parallelism.ipynb, as written there --------------------------------------------
dataset_size, channel_size, hidden_size, depth = 64, 4, 8, 1
learning_rate, batch_size = 3e-4, 16


def compute_loss(model, x, y):
    pred_y = jax.vmap(model)(x)
    return jnp.mean((y - pred_y) ** 2)


@functools.cache
def _notebook():
    """``(model, optim, model_sharding, data_sharding, xs, ys)`` as the notebook sets them up."""
    xs = np.random.default_rng(0).normal(size=(dataset_size, channel_size)).astype(np.float32)
    ys = np.sin(xs)
    model = eqx.nn.MLP(channel_size, channel_size, hidden_size, depth, key=jr.PRNGKey(6789))
    optim = optax.adam(learning_rate)
    num_devices = len(jax.devices())
    mesh = jax.make_mesh((num_devices,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    data_sharding = jshard.NamedSharding(mesh, jshard.PartitionSpec("batch"))
    model_sharding = jshard.NamedSharding(mesh, jshard.PartitionSpec())
    return model, optim, model_sharding, data_sharding, xs, ys


def _steps():
    """The notebook's ``train_step`` and ``evaluate``."""
    _, optim, model_sharding, data_sharding, _, _ = _notebook()

    @eqx.filter_jit(donate="all")
    def train_step(model, opt_state, x, y):
        model, opt_state = eqx.filter_shard((model, opt_state), model_sharding)
        x, y = eqx.filter_shard((x, y), data_sharding)
        grads = eqx.filter_grad(compute_loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return eqx.filter_shard((model, opt_state), model_sharding)

    @eqx.filter_jit(donate="all-except-first")
    def evaluate(model, x, y):
        model = eqx.filter_shard(model, model_sharding)
        x, y = eqx.filter_shard((x, y), data_sharding)
        return compute_loss(model, x, y)

    return train_step, evaluate


def test_equinox_parallelism_evaluates_trains_and_exports_as_its_notebook(tmp_path):
    model, optim, model_sharding, data_sharding, xs, ys = _notebook()
    train_step, evaluate = _steps()
    model = eqx.filter_shard(model, model_sharding)  # as the notebook places it
    x, y = (jnp.asarray(a[:batch_size]) for a in (xs, ys))
    h = sm.hybridize(evaluate, model)
    want = evaluate(model, x, y)
    for got in (h(x, y), h.eager(x, y), h(xs[:batch_size], ys[:batch_size])):
        chex.assert_trees_all_close(got, want, **TOL)
    grads = jax.grad(lambda p: h.apply(p, x, y))(h.params)
    want_grads = eqx.filter_grad(compute_loss)(model, x, y)
    chex.assert_trees_all_close(jax.tree.leaves(grads), jax.tree.leaves(want_grads), **TOL)

    # the notebook's loop (train_step donates its model: a copy of h's params goes in) and the
    # same steps over h.apply, as train()'s refusal of an equinox model names them
    mine = jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_inexact_array))
    notebook = eqx.combine(mine, model)
    opt_state = optim.init(eqx.filter(notebook, eqx.is_inexact_array))
    params, my_state = h.params, optim.init(h.params)
    step = jax.jit(lambda p, s, x, y: _update(optim, h, p, s, x, y))
    for i in range(3):
        batch = eqx.filter_shard((xs[16 * i : 16 * (i + 1)], ys[16 * i : 16 * (i + 1)]),
                                 data_sharding)  # fmt: skip
        notebook, opt_state = train_step(notebook, opt_state, *batch)
        params, my_state = step(params, my_state, *batch)
    trained = h.replace(params=params)
    chex.assert_trees_all_close(trained(x, y), evaluate(notebook, x, y), **TOL)

    sm.export(trained, tmp_path / "m", example=(x, y))
    m = sm.load(tmp_path / "m")
    assert m.manifest["nr_devices"] == len(jax.devices()) == 8  # the sharding, recorded
    chex.assert_trees_all_close(m(xs[:8], ys[:8]), evaluate(notebook, xs[:8], ys[:8]), **TOL)
    with pytest.raises(sm.ArtifactError, match=r"sharded over 8 devices; IREE runs single"):
        sm.load(tmp_path / "m", runtime="iree")


def _update(optim, h, params, opt_state, x, y):
    grads = jax.grad(lambda p: h.apply(p, x, y))(params)
    updates, opt_state = optim.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state


# -- JAX's spmd_mnist_classifier_fromscratch.py, as written there (its init_random_params and
# predict are the from-scratch example's, helpers.py's) ----------------------------------------
def loss(params, batch):
    inputs, targets = batch
    preds = predict(params, inputs)
    return -jnp.mean(jnp.sum(preds * targets, axis=1))


step_size = 0.001


@jax.jit(donate_argnums=0)
def train_step(params, batch):
    grads = jax.grad(loss)(params, batch)
    return [
        (w - step_size * dw, b - step_size * db)
        for (w, b), (dw, db) in zip(params, grads, strict=False)
    ]


def test_the_spmd_classifier_on_its_explicit_mesh_runs_trains_and_exports_as_jax(tmp_path):
    mesh = jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(AxisType.Explicit,))
    replicated_sharding = NamedSharding(mesh, P())
    data_sharding = NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(0)
    images_np = rng.normal(size=(16, 16)).astype(np.float32)
    labels_np = np.eye(10, dtype=np.float32)[np.arange(16) % 10]
    images = jax.device_put(images_np, data_sharding)
    labels = jax.device_put(labels_np, data_sharding)
    replicated_params = jax.device_put(init_random_params(0.1, [16, 8, 10]), replicated_sharding)
    h = sm.hybridize(predict, replicated_params)
    want = predict(replicated_params, images)
    for got in (h(images), h.eager(images), h(images_np)):
        chex.assert_trees_all_close(np.asarray(got), np.asarray(want), **TOL)

    def hybrid_step(params, batch):  # the example's step, its loss over h.apply
        grads = jax.grad(lambda p: -jnp.mean(jnp.sum(h.apply(p, batch[0]) * batch[1], 1)))(params)
        return [(w - step_size * dw, b - step_size * db)
                for (w, b), (dw, db) in zip(params, grads, strict=True)]  # fmt: skip

    params, mine = replicated_params, jax.tree.map(jnp.copy, replicated_params)
    with jax.set_mesh(mesh):  # as the example runs its step
        for _ in range(3):
            params = train_step(params, (images, labels))  # (donates the params it is given)
            mine = jax.jit(hybrid_step)(mine, (images, labels))
    chex.assert_trees_all_close(jax.device_get(mine), jax.device_get(params), **TOL)

    sm.export(h.replace(params=mine), tmp_path / "m", example=images)
    m = sm.load(tmp_path / "m")
    for rows in (16, 3):
        got, want = m(images_np[:rows]), predict(jax.device_get(params), images_np[:rows])
        chex.assert_trees_all_close(np.asarray(got), np.asarray(want), **TOL)
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [f.result(30) for f in [b.submit(images_np[i : i + 1]) for i in range(3)]]
    chex.assert_trees_all_close(np.concatenate(got), np.asarray(m(images_np[:3])), **TOL)
