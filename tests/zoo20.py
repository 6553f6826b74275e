"""Code we did not write, round twenty: Flax NNX's larger examples, as their authors wrote
them (sizes cut by the tests), for tests/test_authors_round20.py.

google/flax at 18f8f311c275d57f46d95e41b15aa97b454754c0:

- docs_nnx/examples/image_segmentation.md: ``ShardingConfig``, ``ViTConfig``,
  ``PatchEmbedding``, ``MLPBlock``, ``ViTEncoderBlock``, ``ViT``, ``Conv2dNormActivation``,
  ``InstanceNorm``, ``UnetResBlock``, ``UnetrBasicBlock``, ``UnetrPrUpBlock``,
  ``UnetrUpBlock``, ``ModelConfig`` and ``UNETR``; ``compute_softmax_jaccard_loss``,
  ``compute_losses_and_logits`` and ``train_step`` (renamed ``unetr_train_step``; nnx.jit
  with the model and optimizer donated). Left out: the Oxford Pets data, its augmentations,
  the ViT demo at 224 x 224, the confusion-matrix metric and the training loop. The
  authors' quirks kept: ``UnetrBasicBlock`` builds its ``UnetResBlock`` without the
  ``rngs`` it is given (from the shared default ``nnx.Rngs(0)``, so that two UNETRs built
  alike differ there), ``MLPBlock``'s dropout draws from the ``rngs`` it was built with.
"""

# ruff: noqa: B008, RUF005, RUF009, RUF059 - as the authors wrote it

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

# --- docs_nnx/examples/image_segmentation.md ---------------------------------------------------


@dataclass(slots=True, frozen=True)
class ShardingConfig:
    attn_qkvo_weight_ndh: P | None = None  # sharding for Q, K, V, Out weights
    mlp_weight_df: P | None = None
    mlp_weight_fd: P | None = None
    act_btd: P | None = None  # sharding of the activation (B, T, D)
    act_btf: P | None = None
    act_btnh: P | None = None

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
            fsdp_axis_name=fsdp_axis_name,
        )


@dataclass(slots=True, frozen=True)
class ViTConfig:
    in_channels: int = 3
    img_size: int = 224
    patch_size: int = 16
    num_layers: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    hidden_size: int = 768
    dropout_rate: float = 0.1
    sharding: ShardingConfig = ShardingConfig.no_sharding()


class PatchEmbedding(nnx.Module):
    def __init__(
        self,
        in_channels: int,  # dimension of input channels.
        img_size: int,  # dimension of input image.
        patch_size: int,  # dimension of patch size.
        hidden_size: int,  # dimension of hidden layer.
        dropout_rate: float = 0.0,
        *,
        rngs: nnx.Rngs = nnx.Rngs(0),
    ):
        n_patches = (img_size // patch_size) ** 2
        self.patch_embeddings = nnx.Conv(
            in_channels,
            hidden_size,
            kernel_size=(patch_size, patch_size),
            strides=(patch_size, patch_size),
            padding="VALID",
            use_bias=True,
            rngs=rngs,
        )

        initializer = jax.nn.initializers.truncated_normal(stddev=0.02)
        self.position_embeddings = nnx.Param(
            initializer(rngs.params(), (1, n_patches, hidden_size), jnp.float32)
        )
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        rngs: nnx.Rngs | None = None,
        out_sharding: P | None = None,
    ) -> jax.Array:
        x = self.patch_embeddings(x, out_sharding=out_sharding)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        embeddings = x + self.position_embeddings
        embeddings = self.dropout(embeddings, rngs=rngs)
        return embeddings


