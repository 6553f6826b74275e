"""The models of test_authors_round9.py: JAX's own docs and tests, as their authors wrote them,
from jax-ml/jax@cec06d116c05f0d52adfceee3d3b730fdbcb0ce5 (sizes as written there, or cut where
said; the docs' functions become a model where a user would put them: ``net_*``, ours).

- docs/external-callbacks.md: ``f_host``/``f`` (``jax.pure_callback``, ``vmap_method=
  'sequential'``), ``host_side_random_like``/``numpy_random_like`` (``io_callback``, its
  ``global_rng``), ``log_value`` (``jax.debug.callback``), the ``jax.debug.print`` of "Why
  callbacks?", and "Example: ``pure_callback`` with ``custom_jvp``": ``jv`` (scipy's Bessel
  function) and its ``_jv_jvp``, ``j1``.
- docs/gradient-checkpointing.md: ``g``, ``f`` (no checkpoint), ``f2`` (``jax.checkpoint`` of
  each ``g``), ``f3`` (``policy=dots_with_no_batch_dims_saveable``), ``f4`` (``checkpoint_name``
  and ``save_only_these_names('a')``) and its ``W1, W2, W3, x`` (``jnp.ones``, as written).
- tests/ode_test.py ``test_pend_grads``: ``pend`` and its ``y0``, ``ts``, ``args`` (m, g),
  ``odeint`` of ``partial(pend, jnp)``; ``test_grad_closure``'s ``experiment`` (a closure over
  ``x``), its time grid cut from 100 steps to 10.
- docs/pallas/quickstart.md: ``add_vectors_kernel``/``add_vectors`` and the fused-activation
  ``matmul_kernel``/``matmul`` (grid (2, 2)), each ``interpret=True`` (this machine has no
  GPU/TPU), ``matmul``'s 1024 x 1024 cut to 8 x 8.
- docs/custom_pytrees.md: ``RegisteredSpecial`` (``register_pytree_node``),
  ``MyOtherContainer`` (a ``NamedTuple``), ``MyDataclassContainer`` (``register_dataclass``,
  ``name`` a meta field) and its jitted ``f`` (``x.a + x.b``).

From patrick-kidger/equinox@9336d820b2ef66b360fc6cb3611b3da5cefbb14d:

- docs/all-of-equinox.md: ``NeuralNetwork`` (its ``extra_bias``) and ``NeuralNetwork2`` (a
  ``jax.nn.relu`` among its layers), its data (100 x 2), the jitted ``jax.grad`` ``loss`` and
  its gradient-descent step, and the filtered ``eqx.filter_jit``/``eqx.filter_grad`` ``loss``.

From google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0:

- docs_nnx/guides/checkpointing.md: ``TwoLayerMLP`` and ``ModifiedTwoLayerMLP`` (its biases
  added); the guide's Orbax save and restore (an ``nnx.State``, a pure dict, the abstract model
  of ``nnx.eval_shape``) are run in the test.
- examples/linen_design_test: dense.py's ``Dense`` (-> ``DesignDense``: a ``lax.dot_general``
  and its ``use_bias``), mlp_lazy.py's ``MLP`` (-> ``LazyMLP``: ``setup``'s lazy Denses) and
  linear_regression.py's ``predict``/``loss_fn``/``init_params`` and its loop (its ``X``, ``Y``;
  50 steps cut to 5). Left out: attention_simple.py (its ``init`` raises in Flax 0.12.8:
  ``concise_vmap`` names the collection ``param``, "collection 'params' ... is empty"),
  autoencoder.py (``jnp.prod`` of a tuple raises in JAX 0.10), mlp_explicit.py (it imports
  ``flax.deprecated``, gone).
- docs_nnx/hijax/hijax.md is left out: its own training loop raises in the installed Flax
  0.12.8 (``DynamicJaxprTracer has no attribute mutable``), as does ``jax.grad`` through
  ``nnx.merge`` of a hijax state (``jvp not implemented for 'get_variable'``).
"""

# ruff: noqa: B905, E731, RUF009 (the authors' code, as written)

import functools as ft
import itertools as it
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from flax import linen as nn
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import checkify, io_callback
from jax.experimental import pallas as pl
from jax.experimental.ode import odeint
from jax.sharding import AxisType


