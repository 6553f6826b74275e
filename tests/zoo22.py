"""Code we did not write, round twenty-two: google-research/scenic's DETR and TokenLearner, as
their authors wrote them (sizes cut by the tests), for tests/test_authors_round22.py.

google-research/scenic at 4a38d475ee89cb821078c0e2bf2065ee030e1535 (not installed: its
``setup.py`` pulls TensorFlow and its datasets; the model files copied, with the small
helpers of scenic's own that they import, each under its file's heading):

- scenic/model_lib/layers/nn_layers.py: ``IdentityLayer``, ``StochasticDepth``;
- scenic/model_lib/layers/attention_layers.py: ``_attention_dropout``,
  ``dot_product_attention`` (its ``capture_attention_weights`` tag), ``MlpBlock``;
- scenic/projects/baselines/resnet.py: ``ResidualBlock``, ``ResNet``, ``BLOCK_SIZE_OPTIONS``
  (DETR's backbone, whole: the tests pick its smallest of four stages, ``num_layers=9``);
- scenic/projects/baselines/vit.py: ``AddPositionEmbs``, ``Encoder1DBlock``;
- scenic/projects/baselines/detr/model.py: every module up to ``DETR`` (its
  ``QueryPosEmbedding``, sine and learned input embeddings, ``MultiHeadDotProductAttention``,
  encoder and decoder blocks, ``DETRTransformer``, the box and class heads); left out: the
  ``DETRModel`` wrapper (scenic's ``ObjectDetectionWithMatchingModel``, its Hungarian
  matching loss and config plumbing);
- scenic/projects/token_learner/model.py: ``TokenLearnerModule``, ``TokenLearnerModuleV11``,
  ``TokenFuser``, ``EncoderMod``, ``EncoderModFuser``, ``TokenLearnerViT``; left out: the
  representation variant, the classification-model wrappers and checkpoint loading, and the
  video tokenizer's ``vivit_model.temporal_encode`` (its branch kept, never taken here).

The modules scenic's files import by name (``nn_layers``, ``attention_layers``, ``resnet``,
``vit``) are namespaces of the copies here, bound after each file's heading: DETR's own
``MlpBlock`` and attention keep their names as in its file.
"""

# ruff: noqa: F821, UP006, UP007, UP035, UP045, RUF005, SIM114, UP031, B905 - the authors' code, as written

import functools
import math
from types import SimpleNamespace
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.nn import initializers

# --- scenic/model_lib/layers/nn_layers.py ------------------------------------------------------


