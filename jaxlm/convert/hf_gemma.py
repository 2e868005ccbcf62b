"""Gemma <-> Hugging Face `GemmaForCausalLM`, `Gemma2ForCausalLM`, `Gemma3ForCausalLM` (and the
text tower of `Gemma3ForConditionalGeneration`): config.json fields and tensor names.

    model.embed_tokens.weight [V, H]                 token_embedding/embeddings (LM head tied)
    model.layers.i.self_attn.{q,k,v}_proj.weight     attention/{query,key,value}/kernel
    model.layers.i.self_attn.o_proj.weight           attention/attention_output/kernel
    model.layers.i.self_attn.{q,k}_norm.weight       attention/{query,key}_norm/scale (Gemma 3)
    model.layers.i.mlp.{gate,up,down}_proj.weight    ffw_gating, ffw_gating_2, ffw_linear
    model.layers.i.input_layernorm.weight            pre_attention_norm
    model.norm.weight                                final_normalization

The norms after attention differ by generation: Gemma 1's `post_attention_layernorm` is the
norm *before* the FFN (it has no post-sublayer norms); Gemma 2/3 name that one
`pre_feedforward_layernorm` and use `post_attention_layernorm` / `post_feedforward_layernorm`
for the post norms. RMSNorm weights are zero-centred and applied as x * (1 + w) on both sides,
and both scale the embedding by sqrt(H) at run time, so those tensors copy unchanged.

Missing config keys take the transformers class defaults, which are not ours: Gemma 2 caps
attention logits at 50 and final logits at 30 and Gemma 2/3 scale queries by
`query_pre_attn_scalar` = 256 unless config.json says otherwise.
"""
from __future__ import annotations

from jaxlm.convert.hf_tensors import Tensor, heads_in, heads_out, linear, same
from jaxlm.errors import UserError
from models.gemma import GemmaConfig

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3")
ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}
# Where a multimodal Gemma 3 keeps its text tower: as saved by transformers, and its in-memory names.
TEXT_TOWER_PREFIXES = ("language_model.model.", "model.language_model.")
# Tensors a Gemma checkpoint may carry that the text model does not use.
IGNORED = (r"lm_head\.weight", r"(model\.)?vision_tower\..*", r"(model\.)?multi_modal_projector\..*")
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")
_DEFAULTS = {  # the transformers config classes' defaults for keys a config.json may omit
    "gemma": dict(rope_theta=10_000.0),
    "gemma2": dict(rope_theta=10_000.0, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0, pattern=2),
    "gemma3_text": dict(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
                        sliding_window=4096, final_logit_softcapping=None,
                        attn_logit_softcapping=None, pattern=6),
}


def text_config(c: dict) -> dict:
    """A multimodal `gemma3` config's text part (as `gemma3_text`); other configs unchanged."""
    if c.get("model_type") == "gemma3":
        text = c.get("text_config")
        if not isinstance(text, dict):
            raise UserError("this gemma3 config.json has no text_config; is it complete?")
        return {"model_type": "gemma3_text", **text}
    return c


