"""LoRA as a transform of the parameter tree.

No module knows about LoRA. `init` returns a separate, small tree of adapters that mirrors the
parameter tree at the targeted kernels only::

    params   decoder_block_0/attention/query/kernel   [N, H, D]   (frozen)
    adapters decoder_block_0/attention/query/lora_a   [N, H, r]   float32, he_uniform
             decoder_block_0/attention/query/lora_b   [r, D]      float32, zeros

and `merge(params, adapters)` returns the effective parameters, kernel + (alpha / r) * A @ B
(matmul batched over the leading dims), which the unchanged model then applies. The train step
merges inside `jit` and differentiates only the adapters; since B starts at zero the merged
model starts equal to the base one.

Targets are regexes `re.fullmatch`ed against parameter paths; each must match at least one
`.../kernel` of rank >= 2. The default equals KerasHub's `enable_lora`, which LoRA-fies the
layers named query/value: every attention query and value kernel (Gemma's
`decoder_block_{i}/attention/query/kernel`, RoBERTa's
`transformer_layer_{i}/self_attention_layer/query/kernel`). Shapes, float32 factors, Keras-fan
he_uniform init and scale alpha / r with alpha = r all match `EinsumDense.enable_lora`, so
Gemma 2B at rank 4 trains 1,363,968 parameters, as in KerasHub.

Weight-space merging cannot apply dropout to the layer input, so `dropout` must be 0 (KerasHub's
LoRA has no dropout either). `alpha` scales the update in `merge`, not the initial factors; `init`
only checks it.

KerasHub adapter files (`backbone.save_lora_weights`, `*.lora.h5`) hold one rank and, per
LoRA-enabled layer, its factors under the layer's index among the backbone's layers that own
weights (`_flatten_layers` order): `lora/vars/rank`, `lora/<idx>/vars/lora_kernel_{a,b}`.
`save_keras_lora` / `load_keras_lora` move adapters both ways; KerasHub does not store alpha, so a
non-default alpha is folded into B on export. KerasHub's `load_lora_weights` fills the layers its
own `enable_lora(rank)` enabled (query/value by default), so adapters with other targets need
`enable_lora(rank, target_layer_names=[...])` on the Keras side first.
"""
from __future__ import annotations

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.errors import UserError
from jaxlm.tree import flatten, unflatten

DEFAULT_TARGETS = ("(.*/)?(query|value)/kernel",)
FACTORS = ("lora_a", "lora_b")


def find_targets(params: dict, targets=None) -> list[str]:
    """Sorted paths of the kernels the target regexes select (see module docstring)."""
    targets = DEFAULT_TARGETS if targets is None else targets
    if isinstance(targets, str):
        targets = (targets,)
    paths = flatten(params)
    found = set()
    for pattern in targets:
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise UserError(f"LoRA target {pattern!r} is not a valid regex ({e})") from None
        hits = [p for p in paths if regex.fullmatch(p)]
        if not hits:
            raise UserError(f"LoRA target {pattern!r} matches no parameter (paths look like "
                            f"{next(iter(paths), '<empty>')!r}); fix the regex")
        for p in hits:
            if not p.endswith("/kernel") or len(paths[p].shape) < 2:
                raise UserError(f"LoRA target {pattern!r} matches {p} {tuple(paths[p].shape)}; "
                                "LoRA adapts kernels (rank >= 2): end the regex in /kernel")
        found.update(hits)
    return sorted(found)


def _he_uniform(key, shape) -> jax.Array:
    """Keras `he_uniform` with Keras fans: fan_in = shape[-2] * prod(shape[:-2])."""
    fan_in = shape[-2] * math.prod(shape[:-2])
    limit = math.sqrt(6.0 / fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -limit, limit)


def init(params: dict, rank: int, *, key, alpha=None, targets=None, dropout: float = 0.0) -> dict:
    """-> adapters {P: {"lora_a": [*K[:-1], r], "lora_b": [r, K[-1]]}} per target kernel P/kernel.

    params may be abstract (ShapeDtypeStructs): only shapes are read, so
    `jax.jit(lambda k: init(abstract, r, key=k), out_shardings=...)` creates adapters in place.
    """
    _check(rank, alpha)
    if dropout:
        raise UserError(f"LoRA dropout={dropout} is not supported: merged weights cannot drop "
                        "the layer input; use dropout=0 (KerasHub's LoRA has none either)")
    paths = find_targets(params, targets)
    flat = flatten(params)
    keys = jax.random.split(key, len(paths))
    out = {}
    for k, path in zip(keys, paths):
        shape = tuple(flat[path].shape)
        parent = path[: -len("/kernel")]
        out[f"{parent}/lora_a"] = _he_uniform(k, shape[:-1] + (rank,))
        out[f"{parent}/lora_b"] = jnp.zeros((rank, shape[-1]), jnp.float32)
    return unflatten(out)


