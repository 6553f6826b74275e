"""The models of test_authors_round6.py, as their authors wrote them (sizes cut in the tests,
not here), each headed by its source path and commit.

- google-research/big_vision@0127fb6b337ee2a27bf4e54dea79cff176527356:
  big_vision/models/vit.py (``posemb_sincos_2d``, ``MlpBlock``, ``Encoder1DBlock``, ``Encoder``
  with its ``nn.scan`` of an ``nn.remat`` block, ``MAPHead``, ``_Model``, ``Model``,
  ``pyloop_to_scan`` and ``scan_to_pyloop``; its checkpoint loading left out: it reads
  big_vision's own ``utils``), big_vision/models/
  mlp_mixer.py (``MixerBlock``'s stochastic depth, ``_stoch_depth_mask``, drawing from the
  'dropout' rng; its one ``einops.rearrange`` written as the reshape it is: einops is no
  dependency here) and big_vision/models/bit.py (``StdConv``'s weight standardization,
  GroupNorm, ``get_block_desc``);
- flax examples/nnx_toy_examples 02_lifted_transforms.py, 03_train_state.py,
  04_data_parallel_with_jit.py, 06_scan_over_layers.py and 08_save_load_checkpoints.py
  (google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0), their plotting left out;
- JAX examples/kernel_lsq.py and examples/gaussian_process_regression.py, as they were before
  jax-ml/jax@c856560f0e removed them (jax-ml/jax@035c1e566d61d759eb20106ae47df47f6284975f),
  the GP's ``main`` split into its functions (``numpts`` an argument, the plotting left out).
"""

# ruff: noqa: UP006, UP007, UP035, UP045, E741, RUF059, E731, E501 (the authors' code, as written)

from functools import partial
from typing import Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as random
import jax.scipy as scipy
import numpy as np
import optax
import orbax.checkpoint as orbax
from flax import nnx
from flax.training import train_state
from helpers import MixerMlpBlock
from jax import grad, jit, lax, vmap
from jax.example_libraries import optimizers


# -- big_vision/models/vit.py, as written there --------------------------------------------------
def posemb_sincos_2d(h, w, width, temperature=10_000.0, dtype=jnp.float32):
    """Follows the MoCo v3 logic."""
    y, x = jnp.mgrid[:h, :w]

    assert width % 4 == 0, "Width must be mult of 4 for sincos posemb"
    omega = jnp.arange(width // 4) / (width // 4 - 1)
    omega = 1.0 / (temperature**omega)
    y = jnp.einsum("m,d->md", y.flatten(), omega)
    x = jnp.einsum("m,d->md", x.flatten(), omega)
    pe = jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)
    return jnp.asarray(pe, dtype)[None, :, :]


def get_posemb(self, typ, seqshape, width, name, dtype=jnp.float32):
    if typ == "learn":
        return self.param(
            name,
            nn.initializers.normal(stddev=1 / np.sqrt(width)),
            (1, np.prod(seqshape), width),
            dtype,
        )
    elif typ == "sincos2d":
        return posemb_sincos_2d(*seqshape, width, dtype=dtype)
    else:
        raise ValueError(f"Unknown posemb type: {typ}")


class MlpBlock(nn.Module):
    """Transformer MLP / feed-forward block."""

    mlp_dim: Optional[int] = None  # Defaults to 4x input dim
    dropout: float = 0.0
    dtype_mm: str = "float32"

    @nn.compact
    def __call__(self, x, deterministic=True):
        """Applies Transformer MlpBlock module."""
        inits = dict(
            kernel_init=nn.initializers.xavier_uniform(),
            bias_init=nn.initializers.normal(stddev=1e-6),
        )

        d = x.shape[-1]
        x = nn.Dense(self.mlp_dim or 4 * d, dtype=self.dtype_mm, **inits)(x)
        # In some extreme batch-size cases, this is needed as of Sept 2024:
        x = nn.with_logical_constraint(x, ("act_batch", "act_len", "act_emb"))
        x = nn.gelu(x)
        x = nn.Dropout(rate=self.dropout)(x, deterministic)
        x = nn.Dense(d, dtype=self.dtype_mm, **inits)(x)
        return x


