"""Code we did not write, round eleven: JAX's docs where no round looked, as their authors wrote
them (tests/zoo11.py; sources and commit there), over every feature: hybridize, ``h(x)`` equal
to the plain model, its graph, export (a symbolic batch where the model allows one) + load +
call equal, grads/Hessians over the loaded model (``vjp_order=2``), a Batcher's answers, and
the original's own steps where it trains.

- complex-differentiation.md: complex inputs and params: ``f(z)`` (C -> R) trains by the docs'
  conjugate step, ``jnp.sin`` differentiates ``holomorphic=True`` through the loaded model,
  and the complex Cholesky's LAPACK kernels are refused at load naming ``allow=``.
- random-numbers.md: ``jax.vmap(random.normal)(subkeys)`` takes a batch of typed keys; a dense
  layer drawing from one key it is given exports with ``shapes=(None, 'b, ...')``, which the
  refusal of the default batch names.
- higher-order.md: ``td_loss``'s ``stop_gradient`` survives export (the loaded model's grads
  are TD(0)'s), its update steps over ``h.apply`` equal the docs' ``td_update``; the
  straight-through estimator's grads are the identity's through the loaded model.
- jacobian-vector-products.md: the Hybrid takes the docs' three HVPs; the loaded model takes
  reverse over reverse and refuses forward mode naming ``jax.jacrev``.
- pytrees.md: an MLP of NumPy float64 params in a list of dicts trains by the docs' ``update``.
- Flax's pytorch_to_jax_flax.rst: ``Model`` and its ``train_step``, a Param beside a Buffer,
  and ``JModel``, ``BatchNorm``, ``avg_pool``, ``ConvTranspose`` with torch's weights, equal to
  torch's answers as the guide asserts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo11
from features import close as _close
from features import every_feature
from flax import linen as nn
from flax import nnx
from jax import random

import symjax_mlp as sm


def _z(shape, seed=0):
    k1, k2 = random.split(random.key(seed))
    return (random.normal(k1, shape) + 1j * random.normal(k2, shape)).astype(jnp.complex64)


@pytest.mark.slow
def test_complex_rows_to_real_and_the_docs_conjugate_step(tmp_path):
    """``f(z) = x**2 + y**2`` of complex rows: the Hybrid, the loaded model (batch symbolic)
    and its grads (complex, as ``grad(f)(z)``), per-row grads and a Batcher's answers equal
    the plain net's; the docs' step for a C -> R loss (along the conjugate of ``grad``) over
    ``h.apply`` of complex params equals the plain one's."""
    p = {"w": jnp.asarray([1.0, 2.0 - 1j, 0.5j], jnp.complex64)}
    z = _z((5, 3))
    ref = lambda r: zoo11.net_abs2(p, r)  # noqa: E731
    h = sm.hybridize(zoo11.net_abs2, p)
    _close(h(z), ref(z))
    assert h.graph(z).primitive_counts["imag"] == 1
    sm.export(h, tmp_path / "m", example=(z,), vjp_order=2)
    m = sm.load(tmp_path / "m")
    _close(m(np.asarray(z[:3])), ref(z[:3]))
    _close(jax.grad(lambda r: m(r).sum())(z), jax.grad(lambda r: ref(r).sum())(z))
    one = lambda f: lambda r: f(r[None]).sum()  # noqa: E731
    _close(jax.vmap(jax.grad(one(m)))(z), jax.vmap(jax.grad(one(ref)))(z))
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [b.submit(np.asarray(z[i : i + 1])).result(30) for i in range(2)]
    _close(np.concatenate(got), ref(z[:2]))
    loss = lambda apply: lambda q: apply(q, z).mean()  # noqa: E731
    ours, theirs = p, p
    for _ in range(3):
        ours = jax.tree.map(lambda w, g: w - 0.1 * jnp.conj(g), ours, jax.grad(loss(h.apply))(ours))
        theirs = jax.tree.map(
            lambda w, g: w - 0.1 * jnp.conj(g), theirs, jax.grad(loss(zoo11.net_abs2))(theirs)
        )
    _close(ours, theirs)
    assert loss(h.apply)(ours) < loss(h.apply)(p)


