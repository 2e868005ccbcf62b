"""KerasHub adapter files (`backbone.save_lora_weights`, `*.lora.h5`), both ways.

A file holds one rank and, per LoRA-enabled layer, its factors under the layer's index among
the backbone's layers that own weights (`_flatten_layers` order): `lora/vars/rank`,
`lora/<idx>/vars/lora_kernel_{a,b}`. KerasHub always scales by 1 (alpha = rank), so
`save_keras_lora` folds a non-default alpha into B; it also writes the adapters' own
description (alpha and targets) as root attributes, which KerasHub ignores and
`load_keras_lora` reads back, so a round trip gives the trained factors and alpha again.
KerasHub's `load_lora_weights` fills the layers its own `enable_lora(rank)` enabled
(query/value by default), so adapters with other targets need
`enable_lora(rank, target_layer_names=[...])` on the Keras side first.
"""
from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np

from jaxlm.errors import UserError
from jaxlm.lora.core import Adapters, _check, pairs
from jaxlm.tree import flatten, unflatten

def keras_lora_supported(config) -> bool:
    """Whether `.lora.h5` import/export knows this config's KerasHub layer order."""
    try:
        keras_layers(config)
    except UserError:
        return False
    return True


def keras_layers(config) -> list[str]:
    """Paths of the backbone's layers that own weights, in KerasHub `_flatten_layers` order.

    A layer's index in this list is its `<idx>` in a `.lora.h5` file (checked live against
    KerasHub's `layer.path`s in tests/test_lora.py).
    """
    family = getattr(config, "family", None)
    if family == "gemma":  # GemmaBackbone (Gemma 1, and 2 with post norms) and Gemma3Backbone
        post_ffw = ["post_ffw_norm"] if config.use_post_ffw_norm else []
        post_attention = ["post_attention_norm"] if config.use_post_attention_norm else []
        qk = ["attention/key_norm", "attention/query_norm"] if config.use_query_key_norm else []
        block = (["ffw_linear", "ffw_gating_2", "ffw_gating"] + post_ffw + ["pre_ffw_norm", "attention",
                 "attention/attention_output"] + qk + ["attention/value", "attention/key", "attention/query"]
                 + post_attention + ["pre_attention_norm"])
        out = ["token_embedding"]
        for i in range(config.num_layers):
            b = f"decoder_block_{i}"
            out += [b] + [f"{b}/{n}" for n in block]
        return out + ["final_normalization"]
    if family == "roberta":
        out = ["embeddings", "embeddings/position_embedding", "embeddings/token_embedding",
               "embeddings_layer_norm"]
        for i in range(config.num_layers):
            t = f"transformer_layer_{i}"
            out += [t, f"{t}/feedforward_output_dense", f"{t}/feedforward_intermediate_dense",
                    f"{t}/feedforward_layer_norm", f"{t}/self_attention_layer_norm",
                    f"{t}/self_attention_layer"]
            out += [f"{t}/self_attention_layer/{n}"
                    for n in ("attention_output", "value", "key", "query")]
        return out
    raise UserError(f"no KerasHub LoRA layer order for model family {family!r}")


def _lora_path(path: str) -> None:
    if not str(path).endswith(".lora.h5"):
        raise UserError(f"{path}: KerasHub adapter files must end in .lora.h5; rename it")