class MLPBlock(nnx.Module):
    def __init__(
        self,
        hidden_size: int,  # dimension of hidden layer.
        mlp_dim: int,  # dimension of feedforward layer
        dropout_rate: float = 0.0,
        activation_layer: Callable = nnx.gelu,
        *,
        rngs: nnx.Rngs = nnx.Rngs(0),
        up_proj_sharding: P | None = None,
        down_proj_sharding: P | None = None,
    ):
        self.up_proj = nnx.Linear(
            hidden_size,
            mlp_dim,
            rngs=rngs,
            kernel_metadata={"out_sharding": up_proj_sharding},
        )
        self.act = activation_layer
        self.drop = nnx.Dropout(dropout_rate, rngs=rngs)
        self.down_proj = nnx.Linear(
            mlp_dim,
            hidden_size,
            rngs=rngs,
            kernel_metadata={"out_sharding": down_proj_sharding},
        )

    def __call__(
        self,
        x: jax.Array,
        rngs: nnx.Rngs | None = None,
        up_proj_out_sharding: P | None = None,
        out_sharding: P | None = None,
    ) -> jax.Array:
        x = self.up_proj(x, out_sharding=up_proj_out_sharding)
        x = self.act(x)
        x = self.drop(x)
        x = self.down_proj(x, out_sharding=out_sharding)
        return self.drop(x)


class ViTEncoderBlock(nnx.Module):
    def __init__(
        self,
        hidden_size: int,  # dimension of hidden layer.
        mlp_dim: int,  # dimension of feedforward layer.
        num_heads: int,  # number of attention heads
        dropout_rate: float = 0.0,
        *,
        rngs: nnx.Rngs = nnx.Rngs(0),
        sharding: ShardingConfig = ShardingConfig(),
    ) -> None:
        self.mlp = MLPBlock(
            hidden_size,
            mlp_dim,
            dropout_rate,
            rngs=rngs,
            up_proj_sharding=sharding.mlp_weight_df,
            down_proj_sharding=sharding.mlp_weight_fd,
        )
        self.norm1 = nnx.LayerNorm(hidden_size, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=num_heads,
            in_features=hidden_size,
            dropout_rate=dropout_rate,
            broadcast_dropout=False,
            decode=False,
            deterministic=False,
            rngs=rngs,
            keep_rngs=False,
            kernel_metadata={"out_sharding": sharding.attn_qkvo_weight_ndh},
            out_kernel_metadata={"out_sharding": sharding.attn_qkvo_weight_ndh},
        )
        self.norm2 = nnx.LayerNorm(hidden_size, rngs=rngs)
        self.sharding = sharding

    def __call__(
        self,
        x: jax.Array,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        x = x + self.attn(
            self.norm1(x),
            rngs=rngs,
            out_sharding=self.sharding.act_btd,
            qkv_sharding=self.sharding.act_btnh,
        )
        x = x + self.mlp(
            self.norm2(x),
            rngs=rngs,
            out_sharding=self.sharding.act_btd,
            up_proj_out_sharding=self.sharding.act_btf,
        )
        return x


class ViT(nnx.Module):
    def __init__(
        self,
        config,
        *,
        rngs: nnx.Rngs = nnx.Rngs(0),
    ):
        if config.hidden_size % config.num_heads != 0:
            raise ValueError("hidden_size should be divisible by num_heads.")

        self.config = config
        self.patch_embedding = PatchEmbedding(
            in_channels=config.in_channels,
            img_size=config.img_size,
            patch_size=config.patch_size,
            hidden_size=config.hidden_size,
            dropout_rate=config.dropout_rate,
            rngs=rngs,
        )
        self.blocks = nnx.List(
            [
                ViTEncoderBlock(
                    config.hidden_size,
                    config.mlp_dim,
                    config.num_heads,
                    config.dropout_rate,
                    rngs=rngs,
                    sharding=config.sharding,
                )
                for i in range(config.num_layers)
            ]
        )
        self.norm = nnx.LayerNorm(config.hidden_size, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        x = self.patch_embedding(
            x,
            rngs=rngs,
            out_sharding=self.config.sharding.act_btd,
        )
        hidden_states_out = []
        for blk in self.blocks:
            x = blk(x, rngs=rngs)
            hidden_states_out.append(x)
        x = self.norm(x)
        return x, hidden_states_out


class Conv2dNormActivation(nnx.Sequential):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        padding: int | None = None,
        groups: int = 1,
        norm_layer: Callable[..., nnx.Module] = nnx.BatchNorm,
        activation_layer: Callable = nnx.relu,
        dilation: int = 1,
        bias: bool | None = None,
        rngs: nnx.Rngs = nnx.Rngs(0),
    ):
        self.out_channels = out_channels

        if padding is None:
            padding = (kernel_size - 1) // 2 * dilation
        if bias is None:
            bias = norm_layer is None

        # sequence integer pairs that give the padding to apply before
        # and after each spatial dimension
        padding = ((padding, padding), (padding, padding))

        layers = [
            nnx.Conv(
                in_channels,
                out_channels,
                kernel_size=(kernel_size, kernel_size),
                strides=(stride, stride),
                padding=padding,
                kernel_dilation=(dilation, dilation),
                feature_group_count=groups,
                use_bias=bias,
                rngs=rngs,
            )
        ]

        if norm_layer is not None:
            layers.append(norm_layer(out_channels, rngs=rngs))

        if activation_layer is not None:
            layers.append(activation_layer)

        super().__init__(*layers)


class InstanceNorm(nnx.GroupNorm):
    def __init__(self, num_features, **kwargs):
        num_groups, group_size = num_features, None
        super().__init__(
            num_features,
            num_groups=num_groups,
            group_size=group_size,
            **kwargs,
        )


class UnetResBlock(nnx.Module):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int,
        norm_layer: Callable[..., nnx.Module] = InstanceNorm,
        activation_layer: Callable = nnx.leaky_relu,
        *,
        rngs: nnx.Rngs = nnx.Rngs(0),
    ):
        self.conv_norm_act1 = Conv2dNormActivation(
            in_channels=in_channels,
            out_channels=out_channels,
            kernel_size=kernel_size,
            stride=stride,
            norm_layer=norm_layer,
            activation_layer=activation_layer,
            rngs=rngs,
        )
        self.conv_norm2 = Conv2dNormActivation(
            in_channels=out_channels,
            out_channels=out_channels,
            kernel_size=kernel_size,
            stride=1,
            norm_layer=norm_layer,
            activation_layer=None,
            rngs=rngs,
        )

        self.downsample = (in_channels != out_channels) or (stride != 1)
        if self.downsample:
            self.conv_norm3 = Conv2dNormActivation(
                in_channels=in_channels,
                out_channels=out_channels,
                kernel_size=1,
                stride=stride,
                norm_layer=norm_layer,
                activation_layer=None,
                rngs=rngs,
            )
        self.act = activation_layer

    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        out = self.conv_norm_act1(x)
        out = self.conv_norm2(out)
        if self.downsample:
            residual = self.conv_norm3(residual)
        out += residual
        out = self.act(out)
        return out


