"""Gemma 1, 2 and 3 (text) decoders in Flax Linen, numerically matching KerasHub's
`GemmaBackbone` (Gemma 1 and 2) and `Gemma3Backbone`.

Parameter paths mirror KerasHub's `variable.path` so the layout map and LoRA targets read the
same in both worlds::

    token_embedding/embeddings                          [V, H]
    decoder_block_{i}/pre_attention_norm/scale          [H]
    decoder_block_{i}/attention/query/kernel            [N, H, D]
    decoder_block_{i}/attention/key/kernel              [K, H, D]
    decoder_block_{i}/attention/value/kernel            [K, H, D]
    decoder_block_{i}/attention/attention_output/kernel [N, D, H]
    decoder_block_{i}/pre_ffw_norm/scale                [H]
    decoder_block_{i}/ffw_gating/kernel                 [H, F]   (tanh-GELU branch)
    decoder_block_{i}/ffw_gating_2/kernel               [H, F]   (linear branch)
    decoder_block_{i}/ffw_linear/kernel                 [F, H]
    final_normalization/scale                           [H]
    Gemma 2/3 add decoder_block_{i}/{post_attention_norm,post_ffw_norm}/scale [H];
    Gemma 3 adds decoder_block_{i}/attention/{query_norm,key_norm}/scale [D].

Shapes: B batch, T query length, S key length, V vocabulary, H hidden, N query heads,
K key/value heads, G = N // K queries per KV head, D head dim, F FFN width.

The families differ only by config switches: post-sublayer norms, attention and final-logit
soft-caps (Gemma 2), sliding-window local layers interleaved with global ones
(`sliding_window_pattern`: every pattern-th layer is global; Gemma 2: 2, Gemma 3: 6) with their
own RoPE base (Gemma 3: local 10k, global 1M), and RMSNorm on queries and keys before RoPE
(Gemma 3).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn

from models import decode_kernels, ffn_kernels, kernels, layers

Cache = dict  # {"decoder_block_{i}": {"k": [B, S, K, D], "v": [B, S, K, D]}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig:
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden_dim: int
    ffw_dim: int  # the real FFN width (KerasHub's `intermediate_dim` is twice this for Gemma 1/2)
    head_dim: int
    norm_eps: float = 1e-6
    rope_base: float = 10_000.0
    dtype: str = "float32"  # parameters and compute; norms and softmax always run in float32
    remat: bool = False  # recompute each block's activations in the backward pass (saves memory)
    # Training runs the blocks as one lax.scan (compile time flat in depth) over weights stacked
    # in every step; False unrolls them: no stacking, no per-layer weight slices, a longer compile.
    scan_layers: bool = True
    # Gemma 2 / 3 switches.
    use_post_attention_norm: bool = False
    use_post_ffw_norm: bool = False
    attention_logit_soft_cap: float | None = None
    final_logit_soft_cap: float | None = None
    sliding_window_size: int | None = None  # None: every layer is global
    sliding_window_pattern: int = 2  # layer i is global iff (i + 1) % pattern == 0
    local_rope_base: float | None = None  # RoPE base of local layers (None: rope_base)
    global_rope_scaling_factor: float = 1.0  # linear RoPE scaling of global layers (Gemma 3 4B+)
    use_query_key_norm: bool = False
    query_pre_attn_scalar: float | None = None  # queries scaled by its -1/2 power (None: head_dim)
    # Training attention (no cache): "xla" (any platform) or "cudnn" (fused flash attention on
    # NVIDIA GPUs; bfloat16/float16, no attention soft-cap, rows padded on the right only).
    attention: str = "xla"

    family = "gemma"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.attention not in ("xla", "cudnn"):
            raise ValueError(f"attention={self.attention!r}: use 'xla' or 'cudnn'")
        if self.attention == "cudnn" and (self.dtype not in ("bfloat16", "float16")
                                          or self.attention_logit_soft_cap is not None):
            raise ValueError(f"attention='cudnn' needs bfloat16 or float16 and no attention soft-cap "
                             f"(got {self.dtype}, soft-cap {self.attention_logit_soft_cap}); use 'xla'")

    def replace(self, **changes) -> "GemmaConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def is_local(self, layer: int) -> bool:
        return self.sliding_window_size is not None and (layer + 1) % self.sliding_window_pattern != 0

    @property
    def num_params(self) -> int:
        """Closed-form count (KerasHub's formula); tests check it against `jax.eval_shape`."""
        v, h, n, k, d, f, l = (self.vocab_size, self.hidden_dim, self.num_heads,
                               self.num_kv_heads, self.head_dim, self.ffw_dim, self.num_layers)
        norms = 2 + self.use_post_attention_norm + self.use_post_ffw_norm
        per_layer = 2 * n * h * d + 2 * k * h * d + 3 * h * f + norms * h + 2 * d * self.use_query_key_norm
        return v * h + l * per_layer + h


PRESETS: dict[str, GemmaConfig] = {
    "gemma_2b_en": GemmaConfig(vocab_size=256_000, num_layers=18, num_heads=8, num_kv_heads=1,
                               hidden_dim=2048, ffw_dim=16_384, head_dim=256),
    "gemma_7b_en": GemmaConfig(vocab_size=256_000, num_layers=28, num_heads=16, num_kv_heads=16,
                               hidden_dim=3072, ffw_dim=24_576, head_dim=256),
    # Small enough to train on a laptop CPU in minutes; the offline default and test fixture.
    "gemma_tiny": GemmaConfig(vocab_size=4096, num_layers=2, num_heads=4, num_kv_heads=1,
                              hidden_dim=128, ffw_dim=256, head_dim=32),
}
PRESETS["gemma_instruct_2b_en"] = PRESETS["gemma_2b_en"]
PRESETS["gemma_instruct_7b_en"] = PRESETS["gemma_7b_en"]


class Attention(nn.Module):
    config: GemmaConfig
    local: bool = False  # a sliding-window layer (its mask is chosen by the caller)

    @nn.compact
    def __call__(self, x, rope, mask, cache=None, cache_index=None):
        """x [B, T, H], rope = layers.rope_table(positions, ...) for this layer's kind,
        mask [B, T, S] -> ([B, T, H], new cache or None).

        With a cache ({"k", "v": [B, S, K, D]}), the new keys/values are written at
        `cache_index` (scalar) and attention runs over all S cached slots.
        """
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        n, k, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_dim
        q, key, value = (kernels.project(layers.Einsum((heads, h, d), dtype, name=name),
                                         "BTH,NHD->BTND", x)
                         for heads, name in ((n, "query"), (k, "key"), (k, "value")))

        if cfg.use_query_key_norm:
            q = layers.RMSNorm(cfg.norm_eps, name="query_norm")(q)
            key = layers.RMSNorm(cfg.norm_eps, name="key_norm")(key)
        q = layers.rope(q, rope)
        key = layers.rope(key, rope)
        q = q * jnp.asarray(1.0 / math.sqrt(cfg.query_pre_attn_scalar or d), q.dtype)

        # Without a cache, query t sits at position t and sees keys <= t only (and, in a
        # sliding-window layer, keys > t - window only).
        window = cfg.sliding_window_size if self.local else None
        if cache is not None:  # the new keys/values go in at cache_index; attend over all S
            out, cache = decode_kernels.cached_attention(q, key, value, cache, cache_index, mask,
                                                         cfg.attention_logit_soft_cap)
        elif cfg.attention == "cudnn":  # mask: None, or packed examples apart
            out = layers.fused_causal_attention(q, key, value, window, mask)
        else:
            # Training under a table that splits no heads: each device takes its share of rows.
            rows = ("attention_batch", None, None, None)
            q, key, value = (layers.constrain(a, rows) for a in (q, key, value))
            mask = layers.constrain(mask, rows[:3])
            out = kernels.causal_attention(q, key, value, mask, cfg.attention_logit_soft_cap, window)
            out = layers.constrain(out, rows)
        out_proj = layers.Einsum((n, d, h), dtype, name="attention_output")
        out = kernels.project(out_proj, "BTND,NDH->BTH", out)
        return out, cache


def feed_forward(cfg: GemmaConfig, x):
    """GeGLU: ffw_linear(gelu_tanh(x @ ffw_gating) * (x @ ffw_gating_2)), x [B, T, H].

    A function, not a module, so its kernels sit directly under `decoder_block_{i}/` as in KerasHub.
    Call it inside a compact method: the layers bind to the calling module.
    """
    dtype = jnp.dtype(cfg.dtype)
    h, f = cfg.hidden_dim, cfg.ffw_dim
    gating, gating_2 = (layers.Einsum((h, f), dtype, name=n) for n in ("ffw_gating", "ffw_gating_2"))
    linear = layers.Einsum((f, h), dtype, name="ffw_linear")
    return ffn_kernels.gated_ffn(x, gating, gating_2, linear)


class DecoderBlock(nn.Module):
    config: GemmaConfig
    local: bool = False

    @nn.compact
    def __call__(self, x, rope, mask, cache=None, cache_index=None):
        cfg = self.config
        normed = layers.RMSNorm(cfg.norm_eps, name="pre_attention_norm")(x)
        attn, cache = Attention(cfg, self.local, name="attention")(normed, rope, mask, cache, cache_index)
        if cfg.use_post_attention_norm:  # Gemma 2/3: normalise the sublayer output before the residual
            attn = layers.RMSNorm(cfg.norm_eps, name="post_attention_norm")(attn)
        x = x + attn
        normed = layers.RMSNorm(cfg.norm_eps, name="pre_ffw_norm")(x)
        ffw = feed_forward(cfg, normed)
        if cfg.use_post_ffw_norm:
            ffw = layers.RMSNorm(cfg.norm_eps, name="post_ffw_norm")(ffw)
        return x + ffw, cache


class Gemma(nn.Module):
    """Gemma causal LM.

    `apply({"params": p}, token_ids [B, T], padding_mask [B, T])` -> logits [B, T, V].

    Keyword options:
      segment_ids, positions: int [B, T], for packed rows (`jaxlm.data.packing`): token t sees
        key s only where segment_ids agree (0 = padding), and RoPE rotates by `positions`
        (restarting at each example) instead of t. Training only (no cache).
      return_hidden: return the final-normed hidden states [B, T, H] instead of logits (the
        training loss projects them onto the vocabulary in chunks).
      cache, cache_index: decode with a KV cache (see `init_cache`); then `padding_mask` is the
        key mask over the cache slots [B, S] and the result is `(logits, new_cache)`.
    """
    config: GemmaConfig

    def setup(self):
        cfg = self.config
        self.token_embedding = layers.Embedding(cfg.vocab_size, cfg.hidden_dim,
                                                jnp.dtype(cfg.dtype), name="token_embedding")
        # Explicit names keep KerasHub's `decoder_block_{i}` paths.
        block = nn.remat(DecoderBlock, static_argnums=(5,)) if cfg.remat else DecoderBlock
        self.blocks = [block(cfg, cfg.is_local(i), name=f"decoder_block_{i}") for i in range(cfg.num_layers)]
        self.final_normalization = layers.RMSNorm(cfg.norm_eps, name="final_normalization")

    def __call__(self, token_ids, padding_mask=None, *, segment_ids=None, positions=None,
                 return_hidden=False, cache: Cache | None = None, cache_index=None):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        b, t = token_ids.shape
        if padding_mask is None:
            padding_mask = jnp.ones((b, t) if cache is None else (b, cache_size(cache)), bool)
        padding_mask = padding_mask.astype(bool)
        if cache is not None and (segment_ids is not None or positions is not None):
            raise ValueError("segment_ids / positions (packed rows) are for training, not with a cache")

        x = self.token_embedding(token_ids)
        x = x * jnp.asarray(math.sqrt(cfg.hidden_dim), dtype)  # the scale is rounded to dtype, as KerasHub

        start = 0 if cache is None else cache_index
        index = start + jnp.arange(t)[None, :]
        key_index = jnp.arange(t if cache is None else cache_size(cache))
        # Causal AND key padding; padded queries are left unmasked (as KerasHub) and ignored by the loss.
        mask = (index[:, :, None] >= key_index[None, None, :]) & padding_mask[:, None, :]
        if segment_ids is not None:  # packed rows: a token sees its own example only
            mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
        # What each kind of layer attends with, {local?: (RoPE table, mask)}. The tables are
        # built once here, outside the layer scan: built next to their use, XLA fused cos/sin
        # into the rotation (and its backward) and evaluated them for every element of q and k.
        # Unpacked, positions are the same for every row and a table is [1, T, 1, D/2]; packed
        # rows restart them at each example ([B, T, 1, D/2]).
        positions = index if positions is None else positions
        rope = layers.rope_table(positions, cfg.head_dim, cfg.rope_base, cfg.global_rope_scaling_factor)
        # The fused kernel is causal (and windowed) by construction: it needs a mask only to keep
        # packed examples apart.
        if cache is None and cfg.attention == "cudnn" and segment_ids is None:
            mask = None
        inputs = {False: (rope, mask), True: (rope, mask)}
        if cfg.sliding_window_size is not None:  # local layers see keys in (t - W, t]
            local_mask = None if mask is None else (
                mask & (index[:, :, None] - key_index[None, None, :] < cfg.sliding_window_size))
            inputs[True] = (layers.rope_table(positions, cfg.head_dim, cfg.local_rope_base or cfg.rope_base),
                            local_mask)

        new_cache = {} if cache is not None else None
        if cache is None and cfg.scan_layers and not self.is_initializing():
            x = self._scan_blocks(x, inputs)
        else:  # init names the parameters; decoding keeps one cache entry per layer
            for i, block in enumerate(self.blocks):
                layer_cache = None if cache is None else cache[f"decoder_block_{i}"]
                x, layer_cache = block(x, *inputs[block.local], layer_cache, cache_index)
                if cache is not None:
                    new_cache[f"decoder_block_{i}"] = layer_cache
        # what the loss projects onto the vocabulary, split as a table may ask (`sharding.rules`)
        x = layers.constrain(self.final_normalization(x), ("batch", None, "hidden"))
        out = x if return_hidden else layers.soft_cap(self.token_embedding.attend(x), cfg.final_logit_soft_cap)
        return out if cache is None else (out, new_cache)


    def _scan_blocks(self, x, inputs):
        """The blocks as one `lax.scan` over layer periods, so compile time does not grow with depth.

        The parameter tree keeps KerasHub's `decoder_block_{i}` paths: the scan runs over a
        stacked view [L/P, P, ...] built here (a copy of the block weights per call, which XLA
        fuses into the step). P = sliding_window_pattern when local layers exist (the body
        holds one period of local/global blocks with their masks and RoPE tables), else 1;
        layers past the last whole period run unrolled. Same math as the per-layer loop.
        """
        cfg = self.config
        period = cfg.sliding_window_pattern if cfg.sliding_window_size is not None else 1
        n = cfg.num_layers // period * period
        layer_params = [self.blocks[i].variables["params"] for i in range(cfg.num_layers)]
        kinds = [DecoderBlock(cfg, cfg.is_local(j), parent=None) for j in range(period)]  # unbound

        def body(h, period_params):
            for j, block in enumerate(kinds):
                h, _ = block.apply({"params": jax.tree.map(lambda p: p[j], period_params)},
                                   h, *inputs[block.local])
            return h, None

        if cfg.remat:  # as nn.remat on each block: keep only each period's input
            body = jax.checkpoint(body)
        else:  # keep weight-matmul outputs, recompute the rest: a scan's residuals cannot be
            # fused away as the unrolled loop's were (Gemma 2B LoRA on a v3 core: 19.8 GiB of
            # temporaries with every residual saved, 5.8 with this policy, 6.0 unrolled)
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        if n:
            stacked = jax.tree.map(lambda *p: jnp.stack(p).reshape(n // period, period, *p[0].shape),
                                   *layer_params[:n])
            x, _ = jax.lax.scan(body, x, stacked)
        for i in range(n, cfg.num_layers):
            x, _ = self.blocks[i](x, *inputs[self.blocks[i].local], None, None)
        return x


def cache_size(cache: Cache) -> int:
    return next(iter(cache.values()))["k"].shape[1]


def init_cache(config: GemmaConfig, batch_size: int, length: int, dtype=None) -> Cache:
    """Zeroed KV cache: per layer {"k", "v": [B, length, K, D]} in the compute dtype."""
    shape = (batch_size, length, config.num_kv_heads, config.head_dim)
    dtype = jnp.dtype(dtype or config.dtype)
    return {f"decoder_block_{i}": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
            for i in range(config.num_layers)}
