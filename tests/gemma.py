"""flax examples/gemma, as written there (google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0):
the nnx Gemma transformer of transformer_cfg.py (its config, the enums, ``ShardingConfig``,
``TransformerConfig`` with ``from_dict`` and the ``gemma3_1b`` preset the tests cut to a tiny
size), sow_lib.py, layers.py (``RMSNorm``), positional_embeddings.py (RoPE), modules.py
(``ScaledEmbed``, ``Attention`` with its left-aligned KV cache, ``FeedForward``, ``Block``),
transformer.py (``Transformer``, ``init_cache``, ``make_causal_attn_mask``,
``build_positions_from_mask``), sampler.py (``Sampler``: a jitted ``lax.while_loop`` over
``_sample_step``, which decodes one token on the cache) and train.py's loss, schedule,
``nnx_train_step`` and ``eval_step``. One module here: the files' prefixes (``modules.``,
``layers.``, ``sow_lib.``, ``positional_embeddings.``, ``transformer_lib.``) dropped. Left out:
the license headers, what loads released checkpoints (``Transformer.from_params`` and its
linen-name mapping, helpers.py, params.py, ``TransformerConfig.from_path``/``from_params``/the
other presets), train.py's ``jax_train_step`` (``nnx_train_step`` by ``jax.value_and_grad``)
and ``train_and_evaluate`` (datasets, orbax, clu); sampler.py's ``import sentencepiece as spm``
too (no dependency here; ``vocab`` is duck-typed: ``pad_id``, ``eos_id``, ``bos_id``,
``EncodeAsIds``, ``DecodeIds``; its annotation a string).
"""

# ruff: noqa: UP007, RUF005, SIM108, B905, UP031, B008, E731, RUF009, UP037, SIM102, SIM910 (the authors' code, as written)

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence
from typing import Any, Union

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import graph, statelib
from jax.experimental.multihost_utils import process_allgather
from jax.sharding import PartitionSpec as P
from jax.sharding import auto_axes
from jaxtyping import Array  # pylint: disable=g-importing-member,g-multiple-import

# -- transformer_cfg.py, as written there --
_NUM_LAYERS_GEMMA3_1B = 26

DEFAULT_ROPE_BASE_FREQUENCY = 10_000
DEFAULT_ROPE_SCALE_FACTOR = 1.0


class QueryPreAttentionNormalisation(enum.Enum):
    """Initialization strategy."""

    # Whether to scale the query by 1/sqrt(head_dim)
    BY_ONE_OVER_SQRT_HEAD_DIM = enum.auto()

    # Whether to scale the query by `embed_dim // num_heads`
    BY_EMBED_DIM_DIV_NUM_HEADS = enum.auto()

    # Whether to scale the query by `1/sqrt(embed_dim // num_heads)`
    BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS = enum.auto()


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


GEMMA3_ATTENTION_PATTERN = (
    AttentionType.LOCAL_SLIDING,
    AttentionType.LOCAL_SLIDING,
    AttentionType.LOCAL_SLIDING,
    AttentionType.LOCAL_SLIDING,
    AttentionType.LOCAL_SLIDING,
    AttentionType.GLOBAL,
)