class Encoder1DBlock(nn.Module):
    """Single transformer encoder block (MHSA + MLP)."""

    mlp_dim: Optional[int] = None  # Defaults to 4x input dim
    num_heads: int = 12
    dropout: float = 0.0
    dtype_mm: str = "float32"

    @nn.compact
    def __call__(self, x, deterministic=True):
        out = {}
        x = nn.with_logical_constraint(x, ("act_batch", "act_len", "act_emb"))
        y = nn.LayerNorm()(x)
        y = out["sa"] = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            kernel_init=nn.initializers.xavier_uniform(),
            deterministic=deterministic,
            dtype=self.dtype_mm,
        )(y, y)
        y = nn.with_logical_constraint(y, ("act_batch", "act_len", "act_emb"))
        y = nn.Dropout(rate=self.dropout)(y, deterministic)
        x = out["+sa"] = x + y

        y = nn.LayerNorm()(x)
        y = out["mlp"] = MlpBlock(
            mlp_dim=self.mlp_dim,
            dropout=self.dropout,
            dtype_mm=self.dtype_mm,
        )(y, deterministic)
        y = nn.with_logical_constraint(y, ("act_batch", "act_len", "act_emb"))
        y = nn.Dropout(rate=self.dropout)(y, deterministic)
        x = out["+mlp"] = x + y
        x = nn.with_logical_constraint(x, ("act_batch", "act_len", "act_emb"))
        return x, out


class Encoder(nn.Module):
    """Transformer Model Encoder for sequence to sequence translation."""

    depth: int
    mlp_dim: Optional[int] = None  # Defaults to 4x input dim
    num_heads: int = 12
    dropout: float = 0.0
    scan: bool = False
    remat_policy: str = "nothing_saveable"
    dtype_mm: str = "float32"

    @nn.compact
    def __call__(self, x, deterministic=True):
        out = {}

        if self.scan:
            block = nn.remat(
                Encoder1DBlock,
                prevent_cse=False,
                static_argnums=(2,),  # 0=self, 2=deterministic
                policy=getattr(jax.checkpoint_policies, self.remat_policy, None),
            )
            x, scan_out = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=nn.broadcast,
                length=self.depth,
            )(
                name="encoderblock",
                dtype_mm=self.dtype_mm,
                mlp_dim=self.mlp_dim,
                num_heads=self.num_heads,
                dropout=self.dropout,
            )(x, deterministic)
            for lyr in range(self.depth):
                out[f"block{lyr:02d}"] = jax.tree.map(lambda o, l=lyr: o[l], scan_out)
        else:
            # Input Encoder
            for lyr in range(self.depth):
                block_cur = Encoder1DBlock(
                    name=f"encoderblock_{lyr}",
                    dtype_mm=self.dtype_mm,
                    mlp_dim=self.mlp_dim,
                    num_heads=self.num_heads,
                    dropout=self.dropout,
                )
                x, out[f"block{lyr:02d}"] = block_cur(x, deterministic)
            out["pre_ln"] = x  # Alias for last block, but without the number in it.

        return nn.LayerNorm(name="encoder_norm")(x), out


class MAPHead(nn.Module):
    """Multihead Attention Pooling."""

    mlp_dim: Optional[int] = None  # Defaults to 4x input dim
    num_heads: int = 12

    @nn.compact
    def __call__(self, x):
        # TODO
        n, l, d = x.shape  # pylint: disable=unused-variable
        probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, d), x.dtype)
        probe = jnp.tile(probe, [n, 1, 1])

        x = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, kernel_init=nn.initializers.xavier_uniform()
        )(probe, x)

        # TODO: dropout on head?
        y = nn.LayerNorm()(x)
        x = x + MlpBlock(mlp_dim=self.mlp_dim)(y)
        return x[:, 0]


