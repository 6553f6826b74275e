"""flax examples/wmt, as written there (google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0):
models.py (the encoder-decoder Transformer, its mode a config of a frozen struct.dataclass,
``decode=True`` for autoregressive decoding with a "cache" collection), decode.py (the beam
search: a lax.while_loop over a BeamState holding that cache) and train.py's
``initialize_cache`` and ``predict_step`` (``apply(..., method=Transformer.encode)``, then
``method=Transformer.decode`` with ``mutable=["cache"]`` per step). Docstrings and comments
left out; names as there (a module of its own: helpers.py's lm1b and vit hold some of them).
"""

import typing
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct
from jax import lax

# ruff: noqa: UP031, RUF005 (the authors' code, as written)


# -- models.py --
@struct.dataclass
class TransformerConfig:
    vocab_size: int
    output_vocab_size: int
    share_embeddings: bool = False
    logits_via_embedding: bool = False
    dtype: Any = jnp.float32
    emb_dim: int = 512
    num_heads: int = 8
    num_layers: int = 6
    qkv_dim: int = 512
    mlp_dim: int = 2048
    max_len: int = 2048
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    decode: bool = False
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-06)
    posemb_init: Callable | None = None


def shift_right(x, axis=1):
    pad_widths = [(0, 0)] * len(x.shape)
    pad_widths[axis] = (1, 0)
    padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
    return padded[:, :-1]