def make_attention_layers_types(
    pattern: tuple[AttentionType, ...],
    num_layers: int,
) -> tuple[AttentionType, ...]:
    """Returns the list of attention types for every"""

    pattern_size = len(pattern)
    out = pattern * (num_layers // pattern_size)
    if num_layers % pattern_size != 0:
        out += pattern[: num_layers % pattern_size]
    return tuple(out)


@dataclasses.dataclass(slots=True, frozen=True)
class ShardingConfig:
    """Sharding configuration for gemma transformer."""

    emb_vd: P | None = None
    q_weight_ndh: P | None = None
    kv_weight_cndh: P | None = None
    qkv_weight_cndh: P | None = None
    o_weight_nhd: P | None = None
    ffw_weight_df: P | None = None
    ffw_weight_fd: P | None = None
    rms_norm_weight: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None
    act_btnh: P | None = None
    act_sbtnh: P | None = None

    fsdp_axis_name: str = "fsdp"
    tensor_parallel_axis_name: str = "tensor"

    @staticmethod
    def no_sharding():
        return ShardingConfig()

    @staticmethod
    def fsdp_tp_sharding(
        is_sampling: bool = False,
        fsdp_axis_name: str = "fsdp",
        tensor_parallel_axis_name: str = "tp",
    ):
        fsdp = fsdp_axis_name if not is_sampling else None
        tp = tensor_parallel_axis_name

        return ShardingConfig(
            emb_vd=P(tp, fsdp),
            q_weight_ndh=P(tp, fsdp, None),
            kv_weight_cndh=P(None, tp, fsdp, None),
            qkv_weight_cndh=P(None, tp, fsdp, None),
            o_weight_nhd=P(tp, None, fsdp),
            ffw_weight_df=P(fsdp, tp),
            ffw_weight_fd=P(tp, fsdp),
            rms_norm_weight=P(
                tp,
            ),
            act_btd=P(fsdp, None, None if is_sampling else tp),
            act_btf=P(fsdp, None, tp),
            act_btnh=P(fsdp, None, tp, None),
            act_sbtnh=P(None, fsdp, None, tp, None),
            tensor_parallel_axis_name=tensor_parallel_axis_name,
            fsdp_axis_name=fsdp_axis_name,
        )


@dataclasses.dataclass(slots=True, frozen=True)
class TransformerConfig:
    """Configuration for the text-only gemma transformer."""

    num_layers: int
    num_embed: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    final_logit_softcap: float | None
    use_post_attn_norm: bool
    use_post_ffw_norm: bool
    attention_types: Iterable[AttentionType]
    query_pre_attn_norm: QueryPreAttentionNormalisation = (
        QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM
    )
    attn_logits_soft_cap: float | None = None
    transpose_gating_einsum: bool = False
    local_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY
    global_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY
    local_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR
    global_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR
    use_qk_norm: bool = False
    sliding_window_size: int | None = None
    dtype: Any = jnp.float32
    weight_dtype: Any = jnp.float32
    dropout_rate: float = 0.0

    shd_config: ShardingConfig = ShardingConfig.no_sharding()

    def query_pre_attn_scalar(self) -> float:
        """Returns the scalar to multiply the query by before attention."""
        match self.query_pre_attn_norm:
            case QueryPreAttentionNormalisation.BY_EMBED_DIM_DIV_NUM_HEADS:
                return self.embed_dim // self.num_heads
            case QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS:  # pylint: disable=line-too-long
                return (self.embed_dim // self.num_heads) ** -0.5
            case QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM | _:
                return self.head_dim**-0.5

    @classmethod
    def from_dict(cls, **config: Any) -> "TransformerConfig":
        # Deserialize query_pre_attn_norm values:
        if "query_pre_attn_norm" in config:
            config["query_pre_attn_norm"] = QueryPreAttentionNormalisation(
                config["query_pre_attn_norm"]
            )
        else:
            config["query_pre_attn_norm"] = QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM
        return cls(**config)

    @classmethod
    def gemma3_1b(cls, **override):
        num_layers = _NUM_LAYERS_GEMMA3_1B
        config = {
            "num_layers": num_layers,
            "final_logit_softcap": None,
            "num_embed": 262144,
            "embed_dim": 1152,
            "hidden_dim": 6 * 1152,
            "num_heads": 4,
            "head_dim": 256,
            "num_kv_heads": 1,
            "use_post_attn_norm": True,
            "use_post_ffw_norm": True,
            "use_qk_norm": True,
            "attention_types": make_attention_layers_types(GEMMA3_ATTENTION_PATTERN, num_layers),
            "query_pre_attn_norm": (QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM),
            "attn_logits_soft_cap": None,
            "sliding_window_size": 512,
            "transpose_gating_einsum": True,
            "local_base_frequency": 10_000,
            "global_base_frequency": 1_000_000,
        }
        for key, value in override.items():
            config[key] = value
        return cls(**config)

    def __post_init__(self):
        if self.num_heads != self.num_kv_heads:
            if self.num_heads % self.num_kv_heads != 0:
                raise ValueError(
                    f"Number of query heads ({self.num_heads}) must be divisible by "
                    f"number of key/value heads ({self.num_kv_heads})."
                )


# -- sow_lib.py, as written there --
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerIntermediates:
    """Intermediate activations for a single layer."""

    # Dense residual stream activations.
    rs_after_attention: jax.Array | None = None
    rs_after_ffw: jax.Array | None = None

    # Sparse representations for large activations.
    mlp_hidden_topk_values: jax.Array | None = None
    mlp_hidden_topk_indices: jax.Array | None = None
    attn_logits_topk_values: jax.Array | None = None
    attn_logits_topk_indices: jax.Array | None = None

    def merge(self, decoding_step, layer: nnx.State):
        """Merges the intermediate activations from one step."""

        for field in dataclasses.fields(self.__class__):
            value = getattr(self, field.name)
            if value is None:
                continue
            # We put mlp and attn intermediates into this class without any further
            # nesting. So we have to retrieve the intermediates from the correct
            # sub-module.
            try:
                if field.name.startswith("attn_"):
                    step_value = getattr(layer.attn, field.name.replace("attn_", ""))[0]
                elif field.name.startswith("mlp_"):
                    step_value = getattr(layer.mlp, field.name.replace("mlp_", ""))[0]
                else:
                    step_value = getattr(layer, field.name)[0]
            except AttributeError as exc:
                raise ValueError(
                    f"Intermediate {field.name} is not in the step intermediates."
                ) from exc
            # This logic is the same for all intermediates. The second dimenions is
            # the length dimension, where we want to merge the intermediates from
            # multiple steps.
            setattr(
                self,
                field.name,
                value.at[:, decoding_step + 1].set(step_value[:, 0, ...]),
            )

    def trim(self, max_length: int):
        """Trims the intermediate activations to the given length."""
        for field in dataclasses.fields(self.__class__):
            value = getattr(self, field.name)
            if value is not None:
                setattr(self, field.name, value[:, :max_length, ...])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TransformerIntermediates:
    """Intermediate activations of a transformer network."""

    # Embeddings of the input tokens.
    embeddings: jax.Array | None = None

    # Intermediate activations of each layer.
    layers: list[LayerIntermediates] = dataclasses.field(default_factory=list)

    def merge(self, decoding_step, intermediates: nnx.State):
        """Merges the intermediate activations from one step."""
        if self.embeddings is not None:
            try:
                self.embeddings = self.embeddings.at[:, decoding_step + 1, ...].set(
                    intermediates.embeddings[0][:, 0, ...]
                )
            except AttributeError as exc:
                raise ValueError("Embeddings are not in the step intermediates.") from exc
        if len(self.layers) != len(intermediates.layers):
            raise ValueError("Number of layers in the transformer and intermediates do not match.")
        for layer_intermediates, layer_idx in zip(self.layers, intermediates.layers):
            layer_module = intermediates.layers[layer_idx]
            layer_intermediates.merge(decoding_step, layer_module)

    def trim(self, max_length: int):
        """Trims the intermediate activations to the given length."""
        if self.embeddings is not None:
            self.embeddings = self.embeddings[:, :max_length, ...]
        for layer in self.layers:
            layer.trim(max_length)


@dataclasses.dataclass(frozen=True)
class SowConfig:
    """Module for sowing intermediate activations."""

    # Whether to sow embeddings.
    embeddings: bool = False

    # Whether to sow activations after each attention block (in residual stream).
    rs_after_attention: bool = False

    # Whether to sow activations after each FFW block (in residual stream).
    # This is the same as the residual stream activations after a whole layer.
    rs_after_ffw: bool = False

    # If non-zero, top-k activations in a ffw hidden layer are sowed.
    # We use a sparse representation here to save memory.
    mlp_hidden_topk: int = 0

    # If non-zero, top-k attention logits are sowed.
    # We use a sparse representation here to save memory.
    attn_logits_topk: int = 0

    def is_enabled(self):
        return any(
            [
                self.embeddings,
                self.rs_after_attention,
                self.rs_after_ffw,
                self.mlp_hidden_topk,
                self.attn_logits_topk,
            ]
        )

    def maybe_sow_embeddings(
        self,
        embeddings: jax.Array,
        module: nnx.Module,
    ):
        """Sows embeddings if configured."""
        if self.embeddings:
            module.sow(nnx.Intermediate, "embeddings", embeddings)

    def maybe_sow_rs_after_attention(
        self,
        activations: jax.Array,
        module: nnx.Module,
    ):
        """Sows activations after attention if configured."""
        if self.rs_after_attention:
            module.sow(nnx.Intermediate, "rs_after_attention", activations)

    def maybe_sow_rs_after_ffw(
        self,
        activations: jax.Array,
        module: nnx.Module,
    ):
        """Sows activations after FFW if configured."""
        if self.rs_after_ffw:
            module.sow(nnx.Intermediate, "rs_after_ffw", activations)

    def maybe_sow_mlp_hidden_topk(
        self,
        activations: jax.Array,
        module: nnx.Module,
    ):
        """Sows top-absolute-k activations in a mlp hidden layer if configured."""
        if self.mlp_hidden_topk:
            shd = jax.typeof(activations).sharding
            top_k = lambda x: jax.lax.top_k(x, self.mlp_hidden_topk)
            _, indices = auto_axes(out_sharding=shd)(top_k)(jnp.abs(activations))
            take_aa = lambda x, i, axis: jnp.take_along_axis(x, i, axis)
            values = auto_axes(out_sharding=shd)(take_aa)(activations, indices, axis=-1)
            module.sow(nnx.Intermediate, "hidden_topk_values", values)
            module.sow(nnx.Intermediate, "hidden_topk_indices", indices)

    def maybe_sow_attn_logits_topk(
        self,
        logits: jax.Array,
        module: nnx.Module,
    ):
        """Sows top-k attention logits if configured."""
        if self.attn_logits_topk:
            shd = jax.typeof(logits).sharding
            top_k = lambda x: jax.lax.top_k(x, self.attn_logits_topk)
            values, indices = auto_axes(out_sharding=shd)(top_k)(logits)
            module.sow(nnx.Intermediate, "logits_topk_values", values)
            module.sow(nnx.Intermediate, "logits_topk_indices", indices)


def init_intermediates(
    batch_size: int,
    buffer_size: int,
    embed_dim: int,
    num_layers: int,
    num_heads: int,
    sow_config: SowConfig,
    dtype: jnp.dtype = jnp.float32,
) -> TransformerIntermediates:
    """Initializes the intermediate activations that will be filled."""
    intermediates = TransformerIntermediates()
    residual_stream_dummy = jnp.zeros(
        (batch_size, buffer_size, embed_dim),
        dtype=dtype,
    )
    if sow_config.embeddings:
        intermediates.embeddings = residual_stream_dummy
    for _ in range(num_layers):
        layer_intermediates = LayerIntermediates()
        if sow_config.rs_after_attention:
            layer_intermediates.rs_after_attention = residual_stream_dummy
        if sow_config.rs_after_ffw:
            layer_intermediates.rs_after_ffw = residual_stream_dummy
        if sow_config.attn_logits_topk:
            shape = (
                batch_size,
                buffer_size,
                num_heads,
                sow_config.attn_logits_topk,
            )
            layer_intermediates.attn_logits_topk_values = jnp.zeros(
                shape,
                dtype=dtype,
            )
            layer_intermediates.attn_logits_topk_indices = jnp.zeros(
                shape,
                dtype=jnp.int32,
            )
        if sow_config.mlp_hidden_topk:
            shape = (
                batch_size,
                buffer_size,
                sow_config.mlp_hidden_topk,
            )
            layer_intermediates.mlp_hidden_topk_values = jnp.zeros(
                shape,
                dtype=dtype,
            )
            layer_intermediates.mlp_hidden_topk_indices = jnp.zeros(
                shape,
                dtype=jnp.int32,
            )
        intermediates.layers.append(layer_intermediates)
    return intermediates


# -- layers.py, as written there --
Shape = Sequence[Union[int, Any]]


class RMSNorm(nnx.Module):
    """RMSNorm layer."""

    def __init__(
        self,
        dim: int,
        *,
        scale_init: nnx.Initializer = nnx.initializers.zeros_init(),
        scale_metadata: dict[str, Any] | None = None,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        weight_dtype: Any = jnp.float32,
    ):
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        scale_metadata = scale_metadata if scale_metadata else {}
        self.scale = nnx.Param(
            scale_init(rngs.params(), dim, weight_dtype),
            **scale_metadata,  # pyrefly: ignore[bad-argument-type]
        )

    def __call__(self, x: Array) -> Array:
        x = jnp.asarray(x, jnp.float32)
        mean2 = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        normed_inputs = jnp.asarray(x * jax.lax.rsqrt(mean2 + 1e-06), dtype=self.dtype)
        scale = jnp.asarray(self.scale, self.dtype)
        normed_inputs = normed_inputs * (1.0 + scale)
        return normed_inputs


# -- positional_embeddings.py, as written there --
_MAX_WAVELENGTH = 10_000


def add_positional_embedding(
    input_embedding: jax.Array,
    position: int,
    max_wavelength: int = _MAX_WAVELENGTH,
) -> jax.Array:
    """Adds positional embeddings to input embeddings."""
    embed_dim = input_embedding.shape[-1]
    num_timescales = embed_dim // 2
    log_timescale_increment = jnp.log(float(max_wavelength)) / jnp.maximum(
        jnp.asarray(num_timescales, dtype=jnp.float32) - 1, 1
    )
    inv_timescales = jnp.exp(
        jnp.arange(num_timescales, dtype=jnp.float32) * -log_timescale_increment
    )
    scaled_time = position * inv_timescales
    signal = jnp.concatenate([jnp.sin(scaled_time), jnp.cos(scaled_time)])
    signal = jnp.pad(signal, [[0, jnp.mod(embed_dim, 2)]])
    position_embedding = signal.astype(jnp.float32)

    return input_embedding + position_embedding


def apply_rope(
    inputs: jax.Array,  # [B, L]
    positions: jax.Array,  # [B, L]
    head_dim: int,
    max_wavelength: int = _MAX_WAVELENGTH,
    scale_factor: float = 1.0,
) -> jax.Array:
    """Applies RoPE."""
    fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
    timescale = max_wavelength**fraction

    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
    if scale_factor < 1.0:
        raise ValueError(f"scale_factor must be >= 1.0, got {scale_factor}")
    sinusoid_inp /= scale_factor

    sin = jnp.sin(sinusoid_inp)
    cos = jnp.cos(sinusoid_inp)

    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    out = jnp.concatenate([first_part, second_part], axis=-1)
    return out.astype(inputs.dtype)


# -- modules.py, as written there --
LayerCache = dict[str, Array]
Shape = Sequence[Union[int, Any]]

K_MASK = -2.3819763e38  # Set to a large negative number.


class ScaledEmbed(nnx.Embed):
    def __call__(self, x: Array, out_sharding=None) -> Array:
        x = super().__call__(x, out_sharding)
        x *= jnp.sqrt(x.shape[-1])
        return x

    @property
    def embed_dim(self):
        return self.features

    @property
    def num_embed(self):
        return self.num_embeddings


class Attention(nnx.Module):
    """Attention module."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        features: int,
        head_dim: int,
        query_pre_attn_scalar: float,
        attn_type: AttentionType,
        *,
        rngs: nnx.Rngs,
        rope_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY,
        rope_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR,
        attn_logits_soft_cap: float | None = None,
        sliding_window_size: int | None = None,
        use_qk_norm: bool = False,
        sow_config: SowConfig = SowConfig(),
        shd_config: ShardingConfig,
        dtype: jnp.dtype = jnp.float32,
        weight_dtype: jnp.dtype = jnp.float32,
        dropout_rate: float = 0.0,
    ):
        if attn_type == AttentionType.LOCAL_SLIDING and sliding_window_size is None:
            raise ValueError("`sliding_window_size` must be set if `attn_type` is Local Sliding.")

        self.shd_config = shd_config
        self.query_pre_attn_scalar = query_pre_attn_scalar
        self.attn_type = attn_type
        self.sliding_window_size = sliding_window_size
        self.attn_logits_soft_cap = attn_logits_soft_cap
        self.attn_vec_einsum = nnx.Einsum(
            einsum_str="BTNH,NHD->BTD",
            kernel_shape=(num_heads, head_dim, features),
            kernel_metadata={
                "out_sharding": shd_config.o_weight_nhd,
            },
            dtype=dtype,
            param_dtype=weight_dtype,
            rngs=rngs,
        )
        self.rope_base_frequency = rope_base_frequency
        self.rope_scale_factor = rope_scale_factor
        self.use_qk_norm = use_qk_norm
        self.sow_config = sow_config
        self.shd_config = shd_config

        self.act_cbtkh_shd = None
        if num_heads == num_kv_heads:
            self.qkv_einsum = nnx.Einsum(
                einsum_str="BTD,SNDH->SBTNH",
                kernel_shape=(3, num_heads, features, head_dim),
                kernel_metadata={
                    "out_sharding": shd_config.qkv_weight_cndh,
                },
                dtype=dtype,
                param_dtype=weight_dtype,
                rngs=rngs,
            )
        else:
            if num_heads % num_kv_heads != 0:
                raise ValueError(
                    f"Number of query heads ({num_heads}) must be divisible by "
                    f"number of key/value heads ({num_kv_heads})."
                )
            self.q_einsum = nnx.Einsum(
                einsum_str="BTD,NDH->BTNH",
                kernel_shape=(num_heads, features, head_dim),
                kernel_metadata={"out_sharding": shd_config.q_weight_ndh},
                dtype=dtype,
                param_dtype=weight_dtype,
                rngs=rngs,
            )
            kv_kernel_sharding = None
            if shd_config.kv_weight_cndh:
                self.act_cbtkh_shd = (
                    self.shd_config.act_sbtnh
                    if num_kv_heads > 1
                    else jax.P(None, shd_config.fsdp_axis_name, None, None, None)
                )
                kv_kernel_sharding = (
                    shd_config.kv_weight_cndh
                    if num_kv_heads > 1
                    else jax.P(None, None, shd_config.fsdp_axis_name, None)
                )
            self.kv_einsum = nnx.Einsum(
                einsum_str="BTD,CKDH->CBTKH",
                kernel_shape=(2, num_kv_heads, features, head_dim),
                kernel_metadata={"out_sharding": kv_kernel_sharding},
                dtype=dtype,
                param_dtype=weight_dtype,
                rngs=rngs,
            )

        if self.use_qk_norm:
            self._query_norm = RMSNorm(
                head_dim,
                dtype=dtype,
                weight_dtype=weight_dtype,
                rngs=rngs,
            )
            self._key_norm = RMSNorm(
                head_dim,
                dtype=dtype,
                weight_dtype=weight_dtype,
                rngs=rngs,
            )

        self.dropout = nnx.Dropout(dropout_rate)

    def __call__(
        self,
        x: Array,
        segment_pos: Array,
        cache: LayerCache | None,
        attn_mask: Array,
        rngs: nnx.Rngs | None = None,
    ) -> tuple[LayerCache | None, Array]:
        seq_len = x.shape[1]

        if self.use_qkv_einsum:
            query_proj, key_proj, value_proj = self.qkv_einsum(
                x, out_sharding=self.shd_config.act_sbtnh
            )
        else:
            query_proj = self.q_einsum(x, out_sharding=self.shd_config.act_btnh)
            key_proj, value_proj = self.kv_einsum(x, out_sharding=self.act_cbtkh_shd)

        if self.use_qk_norm:
            query_proj = self._query_norm(query_proj)
            key_proj = self._key_norm(key_proj)

        query_proj = apply_rope(
            query_proj,
            segment_pos,
            head_dim=self.head_dim,
            max_wavelength=self.rope_base_frequency,
            scale_factor=self.rope_scale_factor,
        )
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(
            key_proj,
            segment_pos,
            head_dim=self.head_dim,
            max_wavelength=self.rope_base_frequency,
            scale_factor=self.rope_scale_factor,
        )

        # Cache is left aligned.
        if cache is not None:
            end_index = cache["end_index"][0]
            slice_indices = (0, end_index % cache["v"].shape[1], 0, 0)
            value_proj = jax.lax.dynamic_update_slice(
                cache["v"],
                value_proj,
                slice_indices,
            )
            key_proj = jax.lax.dynamic_update_slice(cache["k"], key_proj, slice_indices)

        use_gqa = self.num_heads > self.num_kv_heads and self.num_kv_heads > 1
        if use_gqa:
            # Reshape matrices to enable einsums over groups.
            num_groups = self.num_heads // self.num_kv_heads
            batch_size, seq_size, _, head_dim = query_scaled.shape
            query_scaled = query_scaled.reshape(
                (batch_size, seq_size, self.num_kv_heads, num_groups, head_dim)
            )
            logits = jnp.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj)
            logits = logits.reshape((batch_size, seq_size, self.num_heads, -1))
        else:
            logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled, key_proj)

        if self.attn_logits_soft_cap is not None:
            logits = jnp.tanh(logits / self.attn_logits_soft_cap)
            logits = logits * self.attn_logits_soft_cap
        if self.attn_type == AttentionType.LOCAL_SLIDING:
            if self.sliding_window_size is None:
                raise ValueError("sliding_window_size must be set if attn_type is Local Sliding.")

            # workaround for a bug with triu/tril if all_ones is explicitly sharded
            # all_ones = jnp.ones_like(attn_mask)
            all_ones = jnp.ones(attn_mask.shape, dtype=attn_mask.dtype)
            sliding_mask = jnp.triu(all_ones, -1 * self.sliding_window_size + 1) * jnp.tril(
                all_ones, self.sliding_window_size - 1
            )
            attn_mask = sliding_mask * attn_mask

        padded_logits = jnp.where((jnp.expand_dims(attn_mask, -2)), logits, K_MASK)
        self.sow_config.maybe_sow_attn_logits_topk(padded_logits, self)
        probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)

        probs = self.dropout(probs, rngs=rngs)

        if use_gqa:
            # Reshape matrices to enable einsums over groups.
            num_groups = self.num_heads // self.num_kv_heads
            batch_size, seq_size1, _, _ = probs.shape
            probs = probs.reshape((batch_size, seq_size1, self.num_kv_heads, num_groups, -1))
            encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value_proj)
            encoded = encoded.reshape(
                (batch_size, seq_size, self.num_heads, head_dim)  # pyrefly: ignore[unbound-name]
            )
        else:
            encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value_proj)
        attn_output = self.attn_vec_einsum(encoded, out_sharding=self.shd_config.act_btd)

        if cache is not None:
            new_cache = {
                "v": value_proj,
                "k": key_proj,
                "end_index": cache["end_index"] + seq_len,
            }
        else:
            new_cache = None

        return new_cache, attn_output

    @property
    def head_dim(self):
        return self.attn_vec_einsum.kernel.shape[1]

    @property
    def num_heads(self):
        return (
            self.qkv_einsum.kernel.shape[1]
            if self.use_qkv_einsum
            else self.q_einsum.kernel.shape[0]
        )

    @property
    def num_kv_heads(self):
        return (
            self.qkv_einsum.kernel.shape[1]
            if self.use_qkv_einsum
            else self.kv_einsum.kernel.shape[1]
        )

    @property
    def use_qkv_einsum(self):
        return hasattr(self, "qkv_einsum") and self.qkv_einsum is not None

    def init_cache(
        self,
        cache_size: int,
        batch_size: int,
        dtype: jnp.dtype = jnp.float32,
    ) -> LayerCache:
        out_sharding = None if self.act_cbtkh_shd is None else jax.P(*self.act_cbtkh_shd[1:])
        return {
            "v": jnp.zeros(
                (batch_size, cache_size, self.num_kv_heads, self.head_dim),
                dtype=dtype,
                out_sharding=out_sharding,
            ),
            "k": jnp.zeros(
                (batch_size, cache_size, self.num_kv_heads, self.head_dim),
                dtype=dtype,
                out_sharding=out_sharding,
            ),
            "end_index": jnp.zeros((batch_size,), dtype=jnp.int32),
        }


class FeedForward(nnx.Module):
    """Feed forward module."""

    def __init__(
        self,
        features: int,
        hidden_dim: int,
        *,
        kernel_init: nnx.Initializer = nnx.initializers.normal(),
        rngs: nnx.Rngs,
        sow_config: SowConfig = SowConfig(),
        shd_config: ShardingConfig,
        dtype: jnp.dtype = jnp.float32,
        weight_dtype: jnp.dtype = jnp.float32,
        dropout_rate: float = 0.0,
    ):
        self.gate_proj = nnx.Linear(
            in_features=features,
            out_features=hidden_dim,
            use_bias=False,
            rngs=rngs,
            kernel_init=kernel_init,
            kernel_metadata={"out_sharding": shd_config.ffw_weight_df},
            dtype=dtype,
            param_dtype=weight_dtype,
        )
        self.up_proj = nnx.Linear(
            in_features=features,
            out_features=hidden_dim,
            use_bias=False,
            rngs=rngs,
            kernel_init=kernel_init,
            kernel_metadata={"out_sharding": shd_config.ffw_weight_df},
            dtype=dtype,
            param_dtype=weight_dtype,
        )
        self.down_proj = nnx.Linear(
            in_features=hidden_dim,
            out_features=features,
            use_bias=False,
            rngs=rngs,
            kernel_init=kernel_init,
            kernel_metadata={"out_sharding": shd_config.ffw_weight_fd},
            dtype=dtype,
            param_dtype=weight_dtype,
        )
        self.dropout = nnx.Dropout(dropout_rate)
        self.sow_config = sow_config
        self.shd_config = shd_config

    def __call__(self, x: Array, rngs: nnx.Rngs | None = None) -> Array:
        ff_gate = self.gate_proj(x, out_sharding=self.shd_config.act_btf)
        gate_value = nnx.gelu(ff_gate)

        ff1 = self.up_proj(x, out_sharding=self.shd_config.act_btf)
        activations = gate_value * ff1
        self.sow_config.maybe_sow_mlp_hidden_topk(activations, self)

        activations = self.dropout(activations, rngs=rngs)
        outputs = self.down_proj(activations, out_sharding=self.shd_config.act_btd)
        return outputs


class Block(nnx.Module):
    """Transformer block."""

    def __init__(
        self,
        config: TransformerConfig,
        attn_type: AttentionType,
        *,
        rngs: nnx.Rngs,
        sow_config: SowConfig = SowConfig(),
    ):
        num_heads = config.num_heads
        num_kv_heads = config.num_kv_heads
        embed_dim = config.embed_dim
        head_dim = config.head_dim
        hidden_dim = config.hidden_dim
        sliding_window_size = config.sliding_window_size
        use_post_attn_norm = config.use_post_attn_norm
        use_post_ffw_norm = config.use_post_ffw_norm
        query_pre_attn_scalar = config.query_pre_attn_scalar()
        if attn_type == AttentionType.LOCAL_SLIDING:
            rope_base_frequency = config.local_base_frequency
            rope_scale_factor = config.local_scale_factor
        else:
            rope_base_frequency = config.global_base_frequency
            rope_scale_factor = config.global_scale_factor

        attn_logits_soft_cap = config.attn_logits_soft_cap
        use_qk_norm = config.use_qk_norm
        dtype = config.dtype
        weight_dtype = config.weight_dtype

        self.pre_attention_norm = RMSNorm(
            embed_dim,
            scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
            rngs=rngs,
            dtype=dtype,
            weight_dtype=weight_dtype,
        )
        self.attn = Attention(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            features=embed_dim,
            head_dim=head_dim,
            query_pre_attn_scalar=query_pre_attn_scalar,
            attn_type=attn_type,
            rope_base_frequency=rope_base_frequency,
            rope_scale_factor=rope_scale_factor,
            attn_logits_soft_cap=attn_logits_soft_cap,
            sliding_window_size=sliding_window_size,
            rngs=rngs,
            use_qk_norm=use_qk_norm,
            sow_config=sow_config,
            shd_config=config.shd_config,
            dtype=dtype,
            weight_dtype=weight_dtype,
            dropout_rate=config.dropout_rate,
        )
        if use_post_attn_norm:
            self.post_attention_norm = RMSNorm(
                embed_dim,
                scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
                rngs=rngs,
                dtype=dtype,
                weight_dtype=weight_dtype,
            )
        else:
            self.post_attention_norm = None

        self.pre_ffw_norm = RMSNorm(
            embed_dim,
            scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
            rngs=rngs,
            dtype=dtype,
            weight_dtype=weight_dtype,
        )
        self.mlp = FeedForward(
            features=embed_dim,
            hidden_dim=hidden_dim,
            rngs=rngs,
            sow_config=sow_config,
            shd_config=config.shd_config,
            dtype=dtype,
            weight_dtype=weight_dtype,
            dropout_rate=config.dropout_rate,
        )
        if use_post_ffw_norm:
            self.post_ffw_norm = RMSNorm(
                embed_dim,
                scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
                rngs=rngs,
                dtype=dtype,
                weight_dtype=weight_dtype,
            )
        else:
            self.post_ffw_norm = None

        self.dropout = nnx.Dropout(config.dropout_rate)
        self.sow_config = sow_config

    def __call__(
        self,
        x: jax.Array,
        segment_pos: jax.Array,
        cache: LayerCache | None,
        attn_mask: jax.Array,
        rngs: nnx.Rngs | None = None,
    ) -> tuple[LayerCache | None, jax.Array]:

        # Attention.
        attn_inputs = self.pre_attention_norm(x)
        cache, attn_output = self.attn(
            attn_inputs,
            segment_pos,
            cache,
            attn_mask,
            rngs=rngs,
        )
        if self.post_attention_norm is not None:
            attn_output = self.post_attention_norm(attn_output)
        x += attn_output
        self.sow_config.maybe_sow_rs_after_attention(x, self)

        # Feed forward.
        ffw_inputs = self.pre_ffw_norm(x)
        ffw_outputs = self.mlp(ffw_inputs, rngs=rngs)
        if self.post_ffw_norm is not None:
            ffw_outputs = self.post_ffw_norm(ffw_outputs)
        x += ffw_outputs
        x = self.dropout(x, rngs=rngs)
        self.sow_config.maybe_sow_rs_after_ffw(x, self)

        return cache, x

    def init_cache(
        self,
        cache_size: int,
        batch_size: int,
        dtype: jnp.dtype = jnp.float32,
    ) -> LayerCache:
        return self.attn.init_cache(
            cache_size=cache_size,
            batch_size=batch_size,
            dtype=dtype,
        )


# -- transformer.py, as written there --
Cache = dict[str, LayerCache]


class Transformer(nnx.Module):
    """Gemma text-only transformer."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        rngs: nnx.Rngs,
        sow_config: SowConfig = SowConfig(),
    ):
        self.embedder = ScaledEmbed(
            config.num_embed,
            config.embed_dim,
            dtype=config.dtype,
            param_dtype=config.weight_dtype,
            rngs=rngs,
            embedding_metadata={"out_sharding": config.shd_config.emb_vd},
        )
        self.layers = nnx.List(
            [
                Block(
                    config=config,
                    attn_type=attn_type,
                    sow_config=sow_config,
                    rngs=rngs,
                )
                for _, attn_type in zip(range(config.num_layers), config.attention_types)
            ]
        )
        self.final_norm = RMSNorm(
            config.embed_dim,
            scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
            rngs=rngs,
            dtype=config.dtype,
            weight_dtype=config.weight_dtype,
        )
        self.final_dropout = nnx.Dropout(config.dropout_rate, deterministic=False)
        self.final_logits_softcap = config.final_logit_softcap
        self.config = config
        self.sow_config = sow_config
        self.shd_config = config.shd_config

    def __call__(
        self,
        last_tokens: Array,  # [B, L]
        positions: Array,  # [B, L]
        cache: Cache | None,  # (sequence length L')
        attention_mask: Array,  # [B, L, L']
        rngs: nnx.Rngs | None = None,
    ) -> tuple[Array, Cache | None]:
        """Transformer forward pass.

        You can run this forward pass two ways: with or without an attention kv
        cache.

        Args:
          last_tokens: input sequence of tokens.
          positions: input absolute positions.
          cache: Attention KV cache or None.
          attention_mask: transformer input mask.
          rngs: optional rngs to pass in stochastic layers

        Returns:
          predicted_logits, new_cache

          predicted_logits: output logits predicted by the model
          new_cache: updated cache if the input cache is not None, None elsewhere.
        """
        new_cache = None if cache is None else {}
        x = self.embedder(last_tokens, out_sharding=self.shd_config.act_btd)
        self.sow_config.maybe_sow_embeddings(x, self)

        for i, layer in enumerate(self.layers):
            layer_name = f"layer_{i}"
            layer_cache = cache[layer_name] if cache else None
            layer_cache, x = layer(
                x,
                positions,
                layer_cache,
                attention_mask,
                rngs=rngs,
            )
            if cache is not None:
                new_cache[layer_name] = layer_cache  # pytype: disable=container-type-mismatch

        x = self.final_norm(x)
        x = self.final_dropout(x, rngs=rngs)
        logits = self.embedder.attend(x, out_sharding=self.shd_config.act_btd)

        if self.final_logits_softcap is not None:
            logits /= self.final_logits_softcap
            logits = jnp.tanh(logits) * self.final_logits_softcap

        return logits, new_cache  # pytype: disable=bad-return-type

    @property
    def embed_dim(self) -> int:
        return self.embedder.embed_dim

    @property
    def num_embed(self) -> int:
        return self.embedder.num_embed

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def init_cache(
        self,
        cache_size: int,
        batch_size: int,
        dtype: jnp.dtype = jnp.float32,
    ) -> Cache:
        """Initializes a new Transformer cache."""
        return {
            f"layer_{i}": self.layers[i].init_cache(
                cache_size=cache_size,
                batch_size=batch_size,
                dtype=dtype,
            )
            for i in range(self.num_layers)
        }


def make_causal_attn_mask(
    input_mask: Array,
) -> Array:
    """Attention mask in batch mode.

    Args:
      input_mask: Input mask for the input. True for non-padded tokens only, else
        False.

    Returns:
      Attention mask.
    """
    seq_len = input_mask.shape[-1]
    attn_mask = input_mask[..., None, :]
    causal_mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))
    # Prefixes can be attended by all tokens
    attn_mask *= causal_mask[None, ...]
    return attn_mask