@pytest.mark.slow
def test_holomorphic_sin_through_the_loaded_model(tmp_path):
    """``jnp.sin`` of complex rows (C -> C): ``grad(..., holomorphic=True)`` and its Hessian
    (jacrev of jacrev, both holomorphic) over the loaded model equal the plain net's."""
    p = {"w": jnp.asarray([1.0, 2.0, 0.5 + 0.5j], jnp.complex64)}
    z = 0.3 * _z((4, 3), 1)
    ref = lambda r: zoo11.net_sin(p, r)  # noqa: E731
    h = sm.hybridize(zoo11.net_sin, p)
    _close(h(z), ref(z))
    sm.export(h, tmp_path / "m", example=(z,), vjp_order=2)
    m = sm.load(tmp_path / "m")
    _close(m(np.asarray(z[:3])), ref(z[:3]))
    g = lambda f: jax.grad(lambda r: f(r).sum(), holomorphic=True)(z)  # noqa: E731
    _close(g(m), g(ref))
    one = lambda f: lambda r: f(r[None]).sum()  # noqa: E731
    hess = lambda f: jax.jacrev(jax.jacrev(one(f), holomorphic=True), holomorphic=True)(z[0])  # noqa: E731
    _close(hess(m), hess(ref))
    with sm.serving.Batcher(m, max_batch=4) as b:
        _close(b.submit(np.asarray(z[:1])).result(30), ref(z[:1]))


@pytest.mark.slow
def test_complex_cholesky_refused_at_load_naming_allow(tmp_path):
    """``f(X)``'s ``jnp.linalg.cholesky`` of a complex Hermitian matrix, per matrix of a batch:
    load refuses its native kernels naming the ``allow=`` that loads them; loaded so, its
    answers and ``holomorphic=True`` grads equal the plain net's."""
    p = {"s": jnp.asarray(1.0, jnp.complex64)}
    X = jnp.stack([zoo11.A, 2.0 * zoo11.A, zoo11.A + 3.0 * jnp.eye(3)]).astype(jnp.complex64)
    ref = lambda r: zoo11.net_chol(p, r)  # noqa: E731
    h = sm.hybridize(zoo11.net_chol, p)
    _close(h(X), ref(X), rtol=1e-4, atol=1e-4)
    assert h.graph(X).primitive_counts["cholesky"] == 1
    sm.export(h, tmp_path / "m", example=(X,), vjp_order=1)
    with pytest.raises(sm.ArtifactError, match=r"pass allow=\{'custom_call:") as e:
        sm.load(tmp_path / "m")
    allow = eval(str(e.value).split("pass allow=")[1].split(" (just these)")[0])
    m = sm.load(tmp_path / "m", allow=allow)
    _close(m(np.asarray(X[:2])), ref(X[:2]), rtol=1e-4, atol=1e-4)
    g = lambda f: jax.grad(lambda r: f(r).sum(), holomorphic=True)(X)  # noqa: E731
    _close(g(m), g(ref), rtol=1e-4, atol=1e-3)


@pytest.mark.slow
def test_vmap_of_random_normal_over_a_batch_of_keys(tmp_path):
    """``jax.vmap(random.normal)(subkeys)`` of ``random.split(random.key(42), 3)``: the loaded
    model (batch symbolic over typed keys) draws the docs' numbers for any number of keys; a
    Batcher answers each key's row; grads over the params through the loaded model equal."""
    p = {"loc": jnp.asarray(1.0), "scale": jnp.asarray(2.0)}
    subkeys = random.split(random.key(42), 3)
    ref = lambda k: zoo11.net_noise(p, k)  # noqa: E731
    h = sm.hybridize(zoo11.net_noise, p)
    _close(h(subkeys), 1.0 + 2.0 * jax.vmap(random.normal)(subkeys))
    assert h.graph(subkeys).primitive_counts
    sm.export(h, tmp_path / "m", example=(subkeys,))
    with pytest.raises(sm.ArtifactError, match=r"allow=\{'real_dynamic_slice'\}"):
        sm.load(tmp_path / "m")  # threefry's slices of the symbolic batch's bits
    m = sm.load(tmp_path / "m", allow={"real_dynamic_slice"})
    more = random.split(random.key(7), 5)
    _close(m(subkeys), ref(subkeys))
    _close(m(more), ref(more))
    with pytest.raises(sm.ConfigError, match=r"key<fry>\[b\], typed rng keys.*key_data"):
        sm.serving.Batcher(m)  # was NumPy's TypeError: data type 'key<fry>' not understood
    h_data = sm.hybridize(lambda q, kd: zoo11.net_noise(q, random.wrap_key_data(kd)), p)
    sm.export(h_data, tmp_path / "data", example=(random.key_data(subkeys),))
    served = sm.load(tmp_path / "data", allow={"real_dynamic_slice"})
    with sm.serving.Batcher(served, max_batch=4) as b:
        got = [b.submit(np.asarray(random.key_data(more[i : i + 1]))).result(30) for i in range(3)]
    _close(np.concatenate(got), ref(more[:3]))
    _close(
        jax.grad(lambda q: h.apply(q, more).sum())(p),
        jax.grad(lambda q: zoo11.net_noise(q, more).sum())(p),
    )