def config_from_hf(c: dict) -> GemmaConfig:
    c = text_config(c)
    kind = c["model_type"]
    defaults = _DEFAULTS[kind]
    get = lambda key: c.get(key, defaults.get(key))  # noqa: E731
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _TANH_GELU + (("gelu",) if kind == "gemma" else ()):  # HF reads Gemma 1's legacy "gelu" as tanh
        raise UserError(f"hidden activation {act!r} is not Gemma's tanh GELU; jaxlm cannot run this config")
    for key, ok in (("tie_word_embeddings", True), ("attention_bias", False),
                    ("use_bidirectional_attention", False)):
        if bool(c.get(key, ok)) != ok:
            raise UserError(f"config.json has {key}={c[key]}; jaxlm's Gemma supports only {key}={ok}")
    try:
        heads, hidden = int(c["num_attention_heads"]), int(c["hidden_size"])
        head_dim = int(c.get("head_dim") or hidden // heads)
        args = dict(vocab_size=int(c["vocab_size"]), num_layers=int(c["num_hidden_layers"]),
                    num_heads=heads, num_kv_heads=int(c.get("num_key_value_heads") or heads),
                    hidden_dim=hidden, ffw_dim=int(c["intermediate_size"]), head_dim=head_dim,
                    norm_eps=float(c.get("rms_norm_eps", 1e-6)))
    except KeyError as e:
        raise UserError(f"{kind} config.json is missing {e.args[0]!r}; is it complete?") from None
    global_rope, local_rope, factor = _rope(c, kind, defaults)
    args.update(rope_base=global_rope)
    if kind == "gemma":
        return GemmaConfig(**args)
    window = get("sliding_window")
    pattern = _pattern(c, args["num_layers"], defaults["pattern"])
    scalar = float(get("query_pre_attn_scalar"))
    args.update(use_post_attention_norm=True, use_post_ffw_norm=True,
                attention_logit_soft_cap=_float(get("attn_logit_softcapping")),
                final_logit_soft_cap=_float(get("final_logit_softcapping")),
                sliding_window_size=int(window) if window and pattern else None,
                sliding_window_pattern=pattern or defaults["pattern"],
                query_pre_attn_scalar=None if scalar == head_dim else scalar)
    if kind == "gemma3_text":
        args.update(use_query_key_norm=True, local_rope_base=local_rope, global_rope_scaling_factor=factor)
    return GemmaConfig(**args)


def _float(x):
    return None if x is None else float(x)


def _rope(c: dict, kind: str, defaults: dict) -> tuple[float, float | None, float]:
    """-> (global base, local base, global linear scaling factor), from transformers 5's
    `rope_parameters` or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling` keys."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # Gemma 3: one entry per layer type
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
    else:
        full = params if isinstance(params, dict) else {}
        local = {"rope_theta": c.get("rope_local_base_freq", defaults.get("rope_local_base_freq"))}
        full = {"rope_theta": c.get("rope_theta", defaults["rope_theta"]), **(c.get("rope_scaling") or {}), **full}
    full_type = full.get("rope_type", full.get("type", "default"))
    local_type = local.get("rope_type", local.get("type", "default"))
    if full_type not in ("default", "linear") or local_type != "default":
        raise UserError(f"RoPE type {full_type!r} (global) / {local_type!r} (local) is not supported; "
                        "jaxlm implements default RoPE and linear scaling of global layers")
    factor = float(full.get("factor", 1.0)) if full_type == "linear" else 1.0
    theta = float(full.get("rope_theta", defaults["rope_theta"]))
    local_theta = local.get("rope_theta")
    return theta, (None if kind != "gemma3_text" else float(local_theta)), factor


def _pattern(c: dict, num_layers: int, default: int) -> int | None:
    """The p with layer i global iff (i + 1) % p == 0 that reproduces `layer_types`; None when
    no layer is sliding. Without layer_types: `sliding_window_pattern` (or the class default)."""
    hint = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or default)
    types = c.get("layer_types")
    if types is None:
        return hint
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UserError(f"layer_types {types} does not list {num_layers} sliding_attention/full_attention "
                        "entries; the config is damaged")
    if "sliding_attention" not in types:
        return None
    first_full = types.index("full_attention") + 1 if "full_attention" in types else None
    for p in (hint, first_full, num_layers + 1):
        if p and all((t == "sliding_attention") == ((i + 1) % p != 0) for i, t in enumerate(types)):
            return p
    raise UserError(f"layer_types {types} is not a periodic local/global pattern (every p-th layer "
                    "global), the only one jaxlm's Gemma implements")


def model_type(cfg: GemmaConfig) -> str:
    """The transformers model type that runs `cfg` exactly, or a UserError naming what has none."""
    post = (cfg.use_post_attention_norm, cfg.use_post_ffw_norm)
    if post not in ((False, False), (True, True)):
        raise UserError("transformers' Gemma models have both post-sublayer norms or neither; this "
                        f"config has use_post_attention_norm={post[0]}, use_post_ffw_norm={post[1]}")
    if cfg.use_query_key_norm:
        if not post[0]:
            raise UserError("Gemma 3 (query/key norms) in transformers always has post-sublayer norms")
        return "gemma3_text"
    problems = []
    if cfg.local_rope_base not in (None, cfg.rope_base):
        problems.append(f"local_rope_base={cfg.local_rope_base}")
    if cfg.global_rope_scaling_factor != 1.0:
        problems.append(f"global_rope_scaling_factor={cfg.global_rope_scaling_factor}")
    if post[0]:
        if cfg.sliding_window_size is not None and cfg.sliding_window_pattern != 2:
            problems.append(f"sliding_window_pattern={cfg.sliding_window_pattern}")
        kind = "gemma2"
    else:
        for name in ("attention_logit_soft_cap", "final_logit_soft_cap", "sliding_window_size"):
            if getattr(cfg, name) is not None:
                problems.append(f"{name}={getattr(cfg, name)}")
        if cfg.query_pre_attn_scalar not in (None, cfg.head_dim):
            problems.append(f"query_pre_attn_scalar={cfg.query_pre_attn_scalar}")
        kind = "gemma"
    if problems:
        raise UserError(f"transformers' {kind} model has no equivalent of {', '.join(problems)}")
    return kind


def config_to_hf(cfg: GemmaConfig, special_ids: dict) -> dict:
    """config.json for the model type of `cfg`. special_ids: {"bos", "eos", "pad"} token ids.

    RoPE is written with the keys transformers 4.x reads (rope_theta, rope_local_base_freq,
    rope_scaling); transformers 5 converts them to its `rope_parameters` on load.
    """
    kind = model_type(cfg)
    c = {"architectures": [ARCHITECTURES[kind]], "model_type": kind,
         "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_dim,
         "intermediate_size": cfg.ffw_dim, "num_hidden_layers": cfg.num_layers,
         "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
         "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
         "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
         "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
         "max_position_embeddings": 131_072 if kind == "gemma3_text" else 8192,
         "bos_token_id": special_ids["bos"], "eos_token_id": special_ids["eos"],
         "pad_token_id": special_ids["pad"],
         # transformers 5 reads "dtype", 4.x "torch_dtype"
         "dtype": cfg.dtype, "torch_dtype": cfg.dtype}
    if kind == "gemma":
        return c
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    if scalar != int(scalar):  # transformers 5 validates it as an int
        raise UserError(f"query_pre_attn_scalar={scalar} is not an integer, which transformers requires")
    window = cfg.sliding_window_size
    c.update(query_pre_attn_scalar=int(scalar),
             attn_logit_softcapping=cfg.attention_logit_soft_cap,
             final_logit_softcapping=cfg.final_logit_soft_cap,
             sliding_window=window or 4096, sliding_window_pattern=cfg.sliding_window_pattern,
             layer_types=["sliding_attention" if cfg.is_local(i) else "full_attention"
                          for i in range(cfg.num_layers)])
    if kind == "gemma3_text":
        c.update(rope_local_base_freq=cfg.local_rope_base or cfg.rope_base,
                 rope_scaling=None if cfg.global_rope_scaling_factor == 1.0 else
                 {"rope_type": "linear", "factor": cfg.global_rope_scaling_factor})
    return c


def tensors(cfg: GemmaConfig, hf_config: dict | None = None) -> dict[str, Tensor]:
    """{our parameter path: Tensor} for every parameter of `cfg` (see the module docstring);
    hf_config (the file's config.json when reading) changes nothing for Gemma."""
    kind = model_type(cfg)
    v, h, n, k, d, f = (cfg.vocab_size, cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.ffw_dim)
    out = {"token_embedding/embeddings": same("model.embed_tokens.weight", (v, h)),
           "final_normalization/scale": same("model.norm.weight", (h,))}
    norms = {"pre_attention_norm": "input_layernorm"}
    norms.update({"pre_ffw_norm": "post_attention_layernorm"} if kind == "gemma" else
                 {"post_attention_norm": "post_attention_layernorm",
                  "pre_ffw_norm": "pre_feedforward_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"})
    for i in range(cfg.num_layers):
        ours, hf = f"decoder_block_{i}", f"model.layers.{i}"
        att = f"{hf}.self_attn"
        out.update({
            f"{ours}/attention/query/kernel": heads_in(f"{att}.q_proj.weight", (n, h, d)),
            f"{ours}/attention/key/kernel": heads_in(f"{att}.k_proj.weight", (k, h, d)),
            f"{ours}/attention/value/kernel": heads_in(f"{att}.v_proj.weight", (k, h, d)),
            f"{ours}/attention/attention_output/kernel": heads_out(f"{att}.o_proj.weight", (n, d, h)),
            f"{ours}/ffw_gating/kernel": linear(f"{hf}.mlp.gate_proj.weight", (h, f)),
            f"{ours}/ffw_gating_2/kernel": linear(f"{hf}.mlp.up_proj.weight", (h, f)),
            f"{ours}/ffw_linear/kernel": linear(f"{hf}.mlp.down_proj.weight", (f, h)),
        })
        out.update({f"{ours}/{a}/scale": same(f"{hf}.{b}.weight", (h,)) for a, b in norms.items()})
        if cfg.use_query_key_norm:
            out[f"{ours}/attention/query_norm/scale"] = same(f"{att}.q_norm.weight", (d,))
            out[f"{ours}/attention/key_norm/scale"] = same(f"{att}.k_norm.weight", (d,))
    return out
