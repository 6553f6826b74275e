"""The models of test_authors_round10.py: JAX's own docs, as their authors wrote them, from
jax-ml/jax@cec06d116c05f0d52adfceee3d3b730fdbcb0ce5 (sizes cut where said; the docs' functions
become a model where a user would put them: ``net_*``, ours).

- docs/notebooks/Writing_custom_interpreters_in_Jax.md: its ``f`` of ``w, b, x`` (here
  ``f_dense``), ``eval_jaxpr`` (a model evaluating another function's jaxpr, ``bind`` per
  equation), ``inverse_registry`` (``exp_p``, ``tanh_p``), ``inverse``/``inverse_jaxpr`` and its
  ``f`` (``exp(tanh(x))``) inverted. ``examine_jaxpr``'s prints are left out.
- docs/notebooks/convolutions.md: ``jnp.convolve`` of a 10-wide moving average (``mode='same'``;
  its 500 points cut to 24), ``jsp.signal.convolve`` of the 7 x 7 Gaussian ``window`` (its
  image of scipy's ``datasets.face()`` cut to a 12 x 10 one), the HWIO edge ``kernel`` and the
  NHWC ``img`` (200 x 198 cut to 12 x 10), ``lax.conv_dimension_numbers`` of ``('NHWC',
  'HWIO', 'NHWC')`` and ``lax.conv_general_dilated`` with it: 'SAME', 'VALID', strides (2, 2),
  and the kernel dilation (12, 12) cut to (3, 3). matplotlib's plots are left out.
- docs/control-flow.md: ``f(x, n)`` (a Python loop over a static ``n``, ``jit(f,
  static_argnames='n')``), ``example_fun(length, val)`` (``static_argnames='length'``), the
  ``lax.cond``, ``lax.while_loop`` and ``lax.fori_loop`` examples and ``jax_check_positive_even``.
"""

# ruff: noqa: E731 (the authors' code, as written)

from functools import wraps

import jax
import jax.numpy as jnp
import jax.scipy as jsp
from flax import nnx
from jax import jit, lax
from jax._src.util import safe_map
from jax.extend import core


# -- Writing_custom_interpreters_in_Jax.md ------------------------------------------------------
def f_dense(w, b, x):  # the notebook's first ``f``
    return jnp.tanh(jnp.dot(x, w) + b)


def eval_jaxpr(jaxpr, consts, *args):
    # Mapping from variable -> value
    env = {}

    def read(var):
        # Literals are values baked into the Jaxpr
        if type(var) is core.Literal:
            return var.val
        return env[var]

    def write(var, val):
        env[var] = val

    # Bind args and consts to environment
    safe_map(write, jaxpr.invars, args)
    safe_map(write, jaxpr.constvars, consts)

    # Loop through equations and evaluate primitives using `bind`
    for eqn in jaxpr.eqns:
        # Read inputs to equation from environment
        invals = safe_map(read, eqn.invars)
        # `bind` is how a primitive is called
        outvals = eqn.primitive.bind(*invals, **eqn.params)
        # Primitives may return multiple outputs or not
        if not eqn.primitive.multiple_results:
            outvals = [outvals]
        # Write the results of the primitive into the environment
        safe_map(write, eqn.outvars, outvals)
    # Read the final result of the Jaxpr from the environment
    return safe_map(read, jaxpr.outvars)


inverse_registry = {}
inverse_registry[lax.exp_p] = jnp.log
inverse_registry[lax.tanh_p] = jnp.arctanh


def inverse(fun):
    @wraps(fun)
    def wrapped(*args, **kwargs):
        # Since we assume unary functions, we won't worry about flattening and
        # unflattening arguments.
        closed_jaxpr = jax.make_jaxpr(fun)(*args, **kwargs)
        out = inverse_jaxpr(closed_jaxpr.jaxpr, closed_jaxpr.literals, *args)
        return out[0]

    return wrapped


def inverse_jaxpr(jaxpr, consts, *args):
    env = {}

    def read(var):
        if type(var) is core.Literal:
            return var.val
        return env[var]

    def write(var, val):
        env[var] = val

    # Args now correspond to Jaxpr outvars
    safe_map(write, jaxpr.outvars, args)
    safe_map(write, jaxpr.constvars, consts)

    # Looping backward
    for eqn in jaxpr.eqns[::-1]:
        #  outvars are now invars
        invals = safe_map(read, eqn.outvars)
        if eqn.primitive not in inverse_registry:
            raise NotImplementedError(f"{eqn.primitive} does not have registered inverse.")
        # Assuming a unary function
        outval = inverse_registry[eqn.primitive](*invals)
        safe_map(write, eqn.invars, [outval])
    return safe_map(read, jaxpr.invars)


