"""LoRA as a function over the parameter tree (`core`), and its files: jaxlm adapter folders
(`folder`), KerasHub `.lora.h5` (`keras`), PEFT adapter folders (`peft`).

    adapters = jaxlm.lora.init(params, rank=4, key=jax.random.key(0), alpha=16)
    merged = jaxlm.lora.merge(params, adapters)          # reads alpha from the adapters
    jaxlm.lora.save("run/adapters", adapters)             # factors + rank, alpha, targets
    adapters = jaxlm.lora.load("run/adapters")            # no flags needed
    jaxlm.lora.save_peft("run/adapters_peft", adapters, model, base_model_name_or_path="run/hf")
    adapters = jaxlm.lora.load_peft("hf_adapter_dir", model)
"""
from jaxlm.lora.core import (DEFAULT_TARGETS, FACTORS, Adapters, find_targets, init, merge,
                             num_params, pairs, trainable_count, unmerge)
from jaxlm.lora.folder import load, save
from jaxlm.lora.keras import keras_layers, keras_lora_supported, load_keras_lora, save_keras_lora
from jaxlm.lora.peft import load_peft, save_peft

__all__ = ["DEFAULT_TARGETS", "FACTORS", "Adapters", "find_targets", "init", "merge", "unmerge",
           "num_params", "pairs", "trainable_count", "load", "save", "keras_layers",
           "keras_lora_supported", "load_keras_lora", "save_keras_lora", "load_peft", "save_peft"]
