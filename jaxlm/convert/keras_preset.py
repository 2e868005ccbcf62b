"""Read and write Keras preset folders with h5py, one tensor at a time.

A preset folder holds `config.json`, `metadata.json`, `model.weights.h5` (or the sharded
`model.weights.json` + `model_0000k.weights.h5`), optional `task.weights.h5`, and tokenizer
assets under `assets/tokenizer/`. Inside an H5 file every layer's variables sit in a
`<path>/vars` group as datasets named "0", "1", ...; bfloat16 is stored as opaque `|V2`.

Reading streams: each tensor is read, cast, placed on its device(s) and dropped before the next,
so host memory peaks near one copy of the weights plus one tensor.
"""
from __future__ import annotations

import datetime
import functools
import json
from typing import Callable

import jax
import ml_dtypes
import numpy as np

from jaxlm import storage
from jaxlm.errors import UserError
from jaxlm.tree import RowReader, flatten, place_streamed

TASK_PREFIX = "task:"  # a family's keras_paths value with this prefix lives in task.weights.h5


class H5Store:
    """Tensor lookup across a preset's weight files by H5 dataset path ("layers/…/vars/0").

    `files` maps a role ("model", "task") to a .weights.h5 path, or to a .weights.json index of
    shards. Task-level files written by `task.save_weights()` nest the backbone under
    `layers/<backbone>/`; that prefix is found once and applied to every lookup.
    """

    def __init__(self, files: dict[str, str]):
        self._files = files
        self._open: dict[str, h5py.File] = {}
        self._prefix: dict[str, str] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self._open.values():
            f.close()

    def _h5(self, path: str) -> h5py.File:
        import h5py  # here, not at the top: 10 MB resident in every run that reads no preset
        if path not in self._open:
            if not storage.exists(path):
                raise UserError(f"weights file {path} does not exist")
            try:  # a URL is read through its file object, range by range
                self._open[path] = h5py.File(storage.open_file(path, "rb") if storage.is_url(path)
                                             else path, "r")
            except OSError as e:
                raise UserError(f"{path} is truncated or not an HDF5 weights file ({e}); "
                                "copy or download it again") from None
        return self._open[path]

    def _file_for(self, role: str, key: str) -> tuple[h5py.File, str]:
        src = self._files.get(role)
        if src is None:
            raise UserError(f"the preset has no {role}.weights.h5, needed for {key}")
        if src.endswith(".json"):  # sharded: {"weight_map": {"/layers/…/vars": "model_00000.weights.h5"}}
            weight_map = json.loads(storage.read_text(src))["weight_map"]
            group = "/" + key.rsplit("/", 1)[0]
            shard = weight_map.get(group)
            if shard is None:
                raise UserError(f"{src} lists no shard for {group}; the index is incomplete")
            shards = shard if isinstance(shard, list) else [shard]
            for s in shards:
                h5 = self._h5(storage.join(storage.parent(src), s))
                if key in h5:
                    return h5, key
            raise UserError(f"{key} is in none of its shards {shards}")
        h5 = self._h5(src)
        if role not in self._prefix:
            self._prefix[role] = _find_prefix(h5, key)
        return h5, self._prefix[role] + key

    def dataset(self, key: str):
        role = "model"
        if key.startswith(TASK_PREFIX):
            role, key = "task", key[len(TASK_PREFIX):]
        h5, full = self._file_for(role, key)
        if full not in h5:
            raise UserError(f"{h5.filename} has no weight {full}; is it a weights file for this model?")
        return h5[full]

    def get(self, key: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """Tensor `key`, or its rows [start, stop)."""
        ds = self.dataset(key)
        try:
            data = ds[()] if start is None else ds[start:stop]
        except OSError as e:
            raise UserError(f"cannot read {ds.name.lstrip('/')} from {ds.file.filename} "
                            f"(truncated file? {e})") from None
        if ds.dtype.kind == "V" or ds.attrs.get("dtype") == "bfloat16":
            data = np.asarray(data).view(np.uint16).view(ml_dtypes.bfloat16)
        return np.asarray(data)


def _find_prefix(h5: h5py.File, key: str) -> str:
    """'' for backbone files; 'layers/<backbone>/' for task-level `save_weights` files."""
    if key in h5:
        return ""
    for name in h5.get("layers", {}):
        if f"layers/{name}/{key}" in h5:
            return f"layers/{name}/"
    return ""  # let the caller report the missing weight


def task_paths(family, config) -> set[str]:
    """Our parameter paths that live in task.weights.h5 (e.g. RoBERTa's masked-LM head)."""
    return {p for p, k in family.keras_paths(config).items() if k.startswith(TASK_PREFIX)}


def weight_files(preset_dir: str, weights: str | None = None) -> dict[str, str]:
    """The H5 sources of a preset; `weights` (a .weights.h5 from `save_weights`) overrides the model's."""
    files = {}
    for role in ("model", "task"):
        for ext in (".weights.h5", ".weights.json"):
            p = storage.join(preset_dir, role + ext)
            if storage.exists(p):
                files[role] = p
                break
    if weights is not None:
        if not storage.exists(weights):
            raise UserError(f"weights file {weights} does not exist")
        files["model"] = weights
        files.setdefault("task", weights)
    if "model" not in files:
        raise UserError(f"{preset_dir} has no model.weights.h5 or model.weights.json; "
                        "is it a complete Keras preset?")
    return files


def read_params(family, config, files: dict[str, str], abstract: dict,
                placement: Callable[[str, tuple], jax.sharding.Sharding] | None = None) -> dict:
    """Stream weights into a nested dict shaped like `abstract` ({path: ShapeDtypeStruct})."""
    paths = family.keras_paths(config)
    missing = sorted(set(abstract) - set(paths))
    if missing:
        raise RuntimeError(f"no Keras name for parameters {missing[:3]}…")  # a bug in the family
    with H5Store(files) as store:
        def fetch(path):
            if path.endswith("token_embedding/embeddings"):  # each device's rows, read alone
                return RowReader(store.dataset(paths[path]).shape,
                                 functools.partial(store.get, paths[path]))
            return store.get(paths[path])
        return place_streamed(
            abstract, fetch, placement,
            lambda path, got, want: (f"weight {path} has shape {got} in the file but the config says "
                                     f"{want}; the weights do not belong to this config.json"))


def write_preset(family, config, params: dict, out_dir: str, tokenizer=None) -> None:
    """Write a Keras preset folder that `keras_hub.models.*.from_preset(out_dir)` loads (a local
    folder or a URL; each .h5 is written to a local temporary file first)."""
    import h5py
    storage.makedirs(out_dir)
    flat = flatten(params)
    paths = family.keras_paths(config)
    by_role: dict[str, dict[str, str]] = {}
    for ours, theirs in paths.items():
        role = "task" if theirs.startswith(TASK_PREFIX) else "model"
        by_role.setdefault(role, {})[theirs.removeprefix(TASK_PREFIX)] = ours
    for role, entries in by_role.items():
        with storage.writing(storage.join(out_dir, f"{role}.weights.h5"), ".h5") as tmp, \
                h5py.File(tmp, "w") as h5:
            h5.create_group("vars")
            for key, ours in entries.items():
                arr = np.asarray(jax.device_get(flat[ours]))
                group = h5.require_group(key.rsplit("/", 1)[0])
                group.attrs["name"] = ours.split("/")[-2]
                if arr.dtype == ml_dtypes.bfloat16:  # Keras' own encoding of bfloat16
                    ds = group.create_dataset(key.rsplit("/", 1)[1], data=arr.view(np.uint16).view("V2"))
                    ds.attrs["dtype"] = "bfloat16"
                else:
                    group.create_dataset(key.rsplit("/", 1)[1], data=arr)
    _write_json(storage.join(out_dir, "config.json"), family.config_to_keras(config))
    count = sum(int(np.prod(np.shape(v))) for v in flat.values())
    _write_json(storage.join(out_dir, "metadata.json"), {
        "keras_version": "3", "keras_hub_version": "0", "parameter_count": count,
        "date_saved": datetime.datetime.now().strftime("%Y-%m-%d@%H:%M:%S"),
        "tasks": list(family.keras_tasks), "exported_by": "jaxlm"})
    if tokenizer is not None:
        tokenizer.save_keras_assets(out_dir)
    if family.write_extras is not None:
        family.write_extras(config, out_dir)


def dtype_policy(name: str) -> dict:
    """A serialized Keras DTypePolicy, as config.json / tokenizer.json store it."""
    return {"module": "keras", "class_name": "DTypePolicy", "config": {"name": name},
            "registered_name": None}


def write_tokenizer_json(preset_dir: str, module: str, class_name: str, name: str, **config) -> None:
    """tokenizer.json for a KerasHub tokenizer class; its vocabulary lives in assets/tokenizer/."""
    _write_json(storage.join(preset_dir, "tokenizer.json"), {
        "module": module, "class_name": class_name,
        "config": {"name": name, "trainable": True, "dtype": dtype_policy("int32"),
                   "config_file": "tokenizer.json", **config},
        "registered_name": f"keras_hub>{class_name}"})


def _write_json(path, obj):
    storage.write_text(path, json.dumps(obj, indent=4))