class UnetrBasicBlock(nnx.Module):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int,
        norm_layer: Callable[..., nnx.Module] = InstanceNorm,
        *,
        rngs: nnx.Rngs = nnx.Rngs(0),
    ):
        self.layer = UnetResBlock(
            in_channels=in_channels,
            out_channels=out_channels,
            kernel_size=kernel_size,
            stride=stride,
            norm_layer=norm_layer,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layer(x)


class UnetrPrUpBlock(nnx.Module):
    def __init__(
        self,
        in_channels: int,  # number of input channels.
        out_channels: int,  # number of output channels.
        num_layer: int,  # number of upsampling blocks.
        kernel_size: int,
        stride: int,
        upsample_kernel_size: int = 2,  # convolution kernel size for transposed convolution layers.
        norm_layer: Callable[..., nnx.Module] = InstanceNorm,
        *,
        rngs: nnx.Rngs = nnx.Rngs(0),
    ):
        upsample_stride = upsample_kernel_size
        self.transp_conv_init = nnx.ConvTranspose(
            in_features=in_channels,
            out_features=out_channels,
            kernel_size=(upsample_kernel_size, upsample_kernel_size),
            strides=(upsample_stride, upsample_stride),
            padding="VALID",
            rngs=rngs,
        )
        self.blocks = nnx.List(
            [
                nnx.Sequential(
                    nnx.ConvTranspose(
                        in_features=out_channels,
                        out_features=out_channels,
                        kernel_size=(upsample_kernel_size, upsample_kernel_size),
                        strides=(upsample_stride, upsample_stride),
                        rngs=rngs,
                    ),
                    UnetResBlock(
                        in_channels=out_channels,
                        out_channels=out_channels,
                        kernel_size=kernel_size,
                        stride=stride,
                        norm_layer=norm_layer,
                        rngs=rngs,
                    ),
                )
                for i in range(num_layer)
            ]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.transp_conv_init(x)
        for blk in self.blocks:
            x = blk(x)
        return x


class UnetrUpBlock(nnx.Module):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        upsample_kernel_size: int = 2,  # convolution kernel size for transposed convolution layers.
        norm_layer: Callable[..., nnx.Module] = InstanceNorm,
        *,
        rngs: nnx.Rngs = nnx.Rngs(0),
    ) -> None:
        upsample_stride = upsample_kernel_size
        self.transp_conv = nnx.ConvTranspose(
            in_features=in_channels,
            out_features=out_channels,
            kernel_size=(upsample_kernel_size, upsample_kernel_size),
            strides=(upsample_stride, upsample_stride),
            padding="VALID",
            rngs=rngs,
        )
        self.conv_block = UnetResBlock(
            out_channels + out_channels,
            out_channels,
            kernel_size=kernel_size,
            stride=1,
            norm_layer=norm_layer,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array, skip: jax.Array) -> jax.Array:
        out = self.transp_conv(x)
        out = jnp.concat((out, skip), axis=-1)
        out = self.conv_block(out)
        return out


@dataclass(slots=True, frozen=True)
class ModelConfig:
    out_channels: int
    vit_config: ViTConfig
    feature_size: int = 16
    norm_layer: Callable[..., nnx.Module] = InstanceNorm


class UNETR(nnx.Module):
    """UNETR model ported to NNX from MONAI implementation:
    - https://github.com/Project-MONAI/MONAI/blob/dev/monai/networks/nets/unetr.py
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs = nnx.Rngs(0),
    ):
        self.config = config
        vit_config = config.vit_config
        feat_size = vit_config.img_size // vit_config.patch_size

        self.vit = ViT(
            config=config.vit_config,
            rngs=rngs,
        )
        self.encoder1 = UnetrBasicBlock(
            in_channels=vit_config.in_channels,
            out_channels=config.feature_size,
            kernel_size=3,
            stride=1,
            norm_layer=config.norm_layer,
            rngs=rngs,
        )
        self.encoder2 = UnetrPrUpBlock(
            in_channels=vit_config.hidden_size,
            out_channels=config.feature_size * 2,
            num_layer=2,
            kernel_size=3,
            stride=1,
            upsample_kernel_size=2,
            norm_layer=config.norm_layer,
            rngs=rngs,
        )
        self.encoder3 = UnetrPrUpBlock(
            in_channels=vit_config.hidden_size,
            out_channels=config.feature_size * 4,
            num_layer=1,
            kernel_size=3,
            stride=1,
            upsample_kernel_size=2,
            norm_layer=config.norm_layer,
            rngs=rngs,
        )
        self.encoder4 = UnetrPrUpBlock(
            in_channels=vit_config.hidden_size,
            out_channels=config.feature_size * 8,
            num_layer=0,
            kernel_size=3,
            stride=1,
            upsample_kernel_size=2,
            norm_layer=config.norm_layer,
            rngs=rngs,
        )
        self.decoder5 = UnetrUpBlock(
            in_channels=vit_config.hidden_size,
            out_channels=config.feature_size * 8,
            kernel_size=3,
            upsample_kernel_size=2,
            norm_layer=config.norm_layer,
            rngs=rngs,
        )
        self.decoder4 = UnetrUpBlock(
            in_channels=config.feature_size * 8,
            out_channels=config.feature_size * 4,
            kernel_size=3,
            upsample_kernel_size=2,
            norm_layer=config.norm_layer,
            rngs=rngs,
        )
        self.decoder3 = UnetrUpBlock(
            in_channels=config.feature_size * 4,
            out_channels=config.feature_size * 2,
            kernel_size=3,
            upsample_kernel_size=2,
            norm_layer=config.norm_layer,
            rngs=rngs,
        )
        self.decoder2 = UnetrUpBlock(
            in_channels=config.feature_size * 2,
            out_channels=config.feature_size,
            kernel_size=3,
            upsample_kernel_size=2,
            norm_layer=config.norm_layer,
            rngs=rngs,
        )

        self.out = nnx.Conv(
            in_features=config.feature_size,
            out_features=config.out_channels,
            kernel_size=(1, 1),
            strides=(1, 1),
            padding="VALID",
            use_bias=True,
            rngs=rngs,
        )

        self.proj_axes = (0, 1, 2, 3)
        self.proj_view_shape = [feat_size, feat_size, vit_config.hidden_size]

    def proj_feat(self, x: jax.Array) -> jax.Array:
        new_view = [x.shape[0]] + self.proj_view_shape
        x = x.reshape(new_view)
        x = jnp.permute_dims(x, self.proj_axes)
        return x

    def __call__(
        self,
        x_in: jax.Array,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        x, hidden_states_out = self.vit(x_in, rngs=rngs)
        enc1 = self.encoder1(x_in)
        x2 = hidden_states_out[3]
        enc2 = self.encoder2(self.proj_feat(x2))
        x3 = hidden_states_out[6]
        enc3 = self.encoder3(self.proj_feat(x3))
        x4 = hidden_states_out[9]
        enc4 = self.encoder4(self.proj_feat(x4))
        dec4 = self.proj_feat(x)
        dec3 = self.decoder5(dec4, enc4)
        dec2 = self.decoder4(dec3, enc3)
        dec1 = self.decoder3(dec2, enc2)
        out = self.decoder2(dec1, enc1)
        return self.out(out)


def compute_softmax_jaccard_loss(logits, masks, reduction="mean"):
    assert reduction in ("mean", "sum")
    y_pred = nnx.softmax(logits, axis=-1)
    b, c = y_pred.shape[0], y_pred.shape[-1]
    y = nnx.one_hot(masks, num_classes=c, axis=-1)

    y_pred = y_pred.reshape((b, -1, c))
    y = y.reshape((b, -1, c))

    intersection = y_pred * y
    union = y_pred + y - intersection + 1e-8

    intersection = jnp.sum(intersection, axis=1)
    union = jnp.sum(union, axis=1)

    if reduction == "mean":
        intersection = jnp.mean(intersection)
        union = jnp.mean(union)
    elif reduction == "sum":
        intersection = jnp.sum(intersection)
        union = jnp.sum(union)

    return 1.0 - intersection / union


def compute_losses_and_logits(
    model: nnx.Module,
    images: jax.Array,
    masks: jax.Array,
    rngs: nnx.Rngs | None = None,
):
    logits = model(images, rngs=rngs)
    xentropy_loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=masks
    ).mean()
    jacc_loss = compute_softmax_jaccard_loss(logits=logits, masks=masks)
    loss = xentropy_loss + jacc_loss
    return loss, (xentropy_loss, jacc_loss, logits)


@nnx.jit(donate_argnames=("model", "optimizer"))
def unetr_train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    rngs: nnx.Rngs,
    batch: tuple[jax.Array, jax.Array],
):
    images, masks = batch
    grad_fn = nnx.value_and_grad(compute_losses_and_logits, has_aux=True)
    (loss, (xentropy_loss, jacc_loss, logits)), grads = grad_fn(model, images, masks, rngs.fork())
    optimizer.update(model, grads)  # In-place updates.

    return loss, xentropy_loss, jacc_loss
