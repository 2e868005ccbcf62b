"""`jaxlm.load`: one entry point for Keras presets, jaxlm folders and built-in preset names.

A jaxlm folder (written by `python -m jaxlm.convert` or `save`) is::

    jaxlm.json        {"family": "gemma", "config": {...}, "format": 1}
    params/           an orbax checkpoint of the parameter tree
    tokenizer/        vocabulary.spm (or the family's tokenizer files)

A llama.cpp `.gguf` file (Gemma 1/2/3), or a folder holding exactly one, is dequantised to
float and mapped onto the same tree (jaxlm/convert/gguf.py).

`placement(path, shape) -> Sharding` puts each tensor straight onto its device(s) as it is read
or created; without it, tensors land on the default device.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp

from jaxlm import families
from jaxlm.convert import keras_preset
from jaxlm.errors import UserError
from jaxlm.tree import flatten, place_streamed, unflatten

Placement = Callable[[str, tuple], jax.sharding.Sharding]
FOLDER_META = "jaxlm.json"


def default_dtype() -> str:
    """float32 on CPU (exact parity), bfloat16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def resolve(path: str, dtype: str | None = None):
    """-> (kind, family, config) without reading weights; kind in {"preset", "keras", "jaxlm", "gguf"}."""
    path = os.fspath(path)
    dtype = str(jnp.dtype(dtype)) if dtype is not None else default_dtype()
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        from jaxlm.convert import gguf
        family = families.by_name("gemma")
        kwargs = gguf.config_kwargs(gguf.open_reader(gguf_file))
        return "gguf", family, family.config_cls(**kwargs, dtype=dtype)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, FOLDER_META)):
            with open(os.path.join(path, FOLDER_META)) as f:
                meta = json.load(f)
            family = families.by_name(meta["family"])
            return "jaxlm", family, family.config_cls(**{**meta["config"], "dtype": dtype})
        if os.path.exists(os.path.join(path, "config.json")):
            family, config = keras_preset.read_config(path)
            return "keras", family, config.replace(dtype=dtype)
        raise UserError(f"{path} is neither a Keras preset folder (no config.json) nor a jaxlm "
                        f"folder (no {FOLDER_META})")
    found = families.preset(path)
    if found is not None:
        family, config = found
        return "preset", family, config.replace(dtype=dtype)
    if os.path.exists(path):
        raise UserError(f"{path} is a file; pass the preset folder that contains it "
                        "(or weights=FILE for a fine-tuned .weights.h5)")
    raise UserError(f"{path} does not exist and is not a built-in preset; "
                    f"built-in presets: {', '.join(families.all_presets())}")


def find_gguf(path: str) -> str | None:
    """The .gguf file `path` names, or the single one inside folder `path`; else None."""
    if path.endswith(".gguf"):
        if not os.path.exists(path):
            raise UserError(f"GGUF file {path} does not exist")
        return path
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(found) > 1:
            raise UserError(f"{path} holds several .gguf files ({', '.join(found)}); pass one of them")
        if found:
            return os.path.join(path, found[0])
    return None


def abstract_params(module, config) -> dict:
    """{path: ShapeDtypeStruct} of a model's parameters, computed without allocating them."""
    ids = jnp.zeros((1, 1), jnp.int32)
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), ids))["params"]
    return flatten(shapes)


