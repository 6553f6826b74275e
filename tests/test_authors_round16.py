"""Code we did not write, round sixteen (tests/zoo16.py; sources and commits there), over
every feature: hybridize, ``h(x)`` equal to the plain model, its graph, export + load + call
equal, grads/Hessians over the loaded model, a Batcher's answers, and what is specific.

- sharding-ad.md, on its one-axis mesh ``X`` of two of conftest's eight CPU devices (Explicit):
  the data-parallel ``loss`` and ``loss2`` (``w`` cast to ``reduced={'X'}``) over every feature
  with the batch static and split over ``X`` (a Batcher refuses a loss: one number a
  batch); ``loss2``'s export staged its program unsplit (JAX's raw ShardingTypeError from its
  VJP), now kept on the split; a symbolic batch (JAX splits none over a mesh) or an unsplit
  example is refused naming ``batch=None`` with a split one.
  A per-row ``tanh(x @ w)`` exported on the mesh with ``batch='b'``: the loaded model's
  grads (its VJP was built on the caller's mesh, the forward off it: 'expects static
  assert_what').
  ``loss_fanout``'s two uses of ``w`` and the capstone's microbatch ``step`` over ``h.apply``:
  its gradients come back unreduced (the docs' ``assert`` holds) and its weights equal the
  docs' step's.
- simple_FNO_in_JAX.ipynb: ``FNO1d`` (``jnp.fft.rfft``/``irfft`` around complex weights of the
  lowest modes) over every feature, batch symbolic; the notebook's Adam steps (``loss_fn``,
  ``optax.adam``) over ``h.apply`` equal ``eqx.filter_value_and_grad``'s.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo16
from features import close, every_feature

import symjax_mlp as sm


@pytest.fixture
def mesh():
    """The docs' ``jax.set_mesh(jax.make_mesh((2,), ('X',)))``, on two of the eight devices."""
    with jax.set_mesh(jax.make_mesh((2,), ("X",), devices=jax.devices()[:2])) as m:
        yield m


def _docs_arrays():
    x = jax.device_put(jnp.arange(8 * 4.0).reshape(8, 4) / 10.0, jax.P("X", None))
    w = jax.device_put(jnp.arange(4 * 2.0).reshape(4, 2) / 10.0, jax.P(None, None))
    return w, x


@pytest.mark.slow
@pytest.mark.parametrize("fn", [zoo16.loss, zoo16.loss2])
def test_sharding_ad_losses_over_every_feature_on_their_mesh(tmp_path, mesh, fn):
    """``loss`` and ``loss2`` of the docs' ``x`` (split over ``X``): every feature, the batch
    static; the grads over ``h.apply`` typed as the docs print them (``dw`` replicated,
    ``dx`` split ``8@X``) and equal to theirs. ``loss2``'s export raised JAX's
    ShardingTypeError ('unreduced axes should be equal to the contracting specs'): it was
    staged unsplit."""
    w, x = _docs_arrays()
    h = sm.hybridize(fn, w)
    dw, dx = jax.grad(h.apply, argnums=(0, 1))(w, x)
    assert str(jax.typeof(dw)) == "float32[4,2]" and str(jax.typeof(dx)) == "float32[8@X,4]"
    close((dw, dx), jax.grad(fn, argnums=(0, 1))(w, x), rtol=1e-5, atol=1e-3)
    ref, tol = (lambda r: fn(w, r)), {"rtol": 1e-5, "atol": 1e-3}
    close(h(x), ref(x), **tol)
    assert h.graph(x).flops > 0
    sm.export(h, tmp_path / "m", example=(x,), batch=None, vjp_order=2)
    m = sm.load(tmp_path / "m")
    close(m(np.asarray(x)), ref(x), **tol)
    close(jax.grad(lambda r: m(r))(np.asarray(x)), dx, **tol)
    hess = lambda f: jax.jacrev(jax.jacrev(f))(x)  # noqa: E731 - the batch's Hessian
    close(hess(m), hess(ref), **tol)
    with pytest.raises(sm.ConfigError, match="per-row outputs"), sm.serving.Batcher(m) as b:
        b.submit(np.asarray(x)).result(30)  # a loss: one number for the batch, not per row


def test_reduced_weights_unsplit_are_refused_naming_what_works(tmp_path, mesh):
    """``loss2`` with ``batch='b'`` (JAX splits no symbolic dimension) or of an example on one
    device: staged unsplit, its VJP has no split to contract (was JAX's raw
    ShardingTypeError from serialize; with vjp_order=0 its raw JaxRuntimeError 'expects static
    assert_what'); refused naming the mesh's axis and ``batch=None`` with a split example."""
    w, x = _docs_arrays()
    h = sm.hybridize(zoo16.loss2, w)
    for batch, example, order in (("b", x, 1), ("b", x, 0), (None, np.asarray(x), 1)):
        with pytest.raises(sm.ConfigError, match=r"axes X .*batch=None and the example split"):
            sm.export(h, tmp_path / "b", example=(example,), batch=batch, vjp_order=order)


