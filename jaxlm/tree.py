"""Parameter trees are nested dicts; these helpers key them by path strings ("a/b/kernel")."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from jaxlm.errors import UserError


@dataclasses.dataclass(frozen=True)
class RowReader:
    """A host tensor a loader reads by rows on demand: `read(start, stop)` -> rows [start, stop)
    as numpy. Placed with a sharding, each device's block is read by itself, so a process
    reads only the rows of its own devices: the demo's 0.67 GB float32 embedding, read whole
    on every process, made the load each process's peak in a two-process run."""
    shape: tuple
    read: Callable[[int, int], np.ndarray]


def place_streamed(abstract: dict, fetch: Callable, placement=None, mismatch: Callable = None) -> dict:
    """Fill `abstract` ({path: ShapeDtypeStruct}) tensor by tensor -> nested dict of arrays.

    Each host array (or `RowReader`) `fetch(path)` is shape-checked (`mismatch(path, got,
    want)` -> the error line), cast, placed (`placement(path, shape) -> Sharding`, else the
    default device) and dropped before the next is fetched, so host memory holds one tensor
    beyond the source.
    """
    flat = {}
    for path, spec in abstract.items():
        arr = fetch(path)
        if tuple(arr.shape) != tuple(spec.shape):
            raise UserError(mismatch(path, tuple(arr.shape), tuple(spec.shape)))
        sharding = placement(path, spec.shape) if placement else None
        if isinstance(arr, RowReader):
            flat[path] = _place_rows(arr, spec.dtype, sharding)
        else:
            arr = arr.astype(spec.dtype, copy=False)
            flat[path] = place(arr, sharding) if sharding else jax.device_put(arr)
        del arr
    return unflatten(flat)


def _place_rows(rows: RowReader, dtype, sharding) -> jax.Array:
    if sharding is None:
        return jax.device_put(rows.read(0, rows.shape[0]).astype(dtype, copy=False))
    last = {}  # the rows read last: devices holding the same rows (replicas, a split of the
    # columns) share one read instead of each reading, or dequantising, the table again

    def block(index):
        span = index[0].indices(rows.shape[0])[:2]
        if last.get("span") != span:
            last.clear()
            last.update(span=span, rows=rows.read(*span).astype(dtype, copy=False))
        return np.array(last["rows"][(slice(None),) + tuple(index[1:])])  # each device's own copy
    return jax.make_array_from_callback(tuple(rows.shape), sharding, block)


def place(arr, sharding):
    """Host array `arr` (the same on every process) as a global array with `sharding`: each of
    this process's devices is given its slice, so a mesh may span several processes. On such a
    mesh `jax.device_put` of the whole host array took 9.5 GB at peak and kept 6.4 GB per
    process for Gemma 3 270M's 1.07 GB (2 processes x 4 simulated devices). Each slice is
    copied: a contiguous slice (a split on the first axis) was otherwise adopted by XLA:CPU as
    it is, and the whole host array stayed alive under its shards (the demo's 0.67 GB
    embedding, split over the vocabulary, held 0.6 GB more after loading)."""
    return jax.make_array_from_callback(arr.shape, sharding, lambda index: np.array(arr[index]))


ALIGN = 64  # XLA:CPU adopts a host buffer aligned to this without copying it


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised host array that `jax.device_put` on CPU adopts without copying."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def to_host(x: jax.Array, start=None, shape=None, consume: bool = False) -> np.ndarray:
    """This process's shards of `x` written into one new host block (default: all of fully
    addressable `x`) of `shape` at `start`, each distinct block once (replicas, this process's
    or not, are skipped), and aligned so that `jax.device_put` on CPU adopts it rather than
    copying it. `jax.device_get` instead kept each host copy cached on its array (the demo's
    1.07 GB of weights held twice after its export), and numpy's own 16-byte alignment made
    `device_put` copy the 0.67 GB embedding twice while it moved. consume=True deletes each
    shard once it is copied, so that x and its copy never exist whole together (that raised
    the demo's peak by its 0.67 GB embedding in the evaluation)."""
    shape, start = shape or x.shape, start or (0,) * x.ndim
    host, seen = aligned_empty(shape, x.dtype), set()
    for shard in x.addressable_shards:
        key = tuple(i.indices(n)[:2] for i, n in zip(shard.index, x.shape))
        if key not in seen:
            host[within(shard.index, start)] = np.asarray(shard.data)
            seen.add(key)
        if consume:
            shard.data.delete()
    return host


def within(index, start) -> tuple:
    """Global `index` (slices) relative to a block starting at `start`."""
    return tuple(slice(i.start - s if i.start is not None else None,
                       i.stop - s if i.stop is not None else None) for i, s in zip(index, start))


def map_with_path(fn: Callable, tree):
    """`fn(path, leaf)` over every leaf, keeping the tree's structure (node types and their
    static data, e.g. `jaxlm.lora.Adapters`' description), so the result lines up with `tree`
    wherever jax compares structures (optax masks, jit shardings, device_put)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, leaf: fn(jax.tree_util.keystr(kp, simple=True, separator="/"), leaf), tree)


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a/b/c": leaf}."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out