def build_positions_from_mask(input_mask: Array) -> Array:
    """Computes the `positions` from the `input_mask`.

    Args:
      input_mask: The tokens `input_mask`, True for non-padded tokens only.

    Returns:
      The indices to use for RoPE and absolute position encodings for the given
      input mask.
    """
    positions = jnp.cumsum(input_mask, axis=-1)
    # Subtract one for all positions from the first valid one as they are
    # 0-indexed
    return positions - (positions >= 1)


# -- sampler.py, as written there --
def _sample_top_p(probs: jnp.ndarray, p: float, key: jax.Array) -> jnp.ndarray:
    """Sample a token using top-p sampling."""
    probs_sorted, indices = jax.lax.top_k(probs, k=probs.shape[-1])
    cumsum_probs = jnp.cumsum(probs_sorted, axis=-1)
    mask = cumsum_probs - probs_sorted > p
    probs_sorted = jnp.where(mask, 0.0, probs_sorted)
    probs_sorted /= jnp.sum(probs_sorted, axis=-1, keepdims=True)

    next_token = jax.random.categorical(key, logits=jnp.log(probs_sorted))

    next_token = jnp.take_along_axis(indices, next_token[..., None], axis=-1)
    next_token = jnp.squeeze(next_token, axis=-1)
    return next_token


