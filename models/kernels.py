"""XLA:CPU's own kernels for parts of the model's math, and the one place that picks them.

models/gemma.py and models/layers.py write every computation once, as the math. A few of them
run markedly faster on XLA:CPU written another way; those versions live here (the FFN's in
models/ffn_kernels.py), each with the bench measurement that justifies it, and each is checked
against the plain math in tests/test_kernels.py (the projections in
tests/test_projection_kernel.py). On TPU and GPU the plain math runs.

How the platform is chosen:
  * Training (`project`, `causal_attention`, the loss's `tied_logits` and
    `tied_hidden_gradient`, and models/ffn_kernels.py's `gated_ffn` and `geglu`) and
    the decoder's attention over its KV cache (models/decode_kernels.py) go through
    `by_platform`, i.e. `jax.lax.platform_dependent`: both versions are traced and the one for
    the platform the program is *lowered* for is kept, so a step compiled on a CPU host for a
    TPU slice (`jaxlm.train.aot`) gets the plain math. The attention kernels and projections
    gain only in a narrow dtype and take `narrow_by_platform`, which runs float32 as the
    plain math everywhere.
  * Decoding swaps some products inside a context the decoder enters for its platform
    (`decode_kernels.decode_steps`), some of them in a layout built once before the decode
    loop: state the decoder owns.
  * A bfloat16 LoRA step on CPU multiplies its frozen weights through the train layout
    (models/train_layout.py): a second copy of them, in the one form XLA:CPU multiplies
    bfloat16 fast, that the trainer builds when it trains on CPU (state, as the decoder's).

The kernels are written in XLA:CPU's fast forms (models/cpu_forms.py).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from models import layers, train_layout
from models.cpu_forms import (batched_product, bits_slice, loop_slice, product, row_major,
                              row_major_t, times_t, transposed)


def by_platform(*args, cpu, plain):
    """`cpu(*args)` in a program lowered for CPU, `plain(*args)` for any other platform. The
    CPU version's ops are named `cpu_kernel/<its name>` (in profiles and lowered text)."""
    return jax.lax.platform_dependent(
        *args, cpu=jax.named_scope(f"cpu_kernel/{cpu.__name__}")(cpu), default=plain)


def narrow_by_platform(*args, cpu, plain):
    """`by_platform` for a kernel that pays only in a narrow dtype (its products in XLA:CPU's
    fast bfloat16 form): with float32 arguments, whose products gain nothing from it, `plain`
    runs on every platform."""
    if jnp.dtype(args[0].dtype) == jnp.float32:
        return plain(*args)
    return by_platform(*args, cpu=cpu, plain=plain)


# --- Training: narrow weights a slice at a time ----------------------------------------------

# XLA:CPU widens a bfloat16 weight to float32 for most products, and hoists the widened copy
# of a whole weight out of loops and shares it between the forward and backward passes, so it
# lives for the whole step (Gemma 2B: 54 x 128 MiB for the FFN kernels, 3 x 1.95 GiB for the
# tied embedding). A narrow weight is therefore multiplied a slice at a time, inside a loop;
# a widened slice of at most this many bytes lives for one product. Justified by `python
# bench/memory.py --platform=cpu --dtype=bfloat16`'s `BENCH memory_cpu_gemma_2b_en_lora_unrolled`
# line (temp_gib 13.56 -> 1.70; the whole 2B LoRA step 16.5 -> 7.6 GiB peak RSS, 2026-12-01,
# bench/README.md). Float32 weights take one slice: the products as before.
SLICE_BYTES = 32 << 20