@pytest.mark.slow
def test_a_dense_layer_drawing_from_the_key_it_is_given(tmp_path):
    """A dense layer plus ``random.normal(subkey, ...)`` of ``random.split(key)``: the default
    batch's refusal names ``shapes=(None, 'b, ...')`` (a key has no rows); exported so, the
    loaded model equals the plain layer for each key, under ``jax.vmap`` over keys, and its
    grads and Hessians over the rows equal; a Batcher refuses the shared key naming the fix."""
    p = {"w": jax.random.normal(random.key(0), (4, 3)) * 0.5, "b": jnp.full((3,), 0.1)}
    key, x = random.key(42), jax.random.normal(random.key(1), (5, 4))
    ref = lambda k, r: zoo11.net_noisy_dense(p, k, r)  # noqa: E731
    h = sm.hybridize(zoo11.net_noisy_dense, p)
    _close(h(key, x), ref(key, x))
    with pytest.raises(sm.SignatureError, match=r"shapes=\(None, 'b, \.\.\.'\)"):
        sm.export(h, tmp_path / "refused", example=(key, x))
    sm.export(h, tmp_path / "m", example=(key, x), shapes=(None, "b, ..."), vjp_order=2)
    m = sm.load(tmp_path / "m")
    _close(m(key, np.asarray(x[:2])), ref(key, x[:2]))
    keys = random.split(key, 3)
    _close(jax.vmap(lambda k: m(k, x))(keys), jax.vmap(lambda k: ref(k, x))(keys))
    g = lambda f: jax.grad(lambda r: f(key, r).sum())(x)  # noqa: E731
    _close(g(m), g(ref))
    hess = lambda f: jax.jacrev(jax.jacrev(lambda r: f(key, r[None]).sum()))(x[0])  # noqa: E731
    _close(hess(m), hess(ref))
    with pytest.raises(sm.ConfigError, match="without the batch 'b'"):
        sm.serving.Batcher(m)