def _compute_attention_masks(
    time_step: jax.Array, seq_len: int, input_mask: jax.Array
) -> jax.Array:
    """Computes causal attention mask."""
    batch_size = input_mask.shape[0]
    batch_time_step = jnp.full((batch_size, 1), time_step, dtype=jnp.uint32)
    causal_padding = jnp.greater(jnp.expand_dims(jnp.arange(seq_len), 0), batch_time_step)
    max_seq_len = min(input_mask.shape[-1], seq_len)
    input_mask = jax.lax.dynamic_slice(
        input_mask,
        (0, jnp.maximum(time_step - seq_len + 1, 0)),
        (batch_size, max_seq_len),
    )
    input_mask = (
        jnp.zeros((batch_size, seq_len), dtype=jnp.bool_).at[:, :max_seq_len].set(input_mask)
    )

    causal_padding = jnp.logical_or(causal_padding, input_mask)
    attention_mask = causal_padding[:, jnp.newaxis, :].astype(jnp.bool_)

    return ~attention_mask


@flax.struct.dataclass
class _SamplingState:
    """Internal sampling state."""

    # Decoding step.
    decoding_step: jnp.int32

    # Number of tokens in the prompt.
    num_input_tokens: jnp.ndarray  # [B]

    # Fixed-size buffer for accumulating the output tokens.
    token_buffer: jnp.ndarray  # [B, L]

    # Position indices, based on ignoring pad tokens.
    positions: jnp.ndarray  # [B, L]

    # Model state for conditioning the model on autoregressively.
    cache: dict[str, LayerCache]

    # Is decoding done on the given sequence?
    done: jnp.ndarray  # [B]

    # Total sampling steps (including the prompt).
    total_sampling_steps: int

    # Fixed-size buffer for accumulating the output logits.
    logits_buffer: jnp.ndarray | None  # [B, L, V]

    # List of tokens that are forbidden to be generated.
    forbidden_token_ids: Sequence[int] | None

    # Intermediate activations from the model if requested.
    intermediates: TransformerIntermediates | None

    # Random seed for sampling.
    seed: jax.Array

    # Tempurature for top_p sampling.
    temperature: float = flax.struct.field(pytree_node=False)

    # Top-p sampling threshold.
    top_p: float = flax.struct.field(pytree_node=False)


