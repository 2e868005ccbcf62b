"""Gemma <-> KerasHub `GemmaBackbone`: config fields and H5 weight locations."""
from __future__ import annotations

from jaxlm.errors import UserError
from jaxlm.families import Family, register
from models.gemma import Gemma, GemmaConfig, PRESETS

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
_GEMMA2 = {"post_attention_norm/scale": "post_attention_norm", "post_ffw_norm/scale": "post_ffw_norm"}


def keras_paths(cfg: GemmaConfig) -> dict[str, str]:
    paths = {"token_embedding/embeddings": "layers/reversible_embedding/vars/0",
             "final_normalization/scale": "layers/rms_normalization/vars/0"}
    block = dict(_BLOCK)
    if cfg.use_post_attention_norm:
        block["post_attention_norm/scale"] = _GEMMA2["post_attention_norm/scale"]
    if cfg.use_post_ffw_norm:
        block["post_ffw_norm/scale"] = _GEMMA2["post_ffw_norm/scale"]
    for i in range(cfg.num_layers):
        group = "layers/gemma_decoder_block" + (f"_{i}" if i else "")  # block 0 has no suffix
        for ours, theirs in block.items():
            paths[f"decoder_block_{i}/{ours}"] = f"{group}/{theirs}/vars/0"
    return paths


def config_from_keras(c: dict) -> GemmaConfig:
    """GemmaBackbone constructor arguments -> GemmaConfig (missing keys take Keras' defaults)."""
    gemma2 = [k for k in ("use_post_attention_norm", "use_post_ffw_norm", "attention_logit_soft_cap",
                          "final_logit_soft_cap", "use_sliding_window_attention") if c.get(k)]
    if gemma2:
        raise UserError(f"this preset uses Gemma 2 features ({', '.join(gemma2)}) that jaxlm does not "
                        "support yet; use a Gemma 1 preset")
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


def config_to_keras(cfg: GemmaConfig) -> dict:
    return {
        "module": "keras_hub.src.models.gemma.gemma_backbone",
        "class_name": "GemmaBackbone",
        "config": {
            "name": "gemma_backbone", "trainable": True,
            "dtype": {"module": "keras", "class_name": "DTypePolicy",
                      "config": {"name": cfg.dtype}, "registered_name": None},
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


FAMILY = register(Family(
    name="gemma", config_cls=GemmaConfig, module_cls=Gemma, presets=PRESETS,
    keras_classes=("GemmaBackbone",), config_from_keras=config_from_keras,
    config_to_keras=config_to_keras, keras_paths=keras_paths, keras_tasks=("CausalLM",)))
