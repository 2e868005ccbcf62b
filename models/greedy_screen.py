"""Greedy tokens of a float32 model through a bfloat16 screen of its tied table (XLA:CPU, AMX).

A float32 decode step of a model with a large vocabulary spends most of its time reading the
tied table for the logits (the real Gemma 3 270M: 671 of its 1067 MB). Greedy decoding needs
only the largest logit, and a table rounded to bfloat16 finds it from half the bytes, with
an error that can be bounded for every row of the table. Write w for a table row, w' for it
rounded, x for the hidden state and x' for it rounded; then

    x . w - x' . w' = x . (w - w') + (x - x') . w'
    |x . w - fl(x' . w')| <= |x| |w - w'| + |x - x'| |w'| + gamma |x'| |w'|    (Cauchy-Schwarz)

where gamma bounds the float32 sums' rounding, and |w - w'| <= 2^-8 |w'| (bfloat16 keeps 8
significant bits and rounds to nearest; a last term covers subnormals).

The step works a block of `block` vocabulary rows at a time, so that nothing but the product
passes over all V rows. The screen, built once per generate call, is the rounded table and
each block's norm: its largest rounded row's. One bound e then serves the whole block, and
the block's largest exact logit lies within e of its largest rounded one m (a row's exact
logit is at most its rounded one plus e; the row of the rounded maximum's is at least m - e).
No block with m + e below max(m - e) can hold the largest logit. The blocks that can, in
vocabulary order (a running count places them, without XLA:CPU's sort), are recomputed in
float32 from the table, and the greedy rule picks among them: the first `few` blocks of each
row where that many hold every row's candidates, else the first `blocks`. If more than
`blocks` remain for a row (a flat distribution, a NaN), the step falls back to the whole
float32 product.

So the token is the float32 argmax, up to float32 rounding: the exact logits are summed in
another order than the whole product's, so two logits within a few ulps can order otherwise
(as between any two implementations). On the real 270M's greedy decoding from random prompts
(3 x 8 rows x 64 steps) the candidates fell in one block of 64 at the median, in more than 8
blocks for 1.0% of the rows' steps and more than 16 for 0.46%, nearly all the first new
token; a bound for each row instead of each block gave the same counts. Each row's error was
at most 16% of its own bound.

It pays where bfloat16 products are fast: a 2-core Xeon with AMX-BF16 multiplies the 270M's
table at batch 4 in 16.9 ms rounded against 45.7 ms in float32 (ad hoc, best of 10), and the
whole screen took 16.2 ms of a step (20.3 with a bound for each row and a top-k over the
blocks, 2.5 ms of it XLA:CPU's sort). The screen is held while generating: half the table's
bytes more.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.decode_kernels import matmul_rows, narrow_rows_t

BLOCK = 64  # vocabulary rows per block
BLOCKS = 16  # at most this many blocks recomputed in float32 per batch row ...
FEW = 2  # ... and only this many where they suffice for every row (most steps)


def fits(vocab: int, block: int = BLOCK, blocks: int = BLOCKS) -> bool:
    """Whether a vocabulary of `vocab` rows cuts into blocks the screen can use."""
    return vocab % block == 0 and vocab // block > 2 * blocks


def build(table, block: int = BLOCK):
    """table [V, H] float32 -> the screen: (the table rounded to bfloat16 [V, H], each block's
    largest rounded-row norm |w'| [V / block] float32)."""
    rounded = table.astype(jnp.bfloat16)
    norms = jnp.sqrt(jnp.sum(jnp.square(rounded.astype(jnp.float32)), axis=-1))
    return rounded, jnp.max(norms.reshape(-1, block), axis=-1)


def bounds(screen, x):
    """x [B, H] float32 -> (m, e) [B, V / block] float32: each block's largest rounded logit,
    and a bound on every rounded logit's error in the block, so the block's largest exact
    logit lies within e of m."""
    rounded, norm = screen  # norm [V / block]: each block's largest
    (v, h), b = rounded.shape, x.shape[0]
    xr = x.astype(jnp.bfloat16)
    a = narrow_rows_t(rounded, xr)  # [V, B or 2] float32: a bfloat16 result adds a rounding
    m = jnp.max(a.reshape(norm.shape[0], v // norm.shape[0], -1), axis=1)[:, :b].T
    gamma = 2 * h * 2.0 ** -24 / (1 - 2 * h * 2.0 ** -24)  # twice the textbook bound's length
    xw = xr.astype(jnp.float32)
    x_norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
    x_err = jnp.linalg.norm(x - xw, axis=-1, keepdims=True)
    xr_norm = jnp.linalg.norm(xw, axis=-1, keepdims=True)
    e = (x_norm * 2.0 ** -8 + x_err + gamma * xr_norm) * norm * (1 + 2.0 ** -10)
    return m, e + 2.0 ** -100 * (1 + x_norm) * (1 + norm)


def candidates(m, e, tie: float = 0.0, blocks: int = BLOCKS):
    """-> (how many blocks of each row can hold a logit within `tie` of its largest [B] (0
    where a row has NaN), the first `blocks` of them [B, blocks] in vocabulary order, the
    last repeated to fill)."""
    floor = jnp.max(m - e, axis=-1, keepdims=True) - tie  # no logit below this can be picked
    return _first(m + e >= floor, blocks)


def widest(count, blocks: int = BLOCKS):
    """count [B] from `candidates` -> the most candidate blocks a row has: blocks + 1 (more
    than the screen recomputes) where a row has none, which only NaN gives."""
    return jnp.max(jnp.where(count >= 1, count, blocks + 1))


def _first(mask, k: int):
    """mask [B, N] bool -> (how many hold [B], the first k indices that hold [B, k] in order,
    the last repeated where fewer hold; -1 where none does). A cumulative count places each
    index in its slot: XLA:CPU's top-k is a sort, 2.5 ms of [4, 4096] against 0.16."""
    b, n = mask.shape
    slot = jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1
    into = jnp.where(mask & (slot < k), slot, k)  # slot k: a bin for the rest
    ids = jnp.full((b, k + 1), -1, jnp.int32).at[jnp.arange(b)[:, None], into].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)))[:, :k]
    return slot[:, -1] + 1, jax.lax.cummax(ids, axis=1)


def greedy(table, screen, x, pick, tie: float, blocks: int = BLOCKS, few: int = FEW):
    """x [B, H] float32 -> pick(x @ table^T) [B] int32, reading the table only where the
    screen cannot rule a row out (see the module docstring).

    pick(logits [B, N]) -> [B] int32 indices into N: the sampler's rule, which must choose
    among the logits within `tie` of the largest (it may take any of those as a tie), the
    first in vocabulary order."""
    b = x.shape[0]
    v, h = table.shape
    block = v // screen[1].shape[0]
    count, ids = candidates(*bounds(screen, x), tie, blocks)
    worst = widest(count, blocks)

    def exact(k):
        def recompute():
            chosen = ids[:, :k]
            rows = table.reshape(v // block, block, h)[chosen]  # [B, k, block, H]
            logits = jnp.einsum("bkrh,bh->bkr", rows, x).reshape(b, k * block)
            j = pick(logits)  # a repeated block repeats a row after its first copy
            return (jnp.take_along_axis(chosen, (j // block)[:, None], axis=1)[:, 0] * block
                    + j % block).astype(jnp.int32)
        return recompute

    def whole():
        return pick(matmul_rows(table, x)).astype(jnp.int32)

    branch = (worst > few).astype(jnp.int32) + (worst > blocks).astype(jnp.int32)
    return jax.lax.switch(branch, [exact(few), exact(blocks), whole])
