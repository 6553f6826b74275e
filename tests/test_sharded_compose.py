"""The library's own data parallelism composed with JAX's transforms and its other parts, each
against the plain single-device model: a sharded Hybrid (``h.shard(mesh)``) under jax.grad,
jax.vmap, jax.jvp and a jit around it, its batch not dividing over the shards; ``shard_step`` with
BatchNorm and Dropout models and a padded batch; a sharded artifact loaded and transformed; a
Batcher over a sharded Hybrid. Meshes of 2 of conftest.py's 8 virtual CPU devices (compiles
cheaply), 8 where the shards must outnumber the rows of a request.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ZOO, keyless
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import symjax_mlp as sm

TOL = {"rtol": 1e-5, "atol": 1e-6}
ROWS = 13  # over 2 or 8 shards: split unevenly (shard_step pads to 14 or 16)


@functools.cache
def _mlp():
    """(h, x): an MLP's Hybrid, one device, and 13 rows."""
    net = sm.mlp((16, 4))
    x = np.asarray(jax.random.normal(jax.random.key(1), (ROWS, 12)))
    return sm.hybridize(net, net.init(jax.random.key(0), x)), x


def _case(name):
    return next(c for c in ZOO if c.name == name)


@pytest.mark.slow  # six gradients, one and two devices: ~5 s
def test_grad_of_a_padded_sharded_call_takes_any_cotangent_as_one_device():
    """jax.grad of a loss whose cotangent reaches the sharded program replicated (a mean over
    the 13 trimmed rows, a replicated factor) raised JAX's "ValueError: Sharding passed to jit
    does not match the sharding on the respective arg. Got jit sharding: NamedSharding(mesh=
    Mesh('data': 2, ...), spec=P('data',)), arg sharding: ... spec=P()" (its eager transpose
    of the program refuses it); a stateful model's held call too. Now the output carries the
    batch sharding as a constraint, which reshards the cotangent."""
    h, x = _mlp()
    s = h.shard(sm.data_mesh(2))
    w = jax.device_put(jnp.arange(4.0), NamedSharding(s.mesh, P()))
    for loss in (lambda f, v: (f(v) ** 2).mean(), lambda f, v: (f(v) * w).sum()):
        for rows in (ROWS, 12):  # split unevenly, and not
            want = jax.grad(functools.partial(loss, h))(x[:rows])
            chex.assert_trees_all_close(jax.grad(functools.partial(loss, s))(x[:rows]), want, **TOL)
    case = _case("linen_batchnorm")  # the held state's call, in eval mode
    one, two, xs = case.hybridize(), case.hybridize().shard(sm.data_mesh(2)), x[:, :5]

    def bn_loss(f, v):
        return (f(v, **case.eval) ** 2).mean()

    got = jax.grad(functools.partial(bn_loss, two))(xs)
    chex.assert_trees_all_close(got, jax.grad(functools.partial(bn_loss, one))(xs), **TOL)


@pytest.mark.slow  # ~1.2 s
def test_vmap_jvp_and_a_jit_around_a_padded_sharded_call_equal_one_device():
    h, x = _mlp()
    s = h.shard(sm.data_mesh(2))
    stacked = jnp.stack([x, 2 * x, -x])  # vmapped over its first axis: 13 rows each
    chex.assert_trees_all_close(jax.vmap(s)(stacked), jax.vmap(h)(stacked), **TOL)
    chex.assert_trees_all_close(jax.vmap(s, 1, 1)(stacked.swapaxes(0, 1)),
                                jax.vmap(h)(stacked).swapaxes(0, 1), **TOL)  # fmt: skip
    chex.assert_trees_all_close(jax.jvp(s, (x,), (x,)), jax.jvp(h, (x,), (x,)), **TOL)
    around = jax.jit(lambda v: s(v).mean(0))
    chex.assert_trees_all_close(around(x), h(x).mean(0), **TOL)
    loss = jax.value_and_grad(lambda p: (s.apply(p, x) ** 2).mean())  # params: replicated
    chex.assert_trees_all_close(loss(s.params), jax.value_and_grad(
        lambda p: (h.apply(p, x) ** 2).mean())(h.params), **TOL)  # fmt: skip


@pytest.mark.slow  # ~0.7 s each
@pytest.mark.parametrize("name", ["linen_dropout", "nnx_dropout"])
def test_dropout_masks_of_a_padded_sharded_call_are_one_devices(name):
    """Each shard draws its own rows of one mask: the rows one device draws for the batch
    (13 rows, split unevenly over 8 shards), and the key moves alike."""
    case = _case(name)
    one, eight = case.hybridize(), case.hybridize().shard(sm.data_mesh(8))
    x = jax.random.normal(jax.random.key(0), (ROWS, 5))
    for _ in range(2):
        got, want = eight(x, **case.train), one(x, **case.train)
        chex.assert_trees_all_close(got, want, **TOL)
        assert not np.allclose(got[:2], got[2:4])  # shards 0 and 1: rows of their own
    chex.assert_trees_all_equal(keyless(eight.state), keyless(one.state))