@pytest.mark.slow
def test_td_loss_stop_gradient_and_its_update_steps(tmp_path):
    """``td_loss`` per transition of a batch: the loaded model's grad over ``s_tm1`` keeps the
    docs' ``stop_gradient`` of the target (it differs from the naive loss's), and TD(0) steps
    over ``h.apply`` equal the docs' ``td_update`` (``[1.2, 2.4, -1.2]`` first) and its
    ``delta_theta_original_calculation``."""
    p = {"theta": zoo11.theta}
    S = jnp.stack([zoo11.s_tm1, zoo11.s_t, -zoo11.s_tm1])
    R = jnp.asarray([1.0, 0.5, -1.0])
    T = jnp.stack([zoo11.s_t, zoo11.s_tm1, zoo11.s_t])
    ref = lambda a, r, b: zoo11.td_loss_batch(p, a, r, b)  # noqa: E731
    h = sm.hybridize(zoo11.td_loss_batch, p)
    _close(h(S, R, T), ref(S, R, T))
    sm.export(h, tmp_path / "m", example=(S, R, T), vjp_order=2)
    m = sm.load(tmp_path / "m")
    _close(m(S[:2], R[:2], T[:2]), ref(S[:2], R[:2], T[:2]))
    gt = lambda f: jax.grad(lambda b: f(S, R, b).sum())(T)  # noqa: E731
    _close(gt(m), jnp.zeros_like(T))  # the target's state: stopped
    _close(gt(m), gt(ref))
    ga = lambda f: jax.grad(lambda a: f(a, R, T).sum())(S)  # noqa: E731
    _close(ga(m), ga(ref))
    one = lambda f: lambda a: f(a[None], R[:1], T[:1]).sum()  # noqa: E731
    _close(jax.jacrev(jax.jacrev(one(m)))(S[0]), jax.jacrev(jax.jacrev(one(ref)))(S[0]))
    with sm.serving.Batcher(m, max_batch=4) as b:
        _close(b.submit(S[:1], R[:1], T[:1]).result(30), ref(S[:1], R[:1], T[:1]))
    td_update = jax.grad(zoo11.td_loss)
    delta = jax.grad(
        lambda q: h.apply(q, zoo11.s_tm1[None], zoo11.r_t[None], zoo11.s_t[None]).sum()
    )(p)
    _close(delta["theta"], td_update(zoo11.theta, zoo11.s_tm1, zoo11.r_t, zoo11.s_t))
    _close(delta["theta"], jnp.asarray([1.2, 2.4, -1.2]))
    ours, theirs = p, zoo11.theta
    step = jax.grad(lambda q, a, r, b: h.apply(q, a[None], r[None], b[None]).sum())
    for i in range(3):
        ours = {"theta": ours["theta"] + 0.1 * step(ours, S[i], R[i], T[i])["theta"]}
        theirs = theirs + 0.1 * td_update(theirs, S[i], R[i], T[i])
    _close(ours["theta"], theirs)
    s_grad = jax.grad(zoo11.value_fn)(zoo11.theta, zoo11.s_tm1)
    original = (
        zoo11.r_t
        + zoo11.value_fn(zoo11.theta, zoo11.s_t)
        - zoo11.value_fn(zoo11.theta, zoo11.s_tm1)
    ) * s_grad
    _close(delta["theta"], original)


@pytest.mark.slow
def test_straight_through_estimator_as_an_activation(tmp_path):
    """``straight_through_f`` after a dense layer: rounds forward (the loaded model's answers
    are integers) and differentiates as the identity (its grads are the dense layer's): every
    feature, batch symbolic."""
    p = {"w": jax.random.normal(random.key(0), (4, 3)) * 2.0, "b": jnp.full((3,), 0.1)}
    x = jax.random.normal(random.key(1), (5, 4))
    h = sm.hybridize(zoo11.net_straight_through, p)
    m = every_feature(tmp_path, h, lambda r: zoo11.net_straight_through(p, r), x)
    out = m(np.asarray(x[:3]))
    _close(out, jnp.round(out))
    g = jax.grad(lambda r: m(r).sum())(x[:3])
    _close(g, jnp.broadcast_to(p["w"].sum(1), (3, 4)))


# -- Flax's docs_nnx/migrating/pytorch_to_jax_flax.rst ------------------------------------------
CONV = {"convolution"}  # load() names it: an MLP artifact never convolves


def _nhwc(t_out):
    return np.transpose(t_out.detach().cpu().numpy(), (0, 2, 3, 1))  # [N, C, H, W] -> NHWC


def _nchw(x):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.transpose(np.array(x), (0, 3, 1, 2)))


