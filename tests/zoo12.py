"""Code we did not write, round twelve: the jax.export guide's own examples, as their authors
wrote them (jax-ml/jax at cec06d116c05f0d52adfceee3d3b730fdbcb0ce5), each wrapped as a net of
params and inputs for tests/test_authors_round12.py (our artifact IS jax.export).

- docs/export/export.md: ``f`` (``2 * x * x``) and its ``callee``, ``f`` of ``7 * x * x * x``
  (serialized with ``vjp_order=3``), ``lax.cos`` exported for ``['tpu']`` and for
  ``['tpu', 'cpu', 'cuda']``, and the "largish function" of 1000 ``jnp.cos``.
- docs/export/shape_poly.md: ``f`` (``jnp.concatenate([x, x], axis=1)``: ``f32[a, 2*b]``),
  ``f1`` (``x + y`` of ``"a, ..."``), the flatten to ``4*b``, ``jnp.array(x.shape[0]) + x``,
  the three outputs of ``5. + x.shape[0]`` and friends, the average ``jnp.sum(x, axis=0) /
  x.shape[0]``, ``x[0:16]`` of ``"b + 15"``, ``x[:x.shape[1], :16]`` under ``a >= b, b >= 16``,
  ``lax.slice_in_dim(x, 0, x.shape[0] % 3)`` (its constraint ``b >= mod(b, 3)``), the
  inconclusive ``0 if x.shape[0] + 1 >= x.shape[1] else 1``, ``my_top_k`` and
  ``my_top_k_with_dimensions`` (``k`` from an empty ``(0, k)`` array), the identity of
  ``"b, b, 2*d"`` and ``x.shape[0]`` of ``(a * a,)``.
- docs/aot.md: ``f`` (``2 * x + y``) and its traced, lowered and compiled stages, and ``g``
  (``assert x.shape == (3, 2)``) with ``make_z``, which the guide maps with ``jax.vmap``.
- docs/notebooks/Common_Gotchas_in_JAX.md (its ``CustomClass`` is zoo10's): the
  ``.at[1, :].set`` and ``.at[::2, 3:].add`` updates, out-of-bounds reads
  (``jnp.arange(10)[11]``, ``.at[11].get(mode='fill', fill_value=jnp.nan)``), and ``nansum``
  (a boolean mask: no static shape) beside ``nansum_2`` (``jnp.where``).
- docs/automatic-differentiation.md: ``f = lambda x: x**3 + 2*x**2 - 3*x + 1`` and its four
  derivatives ``dfdx`` .. ``d4fdx``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# --- docs/export/export.md -----------------------------------------------------------------


def f_square(x):  # the guide's first ``f``
    return 2 * x * x


def callee(rehydrated_call, y):
    """The guide's ``callee``, its ``rehydrated_exp.call`` given (ours: the loaded model)."""
    return 3.0 * rehydrated_call(y * 4.0)


def f_cube(x):  # "Serialize 3 levels of VJP along with the primal function"
    return 7 * x * x * x


def f_largish(x):  # "A largish function"
    for i in range(1000):  # noqa: B007 - as written
        x = jnp.cos(x)
    return x


def net_cos(p, x):
    """``lax.cos``, exported by the guide for ``['tpu']`` and ``['tpu', 'cpu', 'cuda']``."""
    return lax.cos(x * p["s"])


# --- docs/export/shape_poly.md -------------------------------------------------------------


def f_concat(x):  # f: f32[a, b]
    return jnp.concatenate([x, x], axis=1)


def f1(x, y):  # x: f32[a, 1], y : f32[a, 4]
    return x + y


flatten = lambda x: jnp.reshape(x, (x.shape[0] * x.shape[1],))  # noqa: E731 - as written
size_plus = lambda x: jnp.array(x.shape[0]) + x  # noqa: E731
three = lambda x: (  # noqa: E731
    5.0 + x.shape[0],
    x.shape[0] - np.arange(5, dtype=jnp.int32),
    x + x.shape[0] + jnp.sin(x.shape[0]),
)
average = lambda x: jnp.sum(x, axis=0) / x.shape[0]  # noqa: E731
first_16 = lambda x: x[0:16]  # noqa: E731 - exported with "b + 15"
square_16 = lambda x: x[: x.shape[1], :16]  # noqa: E731 - "a >= b", "b >= 16"
slice_mod = lambda x: lax.slice_in_dim(x, 0, x.shape[0] % 3)  # noqa: E731
branch = lambda x: 0 if x.shape[0] + 1 >= x.shape[1] else 1  # noqa: E731 - inconclusive


def f_identity(x):  # x: f32[b, b, 2*d]
    return x


size_of = lambda x: x.shape[0]  # noqa: E731 - exported with (a * a,)


def my_top_k(k, x):  # x: i32[4, 10], k <= 10
    return lax.top_k(x, k)[0]  # : i32[4, 3]


def my_top_k_with_dimensions(dimensions, x):  # dimensions: i32[0, k], x: i32[4, 10]
    return my_top_k(dimensions.shape[1], x)


x_top = np.arange(40, dtype=np.int32).reshape((4, 10))

# --- docs/aot.md ---------------------------------------------------------------------------


def f_aot(x, y):
    return 2 * x + y


def g(x):
    assert x.shape == (3, 2)
    return x @ jnp.ones(2)


def make_z(*shape):
    return jnp.arange(np.prod(shape)).reshape(shape)


# --- docs/notebooks/Common_Gotchas_in_JAX.md ----------------------------------------------


def nansum(x):
    mask = ~jnp.isnan(x)  # boolean mask selecting non-nan values
    x_without_nans = x[mask]
    return x_without_nans.sum()


@jax.jit
def nansum_2(x):
    mask = ~jnp.isnan(x)  # boolean mask selecting non-nan values
    return jnp.where(mask, x, 0).sum()


def net_updates(p, jax_array):
    """The guide's two updates of a batch of (5, 6) arrays, ``p`` the values set and added."""
    updated_array = jax_array.at[:, 1, :].set(p["set"])
    return updated_array.at[:, ::2, 3:].add(p["add"])


def net_out_of_bounds(p, x):
    """``x[:, 11]`` of 10 columns (the guide's ``jnp.arange(10)[11]``: the last, clamped) and
    ``.at[:, 11].get(mode='fill', fill_value=jnp.nan)`` (NaN), scaled."""
    return jnp.stack([x[:, 11], x.at[:, 11].get(mode="fill", fill_value=jnp.nan)], -1) * p["s"]


def net_clipped(p, x):
    """The guide's read past the end, the clamp asked for: ``.at[:, 11].get(mode='clip')``."""
    return x.at[:, 11].get(mode="clip") * p["s"]


# --- docs/automatic-differentiation.md -----------------------------------------------------

f_poly = lambda x: x**3 + 2 * x**2 - 3 * x + 1  # noqa: E731 - the guide's ``f``


# --- nets: each a function of params and inputs, the guide's function inside ----------------


def scaled(fn):
    """``fn`` of inputs scaled by the param ``s`` (a float net of params, as sm.hybridize takes
    one); ``fn`` itself at ``s == 1``."""
    return lambda p, *xs: fn(*(x * p["s"] for x in xs))


def net_branch(p, x):
    """``branch``'s choice applied: the rows scaled where it is 0, as they are where it is 1."""
    return x * p["s"] if branch(x) == 0 else x


def net_top_k_dims(p, dimensions, x):
    return my_top_k_with_dimensions(dimensions, x * p["s"])
