"""The models of test_authors_round4.py, as their authors wrote them (sizes cut), each headed by
its source path and commit.

- equinox docs/examples/init_apply.ipynb and serialisation.ipynb, and unet.ipynb (its two
  ``einops.rearrange`` calls written as the reshapes they are: einops is no dependency here)
  (patrick-kidger/equinox@9336d820b2ef66b360fc6cb3611b3da5cefbb14d);
- flax flax/linen/transforms.py, the lifted transforms' docstrings: ``nn.checkpoint``'s
  CheckpointedMLP, ``nn.scan``'s LSTM (both forms) and ResidualMLP, ``nn.remat_scan``'s
  BigModel, ``nn.while_loop``'s WhileLoopExample, ``nn.cond``'s CondExample, ``nn.switch``'s
  SwitchExample and MultiHeadSwitchExample, ``nn.custom_vjp``'s Foo;
- flax docs_nnx/guides/extracting_intermediates.md: ``Foo`` (``self.sow`` of its features,
  read by ``nnx.capture``) and ``Model`` (``self.perturb``) with its ``train_step`` (renamed
  ``SowFoo``, ``PerturbModel`` and ``perturb_train_step`` here);
- JAX examples/advi.py (jax-ml/jax@cec06d116c05f0d52adfceee3d3b730fdbcb0ce5): its ELBO, the
  jitted ``objective(params, t)`` of its main block, and its ``update`` step (the plotting
  left out);
- flax docs_nnx/guides/optimization_cookbook.md: its toy ``make_model`` and ``loss_fn``, and
  its rank-2 LoRA of every Linear by ``nnx.recursive_map`` (``rngs`` passed in: the cookbook's
  is a global);
- flax docs_nnx/guides/transforms.md: ``WeightStack`` (``nnx.vmap`` of ``__init__`` and
  ``__call__``) and ``noisy_vector_dot`` (``nnx.split_rngs`` over an ``nnx.vmap`` of
  ``nnx.StateAxes``) (google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0).
"""

# ruff: noqa: SIM108, SIM300, RUF059, B905, RUF036 (the authors' code, as written)

import json
import math
from collections.abc import Callable
from functools import partial

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy.stats.norm as norm
from flax import nnx
from jax import grad, jit, random, vmap
from jax.example_libraries import optimizers


# -- equinox docs/examples/init_apply.ipynb, as written there --------------------------------
def make_mlp(in_size, out_size, width_size, depth, *, key):
    mlp = eqx.nn.MLP(in_size, out_size, width_size, depth, key=key)  # insert your model here
    params, static = eqx.partition(mlp, eqx.is_inexact_array)

    def init_fn():
        return params

    def apply_fn(_params, x):
        model = eqx.combine(_params, static)
        return model(x)

    return init_fn, apply_fn


# -- equinox docs/examples/serialisation.ipynb, as written there -------------------------------
def make(*, key, size, width, depth, use_tanh=False):
    if use_tanh:
        activation = jnp.tanh
    else:
        activation = jax.nn.relu
    # (This is not meant to be a realistically useful model.)
    return eqx.nn.MLP(
        in_size=size,
        out_size=1,
        width_size=width,
        depth=depth,
        activation=activation,
        key=key,
    )


hyperparameters = {"size": 5, "width": 10, "depth": 3, "use_tanh": True}


def save(filename, hyperparams, model):
    with open(filename, "wb") as f:
        hyperparam_str = json.dumps(hyperparams)
        f.write((hyperparam_str + "\n").encode())
        eqx.tree_serialise_leaves(f, model)


def load(filename):
    with open(filename, "rb") as f:
        hyperparams = json.loads(f.readline().decode())
        model = make(key=jr.PRNGKey(0), **hyperparams)
        return eqx.tree_deserialise_leaves(f, model)


# -- equinox docs/examples/unet.ipynb, as written there (its rearranges as reshapes) -------------
class SinusoidalPosEmb(eqx.Module):
    emb: jax.Array

    def __init__(self, dim):
        half_dim = dim // 2
        emb = math.log(10000) / (half_dim - 1)
        self.emb = jnp.exp(jnp.arange(half_dim) * -emb)

    def __call__(self, x):
        emb = x * self.emb
        emb = jnp.concatenate((jnp.sin(emb), jnp.cos(emb)), axis=-1)
        return emb