@pytest.mark.slow
def test_pytorch_guide_model_and_its_train_step(tmp_path):
    """``Model(10, 10, 12)``: every feature, batch symbolic; three of the guide's ``train_step``
    (``nnx.value_and_grad`` of ``loss_function`` over ``nnx.split(model, nnx.Param, ...)``,
    ``nnx.Optimizer`` of ``optax.adamw(0.001)``) equal the same steps over ``h.apply``."""
    model = zoo11.Model(10, 10, 12, rngs=nnx.Rngs(12))
    x = jax.random.normal(random.key(1), (5, 10))
    y = jax.random.normal(random.key(2), (5, 10))
    h = sm.hybridize(model)
    every_feature(tmp_path, h, model, x)
    tx = optax.adamw(0.001)
    params = h.params
    state = tx.init(params)
    loss = lambda p: ((h.apply(p, x) - y) ** 2).mean()  # noqa: E731
    for _ in range(3):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        params = optax.apply_updates(params, updates)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses = [float(zoo11.train_step(model, optimizer, (x, y))) for _ in range(3)]
    assert losses[-1] < losses[0]
    _close(params, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    _close(h.replace(params=params)(x), model(x))


@pytest.mark.slow
def test_pytorch_guide_param_and_buffer(tmp_path):
    """The guide's ``nnx.Param`` beside a ``Buffer`` (its own ``nnx.Variable`` subclass, as
    torch's ``register_buffer``): every feature, batch symbolic; ``h.apply``'s grads are the
    Params' (``nnx.grad``'s), the buffer held as ``h.state``, not a param."""
    model = zoo11.BufferModel(nnx.Rngs(0))
    x = jax.random.normal(random.key(1), (5, 10))
    h = sm.hybridize(model)
    every_feature(tmp_path, h, model, x)
    assert "b" not in h.params and h.state["b"].shape == (5,)  # held as state
    grads = jax.grad(lambda p: h.apply(p, x)[0].sum())(h.params)  # (out, new_state)
    want = nnx.grad(lambda m: m(x).sum())(model)
    _close(grads, nnx.to_pure_dict(want))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'.value' setter")  # the guide's own
def test_pytorch_guide_jmodel_with_torch_weights(tmp_path):
    """``JModel`` with ``TModel``'s weights ported as the guide ports them (kernels transposed):
    the loaded model (batch symbolic; ``x.reshape(x.shape[0], -1)`` of the symbolic batch)
    equals torch's answers to ``decimal=6`` as the guide's ``assert_almost_equal``; every
    feature against the nnx model."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class TModel(torch.nn.Module):
        def __init__(self):
            super(TModel, self).__init__()  # noqa: UP008 - as the guide writes it
            self.conv = torch.nn.Conv2d(
                in_channels=3, out_channels=4, kernel_size=2, padding="valid"
            )
            self.fc = torch.nn.Linear(in_features=100, out_features=2)

        def forward(self, x):
            x = self.conv(x)
            x = x.reshape(x.shape[0], -1)
            x = self.fc(x)
            return x

    t_model = TModel()
    j_model = zoo11.JModel(nnx.Rngs(0))
    sd = {k: v.detach().cpu().numpy() for k, v in t_model.state_dict().items()}
    j_model.conv.kernel.value = jnp.transpose(sd["conv.weight"], (2, 3, 1, 0))
    j_model.conv.bias.value = sd["conv.bias"]
    j_model.linear.kernel.value = jnp.transpose(sd["fc.weight"], (1, 0))
    j_model.linear.bias.value = sd["fc.bias"]
    x = random.normal(random.key(0), (4, 6, 6, 3))
    h = sm.hybridize(j_model)
    m = every_feature(tmp_path, h, j_model, x, allow=CONV, rtol=1e-5, atol=1e-5)
    t_out = t_model(_nchw(x[:3])).detach().cpu().numpy()
    np.testing.assert_almost_equal(m(np.asarray(x[:3])), t_out, decimal=5)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'.value' setter")  # the guide's own
def test_pytorch_guide_batch_norm_pool_and_conv_transpose(tmp_path):
    """The guide's layers side by side with torch's: ``nnx.BatchNorm(use_running_average=True)``
    (torch's ``eval()``), ``avg_pool`` by ``nnx.pool`` without padded zeros
    (``count_include_pad=False``) and ``nnx.ConvTranspose(transpose_kernel=True)`` with
    ``ConvTranspose2d``'s weights: every feature, batch symbolic; the loaded models equal
    torch's answers."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    x = random.normal(random.key(0), (4, 6, 6, 3))
    j_bn = nnx.BatchNorm(num_features=3, momentum=0.9, use_running_average=True, rngs=nnx.Rngs(0))
    m = every_feature(tmp_path / "bn", sm.hybridize(j_bn), j_bn, x)
    t_bn = torch.nn.BatchNorm2d(num_features=3, momentum=0.1)
    t_bn.eval()
    np.testing.assert_almost_equal(m(np.asarray(x[:3])), _nhwc(t_bn(_nchw(x[:3]))), decimal=5)
    p = {"s": jnp.asarray(1.0)}
    h = sm.hybridize(zoo11.net_avg_pool, p)
    pool = {"reduce_window", "real_dynamic_slice"}  # load() names them
    m = every_feature(tmp_path / "pool", h, lambda r: zoo11.net_avg_pool(p, r), x, allow=pool)
    t_pool = torch.nn.AvgPool2d(kernel_size=2, stride=1, padding=1, count_include_pad=False)
    np.testing.assert_almost_equal(m(np.asarray(x[:3])), _nhwc(t_pool(_nchw(x[:3]))), decimal=5)
    t_conv = torch.nn.ConvTranspose2d(in_channels=3, out_channels=4, kernel_size=2, padding=0)
    j_conv = nnx.ConvTranspose(
        3, 4, kernel_size=(2, 2), padding="VALID", transpose_kernel=True, rngs=nnx.Rngs(0)
    )
    j_conv.kernel.value = jnp.transpose(t_conv.weight.detach().cpu().numpy(), (2, 3, 1, 0))
    j_conv.bias.value = t_conv.bias.detach().cpu().numpy()
    m = every_feature(tmp_path / "convT", sm.hybridize(j_conv), j_conv, x, allow=CONV)
    np.testing.assert_almost_equal(m(np.asarray(x[:3])), _nhwc(t_conv(_nchw(x[:3]))), decimal=5)


@pytest.mark.slow
def test_jacobian_vector_products_hvps_of_the_loaded_model(tmp_path):
    """jacobian-vector-products.md's ``predict`` (its ``sigmoid``, its toy ``inputs``): the
    Hybrid takes the docs' three Hessian-vector products (reverse over reverse, forward over
    reverse, reverse over forward) and ``vgrad``, equal to the plain net's; the loaded model
    (``vjp_order=2``) takes ``vgrad`` and reverse over reverse, equal, and refuses the forward
    ones naming ``jax.jacrev`` (jax.export keeps VJPs only)."""
    p = {"W": jax.random.normal(random.key(1), (3,)), "b": jnp.asarray(0.3)}
    x, v = zoo11.inputs, 0.1 * jax.random.normal(random.key(2), zoo11.inputs.shape)
    ref = lambda r: zoo11.net_predict(p, r)  # noqa: E731
    h = sm.hybridize(zoo11.net_predict, p)
    loss = lambda f: lambda X: jnp.sum(jnp.tanh(f(X)) ** 2)  # noqa: E731 - the docs' f over it
    for how in (
        lambda f: zoo11.vgrad(f, x),
        lambda f: zoo11.hvp_rev(loss(f), x, v),
        lambda f: zoo11.hvp(loss(f), (x,), (v,)),
        lambda f: zoo11.hvp_revfwd(loss(f), (x,), (v,))[0],
    ):
        _close(how(h), how(ref))
    sm.export(h, tmp_path / "m", example=(x,), vjp_order=2)
    m = sm.load(tmp_path / "m")
    _close(zoo11.vgrad(m, x), zoo11.vgrad(ref, x))
    _close(zoo11.hvp_rev(loss(m), x, v), zoo11.hvp_rev(loss(ref), x, v))
    for forward in (zoo11.hvp, zoo11.hvp_revfwd):
        with pytest.raises(sm.ConfigError, match=r"reverse mode only.*Use jax\.jacrev"):
            forward(loss(m), (x,), (v,))


@pytest.mark.slow
def test_pytrees_mlp_of_numpy_float64_params_and_its_update(tmp_path):
    """pytrees.md's MLP: params a list of dicts of NumPy float64 arrays (``init_mlp_params``,
    widths cut to ``[1, 8, 8, 1]``): every feature, batch symbolic; three of the docs' jitted
    ``update`` (SGD by ``jax.tree.map``) equal the same steps over ``h.apply``. The artifact's
    input is float32, as JAX computes it: a float64 row is refused naming the cast."""
    np.random.seed(0)
    params = zoo11.init_mlp_params([1, 8, 8, 1])
    x = np.linspace(-1, 1, 6, dtype=np.float32)[:, None]
    y = x**2
    h = sm.hybridize(zoo11.forward, params)
    every_feature(tmp_path, h, lambda r: zoo11.forward(params, r), x, rtol=1e-5, atol=1e-5)
    ours, theirs = h.params, params
    step = jax.grad(lambda q: jnp.mean((h.apply(q, x) - y) ** 2))
    for _ in range(3):
        ours = jax.tree.map(lambda p, g: p - zoo11.LEARNING_RATE * g, ours, step(ours))
        theirs = zoo11.update(theirs, x, y)
    _close(ours, theirs)
    with pytest.raises(
        sm.SignatureError, match=r"dtype float64 .*Cast it: x\.astype\(np\.float32\)"
    ):
        sm.load(tmp_path / "m")(x.astype(np.float64))


def test_a_batcher_of_a_hybrid_over_a_batch_of_keys_names_their_data():
    """``Batcher(h, example=subkeys)`` of random-numbers.md's ``jax.vmap(random.normal)``: one
    key per row, refused naming ``random.key_data``/``wrap_key_data`` (it said the keys were
    'one value shared by every row', and named only a function closing over one key)."""
    h = sm.hybridize(zoo11.net_noise, {"loc": jnp.asarray(1.0), "scale": jnp.asarray(2.0)})
    subkeys = random.split(random.key(42), 3)
    with pytest.raises(sm.ConfigError, match=r"key<fry>\[3\].*key_data\(keys\).*wrap_key_data"):
        sm.serving.Batcher(h, example=subkeys)


@pytest.mark.slow
def test_fp8_dense_and_einsum_and_the_guides_update(tmp_path):
    """fp8_basics.md: ``nn.Dense(dot_general_cls=fp8_ops.Fp8DotGeneral)`` (features cut to 6):
    every feature, batch symbolic (load names the ``scatter`` and ``gather`` of its amax
    history's VJPs, both where ``allow=`` had one);
    ``FooModule(einsum=fp8_ops.Fp8Einsum)`` of two inputs equals; three of the guide's steps
    (``jax.grad(train_step, (0, 1))``, ``params`` plus ``0.01 * grads``, the FP8 scales and
    amax histories overwritten by their gradients) over ``h.apply`` equal the plain ones."""
    from flax.linen import fp8_ops

    k0, k1, k2 = random.split(random.key(0), 3)
    A = random.normal(k1, (4, 8))
    model = nn.Dense(features=6, dot_general_cls=fp8_ops.Fp8DotGeneral)
    params = model.init(k0, A)
    h = sm.hybridize(model, params)
    sm.export(h, tmp_path / "part", example=(A,), vjp_order=2)
    with pytest.raises(sm.ArtifactError, match=r"pass allow=\{'gather', 'scatter'\} \(just"):
        sm.load(tmp_path / "part", allow={"scatter"})  # it said allow={'gather'}: not enough
    every_feature(tmp_path, h, lambda r: model.apply(params, r), A, allow={"gather", "scatter"})

    def train_step(apply):
        return lambda var, a: jnp.sum(apply(var, a))

    ours, theirs = params, params
    for _ in range(3):
        ours = zoo11.fp8_update(ours, jax.grad(train_step(h.apply), (0, 1))(ours, A)[0])
        theirs = zoo11.fp8_update(
            theirs, jax.jit(jax.grad(train_step(model.apply), (0, 1)))(theirs, A)[0]
        )
    _close(ours, theirs)
    assert not np.allclose(ours["params"]["kernel"], params["params"]["kernel"])
    foo = zoo11.FooModule(einsum=fp8_ops.Fp8Einsum)
    b = random.normal(k2, (8, 5))
    fparams = foo.init(k0, A, b)
    hf = sm.hybridize(foo, fparams)
    _close(hf(A, b), foo.apply(fparams, A, b))
    sm.export(hf, tmp_path / "foo", example=(A, b), shapes=("b, 8", None), vjp_order=1)
    m = sm.load(tmp_path / "foo", allow={"scatter"})
    _close(m(A[:2], b), foo.apply(fparams, A[:2], b))
    g = lambda f: jax.grad(lambda r: f(r, b).sum())(A)  # noqa: E731
    _close(g(m), g(lambda a, bb: foo.apply(fparams, a, bb)))
