"""XLA:CPU's own kernels for decoding, and the context that swaps them in.

models/kernels.py says how a kernel is chosen by platform and holds the training kernels,
models/cpu_forms.py the fast forms all of them are written in; the decoder's are here.
`jaxlm.decode` knows the devices it compiles for and traces its model calls inside
`decode_steps(platform)`, which on CPU swaps the decode step's products for the kernels below
(a Flax method interceptor: the layers keep their plain `__call__`) and elsewhere changes
nothing. Some of them multiply the block kernels in another layout, the step layout, built
once before the decode loop: state the decoder owns. The model's attention over its KV cache,
with the cache's update (`cached_attention`), is chosen by `kernels.by_platform`.
"""
from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import flax.linen as nn

from models import cpu_forms, layers, train_layout
from models.cpu_forms import batched_product, bits_take, product, row_major, transposed
from models.kernels import by_platform, narrow_by_platform

# The step layout (below) holds a second, transposed copy of the block kernels while a
# generate call runs; models whose block kernels exceed this decode with their stored layout.
STEP_LAYOUT_MAX_BYTES = 2 << 30
# ... and only batches this small use it, where a step streams the weights: Gemma 3 270M with
# vs without, float32, 48 new tokens: batch 8 11.4% faster, 16 7.1%, 40 (the demo's evaluation)
# 1.3% slower and its 400 MB held for nothing (`BENCH real_ab_layout`, bench/README.md).
STEP_LAYOUT_MAX_ROWS = 16


# --- One token per step -------------------------------------------------------------------------

def decode_steps(platform: str):
    """Context in which the decoder traces its model calls for `platform`'s devices.

    On CPU, every single-token product runs through a decode kernel:
      * with the `step_layout` collection mutable (to build it) or passed in, each Einsum
        multiplies its kernel's step layout, the same weights as an [out, in] row-major
        matrix, as rows @ x^T: XLA:CPU streams float32 ~15% faster than x @ [in, out], and a
        decode step of a small model is bound by that stream. Transposing costs a full read
        and write of the kernel, so the decoder builds the layout once per call (one step
        with the collection mutable) and passes it to every step (see `step_layout_pays`);
      * without it, the query/key/value projections are dots batched over heads, which read
        the [N, H, D] kernels in place instead of re-transposing them to [H, N*D] on every
        step of the loop (~6-9% of a decode step), and the other narrow kernels multiply
        as stored, in XLA:CPU's fast form (`_stored_product`);
      * the tied embedding's logits are rows @ x^T as well (the table is already [V, H]),
        ~1.5x faster than [B, H] @ [H, V] at batch 4;
      * a narrow table's lookup gathers its rows as bits (`cpu_forms.bits_take`): XLA:CPU
        widened the whole table to float32 for it, once per call, and kept it (the 270M:
        671 MB, ~160-200 ms a call).
    Together with a vectorised argmax and one dot for the attention output these took the
    bench config's decode step from 12.9 to ~8.4 ms: `python bench/generate.py`'s `BENCH
    decode_step_vs_weight_read` line (`jaxlm=` ms per step) and `BENCH generate_b4` (new
    tokens/s), 2026-11-30, bench/README.md. Elsewhere the layers run as written.
    """
    if platform != "cpu":
        return contextlib.nullcontext()
    return nn.intercept_methods(_cpu_decode_step)


def step_layout_pays(platform: str, block_bytes: int, rows: int, dtype="float32") -> bool:
    """Whether the decoder should build the step layout for a batch of `rows` in `dtype`: on
    CPU, for block kernels of at most STEP_LAYOUT_MAX_BYTES (the copy is held while
    generating) and at most STEP_LAYOUT_MAX_ROWS rows (a larger batch is not bound by the
    weight stream); on a CPU without AMX (`cpu_forms.amx`), in a narrow dtype for one row only,
    in float32 for two rows or more.

    Without AMX a narrow kernel multiplies several rows fastest as stored (`_stored_product`).
    The real Gemma 3 270M, bfloat16, 32 + 64 tokens, with the layout vs as stored (a 2-core AMD
    EPYC with AVX512-BF16, no AMX; interleaved, ad hoc): batch 2 49.8 vs 44.3 ms a step, batch
    4 51.1 vs 46.5, batch 8 54.7 vs 51.5, each call ~90 ms less to start; batch 1 23.1 vs
    45.4 ms, where the layout's rows are read by a vector-matrix loop. With AMX the layout
    wins at every batch (a 2-core Xeon, the same way, the whole call over 64 steps): batch 2
    31.6 vs 44.2 ms, 4 34.1 vs 44.4, 8 39.3 vs 50.3. In float32 the layout pays at batch 4 on
    both (48.8 vs 53.1 ms on the EPYC), but not for one row on the EPYC, whose one-row
    product is a vector-matrix loop either way: 64 new tokens 2494 vs 2427 ms (best of 6; the
    median 2820 vs 2688; in another pair of runs 41 vs 42-45 ms a step, 248-269 vs 121-140 ms
    before the first), and the layout's trace and copy are spared.
    Beyond the layout's rows, where the plain einsum widened the narrow kernels, batch 32 went
    from 111.7 to 90.8 ms a step (the EPYC)."""
    if platform != "cpu" or block_bytes > STEP_LAYOUT_MAX_BYTES:
        return False
    if cpu_forms.amx():
        return rows <= STEP_LAYOUT_MAX_ROWS
    return rows == 1 if jnp.dtype(dtype).itemsize < 4 else 2 <= rows <= STEP_LAYOUT_MAX_ROWS


