"""Gemma <-> KerasHub `GemmaBackbone` (Gemma 1 and 2) and `Gemma3Backbone` (text): config
fields and H5 weight locations.

Conventions that differ between the two Keras classes: `GemmaBackbone.intermediate_dim` is twice
the FFN width and its queries are always scaled by 1/sqrt(head_dim); `Gemma3Backbone` stores the
real width, interleaves 5 local : 1 global layers with RoPE bases 10k / 1M, and normalises
queries and keys.
"""
from __future__ import annotations

import sys

from jaxlm.convert.keras_preset import dtype_policy
from jaxlm.errors import UserError
from models.gemma import GemmaConfig

# our sub-path under decoder_block_{i}/ -> KerasHub attribute path under the block's H5 group
_BLOCK = {
    "pre_attention_norm/scale": "pre_attention_norm",
    "attention/query/kernel": "attention/query_dense",
    "attention/key/kernel": "attention/key_dense",
    "attention/value/kernel": "attention/value_dense",
    "attention/attention_output/kernel": "attention/output_dense",
    "pre_ffw_norm/scale": "pre_ffw_norm",
    "ffw_gating/kernel": "gating_ffw",
    "ffw_gating_2/kernel": "gating_ffw_2",
    "ffw_linear/kernel": "ffw_linear",
}
_OPTIONAL = {  # config switch -> {our sub-path: Keras sub-path}
    "use_post_attention_norm": {"post_attention_norm/scale": "post_attention_norm"},
    "use_post_ffw_norm": {"post_ffw_norm/scale": "post_ffw_norm"},
    "use_query_key_norm": {"attention/query_norm/scale": "attention/query_norm",
                           "attention/key_norm/scale": "attention/key_norm"},
}


def is_gemma3(cfg: GemmaConfig) -> bool:
    return cfg.use_query_key_norm or cfg.sliding_window_pattern == 6


def keras_paths(cfg: GemmaConfig) -> dict[str, str]:
    paths = {"token_embedding/embeddings": "layers/reversible_embedding/vars/0",
             "final_normalization/scale": "layers/rms_normalization/vars/0"}
    block = dict(_BLOCK)
    for switch, extra in _OPTIONAL.items():
        if getattr(cfg, switch):
            block.update(extra)
    prefix = "layers/gemma3_decoder_block" if is_gemma3(cfg) else "layers/gemma_decoder_block"
    for i in range(cfg.num_layers):
        group = prefix + (f"_{i}" if i else "")  # block 0 has no suffix
        for ours, theirs in block.items():
            paths[f"decoder_block_{i}/{ours}"] = f"{group}/{theirs}/vars/0"
    return paths


def config_from_keras(c: dict) -> GemmaConfig:
    """Backbone constructor arguments -> GemmaConfig (missing keys take Keras' defaults)."""
    if "local_rope_scaling_factor" in c or "use_query_key_norm" in c:  # only Gemma3Backbone has them
        return _gemma3_from_keras(c)
    if c.get("query_head_dim_normalize", True) is False:
        # keras-hub's GemmaDecoderBlock passes query_head_dim_normalize=True to its attention
        # whatever the backbone says; match what KerasHub computes (weights trained there).
        print("warning: this GemmaBackbone config has query_head_dim_normalize=False, which "
              "KerasHub ignores (it scales queries by 1/sqrt(head_dim)); jaxlm does the same",
              file=sys.stderr)
    try:
        window = c.get("sliding_window_size", 4096) if c.get("use_sliding_window_attention") else None
        return GemmaConfig(
            vocab_size=int(c["vocabulary_size"]), num_layers=int(c["num_layers"]),
            num_heads=int(c["num_query_heads"]), num_kv_heads=int(c["num_key_value_heads"]),
            hidden_dim=int(c["hidden_dim"]), ffw_dim=int(c["intermediate_dim"]) // 2,
            head_dim=int(c["head_dim"]), norm_eps=float(c.get("layer_norm_epsilon", 1e-6)),
            use_post_attention_norm=bool(c.get("use_post_attention_norm", False)),
            use_post_ffw_norm=bool(c.get("use_post_ffw_norm", False)),
            attention_logit_soft_cap=c.get("attention_logit_soft_cap"),
            final_logit_soft_cap=c.get("final_logit_soft_cap"),
            sliding_window_size=window)
    except KeyError as e:
        raise UserError(f"GemmaBackbone config is missing {e.args[0]!r}; is config.json complete?") from None


