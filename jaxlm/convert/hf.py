"""Hugging Face model folders, both ways: `jaxlm.load(DIR)` reads one, `jaxlm.save(OUT, model,
params, tokenizer, format="hf")` (or `python -m jaxlm.convert SRC OUT --to=hf`) writes one that
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` (Gemma) or `AutoModelForMaskedLM`
(RoBERTa) and `AutoTokenizer.from_pretrained(OUT)` load with no extra arguments.

A folder is::

    config.json                    "model_type": gemma / gemma2 / gemma3_text / gemma3 / roberta
    model.safetensors              or model.safetensors.index.json + model-0000i-of-0000n.safetensors
    tokenizer.model                Gemma: the sentencepiece model (+ tokenizer_config.json)
    vocab.json, merges.txt         RoBERTa: byte-level BPE (+ tokenizer_config.json)

Each family's config fields and tensor names live in `hf_gemma` / `hf_roberta`, the tokenizer
files in `hf_tokenizer`; this module checks a folder against them and streams the tensors
(see `hf_tensors`).
"""
from __future__ import annotations

import collections
import functools
import json
import os
import re

import jax
import numpy as np

from jaxlm import families, storage
from jaxlm.convert import hf_gemma, hf_roberta
from jaxlm.convert.hf_tensors import MAX_SHARD_BYTES, Reader, Rows, write_folder_weights
from jaxlm.convert.hf_tokenizer import write_tokenizer
from jaxlm.errors import UserError
from jaxlm.tree import RowReader, flatten, place_streamed, to_host

FORMATS = {"gemma": hf_gemma, "roberta": hf_roberta}  # family name -> its HF mapping
CONFIG = "config.json"
SPECIAL_IDS = {"gemma": {"bos": 2, "eos": 1, "pad": 0}, "roberta": {"bos": 0, "eos": 2, "pad": 1}}


def is_hf_folder(path: str) -> bool:
    """Whether `path` is a folder whose config.json is a transformers config (has "model_type")."""
    return storage.isdir(path) and "model_type" in _config_json(path, missing_ok=True)


def _config_json(folder: str, missing_ok: bool = False) -> dict:
    path = storage.join(folder, CONFIG)
    if not storage.exists(path):
        if missing_ok:
            return {}
        raise UserError(f"{folder} has no {CONFIG}")
    try:
        raw = json.loads(storage.read_text(path))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); download it again") from None
    return raw if isinstance(raw, dict) else {}


def read_config(folder: str):
    """-> (family, config) from an HF folder's config.json."""
    raw = _config_json(folder)
    model_type = raw.get("model_type")
    for name, fmt in FORMATS.items():
        if model_type in fmt.MODEL_TYPES:
            return families.by_name(name), fmt.config_from_hf(raw)
    known = [t for fmt in FORMATS.values() for t in fmt.MODEL_TYPES]
    raise UserError(f"{folder}: model_type {model_type!r} is not supported; supported: {', '.join(known)}")


def read_params(folder: str, family, config, abstract: dict, placement=None) -> dict:
    """Stream an HF folder's tensors into a nested dict shaped like `abstract` ({path: ShapeDtypeStruct}).

    Every tensor's shape is checked against the config before any data is read; tensors the
    model does not use (a multimodal checkpoint's vision tower, RoBERTa's pooler) are skipped.
    """
    fmt = FORMATS[family.name]
    table = fmt.tensors(config, _config_json(folder))
    with Reader(folder) as reader:
        present = set(reader.keys())
        prefix = _text_tower_prefix(fmt, present)
        file_key = lambda k: prefix + k.removeprefix("model.") if prefix else k  # noqa: E731
        wanted = {file_key(k): shape for t in table.values() for k, shape in zip(t.keys, t.shapes)}
        missing = sorted(set(wanted) - present)
        if missing:
            raise UserError(f"{folder} lacks {len(missing)} tensors the config needs ({missing[0]}, ...); "
                            "the checkpoint is incomplete or its config.json belongs to another model")
        ignored = re.compile("|".join(fmt.IGNORED))
        unexpected = sorted(k for k in present - set(wanted) if not ignored.fullmatch(k))
        if unexpected:
            raise UserError(f"{folder} holds tensors jaxlm's {family.name} has no place for "
                            f"({', '.join(unexpected[:3])}); is it a {family.name} checkpoint?")
        for key, shape in wanted.items():
            got = reader.shape(key)
            if got != tuple(shape):
                raise UserError(f"tensor {key} has shape {got} in the file but {CONFIG} implies "
                                f"{tuple(shape)}; the weights do not belong to this config")

        def fetch(path):
            t = table[path]
            if t.as_is and len(t.shape) == 2:  # the embedding: each device's rows, read alone
                return RowReader(t.shape, functools.partial(reader.rows, file_key(t.keys[0])))
            return np.asarray(t.to_ours(*(reader.get(file_key(k)) for k in t.keys)))

        return place_streamed(abstract, fetch, placement,
                              lambda p, got, want: f"{p}: converted shape {got}, expected {want}")