_PER_HEAD = "BTH,NHD->BTND"  # the query/key/value projections


def _cpu_decode_step(next_fun, args, kwargs, context):
    """Flax method interceptor: single-token Einsum products and tied logits -> CPU kernels."""
    module = context.module
    if isinstance(module, layers.Einsum) and context.method_name == "__call__":
        bound = {**dict(zip(("eq", "x"), args)), **kwargs}
        eq, x = bound.get("eq"), bound.get("x")
        if x is not None and x.shape[1] == 1 and not module.is_initializing():
            if module.is_mutable_collection("step_layout") or module.has_variable("step_layout", "kernel"):
                return _step_product(module, next_fun(None), eq, x)
            if eq == _PER_HEAD:
                return _per_head(next_fun(None), x)
            if jnp.dtype(module.dtype).itemsize < 4 and _inputs_first(eq):
                return _stored_product(next_fun(None), eq, x)
    lookup = (isinstance(module, layers.Embedding) and context.method_name == "__call__"
              and not module.is_initializing())
    if lookup and jnp.dtype(module.embeddings.dtype).itemsize < 4:
        ids = args[0] if args else kwargs["ids"]
        return bits_take(module.embeddings, ids).astype(module.dtype)
    if isinstance(module, layers.Embedding) and context.method_name == "attend":
        x = args[0] if args else kwargs["x"]
        if x.shape[1] == 1:
            return matmul_rows(module.embeddings.astype(module.dtype), x[:, 0].astype(module.dtype))[:, None]
    return next_fun(*args, **kwargs)


def _step_product(module: layers.Einsum, kernel, eq: str, x):
    """x [B, 1, *in] -> [B, 1, *out] through the kernel's [out, in] rows (see decode_steps)."""
    in_axes, out_axes = train_layout.axes(eq)
    out_shape = [module.shape[i] for i in out_axes]
    rows = module.variable("step_layout", "kernel",
                           lambda: train_layout.matrix(kernel, out_axes, in_axes)).value
    b = x.shape[0]
    y = matmul_rows(rows, x.reshape(b, -1).astype(module.dtype))
    return y.reshape(b, 1, *out_shape)


def _inputs_first(eq: str) -> bool:
    """Whether the kernel of `eq` holds its contracted axes first: stored, it is then an
    [in, out] row-major matrix."""
    ins, _ = train_layout.axes(eq)
    return ins == list(range(len(ins)))


def _stored_product(kernel, eq: str, x):
    """x [B, 1, *in] -> [B, 1, *out] with a narrow kernel as stored, [in, out]: x @ kernel in
    XLA:CPU's fast form (row-major operands, a float32 result), where the plain einsum's
    narrow result would widen both operands (see `step_layout_pays` for when it is used)."""
    in_axes, out_axes = train_layout.axes(eq)
    b, size = x.shape[0], math.prod(kernel.shape[i] for i in in_axes)
    y = product(x.reshape(b, size).astype(kernel.dtype), kernel.reshape(size, -1))
    return y.reshape(b, 1, *(kernel.shape[i] for i in out_axes))


def _per_head(kernel, x):
    """x [B, 1, H], kernel [N, H, D] -> [B, 1, N, D] as a dot batched over the heads."""
    b, _, h = x.shape
    xb = jnp.broadcast_to(x[:, 0][None].astype(kernel.dtype), (kernel.shape[0], b, h))
    y = jnp.einsum("NBH,NHD->NBD", xb, kernel, preferred_element_type=jnp.float32)  # as matmul_rows
    return jnp.transpose(y.astype(kernel.dtype), (1, 0, 2))[:, None]


