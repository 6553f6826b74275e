"""Code we did not write, round eighteen: Flax NNX's newest guides, as their authors wrote them
(sizes cut where said), for tests/test_authors_round18.py.

google/flax at 18f8f311c275d57f46d95e41b15aa97b454754c0:

- docs_nnx/guides/view.md: ``MyModel`` (Linear, Dropout drawing from the ``rngs`` passed in,
  BatchNorm, Linear), its ``train_step`` (``nnx.Optimizer(model, tx, wrt=nnx.Param)`` over
  the ``nnx.view(model, deterministic=False)`` training view) and ``eval_step``;
  ``NoisyLinear`` (made train or eval by ``nnx.with_attributes``) and ``add_noise`` (every
  ``nnx.Linear`` made a ``NoisyLinear`` by ``nnx.recursive_map``).
- docs_nnx/guides/randomness.md, as it is at this commit (round six took it at 06611168):
  "Splitting implicit random state", the implicit-rngs ``Model`` sampled five times by
  ``sample_from_model`` (``nnx.with_rngs(split=5)`` over an ``nnx.vmap`` whose ``in_axes``
  is ``nnx.prefix`` of the guide's global ``model``, ``graph=False``); "Transforming implicit
  state", ``rnn_forward`` (one recurrent dropout mask broadcast over the steps by
  ``nnx.with_rngs(broadcast=...)``, an ``nnx.scan``, ``graph=False``) over ``RNNCell``
  (tests/helpers.py's, unchanged since round six took it); sizes cut.
- docs_nnx/examples/vit_training.md: ``ShardingConfig``, ``ModelConfig``,
  ``VisionTransformer`` and ``TransformerEncoder`` (``out_sharding=`` at each layer; Dropout
  and attention dropout drawing from the ``rngs`` passed in), ``compute_losses_and_logits``
  and ``train_step`` (``nnx.Optimizer`` of ``optax.sgd`` with Nesterov momentum, a fork of
  the rngs a step); the config's sizes are cut by the test, its Food-101 data left out.
- docs_nnx/guides/bridge_guide.md, "The Basics" and "Handling RNG keys" (round ten took its
  variable types): ``LinenDot`` in ``bridge.ToNNX``, ``NNXOuter`` (a ToNNX sub-module),
  ``NNXDot`` by ``bridge.to_linen``, ``NNXAddConstant`` by ``bridge.ToLinen(...,
  skip_rng=True)``, ``LinenOuter`` (a to_linen sub-module); ``nn.Dropout`` in ``ToNNX`` and
  ``nnx.Dropout`` by ``to_linen`` (built by the test as the guide builds them).
- docs_nnx/guides/transforms.md (round four took "Transforming methods"): "Basic example"'s
  ``Weights`` and ``vector_dot``; "State propagation"'s ``stateful_vector_dot`` (its
  ``Weights`` of a ``Count`` renamed ``CountedWeights``; ``Count`` is the randomness guide's
  above, the same class) over ``nnx.vmap`` with ``in_axes=0`` and with ``nnx.StateAxes``
  broadcasting the count; "Random state"'s ``noisy_vector_dot`` (its ``Weights`` renamed
  ``NoisyWeights``). The guide's ``weights.count += 1`` raises in the installed Flax
  ("In-place operations are no longer supported for Variable"): written ``[...] += 1``.
- docs_nnx/examples/digits_diffusion_model.md: ``UNet`` (time embedding, four ``ResBlock``
  levels, self-attention, a bridge, skip connections), ``ResBlock``, the flow-matching
  ``loss_fn`` (its times and noise drawn from the ``rngs`` passed in) and ``train_step``
  (renamed ``diffusion_train_step``: ``nnx.ModelAndOptimizer`` of ``optax.adamw`` on a
  warm-up and cosine schedule, clipped); its diffrax sampling left out (not installed).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import bridge
from jax.sharding import PartitionSpec as P

# --- docs_nnx/guides/view.md ------------------------------------------------------------------

in_dim, hidden_dim, out_dim = 4, 8, 2  # the guide's 16, 32, 2


class MyModel(nnx.Module):
    def __init__(
        self,
        in_dim: int,
        hidden_dim: int,
        out_dim: int,
        dropout_rate: float,
        *,
        rngs: nnx.Rngs,
    ):
        self.lin1 = nnx.Linear(in_dim, hidden_dim, rngs=rngs)
        self.do = nnx.Dropout(dropout_rate)
        self.bn = nnx.BatchNorm(hidden_dim, rngs=rngs)
        self.lin2 = nnx.Linear(hidden_dim, out_dim, rngs=rngs)

    def __call__(self, x, *, rngs=None):
        x = nnx.relu(self.do(self.bn(self.lin1(x)), rngs=rngs))
        return self.lin2(x)


@nnx.jit
def train_step(model, optimizer, x, y, rngs):
    def loss_fn(model, rngs):
        return ((model(x, rngs=rngs) - y) ** 2).mean()

    grads = nnx.grad(loss_fn)(model, rngs)
    optimizer.update(model, grads)


@nnx.jit
def eval_step(model, x, y):
    return ((model(x) - y) ** 2).mean()


class NoisyLinear(nnx.Module):
    def __init__(self, din, dout, *, training=None, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.training = training

    def __call__(self, x, rngs=None):
        assert self.training is not None
        x = self.linear(x)
        if self.training:
            x = x + rngs.normal(x.shape) * 0.1
        return x


def add_noise(path, node):
    if isinstance(node, nnx.Linear):
        noisy = nnx.eval_shape(
            lambda: NoisyLinear(node.in_features, node.out_features, rngs=nnx.Rngs(0))
        )
        noisy.linear = node
        return noisy
    return node


# --- docs_nnx/guides/randomness.md --------------------------------------------------------------


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(20, 10, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.drop(self.linear(x)))


model = Model(nnx.Rngs(params=0, dropout=1))

in_axes = nnx.prefix(model, {"dropout": 0, ...: None}, graph=False)


@nnx.with_rngs(split=5, only="dropout", graph=False)
@nnx.vmap(in_axes=(in_axes, None), out_axes=0, graph=False)
def sample_from_model(model, x):
    return model(x)


class Count(nnx.Variable):
    pass


RNNCell = helpers.RNNCell  # the guide's, unchanged since round six took it (its Count too)


@nnx.jit(graph=False)
def rnn_forward(cell: RNNCell, x: jax.Array):
    h = cell.initial_state(batch_size=x.shape[0])
    # Broadcast the 'recurrent_dropout' PRNG state to have the same mask on every step.
    broadcast_cell = nnx.with_rngs(cell, broadcast=x.shape[1], graph=False)
    in_axes = nnx.prefix(broadcast_cell, {"recurrent_dropout": 0, ...: None}, graph=False)

    @nnx.scan(in_axes=(in_axes, nnx.Carry, 1), out_axes=(nnx.Carry, 1), graph=False)
    def unroll(cell, h, x) -> tuple[jax.Array, jax.Array]:
        h, y = cell(h, x)
        return h, y

    _, y = unroll(broadcast_cell, h, x)
    return y


# --- docs_nnx/examples/vit_training.md ----------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ShardingConfig:
    attn_qkvo_weight_ndh: P | None = None  # sharding for Q, K, V, Out weights
    mlp_weight_df: P | None = None
    mlp_weight_fd: P | None = None
    act_btd: P | None = None  # sharding of the activation (B, T, D)
    act_btf: P | None = None
    act_btnh: P | None = None
    act_bc: P | None = None  # sharding of the final logits
    fsdp_axis_name: str = "fsdp"

    @staticmethod
    def no_sharding():
        return ShardingConfig()

    @staticmethod
    def fsdp_sharding(fsdp_axis_name: str = "fsdp"):
        fsdp = fsdp_axis_name
        return ShardingConfig(
            attn_qkvo_weight_ndh=P(None, fsdp, None),
            mlp_weight_df=P(fsdp, None),
            mlp_weight_fd=P(None, fsdp),
            act_btd=P(fsdp, None, None),
            act_btf=P(fsdp, None, None),
            act_btnh=P(fsdp, None, None, None),
            act_bc=P(fsdp, None),
            fsdp_axis_name=fsdp_axis_name,
        )


@dataclass(slots=True, frozen=True)
class ModelConfig:
    num_classes: int = 1000
    in_channels: int = 3
    img_size: int = 224
    patch_size: int = 16
    num_layers: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    hidden_size: int = 768
    dropout_rate: float = 0.1
    sharding: ShardingConfig = ShardingConfig.no_sharding()  # noqa: RUF009 - as written
    use_bfloat16: bool = True


class VisionTransformer(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
    ):
        act_dtype = jnp.bfloat16 if config.use_bfloat16 else jnp.float32
        param_dtype = jnp.float32
        n_patches = (config.img_size // config.patch_size) ** 2
        self.patch_embeddings = nnx.Conv(
            config.in_channels,
            config.hidden_size,
            kernel_size=(config.patch_size, config.patch_size),
            strides=(config.patch_size, config.patch_size),
            padding="VALID",
            use_bias=True,
            dtype=act_dtype,  # activations dtype
            param_dtype=param_dtype,  # weights dtype
            rngs=rngs,
        )

        initializer = jax.nn.initializers.truncated_normal(stddev=0.02)
        self.position_embeddings = nnx.Param(
            initializer(rngs.params(), (1, n_patches + 1, config.hidden_size), param_dtype)
        )  # Shape `(1, n_patches +1, hidden_size`)
        self.dropout = nnx.Dropout(config.dropout_rate)

        self.cls_token = nnx.Param(jnp.zeros((1, 1, config.hidden_size), dtype=param_dtype))

        self.encoder = nnx.Sequential(*[
            TransformerEncoder(config, rngs=rngs) for i in range(config.num_layers)
        ])  # fmt: skip
        self.final_norm = nnx.LayerNorm(
            config.hidden_size, rngs=rngs, dtype=act_dtype, param_dtype=param_dtype
        )
        self.classifier = nnx.Linear(
            config.hidden_size,
            config.num_classes,
            rngs=rngs,
            dtype=act_dtype,
            param_dtype=param_dtype,
        )
        self.config = config

    def embed(self, x: jax.Array) -> jax.Array:
        patches = self.patch_embeddings(x, out_sharding=self.config.sharding.act_btd)
        batch_size = patches.shape[0]
        patches = patches.reshape(batch_size, -1, patches.shape[-1])

        cls_token = jnp.tile(self.cls_token.astype(x.dtype), (batch_size, 1, 1))
        if self.config.sharding.act_btd is not None:
            cls_token = jax.device_put(cls_token, device=self.config.sharding.act_btd)
        x = jnp.concat([cls_token, patches], axis=1)
        return x + self.position_embeddings.astype(x.dtype)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = self.embed(x)
        x = self.dropout(x, rngs=rngs)
        x = self.encoder(x, rngs=rngs)
        x = self.final_norm(x)
        x = x[:, 0]
        return self.classifier(x, out_sharding=self.config.sharding.act_bc)


class TransformerEncoder(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        act_dtype = jnp.bfloat16 if config.use_bfloat16 else jnp.float32
        param_dtype = jnp.float32

        self.norm1 = nnx.LayerNorm(
            config.hidden_size, rngs=rngs, dtype=act_dtype, param_dtype=param_dtype
        )
        self.mha = nnx.MultiHeadAttention(
            num_heads=config.num_heads,
            in_features=config.hidden_size,
            dropout_rate=config.dropout_rate,
            broadcast_dropout=False,
            decode=False,
            deterministic=False,
            kernel_metadata={"out_sharding": config.sharding.attn_qkvo_weight_ndh},
            out_kernel_metadata={"out_sharding": config.sharding.attn_qkvo_weight_ndh},
            keep_rngs=False,
            dtype=act_dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(config.hidden_size, rngs=rngs)
        self.mlp_up_proj = nnx.Linear(
            config.hidden_size,
            config.mlp_dim,
            kernel_metadata={"out_sharding": config.sharding.mlp_weight_df},
            dtype=act_dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.mlp_down_proj = nnx.Linear(
            config.mlp_dim,
            config.hidden_size,
            kernel_metadata={"out_sharding": config.sharding.mlp_weight_fd},
            dtype=act_dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.mlp_drop = nnx.Dropout(config.dropout_rate, rngs=rngs)
        self.config = config

    def attn(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        return self.mha(
            x,
            rngs=rngs,
            out_sharding=self.config.sharding.act_btd,
            qkv_sharding=self.config.sharding.act_btnh,
        )

    def mlp(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = self.mlp_up_proj(x, out_sharding=self.config.sharding.act_btf)
        x = nnx.gelu(x)
        x = self.mlp_drop(x, rngs=rngs)
        x = self.mlp_down_proj(x, out_sharding=self.config.sharding.act_btd)
        return self.mlp_drop(x, rngs=rngs)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = x + self.attn(self.norm1(x), rngs=rngs)
        x = x + self.mlp(self.norm2(x), rngs=rngs)
        return x


def compute_losses_and_logits(
    model: nnx.Module, images: jax.Array, labels: jax.Array, rngs: nnx.Rngs | None = None
) -> tuple[jax.Array, jax.Array]:
    logits = model(images, rngs=rngs)

    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits.astype(jnp.float32), labels=labels
    ).mean()
    return loss, logits


@nnx.jit(donate_argnames=("model", "optimizer"))
def vit_train_step(  # the guide's train_step (view.md's is above)
    model: nnx.Module, optimizer: nnx.Optimizer, rngs: nnx.Rngs, batch: tuple[jax.Array, jax.Array]
):
    images, labels = batch
    grad_fn = nnx.value_and_grad(compute_losses_and_logits, has_aux=True)
    (loss, _), grads = grad_fn(model, images, labels, rngs.fork())
    optimizer.update(model, grads)

    return loss


# --- docs_nnx/guides/bridge_guide.md --------------------------------------------------------------


class LinenDot(nn.Module):
    out_dim: int
    w_init: Callable[..., Any] = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):
        # Linen might need the input shape to create the weight!
        w = self.param("w", self.w_init, (x.shape[-1], self.out_dim))
        return x @ w


class NNXOuter(nnx.Module):
    def __init__(self, out_dim: int, rngs: nnx.Rngs):
        self.dot = nnx.bridge.ToNNX(LinenDot(out_dim), rngs=rngs)
        self.b = nnx.Param(jax.random.uniform(rngs.params(), (1, out_dim)))

    def __call__(self, x):
        return self.dot(x) + self.b


class NNXDot(nnx.Module):
    def __init__(self, in_dim: int, out_dim: int, rngs: nnx.Rngs):
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (in_dim, out_dim)))

    def __call__(self, x: jax.Array):
        return x @ self.w


class NNXAddConstant(nnx.Module):
    def __init__(self):
        self.constant = nnx.Variable(jnp.array(1))

    def __call__(self, x):
        return x + self.constant


class LinenOuter(nn.Module):
    out_dim: int

    @nn.compact
    def __call__(self, x):
        dot = bridge.to_linen(NNXDot, x.shape[-1], self.out_dim)
        b = self.param("b", nn.initializers.lecun_normal(), (1, self.out_dim))
        return dot(x) + b


# --- docs_nnx/guides/transforms.md ---------------------------------------------------------------


class Weights(nnx.Module):
    def __init__(self, kernel: jax.Array, bias: jax.Array):
        self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias)


def vector_dot(weights: Weights, x: jax.Array):
    assert weights.kernel.ndim == 2, "Batch dimensions not allowed"
    assert x.ndim == 1, "Batch dimensions not allowed"
    return x @ weights.kernel + weights.bias


class CountedWeights(nnx.Module):
    def __init__(self, kernel: jax.Array, bias: jax.Array, count: jax.Array):
        self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias)
        self.count = Count(count)


def stateful_vector_dot(weights: CountedWeights, x: jax.Array):
    assert weights.kernel.ndim == 2, "Batch dimensions not allowed"
    assert x.ndim == 1, "Batch dimensions not allowed"
    weights.count[...] += 1
    return x @ weights.kernel + weights.bias


class NoisyWeights(nnx.Module):
    def __init__(self, kernel, bias, count, seed):
        self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias)
        self.count = Count(count)
        self.rngs = nnx.Rngs(noise=seed)


def noisy_vector_dot(weights: NoisyWeights, x: jax.Array):
    assert weights.kernel.ndim == 2, "Batch dimensions not allowed"
    assert x.ndim == 1, "Batch dimensions not allowed"
    weights.count[...] += 1
    y = x @ weights.kernel + weights.bias
    return y + jax.random.normal(weights.rngs.noise(), y.shape)


# --- docs_nnx/examples/digits_diffusion_model.md -----------------------------------------------


class UNet(nnx.Module):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        features: int,
        time_emb_dim: int = 128,
        *,
        rngs: nnx.Rngs,
    ):
        """
        Initialize the U-Net architecture with time embedding.
        """
        self.features = features

        # Time embedding layers for diffusion timestep conditioning.
        self.time_mlp = nnx.Sequential(
            nnx.Linear(in_features=time_emb_dim, out_features=time_emb_dim, rngs=rngs),
            nnx.gelu,
            nnx.Linear(in_features=time_emb_dim, out_features=time_emb_dim, rngs=rngs),
        )

        # Time projection layers for different scales.
        self.time_proj = nnx.List(
            [
                nnx.Linear(in_features=time_emb_dim, out_features=features, rngs=rngs),
                nnx.Linear(in_features=time_emb_dim, out_features=features * 2, rngs=rngs),
                nnx.Linear(in_features=time_emb_dim, out_features=features * 4, rngs=rngs),
                nnx.Linear(in_features=time_emb_dim, out_features=features * 8, rngs=rngs),
            ]
        )

        # The encoder path.
        self.down_convs = nnx.List(
            [
                ResBlock(in_channels, features, rngs),
                ResBlock(features, features * 2, rngs),
                ResBlock(features * 2, features * 4, rngs),
                ResBlock(features * 4, features * 8, rngs),
            ]
        )

        # Multi-head self-attention blocks.
        self.attention1 = nnx.MultiHeadAttention(
            num_heads=1, in_features=features * 4, decode=False, rngs=rngs
        )
        self.attention2 = nnx.MultiHeadAttention(
            num_heads=1, in_features=features * 8, decode=False, rngs=rngs
        )

        # The bridge connecting the encoder and the decoder.
        self.bridge_down = ResBlock(features * 8, features * 16, rngs)
        self.bridge_attention = nnx.MultiHeadAttention(
            num_heads=1, in_features=features * 16, decode=False, rngs=rngs
        )
        self.bridge_up = ResBlock(features * 16, features * 16, rngs)

        # Decoder path with skip connections.
        self.up_convs = nnx.List(
            [
                ResBlock(features * 24, features * 8, rngs),
                ResBlock(features * 12, features * 4, rngs),
                ResBlock(features * 6, features * 2, rngs),
                ResBlock(features * 3, features, rngs),
            ]
        )

        # Output layers.
        self.final_norm = nnx.LayerNorm(features, rngs=rngs)
        self.final_conv = nnx.Conv(
            in_features=features,
            out_features=out_channels,
            kernel_size=(3, 3),
            strides=(1, 1),
            padding=((1, 1), (1, 1)),
            rngs=rngs,
        )

    def _apply_attention(self, attn: nnx.MultiHeadAttention, x: jax.Array) -> jax.Array:
        B, H, W, C = x.shape
        # Flatten spatial dimensions, apply attention, then restore the spatial shape.
        out = attn(x.reshape(B, H * W, C)).reshape(B, H, W, C)
        return x + out  # A ResNet-style residual connection.

    def _pos_encoding(self, t: jax.Array, dim: int) -> jax.Array:
        """Applies sinusoidal positional encoding for time embedding.

        Args:
            t (jax.Array): The time embedding, representing the timestep.
            dim (int): The dimension of the output positional encoding.

        Returns:
            jax.Array: The sinusoidal positional embedding per timestep.

        """
        # Calculate half the embedding dimension.
        half_dim = dim // 2
        # Compute the logarithmic scaling factor for sinusoidal frequencies.
        emb = jnp.log(10000.0) / (half_dim - 1)
        # Generate a range of sinusoidal frequencies.
        emb = jnp.exp(jnp.arange(half_dim) * -emb)
        # Create the positional encoding by multiplying time embeddings with.
        emb = (1000 * t[:, None]) * emb[None, :]

        # Concatenate sine and cosine components for richer representation.
        emb = jnp.concatenate([jnp.sin(emb), jnp.cos(emb)], axis=1)
        return emb

    def _downsample(self, x: jax.Array) -> jax.Array:
        """Downsamples the input feature map with max pooling."""
        return nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2), padding="SAME")

    def _upsample(self, x: jax.Array, target_size: int) -> jax.Array:
        """Upsamples the input feature map using nearest neighbor interpolation."""
        return jax.image.resize(
            x, (x.shape[0], target_size, target_size, x.shape[3]), method="nearest"
        )

    def __call__(self, x: jax.Array, t: jax.Array) -> jax.Array:
        """Perform the forward pass through the U-Net using time embeddings."""

        # Time embedding and projection.
        t_emb = self.time_mlp(
            self._pos_encoding(t, 128)
        )  # Sinusoidal positional encoding for time.

        # The encoder path with time injection.
        t_embs = [proj(t_emb)[:, None, None, :] for proj in self.time_proj]
        attns = [None, None, self.attention1, self.attention2]

        ds = []
        for conv, t_e, attn in zip(self.down_convs, t_embs, attns):  # noqa: B905 - as written
            inp = self._downsample(ds[-1]) if ds else x
            d = conv(inp)
            if attn is not None:
                d = self._apply_attention(attn, d)  # Apply self-attention.
            d = d + jnp.broadcast_to(t_e, d.shape)  # Add the time embedding to the feature map.
            ds.append(d)

        # The bridge.
        b = self._downsample(ds[-1])
        b = self.bridge_down(b)
        b = self._apply_attention(self.bridge_attention, b)
        b = self.bridge_up(b)

        # The decoder path with skip connections.
        u = b
        for conv, skip in zip(self.up_convs, reversed(ds)):  # noqa: B905 - as written
            u = conv(jnp.concatenate([self._upsample(u, skip.shape[1]), skip], axis=-1))

        # Final layers.
        x = self.final_norm(u)
        x = nnx.gelu(x)
        return self.final_conv(x)


class ResBlock(nnx.Module):
    def __init__(self, in_channels: int, out_channels: int, rngs: nnx.Rngs):
        # Convolutional layers with layer normalization.
        self.conv1 = nnx.Conv(
            in_features=in_channels,
            out_features=out_channels,
            kernel_size=(3, 3),
            strides=(1, 1),
            padding=((1, 1), (1, 1)),
            rngs=rngs,
        )
        self.norm1 = nnx.LayerNorm(out_channels, rngs=rngs)
        self.conv2 = nnx.Conv(
            in_features=out_channels,
            out_features=out_channels,
            kernel_size=(3, 3),
            strides=(1, 1),
            padding=((1, 1), (1, 1)),
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(out_channels, rngs=rngs)

        # Projection shortcut if dimensions change.
        self.shortcut = nnx.Conv(
            in_features=in_channels,
            out_features=out_channels,
            kernel_size=(1, 1),
            strides=(1, 1),
            rngs=rngs,
        )

    def __call__(self, x):
        identity = self.shortcut(x)
        x = nnx.gelu(self.norm1(self.conv1(x)))
        x = nnx.gelu(self.norm2(self.conv2(x)))
        return x + identity


def loss_fn(model, x1, rngs):
    batch_size = x1.shape[0]
    u = rngs.normal((batch_size,))
    t = jax.nn.sigmoid(u)  # Logit-normal time sampling (SD3/Flux).
    t_full = t[:, None, None, None]
    x0 = rngs.normal(x1.shape)
    xt = (1 - t_full) * x0 + t_full * x1
    return jnp.mean((model(xt, t) - (x1 - x0)) ** 2)


@nnx.jit
def diffusion_train_step(model, data, rngs, optimizer):  # the example's train_step
    loss, grads = nnx.value_and_grad(loss_fn)(model, data, rngs)
    optimizer.update(grads)
    return loss
