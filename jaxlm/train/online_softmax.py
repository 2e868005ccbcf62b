"""The chunked loss on XLA:CPU a vocabulary slice at a time: a frozen tied table's loss and
d_hidden in one pass (`loss`), a trained table's with its gradient in two (`trained_loss`).

Under LoRA the table takes no gradient, so a chunk's loss needs of its logits only their
logsumexp, their argmax, the target's logit and d_hidden = softmax @ table - table[target]
(times the weight). All four can be taken in one pass over the vocabulary, as flash
attention takes its output: per slice of columns, the slice's logits [N, S] are made from
the table, their exponentials are taken against the running max and summed, and multiplied
back by the same slice of the table into a [N, H] sum; when the max grows, both sums are
rescaled. At the end, d_hidden is that sum over the total. No [N, V] block is written at
all: each slice's logits are used while they are in cache, where the token-major chunk
(`loss._token_major`) writes a float32 [N, V] product and a [N, V] d, and reads them back.

With no block to bound, a chunk can be longer: `ONLINE_TOKENS` tokens, regrouped from the
loss's chunks. The real Gemma 3 270M's bfloat16 LoRA step on a 2-core AMX Xeon, one device,
through the train layout: 8 x 128 tokens 2170 -> 1691 ms (median), temporaries 0.99 -> 0.64
GiB (`python bench/real_step_ab.py --what=online --batch=8 --seq=128 --dtype=bfloat16`, its
`BENCH real_ab_online` line; bench/README.md). The loss's value alone (no gradient) is taken
the same way, without the second product.

A one-device program only: a layout that splits the table (the megatron table splits its
vocabulary) would gather a slice's worth of it per product.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.train import logit_block
from models import cpu_forms, kernels

# Table rows a slice (at most; the fewest slices that split V evenly): a slice's float32
# logits for a 1024-token chunk are 8 MiB. The 270M's loss and d_hidden of 1024 tokens alone
# ran the same at 1024, 2048 and 4096 (random data, ad hoc).
COLUMNS = 2048

# Tokens a chunk: longer chunks multiply longer products. The same loss: one chunk of 1024
# ~0.83 s, two of 512 ~0.84 s, four of 256 ~1.03 s; token-major in four ~1.3 s (ad hoc).
ONLINE_TOKENS = 1024


def loss(h, emb, columns, y, w, live, cap, gradient=True):
    """h [n, B, C, H], emb [V, H], columns [H, V] or None, y/w [n, B, C], live int32 [] ->
    (loss, hits[, d_h [n, B, C, H] if `gradient`]) over the first `live` chunks, taken in
    chunks of up to ONLINE_TOKENS tokens (k consecutive chunks of the loss joined along C)."""
    n, b, c, hidden = h.shape
    k = _joined(n, b * c)
    h_k, y_k, w_k = (_join(a, k) for a in (h, y, w))

    def body(i, carry):
        loss, hits, d_h = carry
        ce, hit, d_h_c = chunk(h_k[i], emb, columns, y_k[i], w_k[i], cap, gradient)
        return loss + ce, hits + hit, None if d_h is None else d_h.at[i].set(d_h_c.astype(d_h.dtype))
    zero = jnp.zeros((), jnp.float32)
    loss, hits, d_h = jax.lax.fori_loop(0, -(-live // k), body, (
        zero, zero, jnp.zeros_like(h_k) if gradient else None))
    if not gradient:
        return loss, hits
    return loss, hits, _unjoin(d_h, k)


def _joined(n: int, tokens: int) -> int:
    """How many of n chunks of `tokens` tokens to join: the most that divide n and hold at most
    ONLINE_TOKENS tokens together (at least 1)."""
    return max(j for j in range(1, n + 1) if n % j == 0 and (j == 1 or j * tokens <= ONLINE_TOKENS))


def _join(x, k: int):
    """[n, B, C, ...] -> [n / k, B, k * C, ...]: k consecutive chunks joined along C."""
    n, b, c = x.shape[:3]
    x = jnp.swapaxes(x.reshape(n // k, k, b, c, *x.shape[3:]), 1, 2)
    return x.reshape(n // k, b, k * c, *x.shape[4:])


def _unjoin(x, k: int):
    """`_join`'s inverse."""
    (m, b, kc), rest = x.shape[:3], x.shape[3:]
    x = jnp.swapaxes(x.reshape(m, b, k, kc // k, *rest), 1, 2)
    return x.reshape(m * k, b, kc // k, *rest)


def chunk(h_c, emb, columns, y_c, w_c, cap, gradient=True):
    """One chunk: h_c [B, C, H] -> (weighted CE sum, weighted argmax hits, float32 d_h_c
    [B, C, H] or None), as `logit_block.sums` and the one-hot block's d_hidden give them."""
    b, c, hidden = h_c.shape
    x, y, w = h_c.reshape(b * c, hidden), y_c.reshape(-1), w_c.reshape(-1)
    view = logit_block.viewer(h_c.dtype, cap)
    lse, first, p_y, total = softmax_sums(x, emb, columns, y, w, view, gradient)
    l_y, th_y = view(p_y)
    ce = ((lse - l_y) * w).sum()
    hits = ((first == y).astype(jnp.float32) * w).sum()
    if not gradient:
        return ce, hits, None
    # The target's term exactly as the one-hot block has it: (p - 1) * w, rounded.
    d_y = logit_block.rounded(logit_block.logit_gradient(
        l_y[:, None], lse, jnp.zeros_like(y), w, None if th_y is None else th_y[:, None]), h_c.dtype)
    d_h = total + d_y * cpu_forms.bits_take(emb, y).astype(jnp.float32)
    return ce, hits, d_h.reshape(b, c, hidden)


def softmax_sums(x, emb, columns, y, w, view, gradient=True):
    """x [N, H] -> (logsumexp [N], first argmax [N] int32, the target's product [N],
    float32 [N, H] sum over v != y of d_v * emb[v] if `gradient`, else None), of the logits
    view(x @ emb^T); d_v = softmax_v * w (* tanh' under the cap), rounded to x's dtype before
    its product, as the block's d is (here against the running max, then scaled: the same
    relative rounding). `view` (`logit_block.viewer`) must be monotone, so that a slice's max
    logit is the view of its max product.

    The argmax is the first index whose exponential against the running max is 1, which
    saves a pass over the slice (a compare of the rounded logits, which XLA then writes out):
    exactly the first index of the max logit, except among logits a few float32 ulps of 1
    apart in exp, which needs the max and another logit both below ~2**-17 in magnitude (no
    trained model's). COLUMNS: 1024 and 4096 ran as 2048 (the loss alone, ad hoc).
    """
    v, hidden = emb.shape
    parts, rows = _slices(emb)
    size = v // parts

    def logits_of(i, part):  # x @ part^T [N, size], in the form XLA:CPU multiplies fast
        if columns is not None:
            return jnp.dot(x, cpu_forms.bits_slice(columns, i, size, 1), preferred_element_type=jnp.float32)
        return cpu_forms.times_t(x, part)

    def body(i, carry):
        m, z, first, p_y, total = carry
        part = rows(i)
        p = logits_of(i, part)
        top = view(jnp.max(p, axis=1))[0]
        m_new = jnp.maximum(m, top)
        scale = jnp.exp(m - m_new)
        logits, th = view(p)
        e = jnp.exp(logits - m_new[:, None])
        index = jax.lax.broadcasted_iota(jnp.int32, p.shape, 1)
        local = y - i * size  # the target's column in this slice, if it is in it
        last = jnp.int32(size - 1)
        s, at = jax.lax.reduce((e, jnp.where(e == 1.0, index, last)), (jnp.float32(0), last),
                               lambda a, b: (a[0] + b[0], jnp.minimum(a[1], b[1])), (1,))
        # gathered, not a third output of the reduction: with the exp fused in (no gradient),
        # XLA:CPU ran that one ~2.5x slower (the 270M's 1024 tokens: 1136 vs 452 ms)
        p_t = jnp.take_along_axis(p, jnp.clip(local, 0, last)[:, None], axis=1)[:, 0]
        p_t = jnp.where((local >= 0) & (local <= last), p_t, 0.0)
        target = index == local[:, None]
        if gradient:
            d = e * w[:, None] if th is None else e * w[:, None] * (1.0 - th * th)
            d = jnp.where(target, 0.0, d).astype(x.dtype)
            total = total * scale[:, None] + jnp.dot(d, part, preferred_element_type=jnp.float32)
        first = jnp.where(top > m, i * size + at, first)  # a tie keeps the earlier slice's
        return m_new, z * scale + s, first, p_y + p_t, total

    n = x.shape[0]
    zeros = jnp.zeros((n,), jnp.float32)
    m, z, first, p_y, total = jax.lax.fori_loop(0, parts, body, (
        jnp.full((n,), -jnp.inf, jnp.float32), zeros, jnp.zeros((n,), jnp.int32), zeros,
        jnp.zeros((n, hidden), jnp.float32) if gradient else None))
    lse = jnp.log(z) + m
    return lse, first, p_y, None if total is None else total * jnp.exp(m - lse)[:, None]


def _slices(emb):
    """-> (the number of slices of the table's rows, rows(i) -> slice i [V / parts, H]): the
    fewest slices of at most COLUMNS rows that split V evenly."""
    v = emb.shape[0]
    parts = kernels.fewest_parts(v, -(-v // COLUMNS))
    return parts, lambda i: cpu_forms.loop_slice(emb, i, v // parts, 0)


def trained_loss(h, emb, y, w, live, cap):
    """`loss` with both gradients, for a trained narrow table on one CPU device: h [n, B, C,
    H], emb [V, H] -> (loss, hits, d_h [n, B, C, H], d_emb [V, H] in emb's dtype).

    The table's gradient needs each logit's d, so this takes two passes over the vocabulary:
    the first `softmax_sums` without the gradient (the logsumexp of every token), the second
    remakes each slice's logits vocabulary-major, [S, N] = slice @ x^T, and multiplies their d
    [S, N] both ways: d @ x, the slice's table gradient (summed over the chunks, then written
    once in emb's dtype), and slice^T @ d, d_hidden^T. One product more than a pass that keeps
    its logits, but no [V, N] block, kept gradient or transposed table is written: every
    product in XLA:CPU's fast form from slices in cache.
    """
    n, b, c, hidden = h.shape
    k = _joined(n, b * c)
    m, tokens = n // k, b * k * c
    x = _join(h, k).reshape(m, tokens, hidden)
    y_f, w_f = _join(y, k).reshape(m, tokens), _join(w, k).reshape(m, tokens)
    view = logit_block.viewer(h.dtype, cap)
    live = -(-live // k)

    def stats(i, carry):
        lse, loss, hits = carry
        lse_i, first, p_y, _ = softmax_sums(x[i], emb, None, y_f[i], w_f[i], view, gradient=False)
        loss = loss + ((lse_i - view(p_y)[0]) * w_f[i]).sum()
        hits = hits + ((first == y_f[i]).astype(jnp.float32) * w_f[i]).sum()
        return lse.at[i].set(lse_i), loss, hits
    zero = jnp.zeros((), jnp.float32)
    lse, loss, hits = jax.lax.fori_loop(0, live, stats, (jnp.zeros((m, tokens), jnp.float32), zero, zero))

    parts, rows = _slices(emb)
    size = emb.shape[0] // parts
    x_t = cpu_forms.transposed(x)  # [m, H, tokens]
    bits = cpu_forms.bits_type(emb.dtype)

    def by_slice(d_h, s):  # d_h: float32 [m, H, tokens]
        part = rows(s)
        cols = cpu_forms.transposed(part)  # [H, S]

        def by_chunk(i, carry):
            d_h, d_part = carry
            logits, th = view(jnp.dot(part, x_t[i], preferred_element_type=jnp.float32))  # [S, N]
            d = logit_block.logit_gradient(logits, lse[i], y_f[i] - s * size, w_f[i], th, axis=0)
            d = d.astype(emb.dtype)
            d_part = d_part + jnp.dot(d, x[i], preferred_element_type=jnp.float32)
            return d_h.at[i].add(jnp.dot(cols, d, preferred_element_type=jnp.float32)), d_part
        d_h, d_part = jax.lax.fori_loop(0, live, by_chunk, (d_h, jnp.zeros((size, hidden), jnp.float32)))
        # as bits: XLA:CPU would widen the stacked bfloat16 gradient for each slice's update
        return d_h, jax.lax.bitcast_convert_type(d_part.astype(emb.dtype), bits)
    d_h, d_emb = jax.lax.scan(by_slice, jnp.zeros((m, hidden, tokens), jnp.float32), jnp.arange(parts))
    d_emb = jax.lax.bitcast_convert_type(d_emb.reshape(emb.shape), emb.dtype)
    d_h = jnp.swapaxes(d_h, 1, 2).astype(h.dtype).reshape(m, b, k * c, hidden)
    return loss, hits, _unjoin(d_h, k), d_emb