def matmul_rows(rows, x):
    """rows [O, I], x [B, I] -> x @ rows^T [B, O].

    Several rows are computed as rows @ x^T; the barrier stops XLA from folding the output
    transpose back into the dot (which would undo the layout). Narrow rows need x^T written
    out row-major and a float32 result, XLA:CPU's one fast bfloat16 form (models/cpu_forms.py).
    The 270M's bfloat16 tied table took 170 ms at batch 4 that way round, 13 ms this way
    (float32: 36 ms), on a 2-core AMX-BF16 Xeon.

    One row (B = 1) is a vector-matrix product, x[0] @ rows^T with a float32 result, which
    XLA:CPU writes as one loop that reads each row of `rows` once and multiplies it in place,
    in either dtype. The barrier ties the rows to x, which changes every step, so XLA does not
    hoist the conversion of the whole of `rows` out of the decode loop (and keep it) but
    converts each row as it reads it. The real Gemma 3 270M's bfloat16 tied table [262144,
    640]: 32.1 -> 12.5 ms, an FFN kernel [640, 2048] 0.37 -> 0.07 ms (float32: 26.8 -> 22.1
    ms, and equal on the block kernels); a 2-core AMD EPYC, measured ad hoc.

    On the 2-core Xeon with AMX (`cpu_forms.amx` tells the two hosts measured apart) that loop
    is the slow form: a narrow row goes in as two rows of the fast form (the table 18.0 ->
    12.9 ms; the 270M's bfloat16 batch-1 generate call, 32 + 64 tokens, 3.00 -> 1.92 s), and
    a float32 row as rows @ x^T, XLA's matrix-vector dot (in the float32 batch-1 call the
    loop read the table in ~36 ms a step and each block kernel in ~0.65 ms, the dot in ~25
    and ~0.30: 4.62 -> 3.30 s a call, 72 -> 52 ms a step; ad hoc, interleaved, best of 3).

    Several narrow rows without AMX are x @ rows^T with the rows in place
    (`cpu_forms.times_t`): the bfloat16 table at batch 2 / 4 / 8 18.7 / 21.4 / 23.9 ms
    against 28.5 / 27.4 / 30.4 as rows @ x^T (the EPYC, medians of 9, ad hoc); in float32
    that form was slower (38-51 against 24-29 ms)."""
    narrow = jnp.dtype(rows.dtype) != jnp.float32
    if x.shape[0] == 1 and not cpu_forms.amx():
        rows, x = jax.lax.optimization_barrier((rows, x))
        return jnp.dot(x[0], rows.T, preferred_element_type=jnp.float32)[None].astype(x.dtype)
    if not narrow:
        return jax.lax.optimization_barrier(rows @ x.T).T
    if not cpu_forms.amx():
        return cpu_forms.times_t(x, rows).astype(x.dtype)
    return narrow_rows(rows, x).astype(x.dtype)


def narrow_rows(rows, x):
    """Narrow rows [O, I], x [B, I] in their dtype -> x @ rows^T [B, O] in float32, as rows @
    x^T in XLA:CPU's fast form, one row going in as two (see `matmul_rows`)."""
    return jax.lax.optimization_barrier(narrow_rows_t(rows, x)).T[:x.shape[0]]


def narrow_rows_t(rows, x):
    """Narrow rows [O, I], x [B, I] -> rows @ x^T [O, max(B, 2)] in float32, XLA:CPU's fast
    form: one row goes in twice, so its result has two equal columns."""
    xs = jnp.concatenate([x, x]) if x.shape[0] == 1 else x
    return jnp.dot(rows, row_major(xs.T), preferred_element_type=jnp.float32)


# --- Attention over the KV cache ----------------------------------------------------------------

def cached_attention(q, k, v, cache, index, mask, soft_cap: float | None):
    """Decoding attention (prefill and every step): the new keys/values k/v [B, T, K, D] go
    into the cache ({"k", "v": [B, S, K, D]}) at slot `index`, and q [B, T, N, D] attends over
    all S slots with mask [B, T, S], as `layers.grouped_attention` without `causal`.
    -> ([B, T, N, D], the new cache).

    In a bfloat16 program for CPU its core is `_cpu_cache_core`; a float32 step (T = 1) for CPU
    is `_cpu_step_attention`."""
    k, v = k.astype(cache["k"].dtype), v.astype(cache["v"].dtype)
    plain = functools.partial(_write_then_attend, soft_cap=soft_cap)
    if q.shape[1] == 1 and jnp.dtype(q.dtype) == jnp.float32:
        def cpu_step_attention(*args):
            return _cpu_step_attention(*args, soft_cap=soft_cap)
        return by_platform(q, k, v, cache, index, mask, cpu=cpu_step_attention, plain=plain)
    return plain(q, k, v, cache, index, mask)


