"""RoBERTa encoder + masked-LM head in Flax Linen, numerically matching KerasHub's
`RobertaBackbone` and `RobertaMaskedLM`.

Parameter paths mirror KerasHub's `variable.path`::

    embeddings/token_embedding/embeddings                              [V, H]
    embeddings/position_embedding/embeddings                           [P, H]
    embeddings_layer_norm/{gamma,beta}                                 [H]
    transformer_layer_{i}/self_attention_layer/{query,key,value}/kernel [H, N, D], bias [N, D]
    transformer_layer_{i}/self_attention_layer/attention_output/kernel [N, D, H], bias [H]
    transformer_layer_{i}/self_attention_layer_norm/{gamma,beta}       [H]
    transformer_layer_{i}/feedforward_intermediate_dense/kernel        [H, F], bias [F]
    transformer_layer_{i}/feedforward_output_dense/kernel              [F, H], bias [H]
    transformer_layer_{i}/feedforward_layer_norm/{gamma,beta}          [H]
    mlm_head/intermediate_dense/kernel [H, H], bias [H]
    mlm_head/intermediate_layer_norm/{gamma,beta} [H]
    mlm_head/output_bias [V]

Shapes: B batch, T length, P max positions, V vocabulary, H hidden, N heads, D = H / N,
F feed-forward width, M masked positions per row.

Post-LN encoder, exact (erf) GELU, LayerNorm eps 1e-5, positions 0..T-1 with no offset (KerasHub's
512-row table is HF's rows 2..513). Norms and softmax run in float32.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn

from models import layers

# KerasHub initialises every RoBERTa kernel and embedding with TruncatedNormal(stddev=0.02).
_init = nn.initializers.truncated_normal(stddev=0.02)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RobertaConfig:
    vocab_size: int
    num_layers: int
    num_heads: int
    hidden_dim: int
    intermediate_dim: int
    max_sequence_length: int = 512
    norm_eps: float = 1e-5
    dropout: float = 0.0  # applied only when `deterministic=False` (training)
    dtype: str = "float32"  # parameters and compute; norms and softmax always run in float32

    family = "roberta"

    def __post_init__(self):
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"hidden_dim={self.hidden_dim} is not a multiple of num_heads={self.num_heads}")

    def replace(self, **changes) -> "RobertaConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def backbone_params(self) -> int:
        """KerasHub's `RobertaBackbone.count_params()`."""
        v, h, f, l, p = (self.vocab_size, self.hidden_dim, self.intermediate_dim, self.num_layers,
                         self.max_sequence_length)
        layer = 4 * (h * h + h) + 2 * h * f + f + h + 4 * h
        return v * h + p * h + 2 * h + l * layer

    @property
    def head_params(self) -> int:
        """The masked-LM head: dense H*H + H, LayerNorm 2H, output bias V."""
        h = self.hidden_dim
        return h * h + h + 2 * h + self.vocab_size

    @property
    def num_params(self) -> int:
        return self.backbone_params + self.head_params


PRESETS: dict[str, RobertaConfig] = {
    "roberta_base_en": RobertaConfig(vocab_size=50_265, num_layers=12, num_heads=12,
                                     hidden_dim=768, intermediate_dim=3072),
    "roberta_large_en": RobertaConfig(vocab_size=50_265, num_layers=24, num_heads=16,
                                      hidden_dim=1024, intermediate_dim=4096),
    # For tests and a CPU demo: trains in seconds.
    "roberta_tiny": RobertaConfig(vocab_size=1024, num_layers=2, num_heads=4, hidden_dim=64,
                                  intermediate_dim=128, max_sequence_length=128),
}


class Dense(nn.Module):
    """`einsum(eq, x, kernel) + bias`: KerasHub's EinsumDense / Dense with a bias."""
    kernel_shape: tuple[int, ...]
    bias_shape: tuple[int, ...]
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, eq: str, x):
        kernel = self.param("kernel", _init, self.kernel_shape, self.dtype)
        bias = self.param("bias", nn.initializers.zeros_init(), self.bias_shape, self.dtype)
        return jnp.einsum(eq, x.astype(self.dtype), kernel.astype(self.dtype)) + bias.astype(self.dtype)


class LayerNorm(nn.Module):
    """Keras LayerNormalization (gamma, beta), computed in float32 and cast back to x.dtype."""
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        h = x.shape[-1]
        gamma = self.param("gamma", nn.initializers.ones_init(), (h,), jnp.float32)
        beta = self.param("beta", nn.initializers.zeros_init(), (h,), jnp.float32)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * gamma.astype(jnp.float32) + beta.astype(jnp.float32)).astype(x.dtype)


