"""One chunk's logits block [B, C, V] in the chunked loss (jaxlm/train/loss.py): the projection
onto the tied table, the block's sums (cross-entropy, argmax hits, logsumexp) and its gradient
dCE/dlogits. The block lives for one chunk, but every pass over it reads [B, C, V] floats
(Gemma 3 on CPU: 256 x 262144 a chunk, the step's largest passes after its products), so these
functions are written for as few passes as XLA:CPU can make of them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models import cpu_forms, kernels


def project(h_c, emb, columns, cap):
    """-> (float32 product [B, C, V], view, its max over V [B, C, 1] where that comes cheaper
    than from the logits, else None). view(x) -> (float32 logits after the cap, tanh(logits /
    cap) or None) acts on each logit alone, so a gather of the product can be viewed without
    the logits block."""
    b, c, h = h_c.shape
    flat = h_c.reshape(b * c, h)
    if columns is None:
        return kernels.tied_logits(flat, emb).reshape(b, c, -1), lambda x: capped(x, cap), None
    product = jnp.dot(flat, columns, preferred_element_type=jnp.float32).reshape(b, c, -1)
    # Rounded to the compute dtype, as the product above. Rounding is monotone, so the rounded
    # block's max is the rounded max of the float32 product: taken from it, XLA:CPU reduces the
    # product as it is, not a float32 copy widened back from the rounded block (a pass over the
    # block less per chunk; the real Gemma 3 270M's bfloat16 LoRA step at 8 x 128 tokens ~2670
    # -> ~2590 ms, an A/B, ad hoc). Under the cap the max is taken after it, from the capped logits.
    top = None if cap is not None else rounded(jnp.max(product, axis=-1, keepdims=True), h_c.dtype)
    return product, viewer(h_c.dtype, cap), top


def viewer(dtype, cap):
    """-> view(x) -> (logits, tanh(logits / cap) or None): a float32 product's logits as the
    model gives them, rounded to the compute `dtype`, then capped."""
    return lambda x: capped(rounded(x, dtype), cap)


def rounded(x, dtype):
    """float32 x rounded to `dtype`, as float32."""
    return x.astype(dtype).astype(jnp.float32)


def capped(logits, cap):
    """-> (logits after the cap, tanh(logits / cap) or None)."""
    if cap is None:
        return logits, None
    th = jnp.tanh(logits / cap)
    return th * cap, th


def sums(logits, y_c, w_c, axis=-1, top=None, target=None):
    """-> (weighted CE sum, weighted argmax hits, logsumexp) of float32 logits [B, C, V] (or
    any layout with the vocabulary on `axis`; y_c, w_c and the logsumexp lack that axis).
    top: the logits' max over `axis` (kept, size 1) and target: the target logits (y_c's
    shape), if the caller has them.

    After the max, one variadic reduction over the last axis takes both the sum of
    exp(logits - max) and the first index reaching the max (`jnp.argmax`'s tie rule; a NaN
    row gives its last index): one read of the block instead of two, and XLA:CPU's plain loop
    beats its YNNPACK sum (the bench-config loss: 25 ms less per step, bench/README.md). Over
    a leading axis that loop walks columns, and two reductions are ~6x faster ([262144, 256]
    float32 logits: ~395 -> ~67 ms, ad hoc).
    """
    axis = axis % logits.ndim
    top = jnp.max(logits, axis=axis, keepdims=True) if top is None else top
    shift = jnp.where(jnp.isfinite(top), top, 0.0)  # as jax.nn.logsumexp: an all -inf row is -inf
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, axis)
    last = logits.shape[axis] - 1
    exp, at_top = jnp.exp(logits - shift), jnp.where(logits == top, index, last)
    if axis == logits.ndim - 1:
        total, first = jax.lax.reduce((exp, at_top), (jnp.float32(0), jnp.int32(last)),
                                      lambda a, b: (a[0] + b[0], jnp.minimum(a[1], b[1])), (axis,))
    else:
        total, first = jnp.sum(exp, axis=axis), jnp.min(at_top, axis=axis)
    lse = jnp.log(total) + jnp.squeeze(shift, axis)
    if target is None:
        target = jnp.squeeze(jnp.take_along_axis(logits, jnp.expand_dims(y_c, axis), axis=axis), axis)
    hit = (first == y_c).astype(jnp.float32) * w_c
    return ((lse - target) * w_c).sum(), hit.sum(), lse


def logit_gradient(logits, lse, y_c, w_c, th, axis=-1, onehot=True):
    """dCE/dlogits = (softmax - onehot) * weight (* tanh' under the cap), float32, the
    vocabulary on `axis` of logits (and th); lse, y_c, w_c lack it. onehot=False leaves out
    the target's term (`target_term`)."""
    axis = axis % logits.ndim
    d = jnp.exp(logits - jnp.expand_dims(lse, axis))
    if onehot:
        index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, axis)
        d = d - (index == jnp.expand_dims(y_c, axis))
    d = d * jnp.expand_dims(w_c, axis)
    return d if th is None else d * (1.0 - th * th)


def target_term(l_y, th_y, lse, w_c, emb, y_c, dtype):
    """-> float32 [B, C, H]: what the target's one-hot term adds to d_hidden, for a d computed
    without it (`logit_gradient(onehot=False)`, rounded to `dtype`): the difference of the
    target's d with and without the term, each rounded as the block is, times emb[target].
    l_y, th_y: the target's logit and tanh(logit / cap) (or None), [B, C, 1].

    The [B, C, V] pass without the term is a compare less per logit: on XLA:CPU the real
    Gemma 3 270M's bfloat16 LoRA step at 8 x 128 tokens ~2580 -> ~2510 ms (an A/B, ad hoc,
    bench/README.md). Adding back the rounded difference, rather than w * emb[target] alone,
    keeps d_hidden as the one-hot block gives it: for a confident target (p near 1), p * w
    rounded to bfloat16 is off by more than the whole p - 1."""
    first = jnp.zeros_like(y_c)
    d_y = [rounded(logit_gradient(l_y, lse, first, w_c, th_y, onehot=onehot), dtype)
           for onehot in (True, False)]
    # the rows as bits: XLA:CPU would widen a narrow table whole for the gather
    return (d_y[0] - d_y[1]) * cpu_forms.bits_take(emb, y_c).astype(jnp.float32)