def _gemma3_from_keras(c: dict) -> GemmaConfig:
    unsupported = [k for k in ("vision_encoder", "use_bidirectional_attention", "is_embedding_model")
                   if c.get(k)]
    if unsupported or float(c.get("local_rope_scaling_factor", 1.0)) != 1.0:
        raise UserError(f"Gemma3Backbone options {unsupported or ['local_rope_scaling_factor']} are not "
                        "supported; jaxlm loads the text-only causal model")
    try:
        normalize = c.get("query_head_dim_normalize", True)
        return GemmaConfig(
            vocab_size=int(c["vocabulary_size"]), num_layers=int(c["num_layers"]),
            num_heads=int(c["num_query_heads"]), num_kv_heads=int(c["num_key_value_heads"]),
            hidden_dim=int(c["hidden_dim"]), ffw_dim=int(c["intermediate_dim"]),
            head_dim=int(c["head_dim"]), norm_eps=float(c.get("layer_norm_epsilon", 1e-6)),
            rope_base=1_000_000.0, local_rope_base=10_000.0,
            global_rope_scaling_factor=float(c.get("global_rope_scaling_factor", 1.0)),
            use_post_attention_norm=bool(c.get("use_post_attention_norm", False)),
            use_post_ffw_norm=bool(c.get("use_post_ffw_norm", False)),
            use_query_key_norm=bool(c.get("use_query_key_norm", True)),
            attention_logit_soft_cap=c.get("attention_logit_soft_cap"),
            final_logit_soft_cap=c.get("final_logit_soft_cap"),
            sliding_window_size=(int(c.get("sliding_window_size", 1024))
                                 if c.get("use_sliding_window_attention") else None),
            sliding_window_pattern=6,
            query_pre_attn_scalar=None if normalize else int(c["hidden_dim"]) / int(c["num_query_heads"]))
    except KeyError as e:
        raise UserError(f"Gemma3Backbone config is missing {e.args[0]!r}; is config.json complete?") from None


def _gemma3_to_keras(cfg: GemmaConfig) -> dict:
    if cfg.query_pre_attn_scalar not in (None, cfg.head_dim, cfg.hidden_dim / cfg.num_heads):
        raise UserError(f"query_pre_attn_scalar={cfg.query_pre_attn_scalar} has no Gemma3Backbone equivalent")
    return {
        "module": "keras_hub.src.models.gemma3.gemma3_backbone",
        "class_name": "Gemma3Backbone",
        "config": {
            "name": "gemma3_backbone", "trainable": True,
            "dtype": dtype_policy(cfg.dtype),
            "vocabulary_size": cfg.vocab_size, "image_size": None, "num_layers": cfg.num_layers,
            "num_query_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "hidden_dim": cfg.hidden_dim, "intermediate_dim": cfg.ffw_dim, "head_dim": cfg.head_dim,
            "query_head_dim_normalize": cfg.query_pre_attn_scalar in (None, cfg.head_dim),
            "use_query_key_norm": cfg.use_query_key_norm,
            "use_post_ffw_norm": cfg.use_post_ffw_norm,
            "use_post_attention_norm": cfg.use_post_attention_norm,
            "attention_logit_soft_cap": cfg.attention_logit_soft_cap,
            "final_logit_soft_cap": cfg.final_logit_soft_cap,
            "use_sliding_window_attention": cfg.sliding_window_size is not None,
            "sliding_window_size": cfg.sliding_window_size or 1024,
            "local_rope_scaling_factor": 1.0,
            "global_rope_scaling_factor": cfg.global_rope_scaling_factor,
            "vision_encoder": None, "use_bidirectional_attention": False,
            "layer_norm_epsilon": cfg.norm_eps, "dropout": 0,
        },
        "registered_name": "keras_hub>Gemma3Backbone",
    }


def config_to_keras(cfg: GemmaConfig) -> dict:
    if is_gemma3(cfg):
        return _gemma3_to_keras(cfg)
    return {
        "module": "keras_hub.src.models.gemma.gemma_backbone",
        "class_name": "GemmaBackbone",
        "config": {
            "name": "gemma_backbone", "trainable": True,
            "dtype": dtype_policy(cfg.dtype),
            "vocabulary_size": cfg.vocab_size, "num_layers": cfg.num_layers,
            "num_query_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "hidden_dim": cfg.hidden_dim, "intermediate_dim": 2 * cfg.ffw_dim,
            "head_dim": cfg.head_dim, "layer_norm_epsilon": cfg.norm_eps, "dropout": 0,
            "query_head_dim_normalize": True,
            "use_post_ffw_norm": cfg.use_post_ffw_norm,
            "use_post_attention_norm": cfg.use_post_attention_norm,
            "final_logit_soft_cap": cfg.final_logit_soft_cap,
            "attention_logit_soft_cap": cfg.attention_logit_soft_cap,
            "sliding_window_size": cfg.sliding_window_size or 4096,
            "use_sliding_window_attention": cfg.sliding_window_size is not None,
        },
        "registered_name": "keras_hub>GemmaBackbone",
    }
