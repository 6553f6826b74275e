"""Code we did not write, round seventeen, as its authors wrote it, for
tests/test_authors_round17.py: JAX's own docs (jax-ml/jax at
cec06d116c05f0d52adfceee3d3b730fdbcb0ce5) where no round looked; where a doc writes an
expression, not a function, it becomes a model where a user would put it (``net_*``, ours).

- docs/jit-compilation.md: ``selu`` (timed there on ``jnp.arange(1000000)``, int32), ``f``
  (a Python ``if`` on ``x``: ``jax.jit(f, static_argnums=0)``), ``g`` (a Python ``while`` up
  to ``n``: ``jax.jit(g, static_argnames=['n'])``) and ``g_jit_decorated`` (the same, as a
  ``@jax.jit(static_argnames=['n'])`` decorator).
- docs/type_promotion.rst, "Weakly-typed values in JAX": ``x = jnp.arange(5, dtype='int8')``
  and ``2 * x`` (int8; ``jnp.int32(2) * x`` would be int32), ``jnp.asarray(2)`` weakly typed:
  ``net_twice`` multiplies by its params as the doc by ``2``; ``net_scaled`` is the same rule
  for a bfloat16 input and a Python float.
- docs/new_docs/201/precision.md: ``loss`` (``jnp.dot(x, w, precision='BF16_BF16_F32')``)
  and its ``x, w`` (``jnp.ones``), and the scoped ``jax.default_matmul_precision``.
- docs/new_docs/201/debugging.md, ``jax_debug_nans``: ``f`` (``jnp.log(-3 * x**2)``: NaN).
- docs/new_docs/301/vjp-objects.md: ``fwd_and_bwd`` (``jax.vjp`` split into two jitted
  functions, the VJP object a pytree passed between them), ``layer``, ``W1, W2, x0`` and
  ``two_layers``; its ``saveable_args`` is left out (JAX 0.10.2's ``jax.vjp`` lacks it).
- docs/new_docs/501/transfer-guard.rst: ``jax.transfer_guard("disallow")`` around a call, its
  explicit transfers (``jax.device_put``) allowed, its implicit ones refused.
"""

import jax
import jax.numpy as jnp
from jax import jit

# --- docs/jit-compilation.md ----------------------------------------------------------------


def selu(x, alpha=1.67, lambda_=1.05):
    return lambda_ * jnp.where(x > 0, x, alpha * jnp.exp(x) - alpha)


# Condition on value of x.


def f(x):
    if x > 0:
        return x
    else:
        return 2 * x


# While loop conditioned on x and n.


def g(x, n):
    i = 0
    while i < n:
        i += 1
    return x + i


@jax.jit(static_argnames=["n"])
def g_jit_decorated(x, n):
    i = 0
    while i < n:
        i += 1
    return x + i


# --- docs/type_promotion.rst, "Weakly-typed values in JAX" ----------------------------------


def net_twice(two, x):
    """The doc's ``2 * x``, its ``2`` the params (a Python int, or ``jnp.asarray(2)``)."""
    return two * x


def net_scaled(params, x):
    """A bfloat16 input times a Python float param, as ``2 * x`` above: stays bfloat16."""
    return jnp.tanh(params["scale"] * x)


# --- docs/new_docs/201/precision.md ---------------------------------------------------------


def loss(x, w):
    return jnp.sum(jnp.dot(x, w, precision="BF16_BF16_F32"))


x, w = jnp.ones((4, 8)), jnp.ones((8, 2))

# --- docs/new_docs/201/debugging.md, jax_debug_nans -----------------------------------------


def f_nan(x):  # the doc's ``f``
    w = 3 * jnp.square(x)
    return jnp.log(-w)


# --- docs/new_docs/301/vjp-objects.md -------------------------------------------------------


def fwd_and_bwd(f):
    def fwd(*args):
        return jax.vjp(f, *args)

    def bwd(f_vjp, y_bar):
        return f_vjp(y_bar)

    return jit(fwd), jit(bwd)


def layer(W, x):
    return jnp.tanh(x @ W)


W1, W2 = jnp.ones((3, 3)), 2.0 * jnp.ones((3, 3))
x0 = jnp.ones((2, 3))


def two_layers(W1, W2, x):
    return jnp.sum(layer(W2, layer(W1, x)))