class _Model(nn.Module):
    """ViT model."""

    num_classes: Optional[int] = None
    patch_size: Sequence[int] = (16, 16)
    width: int = 768
    depth: int = 12
    mlp_dim: Optional[int] = None  # Defaults to 4x input dim
    num_heads: int = 12
    posemb: str = "learn"  # Can also be "sincos2d"
    rep_size: Union[int, bool] = False
    dropout: float = 0.0
    pool_type: str = "gap"  # Can also be "map" or "tok"
    head_zeroinit: bool = True
    scan: bool = False
    # or "dots_with_no_batch_dims_saveable" for more speed (memory costly)
    remat_policy: str = "nothing_saveable"
    dtype_mm: str = "float32"

    @nn.compact
    def __call__(self, image, *, train=False):
        out = {}

        image = jnp.asarray(image, self.dtype_mm)

        # Patch extraction
        x = out["stem"] = nn.Conv(
            self.width,
            self.patch_size,
            strides=self.patch_size,
            padding="VALID",
            name="embedding",
            dtype=self.dtype_mm,
        )(image)

        n, h, w, c = x.shape
        x = jnp.reshape(x, [n, h * w, c])

        # Add posemb before adding extra token.
        x = out["with_posemb"] = x + get_posemb(
            self, self.posemb, (h, w), c, "pos_embedding", x.dtype
        )

        if self.pool_type == "tok":
            cls = self.param("cls", nn.initializers.zeros, (1, 1, c), x.dtype)
            x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)

        n, l, c = x.shape  # pylint: disable=unused-variable
        x = nn.Dropout(rate=self.dropout)(x, not train)

        x, out["encoder"] = Encoder(
            depth=self.depth,
            mlp_dim=self.mlp_dim,
            num_heads=self.num_heads,
            dropout=self.dropout,
            scan=self.scan,
            remat_policy=self.remat_policy,
            dtype_mm=self.dtype_mm,
            name="Transformer",
        )(x, deterministic=not train)
        encoded = out["encoded"] = x

        if self.pool_type == "map":
            x = out["head_input"] = MAPHead(num_heads=self.num_heads, mlp_dim=self.mlp_dim)(x)
        elif self.pool_type == "gap":
            x = out["head_input"] = jnp.mean(x, axis=1)
        elif self.pool_type == "0":
            x = out["head_input"] = x[:, 0]
        elif self.pool_type == "tok":
            x = out["head_input"] = x[:, 0]
            encoded = encoded[:, 1:]
        elif self.pool_type == "none":
            pass
        else:
            raise ValueError(f"Unknown pool type: '{self.pool_type}'")

        x_2d = jnp.reshape(encoded, [n, h, w, -1])

        if self.rep_size:
            rep_size = self.width if self.rep_size is True else self.rep_size
            hid = nn.Dense(rep_size, name="pre_logits")
            # NOTE: In the past we did not include tanh in pre_logits.
            # For few-shot, it should not matter much, as it whitens anyways.
            x_2d = nn.tanh(hid(x_2d))
            x = nn.tanh(hid(x))

        out["pre_logits_2d"] = x_2d
        out["pre_logits"] = x

        if self.num_classes:
            kw = {"kernel_init": nn.initializers.zeros} if self.head_zeroinit else {}
            head = nn.Dense(self.num_classes, name="head", **kw)
            x_2d = out["logits_2d"] = head(x_2d)
            x = out["logits"] = head(x)

        return x, out


def Model(num_classes=None, *, variant=None, **kw):  # pylint: disable=invalid-name
    """Factory function, because linen really don't like what I'm doing!"""
    return _Model(num_classes, **{**decode_variant(variant), **kw})


def decode_variant(variant):
    """Converts a string like "B" or "B/32" into a params dict."""
    if variant is None:
        return {}

    v, patch = variant, {}
    if "/" in variant:
        v, patch = variant.split("/")
        patch = {"patch_size": (int(patch), int(patch))}

    # fmt: off
    return {
        # pylint:disable=line-too-long
        # Reference: Table 2 of https://arxiv.org/abs/2106.04560.
        "width": {"mu": 32, "Ti": 192, "S": 384, "M": 512, "B": 768, "L": 1024, "So400m": 1152, "H": 1280, "g": 1408, "g-opt": 1536, "G": 1664, "G-opt": 1536, "e": 1792}[v],
        "depth": {"mu": 1, "Ti": 12, "S": 12, "M": 12, "B": 12, "L": 24, "So400m": 27, "H": 32, "g": 40, "g-opt": 40, "G": 48, "G-opt": 48, "e": 56}[v],
        "mlp_dim": {"mu": 128, "Ti": 768, "S": 1536, "M": 2048, "B": 3072, "L": 4096, "So400m": 4304, "H": 5120, "g": 6144, "g-opt": 6144, "G": 8192, "G-opt": 8192, "e": 15360}[v],
        "num_heads": {"mu": 2, "Ti": 3, "S": 6, "M": 8, "B": 12, "L": 16, "So400m": 16, "H": 16, "g": 16, "g-opt": 16, "G": 16, "G-opt": 16, "e": 16}[v],
        # pylint:enable=line-too-long
        **patch
    }
    # fmt: on