def load(path: str, dtype: str | None = None, abstract: bool = False, *,
         weights: str | None = None, placement: Placement | None = None, seed: int = 0):
    """-> (model, params). See the module docstring for what `path` may be.

    dtype: parameter and compute dtype (default: float32 on CPU, bfloat16 on accelerators).
    abstract: return `jax.ShapeDtypeStruct` leaves; nothing is read or allocated.
    weights: a `.weights.h5` written by Keras `save_weights` (backbone- or task-level) whose
      tensors replace the preset's, e.g. a fine-tuned GemmaCausalLM on top of its preset.
    seed: random init of a built-in preset name.
    """
    path = os.fspath(path)
    kind, family, config = resolve(path, dtype)
    model = family.module_cls(config)
    shapes = abstract_params(model, config)
    if abstract:
        if placement is not None:
            shapes = {p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placement(p, s.shape))
                      for p, s in shapes.items()}
        return model, unflatten(shapes)
    if weights is not None and kind != "keras":
        raise UserError("weights= applies to a Keras preset folder; "
                        f"{path} is a {'built-in preset' if kind == 'preset' else 'jaxlm folder'}")
    if kind == "keras":
        files = keras_preset.weight_files(path, weights)
        task = keras_preset.task_paths(family, config)
        if task and "task" not in files:
            # A backbone-only preset: KerasHub's task from_preset initialises the head; so do we.
            print(f"warning: {path} has no task.weights.h5; {len(task)} task weights "
                  f"({sorted(task)[0]}, …) are randomly initialised", file=sys.stderr)
            fresh = flatten(init_params(model, shapes, placement, seed))
            params = flatten(keras_preset.read_params(
                family, config, files, {p: s for p, s in shapes.items() if p not in task}, placement))
            params = unflatten({**params, **{p: fresh[p] for p in task}})
        else:
            params = keras_preset.read_params(family, config, files, shapes, placement)
    elif kind == "jaxlm":
        params = _restore_folder_params(path, shapes, placement)
    elif kind == "gguf":
        params = _read_gguf_params(find_gguf(path), config, shapes, placement)
    else:
        params = init_params(model, shapes, placement, seed)
    return model, params


def init_params(model, shapes: dict, placement: Placement | None, seed: int = 0) -> dict:
    """Random init, created directly in the target shardings (never whole on one device)."""
    ids = jnp.zeros((1, 1), jnp.int32)
    out = None
    if placement is not None:
        out = {"params": unflatten({p: placement(p, s.shape) for p, s in shapes.items()})}
    params = jax.jit(lambda key: model.init(key, ids), out_shardings=out)(jax.random.key(seed))
    return params["params"]


def save(out_dir: str, model, params: dict, tokenizer=None) -> None:
    """Write a jaxlm folder (see module docstring). Overwrites `params/` atomically via orbax."""
    import orbax.checkpoint as ocp
    family = families.by_config(model.config)
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(os.path.abspath(out_dir), "params")
    with ocp.StandardCheckpointer() as ckptr:  # collective: every host writes its shards
        ckptr.save(ckpt, params, force=True)
    if jax.process_index() != 0:  # the plain files once, from one host
        return
    config = model.config.to_dict()
    with open(os.path.join(out_dir, FOLDER_META), "w") as f:
        json.dump({"family": family.name, "config": config, "format": 1}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(os.path.join(out_dir, "tokenizer"))


def _read_gguf_params(path: str, config, shapes: dict, placement: Placement | None) -> dict:
    from jaxlm.convert import gguf
    flat = gguf.read_params(gguf.open_reader(path), config.num_layers, config.num_heads,
                            config.num_kv_heads, config.head_dim)
    if set(flat) != set(shapes):
        missing, extra = sorted(set(shapes) - set(flat)), sorted(set(flat) - set(shapes))
        raise UserError(f"{path} does not match its own metadata (missing {missing[:3]}, "
                        f"unexpected {extra[:3]}); the file is damaged or not a Gemma model")
    return place_streamed(  # pop: each dequantised tensor is freed once placed
        shapes, flat.pop, placement,
        lambda p, got, want: f"GGUF tensor for {p} has shape {got}, expected {want}")


def _restore_folder_params(path: str, shapes: dict, placement: Placement | None) -> dict:
    import orbax.checkpoint as ocp
    ckpt = os.path.join(os.path.abspath(path), "params")
    if not os.path.isdir(ckpt):
        raise UserError(f"{path} has no params/ checkpoint; convert the model again")
    if placement is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        placement = lambda p, shape: device  # noqa: E731
    target = unflatten({p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placement(p, s.shape))
                        for p, s in shapes.items()})
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(ckpt, target)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise UserError(f"cannot restore {ckpt}: {str(e).splitlines()[0]}; "
                        "the folder is incomplete or from another config — convert again") from None
