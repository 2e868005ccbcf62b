"""RoBERTa <-> KerasHub `RobertaBackbone` + `RobertaMaskedLM`: config fields and H5 weight locations.

The backbone lives in `model.weights.h5`; the masked-LM head in `task.weights.h5` (the "task:"
prefix). KerasHub reads `task.weights.h5` only when the preset also has a `task.json` naming
`RobertaMaskedLM`; `write_task_json` writes it.

A backbone-only preset (no `task.weights.h5`, like KerasHub's published `roberta_base_en`) cannot
be loaded through `jaxlm.load`, which needs every parameter: the error names the missing file.
`load_backbone_only` loads such a preset with a freshly initialised head, which is what
`RobertaMaskedLM.from_preset` does too.
"""
from __future__ import annotations

import json

from jaxlm import storage
from jaxlm.convert.keras_preset import dtype_policy
from jaxlm.errors import UserError
from models.roberta import RobertaConfig

# our sub-path under transformer_layer_{i}/ -> KerasHub attribute path under the encoder's H5 group
_ATTN = {"query": "query_dense", "key": "key_dense", "value": "value_dense",
         "attention_output": "output_dense"}
_LAYER = {f"self_attention_layer/{ours}/{var}": f"_self_attention_layer/{theirs}/vars/{i}"
          for ours, theirs in _ATTN.items() for i, var in enumerate(("kernel", "bias"))}
for _ours in ("self_attention_layer_norm", "feedforward_layer_norm"):
    _LAYER.update({f"{_ours}/gamma": f"_{_ours}/vars/0", f"{_ours}/beta": f"_{_ours}/vars/1"})
for _ours in ("feedforward_intermediate_dense", "feedforward_output_dense"):
    _LAYER.update({f"{_ours}/kernel": f"_{_ours}/vars/0", f"{_ours}/bias": f"_{_ours}/vars/1"})

_HEAD = {
    "mlm_head/intermediate_dense/kernel": "task:layers/masked_lm_head/_intermediate_dense/vars/0",
    "mlm_head/intermediate_dense/bias": "task:layers/masked_lm_head/_intermediate_dense/vars/1",
    "mlm_head/intermediate_layer_norm/gamma": "task:layers/masked_lm_head/_intermediate_layer_norm/vars/0",
    "mlm_head/intermediate_layer_norm/beta": "task:layers/masked_lm_head/_intermediate_layer_norm/vars/1",
    "mlm_head/output_bias": "task:layers/masked_lm_head/vars/0",
}


def keras_paths(cfg: RobertaConfig) -> dict[str, str]:
    emb = "layers/token_and_position_embedding"
    paths = {"embeddings/token_embedding/embeddings": f"{emb}/token_embedding/vars/0",
             "embeddings/position_embedding/embeddings": f"{emb}/position_embedding/vars/0",
             "embeddings_layer_norm/gamma": "layers/layer_normalization/vars/0",
             "embeddings_layer_norm/beta": "layers/layer_normalization/vars/1"}
    for i in range(cfg.num_layers):
        group = "layers/transformer_encoder" + (f"_{i}" if i else "")  # layer 0 has no suffix
        for ours, theirs in _LAYER.items():
            paths[f"transformer_layer_{i}/{ours}"] = f"{group}/{theirs}"
    paths.update(_HEAD)
    return paths


def config_from_keras(c: dict) -> RobertaConfig:
    """RobertaBackbone constructor arguments -> RobertaConfig (missing keys take Keras' defaults)."""
    try:
        return RobertaConfig(
            vocab_size=int(c["vocabulary_size"]), num_layers=int(c["num_layers"]),
            num_heads=int(c["num_heads"]), hidden_dim=int(c["hidden_dim"]),
            intermediate_dim=int(c["intermediate_dim"]),
            max_sequence_length=int(c.get("max_sequence_length", 512)))
    except KeyError as e:
        raise UserError(f"RobertaBackbone config is missing {e.args[0]!r}; is config.json complete?") from None


def config_to_keras(cfg: RobertaConfig) -> dict:
    return {
        "module": "keras_hub.src.models.roberta.roberta_backbone",
        "class_name": "RobertaBackbone",
        "config": {
            "name": "roberta_backbone", "trainable": True, "dtype": dtype_policy(cfg.dtype),
            "vocabulary_size": cfg.vocab_size, "num_layers": cfg.num_layers,
            "num_heads": cfg.num_heads, "hidden_dim": cfg.hidden_dim,
            "intermediate_dim": cfg.intermediate_dim, "dropout": 0.1,  # KerasHub's default
            "max_sequence_length": cfg.max_sequence_length,
        },
        "registered_name": "keras_hub>RobertaBackbone",
    }


def write_task_json(cfg: RobertaConfig, preset_dir: str) -> None:
    """task.json for `RobertaMaskedLM`, so KerasHub loads our task.weights.h5 (the MLM head).

    The preprocessor is included when the folder holds RoBERTa's BPE tokenizer.json.
    """
    preprocessor = None
    tok_path = storage.join(preset_dir, "tokenizer.json")
    if storage.exists(tok_path):
        tokenizer = json.loads(storage.read_text(tok_path))
        if tokenizer.get("class_name") == "RobertaTokenizer":
            preprocessor = {
                "module": "keras_hub.src.models.roberta.roberta_masked_lm_preprocessor",
                "class_name": "RobertaMaskedLMPreprocessor",
                "config": {"name": "roberta_masked_lm_preprocessor", "trainable": True,
                           "dtype": dtype_policy("float32"), "tokenizer": tokenizer,
                           "config_file": "preprocessor.json",
                           "sequence_length": cfg.max_sequence_length},
                "registered_name": "keras_hub>RobertaMaskedLMPreprocessor"}
    task = {"module": "keras_hub.src.models.roberta.roberta_masked_lm",
            "class_name": "RobertaMaskedLM",
            "config": {"backbone": config_to_keras(cfg), "preprocessor": preprocessor,
                       "name": "roberta_masked_lm", "trainable": True},
            "registered_name": "keras_hub>RobertaMaskedLM"}
    storage.write_text(storage.join(preset_dir, "task.json"), json.dumps(task, indent=4))