def _check(rank, alpha=None) -> None:
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank < 1:
        raise UserError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    if alpha is not None and not alpha > 0:
        raise UserError(f"LoRA alpha must be > 0 (or None for alpha = rank), got {alpha!r}")


def _pairs(adapters: dict) -> dict:
    """{P: (lora_a, lora_b)} from an adapter tree, checking it is well formed."""
    flat = flatten(adapters)
    pairs = {}
    for path in flat:
        parent, _, name = path.rpartition("/")
        if name not in FACTORS:
            raise UserError(f"{path} is not a LoRA factor (lora_a or lora_b); pass the tree "
                            "made by jaxlm.lora.init or load_keras_lora")
        pairs[parent] = ()
    for parent in pairs:
        a, b = flat.get(f"{parent}/lora_a"), flat.get(f"{parent}/lora_b")
        if a is None or b is None:
            raise UserError(f"adapter {parent} lacks lora_a or lora_b; the tree is incomplete")
        pairs[parent] = (a, b)
    return pairs


def _update(path: str, kernel, a, b, alpha, sign: float):
    k, a_shape, b_shape = tuple(kernel.shape), tuple(a.shape), tuple(b.shape)
    if a_shape[:-1] != k[:-1] or b_shape != (a_shape[-1], k[-1]):
        raise UserError(f"adapter {path} has A {a_shape}, B {b_shape} but the kernel is {k}; "
                        "the adapters belong to another model")
    rank = a.shape[-1]
    scale = (rank if alpha is None else alpha) / rank
    delta = jnp.einsum("...r,rd->...d", a.astype(jnp.float32), b.astype(jnp.float32))
    return (kernel.astype(jnp.float32) + sign * scale * delta).astype(kernel.dtype)


def _apply(params: dict, adapters: dict, alpha, sign: float) -> dict:
    flat = flatten(params)
    for parent, (a, b) in _pairs(adapters).items():
        path = f"{parent}/kernel"
        if path not in flat:
            raise UserError(f"adapters have {parent} but the parameters have no {path}; "
                            "the adapters belong to another model")
        flat[path] = _update(parent, flat[path], a, b, alpha, sign)
    return unflatten(flat)


def merge(params: dict, adapters: dict, *, alpha=None) -> dict:
    """-> params with W + (alpha / r) * A @ B at each adapted kernel, in W's dtype.

    alpha None means alpha = r (scale 1, KerasHub's default). Untargeted leaves are the same
    objects. Pure and jit-friendly.
    """
    return _apply(params, adapters, alpha, 1.0)


def unmerge(merged: dict, adapters: dict, *, alpha=None) -> dict:
    """Inverse of `merge` (up to rounding in W's dtype)."""
    return _apply(merged, adapters, alpha, -1.0)


def num_params(tree: dict) -> int:
    """Total element count of a tree of arrays or ShapeDtypeStructs."""
    return sum(math.prod(leaf.shape) for leaf in flatten(tree).values())


def trainable_count(params: dict, rank: int, targets=None) -> int:
    """Adapter parameter count for `init(params, rank, targets=targets)`, allocating nothing."""
    _check(rank)
    flat = flatten(params)
    return sum(math.prod(flat[p].shape[:-1]) * rank + rank * flat[p].shape[-1]
               for p in find_targets(params, targets))


# --- KerasHub .lora.h5 ----------------------------------------------------------------------

def keras_lora_supported(config) -> bool:
    """Whether `.lora.h5` import/export knows this config's KerasHub layer order."""
    try:
        keras_layers(config)
    except UserError:
        return False
    return True


def keras_layers(config) -> list[str]:
    """Paths of the backbone's layers that own weights, in KerasHub `_flatten_layers` order.

    A layer's index in this list is its `<idx>` in a `.lora.h5` file (checked live against
    KerasHub's `layer.path`s in tests/test_lora.py).
    """
    family = getattr(config, "family", None)
    if family == "gemma":
        if config.use_post_attention_norm or config.use_post_ffw_norm:
            raise UserError("KerasHub .lora.h5 layer order is known for Gemma 1 only; "
                            "this config has Gemma 2 post-norms")
        out = ["token_embedding"]
        for i in range(config.num_layers):
            b = f"decoder_block_{i}"
            out += [b, f"{b}/ffw_linear", f"{b}/ffw_gating_2", f"{b}/ffw_gating",
                    f"{b}/pre_ffw_norm", f"{b}/attention"]
            out += [f"{b}/attention/{n}" for n in ("attention_output", "value", "key", "query")]
            out.append(f"{b}/pre_attention_norm")
        return out + ["final_normalization"]
    if family == "roberta":
        out = ["embeddings", "embeddings/position_embedding", "embeddings/token_embedding",
               "embeddings_layer_norm"]
        for i in range(config.num_layers):
            t = f"transformer_layer_{i}"
            out += [t, f"{t}/feedforward_output_dense", f"{t}/feedforward_intermediate_dense",
                    f"{t}/feedforward_layer_norm", f"{t}/self_attention_layer_norm",
                    f"{t}/self_attention_layer"]
            out += [f"{t}/self_attention_layer/{n}"
                    for n in ("attention_output", "value", "key", "query")]
        return out
    raise UserError(f"no KerasHub LoRA layer order for model family {family!r}")