class SelfAttention(nn.Module):
    config: RobertaConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool = True):
        """x [B, T, H], mask [B, T, T] (True = attend) -> [B, T, H]."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        h, n = cfg.hidden_dim, cfg.num_heads
        d = h // n
        proj = lambda name: Dense((h, n, d), (n, d), dtype, name=name)("BTH,HND->BTND", x)  # noqa: E731
        q, k, v = proj("query"), proj("key"), proj("value")
        q = q * jnp.asarray(1.0 / math.sqrt(d), q.dtype)
        if cfg.dropout and not deterministic:
            # Keras drops attention probabilities; do the same by dropping whole (t, s) weights.
            out = _attention_with_dropout(self, q, k, v, mask, cfg.dropout)
        else:
            out = layers.grouped_attention(q, k, v, mask)  # [B, T, N, D]
        return Dense((n, d, h), (h,), dtype, name="attention_output")("BTND,NDH->BTH", out)


def _attention_with_dropout(module, q, k, v, mask, rate):
    logits = jnp.einsum("BTND,BSND->BNTS", q, k.astype(q.dtype)).astype(jnp.float32)
    m = mask[:, None]
    probs = jnp.where(m, jax.nn.softmax(jnp.where(m, logits, -1e9), axis=-1), 0.0)
    keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - rate), 0.0).astype(q.dtype)
    return jnp.einsum("BNTS,BSND->BTND", probs, v.astype(q.dtype))


class EncoderLayer(nn.Module):
    """KerasHub TransformerEncoder with normalize_first=False (post-LN)."""
    config: RobertaConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool = True):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        drop = nn.Dropout(cfg.dropout, deterministic=deterministic)
        attn = SelfAttention(cfg, name="self_attention_layer")(x, mask, deterministic)
        x = LayerNorm(cfg.norm_eps, name="self_attention_layer_norm")(x + drop(attn))
        h, f = cfg.hidden_dim, cfg.intermediate_dim
        y = Dense((h, f), (f,), dtype, name="feedforward_intermediate_dense")("BTH,HF->BTF", x)
        y = jax.nn.gelu(y, approximate=False)
        y = Dense((f, h), (h,), dtype, name="feedforward_output_dense")("BTF,FH->BTH", y)
        return LayerNorm(cfg.norm_eps, name="feedforward_layer_norm")(x + drop(y))


class Table(nn.Module):
    """An embedding table [rows, H] under `<name>/embeddings`."""
    rows: int
    dim: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embeddings = self.param("embeddings", _init, (self.rows, self.dim), self.dtype)


class Embeddings(nn.Module):
    config: RobertaConfig

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.token_embedding = Table(cfg.vocab_size, cfg.hidden_dim, dtype)
        self.position_embedding = Table(cfg.max_sequence_length, cfg.hidden_dim, dtype)

    def __call__(self, token_ids):
        """token_ids [B, T] -> token + position embeddings [B, T, H] (positions 0..T-1)."""
        t = token_ids.shape[1]
        tok = jnp.take(self.token_embedding.embeddings, token_ids, axis=0)
        return (tok + self.position_embedding.embeddings[None, :t]).astype(jnp.dtype(self.config.dtype))

    def table(self):
        """The token embeddings [V, H], which the masked-LM head reuses as its decoder."""
        return self.token_embedding.embeddings


class MaskedLMHead(nn.Module):
    """dense -> exact GELU -> LayerNorm -> tied decoder (token embeddings^T) + output bias."""
    config: RobertaConfig

    @nn.compact
    def __call__(self, x, embeddings):
        """x [B, M, H], embeddings [V, H] -> logits [B, M, V]."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        h = cfg.hidden_dim
        x = Dense((h, h), (h,), dtype, name="intermediate_dense")("BMH,HK->BMK", x)
        x = LayerNorm(cfg.norm_eps, name="intermediate_layer_norm")(jax.nn.gelu(x, approximate=False))
        bias = self.param("output_bias", nn.initializers.zeros_init(), (cfg.vocab_size,), dtype)
        logits = jnp.einsum("BMH,VH->BMV", x.astype(dtype), embeddings.astype(dtype))
        return logits + bias.astype(dtype)


class Roberta(nn.Module):
    """RoBERTa masked LM.

    `apply({"params": p}, token_ids [B, T], padding_mask [B, T])` -> logits [B, T, V] at every
    position. Keyword options:
      mask_positions [B, M]: logits only at these positions -> [B, M, V] (KerasHub's
        `RobertaMaskedLM` input; in training this skips ~85% of the vocabulary projection).
      return_hidden: the encoder output [B, T, H] (KerasHub's backbone output) instead of logits.
      deterministic: False applies dropout (`config.dropout`; needs a "dropout" rng).
    """
    config: RobertaConfig

    @nn.compact
    def __call__(self, token_ids, padding_mask=None, *, mask_positions=None,
                 return_hidden: bool = False, deterministic: bool = True):
        cfg = self.config
        b, t = token_ids.shape
        if t > cfg.max_sequence_length:
            raise ValueError(f"sequence length {t} exceeds max_sequence_length={cfg.max_sequence_length}")
        if padding_mask is None:
            padding_mask = jnp.ones((b, t), bool)
        # Keys only: padded queries produce finite garbage that the loss ignores (as KerasHub).
        mask = jnp.broadcast_to(padding_mask.astype(bool)[:, None, :], (b, t, t))

        embed = Embeddings(cfg, name="embeddings")
        x = embed(token_ids)
        x = LayerNorm(cfg.norm_eps, name="embeddings_layer_norm")(x)
        x = nn.Dropout(cfg.dropout, deterministic=deterministic)(x)
        for i in range(cfg.num_layers):
            x = EncoderLayer(cfg, name=f"transformer_layer_{i}")(x, mask, deterministic)
        if return_hidden:
            return x
        if mask_positions is not None:
            x = jnp.take_along_axis(x, mask_positions.astype(jnp.int32)[..., None], axis=1)
        return MaskedLMHead(cfg, name="mlm_head")(x, embed.table())