def pyloop_to_scan(params_pyloop):
    """Converts a python for-loop ViT checkpoint to a lax.scan based one."""
    # On a high level, they are the same except that the for loop has separate
    # array pytrees for each encoderblock, while the scan one has just one
    # encoderblock pytree, with all block's params concatenated.

    params_scan = jax.tree.map(lambda x: x, params_pyloop)  # Structural copy
    t = params_scan["Transformer"]

    # Find highest index of encoderblocks in the checkpoint (they start at 0):
    encoderblocks = {k for k in t if k.startswith("encoderblock_")}
    depth = 1 + max({int(k.split("_")[-1]) for k in encoderblocks})

    def stack(*values):
        return np.stack(values)

    # Stack all encoderblocks into a single one:
    t["encoderblock"] = jax.tree.map(stack, *[t[f"encoderblock_{lyr}"] for lyr in range(depth)])

    for lyr in range(depth):
        del t[f"encoderblock_{lyr}"]

    return params_scan


def scan_to_pyloop(params_scan):
    """Converts a lax.scan ViT checkpoint to a python for-loop based one."""
    # See comment in pyloop_to_scan.

    params_scan = jax.tree.map(lambda x: x, params_scan)  # Structural copy
    t = params_scan["Transformer"]

    # Find out how many encoderblocks there are
    depth = len(t["encoderblock"]["LayerNorm_0"]["bias"])

    # Create that many encoderblocks, each with their slice of their sub-pytree.
    for lyr in range(depth):
        block = jax.tree.map(lambda x, lyr=lyr: x[lyr], t["encoderblock"])
        t[f"encoderblock_{lyr}"] = block

    del t["encoderblock"]
    return params_scan


# -- big_vision/models/mlp_mixer.py, as written there (its rearrange as a reshape; its MlpBlock
# is vit_jax/models_mixer.py's, line for line: helpers.MixerMlpBlock) ----------------------------
class MixerBlock(nn.Module):
    """Mixer block layer."""

    tokens_mlp_dim: int
    channels_mlp_dim: int
    drop_p: float

    @nn.compact
    def __call__(self, x, *, train=False):
        y = nn.LayerNorm()(x)
        y = jnp.swapaxes(y, 1, 2)
        y = MixerMlpBlock(self.tokens_mlp_dim, name="token_mixing")(y)
        y = jnp.swapaxes(y, 1, 2)
        x = x + y * _stoch_depth_mask(x, self.drop_p, not train, self.make_rng)
        y = nn.LayerNorm()(x)
        y = MixerMlpBlock(self.channels_mlp_dim, name="channel_mixing")(y)
        return x + y * _stoch_depth_mask(x, self.drop_p, not train, self.make_rng)


class MlpMixer(nn.Module):
    """Mixer architecture."""

    patch_size: Tuple[int, int]
    num_classes: Optional[int]
    num_blocks: int
    hidden_dim: int
    tokens_mlp_dim: int
    channels_mlp_dim: int
    model_name: Optional[str] = None
    stoch_depth: float = 0.0

    @nn.compact
    def __call__(self, image, *, train=False):
        out = {}
        x = out["stem"] = nn.Conv(
            self.hidden_dim, self.patch_size, strides=self.patch_size, name="stem"
        )(image)
        # einops.rearrange(x, "n h w c -> n (h w) c"):
        x = out["input_tokens"] = jnp.reshape(x, (x.shape[0], -1, x.shape[-1]))
        for i in range(self.num_blocks):
            drop_p = (i / max(self.num_blocks - 1, 1)) * self.stoch_depth
            x = out[f"block_{i}"] = MixerBlock(self.tokens_mlp_dim, self.channels_mlp_dim, drop_p)(
                x, train=train
            )
        x = nn.LayerNorm(name="pre_head_layer_norm")(x)
        x = out["pre_logits"] = jnp.mean(x, axis=1)
        if self.num_classes:
            x = out["logits"] = nn.Dense(
                self.num_classes, kernel_init=nn.initializers.zeros, name="head"
            )(x)
        return x, out


