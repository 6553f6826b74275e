"""Code we did not write, round eleven: JAX's docs where no round looked, as their authors wrote
them (jax-ml/jax at cec06d116c05f0d52adfceee3d3b730fdbcb0ce5), each wrapped as a net of params
and inputs for tests/test_authors_round11.py.

- docs/complex-differentiation.md: ``f(z)`` of ``jnp.real``/``jnp.imag`` (C -> R), the
  holomorphic ``jnp.sin`` and ``f(X)``'s ``jnp.linalg.cholesky`` of a complex Hermitian matrix.
- docs/random-numbers.md: ``random.split`` of ``random.key(42)`` and ``jax.vmap(random.normal)``
  over the subkeys (a model drawing from the keys it is given).
- docs/higher-order.md: ``value_fn``, the TD(0) ``td_loss`` with ``jax.lax.stop_gradient`` of
  its target, and ``straight_through_f`` (``jnp.round`` with a straight-through gradient).
- docs/jacobian-vector-products.md: ``predict`` (its ``sigmoid``), ``vgrad`` and the three
  Hessian-vector products (reverse/reverse, forward/reverse, reverse/forward).
- docs/pytrees.md: ``init_mlp_params`` (NumPy float64 leaves in a list of dicts), ``forward``,
  ``loss_fn`` and the jitted SGD ``update`` by ``jax.tree.map``.

And Flax's docs_nnx/migrating/pytorch_to_jax_flax.rst (google/flax at
18f8f311c275d57f46d95e41b15aa97b454754c0): ``Model``, the buffer (an ``nnx.Variable``
subclass), ``JModel`` (a conv transposed to NCHW before its Linear), ``nnx.BatchNorm``,
the ``nnx.pool`` ``avg_pool`` without padded zeros, ``nnx.ConvTranspose(transpose_kernel=True)``
and the guide's ``train_step``.
"""

from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import zoo8
from flax import linen as nn
from flax import nnx
from jax import random

# --- docs/complex-differentiation.md -------------------------------------------------------


def f_abs2(z):
    x, y = jnp.real(z), jnp.imag(z)
    return x**2 + y**2


def f_sin(z):
    return jnp.sin(z)


A = jnp.array([[5.0, 2.0 + 3j, 5j], [2.0 - 3j, 7.0, 1.0 + 7j], [-5j, 1.0 - 7j, 12.0]])


def f_chol(X):
    L = jnp.linalg.cholesky(X)
    return jnp.sum((L - jnp.sin(L)) ** 2)


def net_abs2(p, z):
    """A C -> R net: complex rows in, |w z|^2 summed per row out."""
    return f_abs2(z * p["w"]).sum(-1)


def net_sin(p, z):
    """A holomorphic C -> C net: ``jnp.sin`` of complex-weighted rows."""
    return f_sin(z * p["w"])


def net_chol(p, X):
    """``f(X)`` per Hermitian matrix of the batch, scaled by a complex param."""
    return jax.vmap(f_chol)(X * p["s"])


# --- docs/random-numbers.md ----------------------------------------------------------------


def net_noise(p, subkeys):
    """``jax.vmap(random.normal)(subkeys)``: one draw per key, scaled and shifted."""
    return p["loc"] + p["scale"] * jax.vmap(random.normal)(subkeys)


def net_noisy_dense(p, key, x):
    """A dense layer plus ``random.normal(key, shape=...)`` of the one key it is given, split
    as the docs split: ``key, subkey = random.split(key)``."""
    key, subkey = random.split(key)
    return x @ p["w"] + p["b"] * random.normal(subkey, shape=p["b"].shape)


# --- docs/higher-order.md ------------------------------------------------------------------

value_fn = lambda theta, state: jnp.dot(theta, state)  # noqa: E731 - as the docs write it
theta = jnp.array([0.1, -0.1, 0.0])
s_tm1 = jnp.array([1.0, 2.0, -1.0])
r_t = jnp.array(1.0)
s_t = jnp.array([2.0, 1.0, 0.0])


