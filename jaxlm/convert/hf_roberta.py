"""RoBERTa <-> Hugging Face `RobertaForMaskedLM`: config.json fields and tensor names.

    roberta.embeddings.word_embeddings.weight [V, H]      embeddings/token_embedding/embeddings
    roberta.embeddings.position_embeddings.weight [P+2, H] + token_type_embeddings[0]
                                                          embeddings/position_embedding/embeddings [P, H]
    roberta.embeddings.LayerNorm.{weight,bias}            embeddings_layer_norm/{gamma,beta}
    roberta.encoder.layer.i.attention.self.{query,key,value}   self_attention_layer/{...} [H, N, D], bias [N, D]
    roberta.encoder.layer.i.attention.output.dense        self_attention_layer/attention_output
    roberta.encoder.layer.i.attention.output.LayerNorm    self_attention_layer_norm
    roberta.encoder.layer.i.intermediate.dense            feedforward_intermediate_dense
    roberta.encoder.layer.i.output.dense / .LayerNorm     feedforward_output_dense / feedforward_layer_norm
    lm_head.dense, lm_head.layer_norm, lm_head.bias       mlm_head/{intermediate_dense, intermediate_layer_norm, output_bias}
    (lm_head.decoder is tied to the word embeddings)

Positions: HF numbers real tokens from pad_token_id + 1 (= 2), counting only non-pad ids; we
number them 0..T-1, so our table is HF's rows 2.. and right-padded inputs (no real token
equal to the pad id) see the same rows. jaxlm has no token-type table: every HF input uses
type 0 unless told otherwise, so row 0 is added into our position rows on import, and an
export writes a zero type table (and zero rows 0 and 1, which only padding reaches).
"""
from __future__ import annotations

import numpy as np

from jaxlm.convert.hf_tensors import Tensor, flat, heads_out, hidden_heads, linear, same
from jaxlm.errors import UserError
from models.roberta import RobertaConfig

MODEL_TYPES = ("roberta",)
IGNORED = (r"roberta\.pooler\..*", r"roberta\.embeddings\.position_ids", r"lm_head\.decoder\.(weight|bias)")
PAD_ID = 1  # HF derives positions from it; KerasHub's and HF's RoBERTa vocabularies put <pad> at 1


def config_from_hf(c: dict) -> RobertaConfig:
    arch = c.get("architectures") or ["RobertaForMaskedLM"]
    if arch[0] != "RobertaForMaskedLM":
        raise UserError(f"{arch[0]} is not supported; jaxlm loads RobertaForMaskedLM checkpoints")
    for key, ok in (("hidden_act", "gelu"), ("position_embedding_type", "absolute"), ("is_decoder", False)):
        if c.get(key, ok) != ok:
            raise UserError(f"config.json has {key}={c[key]!r}; jaxlm's RoBERTa supports only {ok!r}")
    try:
        return RobertaConfig(
            vocab_size=int(c["vocab_size"]), num_layers=int(c["num_hidden_layers"]),
            num_heads=int(c["num_attention_heads"]), hidden_dim=int(c["hidden_size"]),
            intermediate_dim=int(c["intermediate_size"]),
            max_sequence_length=int(c["max_position_embeddings"]) - int(c.get("pad_token_id", PAD_ID)) - 1,
            norm_eps=float(c.get("layer_norm_eps", 1e-12)))
    except KeyError as e:
        raise UserError(f"roberta config.json is missing {e.args[0]!r}; is it complete?") from None


def config_to_hf(cfg: RobertaConfig, special_ids: dict) -> dict:
    if special_ids["pad"] != PAD_ID:
        raise UserError(f"the tokenizer's pad id is {special_ids['pad']}; HF RoBERTa derives "
                        f"positions from pad id {PAD_ID}, so the export would not match")
    return {"architectures": ["RobertaForMaskedLM"], "model_type": "roberta",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_dim,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "intermediate_size": cfg.intermediate_dim, "hidden_act": "gelu",
            "max_position_embeddings": cfg.max_sequence_length + PAD_ID + 1, "type_vocab_size": 1,
            "layer_norm_eps": cfg.norm_eps, "hidden_dropout_prob": cfg.dropout,
            "attention_probs_dropout_prob": cfg.dropout, "position_embedding_type": "absolute",
            "tie_word_embeddings": True, "pad_token_id": PAD_ID,
            "bos_token_id": special_ids["bos"], "eos_token_id": special_ids["eos"],
            "dtype": cfg.dtype, "torch_dtype": cfg.dtype}


