"""What a fine-tune leaves behind, in the formats other tools read.

    export(out, model, params, adapters, tokenizer, merged=False, base=PRESET)

- `adapters/`: the trained LoRA factors with their rank, alpha and targets
  (`jaxlm.lora.save`; `jaxlm.lora.load(out/adapters)` needs no flags);
- `adapters.lora.h5`: KerasHub's `load_lora_weights` file, where its layer order is known;
- `adapters_peft/`: a PEFT LoRA adapter (`peft.PeftModel.from_pretrained(base, DIR)`) for the
  Hugging Face folder of the base: `base` itself when it already is one, else `base_hf/`,
  written once per output folder;
- `merged/` (jaxlm folder), `merged_keras/` (Keras preset) and `merged_hf/` (Hugging Face
  folder): the merged model, with `merged=True` or at full fine-tuning.

The run ends by printing where each export is and the transformers/peft lines that load the
Hugging Face ones. `out` may be a local folder or a URL. Orbax and HF writes are collective
(every host takes part); plain files come from process 0.
"""
from __future__ import annotations

import jax

from jaxlm import families, lora, storage
from jaxlm.convert import hf
from jaxlm.loading import save


def _gathered(adapters):
    """The whole adapter tree on every host (small: only LoRA factors)."""
    if jax.process_count() == 1:
        return adapters
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(adapters, tiled=True)


def export(out: str, model, params, adapters: lora.Adapters | None, tokenizer, *,
           merged: bool = False, base: str | None = None, print_fn=print) -> list[str]:
    """Write the exports of a run into `out`; -> the names written (also printed, with how to
    load the Hugging Face ones). base: the preset the run started from (for PEFT's base)."""
    written, usage = [], []
    lead = jax.process_index() == 0
    family = families.by_config(model.config)
    hf_ok = family.name in ("gemma", "roberta")
    if adapters is not None:
        lora.save(storage.join(out, "adapters"), adapters)
        written.append("adapters/")
        whole = _gathered(adapters)
        if lora.keras_lora_supported(model.config):
            if lead:
                lora.save_keras_lora(storage.join(out, "adapters.lora.h5"), whole, model.config)
            written.append("adapters.lora.h5")
        elif lead:  # the adapters/ folder still holds them
            print_fn("note: no adapters.lora.h5 (KerasHub's LoRA file layout is not known for "
                     "this model); the adapters are in adapters/")
        if hf_ok:
            base_hf = _hf_base(out, model, params, tokenizer, base, written)
            peft_dir = storage.join(out, "adapters_peft")
            if lead:
                lora.save_peft(peft_dir, whole, model.config, base_model_name_or_path=base_hf)
            written.append("adapters_peft/ (PEFT)")
            usage.append(("the base with the PEFT adapters",
                          hf.usage(base_hf, model.config, storage.absolute(peft_dir))))
    if adapters is None or merged:
        full = params if adapters is None else jax.jit(lora.merge)(params, adapters)
        save(storage.join(out, "merged"), model, full, tokenizer)
        written.append("merged/ (jaxlm folder)")
        if hf_ok:
            merged_hf = storage.join(out, "merged_hf")
            save(merged_hf, model, full, tokenizer, format="hf")
            written.append("merged_hf/ (Hugging Face)")
            usage.append(("the merged model", hf.usage(storage.absolute(merged_hf), model.config)))
        if jax.process_count() == 1:
            save(storage.join(out, "merged_keras"), model, full, tokenizer, format="keras")
            written.append("merged_keras/ (Keras preset)")
        elif lead:  # a Keras .h5 needs every tensor whole on one host
            print_fn("multi-host run: convert merged/ to a Keras preset with "
                     "`python -m jaxlm.convert --to-keras` on one machine")
    if lead:
        print_fn(f"exported to {out}: {', '.join(written)}")
        for what, lines in usage:
            print_fn(f"load {what} with transformers:\n    " + "\n    ".join(lines))
    return written


def _hf_base(out: str, model, params, tokenizer, base: str | None, written: list) -> str:
    """The Hugging Face folder PEFT adapters attach to: the run's own preset when it is one,
    else `out/base_hf`, written once (the frozen base never changes between resumed runs)."""
    if base is not None and hf.is_hf_folder(base):
        return storage.absolute(base)
    folder = storage.join(out, "base_hf")
    if not storage.exists(storage.join(folder, "config.json")):
        save(folder, model, params, tokenizer, format="hf")
        written.append("base_hf/ (the base model, Hugging Face)")
    return storage.absolute(folder)
