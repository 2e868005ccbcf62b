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

The adapter tree describes itself: it is an `Adapters`, a dict that also carries `rank`,
`alpha` and `targets`. They are static pytree data (not leaves), so `jax.tree.map`, `jit`,
gradients, optax and orbax all see the same factors and keep the description, and `merge`,
`jaxlm.generate`, the trainer's evaluation and every export read alpha from the tree instead
of a flag someone must remember to pass again.

Targets are regexes `re.fullmatch`ed against parameter paths; each must match at least one
`.../kernel` of rank >= 2. The default equals KerasHub's `enable_lora`, which LoRA-fies the
layers named query/value: every attention query and value kernel (Gemma's
`decoder_block_{i}/attention/query/kernel`, RoBERTa's
`transformer_layer_{i}/self_attention_layer/query/kernel`). Shapes, float32 factors, Keras-fan
he_uniform init and scale alpha / r with alpha = r all match `EinsumDense.enable_lora`, so
Gemma 2B at rank 4 trains 1,363,968 parameters, as in KerasHub.

Weight-space merging cannot apply dropout to the layer input, so `dropout` must be 0 (KerasHub's
LoRA has no dropout either). `alpha` scales the update in `merge`, not the initial factors.
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.errors import UserError
from jaxlm.tree import flatten, unflatten

DEFAULT_TARGETS = ("(.*/)?(query|value)/kernel",)
FACTORS = ("lora_a", "lora_b")


@jax.tree_util.register_pytree_with_keys_class
class Adapters(dict):
    """A nested dict of LoRA factors that also knows its `rank`, `alpha` and `targets`.

    Leaves are the factors only; the description is pytree aux data, so trees mapped from an
    `Adapters` (gradients, Adam moments, shardings, ShapeDtypeStructs) are `Adapters` with the
    same description. `scale` = alpha / rank is what `merge` multiplies A @ B by.
    """

    def __init__(self, factors=(), *, rank: int, alpha: float | None = None, targets=DEFAULT_TARGETS):
        super().__init__(factors)
        self.rank = int(rank)
        self.alpha = float(self.rank if alpha is None else alpha)
        self.targets = tuple(targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def describe(self) -> dict:
        """The description as JSON-ready data (what `jaxlm.lora.save` writes beside the factors)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    def with_factors(self, factors) -> "Adapters":
        """The same description over other factors (a plain nested dict of the same shape)."""
        return Adapters(factors, rank=self.rank, alpha=self.alpha, targets=self.targets)

    def __repr__(self):
        return (f"Adapters(rank={self.rank}, alpha={self.alpha:g}, targets={self.targets}, "
                f"{dict.__repr__(self)})")

    def tree_flatten_with_keys(self):
        keys = tuple(sorted(self))
        return ([(jax.tree_util.DictKey(k), self[k]) for k in keys],
                (keys, self.rank, self.alpha, self.targets))

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, rank, alpha, targets = aux
        return cls(zip(keys, children), rank=rank, alpha=alpha, targets=targets)


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


def _he_uniform(key, shape, dtype) -> jax.Array:
    """Keras `he_uniform` with Keras fans: fan_in = shape[-2] * prod(shape[:-2])."""
    fan_in = shape[-2] * math.prod(shape[:-2])
    limit = math.sqrt(6.0 / fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -limit, limit).astype(dtype)


def init(params: dict, rank: int, *, key, alpha=None, targets=None, dropout: float = 0.0,
         dtype="float32") -> Adapters:
    """-> Adapters {P: {"lora_a": [*K[:-1], r], "lora_b": [r, K[-1]]}} per target kernel P/kernel.

    alpha: None means alpha = rank (scale 1, KerasHub's default). dtype: the factors' dtype --
    the trainable (master) dtype of the precision policy, float32 unless asked otherwise.
    params may be abstract (ShapeDtypeStructs): only shapes are read, so
    `jax.jit(lambda k: init(abstract, r, key=k), out_shardings=...)` creates adapters in place.
    """
    _check(rank, alpha)
    if dropout:
        raise UserError(f"LoRA dropout={dropout} is not supported: merged weights cannot drop "
                        "the layer input; use dropout=0 (KerasHub's LoRA has none either)")
    targets = DEFAULT_TARGETS if targets is None else (targets,) if isinstance(targets, str) else targets
    paths = find_targets(params, targets)
    flat = flatten(params)
    keys = jax.random.split(key, len(paths))
    dtype = jnp.dtype(dtype)
    out = {}
    for k, path in zip(keys, paths):
        shape = tuple(flat[path].shape)
        parent = path[: -len("/kernel")]
        out[f"{parent}/lora_a"] = _he_uniform(k, shape[:-1] + (rank,), dtype)
        out[f"{parent}/lora_b"] = jnp.zeros((rank, shape[-1]), dtype)
    return Adapters(unflatten(out), rank=rank, alpha=alpha, targets=targets)


def _check(rank, alpha=None) -> None:
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank < 1:
        raise UserError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    if alpha is not None and not alpha > 0:
        raise UserError(f"LoRA alpha must be > 0 (or None for alpha = rank), got {alpha!r}")


def pairs(adapters: dict) -> dict:
    """{P: (lora_a, lora_b)} from an adapter tree, checking it is well formed."""
    flat = flatten(adapters)
    out = {}
    for path in flat:
        parent, _, name = path.rpartition("/")
        if name not in FACTORS:
            raise UserError(f"{path} is not a LoRA factor (lora_a or lora_b); pass the tree "
                            "made by jaxlm.lora.init or load_keras_lora")
        out[parent] = ()
    for parent in out:
        a, b = flat.get(f"{parent}/lora_a"), flat.get(f"{parent}/lora_b")
        if a is None or b is None:
            raise UserError(f"adapter {parent} lacks lora_a or lora_b; the tree is incomplete")
        out[parent] = (a, b)
    return out


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
    alpha = alpha if alpha is not None else getattr(adapters, "alpha", None)
    flat = flatten(params)
    for parent, (a, b) in pairs(adapters).items():
        path = f"{parent}/kernel"
        if path not in flat:
            raise UserError(f"adapters have {parent} but the parameters have no {path}; "
                            "the adapters belong to another model")
        flat[path] = _update(parent, flat[path], a, b, alpha, sign)
    return unflatten(flat)


def merge(params: dict, adapters: dict, *, alpha=None) -> dict:
    """-> params with W + (alpha / r) * A @ B at each adapted kernel, in W's dtype.

    alpha: None reads the adapters' own (`Adapters.alpha`; alpha = r for a plain dict of
    factors); a number overrides it. Untargeted leaves are the same objects. Pure and
    jit-friendly.
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