def _stoch_depth_mask(x, drop_p, deterministic, make_rng):
    if not deterministic and drop_p:
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        return 1.0 - jax.random.bernoulli(make_rng("dropout"), drop_p, shape)
    return 1.0


# -- big_vision/models/bit.py, as written there ---------------------------------------------------
def weight_standardize(w, axis, eps):
    w = w - jnp.mean(w, axis=axis)
    w = w / (jnp.std(w, axis=axis) + eps)
    return w


class StdConv(nn.Conv):
    def param(self, name, *a, **kw):
        param = super().param(name, *a, **kw)
        if name == "kernel":
            param = weight_standardize(param, axis=[0, 1, 2], eps=1e-5)
        return param


class ResidualUnit(nn.Module):
    """Bottleneck ResNet block."""

    nmid: Optional[int] = None
    strides: Sequence[int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        nmid = self.nmid or x.shape[-1] // 4
        nout = nmid * 4

        residual = x
        if x.shape[-1] != nout or self.strides != (1, 1):
            residual = StdConv(nout, (1, 1), self.strides, use_bias=False, name="conv_proj")(
                residual
            )
            residual = nn.GroupNorm(name="gn_proj")(residual)

        y = StdConv(nmid, (1, 1), use_bias=False, name="conv1")(x)
        y = nn.GroupNorm(name="gn1")(y)
        y = nn.relu(y)
        y = StdConv(nmid, (3, 3), self.strides, use_bias=False, name="conv2")(y)
        y = nn.GroupNorm(name="gn2")(y)
        y = nn.relu(y)
        y = StdConv(nout, (1, 1), use_bias=False, name="conv3")(y)

        y = nn.GroupNorm(name="gn3", scale_init=nn.initializers.zeros)(y)
        y = nn.relu(residual + y)
        return y


class ResNetStage(nn.Module):
    """One stage of ResNet."""

    block_size: int
    first_stride: Sequence[int] = (1, 1)
    nmid: Optional[int] = None

    @nn.compact
    def __call__(self, x):
        x = ResidualUnit(self.nmid, strides=self.first_stride, name="unit1")(x)
        for i in range(1, self.block_size):
            x = ResidualUnit(self.nmid, name=f"unit{i + 1}")(x)
        return x


class BiT(nn.Module):  # bit.py's Model (vit.py's holds the name here)
    """ResNetV1."""

    num_classes: Optional[int] = None
    width: float = 1
    depth: Union[int, Sequence[int]] = 50

    @nn.compact
    def __call__(self, image, *, train=False):
        del train  # Unused
        blocks = get_block_desc(self.depth)
        width = int(64 * self.width)

        out = {}

        # Root block
        x = StdConv(width, (7, 7), (2, 2), use_bias=False, name="conv_root")(image)
        x = nn.GroupNorm(name="gn_root")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        out["stem"] = x

        # Stages
        x = ResNetStage(blocks[0], nmid=width, name="block1")(x)
        out["stage1"] = x
        for i, block_size in enumerate(blocks[1:], 1):
            x = ResNetStage(
                block_size, nmid=width * 2**i, first_stride=(2, 2), name=f"block{i + 1}"
            )(x)
            out[f"stage{i + 1}"] = x
        out["pre_logits_2d"] = x

        # Head
        x = out["pre_logits"] = jnp.mean(x, axis=(1, 2))

        if self.num_classes:
            head = nn.Dense(self.num_classes, name="head", kernel_init=nn.initializers.zeros)
            out["logits_2d"] = head(out["pre_logits_2d"])
            x = out["logits"] = head(out["pre_logits"])

        return x, out


# A dictionary mapping the number of layers in a resnet to the number of
# blocks in each stage of the model.
# NOTE: Does not include 18/34 as they also need non-bottleneck block!
def get_block_desc(depth):
    if isinstance(depth, list):  # Be robust to silly mistakes.
        depth = tuple(depth)
    return {
        26: [2, 2, 2, 2],  # From timm, gets ~75% on ImageNet.
        50: [3, 4, 6, 3],
        101: [3, 4, 23, 3],
        152: [3, 8, 36, 3],
        200: [3, 24, 36, 3],
    }.get(depth, depth)


# -- big_vision/utils.py's sigmoid_xent and big_vision/train.py's update_fn, as written there
# (its mixup, measurements and bv_optax's step count left out: the count is an argument) -------
def sigmoid_xent(*, logits, labels, reduction=True):
    # NOTE: This implementation is stable, see these two:
    # (internal link)
    # https://github.com/google/jax/issues/2140
    log_p = jax.nn.log_sigmoid(logits)
    log_not_p = jax.nn.log_sigmoid(-logits)
    nll = -jnp.sum(labels * log_p + (1.0 - labels) * log_not_p, axis=-1)
    return jnp.mean(nll) if reduction else nll


def make_update_fn(model, tx):
    def update_fn(train_state, rng, batch, step_count):
        """Update step."""

        images, labels = batch["image"], batch["labels"]

        rng = jax.random.fold_in(rng, step_count)

        # Get device-specific loss rng.
        rng, rng_model = jax.random.split(rng, 2)

        def loss_fn(params):
            logits, _ = model.apply(
                {"params": params}, images, train=True, rngs={"dropout": rng_model}
            )
            return sigmoid_xent(logits=logits, labels=labels)

        params, opt = train_state["params"], train_state["opt"]
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)

        measurements = {"training_loss": loss}
        return {"params": params, "opt": opt}, measurements

    return update_fn