@dataclasses.dataclass
class SamplerOutput:
    """Output of the sampler."""

    # Decoded samples from the model.
    text: list[str]

    # Per-step logits used during sampling.
    logits: list[list[float]]

    # Tokens corresponding to the generated samples.
    tokens: list[list[int]]

    # Intermediate activations from the model if requested.
    intermediates: TransformerIntermediates | None = None


class Sampler:
    """Sampler for gemma transformer."""

    def __init__(
        self,
        *,
        vocab: spm.SentencePieceProcessor,  # noqa: F821 - sentencepiece, left out
        cache_size: int = 1024,
        transformer: Transformer | None = None,
    ):
        """Initializes a sampler for a Gemma model.

        Args:
          transformer: an instance of the Gemma transformer.
          vocab: vocabulary of the given model.
          cache_size: size of the cache for the transformer.
        """
        self.vocab = vocab
        self.cache_size = cache_size
        self.transformer = transformer
        # we separate out state and graph def so that the state can be passed as an
        # argument to _sample_fn, resulting in it not being treated as a static
        # arg. This greatly reduces the size of the HLO and reduces compile time
        self._compiled_sample_fn = jax.jit(self._sample_fn)

    @property
    def transformer_state(self) -> statelib.State:
        assert self.transformer is not None
        return nnx.state(self.transformer)

    @transformer_state.setter
    def transformer_state(self, state: statelib.State) -> statelib.State:
        assert self.transformer is not None

        def check_tree_structure(tree1, tree2):
            if jax.tree_util.tree_structure(tree1) != jax.tree_util.tree_structure(tree2):
                raise ValueError("New state must have the same structure as the old state.")

            def check_shape_dtype(x, y):
                return x.shape == y.shape and x.dtype == y.dtype

            if not all(
                jax.tree_util.tree_leaves(jax.tree_util.tree_map(check_shape_dtype, tree1, tree2))
            ):
                raise ValueError("New state must have the same shape and dtype as the old state.")

        check_tree_structure(self.transformer_state, state)
        nnx.update(self.transformer, state)

    @property
    def dtype(self) -> jnp.dtype:
        assert self.transformer is not None
        return jax.tree_util.tree_leaves(self.transformer_state)[0].dtype

    def _sample_step(
        self,
        graphdef: graph.GraphDef,
        params: statelib.State,
        sampler_state: _SamplingState,
    ) -> _SamplingState:
        """Performs a single sampling step."""
        batch_size = sampler_state.token_buffer.shape[0]
        decoding_step = jnp.asarray(sampler_state.decoding_step, dtype=jnp.int32)
        last_token = sampler_state.token_buffer[:, decoding_step]
        input_mask = sampler_state.token_buffer == self.vocab.pad_id()
        attention_mask = _compute_attention_masks(decoding_step, self.cache_size, input_mask)
        step_positions = jnp.expand_dims(sampler_state.positions[:, decoding_step], -1)
        last_token = last_token.reshape((batch_size, 1))

        transformer = nnx.merge(graphdef, params)
        forward = nnx.capture(transformer, nnx.Intermediate)
        (logits, cache), intermediates = forward(
            last_token,
            step_positions,
            sampler_state.cache,
            attention_mask,
        )
        if sampler_state.forbidden_token_ids:
            logits = logits.at[:, :, sampler_state.forbidden_token_ids].set(-jnp.inf)

        def sample_top_p(logits, key):
            probs = jax.nn.softmax(logits[:, -1] / sampler_state.temperature, axis=-1)
            next_token = _sample_top_p(probs, sampler_state.top_p, key)
            return next_token

        def sample_best(logits):
            next_token = jnp.argmax(logits, axis=-1)
            next_token = next_token[:, 0]
            return next_token

        if sampler_state.temperature > 0:
            key = jax.random.fold_in(sampler_state.seed, decoding_step)
            next_token_candidate = sample_top_p(logits, key)
        else:
            next_token_candidate = sample_best(logits)

        next_token_candidate = jnp.where(
            decoding_step < sampler_state.num_input_tokens - 1,
            sampler_state.token_buffer[:, decoding_step + 1],
            next_token_candidate,
        )

        token_buffer = sampler_state.token_buffer.at[:, decoding_step + 1].set(next_token_candidate)

        if sampler_state.logits_buffer is not None:
            next_logits = jnp.squeeze(logits, 1)
            logits_buffer = sampler_state.logits_buffer.at[:, decoding_step + 1].set(next_logits)
        else:
            logits_buffer = sampler_state.logits_buffer

        if sampler_state.intermediates is not None:
            sampler_state.intermediates.merge(decoding_step, intermediates)

        done = sampler_state.done | jnp.equal(
            token_buffer[:, decoding_step + 1], self.vocab.eos_id()
        )

        return _SamplingState(
            decoding_step=sampler_state.decoding_step + 1,
            num_input_tokens=sampler_state.num_input_tokens,
            token_buffer=token_buffer,
            positions=sampler_state.positions,
            logits_buffer=logits_buffer,
            cache=cache,
            done=done,
            total_sampling_steps=sampler_state.total_sampling_steps,
            forbidden_token_ids=sampler_state.forbidden_token_ids,
            intermediates=sampler_state.intermediates,
            temperature=sampler_state.temperature,
            top_p=sampler_state.top_p,
            seed=sampler_state.seed,
        )

    def init_sample_state(
        self,
        all_input_ids: list[jax.Array],
        total_sampling_steps: int,
        include_logits: bool,
        forbidden_token_ids: Sequence[int] | None,
        temperature: float,
        top_p: float,
        seed: jax.Array,
        dtype: jnp.dtype | None = None,
        data_sharding: jax.sharding.NamedSharding | None = None,
    ) -> _SamplingState:
        """Initializes the sampling state given input prompts."""
        assert self.transformer is not None
        dtype = self.dtype if dtype is None else dtype
        num_inputs = len(all_input_ids)
        batch_size = num_inputs
        num_input_tokens = [len(input_ids) for input_ids in all_input_ids]
        buffer_size = total_sampling_steps + 1

        if data_sharding is not None:
            # Get the number of devices for data sharding
            assert len(data_sharding.spec) == 1, data_sharding
            n = data_sharding.num_devices
            out = data_sharding.shard_shape((n,))
            num_data_devs = n // out[0]
            batch_size = int(math.ceil(batch_size / num_data_devs) * num_data_devs)
            num_input_tokens += [0] * (batch_size - num_inputs)

        token_buffer = jnp.full((batch_size, buffer_size), self.vocab.pad_id(), dtype=jnp.int32)
        input_mask = jnp.ones_like(token_buffer, dtype=jnp.bool_)
        for i, (input_ids, num_tokens) in enumerate(zip(all_input_ids, num_input_tokens)):
            token_buffer = token_buffer.at[i, :num_tokens].set(input_ids)
            input_mask = input_mask.at[i, :num_tokens].set(input_ids != self.vocab.pad_id())

        done = jnp.zeros((batch_size,), dtype=jnp.bool_)
        num_input_tokens = jnp.array(num_input_tokens, dtype=jnp.int32)
        if data_sharding is not None:
            token_buffer = jax.device_put(token_buffer, data_sharding)
            input_mask = jax.device_put(input_mask, data_sharding)
            done = jax.device_put(done, data_sharding)
            num_input_tokens = jax.device_put(num_input_tokens, data_sharding)

        positions = build_positions_from_mask(input_mask)

        if include_logits:
            logits_buffer = jnp.zeros(
                (batch_size, buffer_size, self.transformer.num_embed),
                dtype=dtype,
            )
            if data_sharding is not None:
                logits_buffer = jax.device_put(logits_buffer, data_sharding)
        else:
            logits_buffer = None

        intermediates = None
        if self.transformer.sow_config.is_enabled():
            intermediates = init_intermediates(
                batch_size,
                buffer_size,
                self.transformer.embed_dim,
                self.transformer.num_layers,
                self.transformer.config.num_heads,
                self.transformer.sow_config,
                dtype=dtype,
            )

        return _SamplingState(
            decoding_step=0,
            num_input_tokens=num_input_tokens,
            token_buffer=token_buffer,
            positions=positions,
            logits_buffer=logits_buffer,
            cache=self.transformer.init_cache(
                cache_size=self.cache_size,
                batch_size=batch_size,
                dtype=dtype,
            ),
            done=done,
            total_sampling_steps=total_sampling_steps,
            forbidden_token_ids=forbidden_token_ids,
            intermediates=intermediates,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        )

    def tokenize(self, input_string: str) -> jax.Array:
        """Tokenizes the input string."""
        input_ids = self.vocab.EncodeAsIds(input_string)
        input_ids = jnp.array(
            [self.vocab.bos_id()] + jnp.array(input_ids).tolist(), dtype=jnp.int32
        )
        return input_ids

    def mask_tokens_after_eos_ids(self, token_buffer):
        """Mask token IDs after the EOS token with the padding ID."""
        eos_id = self.vocab.eos_id()
        eos_exists = jnp.any(jnp.equal(token_buffer, eos_id), axis=-1)
        eos_indices = jnp.where(
            eos_exists,
            jnp.argmax(jnp.equal(token_buffer, eos_id), axis=-1),
            token_buffer.shape[-1],
        )
        mask = jnp.less_equal(jnp.arange(token_buffer.shape[-1]), eos_indices[:, None])
        masked_token_buffer = token_buffer * mask + self.vocab.pad_id() * (1 - mask)

        return masked_token_buffer

    def _sample_fn(
        self,
        graphdef: graph.GraphDef,
        params: statelib.State,
        initial_sampling_state: _SamplingState,
    ) -> _SamplingState:
        """Internal sampling function (to be jitted)."""

        def sample_with_params(sampler_state: _SamplingState):
            return self._sample_step(graphdef, params, sampler_state)

        def cond_fn(sampler_state: _SamplingState):
            return (sampler_state.decoding_step < sampler_state.total_sampling_steps) & jnp.any(
                jnp.logical_not(sampler_state.done)
            )

        return jax.lax.while_loop(cond_fn, sample_with_params, initial_sampling_state)

    def __call__(
        self,
        input_strings: Sequence[str],
        total_generation_steps: int,
        echo: bool = False,
        return_logits: bool = True,
        forbidden_tokens: Sequence[str] | None = None,
        temperature: float = 0.0,
        top_p: float = 0.95,
        seed: jax.Array | None = None,
        dtype: jnp.dtype | None = None,
        transformer: Transformer | None = None,
        data_sharding: jax.sharding.Sharding | None = None,
    ) -> SamplerOutput:
        """Samples a completion of the input string.

        Args:
          input_strings: input prompts to feed to the model for sampling.
          total_generation_steps: number of generation steps. will correspond to the
            longest prompt in the batch.
          echo: whether to return the prompt as part of the output sample.
          return_logits: whether to return per-step logits used during generation.
          forbidden_tokens: list of tokens that are forbidden to be generated. Each
            token must map to a single token id in the vocab.
          temperature: temperature for sampling.
          top_p: top-p sampling threshold.
          seed: random seed for sampling.
          dtype: dtype for cache, buffers and intermediates initialization
          transformer: optional, model to use for sampling

        Returns:
          sampler_output: A SamplerOutput object containing the generated samples.
        """
        if transformer is not None:
            self.transformer = transformer
        assert self.transformer

        forbidden_token_ids = None
        if forbidden_tokens is not None:
            forbidden_token_ids = []
            for token in forbidden_tokens:
                token_id = self.vocab.EncodeAsIds(token)
                if len(token_id) != 1:
                    raise ValueError("Forbidden tokens must map to single token ids in the vocab.")
                forbidden_token_ids.extend(token_id)
            forbidden_token_ids = tuple(forbidden_token_ids)
        all_input_ids = [self.tokenize(x) for x in input_strings]
        max_input_length = max(len(input_ids) for input_ids in all_input_ids)
        total_sampling_steps = max_input_length + total_generation_steps
        num_inputs = len(all_input_ids)

        if seed is None:
            seed = jax.random.PRNGKey(0)
        dtype = self.dtype if dtype is None else dtype
        initial_sampling_state = self.init_sample_state(
            all_input_ids,
            include_logits=return_logits,
            total_sampling_steps=total_sampling_steps,
            forbidden_token_ids=forbidden_token_ids,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            dtype=dtype,
            data_sharding=data_sharding,  # pyrefly: ignore[bad-argument-type]
        )

        graphdef, state = nnx.split(self.transformer)
        sampling_state = self._compiled_sample_fn(graphdef, state, initial_sampling_state)

        masked_token_buffer = self.mask_tokens_after_eos_ids(sampling_state.token_buffer)

        if not masked_token_buffer.is_fully_addressable:
            masked_token_buffer = process_allgather(masked_token_buffer, tiled=True)
        masked_token_buffer = np.asarray(masked_token_buffer)

        num_input_tokens = sampling_state.num_input_tokens
        if not num_input_tokens.is_fully_addressable:
            num_input_tokens = process_allgather(num_input_tokens, tiled=True)
        num_input_tokens = np.asarray(num_input_tokens)

        # We padded token_buffer and num_input_tokens if data_sharding provided to
        # a multiple of number of data sharding devices
        if len(num_input_tokens) > num_inputs:
            num_input_tokens = num_input_tokens[:num_inputs]

        logits_buffer = sampling_state.logits_buffer
        if not logits_buffer.is_fully_addressable:
            logits_buffer = process_allgather(logits_buffer, tiled=True)
        logits_buffer = np.asarray(logits_buffer)

        out_tokens = []
        out_logits = []
        for i, (token_buffer, num_tokens) in enumerate(
            zip(masked_token_buffer, num_input_tokens, strict=False)
        ):
            start_idx = 0 if echo else num_tokens
            out_tokens.append(token_buffer[start_idx:total_sampling_steps].tolist())
            if return_logits:
                out_logits.append(logits_buffer[i, start_idx:total_sampling_steps].tolist())

        decoded_outputs = [self.vocab.DecodeIds(tokens) for tokens in out_tokens]

        if sampling_state.intermediates is not None:
            sampling_state.intermediates.trim(total_sampling_steps)

        result = SamplerOutput(
            text=decoded_outputs,
            logits=out_logits,
            tokens=out_tokens,
            intermediates=sampling_state.intermediates,
        )
        return result