def sinusoidal_init(max_len=2048, min_scale=1.0, max_scale=10000.0):

    def init(key, shape, dtype=np.float32):
        del key, dtype
        d_feature = shape[-1]
        pe = np.zeros((max_len, d_feature), dtype=np.float32)
        position = np.arange(0, max_len)[:, np.newaxis]
        scale_factor = -np.log(max_scale / min_scale) / (d_feature // 2 - 1)
        div_term = min_scale * np.exp(np.arange(0, d_feature // 2) * scale_factor)
        pe[:, : d_feature // 2] = np.sin(position * div_term)
        pe[:, d_feature // 2 : 2 * (d_feature // 2)] = np.cos(position * div_term)
        pe = pe[np.newaxis, :, :]
        return jnp.array(pe)

    return init


class AddPositionEmbs(nn.Module):
    config: TransformerConfig
    decode: bool = False

    @nn.compact
    def __call__(self, inputs, inputs_positions=None):
        config = self.config
        assert inputs.ndim == 3, "Number of dimensions should be 3, but it is: %d" % inputs.ndim
        length = inputs.shape[1]
        pos_emb_shape = (1, config.max_len, inputs.shape[-1])
        if config.posemb_init is None:
            pos_embedding = sinusoidal_init(max_len=config.max_len)(None, pos_emb_shape, None)
        else:
            pos_embedding = self.param("pos_embedding", config.posemb_init, pos_emb_shape)
        pe = pos_embedding[:, :length, :]
        if self.decode:
            is_initialized = self.has_variable("cache", "cache_index")
            cache_index = self.variable(
                "cache", "cache_index", lambda: jnp.array(0, dtype=jnp.uint32)
            )
            if is_initialized:
                i = cache_index.value
                cache_index.value = i + 1
                _, _, df = pos_embedding.shape
                pe = lax.dynamic_slice(pos_embedding, jnp.array((0, i, 0)), (1, 1, df))
        if inputs_positions is None:
            return inputs + pe
        else:
            return inputs + jnp.take(pe[0], inputs_positions, axis=0)


class MlpBlock(nn.Module):
    config: TransformerConfig
    out_dim: int | None = None

    @nn.compact
    def __call__(self, inputs):
        config = self.config
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(
            config.mlp_dim,
            dtype=config.dtype,
            kernel_init=config.kernel_init,
            bias_init=config.bias_init,
        )(inputs)
        x = nn.relu(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        output = nn.Dense(
            actual_out_dim,
            dtype=config.dtype,
            kernel_init=config.kernel_init,
            bias_init=config.bias_init,
        )(x)
        output = nn.Dropout(rate=config.dropout_rate)(output, deterministic=config.deterministic)
        return output


class Encoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, encoder_mask=None):
        config = self.config
        assert inputs.ndim == 3
        x = nn.LayerNorm(dtype=config.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads,
            dtype=config.dtype,
            qkv_features=config.qkv_dim,
            kernel_init=config.kernel_init,
            bias_init=config.bias_init,
            use_bias=False,
            broadcast_dropout=False,
            dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic,
        )(x, mask=encoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + inputs
        y = nn.LayerNorm(dtype=config.dtype)(x)
        y = MlpBlock(config=config)(y)
        return x + y


class EncoderDecoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, targets, encoded, decoder_mask=None, encoder_decoder_mask=None):
        config = self.config
        assert targets.ndim == 3
        x = nn.LayerNorm(dtype=config.dtype)(targets)
        x = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads,
            dtype=config.dtype,
            qkv_features=config.qkv_dim,
            kernel_init=config.kernel_init,
            bias_init=config.bias_init,
            use_bias=False,
            broadcast_dropout=False,
            dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic,
            decode=config.decode,
        )(x, mask=decoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + targets
        y = nn.LayerNorm(dtype=config.dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads,
            dtype=config.dtype,
            qkv_features=config.qkv_dim,
            kernel_init=config.kernel_init,
            bias_init=config.bias_init,
            use_bias=False,
            broadcast_dropout=False,
            dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic,
        )(y, encoded, mask=encoder_decoder_mask)
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
        y = y + x
        z = nn.LayerNorm(dtype=config.dtype)(y)
        z = MlpBlock(config=config)(z)
        return y + z


class Encoder(nn.Module):
    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(self, inputs, inputs_positions=None, encoder_mask=None):
        config = self.config
        assert inputs.ndim == 2
        if self.shared_embedding is None:
            input_embed = nn.Embed(
                num_embeddings=config.vocab_size,
                features=config.emb_dim,
                embedding_init=nn.initializers.normal(stddev=1.0),
            )
        else:
            input_embed = self.shared_embedding
        x = inputs.astype("int32")
        x = input_embed(x)
        x = AddPositionEmbs(config=config, decode=False, name="posembed_input")(
            x, inputs_positions=inputs_positions
        )
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x.astype(config.dtype)
        for lyr in range(config.num_layers):
            x = Encoder1DBlock(config=config, name=f"encoderblock_{lyr}")(x, encoder_mask)
        encoded = nn.LayerNorm(dtype=config.dtype, name="encoder_norm")(x)
        return encoded


class Decoder(nn.Module):
    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(
        self, encoded, targets, targets_positions=None, decoder_mask=None, encoder_decoder_mask=None
    ):
        config = self.config
        assert encoded.ndim == 3
        assert targets.ndim == 2
        if self.shared_embedding is None:
            output_embed = nn.Embed(
                num_embeddings=config.output_vocab_size,
                features=config.emb_dim,
                embedding_init=nn.initializers.normal(stddev=1.0),
            )
        else:
            output_embed = self.shared_embedding
        y = targets.astype("int32")
        if not config.decode:
            y = shift_right(y)
        y = output_embed(y)
        y = AddPositionEmbs(config=config, decode=config.decode, name="posembed_output")(
            y, inputs_positions=targets_positions
        )
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
        y = y.astype(config.dtype)
        for lyr in range(config.num_layers):
            y = EncoderDecoder1DBlock(config=config, name=f"encoderdecoderblock_{lyr}")(
                y, encoded, decoder_mask=decoder_mask, encoder_decoder_mask=encoder_decoder_mask
            )
        y = nn.LayerNorm(dtype=config.dtype, name="encoderdecoder_norm")(y)
        if config.logits_via_embedding:
            logits = output_embed.attend(y.astype(jnp.float32))
            logits = logits / jnp.sqrt(y.shape[-1])
        else:
            logits = nn.Dense(
                config.output_vocab_size,
                dtype=config.dtype,
                kernel_init=config.kernel_init,
                bias_init=config.bias_init,
                name="logitdense",
            )(y)
        return logits


class Transformer(nn.Module):
    config: TransformerConfig

    def setup(self):
        config = self.config
        if config.share_embeddings:
            if config.output_vocab_size is not None:
                assert config.output_vocab_size == config.vocab_size, (
                    "can't share embedding with different vocab sizes."
                )
            self.shared_embedding = nn.Embed(
                num_embeddings=config.vocab_size,
                features=config.emb_dim,
                embedding_init=nn.initializers.normal(stddev=1.0),
            )
        else:
            self.shared_embedding = None
        self.encoder = Encoder(config=config, shared_embedding=self.shared_embedding)
        self.decoder = Decoder(config=config, shared_embedding=self.shared_embedding)

    def encode(self, inputs, inputs_positions=None, inputs_segmentation=None):
        config = self.config
        encoder_mask = nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype)
        if inputs_segmentation is not None:
            encoder_mask = nn.combine_masks(
                encoder_mask,
                nn.make_attention_mask(
                    inputs_segmentation, inputs_segmentation, jnp.equal, dtype=config.dtype
                ),
            )
        return self.encoder(inputs, inputs_positions=inputs_positions, encoder_mask=encoder_mask)

    def decode(
        self,
        encoded,
        inputs,
        targets,
        targets_positions=None,
        inputs_segmentation=None,
        targets_segmentation=None,
    ):
        config = self.config
        if config.decode:
            decoder_mask = None
            encoder_decoder_mask = nn.make_attention_mask(
                jnp.ones_like(targets) > 0, inputs > 0, dtype=config.dtype
            )
        else:
            decoder_mask = nn.combine_masks(
                nn.make_attention_mask(targets > 0, targets > 0, dtype=config.dtype),
                nn.make_causal_mask(targets, dtype=config.dtype),
            )
            encoder_decoder_mask = nn.make_attention_mask(
                targets > 0, inputs > 0, dtype=config.dtype
            )
        if inputs_segmentation is not None:
            decoder_mask = nn.combine_masks(
                decoder_mask,
                nn.make_attention_mask(
                    targets_segmentation, targets_segmentation, jnp.equal, dtype=config.dtype
                ),
            )
            encoder_decoder_mask = nn.combine_masks(
                encoder_decoder_mask,
                nn.make_attention_mask(
                    targets_segmentation, inputs_segmentation, jnp.equal, dtype=config.dtype
                ),
            )
        logits = self.decoder(
            encoded,
            targets,
            targets_positions=targets_positions,
            decoder_mask=decoder_mask,
            encoder_decoder_mask=encoder_decoder_mask,
        )
        return logits.astype(self.config.dtype)

    def __call__(
        self,
        inputs,
        targets,
        inputs_positions=None,
        targets_positions=None,
        inputs_segmentation=None,
        targets_segmentation=None,
    ):
        encoded = self.encode(
            inputs, inputs_positions=inputs_positions, inputs_segmentation=inputs_segmentation
        )
        return self.decode(
            encoded,
            inputs,
            targets,
            targets_positions=targets_positions,
            inputs_segmentation=inputs_segmentation,
            targets_segmentation=targets_segmentation,
        )


# -- decode.py --
EOS_ID = 2
NEG_INF = np.array(-10000000.0)


def brevity_penalty(alpha, length):
    return jnp.power((5.0 + length) / 6.0, alpha)


def add_beam_dim(x, beam_size):
    if x.ndim == 0:
        return x
    x = jnp.expand_dims(x, axis=1)
    tile_dims = [1] * x.ndim
    tile_dims[1] = beam_size
    return jnp.tile(x, tile_dims)


def flatten_beam_dim(x):
    if x.ndim == 0:
        return x
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def unflatten_beam_dim(x, batch_size, beam_size):
    if x.ndim == 0:
        return x
    assert batch_size * beam_size == x.shape[0]
    return x.reshape((batch_size, beam_size) + x.shape[1:])


def flat_batch_beam_expand(x, beam_size):
    return flatten_beam_dim(add_beam_dim(x, beam_size))


def gather_beams(nested, beam_indices, batch_size, new_beam_size):
    batch_indices = jnp.reshape(
        jnp.arange(batch_size * new_beam_size) // new_beam_size, (batch_size, new_beam_size)
    )

    def gather_fn(x):
        if x.ndim == 0:
            return x
        else:
            return x[batch_indices, beam_indices]

    return jax.tree_util.tree_map(gather_fn, nested)


def gather_topk_beams(nested, score_or_log_prob, batch_size, new_beam_size):
    _, topk_indices = lax.top_k(score_or_log_prob, k=new_beam_size)
    topk_indices = jnp.flip(topk_indices, axis=1)
    return gather_beams(nested, topk_indices, batch_size, new_beam_size)


@flax.struct.dataclass
class BeamState:
    cur_index: jax.Array
    live_logprobs: jax.Array
    finished_scores: jax.Array
    live_seqs: jax.Array
    finished_seqs: jax.Array
    finished_flags: jax.Array
    cache: typing.Any


def beam_init(batch_size, beam_size, max_decode_len, cache):
    cur_index0 = jnp.array(0)
    live_logprobs0 = jnp.tile(jnp.array([0.0] + [NEG_INF] * (beam_size - 1)), [batch_size, 1])
    finished_scores0 = jnp.ones((batch_size, beam_size)) * NEG_INF
    live_seqs0 = jnp.zeros((batch_size, beam_size, max_decode_len), jnp.int32)
    finished_seqs0 = jnp.zeros((batch_size, beam_size, max_decode_len), jnp.int32)
    finished_flags0 = jnp.zeros((batch_size, beam_size), jnp.bool_)
    beam_cache0 = jax.tree_util.tree_map(lambda x: add_beam_dim(x, beam_size), cache)
    return BeamState(
        cur_index=cur_index0,
        live_logprobs=live_logprobs0,
        finished_scores=finished_scores0,
        live_seqs=live_seqs0,
        finished_seqs=finished_seqs0,
        finished_flags=finished_flags0,
        cache=beam_cache0,
    )


def beam_search(
    inputs, cache, tokens_to_logits, beam_size=4, alpha=0.6, eos_id=EOS_ID, max_decode_len=None
):
    batch_size = inputs.shape[0]
    if max_decode_len is None:
        max_decode_len = inputs.shape[1]
    end_marker = jnp.array(eos_id)
    beam_search_init_state = beam_init(batch_size, beam_size, max_decode_len, cache)

    def beam_search_loop_cond_fn(state):
        not_at_end = state.cur_index < max_decode_len - 1
        min_brevity_penalty = brevity_penalty(alpha, max_decode_len)
        best_live_scores = state.live_logprobs[:, -1:] / min_brevity_penalty
        worst_finished_scores = jnp.min(state.finished_scores, axis=1, keepdims=True)
        worst_finished_scores = jnp.where(state.finished_flags, worst_finished_scores, NEG_INF)
        search_terminated = jnp.all(worst_finished_scores > best_live_scores)
        return not_at_end & ~search_terminated

    def beam_search_loop_body_fn(state):
        flat_ids = flatten_beam_dim(
            lax.dynamic_slice(state.live_seqs, (0, 0, state.cur_index), (batch_size, beam_size, 1))
        )
        flat_cache = jax.tree_util.tree_map(flatten_beam_dim, state.cache)
        flat_logits, new_flat_cache = tokens_to_logits(flat_ids, flat_cache)
        logits = unflatten_beam_dim(flat_logits, batch_size, beam_size)
        new_cache = jax.tree_util.tree_map(
            lambda x: unflatten_beam_dim(x, batch_size, beam_size), new_flat_cache
        )
        candidate_log_probs = jax.nn.log_softmax(logits)
        log_probs = candidate_log_probs + jnp.expand_dims(state.live_logprobs, axis=2)
        vocab_size = log_probs.shape[2]
        beams_to_keep = 2 * beam_size
        flat_log_probs = log_probs.reshape((batch_size, beam_size * vocab_size))
        topk_log_probs, topk_indices = lax.top_k(flat_log_probs, k=beams_to_keep)
        topk_beam_indices = topk_indices // vocab_size
        topk_seq = gather_beams(state.live_seqs, topk_beam_indices, batch_size, beams_to_keep)
        topk_ids = jnp.expand_dims(topk_indices % vocab_size, axis=2)
        topk_seq = lax.dynamic_update_slice(topk_seq, topk_ids, (0, 0, state.cur_index + 1))
        newly_finished = topk_seq[:, :, state.cur_index + 1] == end_marker
        new_log_probs = topk_log_probs + newly_finished * NEG_INF
        _, new_topk_indices = lax.top_k(new_log_probs, k=beam_size)
        new_topk_indices = jnp.flip(new_topk_indices, axis=1)
        top_alive_seq, top_alive_log_probs = gather_beams(
            [topk_seq, new_log_probs], new_topk_indices, batch_size, beam_size
        )
        top_alive_indices = gather_beams(topk_beam_indices, new_topk_indices, batch_size, beam_size)
        top_alive_cache = gather_beams(new_cache, top_alive_indices, batch_size, beam_size)
        new_scores = topk_log_probs / brevity_penalty(alpha, state.cur_index + 1)
        new_scores += ~newly_finished * NEG_INF
        finished_seqs = jnp.concatenate([state.finished_seqs, topk_seq], axis=1)
        finished_scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)
        finished_flags = jnp.concatenate([state.finished_flags, newly_finished], axis=1)
        top_finished_seq, top_finished_scores, top_finished_flags = gather_topk_beams(
            [finished_seqs, finished_scores, finished_flags], finished_scores, batch_size, beam_size
        )
        return BeamState(
            cur_index=state.cur_index + 1,
            live_logprobs=top_alive_log_probs,
            finished_scores=top_finished_scores,
            live_seqs=top_alive_seq,
            finished_seqs=top_finished_seq,
            finished_flags=top_finished_flags,
            cache=top_alive_cache,
        )

    final_state = lax.while_loop(
        beam_search_loop_cond_fn, beam_search_loop_body_fn, beam_search_init_state
    )
    none_finished = jnp.any(final_state.finished_flags, axis=1)
    finished_seqs = jnp.where(
        none_finished[:, None, None], final_state.finished_seqs, final_state.live_seqs
    )
    finished_scores = jnp.where(
        none_finished[:, None], final_state.finished_scores, final_state.live_logprobs
    )
    return (finished_seqs, finished_scores)


# -- train.py --
def initialize_cache(inputs, max_decode_len, config):
    target_shape = (inputs.shape[0], max_decode_len) + inputs.shape[2:]
    initial_variables = Transformer(config).init(
        jax.random.key(0),
        jnp.ones(inputs.shape, config.dtype),
        jnp.ones(target_shape, config.dtype),
    )
    return initial_variables["cache"]


def predict_step(inputs, params, cache, eos_id, max_decode_len, config, beam_size=4):
    encoded_inputs = flat_batch_beam_expand(
        Transformer(config).apply({"params": params}, inputs, method=Transformer.encode), beam_size
    )
    raw_inputs = flat_batch_beam_expand(inputs, beam_size)

    def tokens_ids_to_logits(flat_ids, flat_cache):
        flat_logits, new_vars = Transformer(config).apply(
            {"params": params, "cache": flat_cache},
            encoded_inputs,
            raw_inputs,
            flat_ids,
            mutable=["cache"],
            method=Transformer.decode,
        )
        new_flat_cache = new_vars["cache"]
        flat_logits = flat_logits.squeeze(axis=1)
        return (flat_logits, new_flat_cache)

    beam_seqs, _ = beam_search(
        inputs,
        cache,
        tokens_ids_to_logits,
        beam_size=beam_size,
        alpha=0.6,
        eos_id=eos_id,
        max_decode_len=max_decode_len,
    )
    return beam_seqs[:, -1, 1:]