def slices(rows: int, cols: int, dtype) -> int:
    """How many slices of `cols` a [rows, cols] weight is multiplied in: 1 for float32; else
    the fewest that divide `cols` and keep a float32 [rows, cols / n] within SLICE_BYTES."""
    if jnp.dtype(dtype) == jnp.float32:
        return 1
    return fewest_parts(cols, -(-4 * rows * cols // SLICE_BYTES))


def fewest_parts(total: int, at_least: int) -> int:
    """The smallest n >= max(at_least, 1) that divides `total` (none above it: an error)."""
    return next(n for n in range(max(1, at_least), total + 1) if total % n == 0)


# --- Training: the tied embedding's logits ---------------------------------------------------

def tied_logits(h, emb):
    """h [N, H] @ emb [V, H]^T -> float32 logits [N, V], computed in h's dtype (as the model's
    `Embedding.attend`); on CPU a narrow table goes a slice of V at a time (`slices`)."""
    return by_platform(h, emb, cpu=_cpu_tied_logits, plain=_tied_logits)


def _tied_logits(h, emb):
    return jnp.einsum("NH,VH->NV", h, emb).astype(jnp.float32)


def _cpu_tied_logits(h, emb):
    v, n = emb.shape[0], slices(emb.shape[1], emb.shape[0], emb.dtype)
    if n == 1:
        return _tied_logits(h, emb)
    size = v // n

    def body(logits, i):
        part = jnp.dot(h, bits_slice(emb, i, size, 0).T, preferred_element_type=jnp.float32)
        part = part.astype(h.dtype).astype(jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(logits, part, i * size, 1), None
    return jax.lax.scan(body, jnp.zeros((h.shape[0], v), jnp.float32), jnp.arange(n))[0]


# Float32 table rows a slice of the hidden gradient's product; a narrower table takes as many
# bytes (bfloat16: 2048 rows). The real Gemma 3 270M's bfloat16 LoRA step at 8 x 128 tokens on
# a 2-core AMX Xeon: 2048-row slices ~5% faster than 1024 (fewer adds; an A/B, ad hoc,
# bench/README.md); its float32 step the same within noise at 1024, 2048 and 4096.
HIDDEN_GRADIENT_ROWS = 1024


def tied_hidden_gradient(d, emb):
    """d [N, V] @ emb [V, H] -> float32 [N, H]: the gradient of `tied_logits` with respect to
    h, from d = dLoss/dlogits in h's dtype; on CPU the contraction over V runs as a loop over
    slices of at most HIDDEN_GRADIENT_ROWS float32 rows' bytes of the table, summed in float32,
    in a one-device program (`layers.traced_devices`). On more than one device a layout may split
    the table over its vocabulary (the megatron table does), where a slice of it would gather
    the whole table: there it is multiplied whole.

    Whole, XLA:CPU ran Gemma 3's K = 262144 at ~65% of its float32 peak, in 1024-row slices
    near it. One loss chunk, [256, 262144] @ [262144, 640], on a 2-core AMD EPYC (ad hoc):
    float32 619 -> 434 ms, bfloat16 265 -> 226 ms; the float32 LoRA step at 8 x 128 7666 ->
    6900 ms (`BENCH real_ab_hidden`, `python bench/real_step_ab.py --what=hidden`). A frozen
    table's loss on one CPU device takes neither (jaxlm/train/online_softmax.py)."""
    return by_platform(d, emb, cpu=_cpu_tied_hidden_gradient, plain=_tied_hidden_gradient)


def _tied_hidden_gradient(d, emb):
    return jnp.dot(d, emb, preferred_element_type=jnp.float32)


def _cpu_tied_hidden_gradient(d, emb):
    v, rows = emb.shape[0], HIDDEN_GRADIENT_ROWS * 4 // jnp.dtype(emb.dtype).itemsize
    n = fewest_parts(v, -(-v // rows))
    size = v // n
    if n == 1 or 4 * size < rows or layers.traced_devices() > 1:  # one slice, no fit
        return _tied_hidden_gradient(d, emb)
    def body(i, total):
        return total + jnp.dot(loop_slice(d, i, size, 1), loop_slice(emb, i, size, 0),
                               preferred_element_type=jnp.float32)
    return jax.lax.fori_loop(0, n, body, jnp.zeros((d.shape[0], emb.shape[1]), jnp.float32))


# --- Training: the attention projections ----------------------------------------------------

def project(layer: layers.Einsum, eq: str, x):
    """`layer(eq, x)` for an attention projection (x [B, T, ...] with its contracted axes last,
    as `train_layout.axes` reads them). A decode step (T = 1) and a step through the train
    layout (or with LoRA factors beside it) go through the layer, whose interceptors replace
    the product; otherwise a bfloat16 program for CPU multiplies with `_cpu_projection`."""
    kernel = layer(None)
    if x.shape[1] == 1 or train_layout.intercepts(layer):
        return layer(eq, x)

    def cpu_projection(x, kernel):
        return cpu_project(eq, x, kernel)
    return narrow_by_platform(x.astype(kernel.dtype), kernel, cpu=cpu_projection,
                              plain=functools.partial(jnp.einsum, eq))


def cpu_project(eq: str, x, kernel):
    """`jnp.einsum(eq, x, kernel)` as `_cpu_projection` of the flattened tokens."""
    ins, outs = train_layout.axes(eq)
    flat = x.reshape(-1, math.prod(kernel.shape[i] for i in ins))
    y = _cpu_projection(flat, kernel, tuple(ins), tuple(outs))
    return y.reshape(*x.shape[:-len(ins)], *(kernel.shape[i] for i in outs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cpu_projection(x, kernel, ins, outs):
    """x [M, I] @ kernel read as an [I, O] matrix (its axes `ins`, then `outs`) -> [M, O]: the
    forward and both backward products in XLA:CPU's fast bfloat16 form (`cpu_forms.product`).
    With autodiff's einsums XLA:CPU multiplied the [N, H, D] kernels and the transposed
    activations of the weight gradients in float32; here the kernel is written out as the
    matrix each product needs (small next to the activations), as is x^T. The real Gemma 3 270M's
    bfloat16 full fine-tune step at 8 x 128 tokens: its q/k/v/o products ~0.72 -> ~0.23 s, the
    step ~6.0 -> ~5.4 s (a profile and an A/B, ad hoc; the bench line is `BENCH
    real_bf16_train_full_t128`, bench/README.md). With the kernel frozen, the backward is d_x
    alone."""
    return product(x, _matrix(kernel, ins, outs))


def _matrix(kernel, rows, cols):
    """kernel as a row-major [prod rows, prod cols] matrix (`train_layout.matrix`)."""
    m = train_layout.matrix(kernel, list(rows), list(cols))
    return m if list(rows + cols) == sorted(rows + cols) else row_major(m)


def _cpu_projection_fwd(x, kernel, ins, outs):
    trained = kernel.perturbed
    x, kernel = x.value, kernel.value
    return _cpu_projection(x, kernel, ins, outs), (x if trained else None, kernel)


def _cpu_projection_bwd(ins, outs, residuals, d_y):
    x, kernel = residuals
    if isinstance(d_y, SymbolicZero):
        return None, None
    d_y = d_y.astype(kernel.dtype)
    d_x = times_t(d_y, _matrix(kernel, ins, outs)).astype(kernel.dtype)  # W^T in place without AMX
    if x is None:
        return d_x, None
    d_w = product(row_major_t(x), d_y).reshape(*(kernel.shape[i] for i in ins + outs))
    order = ins + outs
    return d_x, jnp.transpose(d_w, sorted(range(len(order)), key=order.__getitem__))


_cpu_projection.defvjp(_cpu_projection_fwd, _cpu_projection_bwd, symbolic_zeros=True)


# --- Training: causal attention in bfloat16 --------------------------------------------------

# Query rows per block for `_cpu_softmax_attention` (layers.QUERY_BLOCK elsewhere): its
# per-block products are fast enough that fewer, larger blocks pay (at 2 x 512 tokens, the real
# 270M's attention forward + backward: 64 rows 348 ms, 128 237, 256 192, one block 220;
# measured ad hoc, bench/README.md).
CPU_QUERY_BLOCK = 256


def causal_attention(q, k, v, mask, soft_cap: float | None, window: int | None):
    """Training attention (no cache), `layers.grouped_attention(..., causal=True)`: q [B, T, N,
    D], k/v [B, T, K, D], mask [B, T, T] -> [B, T, N, D]. In a bfloat16 program for CPU its
    softmax core is `_cpu_softmax_attention`."""
    plain = functools.partial(layers.grouped_attention, soft_cap=soft_cap, causal=True, window=window)

    def cpu_attention(q, k, v, mask):
        return plain(q, k, v, mask, block=CPU_QUERY_BLOCK, core=_cpu_softmax_attention)
    return narrow_by_platform(q, k, v, mask, cpu=cpu_attention, plain=plain)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cpu_softmax_attention(q, k, v, m, soft_cap):
    """`layers.softmax_attention` with all six products, forward and backward, in the one form
    XLA:CPU multiplies bfloat16 fast ([N, K] @ [K, M], a float32 result; models/train_layout.py).

    Autodiff's backward multiplies by the transposes of v, the probabilities and their
    gradient, and the forward by k's; XLA's layout assignment makes each transpose a
    column-major operand, which XLA:CPU multiplies in float32 at a quarter of the speed. Here
    each is written out row-major (`transposed`, and with more than one KV head also q, k, v
    and the output gradient: `row_major`), and every product returns float32. The
    real Gemma 3 270M's bfloat16 LoRA step (train layout on): 2924 -> 2547 ms at 2 x 512
    tokens, 2449 -> 2387 ms at 8 x 128 (`python bench/real_step_ab.py --what=attention`'s
    `BENCH real_ab_attention` line, bench/README.md). The softmax and its backward stay float32.
    """
    return _attention_forward(q, k, v, m, soft_cap)[0]


def _attention_forward(q, k, v, m, soft_cap):
    q, k, v = row_major(q), row_major(k), row_major(v)  # with K > 1 they come transposed
    logits = batched_product(q, transposed(k))  # [B, K, R, S]
    capped = None
    if soft_cap is not None:
        capped = jnp.tanh(logits / soft_cap)
        logits = capped * soft_cap
    probs = jax.nn.softmax(jnp.where(m, logits, -1e9), axis=-1)
    out = batched_product(probs.astype(q.dtype), v).astype(q.dtype)
    return out, (q, k, v, probs, capped)


def _attention_backward(soft_cap, residuals, d_out):
    q, k, v, probs, capped = residuals
    d_out = row_major(d_out.astype(q.dtype))
    d_v = batched_product(transposed(probs.astype(q.dtype)), d_out)
    d_probs = batched_product(d_out, transposed(v))
    d_logits = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True))
    if capped is not None:
        d_logits = d_logits * (1 - capped * capped)
    d_logits = d_logits.astype(q.dtype)
    d_q = batched_product(d_logits, k)
    d_k = batched_product(transposed(d_logits), q)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


_cpu_softmax_attention.defvjp(_attention_forward, _attention_backward)