def td_loss(theta, s_tm1, r_t, s_t):
    v_tm1 = value_fn(theta, s_tm1)
    target = r_t + value_fn(theta, s_t)
    return -0.5 * ((jax.lax.stop_gradient(target) - v_tm1) ** 2)


def td_loss_batch(p, s_tm1, r_t, s_t):
    """``td_loss`` per transition of a batch (``jax.vmap`` over the rows)."""
    return jax.vmap(td_loss, in_axes=(None, 0, 0, 0))(p["theta"], s_tm1, r_t, s_t)


def f_round(x):
    return jnp.round(x)  # non-differentiable


def straight_through_f(x):
    # Create an exactly-zero expression with Sterbenz lemma that has
    # an exactly-one gradient.
    zero = x - jax.lax.stop_gradient(x)
    return zero + jax.lax.stop_gradient(f_round(x))


def net_straight_through(p, x):
    """A dense layer whose activation is ``straight_through_f``: rounds forward, identity back."""
    return straight_through_f(x @ p["w"] + p["b"])


# --- flax docs_nnx/migrating/pytorch_to_jax_flax.rst (google/flax at
# 18f8f311c275d57f46d95e41b15aa97b454754c0); the torch halves are the tests' reference -------


class Model(nnx.Module):
    def __init__(self, n: int, m: int, h: int, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(n, h, rngs=rngs)
        self.act = nnx.relu
        self.linear2 = nnx.Linear(h, m, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.linear1(x)
        x = self.act(x)
        return self.linear2(x)


class Buffer(nnx.Variable):
    pass


class BufferModel(nnx.Module):
    """The guide's "a learnable parameter and a buffer" (its ``...`` filled in: ``Model``'s
    layers, and a ``__call__``, ours, that reads both)."""

    def __init__(self, rngs: nnx.Rngs):
        self.inner = Model(10, 10, 12, rngs=rngs)
        self.p = nnx.Param(jnp.ones((10,)))
        self.b = Buffer(jnp.ones(5))

    def __call__(self, x):
        return self.inner(x) * self.p + self.b.mean()


class JModel(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 4, kernel_size=(2, 2), padding="valid", rngs=rngs)
        self.linear = nnx.Linear(100, 2, rngs=rngs)

    def __call__(self, x):
        x = self.conv(x)
        # [N, H, W, C] -> [N, C, H, W]
        x = jnp.transpose(x, (0, 3, 1, 2))
        x = jnp.reshape(x, (x.shape[0], -1))
        x = self.linear(x)
        return x


def avg_pool(inputs, window_shape, strides=None, padding="VALID"):
    """
    Pools the input by taking the average over a window.
    In comparison to nnx.avg_pool(), this pooling operation does not
    consider the padded zero's for the average computation.
    """
    assert len(window_shape) == 2

    y = nnx.pool(inputs, 0.0, jax.lax.add, window_shape, strides, padding)
    counts = nnx.pool(jnp.ones_like(inputs), 0.0, jax.lax.add, window_shape, strides, padding)
    y = y / counts
    return y


def net_avg_pool(p, x):
    """The guide's ``avg_pool(x, window_shape=(2, 2), strides=(1, 1), padding=((1, 1), (1, 1)))``
    of scaled images."""
    return avg_pool(p["s"] * x, window_shape=(2, 2), strides=(1, 1), padding=((1, 1), (1, 1)))


def loss_function(params, graphdef, nondiff, x, y):
    """The guide's ``loss_function`` without its ``rngs`` (its ``Model`` takes none: the guide's
    ``model(x, rngs=rngs)`` raises TypeError)."""
    model = nnx.merge(graphdef, params, nondiff)
    logits = model(x)
    # For example, we compute MSE
    return ((logits - y) ** 2).mean()


@nnx.jit(donate_argnames=("model", "optimizer"))
def train_step(model, optimizer, batch):
    x, y = batch
    graphdef, params, nondiff = nnx.split(model, nnx.Param, ...)
    grad_fn = nnx.value_and_grad(loss_function)
    loss, grads = grad_fn(params, graphdef, nondiff, x, y)
    optimizer.update(model, grads)
    return loss


# --- docs/jacobian-vector-products.md (jax-ml/jax, the commit above) ------------------------


# ``sigmoid``, ``predict`` and the toy ``inputs`` as autodiff_cookbook.md writes them, word for
# word: zoo8's copy.
sigmoid, predict, inputs = zoo8.sigmoid, zoo8.predict, zoo8.inputs


def net_predict(p, inputs):
    return predict(p["W"], p["b"], inputs)


def vgrad(f, x):
    y, vjp_fn = jax.vjp(f, x)
    return vjp_fn(jnp.ones(y.shape))[0]


def hvp_rev(f, x, v):  # the docs' first ``hvp``: reverse over reverse
    return jax.grad(lambda x: jnp.vdot(jax.grad(f)(x), v))(x)


# forward-over-reverse
def hvp(f, primals, tangents):
    return jax.jvp(jax.grad(f), primals, tangents)[1]


# Reverse-over-forward
def hvp_revfwd(f, primals, tangents):
    g = lambda primals: jax.jvp(f, primals, tangents)[1]  # noqa: E731 - as the docs write it
    return jax.grad(g)(primals)


# --- docs/pytrees.md (jax-ml/jax, the commit above) ------------------------------------------


def init_mlp_params(layer_widths):
    params = []
    for n_in, n_out in zip(layer_widths[:-1], layer_widths[1:]):  # noqa: B905, RUF007 - as written
        params.append(
            dict(
                weights=np.random.normal(size=(n_in, n_out)) * np.sqrt(2 / n_in),
                biases=np.ones(shape=(n_out,)),
            )
        )
    return params


# Define the forward pass.
def forward(params, x):
    *hidden, last = params
    for layer in hidden:
        x = jax.nn.relu(x @ layer["weights"] + layer["biases"])
    return x @ last["weights"] + last["biases"]


# Define the loss function.
def loss_fn(params, x, y):
    return jnp.mean((forward(params, x) - y) ** 2)


# Set the learning rate.
LEARNING_RATE = 0.0001


# Using the stochastic gradient descent, define the parameter update function.
# Apply `@jax.jit` for JIT compilation (speed).
@jax.jit
def update(params, x, y):
    # Calculate the gradients with `jax.grad`.
    grads = jax.grad(loss_fn)(params, x, y)
    # Note that `grads` is a pytree with the same structure as `params`.
    # `jax.grad` is one of many JAX functions that has
    # built-in support for pytrees.
    # This is useful - you can apply the SGD update using JAX pytree utilities.
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


# --- flax docs/guides/quantization/fp8_basics.md (google/flax, the commit above); its
# ``assert jtu.is_cuda_compute_capability_at_least("9.0")`` cut: XLA's CPU converts to and from
# float8_e4m3fn too (no FP8 kernel, the same numbers) ---------------------------------------


class FooModule(nn.Module):
    einsum: Any = None

    @nn.compact
    def __call__(self, a, b):
        if self.einsum is not None:
            einsum_fn = self.einsum()
        elif self.einsum is None:
            einsum_fn = jnp.einsum
        c = einsum_fn("mk,kn->mn", a, b)
        return c


def fp8_update(params, grads):
    """The guide's step: ``params`` move by ``0.01 * grads``, ``_overwrite_with_gradient``'s
    scales and amax histories are replaced by their "gradients"."""
    params = flax.core.unfreeze(params)
    params = flax.traverse_util.flatten_dict(params, sep="/")
    grads = flax.traverse_util.flatten_dict(grads, sep="/")

    for key, value in params.items():
        if key.startswith("params"):
            params[key] = value + 0.01 * grads[key]
        if key.startswith("_overwrite_with_gradient"):
            params[key] = grads[key]

    params = flax.traverse_util.unflatten_dict(params, sep="/")
    params = flax.core.freeze(params)
    return params