def f(x):  # the notebook's second ``f``
    return jnp.exp(jnp.tanh(x))


def net_eval(p, x):
    """The notebook's ``eval_jaxpr`` of ``make_jaxpr(f_dense)``, the params its ``w``, ``b``."""
    closed_jaxpr = jax.make_jaxpr(f_dense)(p["w"], p["b"], x)
    return eval_jaxpr(closed_jaxpr.jaxpr, closed_jaxpr.literals, p["w"], p["b"], x)[0]


def net_inverse(p, y):
    """``inverse(f)`` of ``y`` (in ``f``'s range), scaled by a param."""
    return p["s"] * inverse(f)(y)


# -- convolutions.md ----------------------------------------------------------------------------
window = jnp.ones(10) / 10


def net_smooth(p, y):
    """One moving average per row: ``jnp.convolve(y, window, mode='same')``, scaled."""
    return p["s"] * jax.vmap(lambda row: jnp.convolve(row, window, mode="same"))(y)


x = jnp.linspace(-3, 3, 7)
window2d = jsp.stats.norm.pdf(x) * jsp.stats.norm.pdf(x[:, None])
del x


def net_smooth_image(p, noisy_image):
    """``jsp.signal.convolve(noisy_image, window, mode='same')`` per image of a batch."""
    conv = lambda im: jsp.signal.convolve(im, window2d, mode="same")
    return p["s"] * jax.vmap(conv)(noisy_image)


# 2D kernel - HWIO layout
kernel = jnp.zeros((3, 3, 3, 3), dtype=jnp.float32)
kernel += jnp.array([[1, 1, 0], [1, 0, -1], [0, -1, -1]])[:, :, jnp.newaxis, jnp.newaxis]


def make_img(n=1, h=12, w=10):
    """NHWC layout: the notebook's three squares, one per channel (placed for 12 x 10)."""
    img = jnp.zeros((n, h, w, 3), dtype=jnp.float32)
    for k in range(3):
        x = 1 + 3 * k
        y = 1 + 2 * k
        img = img.at[0, x : x + 2, y : y + 2, k].set(1.0)
    return img


CONVS = {  # name -> (window strides, padding, rhs dilation), as the notebook's cells
    "same": ((1, 1), "SAME", (1, 1)),
    "valid": ((1, 1), "VALID", (1, 1)),
    "strided": ((2, 2), "SAME", (1, 1)),
    "dilated": ((1, 1), "VALID", (3, 3)),
}


def net_conv(strides, padding, rhs_dilation):
    def net(p, img):
        dn = lax.conv_dimension_numbers(
            img.shape,  # only ndim matters, not shape
            p["kernel"].shape,  # only ndim matters, not shape
            ("NHWC", "HWIO", "NHWC"),  # the important bit
        )
        return lax.conv_general_dilated(
            img,  # lhs = image tensor
            p["kernel"],  # rhs = conv kernel tensor
            strides,  # window strides
            padding,  # padding mode
            (1, 1),  # lhs/image dilation
            rhs_dilation,  # rhs/kernel dilation
            dn,  # dimension_numbers = lhs, rhs, out dimension permutation
        )

    return net


# -- control-flow.md ----------------------------------------------------------------------------
def f_sum(x, n):  # the doc's ``f(x, n)``
    y = 0.0
    for i in range(n):
        y = y + x[i]
    return y


f_sum_jit = jit(f_sum, static_argnames="n")


def example_fun(length, val):
    return jnp.ones((length,)) * val


good_example_jit = jit(example_fun, static_argnames="length")


@jit
def jax_check_positive_even(x):
    is_even = x % 2 == 0
    # `logical_and` does not short circuit, so `x > 0` is always evaluated.
    return jnp.logical_and(is_even, x > 0)