# -- flax examples/nnx_toy_examples/06_scan_over_layers.py, as written there -----------------------
class Block(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array):
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class ScanMLP(nnx.Module):
    """
    An MLP that uses `vmap` during `__init__` to create a Block instance
    with an additional `layer` axis, and `scan` during `__call__` to apply
    the sequence of layers iteratively over the input / output `x`.
    """

    def __init__(self, dim: int, *, n_layers: int, rngs: nnx.Rngs):
        self.n_layers = n_layers

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(axis_size=n_layers)
        def create_block(rngs: nnx.Rngs):
            return Block(dim, rngs=rngs)

        self.layers = create_block(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan
        def scan_fn(x: jax.Array, block: Block):
            x = block(x)
            return x, None

        x, _ = scan_fn(x, self.layers)

        return x


# -- flax examples/nnx_toy_examples/02_lifted_transforms.py, as written there (its Count is
# 03_train_state.py's, nnx.Variable[nnx.A]: the two examples' modules are otherwise one) ---------
class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.uniform(rngs.params(), (din, dout)))
        self.b = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x):
        return x @ self.w.value + self.b.value


class Count(nnx.Variable[nnx.A]):
    pass


class MLP(nnx.Module):
    def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
        self.count = Count(jnp.array(0))
        self.linear1 = Linear(din, dhidden, rngs=rngs)
        self.linear2 = Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        self.count.value += 1
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        return x


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, batch):
    x, y = batch

    def loss_fn(model: MLP):
        y_pred = model(x)
        return jnp.mean((y - y_pred) ** 2)

    grads: nnx.State = nnx.grad(loss_fn)(model)
    optimizer.update(model, grads)


@nnx.jit
def test_step(model: MLP, batch):
    x, y = batch
    y_pred = model(x)
    loss = jnp.mean((y - y_pred) ** 2)
    return {"loss": loss}


# -- flax examples/nnx_toy_examples/03_train_state.py, as written there ---------------------------
class TrainState(train_state.TrainState):
    counts: nnx.State
    graphdef: nnx.GraphDef