def _text_tower_prefix(fmt, present: set) -> str:
    """'' for a text model; a multimodal Gemma 3's prefix of its language model's tensors."""
    if "model.embed_tokens.weight" in present or not hasattr(fmt, "TEXT_TOWER_PREFIXES"):
        return ""
    for prefix in fmt.TEXT_TOWER_PREFIXES:
        if f"{prefix}embed_tokens.weight" in present:
            return prefix
    return ""


def special_ids(family, tokenizer=None) -> dict:
    if tokenizer is None:
        return dict(SPECIAL_IDS[family.name])
    return {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id}


def hf_config(config, tokenizer=None) -> dict:
    """The config.json an export of `config` gets (a UserError if transformers cannot run it)."""
    family = families.by_config(config)
    if family.name not in FORMATS:
        raise UserError(f"no Hugging Face format for model family {family.name!r}")
    return FORMATS[family.name].config_to_hf(config, special_ids(family, tokenizer))


def write_folder(out_dir: str, config, params: dict, tokenizer=None, *,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write an HF folder (see module docstring); `out_dir` may be a URL. -> the files written.

    Tensors are fetched, converted and written one at a time in the weights' dtype. On a
    multi-host run every process must call this (each tensor is gathered from the hosts holding
    its shards) and process 0 writes.
    """
    family = families.by_config(config)
    hf = hf_config(config, tokenizer)  # first: an unsupported config fails before anything is written
    table = FORMATS[family.name].tensors(config)
    flat = flatten(params)
    # One dtype for the file, as transformers writes: the weights' (norm scales, which jaxlm
    # keeps in float32 under any compute dtype, follow them).
    dtype = collections.Counter(str(x.dtype) for x in flat.values()).most_common(1)[0][0]
    hf.update(dtype=dtype, torch_dtype=dtype)
    specs = [(key, shape, dtype) for t in table.values() for key, shape in zip(t.keys, t.shapes)]

    lead = jax.process_index() == 0

    def arrays():
        for path, t in table.items():
            x = flat[path]
            if t.as_is and _by_rows(x):
                blocks = (b.astype(dtype, copy=False) for b in _row_blocks(x))
                if lead:
                    yield Rows(x.shape, np.dtype(dtype), blocks)
                else:  # the others only take part in the gathers
                    collections.deque(blocks, maxlen=0)
                    yield None
                continue
            if lead and isinstance(x, jax.Array) and x.is_fully_addressable:
                # Converted where it lies: XLA transposes a kernel ~6x faster than numpy copies
                # a transposed view (Gemma 2B's bfloat16 kernels: 12.8 s of a 27 s export).
                yield from (_host_array(w).astype(dtype, copy=False) for w in t.to_hf(x))
                continue
            host = _host_array(x, keep=lead)
            yield from ((w.astype(dtype, copy=False) for w in t.to_hf(host)) if lead else
                        (None for _ in t.keys))
    if lead:
        storage.makedirs(out_dir)
    names = write_folder_weights(out_dir, specs, arrays(), max_shard_bytes, write=lead)
    if not lead:
        return []
    storage.write_text(storage.join(out_dir, CONFIG), json.dumps(hf, indent=2))
    names.append(CONFIG)
    if tokenizer is not None:
        names += write_tokenizer(out_dir, tokenizer)
    return names


# Bytes of a tensor gathered across processes at a time (see `_host_array`); the environment
# variable lets the multi-process test take the blocked path on a tiny model.
GATHER_BYTES = int(os.environ.get("JAXLM_GATHER_BYTES", 64 << 20))


def _host_array(x, keep: bool = True) -> np.ndarray | None:
    """`x` whole in host memory (keep=False: only take part in the gathers, for a process that
    does not write; it held the demo's whole 0.67 GB embedding for nothing). An array of this
    process is assembled from its shards (`jaxlm.tree.to_host`). One spread over several
    processes is gathered a block at a time along an axis its sharding leaves whole:
    `process_allgather` replicates what it gathers on every device, so Gemma 3 270M's 0.67 GB
    embedding at once took each of 2 processes x 4 devices to 6.2 GB; and a block of rows of
    that embedding split over the vocabulary made the partitioner gather all of it onto every
    device first (4.3 GB per process)."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if x.is_fully_addressable:
        return to_host(x)
    from jax.experimental import multihost_utils
    if x.ndim == 0 or x.nbytes <= GATHER_BYTES:
        whole = multihost_utils.process_allgather(x, tiled=True)  # every process must call it
        return np.asarray(whole) if keep else None
    axis = gather_axis(x)
    step = max(1, GATHER_BYTES // (x.nbytes // x.shape[axis]))
    out = np.empty(x.shape, x.dtype) if keep else None
    for r in range(0, x.shape[axis], step):
        block = multihost_utils.process_allgather(
            _block(x, r, min(step, x.shape[axis] - r), axis), tiled=True)
        if keep:
            out[(slice(None),) * axis + (slice(r, r + step),)] = block
    return out


def _by_rows(x) -> bool:
    """Whether `x` is split on its first axis only and larger than one gather: `_row_blocks`
    then hands it to the writer without its whole host copy (the demo's 0.67 GB embedding
    raised the single process's export by 0.6 GB)."""
    if not isinstance(x, jax.Array) or x.nbytes <= GATHER_BYTES:
        return False
    split = _split_axes(x)
    return split[0] and not any(split[1:])


def _row_blocks(x):
    """`x` (`_by_rows`) as host blocks of rows in order. One process's array gives its shards
    as they are (on the CPU a view, not a copy). Across processes each block is gathered from
    the process that holds it, and every process must iterate them all; a block is then at
    most GATHER_BYTES over all of this process's devices: `process_allgather` copies its input
    to each local device and its output, one block per process, to each again."""
    if x.is_fully_addressable:
        rows = {s.index[0].indices(x.shape[0])[:2]: s.data for s in x.addressable_shards
                if s.replica_id == 0}
        yield from (np.asarray(rows[r]) for r in sorted(rows))
        return
    from jax.experimental import multihost_utils
    owner, local = {}, {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        rows = index[0].indices(x.shape[0])[:2]
        owner[rows] = min(owner.get(rows, device.process_index), device.process_index)
    for shard in x.addressable_shards:
        local[shard.index[0].indices(x.shape[0])[:2]] = shard.data
    per_round = jax.local_device_count() * (1 + jax.process_count())
    step = max(1, GATHER_BYTES // per_round // (x.nbytes // x.shape[0]))
    me = jax.process_index()
    for (start, stop), p in sorted(owner.items()):
        for r in range(start, stop, step):
            n = min(step, stop - r)
            mine = (np.asarray(local[start, stop][r - start:r - start + n]) if p == me
                    else np.zeros((n,) + x.shape[1:], x.dtype))
            yield multihost_utils.process_allgather(mine, tiled=False)[p]


def _split_axes(x: jax.Array) -> list[bool]:
    """For each axis of `x`, whether its sharding splits it."""
    return [n != m for n, m in zip(x.shape, x.sharding.shard_shape(x.shape))]


def gather_axis(x: jax.Array) -> int:
    """The longest axis that `x`'s sharding does not split (0 if it splits every axis)."""
    whole = [i for i, split in enumerate(_split_axes(x)) if not split]
    return max(whole, key=lambda i: x.shape[i], default=0)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _block(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def usage(model_dir: str, config, adapter_dir: str | None = None) -> list[str]:
    """The lines of Python that load an export with transformers (and peft, for adapters)."""
    auto = "AutoModelForMaskedLM" if families.by_config(config).name == "roberta" else "AutoModelForCausalLM"
    lines = [f"import transformers{', peft' if adapter_dir else ''}",
             f"model = transformers.{auto}.from_pretrained({model_dir!r})",
             f"tokenizer = transformers.AutoTokenizer.from_pretrained({model_dir!r})"]
    if adapter_dir:
        lines.append(f"model = peft.PeftModel.from_pretrained(model, {adapter_dir!r})")
    return lines
