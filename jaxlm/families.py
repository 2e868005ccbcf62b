"""The model families jaxlm knows: config class, module, presets and Keras name mapping.

Loading, conversion and export look a family up here instead of branching on model types, so a
new architecture is one `register(Family(...))` call.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxlm.errors import UserError


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


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def _ensure_loaded():
    # Families register themselves on import; importing here keeps the registry complete
    # whichever entry point the user came through.
    import jaxlm.convert.keras_gemma  # noqa: F401
    try:
        import jaxlm.convert.keras_roberta  # noqa: F401
    except ImportError:
        pass


def by_name(name: str) -> Family:
    _ensure_loaded()
    if name not in FAMILIES:
        raise UserError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def by_config(config) -> Family:
    _ensure_loaded()
    for fam in FAMILIES.values():
        if isinstance(config, fam.config_cls):
            return fam
    raise UserError(f"no model family for config type {type(config).__name__}")


def by_keras_class(class_name: str) -> Family:
    _ensure_loaded()
    for fam in FAMILIES.values():
        if class_name in fam.keras_classes:
            return fam
    supported = sorted(c for f in FAMILIES.values() for c in f.keras_classes)
    raise UserError(f"Keras class {class_name!r} is not supported; supported: {', '.join(supported)}")


def preset(name: str):
    """(family, config) for a built-in preset name, or None."""
    _ensure_loaded()
    for fam in FAMILIES.values():
        if name in fam.presets:
            return fam, fam.presets[name]
    return None


def all_presets() -> list[str]:
    _ensure_loaded()
    return sorted(p for f in FAMILIES.values() for p in f.presets)
