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
- docs/new_docs/301/hijax-types.md: ``QArray`` and its type ``QArrayTy`` (``register_hitype``),
  the ``Quantize``/``Dequantize``/``MatmulQ`` primitives (``VJPHiPrimitive``), ``quantize``,
  ``dequantize``, ``matmul_q``, its ``x``, ``w``, ``qw`` and ``loss`` (here ``x_q``, ``w_q``,
  ``loss_q``: precision.md's ``x``, ``w``, ``loss`` hold those names); the vmap section
  (``MappingSpec``, absent from JAX 0.10.2) and the mesh sections are left out.
- docs/new_docs/501/transfer-guard.rst: ``jax.transfer_guard("disallow")`` around a call, its
  explicit transfers (``jax.device_put``) allowed, its implicit ones refused.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import jit
from jax.experimental.hijax import HiType, ShapedArray, VJPHiPrimitive, register_hitype
from jax.sharding import NamedSharding

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


# --- docs/new_docs/301/hijax-types.md --------------------------------------------------------


@dataclass(frozen=True)
class QArray:
    qvalue: jax.Array  # int8[*leading, n]
    scale: jax.Array  # f32[*leading]


@dataclass(frozen=True)
class QArrayTy(HiType):
    shape: tuple[int, ...]
    sharding: NamedSharding  # qvalue's sharding; scale's is derived from it

    # lowering: which array types make up this type, and how values convert
    def lo_ty(self):
        scale_sharding = self.sharding.update(spec=jax.P(*self.sharding.spec[:-1]))
        return [
            ShapedArray(self.shape, jnp.dtype("int8"), sharding=self.sharding),
            ShapedArray(self.shape[:-1], jnp.dtype("float32"), sharding=scale_sharding),
        ]

    def lower_val(self, q):
        return [q.qvalue, q.scale]

    def raise_val(self, qvalue, scale):
        return QArray(qvalue, scale)

    # autodiff: tangents of quantized arrays are plain float arrays (see below)
    def to_tangent_aval(self):
        return ShapedArray(self.shape, jnp.dtype("float32"), sharding=self.sharding)

    # printing, e.g. in jaxprs
    def str_short(self, short_dtypes=False, mesh_axis_types=False):
        dims = [str(d) if p is None else f"{d}@{p}" for d, p in zip(self.shape, self.sharding.spec)]  # noqa: B905
        return f"q8[{','.join(dims)}]"

    __repr__ = str_short


register_hitype(QArray, lambda q: QArrayTy(q.qvalue.shape, jax.typeof(q.qvalue).sharding))


class Quantize(VJPHiPrimitive):
    def __init__(self, x_aval):
        if x_aval.dtype != jnp.dtype("float32"):
            raise TypeError(x_aval.dtype)
        self.in_avals = (x_aval,)
        self.out_aval = QArrayTy(x_aval.shape, x_aval.sharding)
        self.params = {}
        super().__init__()

    def expand(self, x):
        scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
        qvalue = jnp.round(x / scale[..., None]).astype(jnp.int8)
        return QArray(qvalue, scale)

    # straight-through estimator: differentiate as if it's the identity
    def vjp_fwd(self, nzs_in, x):
        return self(x), None

    def vjp_bwd_retval(self, _res, g):
        return (g,)


class Dequantize(VJPHiPrimitive):
    def __init__(self, q_aval):
        self.in_avals = (q_aval,)
        self.out_aval = ShapedArray(q_aval.shape, jnp.dtype("float32"), sharding=q_aval.sharding)
        self.params = {}
        super().__init__()

    def expand(self, qx):
        return qx.qvalue.astype("float32") * qx.scale[..., None]

    def vjp_fwd(self, nzs_in, qx):
        return self(qx), None

    def vjp_bwd_retval(self, _res, g):
        return (g,)


def quantize(x):
    return Quantize(jax.typeof(x))(x)


def dequantize(qx):
    return Dequantize(jax.typeof(qx))(qx)


class MatmulQ(VJPHiPrimitive):
    def __init__(self, x_aval, q_aval):
        if not (
            isinstance(q_aval, QArrayTy)
            and len(x_aval.shape) == 2
            and len(q_aval.shape) == 2
            and x_aval.shape[1] == q_aval.shape[0]
        ):
            raise TypeError(f"bad matmul_q operand types: {x_aval} @ {q_aval}")
        self.in_avals = (x_aval, q_aval)
        x_spec, q_spec = x_aval.sharding.spec, q_aval.sharding.spec
        if x_spec[1] is not None or q_spec[0] is not None:
            raise TypeError(
                f"matmul_q requires unsharded contraction axes, got {x_aval} @ {q_aval}"
            )
        out_sharding = x_aval.sharding.update(spec=jax.P(x_spec[0], q_spec[1]))
        self.out_aval = ShapedArray(
            (x_aval.shape[0], q_aval.shape[1]), jnp.dtype("float32"), sharding=out_sharding
        )
        self.params = {}
        super().__init__()

    def expand(self, x, qw):
        # fold the per-row scales into the dense operand, then apply one matmul
        # directly against the int8 payload
        return (x * qw.scale) @ qw.qvalue.astype(jnp.float32)

    def vjp_fwd(self, nzs_in, x, qw):
        return self(x, qw), (x, qw)

    def vjp_bwd_retval(self, res, g):
        x, qw = res
        w = dequantize(qw)  # rules are traced code: use primitives here
        # cotangents live where the primals live, so use the primal operands'
        # shardings to disambiguate the (possibly sharded) contractions
        return (
            jnp.matmul(g, w.T, out_sharding=jax.typeof(x).sharding),
            jnp.matmul(x.T, g, out_sharding=jax.typeof(w).sharding),
        )


def matmul_q(x, qw):
    return MatmulQ(jax.typeof(x), jax.typeof(qw))(x, qw)


x_q = jnp.array([[1.0, 2.0, 3.0], [4.0, -5.0, 6.0]])

w_q = jnp.arange(12.0, dtype="float32").reshape(3, 4) / 12.0
qw = quantize(w_q)


def loss_q(x, qw):
    return jnp.sum(matmul_q(x, qw) ** 2)
