"""Safetensors files and the layouts that carry our parameters to Hugging Face's and back.

Our kernels are einsum kernels ([in, out], attention [N, H, D] / [N, D, H]); transformers
stores every linear layer as a torch `nn.Linear` weight [out, in]. A `Tensor` says which HF
tensor(s) hold one of our parameters, their shapes, and the two exact (transpose/reshape only)
conversions. Shapes: N heads, H hidden, D head dim.

Reading opens each file with `safetensors.safe_open` and reads one tensor at a time. Writing
streams: the header is built from the shapes alone, then each tensor is fetched, written and
dropped, so host memory holds one tensor beyond the model (and a URL destination gets the
bytes as they are produced).
"""
from __future__ import annotations

import contextlib
import json
import struct
from typing import Callable, Iterable, Iterator, NamedTuple

import ml_dtypes  # noqa: F401  registers numpy's "bfloat16", which safe_open's numpy reader needs
import numpy as np

from jaxlm import storage
from jaxlm.errors import UserError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 2**30  # transformers' long-standing default shard size

_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
           "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


class Tensor(NamedTuple):
    """One of our parameters as HF stores it.

    shape: ours. keys / shapes: the HF tensor(s) holding it. to_ours(*arrays) -> our array;
    to_hf(array) -> one array per key. lora: how a LoRA on this kernel maps to PEFT's (see
    jaxlm/lora/peft.py), None for parameters LoRA never targets.
    """
    shape: tuple
    keys: tuple[str, ...]
    shapes: tuple[tuple, ...]
    to_ours: Callable
    to_hf: Callable
    lora: str | None = None
    as_is: bool = False  # to_hf and to_ours return the array unchanged


def same(key: str, shape) -> Tensor:
    """Norm scales, biases, embeddings: stored as we store them."""
    return Tensor(tuple(shape), (key,), (tuple(shape),), lambda w: w, lambda w: (w,), as_is=True)


def linear(key: str, shape) -> Tensor:
    """ours [in, out] <-> nn.Linear [out, in]."""
    i, o = shape
    return Tensor((i, o), (key,), ((o, i),), lambda w: w.T, lambda w: (w.T,), lora="linear")


def heads_in(key: str, shape) -> Tensor:
    """Gemma q/k/v: ours [N, H, D] <-> [N*D, H] (rows head-major)."""
    n, h, d = shape
    return Tensor((n, h, d), (key,), ((n * d, h),), lambda w: w.reshape(n, d, h).transpose(0, 2, 1),
                  lambda w: (w.transpose(0, 2, 1).reshape(n * d, h),), lora="heads_in")


def hidden_heads(key: str, shape) -> Tensor:
    """RoBERTa q/k/v (Keras layout): ours [H, N, D] <-> [N*D, H]."""
    h, n, d = shape
    return Tensor((h, n, d), (key,), ((n * d, h),), lambda w: w.T.reshape(h, n, d),
                  lambda w: (w.reshape(h, n * d).T,), lora="hidden_heads")


def heads_out(key: str, shape) -> Tensor:
    """Attention output: ours [N, D, H] <-> [H, N*D]."""
    n, d, h = shape
    return Tensor((n, d, h), (key,), ((h, n * d),), lambda w: w.T.reshape(n, d, h),
                  lambda w: (w.reshape(n * d, h).T,), lora="heads_out")


def flat(key: str, shape) -> Tensor:
    """A per-head bias: ours [N, D] <-> [N*D]."""
    return Tensor(tuple(shape), (key,), ((int(np.prod(shape)),),), lambda w: w.reshape(shape),
                  lambda w: (w.reshape(-1),))


# --- reading ---------------------------------------------------------------------------------