def _write_then_attend(q, k, v, cache, index, mask, soft_cap):
    """`cached_attention` as written: update the cache, then attend over it."""
    cache = {"k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k, index, axis=1),
             "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v, index, axis=1)}
    plain = functools.partial(layers.grouped_attention, soft_cap=soft_cap)

    def cpu_cache_attention(q, k, v, mask):
        return plain(q, k, v, mask, core=_cpu_cache_core)
    out = narrow_by_platform(q, cache["k"], cache["v"], mask, cpu=cpu_cache_attention, plain=plain)
    return out, cache


def _cpu_step_attention(q, k, v, cache, index, mask, soft_cap):
    """`cached_attention` of one new token (T = 1) in float32: attend over the old cache with
    slot `index` masked out and over the new key apart, then write the new key/value in.

    Written the plain way, XLA:CPU copied every layer's key and value cache four times a
    step: it fused the update into both of its readers (the attention's product and the
    loop's carry), each an in-place update of its own copy. Attending over the old cache
    leaves the update one reader, and adding a zero from the output (x + 0 = x) makes the
    write wait for the reads, so it updates the loop's buffer in place; an optimization
    barrier does not order it. A row whose output is not finite gets NaN in its own new
    slot only. The real Gemma 3 270M, float32, batch 4, 64 new tokens: the copies took ~6
    ms of a ~58 ms step; greedy generation 3716 -> 3541 ms (best of 10, interleaved, ad hoc;
    median 3918 -> 3703). bfloat16 keeps `_cpu_cache_core`, whose program had no such copies.
    """
    b, _, n, d = q.shape
    s, kv = cache["k"].shape[1], cache["k"].shape[2]
    g = n // kv
    q = q.reshape(b, kv, g, d)  # T = 1: the rows of KV head j are its G query heads
    heads = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, S, K, D] -> [B, K, S, D]
    batch = ((0, 1), (0, 1))
    logits = jnp.concatenate(  # [B, K, G, S + 1]: the old slots, then the new key
        [jax.lax.dot_general(q, heads(x), (((3,), (3,)), batch)) for x in (cache["k"], k)], -1)
    old = mask[:, 0] & (jnp.arange(s) != index)  # [B, S]
    m = jnp.concatenate([old, jax.lax.dynamic_slice_in_dim(mask[:, 0], index, 1, axis=1)], -1)
    probs = layers.masked_softmax(logits, m[:, None, None], soft_cap)
    out = sum(jax.lax.dot_general(p, heads(x), (((3,), (2,)), batch))  # [B, K, G, D]
              for p, x in ((probs[..., :s], cache["v"]), (probs[..., s:], v)))
    out = jnp.where(jnp.any(mask, axis=-1)[:, :, None, None], out.reshape(b, 1, n, d), 0)
    z = out[:, :, :1, :1] * 0  # [B, 1, 1, 1], data the write must wait for
    cache = {"k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k + z, index, axis=1),
             "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v + z, index, axis=1)}
    return out, cache


def _cpu_cache_core(q, k, v, m, soft_cap):
    """`layers.softmax_attention` (forward) with the cache multiplied as it lies: logits^T =
    k @ q^T [B, K, S, R] and out = probs @ v, so only q and the probabilities, R rows each,
    are written transposed, and both products take bfloat16 operands and return float32
    (XLA:CPU's fast form, models/cpu_forms.py). The plain core's q @ k^T widens the
    whole cache to float32 in every layer of every step: on the real Gemma 3 270M at batch 4
    that conversion and the float32 products took ~210 us of a ~1 ms layer step (a profile;
    `BENCH real_bf16_decode_b4`, bench/README.md)."""
    if q.shape[2] == 1:  # one query row would make both products matrix-vector: not the form
        twice = lambda x: jnp.concatenate([x, x], axis=2)  # noqa: E731
        return _cpu_cache_core(twice(q), k, v, twice(m), soft_cap)[:, :, :1]
    if k.shape[1] > 1:  # [B, S, K, D] read as [B, K, S, D] is then a transpose: write it out
        k, v = row_major(k), row_major(v)
    logits = batched_product(k, transposed(q))  # [B, K, S, R]
    probs = layers.masked_softmax(logits, jnp.swapaxes(m, -1, -2), soft_cap, axis=-2)
    return batched_product(transposed(probs.astype(q.dtype)), v).astype(q.dtype)