# -- train.py, as written there --
def rsqrt_schedule(
    init_value: float,
    shift: int = 0,
):
    """Applies a reverse square-root schedule.

    The reverse square root schedule is simply `lr = init_value / sqrt(step)`.

    Args:
      init_value: Base learning rate (before applying the rsqrt schedule).
      shift: How many steps the rsqrt should be shifted. Shifting the rsqrt
        schedule makes it less steep in the beginning (close to 0).

    Returns:
      A schedule that applies the reverse square root.
    """

    def schedule(count):
        return init_value * (count + shift) ** -0.5 * shift**0.5

    return schedule


def create_learning_rate_schedule(learning_rate: float, warmup_steps: int):
    """Creates a rsqrt schedule with linear warmup."""
    return optax.join_schedules(
        [
            optax.linear_schedule(
                init_value=0,
                end_value=learning_rate,
                transition_steps=warmup_steps,
            ),
            rsqrt_schedule(init_value=learning_rate, shift=warmup_steps),
        ],
        boundaries=[warmup_steps],
    )


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    """Compute weighted cross entropy and entropy for log probs and targets.

    Args:
     logits: [batch, length, num_classes] float array.
     targets: categorical targets [batch, length] int array.
     weights: None or array of shape [batch, length].
     label_smoothing: label smoothing constant, used to determine the on and off
       values.

    Returns:
      Tuple of scalar loss and batch normalizing factor.
    """
    if logits.ndim != targets.ndim + 1:
        raise ValueError(
            "Incorrect shapes. Got shape %s logits and %s targets"
            % (str(logits.shape), str(targets.shape))
        )
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(
        confidence * jnp.log(confidence)
        + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
    )
    soft_targets = (
        jax.nn.one_hot(targets, vocab_size) * (confidence - low_confidence) + low_confidence
    )

    loss = -jnp.sum(soft_targets * nnx.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant

    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()

    # loss shape is [B, T]
    loss_per_sample = loss.sum(axis=1) * len(loss) / normalizing_factor
    return loss_per_sample


@jax.jit
def compute_perplexity(loss):
    return jnp.clip(jnp.exp(loss), max=1.0e4)


# Primary training / eval / decode step functions.
# -----------------------------------------------------------------------------
def nnx_train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    rngs: nnx.Rngs,
    batch: dict[str, jax.Array],
    train_metrics: nnx.Metric,
    label_smoothing: float = 0.0,
    pad_id: int = 0,
    with_capture: bool = False,
) -> nnx.State | None:
    """Perform a single training step."""
    # X_position and X_segmentation are needed only when using "packed examples"
    # where multiple sequences are packed into the same example with this
    # metadata.
    # If such features are not present they are ignored and the example is treated
    # like a normal, unpacked sequence example.
    train_keys = ["inputs", "inputs_position", "inputs_segmentation", "targets"]
    (inputs, inputs_positions, inputs_segmentation, targets) = (
        batch.get(k, None) for k in train_keys
    )

    input_mask = inputs > pad_id
    weights = input_mask.astype(jnp.float32)
    attention_mask = make_causal_attn_mask(input_mask)  # (B, L, L)
    if inputs_segmentation is not None:
        # inputs_segmentation: (B, L)
        mask = inputs_segmentation[:, :, None] == inputs_segmentation[:, None, :]  # (B, L, L)
        attention_mask = jnp.logical_and(mask, attention_mask)

    def loss_fn(model, rngs):
        """loss function used for training."""
        if with_capture:
            forward = nnx.capture(model, nnx.Intermediate)
        else:
            forward = model
        output = forward(
            inputs,
            positions=inputs_positions,
            attention_mask=attention_mask,
            cache=None,
            rngs=rngs,
        )
        # output is (preds, cache) if with_capture=False
        # and is ((preds, cache), intermediates) if with_capture=True
        if with_capture:
            (logits, _), intermediates = output
        else:
            logits, _ = output
            intermediates = None

        loss_per_sample = compute_weighted_cross_entropy(logits, targets, weights, label_smoothing)
        mean_loss = loss_per_sample.mean()
        return mean_loss, (loss_per_sample, logits, intermediates)

    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (_, (loss_per_sample, logits, intermediates)), grads = grad_fn(model, rngs.fork())
    optimizer.update(model, grads)

    # Apply pad mask on logits and targets for metrics computation
    train_metrics.update(
        loss=loss_per_sample,
        logits=logits,
        labels=targets,
        mask={"accuracy": input_mask},
    )
    return intermediates


def eval_step(
    model,
    batch,
    eval_metrics: nnx.Metric,
    label_smoothing: float = 0.0,
    pad_id: int = 0,
) -> nnx.Metric:
    """Calculate evaluation metrics on a batch."""
    inputs, targets = batch["inputs"], batch["targets"]

    input_mask = inputs > pad_id
    weights = input_mask.astype(jnp.float32)
    inputs_positions = build_positions_from_mask(input_mask)
    attention_mask = make_causal_attn_mask(input_mask)

    logits, _ = model(
        inputs,
        positions=inputs_positions,
        attention_mask=attention_mask,
        cache=None,
    )
    loss_per_sample = compute_weighted_cross_entropy(logits, targets, weights, label_smoothing)

    # Apply pad mask on logits and targets for metrics computation
    logits = logits * weights[..., None]
    targets = targets * weights.astype(int)
    eval_metrics.update(
        loss=loss_per_sample,
        logits=logits,
        labels=targets,
        mask={"accuracy": input_mask},
    )
    return eval_metrics
