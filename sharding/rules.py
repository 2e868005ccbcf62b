"""Layout tables: ordered `[(regex, PartitionSpec)]` over parameter paths.

The first rule whose regex `re.fullmatch`es the path wins (keras >= 3.14 `LayoutMap` uses
fullmatch too, so KerasHub's patterns mean the same here); the final `(".*", P())` replicates
everything else. Entry i of a spec names the mesh axis that splits tensor dim i; None keeps the
dim whole; `P()` replicates a tensor of any rank.

Gemma, mesh axes ("batch", "model"):
  "seed"  the seed article's map (model axis only). It splits the hidden dim of q/k/v, so it
          also shards Gemma 2B's single KV head. The seed's patterns end in `.*kernel`; here
          they end in `/kernel`, which selects the same parameters (LoRA factors live in their
          own tree, see `adapter_specs`).
  "megatron" the default: Megatron-style where Gemma's shapes allow. The tied embedding is
          split over the vocabulary and the FFN over its width (gating column-, linear
          row-parallel); attention as the seed's (its few KV heads do not divide 8 devices).
          With the seed's hidden-dim split every device projects onto the whole vocabulary
          (262k entries for Gemma 3) and holds the loss's [B, C, V] logits block twice
          (partial sums, then their all-reduce), and keeps each FFN's whole [N, F] products
          for the backward pass. Gemma 3 270M LoRA on 1x8, temporaries a device: 0.068 GiB
          instead of 0.197 at 8 x 24 tokens (the demo), 0.268 instead of 0.716 at 8 x 128;
          Gemma 2B / 7B LoRA at 8 x 512 on a TPU v3-8: 1.87 / 6.01 GiB a core instead of
          2.83 / 7.23 (docs/sharding.md).
  "keras" `GemmaBackbone.get_layout_map` of keras-hub 0.32, patterns verbatim.
RoBERTa:
  "data"  everything replicated; only the batch is split (DataParallel). The default: a
          125M-parameter encoder fits every chip.
  "model" Megatron-style: heads of q/k/v and the attention output, the FFN width, and the
          hidden dim of the embeddings over `model`.
`ACTIVATIONS` adds, per table, where some activations go (`activation_rules`).
"""
from __future__ import annotations

from jax.sharding import PartitionSpec as P

Rules = list  # [(regex, PartitionSpec)]

REPLICATE = (".*", P())

GEMMA_SEED = [
    ("token_embedding/embeddings", P(None, "model")),                          # [V, H]
    ("decoder_block.*attention/(query|key|value)/kernel", P(None, "model", None)),  # [N|K, H, D]
    ("decoder_block.*attention_output/kernel", P(None, None, "model")),        # [N, D, H]
    ("decoder_block.*ffw_gating(_2)?/kernel", P("model", None)),               # [H, F]
    ("decoder_block.*ffw_linear/kernel", P(None, "model")),                    # [F, H]
    REPLICATE,
]

GEMMA_MEGATRON = [
    ("token_embedding/embeddings", P("model", None)),                          # [V, H]
    ("decoder_block.*attention/(query|key|value)/kernel", P(None, "model", None)),  # [N|K, H, D]
    ("decoder_block.*attention_output/kernel", P(None, None, "model")),        # [N, D, H]
    ("decoder_block.*ffw_gating(_2)?/kernel", P(None, "model")),               # [H, F]
    ("decoder_block.*ffw_linear/kernel", P("model", None)),                    # [F, H]
    REPLICATE,
]

GEMMA_KERAS = [
    ("token_embedding/embeddings", P("model", "batch")),
    ("decoder_block.*attention.*(query|key|value).kernel", P("model", "batch", None)),
    ("decoder_block.*attention_output.kernel", P("model", None, "batch")),
    ("decoder_block.*ffw_gating.kernel", P("batch", "model")),
    ("decoder_block.*ffw_gating_2.kernel", P("batch", "model")),
    ("decoder_block.*ffw_linear.kernel", P("model", "batch")),
    REPLICATE,
]

ROBERTA_DATA = [REPLICATE]

_ATTN = "transformer_layer_\\d+/self_attention_layer"
ROBERTA_MODEL = [
    ("embeddings/(token|position)_embedding/embeddings", P(None, "model")),    # [V|S, H]
    (f"{_ATTN}/(query|key|value)/kernel", P(None, "model", None)),            # [H, heads, dk]
    (f"{_ATTN}/(query|key|value)/bias", P("model", None)),                    # [heads, dk]
    (f"{_ATTN}/attention_output/kernel", P("model", None, None)),             # [heads, dk, H]
    ("transformer_layer_\\d+/feedforward_intermediate_dense/kernel", P(None, "model")),  # [H, I]
    ("transformer_layer_\\d+/feedforward_intermediate_dense/bias", P("model")),          # [I]
    ("transformer_layer_\\d+/feedforward_output_dense/kernel", P("model", None)),        # [I, H]
    REPLICATE,
]

TABLES = {
    "gemma": {"megatron": GEMMA_MEGATRON, "seed": GEMMA_SEED, "keras": GEMMA_KERAS},
    "roberta": {"data": ROBERTA_DATA, "model": ROBERTA_MODEL},
}
DEFAULT_LAYOUT = {"gemma": "megatron", "roberta": "data"}

# Activations by logical name (`models.layers.constrain`) -> mesh axes, per table. The seed
# table splits no attention heads, so left alone every model-axis device computes the whole of
# attention for every row; its rows go over both axes instead (Gemma 3 270M LoRA on 1x8: a
# step 15-18% faster, `python bench/real_step_ab.py --what=activations`; on a TPU v3-8 Gemma 7B
# LoRA at 8 x 512 fits without remat by `python bench/memory.py`). The trainer applies them
# (on CPU to unrolled layers only, `jaxlm.train.trainer.activation_rules`); tables not named
# here leave the activations to XLA's partitioner. The megatron table also splits the final
# hidden states, which the loss projects onto the vocabulary-split embedding, on the hidden
# dim ("hidden"): the demo's step took 0.147 GiB of temporaries a device without it, 0.068
# with it (on a TPU the same either way).
_ROWS = {"attention_batch": ("batch", "model")}
ACTIVATIONS = {
    "gemma": {"seed": _ROWS, "megatron": {**_ROWS, "batch": ("batch",), "hidden": ("model",)}},
}


def rules_for(config, layout: str | None = None) -> Rules:
    """The rule table for a model config (dispatch on `config.family`).

    layout: a table name of that family; None -> the family default ("megatron" for Gemma,
    "data" for RoBERTa).
    """
    family = getattr(config, "family", None)
    if family not in TABLES:
        raise ValueError(f"no layout tables for model family {family!r}; "
                         f"known families: {', '.join(TABLES)}")
    layout = DEFAULT_LAYOUT[family] if layout is None else layout
    if layout not in TABLES[family]:
        raise ValueError(f"unknown layout {layout!r} for {family}; "
                         f"choose one of: {', '.join(TABLES[family])}")
    return list(TABLES[family][layout])


def activation_rules(config, layout: str | None = None) -> dict:
    """{logical activation name: mesh axes} of a config's layout table (`rules_for`'s
    arguments); {} where the table names none."""
    rules_for(config, layout)  # the same checks
    family = config.family
    return dict(ACTIVATIONS.get(family, {}).get(layout or DEFAULT_LAYOUT[family], {}))