class LinearTimeSelfAttention(eqx.Module):
    group_norm: eqx.nn.GroupNorm
    heads: int
    to_qkv: eqx.nn.Conv2d
    to_out: eqx.nn.Conv2d

    def __init__(
        self,
        dim,
        key,
        heads=4,
        dim_head=32,
    ):
        keys = jax.random.split(key, 2)
        self.group_norm = eqx.nn.GroupNorm(min(dim // 4, 32), dim)
        self.heads = heads
        hidden_dim = dim_head * heads
        self.to_qkv = eqx.nn.Conv2d(dim, hidden_dim * 3, 1, key=keys[0])
        self.to_out = eqx.nn.Conv2d(hidden_dim, dim, 1, key=keys[1])

    def __call__(self, x):
        c, h, w = x.shape
        x = self.group_norm(x)
        qkv = self.to_qkv(x)
        # rearrange(qkv, "(qkv heads c) h w -> qkv heads c (h w)", heads=self.heads, qkv=3)
        q, k, v = qkv.reshape(3, self.heads, -1, h * w)
        k = jax.nn.softmax(k, axis=-1)
        context = jnp.einsum("hdn,hen->hde", k, v)
        out = jnp.einsum("hde,hdn->hen", context, q)
        # rearrange(out, "heads c (h w) -> (heads c) h w", heads=self.heads, h=h, w=w)
        out = out.reshape(-1, h, w)
        return self.to_out(out)


def upsample_2d(y, factor=2):
    C, H, W = y.shape
    y = jnp.reshape(y, [C, H, 1, W, 1])
    y = jnp.tile(y, [1, 1, factor, 1, factor])
    return jnp.reshape(y, [C, H * factor, W * factor])


def downsample_2d(y, factor=2):
    C, H, W = y.shape
    y = jnp.reshape(y, [C, H // factor, factor, W // factor, factor])
    return jnp.mean(y, axis=[2, 4])


def exact_zip(*args):
    _len = len(args[0])
    for arg in args:
        assert len(arg) == _len
    return zip(*args)


def key_split_allowing_none(key):
    if key is None:
        return key, None
    else:
        return jr.split(key)


class Residual(eqx.Module):
    fn: LinearTimeSelfAttention

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x, *args, **kwargs):
        return self.fn(x, *args, **kwargs) + x


class ResnetBlock(eqx.Module):
    dim_out: int
    is_biggan: bool
    up: bool
    down: bool
    dropout_rate: float
    time_emb_dim: int
    mlp_layers: list[Callable | eqx.nn.Linear]
    scaling: None | Callable | eqx.nn.ConvTranspose2d | eqx.nn.Conv2d
    block1_groupnorm: eqx.nn.GroupNorm
    block1_conv: eqx.nn.Conv2d
    block2_layers: list[eqx.nn.GroupNorm | eqx.nn.Dropout | eqx.nn.Conv2d | Callable]
    res_conv: eqx.nn.Conv2d
    attn: Residual | None

    def __init__(
        self,
        dim_in,
        dim_out,
        is_biggan,
        up,
        down,
        time_emb_dim,
        dropout_rate,
        is_attn,
        heads,
        dim_head,
        *,
        key,
    ):
        keys = jax.random.split(key, 7)
        self.dim_out = dim_out
        self.is_biggan = is_biggan
        self.up = up
        self.down = down
        self.dropout_rate = dropout_rate
        self.time_emb_dim = time_emb_dim

        self.mlp_layers = [
            jax.nn.silu,
            eqx.nn.Linear(time_emb_dim, dim_out, key=keys[0]),
        ]
        self.block1_groupnorm = eqx.nn.GroupNorm(min(dim_in // 4, 32), dim_in)
        self.block1_conv = eqx.nn.Conv2d(dim_in, dim_out, 3, padding=1, key=keys[1])
        self.block2_layers = [
            eqx.nn.GroupNorm(min(dim_out // 4, 32), dim_out),
            jax.nn.silu,
            eqx.nn.Dropout(dropout_rate),
            eqx.nn.Conv2d(dim_out, dim_out, 3, padding=1, key=keys[2]),
        ]

        assert not self.up or not self.down

        if is_biggan:
            if self.up:
                self.scaling = upsample_2d
            elif self.down:
                self.scaling = downsample_2d
            else:
                self.scaling = None
        else:
            if self.up:
                self.scaling = eqx.nn.ConvTranspose2d(
                    dim_in,
                    dim_in,
                    kernel_size=4,
                    stride=2,
                    padding=1,
                    key=keys[3],
                )
            elif self.down:
                self.scaling = eqx.nn.Conv2d(
                    dim_in,
                    dim_in,
                    kernel_size=3,
                    stride=2,
                    padding=1,
                    key=keys[4],
                )
            else:
                self.scaling = None
        # For DDPM Yang use their own custom layer called NIN, which is
        # equivalent to a 1x1 conv
        self.res_conv = eqx.nn.Conv2d(dim_in, dim_out, kernel_size=1, key=keys[5])

        if is_attn:
            self.attn = Residual(
                LinearTimeSelfAttention(
                    dim_out,
                    heads=heads,
                    dim_head=dim_head,
                    key=keys[6],
                )
            )
        else:
            self.attn = None

    def __call__(self, x, t, *, key):
        C, _, _ = x.shape
        # In DDPM, each set of resblocks ends with an up/down sampling. In
        # biggan there is a final resblock after the up/downsampling. In this
        # code, the biggan approach is taken for both.
        # norm -> nonlinearity -> up/downsample -> conv follows Yang
        # https://github.dev/yang-song/score_sde/blob/main/models/layerspp.py
        h = jax.nn.silu(self.block1_groupnorm(x))
        if self.up or self.down:
            h = self.scaling(h)  # pyright: ignore
            x = self.scaling(x)  # pyright: ignore
        h = self.block1_conv(h)

        for layer in self.mlp_layers:
            t = layer(t)
        h = h + t[..., None, None]
        for layer in self.block2_layers:
            # Precisely 1 dropout layer in block2_layers which requires a key.
            if isinstance(layer, eqx.nn.Dropout):
                h = layer(h, key=key)
            else:
                h = layer(h)

        if C != self.dim_out or self.up or self.down:
            x = self.res_conv(x)

        out = (h + x) / jnp.sqrt(2)
        if self.attn is not None:
            out = self.attn(out)
        return out


class UNet(eqx.Module):
    time_pos_emb: SinusoidalPosEmb
    mlp: eqx.nn.MLP
    first_conv: eqx.nn.Conv2d
    down_res_blocks: list[list[ResnetBlock]]
    mid_block1: ResnetBlock
    mid_block2: ResnetBlock
    ups_res_blocks: list[list[ResnetBlock]]
    final_conv_layers: list[Callable | eqx.nn.LayerNorm | eqx.nn.Conv2d]

    def __init__(
        self,
        data_shape: tuple[int, int, int],
        is_biggan: bool,
        dim_mults: list[int],
        hidden_size: int,
        heads: int,
        dim_head: int,
        dropout_rate: float,
        num_res_blocks: int,
        attn_resolutions: list[int],
        *,
        key,
    ):
        keys = jax.random.split(key, 7)
        del key

        data_channels, in_height, in_width = data_shape

        dims = [hidden_size] + [hidden_size * m for m in dim_mults]
        in_out = list(exact_zip(dims[:-1], dims[1:]))

        self.time_pos_emb = SinusoidalPosEmb(hidden_size)
        self.mlp = eqx.nn.MLP(
            hidden_size,
            hidden_size,
            4 * hidden_size,
            1,
            activation=jax.nn.silu,
            key=keys[0],
        )
        self.first_conv = eqx.nn.Conv2d(
            data_channels, hidden_size, kernel_size=3, padding=1, key=keys[1]
        )

        h, w = in_height, in_width
        self.down_res_blocks = []
        num_keys = len(in_out) * num_res_blocks - 1
        keys_resblock = jr.split(keys[2], num_keys)
        i = 0
        for ind, (dim_in, dim_out) in enumerate(in_out):
            if h in attn_resolutions and w in attn_resolutions:
                is_attn = True
            else:
                is_attn = False
            res_blocks = [
                ResnetBlock(
                    dim_in=dim_in,
                    dim_out=dim_out,
                    is_biggan=is_biggan,
                    up=False,
                    down=False,
                    time_emb_dim=hidden_size,
                    dropout_rate=dropout_rate,
                    is_attn=is_attn,
                    heads=heads,
                    dim_head=dim_head,
                    key=keys_resblock[i],
                )
            ]
            i += 1
            for _ in range(num_res_blocks - 2):
                res_blocks.append(
                    ResnetBlock(
                        dim_in=dim_out,
                        dim_out=dim_out,
                        is_biggan=is_biggan,
                        up=False,
                        down=False,
                        time_emb_dim=hidden_size,
                        dropout_rate=dropout_rate,
                        is_attn=is_attn,
                        heads=heads,
                        dim_head=dim_head,
                        key=keys_resblock[i],
                    )
                )
                i += 1
            if ind < (len(in_out) - 1):
                res_blocks.append(
                    ResnetBlock(
                        dim_in=dim_out,
                        dim_out=dim_out,
                        is_biggan=is_biggan,
                        up=False,
                        down=True,
                        time_emb_dim=hidden_size,
                        dropout_rate=dropout_rate,
                        is_attn=is_attn,
                        heads=heads,
                        dim_head=dim_head,
                        key=keys_resblock[i],
                    )
                )
                i += 1
                h, w = h // 2, w // 2
            self.down_res_blocks.append(res_blocks)
        assert i == num_keys

        mid_dim = dims[-1]
        self.mid_block1 = ResnetBlock(
            dim_in=mid_dim,
            dim_out=mid_dim,
            is_biggan=is_biggan,
            up=False,
            down=False,
            time_emb_dim=hidden_size,
            dropout_rate=dropout_rate,
            is_attn=True,
            heads=heads,
            dim_head=dim_head,
            key=keys[3],
        )
        self.mid_block2 = ResnetBlock(
            dim_in=mid_dim,
            dim_out=mid_dim,
            is_biggan=is_biggan,
            up=False,
            down=False,
            time_emb_dim=hidden_size,
            dropout_rate=dropout_rate,
            is_attn=False,
            heads=heads,
            dim_head=dim_head,
            key=keys[4],
        )

        self.ups_res_blocks = []
        num_keys = len(in_out) * (num_res_blocks + 1) - 1
        keys_resblock = jr.split(keys[5], num_keys)
        i = 0
        for ind, (dim_in, dim_out) in enumerate(reversed(in_out)):
            if h in attn_resolutions and w in attn_resolutions:
                is_attn = True
            else:
                is_attn = False
            res_blocks = []
            for _ in range(num_res_blocks - 1):
                res_blocks.append(
                    ResnetBlock(
                        dim_in=dim_out * 2,
                        dim_out=dim_out,
                        is_biggan=is_biggan,
                        up=False,
                        down=False,
                        time_emb_dim=hidden_size,
                        dropout_rate=dropout_rate,
                        is_attn=is_attn,
                        heads=heads,
                        dim_head=dim_head,
                        key=keys_resblock[i],
                    )
                )
                i += 1
            res_blocks.append(
                ResnetBlock(
                    dim_in=dim_out + dim_in,
                    dim_out=dim_in,
                    is_biggan=is_biggan,
                    up=False,
                    down=False,
                    time_emb_dim=hidden_size,
                    dropout_rate=dropout_rate,
                    is_attn=is_attn,
                    heads=heads,
                    dim_head=dim_head,
                    key=keys_resblock[i],
                )
            )
            i += 1
            if ind < (len(in_out) - 1):
                res_blocks.append(
                    ResnetBlock(
                        dim_in=dim_in,
                        dim_out=dim_in,
                        is_biggan=is_biggan,
                        up=True,
                        down=False,
                        time_emb_dim=hidden_size,
                        dropout_rate=dropout_rate,
                        is_attn=is_attn,
                        heads=heads,
                        dim_head=dim_head,
                        key=keys_resblock[i],
                    )
                )
                i += 1
                h, w = h * 2, w * 2

            self.ups_res_blocks.append(res_blocks)
        assert i == num_keys

        self.final_conv_layers = [
            eqx.nn.GroupNorm(min(hidden_size // 4, 32), hidden_size),
            jax.nn.silu,
            eqx.nn.Conv2d(hidden_size, data_channels, 1, key=keys[6]),
        ]

    def __call__(self, t, y, *, key=None):
        t = self.time_pos_emb(t)
        t = self.mlp(t)
        h = self.first_conv(y)
        hs = [h]
        for res_blocks in self.down_res_blocks:
            for res_block in res_blocks:
                key, subkey = key_split_allowing_none(key)
                h = res_block(h, t, key=subkey)
                hs.append(h)

        key, subkey = key_split_allowing_none(key)
        h = self.mid_block1(h, t, key=subkey)
        key, subkey = key_split_allowing_none(key)
        h = self.mid_block2(h, t, key=subkey)

        for res_blocks in self.ups_res_blocks:
            for res_block in res_blocks:
                key, subkey = key_split_allowing_none(key)
                if res_block.up:
                    h = res_block(h, t, key=subkey)
                else:
                    h = res_block(jnp.concatenate((h, hs.pop()), axis=0), t, key=subkey)

        assert len(hs) == 0

        for layer in self.final_conv_layers:
            h = layer(h)
        return h


# -- flax docs_nnx/guides/optimization_cookbook.md, as written there ---------------------------
lecun_normal = jax.nn.initializers.lecun_normal()


def make_model(rngs, init=lecun_normal):
    return nnx.Sequential(
        nnx.Linear(2, 8, rngs=rngs, kernel_init=init), nnx.Linear(8, 8, rngs=rngs, kernel_init=init)
    )


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def lora_model(rngs):
    """The cookbook's ``nnx.recursive_map(add_rank2_lora, make_model(rngs))``."""

    def add_rank2_lora(path, node):
        if isinstance(node, nnx.Linear):
            return nnx.LoRA(node.in_features, 2, node.out_features, base_module=node, rngs=rngs)
        return node

    base_model = make_model(rngs)
    return nnx.recursive_map(add_rank2_lora, base_model)


# -- flax docs_nnx/guides/transforms.md, "Transforming methods", as written there ---------------
class WeightStack(nnx.Module):
    @nnx.vmap
    def __init__(self, seed: jax.Array):
        self.kernel = nnx.Param(random.uniform(random.key(seed), (2, 3)))
        self.bias = nnx.Param(jnp.zeros((3,)))

    @nnx.vmap(in_axes=0, out_axes=1)
    def __call__(self, x: jax.Array):
        assert self.kernel.ndim == 2, "Batch dimensions not allowed"
        assert x.ndim == 1, "Batch dimensions not allowed"
        return x @ self.kernel + self.bias


# -- the same guide, "Random state": nnx.split_rngs over an nnx.vmap of nnx.StateAxes; its
# ``weights.count += 1`` written ``weights.count[...] += 1`` (flax 0.12 raises
# NotImplementedError: "In-place operations are no longer supported for Variable"), its
# splits=10 made 4
class Count(nnx.Variable):
    pass


class Weights(nnx.Module):
    def __init__(self, kernel, bias, count, seed):
        self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias)
        self.count = Count(count)
        self.rngs = nnx.Rngs(noise=seed)


state_axes = nnx.StateAxes({nnx.RngState: 0, (nnx.Param, Count): None})


@nnx.split_rngs(splits=4)
@nnx.vmap(in_axes=(state_axes, 0))
def noisy_vector_dot(weights: Weights, x: jax.Array):
    assert weights.kernel.ndim == 2, "Batch dimensions not allowed"
    assert x.ndim == 1, "Batch dimensions not allowed"
    weights.count[...] += 1
    y = x @ weights.kernel + weights.bias
    return y + random.normal(weights.rngs.noise(), y.shape)


def noisy_weights() -> Weights:
    """The guide's ``Weights(...)`` with ``seed=0``: one stream, split by each call."""
    return Weights(
        kernel=random.uniform(random.key(0), (2, 3)),
        bias=jnp.zeros((3,)),
        count=jnp.array(0),
        seed=0,
    )


# -- the batches these models take --------------------------------------------------------------
def unet() -> "UNet":
    """The notebook's UNet, tiny: 1x8x8 images, two resolutions, attention at 4x4, dropout."""
    return UNet(data_shape=(1, 8, 8), is_biggan=False, dim_mults=[1, 2], hidden_size=8,
                heads=2, dim_head=4, dropout_rate=0.1, num_res_blocks=2, attn_resolutions=[4],
                key=jr.key(5678))  # fmt: skip


def unet_batch(model, t, y, *, key=None):
    """A batch through ``model(t, y, key=key)``, a dropout key per image as
    examples/bert.ipynb splits them (none in inference)."""
    keys = jr.split(key, t.shape[0]) if key is not None else None
    return jax.vmap(lambda t, y, key: model(t, y, key=key))(t, y, keys)


def mlp_batch(apply_fn: Callable) -> Callable:
    """init_apply's ``apply_fn(params, x)`` over a batch of x (it takes one)."""
    return jax.vmap(apply_fn, in_axes=(None, 0))


# -- flax/linen/transforms.py, the lifted transforms' docstrings, as written there (sizes cut:
# Dense(128) 8 wide, LSTM(32) 4, remat_scan's lengths (10, 10) (2, 2)) ------------------------
class CheckpointedMLP(nn.Module):
    @nn.checkpoint
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = nn.relu(x)
        x = nn.Dense(1)(x)
        return x


class LSTM(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        ScanLSTM = nn.scan(
            nn.LSTMCell, variable_broadcast="params", split_rngs={"params": False}, in_axes=1,
            out_axes=1,
        )  # fmt: skip

        lstm = ScanLSTM(self.features)
        input_shape = x[:, 0].shape
        carry = lstm.initialize_carry(jax.random.key(0), input_shape)
        carry, x = lstm(carry, x)
        return x


class FunctionalLSTM(nn.Module):  # the docstring's second LSTM, "the functional form"
    features: int

    @nn.compact
    def __call__(self, x):
        cell = nn.LSTMCell(self.features)

        def body_fn(cell, carry, x):
            carry, y = cell(carry, x)
            return carry, y

        scan = nn.scan(
            body_fn, variable_broadcast="params", split_rngs={"params": False}, in_axes=1,
            out_axes=1,
        )  # fmt: skip

        input_shape = x[:, 0].shape
        carry = cell.initialize_carry(jax.random.key(0), input_shape)
        carry, x = scan(cell, carry, x)
        return x


class ResidualMLPBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(features=2)(x)
        h = nn.relu(h)
        return x + h, None


class ResidualMLP(nn.Module):
    n_layers: int = 4

    @nn.compact
    def __call__(self, x):
        ScanMLP = nn.scan(
            ResidualMLPBlock, variable_axes={"params": 0}, variable_broadcast=False,
            split_rngs={"params": True}, length=self.n_layers,
        )  # fmt: skip
        x, _ = ScanMLP()(x, None)
        return x


class BigModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        DenseStack = nn.remat_scan(nn.Dense, lengths=(2, 2))
        # 100x dense with O(sqrt(N)) memory for gradient computation
        return DenseStack(8, name="dense_stack")(x)


class WhileLoopExample(nn.Module):
    @nn.compact
    def __call__(self, x):
        def cond_fn(mdl, c):
            return mdl.variables["state"]["acc"] < 10

        def body_fn(mdl, c):
            acc = mdl.variable("state", "acc", lambda: jnp.array(0))
            acc.value += 1
            y = nn.Dense(c.shape[-1])(c)
            return y

        c = x
        if self.is_mutable_collection("params"):
            return body_fn(self, c)
        else:
            return nn.while_loop(cond_fn, body_fn, self, c, carry_variables="state")


class CondExample(nn.Module):
    @nn.compact
    def __call__(self, x, pred):
        self.variable("state", "true_count", lambda: 0)
        self.variable("state", "false_count", lambda: 0)

        def true_fn(mdl, x):
            mdl.variable("state", "true_count").value += 1
            return nn.Dense(2, name="dense")(x)

        def false_fn(mdl, x):
            mdl.variable("state", "false_count").value += 1
            return -nn.Dense(2, name="dense")(x)

        return nn.cond(pred, true_fn, false_fn, self, x)


class SwitchExample(nn.Module):
    @nn.compact
    def __call__(self, x, index):
        self.variable("state", "a_count", lambda: 0)
        self.variable("state", "b_count", lambda: 0)
        self.variable("state", "c_count", lambda: 0)

        def a_fn(mdl, x):
            mdl.variable("state", "a_count").value += 1
            return nn.Dense(2, name="dense")(x)

        def b_fn(mdl, x):
            mdl.variable("state", "b_count").value += 1
            return -nn.Dense(2, name="dense")(x)

        def c_fn(mdl, x):
            mdl.variable("state", "c_count").value += 1
            return nn.Dense(2, name="dense")(x)

        return nn.switch(index, [a_fn, b_fn, c_fn], self, x)


class MultiHeadSwitchExample(nn.Module):
    def setup(self) -> None:
        self.heads = [
            nn.Sequential([nn.Dense(10), nn.Dense(7), nn.Dense(5)]),
            nn.Sequential([nn.Dense(11), nn.Dense(5)]),
            nn.Dense(5),
        ]

    @nn.compact
    def __call__(self, x, index):
        def head_fn(i):
            return lambda mdl, x: mdl.heads[i](x)

        branches = [head_fn(i) for i in range(len(self.heads))]

        # run all branches on init
        if self.is_mutable_collection("params"):
            for branch in branches:
                _ = branch(self, x)

        return nn.switch(index, branches, self, x)


class Foo(nn.Module):
    @nn.compact
    def __call__(self, x):
        def f(mdl, x):
            return mdl(x)

        def fwd(mdl, x):
            return nn.vjp(f, mdl, x)

        def bwd(vjp_fn, y_t):
            params_t, *inputs_t = vjp_fn(y_t)
            params_t = jax.tree_util.tree_map(jnp.sign, params_t)
            return (params_t, *inputs_t)

        sign_grad = nn.custom_vjp(f, forward_fn=fwd, backward_fn=bwd)
        return sign_grad(nn.Dense(1), x).reshape(())


# -- JAX examples/advi.py, as written there (its plotting and callback left out) ----------------
def diag_gaussian_sample(rng, mean, log_std):
    # Take a single sample from a diagonal multivariate Gaussian.
    return mean + jnp.exp(log_std) * random.normal(rng, mean.shape)


def diag_gaussian_logpdf(x, mean, log_std):
    # Evaluate a single point on a diagonal multivariate Gaussian.
    return jnp.sum(vmap(norm.logpdf)(x, mean, jnp.exp(log_std)))


def elbo(logprob, rng, mean, log_std):
    # Single-sample Monte Carlo estimate of the variational lower bound.
    sample = diag_gaussian_sample(rng, mean, log_std)
    return logprob(sample) - diag_gaussian_logpdf(sample, mean, log_std)


def batch_elbo(logprob, rng, params, num_samples):
    # Average over a batch of random samples.
    rngs = random.split(rng, num_samples)
    vectorized_elbo = vmap(partial(elbo, logprob), in_axes=(0, None, None))
    return jnp.mean(vectorized_elbo(rngs, *params))


def funnel_log_density(params):
    return norm.logpdf(params[0], 0, jnp.exp(params[1])) + norm.logpdf(params[1], 0, 1.35)


num_samples = 40


@jit
def objective(params, t):
    rng = random.key(t)
    return -batch_elbo(funnel_log_density, rng, params, num_samples)


# Set up optimizer.
D = 2
init_mean = jnp.zeros(D)
init_std = jnp.zeros(D)
init_params = (init_mean, init_std)
opt_init, opt_update, get_params = optimizers.momentum(step_size=0.1, mass=0.9)


@jit
def update(i, opt_state):
    params = get_params(opt_state)
    gradient = grad(objective)(params, i)
    return opt_update(i, gradient, opt_state)


# -- flax docs_nnx/guides/extracting_intermediates.md, as written there (renamed) --------------
class SowFoo(nnx.Module):  # the guide's Foo
    def __init__(self, *, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(8, 32, rngs=rngs)
        self.dense2 = nnx.Linear(32, 1, rngs=rngs)

    def features(self, x, rngs=None):
        feature = nnx.relu(self.dense1(x))
        self.sow(nnx.Intermediate, "features", feature)
        return feature

    def loss(self, x_features, y_features):
        return jnp.sum((x_features - y_features) ** 2)

    def __call__(self, x, y):
        return self.loss(self.features(x), self.features(y))


class PerturbModel(nnx.Module):  # the guide's Model
    def __call__(self, x):
        x2 = self.perturb("grad_of_x", x)
        self.sow(nnx.Intermediate, "activations", x2)
        return 3 * x2


def perturb_train_step(model, x):  # the guide's train_step
    _, perturbations = nnx.capture(model, nnx.Perturbation)(x)

    def loss(model, perturbations, x):
        return nnx.capture(model, nnx.Intermediate, init=perturbations)(x)

    (grads, perturb_grads), sowed = nnx.grad(loss, argnums=(0, 1), has_aux=True)(
        model, perturbations, x
    )
    return nnx.merge_state(perturb_grads, sowed)