def net_control(p, x):
    """The doc's ``cond``, ``while_loop`` (per value: its ``cond_fun`` is a scalar's) and
    ``fori_loop``, each over ``x`` (2-D), scaled."""
    operand = x * p["s"]
    a = lax.cond(True, lambda x: x + 1, lambda x: x - 1, operand)
    cond_fun = lambda x: x < 10
    body_fun = lambda x: x + 1
    w = jax.vmap(jax.vmap(lambda v: lax.while_loop(cond_fun, body_fun, v)))(operand)
    body_fun = lambda i, x: x + i
    r = lax.fori_loop(0, 10, body_fun, operand)
    return a + w + r


def net_sum(p, x, n):
    """``f_sum_jit`` over each row's first ``n`` values, scaled."""
    return jax.vmap(lambda row: f_sum_jit(row, n))(x) * p["s"]


# -- new_docs/201/jit.md, "Jitting methods": Strategy 1 and Strategy 3 -------------------------
class CustomClass1:  # Strategy 1: a jitted helper function (the doc's ``CustomClass``)
    def __init__(self, x: jax.Array, mul: bool):
        self.x = x
        self.mul = mul

    def calc(self, y):
        return _calc(self.mul, self.x, y)


@jax.jit(static_argnums=0)
def _calc(mul, x, y):
    if mul:
        return x * y
    return y


class CustomClass:  # Strategy 3: registering the class as a pytree
    def __init__(self, x: jax.Array, mul: bool):
        self.x = x
        self.mul = mul

    @jax.jit
    def calc(self, y):
        if self.mul:
            return self.x * y
        return y

    def _tree_flatten(self):
        children = (self.x,)  # arrays / dynamic values
        aux_data = {"mul": self.mul}  # static values
        return (children, aux_data)

    @classmethod
    def _tree_unflatten(cls, aux_data, children):
        return cls(*children, **aux_data)


jax.tree_util.register_pytree_node(
    CustomClass, CustomClass._tree_flatten, CustomClass._tree_unflatten
)


# -- automatic-vectorization.md ------------------------------------------------------------------
def convolve(x, w):
    output = []
    for i in range(1, len(x) - 1):
        output.append(jnp.dot(x[i - 1 : i + 2], w))
    return jnp.array(output)


def manually_batched_convolve(xs, ws):
    output = []
    for i in range(xs.shape[0]):
        output.append(convolve(xs[i], ws[i]))
    return jnp.stack(output)


def manually_vectorized_convolve(xs, ws):
    output = []
    for i in range(1, xs.shape[-1] - 1):
        output.append(jnp.sum(xs[:, i - 1 : i + 2] * ws, axis=1))
    return jnp.stack(output, axis=1)


auto_batch_convolve = jax.vmap(convolve)
auto_batch_convolve_v2 = jax.vmap(convolve, in_axes=1, out_axes=1)
batch_convolve_v3 = jax.vmap(convolve, in_axes=[0, None])


# -- google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0 docs_nnx/guides/demo.md: [1] and [2] --
# (its ``self.blocks`` a plain list raises in Flax 0.12.8, "Disable pytree for this class":
# nnx.List here; its [3] uses ``model.split()``, gone, and is left out)
class Block(nnx.Module):
    def __init__(self, din, dout, *, rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.bn = nnx.BatchNorm(dout, use_running_average=False, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.bn(self.linear(x)))


class MLP(nnx.Module):
    def __init__(self, nlayers, dim, *, rngs):  # explicit RNG threading
        self.blocks = nnx.List([Block(dim, dim, rngs=rngs) for _ in range(nlayers)])
        self.count = Count(0)  # stateful variables are defined as attributes

    def __call__(self, x):
        self.count.value += 1  # in-place stateful updates
        for block in self.blocks:
            x = block(x)
        return x


class Count(nnx.Variable):  # custom Variable types define the "collections"
    pass


def my_optimized_layer(x):
    return x


def demo_model():
    """The demo's ``model`` after its surgery: sharing, weight tying, monkey patching."""
    model = MLP(5, 4, rngs=nnx.Rngs(0))  # no special `init` method
    model.set_attributes(use_running_average=False)  # set flags
    model(jnp.ones((2, 4)))  # call methods directly
    # Module sharing
    model.blocks[1] = model.blocks[3]
    # Weight tying
    model.blocks[0].linear.kernel = model.blocks[-1].linear.kernel
    # Monkey patching
    model.blocks[2] = my_optimized_layer
    return model