# -- external-callbacks.md, "Exploring pure_callback" -------------------------------------------
def f_host(x):
    # call a numpy (not jax.numpy) operation:
    return np.sin(x).astype(x.dtype)


def f(x):
    result_shape = jax.ShapeDtypeStruct.like(x)
    return jax.pure_callback(f_host, result_shape, x, vmap_method="sequential")


# -- "Exploring io_callback" ---------------------------------------------------------------------
global_rng = np.random.default_rng(0)


def host_side_random_like(x):
    """Generate a random array like x using the global_rng state"""
    # We have two side-effects here:
    # - printing the shape and dtype
    # - calling global_rng, thus updating its state
    print(f"generating {x.dtype}{list(x.shape)}")
    return global_rng.uniform(size=x.shape).astype(x.dtype)


@jax.jit
def numpy_random_like(x):
    return io_callback(host_side_random_like, x, x)


# -- "Exploring debug.callback" ------------------------------------------------------------------
def log_value(x):
    # This could be an actual logging call; we'll use
    # print() for demonstration
    print("log:", x)


# -- "Example: pure_callback with custom_jvp" ----------------------------------------------------
def jv(v, z):
    v, z = jnp.asarray(v), jnp.asarray(z)

    # Require the order v to be integer type: this simplifies
    # the JVP rule below.
    assert jnp.issubdtype(v.dtype, jnp.integer)

    # Promote the input to inexact (float/complex).
    # Note that jnp.result_type() accounts for the enable_x64 flag.
    z = z.astype(jnp.result_type(float, z.dtype))

    # Wrap scipy function to return the expected dtype.
    _scipy_jv = lambda v, z: scipy.special.jv(v, z).astype(z.dtype)

    # Define the expected shape & dtype of output.
    result_shape_dtype = jax.ShapeDtypeStruct(
        shape=jnp.broadcast_shapes(v.shape, z.shape), dtype=z.dtype
    )

    # Use vmap_method="broadcast_all" because scipy.special.jv handles broadcasted inputs.
    return jax.pure_callback(_scipy_jv, result_shape_dtype, v, z, vmap_method="broadcast_all")


jv = jax.custom_jvp(jv)


@jv.defjvp
def _jv_jvp(primals, tangents):
    v, z = primals
    _, z_dot = tangents  # Note: v_dot is always 0 because v is integer.
    jv_minus_1, jv_plus_1 = jv(v - 1, z), jv(v + 1, z)
    djv_dz = jnp.where(v == 0, -jv_plus_1, 0.5 * (jv_minus_1 - jv_plus_1))
    return jv(v, z), z_dot * djv_dz


j1 = partial(jv, 1)


# each callback where a user puts one: after a layer (ours)
def net_pure(p, x):
    return f(x @ p)


def net_io(p, x):
    y = x @ p
    return y + numpy_random_like(y)


def net_debug(p, x):
    y = x @ p
    jax.debug.callback(log_value, y)
    return jnp.tanh(y)


def net_print(p, x):  # "Why callbacks?"'s f, its y = x + 1 a layer
    y = x @ p + 1
    jax.debug.print("intermediate value: {}", y)
    return y * 2


def net_j1(p, x):
    return j1(x @ p)


# -- gradient-checkpointing.md -------------------------------------------------------------------
def g(W, x):
    y = jnp.dot(W, x)
    return jnp.sin(y)


def f_plain(W1, W2, W3, x):  # the guide's first ``f``
    x = g(W1, x)
    x = g(W2, x)
    x = g(W3, x)
    return x


def f2(W1, W2, W3, x):
    x = jax.checkpoint(g)(W1, x)
    x = jax.checkpoint(g)(W2, x)
    x = jax.checkpoint(g)(W3, x)
    return x


