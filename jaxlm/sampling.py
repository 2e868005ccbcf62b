"""Next-token samplers, as KerasHub's (`keras_hub.samplers`): greedy, random, top-k, top-p.

A sampler is a small frozen dataclass (hashable, so it can key a compiled decode function)
called as `sampler(logits [B, V], key) -> ids [B] int32`. Probabilities are always computed in
float32 as `softmax(logits / temperature)`, as KerasHub's `Sampler.compute_probabilities`.

    resolve("top_k")                -> TopK(k=5, temperature=1.0)   (KerasHub's defaults)
    resolve(TopP(p=0.9))            -> TopP(p=0.9)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlm.errors import UserError


def _probabilities(logits, temperature):
    return jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)


@dataclasses.dataclass(frozen=True)
class Greedy:
    """argmax of the probabilities (argmax over the softmax, as KerasHub, so ties break alike)."""
    temperature: float = 1.0

    def __call__(self, logits, key):
        del key
        return _most_probable(logits, self.temperature)


def _most_probable(logits, temperature):
    """logits [B, V] -> argmax(_probabilities(logits, temperature)) [B] int32, in three
    reductions over [B, V] where the softmax, then a max and a min over its output, took
    five; compiled for CPU it writes two fewer [B, V] arrays (the probabilities). The real
    Gemma 3 270M's 262144 logits on a 2-core AMD EPYC, as the CPU decoder gives them: batch 4
    1.65 -> 1.2 ms, batch 40 (the demo's evaluation) 96 -> 56 ms a step; greedy generation at
    batch 40, 32 new tokens, 9177 -> 8426 ms (float32, best of 4, interleaved, ad hoc).

    exp(0) = 1 exactly and a division by the row's sum s rounds monotonically, so the largest
    probability is 1 / s, and index i reaches it iff exp(x_i - max) / s rounds to 1 / s: the
    same ties as the probabilities' (in a row of two, logits -1e-9 and 0 both have probability
    1/2), broken the same way.

    That needs the shifted logit to be exactly 0 at the max, so the temperature divides
    x - max(x), not x: with x / temperature - max(x / temperature), XLA:CPU computed the
    division (as a product by 1 / temperature) once for the max and again, fused into the
    subtraction with another rounding, for the exponentials. The max's exponential was then
    not 1, no index reached 1 / s, and every row got the last token (in the decoder's
    program, a tiny Gemma at temperature 0.7; `tests/test_sampling.py`).
    """
    x = logits.astype(jnp.float32)
    shifted = (x - jnp.max(x, axis=-1, keepdims=True)) / temperature  # 0 at the max: see below
    total = jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True)
    return _first(jnp.exp(shifted) / total == 1 / total)


def _first(hits):
    """hits [B, V] bool -> each row's first True index [B] int32 (its last index where there
    is none, as for a row with NaN). A min over the indices, which XLA:CPU vectorises, where its
    (value, index) argmax reduction takes ~3x longer (~0.3 ms per decode step on a 32k
    vocabulary at batch 4)."""
    index = jax.lax.broadcasted_iota(jnp.int32, hits.shape, hits.ndim - 1)
    return jnp.min(jnp.where(hits, index, hits.shape[-1] - 1), axis=-1)


@dataclasses.dataclass(frozen=True)
class Random:
    """Sample from the full distribution softmax(logits / temperature)."""
    temperature: float = 1.0

    def __call__(self, logits, key):
        probs = _probabilities(logits, self.temperature)
        return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopK:
    """Sample among the k most likely tokens (KerasHub default k=5)."""
    k: int = 5
    temperature: float = 1.0

    def __post_init__(self):
        if self.k < 1:
            raise UserError(f"top_k sampler needs k >= 1, got k={self.k}")

    def __call__(self, logits, key):
        probs = _probabilities(logits, self.temperature)
        top, idx = jax.lax.top_k(probs, min(self.k, probs.shape[-1]))  # [B, k]
        pick = jax.random.categorical(key, jnp.log(top), axis=-1)
        return jnp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopP:
    """Nucleus sampling: the smallest set of tokens whose mass reaches p (KerasHub default 0.1).

    `k` optionally limits the sort to the k most likely tokens first (cheaper on large vocabs).
    """
    p: float = 0.1
    k: int | None = None
    temperature: float = 1.0

    def __post_init__(self):
        if not 0.0 < self.p <= 1.0:
            raise UserError(f"top_p sampler needs 0 < p <= 1, got p={self.p}")

    def __call__(self, logits, key):
        probs = _probabilities(logits, self.temperature)
        cutoff = probs.shape[-1] if self.k is None else min(self.k, probs.shape[-1])
        top, idx = jax.lax.top_k(probs, cutoff)  # sorted, descending
        keep = jnp.cumsum(top, axis=-1) <= self.p
        # Keep the token that crosses p too (so at least one token always survives).
        keep = jnp.concatenate([jnp.ones_like(keep[:, :1]), keep[:, :-1]], axis=-1)
        pick = jax.random.categorical(key, jnp.log(jnp.where(keep, top, 0.0)), axis=-1)
        return jnp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


Sampler = Greedy | Random | TopK | TopP

SAMPLERS: dict[str, Sampler] = {
    "greedy": Greedy(),
    "random": Random(),
    "temperature": Random(),
    "top_k": TopK(),
    "top_p": TopP(),
}


def resolve(sampler) -> Sampler:
    """A sampler name or instance -> a sampler instance; unknown names are a UserError."""
    if isinstance(sampler, (Greedy, Random, TopK, TopP)):
        return sampler
    if isinstance(sampler, str) and sampler in SAMPLERS:
        return SAMPLERS[sampler]
    raise UserError(f"unknown sampler {sampler!r}; use one of {', '.join(SAMPLERS)} "
                    "(or a jaxlm.sampling.Greedy/Random/TopK/TopP instance)")