@pytest.mark.slow
def test_fanout_and_the_capstone_step_over_the_hybrid(tmp_path, mesh):
    """``loss_fanout`` (``w`` used twice, reduced): grads over ``h.apply`` equal the docs';
    exported and loaded, its value and input grads too. The capstone ``step`` over ``h.apply``
    of ``predict`` (a scan over layers): the docs' ``assert`` that the gradients are unreduced
    holds, and its new weights equal the docs' step's."""
    w, _ = _docs_arrays()
    x1 = jax.device_put(jnp.ones((8, 4)), jax.P("X", None))
    x2 = jax.device_put(jnp.ones((8, 4)) / 2, jax.P("X", None))
    h = sm.hybridize(zoo16.loss_fanout, w)
    close(jax.grad(h.apply)(w, x1, x2), jax.grad(zoo16.loss_fanout)(w, x1, x2))
    sm.export(h, tmp_path / "f", example=(x1, x2), batch=None, vjp_order=1)
    m = sm.load(tmp_path / "f")
    close(m(np.asarray(x1), np.asarray(x2)), zoo16.loss_fanout(w, x1, x2))
    g = lambda f: jax.grad(f, argnums=(0, 1))(x1, x2)  # noqa: E731
    close(g(m), g(lambda a, b: zoo16.loss_fanout(w, a, b)))

    stacked_ws = jax.device_put(jnp.stack([jnp.eye(4) / 2] * 3), jax.P(reduced={"X"}))
    xs = jax.device_put(jnp.ones((5, 2, 4)), jax.P(None, "X", None))
    hp = sm.hybridize(zoo16.predict, stacked_ws)
    ours = zoo16.make_step(hp.apply)(stacked_ws, xs)
    close(ours, zoo16.make_step(zoo16.predict)(stacked_ws, xs))
    assert str(jax.typeof(ours)) == "float32[3,4,4]"


def _fno():
    return zoo16.FNO1d(2, 1, 3, 4, jax.nn.relu, n_blocks=2, key=jax.random.PRNGKey(0))


@pytest.mark.slow
def test_fno_over_every_feature_and_the_notebooks_adam_steps(tmp_path):
    """``FNO1d`` (3 modes, width 4, 2 blocks) of rows of 2 channels x 8 points: every
    feature, batch symbolic; three of the notebook's Adam steps (``loss_fn``, ``optax.adam``)
    over ``h.apply`` equal ``eqx.filter_value_and_grad``'s."""
    fno = _fno()
    key_a, key_u = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(key_a, (5, 2, 8))
    y = jax.random.normal(key_u, (5, 1, 8))
    h = sm.hybridize(lambda m, r: jax.vmap(m)(r), fno)
    assert h.graph(x).primitive_counts["fft"] == 4  # rfft and irfft per block
    allow = {"convolution", "dynamic_gather", "dynamic_update_slice", "fft", "gather"}
    allow |= {"real_dynamic_slice", "scatter"}  # (the ops load names, as it refused them)
    every_feature(tmp_path, h, jax.vmap(fno), x, allow=allow, rtol=1e-4, atol=1e-5)

    optimizer = optax.adam(3e-4)

    @eqx.filter_jit
    def make_step(model, state, x, y):  # the notebook's, its val_loss left out
        loss, grad = eqx.filter_value_and_grad(zoo16.loss_fn)(model, x, y)
        updates, new_state = optimizer.update(grad, state, model)
        return eqx.apply_updates(model, updates), new_state, loss

    @jax.jit
    def hybrid_step(params, state, x, y):  # the same over h.apply
        loss, grad = jax.value_and_grad(lambda p: jnp.mean((h.apply(p, x) - y) ** 2))(params)
        updates, new_state = optimizer.update(grad, state, params)
        return optax.apply_updates(params, updates), new_state, loss

    params, model = h.params, fno
    p_state, m_state = optimizer.init(params), optimizer.init(eqx.filter(model, eqx.is_array))
    for _ in range(3):
        params, p_state, loss = hybrid_step(params, p_state, x, y)
        model, m_state, want = make_step(model, m_state, x, y)
        close(loss, want, rtol=1e-5, atol=1e-6)
    close(h.replace(params=params)(x), jax.vmap(model)(x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_grads_of_a_model_exported_on_an_explicit_mesh_with_a_symbolic_batch(tmp_path, mesh):
    """The docs' ``x @ w`` per row (``jnp.tanh``), exported under the mesh with ``batch='b'``
    (its one-device program staged off the mesh): ``jax.grad`` of the loaded model raised
    ArtifactError 'expects static assert_what ... Export the model again' (its VJP was built
    on the caller's mesh); its grads now equal the plain net's, the example split or not."""
    w, x = _docs_arrays()
    net = lambda w, r: jnp.tanh(r @ w)  # noqa: E731
    rows = np.asarray(x)[:3]
    want = jax.grad(lambda r: net(np.asarray(w), r).sum())(rows)
    for i, example in enumerate((x, np.asarray(x))):
        sm.export(sm.hybridize(net, w), tmp_path / str(i), example=(example,), vjp_order=1)
        m = sm.load(tmp_path / str(i))
        close(jax.grad(lambda r: m(r).sum())(rows), want)  # noqa: B023
