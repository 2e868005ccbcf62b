"""The model families jaxlm knows: config class, module, presets and Keras name mapping.

Loading, conversion and export look a family up here instead of branching on model types, so a
new architecture is one `Family(...)` entry in `FAMILIES`. The per-family Keras mappings live
in `jaxlm.convert.keras_<family>` and know nothing of this registry (imports point one way).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from jaxlm import storage
from jaxlm.convert import keras_gemma, keras_roberta
from jaxlm.errors import UserError
from models.gemma import Gemma, GemmaConfig, PRESETS as GEMMA_PRESETS
from models.roberta import PRESETS as ROBERTA_PRESETS, Roberta, RobertaConfig


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_cls: type
    module_cls: type
    presets: dict[str, Any]
    keras_classes: tuple[str, ...]          # backbone class names in a Keras config.json
    config_from_keras: Callable[[dict], Any]
    config_to_keras: Callable[[Any], dict]  # -> the whole config.json object
    keras_paths: Callable[[Any], dict[str, str]]  # our param path -> H5 group holding it ("…/vars/0")
    keras_tasks: tuple[str, ...] = ()
    # Extra files a Keras preset of this family needs (e.g. RoBERTa's task.json, without which
    # KerasHub ignores task.weights.h5); called last by `keras_preset.write_preset`.
    write_extras: Callable[[Any, str], None] | None = None


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family(name="gemma", config_cls=GemmaConfig, module_cls=Gemma, presets=GEMMA_PRESETS,
           keras_classes=("GemmaBackbone", "Gemma3Backbone"),
           config_from_keras=keras_gemma.config_from_keras,
           config_to_keras=keras_gemma.config_to_keras, keras_paths=keras_gemma.keras_paths,
           keras_tasks=("CausalLM",)),
    Family(name="roberta", config_cls=RobertaConfig, module_cls=Roberta, presets=ROBERTA_PRESETS,
           keras_classes=("RobertaBackbone",), config_from_keras=keras_roberta.config_from_keras,
           config_to_keras=keras_roberta.config_to_keras, keras_paths=keras_roberta.keras_paths,
           keras_tasks=("MaskedLM",), write_extras=keras_roberta.write_task_json),
)}


def by_name(name: str) -> Family:
    if name not in FAMILIES:
        raise UserError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def by_config(config) -> Family:
    for fam in FAMILIES.values():
        if isinstance(config, fam.config_cls):
            return fam
    raise UserError(f"no model family for config type {type(config).__name__}")


def by_keras_class(class_name: str) -> Family:
    for fam in FAMILIES.values():
        if class_name in fam.keras_classes:
            return fam
    supported = sorted(c for f in FAMILIES.values() for c in f.keras_classes)
    raise UserError(f"Keras class {class_name!r} is not supported; supported: {', '.join(supported)}")


def read_keras_config(preset_dir: str):
    """-> (family, config) from a Keras preset's config.json (keras_hub> and keras_nlp> names)."""
    path = storage.join(preset_dir, "config.json")
    try:
        raw = json.loads(storage.read_text(path))
    except FileNotFoundError:
        raise UserError(f"{preset_dir} is not a Keras preset folder: it has no config.json") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-export the preset") from None
    name = raw.get("registered_name") or raw.get("class_name") or ""
    class_name = name.split(">")[-1]  # "keras_hub>GemmaBackbone" / "keras_nlp>GemmaBackbone"
    family = by_keras_class(class_name)
    return family, family.config_from_keras(raw.get("config", {}))


def preset(name: str):
    """(family, config) for a built-in preset name, or None."""
    for fam in FAMILIES.values():
        if name in fam.presets:
            return fam, fam.presets[name]
    return None


def all_presets() -> list[str]:
    return sorted(p for f in FAMILIES.values() for p in f.presets)