def save_keras_lora(path: str, adapters: dict, config, *, alpha=None) -> None:
    """Write adapters as KerasHub `save_lora_weights` does (load with `load_lora_weights`).

    config: the model's config (or the model). alpha: overrides the adapters' own alpha
    (`Adapters.alpha`; alpha = rank for a plain dict); folded into B because KerasHub always
    scales by 1. `path` may be a local path or a URL.
    """
    import io

    import h5py

    from jaxlm import storage
    _lora_path(path)
    config = getattr(config, "config", config)
    index = {p: i for i, p in enumerate(keras_layers(config))}
    found = pairs(adapters)
    ranks = {a.shape[-1] for a, _ in found.values()}
    if len(ranks) != 1:
        raise UserError(f"adapters have ranks {sorted(ranks)}; a .lora.h5 file holds one rank")
    rank = ranks.pop()
    alpha = alpha if alpha is not None else getattr(adapters, "alpha", None)
    _check(rank, alpha)
    scale = 1.0 if alpha is None else alpha / rank
    missing = [p for p in found if p not in index]
    if missing:
        raise UserError(f"adapter {missing[0]} is not a KerasHub backbone layer; "
                        "only backbone layers can be written to .lora.h5")
    targets = list(getattr(adapters, "targets", [re.escape(f"{p}/kernel") for p in sorted(found)]))
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f.attrs["jaxlm_lora"] = json.dumps({"alpha": float(rank if alpha is None else alpha),
                                            "targets": targets})
        f.create_group("lora/vars").create_dataset("rank", data=np.int64(rank))
        for parent, (a, b) in sorted(found.items(), key=lambda kv: index[kv[0]]):
            g = f.create_group(f"lora/{index[parent]}/vars")
            g.create_dataset("lora_kernel_a", data=np.asarray(a, np.float32))
            g.create_dataset("lora_kernel_b", data=np.asarray(b, np.float32) * np.float32(scale))
    storage.write_bytes(path, buf.getvalue())


def load_keras_lora(path: str, config, params: dict | None = None) -> Adapters:
    """Read a KerasHub `.lora.h5` -> Adapters (float32) that `merge` applies as written.

    A file written by KerasHub has scale 1 (alpha = rank, targets = the adapted kernels); one
    written by `save_keras_lora` gets its alpha back, with B unfolded, and its targets.
    config: the model's config (or the model). params (arrays or abstract), if given, are used
    to check every factor's shape against its kernel.
    """
    import io

    import h5py

    from jaxlm import storage
    _lora_path(path)
    if not storage.isfile(path):
        raise UserError(f"{path} does not exist")
    config = getattr(config, "config", config)
    layers = keras_layers(config)
    kernels = flatten(params) if params is not None else None
    out = {}
    try:
        f = h5py.File(io.BytesIO(storage.read_bytes(path)), "r")
    except OSError as e:
        raise UserError(f"{path} is truncated or not an HDF5 file ({e}); write it again") from None
    with f:
        if "lora/vars/rank" not in f:
            raise UserError(f"{path} has no lora/vars/rank; it is not a KerasHub LoRA file")
        rank = int(f["lora/vars/rank"][()])
        described = json.loads(f.attrs["jaxlm_lora"]) if "jaxlm_lora" in f.attrs else {}
        alpha = float(described.get("alpha", rank))
        for idx in sorted((k for k in f["lora"] if k != "vars"), key=int):
            if int(idx) >= len(layers):
                raise UserError(f"{path} has layer index {idx} but this model has "
                                f"{len(layers)} weighted layers; it belongs to another model")
            parent, g = layers[int(idx)], f[f"lora/{idx}/vars"]
            a = np.asarray(g["lora_kernel_a"], np.float32)
            b = np.asarray(g["lora_kernel_b"], np.float32) / np.float32(alpha / rank)
            if a.shape[-1] != rank or b.shape[0] != rank:
                raise UserError(f"{path}: layer {idx} factors {a.shape}, {b.shape} disagree with "
                                f"rank {rank}; the file is corrupt")
            if kernels is not None:
                kernel = kernels.get(f"{parent}/kernel")
                if kernel is None:
                    raise UserError(f"{path}: layer {idx} maps to {parent}, which has no kernel")
                if a.shape[:-1] != tuple(kernel.shape[:-1]) or b.shape[-1] != kernel.shape[-1]:
                    raise UserError(f"{path}: {parent} factors {a.shape}, {b.shape} do not fit "
                                    f"kernel {tuple(kernel.shape)}; it belongs to another model")
            out[f"{parent}/lora_a"] = jnp.asarray(a)
            out[f"{parent}/lora_b"] = jnp.asarray(b)
    if not out:
        raise UserError(f"{path} holds no adapters")
    targets = described.get("targets") or [re.escape(p[:-len("/lora_a")] + "/kernel")
                                           for p in sorted(out) if p.endswith("/lora_a")]
    return Adapters(unflatten(out), rank=rank, alpha=alpha, targets=targets)