class Reader:
    """The tensors of an HF folder by key: `weights` (model.safetensors) or the shards named by
    `index` (model.safetensors.index.json). Files are opened lazily, one tensor read at a time
    (safe_open memory-maps a local file; a URL's files are copied to local temporary files as
    they are opened)."""

    def __init__(self, folder: str, weights: str = WEIGHTS, index: str | None = INDEX):
        self.folder = folder
        self._handles: dict[str, object] = {}
        self._stack = contextlib.ExitStack()
        index = index and storage.join(folder, index)
        if index and storage.exists(index):
            try:
                self._files = dict(json.loads(storage.read_text(index))["weight_map"])
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"{index} is damaged ({type(e).__name__}: {e}); download it again") from None
        elif storage.exists(storage.join(folder, weights)):
            try:
                self._files = {k: weights for k in self._open(weights).keys()}
            except UserError:
                self._stack.close()
                raise
        else:
            stem = "pytorch_model" if weights == WEIGHTS else weights.removesuffix(".safetensors")
            pickled = [n for n in (f"{stem}.bin", f"{stem}.bin.index.json")
                       if storage.exists(storage.join(folder, n))]
            if pickled:
                raise UserError(f"{folder} holds {pickled[0]}, a pickle, which jaxlm does not read; "
                                "re-save it with save_pretrained(..., safe_serialization=True)")
            raise UserError(f"{folder} has no {weights}" + (f" or {storage.basename(index)}" if index else ""))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handles.clear()
        self._stack.close()

    def _open(self, name: str):
        if name not in self._handles:
            from safetensors import safe_open
            path = storage.join(self.folder, name)
            if not storage.exists(path):
                raise UserError(f"{path} does not exist but {INDEX} lists it; the download is incomplete")
            try:
                handle = safe_open(self._stack.enter_context(storage.local(path)), framework="numpy")
                self._handles[name] = self._stack.enter_context(handle)
            except Exception as e:  # SafetensorError: a short file fails its header/size check
                raise UserError(f"{path} is truncated or not a safetensors file "
                                f"({str(e).splitlines()[0]}); download it again") from None
        return self._handles[name]

    def keys(self) -> list[str]:
        return sorted(self._files)

    def shape(self, key: str) -> tuple:
        return tuple(self._open(self._files[key]).get_slice(key).get_shape())

    def get(self, key: str) -> np.ndarray:
        return self._read(key, lambda f: f.get_tensor(key))

    def rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of tensor `key`, read alone."""
        return self._read(key, lambda f: np.asarray(f.get_slice(key)[start:stop]))

    def _read(self, key: str, read: Callable) -> np.ndarray:
        try:
            return read(self._open(self._files[key]))
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"cannot read {key} from {self.folder} ({str(e).splitlines()[0]}); "
                            "the file is damaged") from None


# --- writing ---------------------------------------------------------------------------------

def dtype_name(dtype) -> str:
    name = str(np.dtype(dtype))
    if name not in _DTYPES:
        raise UserError(f"dtype {name} has no safetensors encoding")
    return _DTYPES[name]


def shard(specs: list[tuple[str, tuple, str]], max_bytes: int = MAX_SHARD_BYTES) -> list[list]:
    """Split [(key, shape, dtype)] in order into files of at most `max_bytes` (one tensor may exceed it)."""
    shards, size = [[]], 0
    for spec in specs:
        n = nbytes(spec)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def nbytes(spec) -> int:
    _, shape, dtype = spec
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


class Rows(NamedTuple):
    """A tensor handed to `write_file` a block of rows at a time, in order, so that it is never
    whole in host memory (a multi-host export gathers the demo's 0.67 GB embedding this way)."""
    shape: tuple
    dtype: np.dtype
    blocks: Iterable[np.ndarray]


def write_file(path: str, specs: list[tuple[str, tuple, str]], arrays: Iterator[np.ndarray | Rows],
               metadata: dict | None = None) -> None:
    """Stream one safetensors file: header from `specs` [(key, shape, dtype)], then the data of
    each array (or `Rows`) `arrays` yields (in spec order, checked). Written under a temporary name and
    renamed when complete, so a crash never leaves a short file under the final name."""
    header, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
    for spec in specs:
        key, shape, dtype = spec
        header[key] = {"dtype": dtype_name(dtype), "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes(spec)]}
        offset += nbytes(spec)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with storage.open_file(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for key, shape, dtype in specs:
            arr = next(arrays)
            if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
                raise RuntimeError(f"{key}: got {arr.shape} {arr.dtype}, header says {shape} {dtype}")
            # The array's own bytes, not `tobytes()`'s copy (0.67 GB for Gemma 3 270M's embedding).
            written = 0
            for block in (arr.blocks if isinstance(arr, Rows) else (arr,)):
                data = np.ascontiguousarray(block, arr.dtype).reshape(-1).view(np.uint8)
                f.write(data)
                written += data.nbytes
                del block, data
            if written != nbytes((key, shape, dtype)):
                raise RuntimeError(f"{key}: {written} bytes written, header says {nbytes((key, shape, dtype))}")
            del arr
    if storage.exists(path):  # rename does not overwrite on every backend
        storage.remove_tree(path)
    storage.rename(tmp, path)


def write_folder_weights(folder: str, specs: list[tuple[str, tuple, str]], arrays: Iterable[np.ndarray],
                         max_shard_bytes: int = MAX_SHARD_BYTES, write: bool = True) -> list[str]:
    """`model.safetensors`, or shards `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`.

    Stale weight files of an earlier export in `folder` are removed first (transformers would
    otherwise prefer an old index). write=False consumes `arrays` without writing (the other
    hosts of a multi-host export, whose arrays take part in the gathers). -> file names.
    """
    arrays = iter(arrays)
    shards = shard(specs, max_shard_bytes)
    names = [WEIGHTS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if not write:
        for _ in specs:
            next(arrays)
        return names
    for old in storage.listdir(folder):
        if old == INDEX or (old.startswith("model") and old.endswith(".safetensors") and old not in names):
            storage.remove_tree(storage.join(folder, old))
    for name, part in zip(names, shards):
        write_file(storage.join(folder, name), part, arrays)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes(s) for s in specs)},
                 "weight_map": {key: name for name, part in zip(names, shards) for key, _, _ in part}}
        storage.write_text(storage.join(folder, INDEX), json.dumps(index, indent=2))
    return names