def _lora_path(path: str) -> None:
    if not str(path).endswith(".lora.h5"):
        raise UserError(f"{path}: KerasHub adapter files must end in .lora.h5; rename it")


def save_keras_lora(path: str, adapters: dict, config, *, alpha=None) -> None:
    """Write adapters as KerasHub `save_lora_weights` does (load with `load_lora_weights`).

    config: the model's config (or the model). alpha: the alpha used with `merge`; folded into
    B because KerasHub always scales by 1.
    """
    import h5py
    _lora_path(path)
    config = getattr(config, "config", config)
    index = {p: i for i, p in enumerate(keras_layers(config))}
    pairs = _pairs(adapters)
    ranks = {a.shape[-1] for a, _ in pairs.values()}
    if len(ranks) != 1:
        raise UserError(f"adapters have ranks {sorted(ranks)}; a .lora.h5 file holds one rank")
    rank = ranks.pop()
    _check(rank, alpha)
    scale = 1.0 if alpha is None else alpha / rank
    missing = [p for p in pairs if p not in index]
    if missing:
        raise UserError(f"adapter {missing[0]} is not a KerasHub backbone layer; "
                        "only backbone layers can be written to .lora.h5")
    with h5py.File(path, "w") as f:
        f.create_group("lora/vars").create_dataset("rank", data=np.int64(rank))
        for parent, (a, b) in sorted(pairs.items(), key=lambda kv: index[kv[0]]):
            g = f.create_group(f"lora/{index[parent]}/vars")
            g.create_dataset("lora_kernel_a", data=np.asarray(a, np.float32))
            g.create_dataset("lora_kernel_b", data=np.asarray(b, np.float32) * np.float32(scale))


def load_keras_lora(path: str, config, params: dict | None = None) -> dict:
    """Read a KerasHub `.lora.h5` -> adapters (float32), for `merge` with alpha=None.

    config: the model's config (or the model). params (arrays or abstract), if given, are used
    to check every factor's shape against its kernel.
    """
    import h5py
    _lora_path(path)
    if not os.path.isfile(path):
        raise UserError(f"{path} does not exist")
    config = getattr(config, "config", config)
    layers = keras_layers(config)
    kernels = flatten(params) if params is not None else None
    out = {}
    with h5py.File(path, "r") as f:
        if "lora/vars/rank" not in f:
            raise UserError(f"{path} has no lora/vars/rank; it is not a KerasHub LoRA file")
        rank = int(f["lora/vars/rank"][()])
        for idx in sorted((k for k in f["lora"] if k != "vars"), key=int):
            if int(idx) >= len(layers):
                raise UserError(f"{path} has layer index {idx} but this model has "
                                f"{len(layers)} weighted layers; it belongs to another model")
            parent, g = layers[int(idx)], f[f"lora/{idx}/vars"]
            a = np.asarray(g["lora_kernel_a"], np.float32)
            b = np.asarray(g["lora_kernel_b"], np.float32)
            if a.shape[-1] != rank or b.shape[0] != rank:
                raise UserError(f"{path}: layer {idx} factors {a.shape}, {b.shape} disagree with "
                                f"rank {rank}; the file is corrupt")
            if kernels is not None:
                kernel = kernels.get(f"{parent}/kernel")
                if kernel is None:
                    raise UserError(f"{path}: layer {idx} maps to {parent}, which has no kernel")
                if a.shape[:-1] != tuple(kernel.shape[:-1]) or b.shape[-1] != kernel.shape[-1]:
                    raise UserError(f"{path}: {parent} factors {a.shape}, {b.shape} do not fit "
                                    f"kernel {tuple(kernel.shape)}; it belongs to another model")
            out[f"{parent}/lora_a"] = jnp.asarray(a)
            out[f"{parent}/lora_b"] = jnp.asarray(b)
    if not out:
        raise UserError(f"{path} holds no adapters")
    return unflatten(out)