f3 = jax.checkpoint(f_plain, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


def f4(W1, W2, W3, x):
    x = checkpoint_name(g(W1, x), name="a")
    x = checkpoint_name(g(W2, x), name="b")
    x = checkpoint_name(g(W3, x), name="c")
    return x


f4 = jax.checkpoint(f4, policy=jax.checkpoint_policies.save_only_these_names("a"))


def checkpoint_weights():
    """The guide's ``W1, W2, W3`` and ``x``, as written."""
    return (jnp.ones((5, 4)), jnp.ones((6, 5)), jnp.ones((7, 6))), jnp.ones(4)


# -- tests/ode_test.py ---------------------------------------------------------------------------
def pend(_np, y, _, m, g):
    theta, omega = y
    return [omega, -m * omega - g * _np.sin(theta)]


PEND_Y0 = [np.pi - 0.1, 0.0]
PEND_TS = np.linspace(0.0, 1.0, 11)
PEND_ARGS = (0.25, 9.8)
integrate = partial(odeint, partial(pend, jnp))


def experiment(x):  # test_grad_closure's, its np.arange(0, 10, 0.1) cut to 10 steps
    def model(y, t):
        return -x * y

    history = odeint(model, 1.0, np.arange(0, 1, 0.1))
    return history[-1]


# -- pallas/quickstart.md ------------------------------------------------------------------------
def add_vectors_kernel(x_ref, y_ref, o_ref):
    x, y = x_ref[...], y_ref[...]
    o_ref[...] = x + y


@jax.jit
def add_vectors(x: jax.Array, y: jax.Array) -> jax.Array:
    return pl.pallas_call(
        add_vectors_kernel, out_shape=jax.ShapeDtypeStruct.like(x), interpret=True
    )(x, y)


def matmul_kernel(x_ref, y_ref, z_ref, *, activation):
    z_ref[...] = activation(x_ref[...] @ y_ref[...])


def matmul(x: jax.Array, y: jax.Array, *, activation):
    return pl.pallas_call(
        partial(matmul_kernel, activation=activation),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype),
        grid=(2, 2),
        in_specs=[
            pl.BlockSpec((x.shape[0] // 2, x.shape[1]), lambda i, j: (i, 0)),
            pl.BlockSpec((y.shape[0], y.shape[1] // 2), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((x.shape[0] // 2, y.shape[1] // 2), lambda i, j: (i, j)),
        interpret=True,
    )(x, y)


# -- array_refs.md ------------------------------------------------------------------------------
def g_ref(x):  # the guide's ``g``
    x_ref = jax.new_ref(0.0)
    x_ref[...] = jnp.sin(x)
    return x_ref[...]


@jax.jit
def pure1(x):
    ref = jax.new_ref(x)
    ref[...] = ref[...] + ref[...]
    return ref[...]


calls = jax.new_ref(jnp.zeros(()))  # ours, after its impure2


def net_counting(p, x):
    calls[...] += 1.0
    return x @ p


# -- debugging/checkify_guide.md ----------------------------------------------------------------
def checkify_f(x, i):  # the guide's ``f``
    checkify.check(i >= 0, "index needs to be non-negative, got {i}", i=i)
    y = x[i]
    z = jnp.sin(y)
    return z


jittable_f = checkify.checkify(checkify_f)


# -- new_docs/201/sharding.md -------------------------------------------------------------------
Auto = jax.sharding.AxisType.Auto


def auto_mesh():
    return jax.make_mesh((4, 2), ("X", "Y"), (Auto, Auto))


def explicit_mesh():  # "explicit mode by default"
    return jax.make_mesh((4, 2), ("X", "Y"))


def sharding_xy():
    """The guide's x and y, placed as it places them (under ``jax.set_mesh(auto_mesh())``)."""
    x = jax.device_put(jnp.arange(8 * 4.0).reshape(8, 4), jax.P(None, "X"))
    y = jax.device_put(jnp.arange(4 * 16.0).reshape(4, 16), jax.P("X", None))
    return x, y


@jax.jit
def f_sharded(x, y):  # the guide's ``f``
    z = jnp.dot(x, y)
    z = jax.lax.with_sharding_constraint(z, jax.P("X", None))
    return z


# -- custom_pytrees.md ---------------------------------------------------------------------------
class Special:
    def __init__(self, x, y):
        self.x = x
        self.y = y


class RegisteredSpecial(Special):
    def __repr__(self):
        return f"RegisteredSpecial(x={self.x}, y={self.y})"


def special_flatten(v):
    children = (v.x, v.y)
    aux_data = None
    return (children, aux_data)


def special_unflatten(aux_data, children):
    return RegisteredSpecial(*children)


jax.tree_util.register_pytree_node(RegisteredSpecial, special_flatten, special_unflatten)


class MyOtherContainer(NamedTuple):
    name: str
    a: Any
    b: Any
    c: Any


@partial(jax.tree_util.register_dataclass, data_fields=["a", "b", "c"], meta_fields=["name"])
@dataclass
class MyDataclassContainer:
    name: str
    a: Any
    b: Any
    c: Any


@jax.jit
def f_container(x: MyDataclassContainer | MyOtherContainer):  # the guide's jitted ``f``
    return x.a + x.b


# -- flax docs_nnx/guides/checkpointing.md -------------------------------------------------------
class TwoLayerMLP(nnx.Module):
    def __init__(self, dim, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(dim, dim, rngs=rngs, use_bias=False)
        self.linear2 = nnx.Linear(dim, dim, rngs=rngs, use_bias=False)

    def __call__(self, x):
        x = self.linear1(x)
        return self.linear2(x)


class ModifiedTwoLayerMLP(nnx.Module):
    """A modified version of TwoLayerMLP, which requires bias arrays."""

    def __init__(self, dim, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(dim, dim, rngs=rngs, use_bias=True)  # We need bias now!
        self.linear2 = nnx.Linear(dim, dim, rngs=rngs, use_bias=True)  # We need bias now!

    def __call__(self, x):
        x = self.linear1(x)
        return self.linear2(x)


# -- equinox docs/all-of-equinox.md --------------------------------------------------------------
class NeuralNetwork(eqx.Module):
    layers: tuple
    extra_bias: jax.Array

    def __init__(self, key):
        key1, key2, key3 = jax.random.split(key, 3)
        # These contain trainable parameters.
        self.layers = (
            eqx.nn.Linear(2, 8, key=key1),
            eqx.nn.Linear(8, 8, key=key2),
            eqx.nn.Linear(8, 2, key=key3),
        )
        # This is also a trainable parameter.
        self.extra_bias = jax.numpy.ones(2)

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x) + self.extra_bias


class NeuralNetwork2(eqx.Module):
    layers: tuple

    def __init__(self, key):
        key1, key2 = jax.random.split(key)
        self.layers = (eqx.nn.Linear(2, 8, key=key1), jax.nn.relu, eqx.nn.Linear(8, 2, key=key2))

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@jax.jit  # compile this function to make it run fast.
@jax.grad  # differentiate all floating-point arrays in `model`.
def eqx_loss(model, x, y):  # the guide's first ``loss``
    pred_y = jax.vmap(model)(x)  # vectorise the model over a batch of data
    return jax.numpy.mean((y - pred_y) ** 2)  # L2 loss


@eqx.filter_jit
@eqx.filter_grad
def filtered_loss(model, x, y):  # its "Option 2"
    pred_y = jax.vmap(model)(x)
    return jax.numpy.mean((y - pred_y) ** 2)


def eqx_data():
    """The guide's keys and data: ``x``, ``y`` (100 x 2) and the model's key."""
    x_key, y_key, model_key = jax.random.split(jax.random.PRNGKey(0), 3)
    return jax.random.normal(x_key, (100, 2)), jax.random.normal(y_key, (100, 2)), model_key


# -- flax examples/linen_design_test -------------------------------------------------------------
class DesignDense(nn.Module):  # dense.py's ``Dense``
    features: int
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    use_bias: bool = True

    @nn.compact
    def __call__(self, inputs):
        kernel = self.param("kernel", self.kernel_init, (inputs.shape[-1], self.features))
        y = jax.lax.dot_general(
            inputs,
            kernel,
            (((inputs.ndim - 1,), (0,)), ((), ())),
        )
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,))
            y = y + bias
        return y


class LazyMLP(nn.Module):  # mlp_lazy.py's ``MLP``
    def setup(self):
        self.dense1 = DesignDense(features=2)
        self.dense2 = DesignDense(features=1)

    def __call__(self, x):
        return self.dense2(nn.relu(self.dense1(x)))


# linear_regression.py
X = jnp.ones((1, 10))
Y = jnp.ones((5,))
model = DesignDense(features=5)


@jax.jit
def predict(params):
    return model.apply({"params": params}, X)


@jax.jit
def loss_fn(params):
    return jnp.mean(jnp.abs(Y - predict(params)))


@jax.jit
def init_params(rng):
    mlp_variables = model.init({"params": rng}, X)
    return mlp_variables["params"]


# -- docs/the-training-cookbook.py, as written there (formatted as this file: 4-space indents) -
ode = """
We are the music makers
    And we are the dreamers of dreams
Wandering by lone sea-breakers
    And sitting by desolate streams;
World-losers and world-forsakers
    On whom the pale moon gleams
Yet we are the movers and shaker
    Of the world for ever, it seems
"""


# tag: config
@jax.tree_util.register_static
@dataclass(kw_only=True, frozen=True)
class Config:
    mesh_axis_names: tuple[str, ...] = ("fsdp",)
    mesh_shape: tuple[int, ...] = (8,)
    seq_length: int = 128

    num_train_steps: int = 10**6
    host_batch_size: int = 16
    learning_rate: float = 1e-4
    beta_1: float = 0.9
    beta_2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0

    param_seed: int = 12738
    num_layers: int = 4
    embed_dim: int = 512
    mlp_dim: int = 512 * 4
    vocab_size: int = 2**8  # uint8 ascii encoding
    num_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    embed: jax.P = jax.P(None, None)
    pos_embed: jax.P = jax.P(None, None)
    att_qkv: jax.P = jax.P(None, "fsdp", None, None)
    att_out: jax.P = jax.P("fsdp", None, None)
    mlp_in: jax.P = jax.P("fsdp", None)
    mlp_out: jax.P = jax.P(None, "fsdp")
    in_kernel: jax.P = jax.P(None, None)
    in_bias: jax.P = jax.P(None)
    out_kernel: jax.P = jax.P("fsdp", None)
    out_bias: jax.P = jax.P(None)

    act_ids: jax.P = jax.P("fsdp")
    act_seq: jax.P = jax.P("fsdp", None, None)
    act_att: jax.P = jax.P("fsdp", None, None, None)
    act_hidden: jax.P = jax.P("fsdp", None, None)

    def __post_init__(self):
        mesh = jax.make_mesh(
            self.mesh_shape, self.mesh_axis_names, len(self.mesh_shape) * (AxisType.Explicit,)
        )
        jax.sharding.set_mesh(mesh)

    # tag: config


@jax.tree_util.register_pytree_with_keys_class
class dot_dict(dict):
    __setattr__ = dict.__setitem__
    __getattr__ = dict.__getitem__

    def tree_flatten_with_keys(self):
        keys = tuple(sorted(self))
        return tuple((jax.tree_util.DictKey(k), self[k]) for k in keys), keys

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(zip(keys, values))


# tag: get-param-state
def init_param_state(config: Config) -> dot_dict:
    root_key = jax.random.key(config.param_seed)
    key = map(ft.partial(jax.random.fold_in, root_key), it.count())
    zero_init = jax.nn.initializers.constant(0.0)
    he_init = jax.nn.initializers.he_normal(1, 1)
    dtype = config.dtype

    params = dot_dict(
        pos_embed=zero_init(
            next(key), (config.seq_length, config.embed_dim), dtype, config.pos_embed
        ),
        layers=dot_dict(),
    )
    params.embedding = he_init(
        next(key), (config.vocab_size, config.embed_dim), dtype, config.embed
    )
    params.linear_in = dot_dict(
        kernel=he_init(next(key), (1, config.embed_dim), dtype, config.in_kernel),
        bias=zero_init(next(key), (config.embed_dim,), dtype, config.in_bias),
    )
    params.linear_out = dot_dict(
        kernel=he_init(next(key), (config.embed_dim, config.vocab_size), dtype, config.out_kernel),
    )
    for layer in range(config.num_layers):
        qkv_shape = (3, config.embed_dim, config.num_heads, config.head_dim)
        out_shape = (config.num_heads, config.head_dim, config.embed_dim)
        params.layers[layer] = dot_dict(
            attention=dot_dict(
                qkv=he_init(next(key), qkv_shape, dtype, config.att_qkv),
                out=he_init(next(key), out_shape, dtype, config.att_out),
            ),
            mlp=dot_dict(
                in_kernel=he_init(
                    next(key), (config.embed_dim, config.mlp_dim), dtype, config.mlp_in
                ),
                out_kernel=he_init(
                    next(key), (config.mlp_dim, config.embed_dim), dtype, config.mlp_out
                ),
            ),
        )
    return params  # tag: get-param-state


# tag: model-apply
def model_apply(config: Config, params: dot_dict, tokens: jax.Array) -> jax.Array:
    out = params.embedding.at[tokens].get(out_sharding=config.act_seq)
    out += params.pos_embed
    del tokens

    for layer in range(config.num_layers):
        block = params.layers[layer]
        att_skip = out  # 1 billion dollars in venture capital funding please
        qkv = jnp.einsum("bsd,3dkh->bs3kh", out, block.attention.qkv, out_sharding=config.act_att)
        out = jax.nn.dot_product_attention(
            qkv[:, :, 0, :], qkv[:, :, 1, :], qkv[:, :, 2, :], is_causal=True
        )
        out = jnp.einsum("bskh,khd->bsd", out, block.attention.out, out_sharding=config.act_seq)
        out += att_skip
        out *= jax.lax.rsqrt(jnp.linalg.norm(out, axis=-1, keepdims=True) + 1e-6)

        mlp_skip = out  # machine learning circa 1986
        out = jnp.einsum("bsd,dh->bsh", out, block.mlp.in_kernel, out_sharding=config.act_hidden)
        out = jax.nn.gelu(out)
        out = jnp.einsum("bsh,hd->bsd", out, block.mlp.out_kernel, out_sharding=config.act_seq)
        out += mlp_skip
        out *= jax.lax.rsqrt(jnp.linalg.norm(out, axis=-1, keepdims=True) + 1e-6)

    logits = jnp.einsum("bsd,dl->bsl", out, params.linear_out.kernel, out_sharding=config.act_seq)
    return logits  # tag: model-apply


# tag: get-adam-state
def init_adam_state(param: jax.Array) -> dot_dict:
    adam_state = dot_dict(mu=jnp.zeros_like(param), nu=jnp.zeros_like(param), count=jnp.array(0))
    return adam_state  # tag: get-adam-state


# tag: adam-apply
def adam_update(config: Config, param: jax.Ref, grad: jax.Array, adam_state: dot_dict):
    adam_state.mu[...] = (1 - config.beta_1) * adam_state.mu[...] + config.beta_1 * grad
    adam_state.nu[...] = (1 - config.beta_2) * adam_state.nu[...] + config.beta_2 * grad**2
    adam_state.count[...] += 1

    mu_hat = adam_state.mu[...] / (1 - config.beta_1 ** adam_state.count[...])
    nu_hat = adam_state.nu[...] / (1 - config.beta_2 ** adam_state.count[...])
    param[...] -= config.learning_rate * mu_hat / (jnp.sqrt(nu_hat + config.eps_root) + config.eps)
    # tag: adam-apply


# tag: get-train-state
@jax.jit
def init_train_state(config: Config) -> dot_dict:
    train_state = dot_dict()
    train_state.params = init_param_state(config)
    train_state.opt = jax.tree.map(init_adam_state, train_state.params)
    return train_state  # tag: get-train-state


# tag: train-step
@jax.jit
def train_step(config: Config, train_state: dot_dict, batch: dict) -> dict:
    def loss_fn(params):
        logits = model_apply(config, params, batch["observed_ids"])
        labels = jax.nn.one_hot(batch["target_ids"], config.vocab_size)
        return -(labels * jax.nn.log_softmax(logits)).mean()

    params = jax.tree.map(jax.ref.get, train_state.params)
    loss, grad = jax.value_and_grad(loss_fn)(params)
    jax.tree.map(ft.partial(adam_update, config), train_state.params, grad, train_state.opt)
    metrics = {"train_loss": loss}
    return metrics  # tag: train-step