class IdentityLayer(nn.Module):
    """Identity layer, convenient for giving a name to an array."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return x


class StochasticDepth(nn.Module):
    """Performs layer-dropout (also known as stochastic depth).

    Described in
    Huang & Sun et al, "Deep Networks with Stochastic Depth", 2016
    https://arxiv.org/abs/1603.09382

    Attributes:
      rate: the layer dropout probability (_not_ the keep rate!).
      deterministic: If false (e.g. in training) the inputs are scaled by `1 / (1
        - rate)` and the layer dropout is applied, whereas if true (e.g. in
        evaluation), no stochastic depth is applied and the inputs are returned as
        is.
    """

    rate: float = 0.0
    deterministic: Optional[bool] = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: Optional[bool] = None) -> jnp.ndarray:
        """Applies a stochastic depth mask to the inputs.

        Args:
          x: Input tensor.
          deterministic: If false (e.g. in training) the inputs are scaled by `1 /
            (1 - rate)` and the layer dropout is applied, whereas if true (e.g. in
            evaluation), no stochastic depth is applied and the inputs are returned
            as is.

        Returns:
          The masked inputs reweighted to preserve mean.
        """
        broadcast_dims = range(1, x.ndim)
        return nn.Dropout(rate=self.rate, broadcast_dims=broadcast_dims)(x, deterministic)


# scenic's module, as its importers name it
nn_layers = SimpleNamespace(IdentityLayer=IdentityLayer, StochasticDepth=StochasticDepth)


# --- scenic/model_lib/layers/attention_layers.py -----------------------------------------------


# TODO(mrit): Upstream this to jax.nn.initializers
# Inputs are PRNGKey, input shape and dtype.
Initializer = Callable[[jnp.ndarray, Sequence[int], jnp.dtype], jnp.ndarray]
Shape = Sequence[int]


def _attention_dropout(
    attn_weights: jnp.ndarray, *, rate: float, broadcast: bool = True, dropout_rng: jnp.ndarray
) -> jnp.ndarray:
    """Applies dropout on attention weights.

    This always applies the dropout. There is no `deterministic` parameter.

    Arguments:
      attn_weights: Attention weights.
      rate: The dropout rate. (_not_ the keep rate!)
      broadcast: Whether to broadcast on first and second last axis.
      dropout_rng: RNG.

    Returns:
      Weights after dropout.
    """
    keep_prob = 1.0 - rate
    if broadcast:
        # Dropout is broadcast across the batch+head+non-attention dimension.
        dropout_shape = list(attn_weights.shape)
        dropout_shape[0] = 1  # Broadcast batch.
        dropout_shape[-2] = 1  # Broadcast heads.
        keep = jax.random.bernoulli(dropout_rng, keep_prob, dropout_shape)
    else:
        keep = jax.random.bernoulli(dropout_rng, keep_prob, attn_weights.shape)
    multiplier = keep.astype(attn_weights.dtype) / jnp.asarray(keep_prob, dtype=attn_weights.dtype)
    return attn_weights * multiplier


def dot_product_attention(
    query: jnp.ndarray,
    key: jnp.ndarray,
    value: jnp.ndarray,
    *,
    bias: Optional[jnp.ndarray] = None,
    bias_kv: Optional[jnp.ndarray] = None,
    broadcast_dropout: bool = True,
    dropout_rate: float = 0.1,
    dtype: jnp.dtype = jnp.float32,
    precision: Optional[jax.lax.Precision] = None,
    deterministic: bool,
    dropout_rng: Optional[jnp.ndarray] = None,
    capture_attention_weights: bool = True,
) -> jnp.ndarray:
    """Computes the dot-product attention given query, key and value.

    This is the core function for applying attention based on
    https://arxiv.org/abs/1706.03762. It calculates the attention weights given
    query and key and combines the values using the attention weights.

    Note: query, key, value needn't have any batch dimensions.

    Args:
      query: Queries for calculating attention with shape of `[batch..., q_length,
        num_heads, qk_depth_per_head]`.
      key: Keys for calculating attention with shape of `[batch..., kv_length,
        num_heads, qk_depth_per_head]`.
      value: Values to be used in attention with shape of `[batch..., kv_length,
        num_heads, v_depth_per_head]`.
      bias: Bias for the attention weights. This should be
        broadcastable to the shape: `[batch..., num_heads, q_length, kv_length]`
          This can be used for incorporating causal masks, padding masks,
          proximity bias, etc.
      bias_kv: Attention bias defined for keys only which has shape
        `[batch..., kv_length]`. Can be used for masking elements in k/v.
      broadcast_dropout: Use a broadcasted dropout along batch dims.
      dropout_rate: Dropout rate.
      dtype: The dtype of the computation (default: float32).
      precision: Numerical precision of the computation see `jax.lax.Precision`
        for details.
      deterministic: Deterministic or not (to apply dropout).
      dropout_rng: Optional JAX PRNGKey to be used for dropout.
      capture_attention_weights: Whether to add an identity layer to tag the
        attention weights to be used for capturing them using Flax
        capture_intermediate, e.g. for visualization. Note that if this is set to
        True, this function can be only called within a Flax module.

    Returns:
      Output of shape `[batch..., length, num_heads, v_depth_per_head]`.
    """
    assert key.ndim == query.ndim == value.ndim, "q, k, v must have same rank."
    assert query.shape[:-3] == key.shape[:-3] == value.shape[:-3], "q, k, v batch dims must match."
    assert query.shape[-2] == key.shape[-2] == value.shape[-2], "q, k, v num_heads must match."
    assert key.shape[-3] == value.shape[-3], "k, v lengths must match."
    assert query.shape[-1] == key.shape[-1], "q, k depths must match."

    # Calculate attention matrix.
    depth = query.shape[-1]
    query = query / jnp.sqrt(depth).astype(dtype)
    # attn weight shape is (batch..., num_heads, q_length, kv_length)
    attn_weights = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)

    # Apply attention bias: masking, dropout, proximity bias, etc.
    if bias is not None:
        attn_weights = attn_weights + bias
    if bias_kv is not None:
        bias_kv = bias_kv[..., jnp.newaxis, jnp.newaxis, :]
        attn_weights += bias_kv

    # Normalize the attention weights.
    attn_weights = jax.nn.softmax(attn_weights).astype(dtype)

    if capture_attention_weights:
        # Tag the intermediate weights for logging/visualization.
        attn_weights = nn_layers.IdentityLayer(name="attn_weights")(attn_weights)

    # Apply attention dropout.
    if not deterministic and dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError("Did not provide `rng` to dot_product_attention().")
        attn_weights = _attention_dropout(
            attn_weights, rate=dropout_rate, broadcast=broadcast_dropout, dropout_rng=dropout_rng
        )

    # Return weighted sum over values for each query position.
    return jnp.einsum("...hqk,...khd->...qhd", attn_weights, value, precision=precision)


class MlpBlock(nn.Module):
    """Transformer MLP / feed-forward block."""

    mlp_dim: int
    out_dim: Optional[int] = None
    dropout_rate: float = 0.1
    use_bias: bool = True
    kernel_init: Initializer = nn.initializers.xavier_uniform()
    bias_init: Initializer = nn.initializers.normal(stddev=1e-6)
    activation_fn: Callable[[jnp.ndarray], jnp.ndarray] = nn.gelu
    precision: Optional[jax.lax.Precision] = None
    dtype: jnp.ndarray = jnp.float32

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, *, deterministic: bool):
        """Applies Transformer MlpBlock module."""
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(
            self.mlp_dim,
            dtype=self.dtype,
            use_bias=self.use_bias,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            precision=self.precision,
        )(inputs)
        x = nn_layers.IdentityLayer(name="mlp1")(self.activation_fn(x))
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
        output = nn.Dense(
            actual_out_dim,
            dtype=self.dtype,
            use_bias=self.use_bias,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            precision=self.precision,
        )(x)
        output = nn_layers.IdentityLayer(name="mlp2")(output)
        output = nn.Dropout(rate=self.dropout_rate)(output, deterministic=deterministic)
        return output


attention_layers = SimpleNamespace(dot_product_attention=dot_product_attention, MlpBlock=MlpBlock)


# --- scenic/projects/baselines/resnet.py -------------------------------------------------------


class ResidualBlock(nn.Module):
    """Bottleneck ResNet block."""

    filters: int
    strides: Tuple[int, int] = (1, 1)
    dtype: jnp.dtype = jnp.float32
    bottleneck: bool = True

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = True) -> jnp.ndarray:
        needs_projection = x.shape[-1] != self.filters * 4 or self.strides != (1, 1)
        nout = self.filters * 4 if self.bottleneck else self.filters

        batch_norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
        )
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)

        residual = x
        if needs_projection:
            residual = conv(nout, (1, 1), self.strides, name="proj_conv")(residual)
            residual = batch_norm(name="proj_bn")(residual)

        if self.bottleneck:
            x = conv(self.filters, (1, 1), name="conv1")(x)
            x = batch_norm(name="bn1")(x)
            x = nn_layers.IdentityLayer(name="relu1")(nn.relu(x))

        y = conv(self.filters, (3, 3), self.strides, padding=[(1, 1), (1, 1)], name="conv2")(x)
        y = batch_norm(name="bn2")(y)
        y = nn_layers.IdentityLayer(name="relu2")(nn.relu(y))

        if self.bottleneck:
            y = conv(nout, (1, 1), name="conv3")(y)
        else:
            y = conv(nout, (3, 3), padding=[(1, 1), (1, 1)], name="conv3")(y)
        y = batch_norm(name="bn3", scale_init=nn.initializers.zeros)(y)
        y = nn_layers.IdentityLayer(name="relu3")(nn.relu(residual + y))
        return y


class ResNet(nn.Module):
    """ResNet architecture.

    Attributes:
      num_outputs: Num output classes. If None, a dict of intermediate feature
        maps is returned.
      num_filters: Num filters.
      num_layers: Num layers.
      kernel_init: Kernel initialization.
      bias_init: Bias initialization.
      dtype: Data type, e.g. jnp.float32.
    """

    num_outputs: Optional[int]
    num_filters: int = 64
    num_layers: int = 50
    kernel_init: Callable[..., Any] = initializers.lecun_normal()
    bias_init: Callable[..., Any] = initializers.zeros
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self, x: jnp.ndarray, train: bool = False, debug: bool = False
    ) -> Union[jnp.ndarray, Dict[str, jnp.ndarray]]:
        """Applies ResNet model to the inputs.

        Args:
          x: Inputs to the model.
          train: Whether it is training or not.
          debug: Whether the debug mode is enabled. debug=True enables model
            specific logging/storing some values using jax.host_callback.

        Returns:
           Un-normalized logits.
        """
        if self.num_layers not in BLOCK_SIZE_OPTIONS:
            raise ValueError("Please provide a valid number of layers")
        block_sizes, bottleneck = BLOCK_SIZE_OPTIONS[self.num_layers]
        x = nn.Conv(
            self.num_filters,
            kernel_size=(7, 7),
            strides=(2, 2),
            padding=[(3, 3), (3, 3)],
            use_bias=False,
            dtype=self.dtype,
            name="stem_conv",
        )(x)
        x = nn.BatchNorm(
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            name="init_bn",
        )(x)
        x = nn_layers.IdentityLayer(name="init_relu")(nn.relu(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=[(1, 1), (1, 1)])
        x = nn_layers.IdentityLayer(name="stem_pool")(x)

        residual_block = functools.partial(ResidualBlock, dtype=self.dtype, bottleneck=bottleneck)
        representations = {"stem": x}
        for i, block_size in enumerate(block_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                filters = self.num_filters * 2**i
                x = residual_block(filters=filters, strides=strides)(x, train)
            representations[f"stage_{i + 1}"] = x

        # Head.
        if self.num_outputs:
            x = jnp.mean(x, axis=(1, 2))
            x = nn_layers.IdentityLayer(name="pre_logits")(x)
            x = nn.Dense(
                self.num_outputs,
                kernel_init=self.kernel_init,
                bias_init=self.bias_init,
                dtype=self.dtype,
                name="output_projection",
            )(x)
            return x
        else:
            return representations


# A dictionary mapping the number of layers in a resnet to the number of
# blocks in each stage of the model. The second argument indicates whether we
# use bottleneck layers or not.
BLOCK_SIZE_OPTIONS = {
    5: ([1], True),  # Only strided blocks. Total stride 4.
    8: ([1, 1], True),  # Only strided blocks. Total stride 8.
    11: ([1, 1, 1], True),  # Only strided blocks. Total stride 16.
    14: ([1, 1, 1, 1], True),  # Only strided blocks. Total stride 32.
    9: ([1, 1, 1, 1], False),  # Only strided blocks. Total stride 32.
    18: ([2, 2, 2, 2], False),
    26: ([2, 2, 2, 2], True),
    34: ([3, 4, 6, 3], False),
    50: ([3, 4, 6, 3], True),
    101: ([3, 4, 23, 3], True),
    152: ([3, 8, 36, 3], True),
    200: ([3, 24, 36, 3], True),
}


resnet = SimpleNamespace(ResNet=ResNet)


# --- scenic/projects/baselines/vit.py ----------------------------------------------------------


class AddPositionEmbs(nn.Module):
    """Adds learned positional embeddings to the inputs.

    Attributes:
      posemb_init: Positional embedding initializer.

    Returns:
      Output in shape `[bs, timesteps, in_dim]`.
    """

    posemb_init: Initializer = nn.initializers.normal(stddev=0.02)  # From BERT.

    @nn.compact
    def __call__(self, inputs: jnp.ndarray) -> jnp.ndarray:
        # Inputs.shape is (batch_size, seq_len, emb_dim).
        assert inputs.ndim == 3, "Number of dimensions should be 3, but it is: %d" % inputs.ndim
        pos_emb_shape = (1, inputs.shape[1], inputs.shape[2])
        pe = self.param("pos_embedding", self.posemb_init, pos_emb_shape, inputs.dtype)
        return inputs + pe


class Encoder1DBlock(nn.Module):
    """Transformer encoder layer.

    Attributes:
      mlp_dim: Dimension of the mlp on top of attention block.
      num_heads: Number of self-attention heads.
      dtype: The dtype of the computation (default: float32).
      dropout_rate: Dropout rate.
      attention_dropout_rate: Dropout for attention heads.
      stochastic_depth: probability of dropping a layer linearly grows
        from 0 to the provided value.

    Returns:
      output after transformer encoder block.
    """

    mlp_dim: int
    num_heads: int
    dtype: Any = jnp.float32
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    stochastic_depth: float = 0.0

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, deterministic: bool) -> jnp.ndarray:
        """Applies Encoder1DBlock module.

        Args:
          inputs: Input data.
          deterministic: Deterministic or not (to apply dropout).

        Returns:
          Output after transformer encoder block.
        """
        # Attention block.
        assert inputs.ndim == 3
        x = nn.LayerNorm(dtype=self.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            dtype=self.dtype,
            kernel_init=nn.initializers.xavier_uniform(),
            broadcast_dropout=False,
            deterministic=deterministic,
            dropout_rate=self.attention_dropout_rate,
        )(x, x)
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic)
        x = nn_layers.StochasticDepth(rate=self.stochastic_depth)(x, deterministic)
        x = x + inputs

        # MLP block.
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = attention_layers.MlpBlock(
            mlp_dim=self.mlp_dim,
            dtype=self.dtype,
            dropout_rate=self.dropout_rate,
            activation_fn=nn.gelu,
            kernel_init=nn.initializers.xavier_uniform(),
            bias_init=nn.initializers.normal(stddev=1e-6),
        )(y, deterministic=deterministic)
        y = nn_layers.StochasticDepth(rate=self.stochastic_depth)(y, deterministic)
        return y + x


vit = SimpleNamespace(AddPositionEmbs=AddPositionEmbs, Encoder1DBlock=Encoder1DBlock)


# --- scenic/projects/baselines/detr/model.py ---------------------------------------------------


pytorch_kernel_init = functools.partial(
    initializers.variance_scaling, 1.0 / 3.0, "fan_in", "uniform"
)


def uniform_initializer(minval, maxval, dtype=jnp.float32):

    def init(key, shape, dtype=dtype):
        return jax.random.uniform(key, shape, dtype, minval=minval, maxval=maxval)

    return init


class QueryPosEmbedding(nn.Module):
    """Creates learned positional embeddings for object queries.

    Attributes:
      hidden_dim: Hidden dimension for the pos embeddings.
      num_queries: Number of object queries.
      posemb_init: Positional embeddings initializer.
      dtype: Jax dtype; The dtype of the computation (default: float32).
    """

    hidden_dim: int
    num_queries: int
    posemb_init: Callable[..., Any] = initializers.normal(stddev=1.0)
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> jnp.ndarray:
        """Creates the positional embeddings for queries.

        Returns:
          Positional embedding for object queries.
        """
        query_pos = self.param("query_emb", self.posemb_init, (self.num_queries, self.hidden_dim))
        query_pos = jnp.expand_dims(query_pos, 0)
        return jnp.asarray(query_pos, self.dtype)


class InputPosEmbeddingLearned(nn.Module):
    """Creates learned positional embeddings for inputs.

    Attributes:
      inputs_shape: Shape of the 2D input, before flattening.
      hidden_dim: hidden dimension for the pos embeddings.
      max_h_w: Maximum height and width for the transformer inputs.
      posemb_init: Positional embeddings initializer.
      dtype: The dtype of the computation (default: float32).
    """

    inputs_shape: Tuple[int, int, int, int]
    hidden_dim: Optional[int] = None
    max_h_w: Optional[int] = None
    posemb_init: Callable[..., Any] = initializers.normal(stddev=1.0)
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> jnp.ndarray:
        """Creates the positional embeddings for transformer inputs.

        Returns:
          Positional embedding for inputs and queries.
        """
        _, h, w, c = self.inputs_shape
        max_h_w = self.max_h_w or np.max((h, w))
        assert h <= max_h_w and w <= max_h_w

        hidden_dim = self.hidden_dim or c

        row_pos_embed = self.param("row_pos_embed", self.posemb_init, (max_h_w, hidden_dim // 2))
        col_pos_embed = self.param("col_pos_embed", self.posemb_init, (max_h_w, hidden_dim // 2))

        # to `[h, w, hidden_dim//2]`
        x_pos_emb = jnp.tile(jnp.expand_dims(col_pos_embed[:w], axis=0), (h, 1, 1))
        # to `[h, w, hidden_dim//2]`
        y_pos_emb = jnp.tile(jnp.expand_dims(row_pos_embed[:h], axis=1), (1, w, 1))
        # to `[1, h*w, hidden_dim]`
        pos = jnp.expand_dims(
            jnp.concatenate((x_pos_emb, y_pos_emb), axis=-1).reshape((h * w, hidden_dim)), axis=0
        )

        return jnp.asarray(pos, self.dtype)


class InputPosEmbeddingSine(nn.Module):
    """Creates sinusoidal positional embeddings for inputs."""

    hidden_dim: int
    dtype: jnp.dtype = jnp.float32
    scale: Optional[float] = None
    temperature: float = 10000

    @nn.compact
    def __call__(self, padding_mask: jnp.ndarray) -> jnp.ndarray:
        """Creates the positional embeddings for transformer inputs.

        Args:
          padding_mask: Binary matrix with 0 at padded image regions. Shape is
            [batch, height, width]

        Returns:
          Positional embedding for inputs.

        Raises:
          ValueError if `hidden_dim` is not an even number.
        """
        if self.hidden_dim % 2:
            raise ValueError("`hidden_dim` must be an even number.")

        mask = padding_mask.astype(jnp.float32)
        y_embed = jnp.cumsum(mask, axis=1)
        x_embed = jnp.cumsum(mask, axis=2)

        # Normalization:
        eps = 1e-6
        scale = self.scale if self.scale is not None else 2 * jnp.pi
        y_embed = y_embed / (y_embed[:, -1:, :] + eps) * scale
        x_embed = x_embed / (x_embed[:, :, -1:] + eps) * scale

        num_pos_feats = self.hidden_dim // 2
        dim_t = jnp.arange(num_pos_feats, dtype=jnp.float32)
        dim_t = self.temperature ** (2 * (dim_t // 2) / num_pos_feats)

        pos_x = x_embed[:, :, :, jnp.newaxis] / dim_t
        pos_y = y_embed[:, :, :, jnp.newaxis] / dim_t
        pos_x = jnp.stack(
            [
                jnp.sin(pos_x[:, :, :, 0::2]),
                jnp.cos(pos_x[:, :, :, 1::2]),
            ],
            axis=4,
        ).reshape(padding_mask.shape + (-1,))
        pos_y = jnp.stack(
            [
                jnp.sin(pos_y[:, :, :, 0::2]),
                jnp.cos(pos_y[:, :, :, 1::2]),
            ],
            axis=4,
        ).reshape(padding_mask.shape + (-1,))

        pos = jnp.concatenate([pos_y, pos_x], axis=3)
        b, h, w = padding_mask.shape
        pos = jnp.reshape(pos, [b, h * w, self.hidden_dim])
        return jnp.asarray(pos, self.dtype)


class MlpBlock(nn.Module):
    """Transformer MLP / feed-forward block."""

    mlp_dim: int
    out_dim: Optional[int] = None
    dropout_rate: float = 0.1
    kernel_init: Callable[..., Any] = nn.initializers.xavier_uniform()
    bias_init: Callable[..., Any] = nn.initializers.normal(stddev=1e-6)
    activation_fn: Callable[[jnp.ndarray], jnp.ndarray] = nn.gelu
    dtype: jnp.ndarray = jnp.float32

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, *, deterministic: bool = True) -> jnp.ndarray:
        """Applies Transformer MlpBlock model."""
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(
            self.mlp_dim, dtype=self.dtype, kernel_init=self.kernel_init, bias_init=self.bias_init
        )(inputs)
        x = self.activation_fn(x)
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
        output = nn.Dense(
            actual_out_dim, dtype=self.dtype, kernel_init=self.kernel_init, bias_init=self.bias_init
        )(x)
        output = nn.Dropout(rate=self.dropout_rate)(output, deterministic=deterministic)
        return output


class MultiHeadDotProductAttention(nn.Module):
    """DETR Customized Multi-head dot-product attention.

    Attributes:
      num_heads: Number of attention heads. Features (i.e. inputs_q.shape[-1])
        should be divisible by the number of heads.
      pos_emb_q: Positional embedding to be added to the query.
      pos_emb_k: Positional embedding to be added to the key.
      pos_emb_v: Positional embedding to be added to the value.
      qkv_features: dimension of the key, query, and value.
      out_features: dimension of the last projection
      dropout_rate: dropout rate
      broadcast_dropout: use a broadcasted dropout along batch dims.
      kernel_init: initializer for the kernel of the Dense layers.
      bias_init: initializer for the bias of the Dense layers.
      use_bias: bool: whether pointwise QKV dense transforms use bias. In DETR
        they always have a bias on the output.
      dtype: the dtype of the computation (default: float32)
    """

    num_heads: int
    qkv_features: Optional[int] = None
    out_features: Optional[int] = None
    dropout_rate: float = 0.0
    broadcast_dropout: bool = False
    kernel_init: Callable[..., Any] = initializers.xavier_uniform()
    bias_init: Callable[..., Any] = initializers.zeros
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        inputs_q: jnp.ndarray,
        inputs_kv: Optional[jnp.ndarray] = None,
        *,
        pos_emb_q: Optional[jnp.ndarray] = None,
        pos_emb_k: Optional[jnp.ndarray] = None,
        pos_emb_v: Optional[jnp.ndarray] = None,
        key_padding_mask: Optional[jnp.ndarray] = None,
        train: bool = False,
    ) -> jnp.ndarray:
        """Applies multi-head dot product attention on the input data.

        Projects the inputs into multi-headed query, key, and value vectors,
        applies dot-product attention and project the results to an output vector.

        This can be used for encoder-decoder attention by specifying both `inputs_q`
        and `inputs_kv` or for self-attention by only specifying `inputs_q` and
        setting `inputs_kv` to None.

        Args:
          inputs_q: Input queries of shape  `[bs, len, features]`.
          inputs_kv: Key/values of shape `[bs, len, features]` or None for
            self-attention, in which case key/values will be derived from inputs_q.
          pos_emb_q: Positional embedding to be added to the query.
          pos_emb_k: Positional embedding to be added to the key.
          pos_emb_v: Positional embedding to be added to the value.
          key_padding_mask: Binary array. Key-value tokens that are padded are 0,
            and 1 otherwise.
          train: Train or not (to apply dropout).

        Returns:
          output of shape `[bs, len, features]`.
        """
        if inputs_kv is None:
            inputs_kv = inputs_q

        assert inputs_kv.ndim == inputs_q.ndim == 3
        features = self.out_features or inputs_q.shape[-1]
        qkv_features = self.qkv_features or inputs_q.shape[-1]

        assert qkv_features % self.num_heads == 0, (
            "Memory dimension must be divisible by number of heads."
        )
        head_dim = qkv_features // self.num_heads

        def add_positional_emb(x, pos_emb_x):
            return x if pos_emb_x is None else x + pos_emb_x

        query, key, value = (
            add_positional_emb(inputs_q, pos_emb_q),
            add_positional_emb(inputs_kv, pos_emb_k),
            add_positional_emb(inputs_kv, pos_emb_v),
        )

        dense = functools.partial(
            nn.DenseGeneral,
            axis=-1,
            features=(self.num_heads, head_dim),
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            use_bias=self.use_bias,
            dtype=self.dtype,
        )
        # project inputs_q to multi-headed q/k/v
        # dimensions are then [bs, l, n_heads, n_features_per_head]
        query, key, value = (
            dense(name="query")(query),
            dense(name="key")(key),
            dense(name="value")(value),
        )

        # create attention masks
        if key_padding_mask is not None:
            attention_bias = (1 - key_padding_mask) * -1e10
            # add head and query dimension.
            attention_bias = jnp.expand_dims(attention_bias, -2)
            attention_bias = jnp.expand_dims(attention_bias, -2)
        else:
            attention_bias = None

        # apply attention
        x = attention_layers.dot_product_attention(
            query,
            key,
            value,
            dtype=self.dtype,
            bias=attention_bias,
            dropout_rate=self.dropout_rate,
            broadcast_dropout=self.broadcast_dropout,
            dropout_rng=self.make_rng("dropout") if train else None,
            deterministic=not train,
            capture_attention_weights=True,
        )

        # back to the original inputs dimensions
        out = nn.DenseGeneral(
            features=features,
            axis=(-2, -1),
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            use_bias=True,
            dtype=self.dtype,
            name="out",
        )(x)

        return out


class EncoderBlock(nn.Module):
    """DETR Transformer encoder block.

    Attributes:
      num_heads: Number of heads.
      qkv_dim: Dimension of the query/key/value.
      mlp_dim: Dimension of the mlp on top of attention block.
      pre_norm: If use LayerNorm before attention/mlp blocks.
      dropout_rate: Dropout rate.
      attention_dropout_rate: Dropout rate for attention weights.
      dtype: Data type of the computation (default: float32).
    """

    num_heads: int
    qkv_dim: int
    mlp_dim: int
    pre_norm: bool = False
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        inputs: jnp.ndarray,
        *,
        pos_embedding: Optional[jnp.ndarray] = None,
        padding_mask: Optional[jnp.ndarray] = None,
        train: bool = False,
    ) -> jnp.ndarray:
        """Applies EncoderBlock module.

        Args:
          inputs: Input data of shape [batch_size, len, features].
          pos_embedding: Positional Embedding to be added to the queries and keys in
            the self-attention operation.
          padding_mask: Binary mask containing 0 for padding tokens.
          train: Train or not (to apply dropout).

        Returns:
          Output after transformer encoder block.
        """
        self_attn = MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            qkv_features=self.qkv_dim,
            dropout_rate=self.attention_dropout_rate,
            broadcast_dropout=False,
            kernel_init=initializers.xavier_uniform(),
            bias_init=initializers.zeros,
            use_bias=True,
            dtype=self.dtype,
        )

        mlp = MlpBlock(  # pytype: disable=wrong-arg-types  # jnp-type
            mlp_dim=self.mlp_dim,
            activation_fn=nn.relu,
            dtype=self.dtype,  # pyrefly: ignore[bad-argument-type]
            dropout_rate=self.dropout_rate,
        )

        assert inputs.ndim == 3

        if self.pre_norm:
            x = nn.LayerNorm(dtype=self.dtype)(inputs)
            x = self_attn(
                inputs_q=x,
                pos_emb_q=pos_embedding,
                pos_emb_k=pos_embedding,
                pos_emb_v=None,
                key_padding_mask=padding_mask,
                train=train,
            )
            x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=not train)
            x = x + inputs
            y = nn.LayerNorm(dtype=self.dtype)(x)
            y = mlp(y, deterministic=not train)
            out = x + y

        else:
            x = self_attn(
                inputs_q=inputs,
                pos_emb_q=pos_embedding,
                pos_emb_k=pos_embedding,
                pos_emb_v=None,
                key_padding_mask=padding_mask,
                train=train,
            )
            x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=not train)
            x = x + inputs
            x = nn.LayerNorm(dtype=self.dtype)(x)
            y = mlp(x, deterministic=not train)
            y = x + y
            out = nn.LayerNorm(dtype=self.dtype)(y)

        return out


class DecoderBlock(nn.Module):
    """DETR Transformer decoder block.

    Attributes:
      num_heads: Number of heads.
      qkv_dim: Dimension of the query/key/value.
      mlp_dim: Dimension of the mlp on top of attention block.
      pre_norm: If use LayerNorm before attention/mlp blocks.
      dropout_rate:Dropout rate.
      attention_dropout_rate:Dropout rate for attention weights.
      dtype: Data type of the computation (default: float32).
    """

    num_heads: int
    qkv_dim: int
    mlp_dim: int
    pre_norm: bool = False
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        obj_queries: jnp.ndarray,
        encoder_output: jnp.ndarray,
        *,
        pos_embedding: Optional[jnp.ndarray] = None,
        query_pos_emb: Optional[jnp.ndarray] = None,
        key_padding_mask: Optional[jnp.ndarray] = None,
        train: bool = False,
    ):
        """Applies DecoderBlock module.

        Args:
          obj_queries: Input data for decoder.
          encoder_output: Output of encoder, which are encoded inputs.
          pos_embedding: Positional Embedding to be added to the keys in
            cross-attention.
          query_pos_emb: Positional Embedding to be added to the queries.
          key_padding_mask: Binary mask containing 0 for pad tokens in key.
          train: Train or not (to apply dropout)

        Returns:
          Output after transformer decoder block.
        """

        assert query_pos_emb is not None, (
            "Given that object_queries are zeros "
            "and not learnable, we should add "
            "learnable query_pos_emb to them."
        )
        # Seems in DETR the self-attention in the first layer basically does
        # nothing, as the  value vector is a zero vector and we add no learnable
        # positional embedding to it!
        self_attn = MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            qkv_features=self.qkv_dim,
            broadcast_dropout=False,
            dropout_rate=self.attention_dropout_rate,
            kernel_init=initializers.xavier_uniform(),
            bias_init=initializers.zeros,
            use_bias=True,
            dtype=self.dtype,
        )

        cross_attn = MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            qkv_features=self.qkv_dim,
            broadcast_dropout=False,
            dropout_rate=self.attention_dropout_rate,
            kernel_init=initializers.xavier_uniform(),
            bias_init=initializers.zeros,
            use_bias=True,
            dtype=self.dtype,
        )

        mlp = MlpBlock(  # pytype: disable=wrong-arg-types  # jnp-type
            mlp_dim=self.mlp_dim,
            activation_fn=nn.relu,
            dtype=self.dtype,  # pyrefly: ignore[bad-argument-type]
            dropout_rate=self.dropout_rate,
        )

        assert obj_queries.ndim == 3
        if self.pre_norm:
            # self attention block
            x = nn.LayerNorm(dtype=self.dtype)(obj_queries)
            x = self_attn(
                inputs_q=x,
                pos_emb_q=query_pos_emb,
                pos_emb_k=query_pos_emb,
                pos_emb_v=None,
                train=train,
            )
            x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=not train)
            x = x + obj_queries
            # cross attention block
            y = nn.LayerNorm(dtype=self.dtype)(x)
            y = cross_attn(
                inputs_q=y,
                inputs_kv=encoder_output,
                pos_emb_q=query_pos_emb,
                pos_emb_k=pos_embedding,
                pos_emb_v=None,
                key_padding_mask=key_padding_mask,
                train=train,
            )
            y = nn.Dropout(rate=self.dropout_rate)(y, deterministic=not train)
            y = y + x
            # mlp block
            z = nn.LayerNorm(dtype=self.dtype)(y)
            z = mlp(z, deterministic=not train)
            out = y + z

        else:
            # self attention block
            x = self_attn(
                inputs_q=obj_queries,
                pos_emb_q=query_pos_emb,
                pos_emb_k=query_pos_emb,
                pos_emb_v=None,
                train=train,
            )
            x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=not train)
            x = x + obj_queries
            x = nn.LayerNorm(dtype=self.dtype)(x)
            # cross attention block
            y = cross_attn(
                inputs_q=x,
                inputs_kv=encoder_output,
                pos_emb_q=query_pos_emb,
                pos_emb_k=pos_embedding,
                pos_emb_v=None,
                key_padding_mask=key_padding_mask,
                train=train,
            )
            y = nn.Dropout(rate=self.dropout_rate)(y, deterministic=not train)
            y = y + x
            y = nn.LayerNorm(dtype=self.dtype)(y)
            # mlp block
            z = mlp(y, deterministic=not train)
            z = y + z
            out = nn.LayerNorm(dtype=self.dtype)(z)

        return out


class Encoder(nn.Module):
    """DETR Transformer Encoder.

    Attributes:
      num_heads: Number of heads.
      num_layers: Number of layers.
      qkv_dim: Dimension of the query/key/value.
      mlp_dim: Dimension of the mlp on top of attention block.
      normalize_before: If use LayerNorm before attention/mlp blocks.
      norm: normalization layer to be applied on the output.
      dropout_rate: Dropout rate.
      attention_dropout_rate: Dropout rate for attention weights.
      dtype: Data type of the computation (default: float32).
    """

    num_heads: int
    num_layers: int
    qkv_dim: int
    mlp_dim: int
    normalize_before: bool = False
    norm: Optional[Callable[..., Any]] = None
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        inputs: jnp.ndarray,
        *,
        pos_embedding: Optional[jnp.ndarray] = None,
        padding_mask: Optional[jnp.ndarray] = None,
        train: bool = False,
    ) -> jnp.ndarray:
        """Applies Encoder on the inputs.

        Args:
          inputs: Input data.
          pos_embedding: Positional Embedding to be added to the queries and keys in
            the self-attention operation.
          padding_mask: Binary mask containing 0 for padding tokens, and 1
            otherwise.
          train: Whether it is training.

        Returns:
          Output of the transformer encoder.
        """
        assert inputs.ndim == 3  # `[batch, height*width, features]`
        x = inputs

        # input Encoder
        for lyr in range(self.num_layers):
            x = EncoderBlock(
                qkv_dim=self.qkv_dim,
                mlp_dim=self.mlp_dim,
                num_heads=self.num_heads,
                pre_norm=self.normalize_before,
                dropout_rate=self.dropout_rate,
                attention_dropout_rate=self.attention_dropout_rate,
                name=f"encoderblock_{lyr}",
                dtype=self.dtype,
            )(x, pos_embedding=pos_embedding, padding_mask=padding_mask, train=train)

        if self.norm is not None:
            x = self.norm(x)
        return x


class Decoder(nn.Module):
    """DETR Transformer Decoder.

    Attributes:
      num_heads: Number of heads.
      num_layers: Number of layers.
      qkv_dim: Dimension of the query/key/value.
      mlp_dim: Dimension of the mlp on top of attention block.
      normalize_before: If use LayerNorm before attention/mlp blocks.
      return_intermediate: If return the outputs from intermediate layers.
      padding_mask: Binary mask containing 0 for padding tokens.
      dropout_rate:Dropout rate.
      attention_dropout_rate:Dropout rate for attention weights.
      dtype: Data type of the computation (default: float32).
    """

    num_heads: int
    num_layers: int
    qkv_dim: int
    mlp_dim: int
    normalize_before: bool = False
    norm: Optional[Callable[..., Any]] = None
    return_intermediate: bool = False
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        obj_queries: jnp.ndarray,
        encoder_output: jnp.ndarray,
        *,
        key_padding_mask: Optional[jnp.ndarray] = None,
        pos_embedding: Optional[jnp.ndarray] = None,
        query_pos_emb: Optional[jnp.ndarray] = None,
        train: bool = False,
    ) -> jnp.ndarray:
        """Applies Decoder on the inputs.

        Args:
          obj_queries: Input data for decoder.
          encoder_output: Output of encoder, which are encoded inputs.
          key_padding_mask: Binary mask containing 0 for padding tokens in the keys.
          pos_embedding: Positional Embedding to be added to the keys.
          query_pos_emb: Positional Embedding to be added to the queries.
          train: Whether it is training.

        Returns:
          Output of a transformer decoder.
        """
        assert encoder_output.ndim == 3  # `[batch, len, features]`
        assert obj_queries.ndim == 3  # `[batch, num queries, embedding size]`
        y = obj_queries
        outputs = []
        for lyr in range(self.num_layers):
            y = DecoderBlock(
                qkv_dim=self.qkv_dim,
                mlp_dim=self.mlp_dim,
                num_heads=self.num_heads,
                pre_norm=self.normalize_before,
                dropout_rate=self.dropout_rate,
                attention_dropout_rate=self.attention_dropout_rate,
                dtype=self.dtype,
                name=f"decoderblock_{lyr}",
            )(
                y,
                encoder_output,
                pos_embedding=pos_embedding,
                query_pos_emb=query_pos_emb,
                key_padding_mask=key_padding_mask,
                train=train,
            )
            if self.return_intermediate:
                outputs.append(y)

        if self.return_intermediate:
            y = jnp.stack(outputs, axis=0)
        return y if self.norm is None else self.norm(y)


class DETRTransformer(nn.Module):
    """DETR Transformer.

    Attributes:
      num_queries: Number of object queries. query_emb_size; Size of the embedding
        learned for object queries.
      query_emb_size: Size of the embedding learned for object queries.
      num_heads: Number of heads.
      num_encoder_layers: Number of encoder layers.
      num_decoder_layers: Number of decoder layers.
      qkv_dim: Dimension of the query/key/value.
      mlp_dim: Dimension of the mlp on top of attention block.
      return_intermediate_dec: If return the outputs from intermediate layers of
        the decoder.
      normalize_before: If use LayerNorm before attention/mlp blocks.
      dropout_rate: Dropout rate.
      attention_dropout_rate:Dropout rate for attention weights.
      dtype: Data type of the computation (default: float32).
    """

    num_queries: int = 100
    query_emb_size: Optional[int] = None
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    qkv_dim: int = 512
    mlp_dim: int = 2048
    return_intermediate_dec: bool = False
    normalize_before: bool = False
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        inputs: jnp.ndarray,
        *,
        padding_mask: Optional[jnp.ndarray] = None,
        pos_embedding: Optional[jnp.ndarray] = None,
        query_pos_emb: Optional[jnp.ndarray] = None,
        train: bool = False,
    ) -> Tuple[jnp.ndarray, jnp.ndarray]:
        """Applies DETRTransformer on the inputs.

        Args:
          inputs: Input data.
          padding_mask: Binary mask containing 0 for padding tokens.
          pos_embedding: Positional Embedding to be added to the inputs.
          query_pos_emb: Positional Embedding to be added to the queries.
          train: Whether it is training.

        Returns:
          Output of the DETR transformer and output of the encoder.
        """
        encoder_norm = nn.LayerNorm() if self.normalize_before else None
        encoded = Encoder(
            num_heads=self.num_heads,
            num_layers=self.num_encoder_layers,
            qkv_dim=self.qkv_dim,
            mlp_dim=self.mlp_dim,
            normalize_before=self.normalize_before,
            norm=encoder_norm,
            dropout_rate=self.dropout_rate,
            attention_dropout_rate=self.attention_dropout_rate,
            dtype=self.dtype,
            name="encoder",
        )(inputs, padding_mask=padding_mask, pos_embedding=pos_embedding, train=train)

        query_dim = self.query_emb_size or inputs.shape[-1]
        obj_query_shape = tuple([inputs.shape[0], self.num_queries, query_dim])
        # Note that we always learn query_pos_embed, so we simply use constant
        # zero vectors for obj_queries and later when applying attention, we have:
        # query = query_pos_embed + obj_queries
        obj_queries = jnp.zeros(obj_query_shape)

        decoder_norm = nn.LayerNorm()
        output = Decoder(
            num_heads=self.num_heads,
            num_layers=self.num_decoder_layers,
            qkv_dim=self.qkv_dim,
            mlp_dim=self.mlp_dim,
            normalize_before=self.normalize_before,
            return_intermediate=self.return_intermediate_dec,
            dropout_rate=self.dropout_rate,
            attention_dropout_rate=self.attention_dropout_rate,
            norm=decoder_norm,
            dtype=self.dtype,
            name="decoder",
        )(
            obj_queries,
            encoded,
            key_padding_mask=padding_mask,
            pos_embedding=pos_embedding,
            query_pos_emb=query_pos_emb,
            train=train,
        )
        return output, encoded


class BBoxCoordPredictor(nn.Module):
    """FFN block for predicting bounding box coordinates."""

    mlp_dim: int
    num_layers: int = 3
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """Applies FFN MLP block to inputs.

        Args:
          x: Input tensor.

        Returns:
          Output of FFN MLP block.
        """
        for _ in range(self.num_layers - 1):
            # This is like pytorch initializes biases in linear layers.
            bias_range = 1 / np.sqrt(x.shape[-1])
            x = nn.Dense(
                self.mlp_dim,
                kernel_init=pytorch_kernel_init(dtype=self.dtype),
                bias_init=uniform_initializer(-bias_range, bias_range, dtype=self.dtype),
                dtype=self.dtype,
            )(x)
            x = nn.relu(x)

        bias_range = 1 / np.sqrt(x.shape[-1])
        x = nn.Dense(
            4,
            kernel_init=pytorch_kernel_init(dtype=self.dtype),
            bias_init=uniform_initializer(-bias_range, bias_range, dtype=self.dtype),
        )(x)
        output = nn.sigmoid(x)
        return output


class ObjectClassPredictor(nn.Module):
    """Linear Projection block for predicting classification."""

    num_classes: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, inputs: jnp.ndarray) -> jnp.ndarray:
        """Applies Linear Projection to inputs.

        Args:
          inputs: Input data.

        Returns:
          Output of Linear Projection block.
        """
        bias_range = 1.0 / np.sqrt(inputs.shape[-1])
        return nn.Dense(
            self.num_classes,
            kernel_init=pytorch_kernel_init(dtype=self.dtype),
            bias_init=uniform_initializer(-bias_range, bias_range, self.dtype),
            dtype=self.dtype,
        )(inputs)


class DETR(nn.Module):
    """Detection Transformer (DETR) model.

    Attributes:
      num_classes: Number of object classes.
      hidden_dim: Hidden dimension of the inputs to the model.
      num_queries: Number of object queries, ie detection slot. This is the
        maximal number of objects DETR can detect in a single image. For COCO,
        DETR paper recommends 100 queries.
      query_emb_size: Size of the embedding learned for object queries.
      transformer_num_heads: Number of transformer heads.
      transformer_num_encoder_layers: Number of transformer encoder layers.
      transformer_num_decoder_layers: Number of transformer decoder layers.
      transformer_qkv_dim: Dimension of the transformer query/key/value.
      transformer_mlp_dim: Dimension of the mlp on top of attention block.
      transformer_normalize_before: If use LayerNorm before attention/mlp blocks.
      backbone_num_filters: Num filters in the ResNet backbone.
      backbone_num_layers: Num layers in the ResNet backbone.
      aux_loss: If train with auxiliary loss.
      dropout_rate:Dropout rate.
      attention_dropout_rate:Attention dropout rate.
      dtype: Data type of the computation (default: float32).
    """

    num_classes: int
    hidden_dim: int = 512
    num_queries: int = 100
    query_emb_size: Optional[int] = None
    transformer_num_heads: int = 8
    transformer_num_encoder_layers: int = 6
    transformer_num_decoder_layers: int = 6
    transformer_qkv_dim: int = 512
    transformer_mlp_dim: int = 2048
    transformer_normalize_before: bool = False
    backbone_num_filters: int = 64
    backbone_num_layers: int = 50
    aux_loss: bool = False
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        inputs: jnp.ndarray,
        train: bool,
        *,
        padding_mask: Optional[jnp.ndarray] = None,
        update_batch_stats: bool = False,
        debug: bool = False,
    ) -> Dict[str, Any]:
        """Applies DETR model on the input.

        Args:
          inputs: Input data.
          train:  Whether it is training.
          padding_mask: Binary matrix with 0 at padded image regions.
          update_batch_stats: Whether update the batch statistics for the BatchNorms
            in the backbone. if None, the value of `train` flag will be used, i.e.
            we update the batch stat if we are in the train mode.
          debug: Whether the debug mode is enabled. debug=True enables model
            specific logging/storing some values using jax.host_callback.

        Returns:
          Output: dit; that has 'pred_logits' and 'pred_boxes', and potentially
          'aux_outputs'.
        """
        # for now, we only support this case
        assert self.hidden_dim == self.transformer_qkv_dim

        if update_batch_stats is None:
            update_batch_stats = train

        backbone_features = resnet.ResNet(
            num_outputs=None,
            num_filters=self.backbone_num_filters,
            num_layers=self.backbone_num_layers,
            dtype=self.dtype,
            name="backbone",
        )(inputs, train=update_batch_stats)
        x = backbone_features["stage_4"]

        bs, h, w, _ = x.shape

        if padding_mask is None:
            padding_mask_downsampled = jnp.ones((bs, h, w), dtype=jnp.bool_)
        else:
            padding_mask_downsampled = jax.image.resize(
                padding_mask.astype(jnp.float32), shape=[bs, h, w], method="nearest"
            ).astype(jnp.bool_)
        pos_emb = InputPosEmbeddingSine(hidden_dim=self.hidden_dim)(padding_mask_downsampled)

        query_pos_emb = QueryPosEmbedding(
            hidden_dim=self.hidden_dim, num_queries=self.num_queries
        )()

        # project and reshape to 3 dimensions and project
        x = nn.Conv(features=self.hidden_dim, kernel_size=(1, 1), strides=(1, 1))(x)
        x = x.reshape(bs, h * w, self.hidden_dim)
        transformer_input = x

        return_intermediate = self.aux_loss
        transformer = DETRTransformer(
            num_queries=self.num_queries,
            query_emb_size=self.query_emb_size,
            num_heads=self.transformer_num_heads,
            num_encoder_layers=self.transformer_num_encoder_layers,
            num_decoder_layers=self.transformer_num_decoder_layers,
            qkv_dim=self.transformer_qkv_dim,
            mlp_dim=self.transformer_mlp_dim,
            return_intermediate_dec=return_intermediate,
            normalize_before=self.transformer_normalize_before,
            dropout_rate=self.dropout_rate,
            attention_dropout_rate=self.attention_dropout_rate,
        )
        decoder_output, encoder_output = transformer(
            x,
            padding_mask=jnp.reshape(padding_mask_downsampled, [bs, h * w]),
            pos_embedding=pos_emb,
            query_pos_emb=query_pos_emb,
            train=train,
        )

        def output_projection(model_output):
            # classification head
            pred_logits = ObjectClassPredictor(num_classes=self.num_classes)(model_output)
            # bounding box detection head
            pred_boxes = BBoxCoordPredictor(mlp_dim=self.hidden_dim)(model_output)
            return pred_logits, pred_boxes

        if not return_intermediate:
            pred_logits, pred_boxes = output_projection(decoder_output)
            return {"pred_logits": pred_logits, "pred_boxes": pred_boxes}

        pred_logits, pred_boxes = jax.vmap(output_projection)(decoder_output)
        output = {
            "pred_logits": pred_logits[-1],
            "pred_boxes": pred_boxes[-1],
            "transformer_input": transformer_input,
            "backbone_features": backbone_features,
            "encoder_output": encoder_output,
            "decoder_output": decoder_output[-1],
            "padding_mask": padding_mask_downsampled,
        }

        if self.aux_loss:
            output["aux_outputs"] = []
            for lgts, bxs in zip(pred_logits[:-1], pred_boxes[:-1]):
                output["aux_outputs"].append({"pred_logits": lgts, "pred_boxes": bxs})

        return output


# --- scenic/projects/token_learner/model.py ----------------------------------------------------


class TokenLearnerModule(nn.Module):
    """TokenLearner module.

    This is the module used for the experiments in the paper.

    Attributes:
      num_tokens: Number of tokens.
    """

    num_tokens: int
    use_sum_pooling: bool = True

    @nn.compact
    def __call__(self, inputs: jnp.ndarray) -> jnp.ndarray:
        """Applies learnable tokenization to the 2D inputs.

        Args:
          inputs: Inputs of shape `[bs, h, w, c]` or `[bs, hw, c]`.

        Returns:
          Output of shape `[bs, n_token, c]`.
        """
        if inputs.ndim == 3:
            n, hw, c = inputs.shape
            h = int(math.sqrt(hw))
            inputs = jnp.reshape(inputs, [n, h, h, c])

            if h * h != hw:
                raise ValueError("Only square inputs supported.")

        feature_shape = inputs.shape

        selected = inputs
        selected = nn.LayerNorm()(selected)

        for _ in range(3):
            selected = nn.Conv(
                self.num_tokens, kernel_size=(3, 3), strides=(1, 1), padding="SAME", use_bias=False
            )(selected)  # Shape: [bs, h, w, n_token].

            selected = nn.gelu(selected)

        selected = nn.Conv(
            self.num_tokens, kernel_size=(3, 3), strides=(1, 1), padding="SAME", use_bias=False
        )(selected)  # Shape: [bs, h, w, n_token].

        selected = jnp.reshape(
            selected, [feature_shape[0], feature_shape[1] * feature_shape[2], -1]
        )  # Shape: [bs, h*w, n_token].
        selected = jnp.transpose(selected, [0, 2, 1])  # Shape: [bs, n_token, h*w].
        selected = nn.sigmoid(selected)[..., None]  # Shape: [bs, n_token, h*w, 1].

        feat = inputs
        feat = jnp.reshape(feat, [feature_shape[0], feature_shape[1] * feature_shape[2], -1])[
            :, None, ...
        ]  # Shape: [bs, 1, h*w, c].

        if self.use_sum_pooling:
            inputs = jnp.sum(feat * selected, axis=2)
        else:
            inputs = jnp.mean(feat * selected, axis=2)

        return inputs


class TokenLearnerModuleV11(nn.Module):
    """TokenLearner module Version 1.1, using slightly different conv. layers.

    Instead of using 4 conv. layers with small channels to implement spatial
    attention, this version uses a MLP with gelu inbetween. It also uses softmax
    instead of sigmoid. We confirmed that this version works better in general.

    Attributes:
      num_tokens: Number of tokens.
      bottleneck_dim: The size of hidden units in the MLP for spatial attention.
      dropout_rate: Dropout rate.
    """

    num_tokens: int
    bottleneck_dim: int = 64
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, deterministic: bool) -> jnp.ndarray:
        """Applies learnable tokenization to the 2D inputs.

        Args:
          inputs: Inputs of shape `[bs, h, w, c]`.
          deterministic: Weather we are in the deterministic mode (e.g inference
            time) or not.

        Returns:
          Output of shape `[bs, n_token, c]`.
        """
        if inputs.ndim == 4:
            n, h, w, c = inputs.shape
            inputs = jnp.reshape(inputs, [n, h * w, c])

        feature_shape = inputs.shape

        selected = inputs

        selected = nn.LayerNorm()(selected)

        selected = attention_layers.MlpBlock(
            mlp_dim=self.bottleneck_dim,
            out_dim=self.num_tokens,
            dropout_rate=self.dropout_rate,
            activation_fn=nn.gelu,
            name="token_masking",
        )(selected, deterministic=deterministic)

        selected = jnp.reshape(
            selected, [feature_shape[0], -1, self.num_tokens]
        )  # Shape: [bs, h*w, n_token].
        selected = jnp.transpose(selected, [0, 2, 1])  # Shape: [bs, n_token, h*w].
        selected = jax.nn.softmax(selected, axis=-1)

        feat = inputs
        feat = jnp.reshape(feat, [feature_shape[0], -1, feature_shape[-1]])  # Shape: [bs, h*w, c].

        feat = jnp.einsum("...si,...id->...sd", selected, feat)

        return feat


class TokenFuser(nn.Module):
    """Token fusion module.

    Attributes:
      use_normalization: Whether to use LayerNorm layers. This is needed when
        using sum pooling in the TokenLearner module.
      bottleneck_dim: The size of hidden units in the MLP for spatial attention.
      dropout_rate: Dropout rate.
    """

    use_normalization: bool = True
    bottleneck_dim: int = 64
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(
        self, inputs: jnp.ndarray, original: jnp.ndarray, deterministic: bool
    ) -> jnp.ndarray:
        """Applies token fusion to the generate 2D ouputs.

        Args:
          inputs: Inputs of shape `[bs, n_token, c]`.
          original: Inputs of shape `[bs, hw, c]` or `[bs, h, w, c]`.
          deterministic: Weather we are in the deterministic mode (e.g inference
            time) or not.

        Returns:
          Output tensor with the shape identical to `original'.
        """
        feature_shape = inputs.shape
        num_tokens = feature_shape[-2]

        if original.ndim == 4:
            n, h, w, c = original.shape
            original = jnp.reshape(original, [n, h * w, c])

        if self.use_normalization:
            inputs = nn.LayerNorm(name="fuser_mix_norm1")(inputs)

        inputs = jnp.transpose(inputs, axes=[0, 2, 1])  # Shape: [bs, c, n_token].
        inputs = nn.Dense(num_tokens, kernel_init=nn.initializers.zeros)(inputs)
        inputs = jnp.transpose(inputs, axes=[0, 2, 1])  # Shape: [bs, n_token, c].

        if self.use_normalization:
            inputs = nn.LayerNorm(name="fuser_mix_norm2")(inputs)

        original = nn.LayerNorm()(original)
        mix = attention_layers.MlpBlock(
            mlp_dim=self.bottleneck_dim,
            out_dim=num_tokens,
            dropout_rate=self.dropout_rate,
            activation_fn=nn.gelu,
            name="token_masking",
        )(original, deterministic=deterministic)  # Shape: [bs, h*w, n_token].
        mix = nn.sigmoid(mix)

        inputs = jnp.einsum("...sc,...hs->...hc", inputs, mix)  # Shape: [bs, h*w, c].

        inputs = nn.Dropout(rate=self.dropout_rate)(inputs, deterministic=deterministic)

        if original.ndim == 4:
            inputs = jnp.reshape(inputs, [n, h, w, -1])  # pyrefly: ignore[unbound-name]

        return inputs


class EncoderMod(nn.Module):
    """Transformer Encoder modified, to use TokenLearner.

    Attributes:
      num_layers: Number of layers.
      mlp_dim: Dimension of the MLP on top of the attention block.
      num_heads: The number of self-attention heads.
      dropout_rate: Dropout rate in the transformer encoder.
      attention_dropout_rate: Dropout rate for multi-head dot-product attention.
      tokenizer_type: Which tokenizer to use. 'dynamic' or 'video' means using
        TokenLearner.
      temporal_dimensions: The number of temporal dimensions in the input. This
        is necessary for video models. Default is 1 for image models.
      num_tokens: Number of tokens to learn by TokenLearner. The total number of
        tokens learned is thus num_tokens * temporal_dimensions.
      tokenlearner_loc: The layer indices to add TokenLearner to.
      use_v11: whether to use version 1.1.
      dtype: Dtype of activations.
    """

    num_layers: int
    mlp_dim: int
    num_heads: int
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    tokenizer_type: str = "patch"
    temporal_dimensions: int = 1
    num_tokens: int = 8
    tokenlearner_loc: int = 12
    use_v11: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, *, train: bool = False):
        """Applies Transformer model on the inputs."""

        assert inputs.ndim == 3  # Shape is `[batch, len, emb]`.
        dtype = jax.dtypes.canonicalize_dtype(self.dtype)

        x = vit.AddPositionEmbs(
            posemb_init=nn.initializers.normal(stddev=0.02),  # From BERT.
            name="posembed_input",
        )(inputs)
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=not train)

        tl_locs = [self.tokenlearner_loc]
        tl_size = [self.num_tokens]
        # Input Encoder.
        for lyr in range(self.num_layers):
            if self.tokenizer_type in {"dynamic", "video"} and lyr in tl_locs:
                tl_index = tl_locs.index(lyr)

                n, thw, c = x.shape
                hw = thw // self.temporal_dimensions
                x = jnp.reshape(x, [n * self.temporal_dimensions, hw, c])
                if self.use_v11:
                    x = TokenLearnerModuleV11(tl_size[tl_index], dropout_rate=self.dropout_rate)(
                        x, deterministic=not train
                    )  # Shape [n*t, n_tokens, c].
                else:
                    x = TokenLearnerModule(tl_size[tl_index])(x)
                _, n_tokens, c = x.shape
                x = jnp.reshape(x, [n, self.temporal_dimensions * n_tokens, c])

                x = vit.Encoder1DBlock(
                    mlp_dim=self.mlp_dim,
                    num_heads=self.num_heads,
                    dropout_rate=self.dropout_rate,
                    attention_dropout_rate=self.attention_dropout_rate,
                    name=f"encoderblock_{lyr}",
                    dtype=dtype,
                )(x, deterministic=not train)

            else:
                x = vit.Encoder1DBlock(
                    mlp_dim=self.mlp_dim,
                    num_heads=self.num_heads,
                    dropout_rate=self.dropout_rate,
                    attention_dropout_rate=self.attention_dropout_rate,
                    name=f"encoderblock_{lyr}",
                    dtype=dtype,
                )(x, deterministic=not train)
        encoded = nn.LayerNorm(name="encoder_norm")(x)
        return encoded


class EncoderModFuser(nn.Module):
    """Transformer Encoder modified, to use TokenLearner + TokenFuser.

    Attributes:
      num_layers: Number of layers.
      mlp_dim: Dimension of the MLP on top of the attention block.
      num_heads: The number of self-attention heads.
      dropout_rate: Dropout rate in the transformer encoder.
      attention_dropout_rate: Dropout rate for multi-head dot-product attention.
      tokenizer_type: Which tokenizer to use. 'dynamic' or 'video' means using
        TokenLearner.
      temporal_dimensions: The number of temporal dimensions in the input. This
        is necessary for video models. Default is 1 for image models.
      num_tokens: Number of tokens to learn by TokenLearner. The total number of
        tokens learned is thus num_tokens * temporal_dimensions.
      tokenlearner_loc: The layer indices to add TokenLearner to.
      use_v11: whether to use version 1.1 of the TokenLearner
        module. Works better when the module is applied early in the network.
      dtype: Dtype of activations.

    """

    num_layers: int
    mlp_dim: int
    num_heads: int
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    tokenizer_type: str = "patch"
    temporal_dimensions: int = 1
    num_tokens: int = 8
    tokenlearner_loc: int = 12
    use_v11: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, *, train: bool = False):
        """Applies Transformer model on the inputs."""

        assert inputs.ndim == 3  # Shape is `[batch, len, emb]`.
        dtype = jax.dtypes.canonicalize_dtype(self.dtype)

        x = vit.AddPositionEmbs(
            posemb_init=nn.initializers.normal(stddev=0.02),  # From BERT.
            name="posembed_input",
        )(inputs)
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=not train)

        # Input Encoder.
        for lyr in range(self.num_layers):
            if self.tokenizer_type in {"dynamic", "video"} and lyr >= self.tokenlearner_loc:
                n, thw, c = x.shape
                hw = thw // self.temporal_dimensions
                x = jnp.reshape(x, [n * self.temporal_dimensions, hw, c])
                residual = x
                if self.use_v11:
                    x = TokenLearnerModuleV11(self.num_tokens, dropout_rate=self.dropout_rate)(
                        x, deterministic=not train
                    )  # Shape [n*t, n_tokens, c].
                else:
                    x = TokenLearnerModule(self.num_tokens)(x)
                _, n_tokens, c = x.shape
                x = jnp.reshape(x, [n, self.temporal_dimensions * n_tokens, c])

                x = vit.Encoder1DBlock(
                    mlp_dim=self.mlp_dim,
                    num_heads=self.num_heads,
                    dropout_rate=self.dropout_rate,
                    attention_dropout_rate=self.attention_dropout_rate,
                    name=f"encoderblock_{lyr}",
                    dtype=dtype,
                )(x, deterministic=not train)

                x = jnp.reshape(x, [n * self.temporal_dimensions, n_tokens, c])
                x = TokenFuser(dropout_rate=self.dropout_rate)(
                    x, residual, deterministic=not train
                )  # [n * t, n_tokens, c], [n * t, hw, c]
                x = x + residual
                x = jnp.reshape(x, [n, self.temporal_dimensions * hw, c])

            else:
                x = vit.Encoder1DBlock(
                    mlp_dim=self.mlp_dim,
                    num_heads=self.num_heads,
                    dropout_rate=self.dropout_rate,
                    attention_dropout_rate=self.attention_dropout_rate,
                    name=f"encoderblock_{lyr}",
                    dtype=dtype,
                )(x, deterministic=not train)
            logging.info("Layer %d. Shape %s", lyr, x.shape)
        encoded = nn.LayerNorm(name="encoder_norm")(x)
        return encoded


class TokenLearnerViT(nn.Module):
    """Vision Transformer model with TokenLearner.

    Attributes:
    num_classes: Number of output classes.
    mlp_dim: Dimension of the mlp on top of attention block.
    num_layers: Number of layers.
    num_heads: Number of self-attention heads.
    patches: Configuration of the patches extracted in the stem of the model.
    hidden_size: Size of the hidden state of the output of model's stem.
    representation_size: Size of the representation layer in the model's head.
      if None, we skip the extra projection + tanh activation at the end.
    dropout_rate: Dropout rate.
    attention_dropout_rate: Dropout for attention heads.
    classifier: type of the classifier layer. Options are 'gap', 'gmp', 'gsp',
      'token'.
    dtype: JAX data type for activations.
    """

    num_classes: int
    mlp_dim: int
    num_layers: int
    num_heads: int
    tokenizer: ml_collections.ConfigDict
    hidden_size: int
    representation_size: int
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    classifier: str = "gap"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray, *, train: bool, debug: bool = False):

        temporal_dimensions = 1
        if self.tokenizer.type == "patch":
            fh, fw = self.tokenizer.patches.size
            x = nn.Conv(
                self.hidden_size, (fh, fw), strides=(fh, fw), padding="VALID", name="embedding"
            )(x)
            n, h, w, c = x.shape
            x = jnp.reshape(x, [n, h * w, c])
        elif self.tokenizer.type == "dynamic":
            fh, fw = self.tokenizer.patches.size
            x = nn.Conv(
                self.hidden_size, (fh, fw), strides=(fh, fw), padding="VALID", name="embedding"
            )(x)
            n, h, w, c = x.shape
            x = jnp.reshape(x, [n, h * w, c])
        elif self.tokenizer.type == "video":
            x, temporal_dimensions = vivit_model.temporal_encode(
                x, self.tokenizer.temporal_encoding_config, self.tokenizer.patches, self.hidden_size
            )
        else:
            raise ValueError("Unknown tokenizer type")

        use_v11 = self.tokenizer.get("use_v11", True)

        if self.tokenizer.use_tokenfuse:
            x = EncoderModFuser(
                mlp_dim=self.mlp_dim,
                num_layers=self.num_layers,
                num_heads=self.num_heads,
                dropout_rate=self.dropout_rate,
                attention_dropout_rate=self.attention_dropout_rate,
                tokenizer_type=self.tokenizer.type,
                num_tokens=self.tokenizer.num_tokens,
                tokenlearner_loc=self.tokenizer.tokenlearner_loc,
                use_v11=use_v11,
                temporal_dimensions=temporal_dimensions,
                dtype=self.dtype,
                name="Transformer",
            )(x, train=train)
        else:
            x = EncoderMod(
                mlp_dim=self.mlp_dim,
                num_layers=self.num_layers,
                num_heads=self.num_heads,
                dropout_rate=self.dropout_rate,
                attention_dropout_rate=self.attention_dropout_rate,
                tokenizer_type=self.tokenizer.type,
                num_tokens=self.tokenizer.num_tokens,
                tokenlearner_loc=self.tokenizer.tokenlearner_loc,
                use_v11=use_v11,
                temporal_dimensions=temporal_dimensions,
                dtype=self.dtype,
                name="Transformer",
            )(x, train=train)

        fn = {"gap": jnp.mean, "gmp": jnp.max, "gsp": jnp.sum}[self.classifier]
        x = fn(x, axis=1)

        if self.representation_size is not None:
            x = nn.Dense(self.representation_size, name="pre_logits")(x)
            x = nn.tanh(x)
        else:
            x = nn_layers.IdentityLayer(name="pre_logits")(x)

        x = nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="output_projection")(
            x
        )
        return x