def _step_on(model, x, y, mesh=None):
    """(params and state, metrics) after one sgd step: sharded on ``mesh``, else jitted."""
    opt = optax.sgd(0.1)
    p0 = sm.training.init_params(model, jax.random.key(0), x[:1])
    step, s0 = sm.training.train_step(model, opt), opt.init(getattr(p0, "params", p0))
    if mesh is None:
        out = jax.jit(step)(p0, s0, x, y, np.ones(len(x), np.float32))
    else:
        out = sm.training.shard_step(step, mesh, donate=False)(p0, s0, x, y)
    return out[0], out[2]


def _classes(rows):
    x = np.asarray(jax.random.normal(jax.random.key(1), (rows, 5)))
    return x, np.arange(rows, dtype=np.int32) % 3


# linen's init_params compiles (~0.8 s): under -m slow
BATCHNORMS = [pytest.param("linen_batchnorm", marks=pytest.mark.slow), "nnx_batchnorm"]


@pytest.mark.parametrize("name", BATCHNORMS)
def test_shard_step_refuses_to_pad_a_batchnorm_batch(name):
    """shard_step padded 13 rows to 16 with copies of the last row, weight 0: their loss out,
    but their rows in BatchNorm's batch statistics, so the loss (1.1442 for 1.1150), every
    gradient and the running statistics (0.047 off) were another batch's, in silence. Now a
    padded batch whose rows move the model's state is refused (before any compile)."""
    with pytest.raises(sm.SignatureError, match=r"13 rows does not divide over 8 shards, and the "
                       r"model's state moves with the rows .* multiple of 8"):  # fmt: skip
        _step_on(_case(name).build()[0], *_classes(ROWS), sm.data_mesh(8))


@pytest.mark.slow  # two programs: ~2 s
def test_shard_step_of_a_whole_batchnorm_batch_equals_one_device():
    model, (x, y) = _case("linen_batchnorm").build()[0], _classes(16)
    got, want = _step_on(model, x, y, sm.data_mesh(8)), _step_on(model, x, y)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two programs: ~1.5 s
def test_shard_step_pads_a_dropout_batch_exactly():
    """A dropout key moves whatever the rows: padded with weight-0 rows, as one device."""
    model, (x, y) = _case("linen_dropout").build()[0], _classes(ROWS)
    got, want = _step_on(model, x, y, sm.data_mesh(8)), _step_on(model, x, y)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # an 8-device export, its load and three transforms: ~2 s
def test_a_sharded_artifact_under_vmap_of_grad_and_jit_equals_one_device(tmp_path):
    h, x = _mlp()
    art = sm.export(h.shard(sm.data_mesh(8)), tmp_path / "a8", example=x[:1], vjp_order=1)
    m = sm.load(art.path)
    chex.assert_trees_all_close(m(x), h(x), **TOL)

    def row_grad(f):
        return jax.vmap(jax.grad(lambda v: (f(v[None]) ** 2).mean()))(x)

    with jax.set_mesh(sm.data_mesh(8)):
        chex.assert_trees_all_close(row_grad(m), row_grad(h), **TOL)
        mean_grad = jax.jit(jax.grad(lambda v: (m(v) ** 2).mean()))(x)
    chex.assert_trees_all_close(mean_grad, jax.grad(lambda v: (h(v) ** 2).mean())(x), **TOL)


@pytest.mark.slow  # a Batcher's buckets on 8 shards: ~1 s
def test_a_batcher_over_a_sharded_hybrid_pads_no_real_row():
    """Requests of 1..7 rows merged, zero-padded to a bucket, and that split unevenly over the 8
    shards: each request's rows as one device gives them (a BatchNorm model in eval mode)."""
    case = _case("linen_batchnorm")
    one, eight = case.hybridize(), case.hybridize().shard(sm.data_mesh(8))
    x = np.asarray(jax.random.normal(jax.random.key(1), (ROWS, 5)))
    one(x[:8], **case.train), eight(x[:8], **case.train)  # the statistics move alike
    spans = ((0, 1), (1, 3), (4, 2), (6, 7))
    with sm.serving.Batcher(eight, example=x[:1], max_batch=8, kwargs=case.eval) as b:
        futures = [b.submit(x[i : i + k]) for i, k in spans]
        for f, (i, k) in zip(futures, spans, strict=True):
            chex.assert_trees_all_close(f.result(), one(x[i : i + k], **case.eval), **TOL)


@pytest.mark.slow  # an 8-device program and its gradient: ~0.8 s
def test_a_sharded_call_of_a_row_mixing_model_is_exact_at_a_batch_that_does_not_divide():
    """13 rows over 8 shards were padded to 16 with copies of the last row and the result
    trimmed: a model mixing its rows (the batch's mean taken out) was 0.39 off one device, in
    silence. Now such a batch goes in whole and XLA splits it unevenly inside the program."""
    h = sm.hybridize(lambda p, x: (x - x.mean(0)) * p, jnp.float32(2))
    s, x = h.shard(sm.data_mesh(8)), jax.random.normal(jax.random.key(0), (ROWS, 3))
    chex.assert_trees_all_close(s(x), h(x), **TOL)

    def loss(f, v):
        return (f(v) ** 2 * jnp.arange(3.0)).mean()

    want = jax.grad(functools.partial(loss, h))(x)
    chex.assert_trees_all_close(jax.grad(functools.partial(loss, s))(x), want, **TOL)