@jax.jit
def ts_train_step(state: TrainState, batch):  # 03's train_step
    x, y = batch

    def loss_fn(params):
        model = nnx.merge(state.graphdef, params, state.counts, copy=True)
        y_pred = model(x)
        loss = jnp.mean((y - y_pred) ** 2)
        counts = nnx.state(model, Count)
        return loss, counts

    grads, counts = jax.grad(loss_fn, has_aux=True)(state.params)
    # sdg update
    state = state.apply_gradients(grads=grads, counts=counts)

    return state


@jax.jit
def ts_test_step(state: nnx.TrainState[MLP], batch):  # 03's test_step
    x, y = batch
    model = nnx.merge(state.graphdef, state.params, state.counts)
    y_pred = model(x)
    loss = jnp.mean((y - y_pred) ** 2)
    return {"loss": loss}


# -- flax examples/nnx_toy_examples/04_data_parallel_with_jit.py, as written there (its mesh and
# shardings made in the test, over conftest's 8 CPU devices) ------------------------------------
class DataParallelMLP(nnx.Module):  # 04's MLP
    def __init__(self, din, dmid, dout, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


@nnx.jit
def dp_train_step(model: DataParallelMLP, optimizer: nnx.Optimizer, x, y):  # 04's train_step
    def loss_fn(model: DataParallelMLP):
        y_pred = model(x)
        return jnp.mean((y - y_pred) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


# -- flax examples/nnx_toy_examples/08_save_load_checkpoints.py, as written there -----------------
class CheckpointMLP(nnx.Module):  # 08's MLP
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(din, dmid, rngs=rngs)
        self.dense2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.dense1(x)
        x = jax.nn.relu(x)
        x = self.dense2(x)
        return x


def create_model(seed: int):
    return CheckpointMLP(10, 20, 30, rngs=nnx.Rngs(seed))


def create_and_save(seed: int, path: str):
    model = create_model(seed)
    state = nnx.state(model)
    # Save the parameters
    checkpointer = orbax.PyTreeCheckpointer()
    checkpointer.save(f"{path}/state", state)


def load_model(path: str) -> CheckpointMLP:
    # create that model with abstract shapes
    model = nnx.eval_shape(lambda: create_model(0))
    state = nnx.state(model)
    # Load the parameters
    checkpointer = orbax.PyTreeCheckpointer()
    state = checkpointer.restore(f"{path}/state", item=state)
    # update the model with the loaded state
    nnx.update(model, state)
    return model


# -- JAX examples/kernel_lsq.py, as written there (before jax-ml/jax@c856560f0e removed it) -------
def gram(kernel, xs):
    """Compute a Gram matrix from a kernel and an array of data points.

    Args:
      kernel: callable, maps pairs of data points to scalars.
      xs: array of data points, stacked along the leading dimension.

    Returns:
      A 2d array `a` such that `a[i, j] = kernel(xs[i], xs[j])`.
    """
    return vmap(lambda x: vmap(lambda y: kernel(x, y))(xs))(xs)


def minimize(f, x, num_steps=10000, step_size=0.000001, mass=0.9):
    opt_init, opt_update, get_params = optimizers.momentum(step_size, mass)

    @jit
    def update(i, opt_state):
        x = get_params(opt_state)
        return opt_update(i, grad(f)(x), opt_state)

    opt_state = opt_init(x)
    for i in range(num_steps):
        opt_state = update(i, opt_state)
    return get_params(opt_state)


def train(kernel, xs, ys, regularization=0.01):
    gram_ = jit(partial(gram, kernel))
    gram_mat = gram_(xs)
    n = xs.shape[0]

    def objective(v):
        risk = 0.5 * jnp.sum((jnp.dot(gram_mat, v) - ys) ** 2.0)
        reg = regularization * jnp.sum(v**2.0)
        return risk + reg

    v = minimize(objective, jnp.zeros(n))

    def predict(x):
        prods = vmap(lambda x_: kernel(x, x_))(xs)
        return jnp.sum(v * prods)

    return jit(vmap(predict))


# its __main__'s kernels
linear_kernel = lambda x, y: jnp.dot(x, y, precision=lax.Precision.HIGH)
rbf_kernel = lambda x, y: jnp.exp(-jnp.sum((x - y) ** 2))


# -- JAX examples/gaussian_process_regression.py, as written there (before jax-ml/jax@c856560f0e
# removed it): its main's functions, made by gp_functions(numpts), and its data, by gp_data ----
def gp_functions(numpts=7):
    eye = jnp.eye(numpts)

    def cov_map(cov_func, xs, xs2=None):
        """Compute a covariance matrix from a covariance function and data points.

        Args:
          cov_func: callable function, maps pairs of data points to scalars.
          xs: array of data points, stacked along the leading dimension.
        Returns:
          A 2d array `a` such that `a[i, j] = cov_func(xs[i], xs[j])`.
        """
        if xs2 is None:
            return vmap(lambda x: vmap(lambda y: cov_func(x, y))(xs))(xs)
        else:
            return vmap(lambda x: vmap(lambda y: cov_func(x, y))(xs))(xs2).T

    def softplus(x):
        return jnp.logaddexp(x, 0.0)

    # Note, writing out the vectorized form of the identity
    # ||x-y||^2 = <x-y,x-y> = ||x||^2 + ||y||^2 - 2<x,y>
    # for computing squared distances would be more efficient (but less succinct).
    def exp_quadratic(x1, x2):
        return jnp.exp(-jnp.sum((x1 - x2) ** 2))

    def gp(params, x, y, xtest=None, compute_marginal_likelihood=False):
        noise = softplus(params["noise"])
        amp = softplus(params["amplitude"])
        ls = softplus(params["lengthscale"])
        ymean = jnp.mean(y)
        y = y - ymean
        x = x / ls
        train_cov = amp * cov_map(exp_quadratic, x) + eye * (noise + 1e-6)
        chol = scipy.linalg.cholesky(train_cov, lower=True)
        kinvy = scipy.linalg.solve_triangular(
            chol.T, scipy.linalg.solve_triangular(chol, y, lower=True)
        )
        if compute_marginal_likelihood:
            log2pi = jnp.log(2.0 * 3.1415)
            ml = jnp.sum(
                -0.5 * jnp.dot(y.T, kinvy)
                - jnp.sum(jnp.log(jnp.diag(chol)))
                - (numpts / 2.0) * log2pi
            )
            ml -= jnp.sum(
                -0.5 * jnp.log(2 * 3.1415) - jnp.log(amp) - 0.5 * jnp.log(amp) ** 2
            )  # lognormal prior
            return -ml

        if xtest is not None:
            xtest = xtest / ls
        cross_cov = amp * cov_map(exp_quadratic, x, xtest)
        mu = jnp.dot(cross_cov.T, kinvy) + ymean
        v = scipy.linalg.solve_triangular(chol, cross_cov, lower=True)
        var = amp * cov_map(exp_quadratic, xtest) - jnp.dot(v.T, v)
        return mu, var

    marginal_likelihood = partial(gp, compute_marginal_likelihood=True)
    predict = partial(gp, compute_marginal_likelihood=False)
    grad_fun = jit(grad(marginal_likelihood))

    lr = 0.01  # Learning rate

    def train_step(params, momentums, scales, x, y):
        grads = grad_fun(params, x, y)
        for k in params:
            momentums[k] = 0.9 * momentums[k] + 0.1 * grads[k][0]
            scales[k] = 0.9 * scales[k] + 0.1 * grads[k][0] ** 2
            params[k] -= lr * momentums[k] / jnp.sqrt(scales[k] + 1e-5)
        return params, momentums, scales

    return marginal_likelihood, predict, train_step


def gp_data(numpts=7):
    key = random.key(0)

    # Covariance hyperparameters to be learned
    params = {
        "amplitude": jnp.zeros((1, 1)),
        "noise": jnp.zeros((1, 1)) - 5.0,
        "lengthscale": jnp.zeros((1, 1)),
    }
    momentums = {k: p * 0.0 for k, p in params.items()}
    scales = {k: p * 0.0 + 1.0 for k, p in params.items()}

    # Create a really simple toy 1D function
    y_fun = lambda x: jnp.sin(x) + 0.1 * random.normal(key, shape=(x.shape[0], 1))
    x = (random.uniform(key, shape=(numpts, 1)) * 4.0) + 1
    y = y_fun(x)
    xtest = jnp.linspace(0, 6.0, 200)[:, None]
    return params, momentums, scales, x, y, xtest
