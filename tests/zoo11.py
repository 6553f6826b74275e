"""Code we did not write, round eleven: JAX's docs where no round looked, as their authors wrote
them (jax-ml/jax at cec06d116c05f0d52adfceee3d3b730fdbcb0ce5), each wrapped as a net of params
and inputs for tests/test_authors_round11.py.

- docs/complex-differentiation.md: ``f(z)`` of ``jnp.real``/``jnp.imag`` (C -> R), the
  holomorphic ``jnp.sin`` and ``f(X)``'s ``jnp.linalg.cholesky`` of a complex Hermitian matrix.
- docs/random-numbers.md: ``random.split`` of ``random.key(42)`` and ``jax.vmap(random.normal)``
  over the subkeys (a model drawing from the keys it is given).
- docs/higher-order.md: ``value_fn``, the TD(0) ``td_loss`` with ``jax.lax.stop_gradient`` of
  its target, and ``straight_through_f`` (``jnp.round`` with a straight-through gradient).
"""

import jax
import jax.numpy as jnp
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