def _positions(p: int, h: int, offset: int, types: int) -> Tensor:
    """Our [P, H] table <-> HF's [offset + P, H] positions and [types, H] token types."""
    def to_hf(w):
        return np.concatenate([np.zeros((offset, h), w.dtype), w]), np.zeros((types, h), w.dtype)
    return Tensor((p, h), ("roberta.embeddings.position_embeddings.weight", "roberta.embeddings.token_type_embeddings.weight"),
                  ((p + offset, h), (types, h)), lambda pos, typ: pos[offset:] + typ[0], to_hf)


def tensors(cfg: RobertaConfig, hf_config: dict | None = None) -> dict[str, Tensor]:
    """{our parameter path: Tensor}; hf_config, when reading, gives the position offset and the
    number of token types (an export writes pad id 1 and one type)."""
    v, h, n, f = cfg.vocab_size, cfg.hidden_dim, cfg.num_heads, cfg.intermediate_dim
    d = h // n
    hf_config = hf_config or {}
    offset = int(hf_config.get("pad_token_id", PAD_ID)) + 1
    types = int(hf_config.get("type_vocab_size", 1))
    emb = "roberta.embeddings"
    out = {"embeddings/token_embedding/embeddings": same(f"{emb}.word_embeddings.weight", (v, h)),
           "embeddings/position_embedding/embeddings": _positions(cfg.max_sequence_length, h, offset, types),
           "embeddings_layer_norm/gamma": same(f"{emb}.LayerNorm.weight", (h,)),
           "embeddings_layer_norm/beta": same(f"{emb}.LayerNorm.bias", (h,)),
           "mlm_head/intermediate_dense/kernel": linear("lm_head.dense.weight", (h, h)),
           "mlm_head/intermediate_dense/bias": same("lm_head.dense.bias", (h,)),
           "mlm_head/intermediate_layer_norm/gamma": same("lm_head.layer_norm.weight", (h,)),
           "mlm_head/intermediate_layer_norm/beta": same("lm_head.layer_norm.bias", (h,)),
           "mlm_head/output_bias": same("lm_head.bias", (v,))}
    for i in range(cfg.num_layers):
        ours, hf = f"transformer_layer_{i}", f"roberta.encoder.layer.{i}"
        for name in ("query", "key", "value"):
            key = f"{hf}.attention.self.{name}"
            out[f"{ours}/self_attention_layer/{name}/kernel"] = hidden_heads(f"{key}.weight", (h, n, d))
            out[f"{ours}/self_attention_layer/{name}/bias"] = flat(f"{key}.bias", (n, d))
        out[f"{ours}/self_attention_layer/attention_output/kernel"] = heads_out(
            f"{hf}.attention.output.dense.weight", (n, d, h))
        out[f"{ours}/self_attention_layer/attention_output/bias"] = same(f"{hf}.attention.output.dense.bias", (h,))
        for ours_name, hf_name, shape in (("feedforward_intermediate_dense", "intermediate.dense", (h, f)),
                                          ("feedforward_output_dense", "output.dense", (f, h))):
            out[f"{ours}/{ours_name}/kernel"] = linear(f"{hf}.{hf_name}.weight", shape)
            out[f"{ours}/{ours_name}/bias"] = same(f"{hf}.{hf_name}.bias", (shape[1],))
        for ours_name, hf_name in (("self_attention_layer_norm", "attention.output.LayerNorm"),
                                   ("feedforward_layer_norm", "output.LayerNorm")):
            out[f"{ours}/{ours_name}/gamma"] = same(f"{hf}.{hf_name}.weight", (h,))
            out[f"{ours}/{ours_name}/beta"] = same(f"{hf}.{hf_name}.bias", (h,))
    return out
