"""What a fine-tune leaves behind, in the formats other tools read.

    export(out, model, params, adapters, tokenizer, merged=False)

- `adapters/`: the trained LoRA factors with their rank, alpha and targets
  (`jaxlm.lora.save`; `jaxlm.lora.load(out/adapters)` needs no flags);
- `adapters.lora.h5`: KerasHub's `load_lora_weights` file, where its layer order is known;
- `merged/` (a jaxlm folder) and `merged_keras/` (a Keras preset): the merged model, with
  `merged=True` or at full fine-tuning.

`out` may be a local folder or a URL. Orbax writes are collective (every host writes its
shards); plain files come from process 0.
"""
from __future__ import annotations

import jax

from jaxlm import families, lora, storage
from jaxlm.loading import save


def export(out: str, model, params, adapters: lora.Adapters | None, tokenizer, *,
           merged: bool = False, print_fn=print) -> list[str]:
    """Write the exports of a run into `out`; -> the names written (also printed)."""
    written = []
    lead = jax.process_index() == 0
    family = families.by_config(model.config)
    if adapters is not None:
        lora.save(storage.join(out, "adapters"), adapters)
        written.append("adapters/")
        if not lora.keras_lora_supported(model.config):  # the adapters/ folder still holds them
            if lead:
                print_fn("note: no adapters.lora.h5 (KerasHub's LoRA file layout is not known for "
                         "this model); the adapters are in adapters/")
        else:
            whole = adapters
            if jax.process_count() > 1:  # small: gather the adapter shards every host holds
                from jax.experimental import multihost_utils
                whole = multihost_utils.process_allgather(adapters, tiled=True)
            if lead:
                lora.save_keras_lora(storage.join(out, "adapters.lora.h5"), whole, model.config)
            written.append("adapters.lora.h5")
    if adapters is None or merged:
        full = params if adapters is None else jax.jit(lora.merge)(params, adapters)
        save(storage.join(out, "merged"), model, full, tokenizer)
        written.append("merged/ (jaxlm folder)")
        if jax.process_count() == 1:
            from jaxlm.convert.keras_preset import write_preset
            write_preset(family, model.config, full, storage.join(out, "merged_keras"), tokenizer)
            written.append("merged_keras/ (Keras preset)")
        elif lead:  # a Keras .h5 needs every tensor whole on one host
            print_fn("multi-host run: convert merged/ to a Keras preset with "
                     "`python -m jaxlm.convert --to-keras` on one machine")
    if lead:
        print_fn(f"exported to {out}: {', '.join(written)}")
    return written
