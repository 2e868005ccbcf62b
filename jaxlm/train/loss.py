"""Causal-LM loss with KerasHub's preprocessing semantics, computed without full logits.

KerasHub's `GemmaCausalLMPreprocessor` packs BOS + text + EOS to `sequence_length + 1` and trains
on `inputs = ids[:, :-1]`, `targets = ids[:, 1:]`, `weights = mask[:, 1:]` (padding weighted 0).
We keep those semantics but normalise by the number of unmasked targets (Keras' default
"sum_over_batch_size" divides by B*T, which makes the loss depend on the padding amount).

Gemma's 256k-vocabulary logits in float32 are 1 GiB per 1k tokens, so the loss projects the
final hidden states onto the tied embedding one sequence chunk at a time, and computes each
chunk's gradient with its loss (a custom VJP), so at most one [B, C, V] block is alive at once
and no logits are recomputed in the backward pass. The chunk
length is chosen so that block stays under a fixed number of logits: with the seed's layout the
embedding is split on the hidden axis, so every model-axis device holds the whole block.

Only targets with a weight cost a projection: each row's weighted positions are moved to its
front (a stable sort along the sequence, so batch sharding is untouched) and the chunk loop
runs only as far as the fullest row needs. Instruction tuning scores few positions: the demo's
rows (response-only loss, 8 x 40) weight 7% of them, and its batches need 1-2 chunks of 8.

One chunk's block of logits, its sums and its gradient: jaxlm/train/logit_block.py. In a
one-device program for CPU, a frozen table's loss and d_hidden (LoRA) and any loss's value
alone write no block: jaxlm/train/online_softmax.py takes them a vocabulary slice at a time.

Losses here return SUMS plus the token count; callers divide by the total count, which is what
makes gradient accumulation exact (see jaxlm/train/step.py).
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxlm.train import logit_block, online_softmax
from models import cpu_forms, kernels, layers, train_layout


Metrics = dict  # {"loss_sum", "correct", "count"}: float32 scalars, summed over tokens


def shift(token_ids, padding_mask):
    """Packed ids/mask [B, T+1] -> (inputs [B, T], input_mask [B, T], targets [B, T], weights [B, T])."""
    return token_ids[:, :-1], padding_mask[:, :-1], token_ids[:, 1:], padding_mask[:, 1:]


# Logits per [B, C, V] block, by platform. Each chunk re-reads the [V, H] table and adds its
# gradient into the float32 table-sized accumulator, so the chunk count is paid in memory traffic.
# CPU: 32 MiB blocks (at 2**22, 16 positions of 8 x 32000, the bench-config loss took 7% longer
# and the full fine-tune step 5.6%), and see `cpu_budget` for large vocabularies. Accelerators:
# 512 MiB blocks, which HBM holds easily; with the CPU budget Gemma 2B at 2 x 2048 tokens ran
# 128 chunks, ~0.8 TB of traffic per step.
CHUNK_LOGITS = {"cpu": 2 ** 23, "gpu": 2 ** 27, "tpu": 2 ** 27}


def cpu_budget(vocab: int, hidden: int, devices: int = 1) -> int:
    """The CPU block: CHUNK_LOGITS["cpu"], or hidden/2 tokens of logits if that is more, split
    between the `devices` sharing the host's memory (each holds its own block).

    Each chunk reads the [V, H] table twice (its logits and d_hidden), so a chunk of fewer than
    ~H/2 tokens moves more table than logits. Gemma 3 270M (V 262144, H 640), value and
    d_hidden of the loss alone, one device, interleaved: 8 x 128 tokens 5.40 s at 32 tokens a
    chunk vs 3.75 s at 256 (-31%; the two products at ~90% of the matmul peak), 8 x 40 tokens
    1.70 vs 1.33 s (bench/README.md). The bench config (V 32000, H 512) keeps 32 MiB blocks.
    """
    return max(CHUNK_LOGITS["cpu"], (hidden // 2) * vocab // max(1, devices))


def chunk_length(batch: int, length: int, vocab: int, budget: int | None = None,
                 hidden: int | None = None) -> int:
    """Positions per chunk so that batch * C * vocab <= budget (default: this platform's
    CHUNK_LOGITS, on CPU `cpu_budget` when `hidden` is given), at least 1 and at most `length`;
    the chunks split `length` as evenly as that allows (2048 in 8 chunks of 256, not 7 of 262
    and one padded)."""
    if budget is None:
        platform = jax.default_backend()
        budget = CHUNK_LOGITS.get(platform, CHUNK_LOGITS["gpu"])
        if platform == "cpu" and hidden is not None:
            # Every device of a CPU run, not this process's: a multi-process CPU run is local
            # processes on one machine (jaxlm.launch), whose devices share its memory. Split by
            # the local count, 2 processes x 4 devices took twice the single process's blocks.
            budget = cpu_budget(vocab, hidden, jax.device_count())
    most = max(1, min(length, budget // max(1, batch * vocab)))
    return -(-length // -(-length // most))


def chunked_cross_entropy(hidden, embeddings, targets, weights, *, chunk_size: int | None = None,
                          logit_soft_cap: float | None = None,
                          chunk_logits: int | None = None, columns=None) -> Metrics:
    """Sum of weighted CE (and argmax hits) of `hidden @ embeddings.T` against `targets`.

    hidden [B, T, H] (compute dtype), embeddings [V, H], targets int [B, T], weights [B, T].
    The projection runs in the compute dtype (as KerasHub's `ReversibleEmbedding`); logsumexp and
    the target logit are taken in float32, per chunk of `chunk_size` positions (default: as many
    as keep a chunk's logits within `chunk_logits`, by default this platform's CHUNK_LOGITS, on
    CPU `cpu_budget`).
    logit_soft_cap: Gemma 2's final cap, tanh(logits / cap) * cap, applied per chunk.
    columns: the frozen table also stored as [H, V] (the CPU train layout,
    `models.train_layout`): the logits multiply it in XLA:CPU's fast form.
    """
    b, t, h = hidden.shape
    c = max(1, min(chunk_size or chunk_length(b, t, embeddings.shape[0], chunk_logits, h), t))
    pad = (-t) % c
    weights = weights.astype(jnp.float32)
    count = weights.sum()
    hidden, targets, weights = scored_first(hidden, targets, weights)
    live = live_chunks(weights, c)
    if pad:  # padded positions carry weight 0
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        weights = jnp.pad(weights, ((0, 0), (0, pad)))
    n = (t + pad) // c
    # [n, B, C, ...]: scan over sequence chunks.
    to_chunks = lambda x: jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 1, 0)  # noqa: E731
    emb = embeddings.astype(hidden.dtype)
    loss_sum, correct = _fused_ce(to_chunks(hidden), emb, columns, to_chunks(targets),
                                  to_chunks(weights), live, logit_soft_cap)
    return {"loss_sum": loss_sum, "correct": correct, "count": count}


def live_chunks(weights, c: int):
    """-> int32 []: the chunks of `c` positions that hold every weighted target of rows sorted
    by `scored_first` (0 for a batch without one)."""
    return -(-jnp.sum(weights != 0, axis=1, dtype=jnp.int32).max() // c)


def scored_first(hidden, targets, weights):
    """hidden [B, T, H], targets and weights [B, T] with each row's weighted positions first,
    in their order (the sum over positions is unchanged; the gradient flows back through the
    gather to the original positions)."""
    order = jnp.argsort(weights == 0, axis=1, stable=True)
    return (jnp.take_along_axis(hidden, order[..., None], axis=1),
            jnp.take_along_axis(targets, order, axis=1), jnp.take_along_axis(weights, order, axis=1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fused_ce(h, emb, columns, y, w, live, cap):
    """h [n, B, C, H], emb [V, H], columns [H, V] or None, y/w [n, B, C], live int32 [] ->
    (loss_sum, correct) over the first `live` chunks (the rest carry no weight); no [B, T, V]
    is kept."""
    def token_major(h, emb, y, w, live):
        def body(i, carry):
            product, view, top = logit_block.project(h[i], emb, columns, cap)
            ce, hit, _ = logit_block.sums(view(product)[0], y[i], w[i], top=top)
            return carry[0] + ce, carry[1] + hit
        zero = jnp.zeros((), jnp.float32)
        return jax.lax.fori_loop(0, live, body, (zero, zero))
    return _online_on_one_cpu(h, emb, columns, y, w, live, cap, token_major, gradient=False)


def _online_on_one_cpu(h, emb, columns, y, w, live, cap, token_major, gradient=True):
    """`online_softmax.loss` (with d_hidden if `gradient`) in a one-device program for CPU,
    else token_major(h, emb, y, w, live)."""
    def cpu_online(h, emb, y, w, live):
        if layers.traced_devices() > 1:
            return token_major(h, emb, y, w, live)
        return online_softmax.loss(h, emb, columns, y, w, live, cap, gradient)
    return kernels.by_platform(h, emb, y, w, live, cpu=cpu_online, plain=token_major)


def _fused_ce_fwd(h, emb, columns, y, w, live, cap):
    """The gradient is computed with the loss, chunk by chunk: dCE/dlogits = softmax - onehot
    (times the weight, and tanh' under the cap) is projected back at once, so the logits are
    neither stored for the backward pass nor recomputed in it (a rematerialised chunk would
    redo the [B, C, H] x [H, V] projection: 14-21% of a small-model step). A loop with a
    run-time trip count is no obstacle: nothing differentiates through it.

    Arguments are CustomVJPPrimals (symbolic zeros): when the embedding is not differentiated
    (a LoRA step with the tied embedding frozen) only d_hidden is computed, and the float32
    embedding-gradient accumulator does not exist. On one CPU device that loss goes online
    (`online_softmax.loss`). A trained table in a bfloat16 program for CPU goes online in
    two passes on one device (`online_softmax.trained_loss`), else vocabulary-major
    (`_cpu_vocab_major`)."""
    train_emb = emb.perturbed
    h, emb, y, w, live = h.value, emb.value, y.value, w.value, live.value
    columns = None if columns is None else columns.value

    def token_major(h, emb, y, w, live):
        d_emb = jnp.zeros(emb.shape[::-1], jnp.float32) if train_emb else None
        loss, hits, d_emb, d_h = _chunk_loop(h, live, d_emb, lambda i: _token_major(
            h[i], emb, columns, y[i], w[i], cap, train_emb))
        return loss, hits, d_h, None if d_emb is None else d_emb.T.astype(emb.dtype)
    if not train_emb:
        loss, hits, d_h = _online_on_one_cpu(h, emb, columns, y, w, live, cap,
                                             lambda *args: token_major(*args)[:3])
        return (loss, hits), (d_h, None)

    def cpu_trained(h, emb, y, w, live):
        if layers.traced_devices() == 1:
            return online_softmax.trained_loss(h, emb, y, w, live, cap)
        return _cpu_vocab_major(h, emb, y, w, live, cap)
    loss, hits, d_h, d_emb = kernels.narrow_by_platform(h, emb, y, w, live, cpu=cpu_trained,
                                                        plain=token_major)
    return (loss, hits), (d_h, d_emb)


def _chunk_loop(h, live, d_emb, chunk, keep=lambda d_emb, part, i: d_emb + part):
    """Runs `chunk(i) -> (ce, hits, d_h_c [B, C, H], part)` over the first `live` chunks ->
    (loss, hits, d_emb, d_h [n, B, C, H]), each chunk's part taken into d_emb by `keep`
    (by default its table gradient, added); d_emb None: no table gradient."""
    def body(i, carry):
        loss, hits, d_emb, d_h = carry
        ce, hit, d_h_c, part = chunk(i)
        d_emb = None if d_emb is None else keep(d_emb, part, i)
        return loss + ce, hits + hit, d_emb, d_h.at[i].set(d_h_c.astype(d_h.dtype))
    zero = jnp.zeros((), jnp.float32)
    return jax.lax.fori_loop(0, live, body, (zero, zero, d_emb, jnp.zeros_like(h)))


def _token_major(h_c, emb, columns, y_c, w_c, cap, train_emb=True):
    """One chunk's (ce, hits, float32 d_h_c [B, C, H], d_emb_c [H, V] or None), the logits
    [B, C, V]."""
    product, view, top = logit_block.project(h_c, emb, columns, cap)
    b, c, v = product.shape
    if train_emb:
        logits, th = view(product)
        ce, hit, lse = logit_block.sums(logits, y_c, w_c, top=top)
        d = logit_block.logit_gradient(logits, lse, y_c, w_c, th).astype(h_c.dtype)
        # float32 out: XLA:CPU then multiplies a bfloat16 table in place, not a widened copy
        d_h_c = kernels.tied_hidden_gradient(d.reshape(b * c, v), emb).reshape(b, c, -1)
        return ce, hit, d_h_c, jnp.einsum("BCH,BCV->HV", h_c, d, preferred_element_type=jnp.float32)
    # Without a table gradient (on one CPU device jaxlm/train/online_softmax.py runs instead)
    # the target's logit is viewed from its gather and d leaves out the target's term, which
    # `target_term` adds back: the viewed logits feed the sums and d, and no compare per logit.
    at = lambda x: jnp.take_along_axis(x, y_c[..., None], axis=-1)  # noqa: E731  [B, C, 1]
    l_y, th_y = view(at(product))
    logits, th = view(product)
    ce, hit, lse = logit_block.sums(logits, y_c, w_c, top=top, target=l_y[..., 0])
    d = logit_block.logit_gradient(logits, lse, None, w_c, th, onehot=False).astype(h_c.dtype)
    d_h_c = kernels.tied_hidden_gradient(d.reshape(b * c, v), emb).reshape(b, c, -1)
    return ce, hit, d_h_c + logit_block.target_term(l_y, th_y, lse, w_c, emb, y_c, h_c.dtype), None


def _cpu_vocab_major(h, emb, y, w, live, cap):
    """The loss and both gradients with each chunk's logits vocabulary-major, [V, B * C], for a
    trained bfloat16 table on XLA:CPU in a program on more than one device (on one,
    `online_softmax.trained_loss` writes no [V, N] block and ran the real 270M's bfloat16
    full fine-tune step ~20% faster): -> (loss, hits, d_h [n, B, C, H], d_emb [V, H]).

    Token-major, the logits h @ emb^T multiply a transposed table, which XLA:CPU does in
    float32 (at a third of the fast form's speed), and the float32 table gradient comes out
    [H, V], converted to the [V, H] bfloat16 one by a transposing pass. Vocabulary-major every
    product is in the fast form, [N, K] @ [K, M] with bfloat16 operands in row-major order and
    a float32 result: emb @ h^T, d @ h (the table gradient, accumulated as [V, H]) and
    emb^T @ d, against a copy of the table written out transposed once per step (a
    table-sized bfloat16 buffer more while the loss runs). The real Gemma 3 270M's bfloat16
    full fine-tune step at 8 x 128 tokens: ~5.4 -> ~4.5 s, with the reductions over the
    vocabulary as `logit_block.sums` does them on a leading axis (an A/B, ad hoc; the bench line is
    `BENCH real_bf16_train_full_t128`, bench/README.md).

    The table gradient sums d @ h over the chunks. Where every chunk's d [V, B * C] together
    takes no more memory than that float32 [V, H] sum (`_keeps_logit_gradients`), the chunks
    keep their d instead, side by side, and one product over all tokens makes the gradient:
    no table-sized zeroing and adding per chunk, and a longer product, which runs faster. The
    same 270M step at 8 x 128 and 2 x 512 tokens: ~4.7 -> ~4.35 s (an A/B, ad hoc).
    """
    n, b, c, hidden = h.shape
    columns = cpu_forms.transposed(emb)

    def chunk(i):
        flat, y_c, w_c = h[i].reshape(b * c, hidden), y[i].reshape(-1), w[i].reshape(-1)
        # rounded to the compute dtype, as the token-major product
        logits = jnp.dot(emb, cpu_forms.transposed(flat), preferred_element_type=jnp.float32)
        logits, th = logit_block.capped(logit_block.rounded(logits, flat.dtype), cap)
        ce, hit, lse = logit_block.sums(logits, y_c, w_c, axis=0)
        d = logit_block.logit_gradient(logits, lse, y_c, w_c, th, axis=0).astype(flat.dtype)
        # the barrier keeps XLA from folding the transpose into the product as d^T @ columns^T,
        # a form XLA:CPU has no bfloat16 kernel for
        d_h_c = jax.lax.optimization_barrier(jnp.dot(columns, d, preferred_element_type=jnp.float32)).T
        return ce, hit, d_h_c.reshape(b, c, hidden), d

    tokens = n * b * c
    if _keeps_logit_gradients(tokens, hidden):
        # a chunk's d goes in as bits: XLA:CPU has no bfloat16 dynamic-update-slice, and would
        # widen the whole buffer to float32 and back for every chunk. The chunks past `live`
        # stay zero.
        kept = jnp.zeros((emb.shape[0], tokens), cpu_forms.bits_type(emb.dtype))
        keep = lambda kept, d, i: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            kept, jax.lax.bitcast_convert_type(d, kept.dtype), i * b * c, 1)
        loss, hits, kept, d_h = _chunk_loop(h, live, kept, chunk, keep)
        d_emb = jnp.dot(jax.lax.bitcast_convert_type(kept, emb.dtype), h.reshape(tokens, hidden),
                        preferred_element_type=jnp.float32)
    else:
        add = lambda d_emb, d, i: d_emb + jnp.dot(  # noqa: E731
            d, h[i].reshape(b * c, hidden), preferred_element_type=jnp.float32)
        loss, hits, d_emb, d_h = _chunk_loop(h, live, jnp.zeros(emb.shape, jnp.float32), chunk, add)
    return loss, hits, d_h, d_emb.astype(emb.dtype)


def _keeps_logit_gradients(tokens: int, hidden: int) -> bool:
    """Whether `_cpu_vocab_major` keeps every chunk's logit gradient, [V, tokens] in the
    compute dtype (2 bytes), rather than sum the float32 [V, hidden] table gradient: when that
    takes no more memory. Gemma 3 270M (H 640): up to 1280 tokens a step."""
    return tokens <= 2 * hidden


def _fused_ce_bwd(cap, res, g):
    d_h, d_emb = res
    g_loss = g[0]  # `correct` (argmax hits) has no gradient
    if isinstance(g_loss, SymbolicZero):
        return None, None, None, None, None, None
    return (d_h * g_loss.astype(d_h.dtype),
            None if d_emb is None else d_emb * g_loss.astype(d_emb.dtype), None, None, None, None)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd, symbolic_zeros=True)


def naive_cross_entropy(logits, targets, weights) -> Metrics:
    """Reference: the same sums from full logits [B, T, V] (tests; small vocabularies)."""
    logits = logits.astype(jnp.float32)
    weights = weights.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {"loss_sum": (ce * weights).sum(), "correct": (hit * weights).sum(), "count": weights.sum()}


def lm_loss_fn(model, *, chunk_size: int | None = None, chunk_logits: int | None = None):
    """-> loss_fn(params, batch, rng) -> (loss_sum, metrics) for `jaxlm.train.step`.

    batch: {"token_ids": int32 [B, T+1], "padding_mask": bool [B, T+1]} packed as KerasHub does
    (BOS + text + EOS, right-padded). The model is applied with `return_hidden=True`; the tied
    embedding `params["token_embedding"]["embeddings"]` projects onto the vocabulary, then the
    config's `final_logit_soft_cap` (Gemma 2) applies, as in the model's own logits.
    Optional batch keys: "loss_mask" bool [B, T+1] (target t counts iff loss_mask[:, t], instead
    of padding_mask) and, for packed rows, "segment_ids" / "positions" int32 [B, T+1] (see
    `jaxlm.data.packing`).
    chunk_size / chunk_logits: see `chunked_cross_entropy` (a step compiled for another
    platform than this host's passes that platform's CHUNK_LOGITS).
    layout, adapters: the frozen base's CPU train layout (`models.train_layout.build`) and
    the LoRA adapters, unmerged (`params` is then the base), passed by a step made with
    `layout=True`: the products run through the layout, the adapters beside them.
    """
    cap = getattr(model.config, "final_logit_soft_cap", None)

    def loss_fn(params, batch, rng, layout=None, adapters=None):
        del rng  # Gemma has no dropout; the argument keeps the signature shared with MLM
        inputs, input_mask, targets, weights = shift(batch["token_ids"], batch["padding_mask"])
        if "loss_mask" in batch:  # --loss_on=response, packed rows: only these targets count
            weights = batch["loss_mask"][:, 1:]
        packed = {k: batch[k][:, :-1] for k in ("segment_ids", "positions") if k in batch}
        variables, products, columns = {"params": params}, contextlib.nullcontext(), None
        if layout is not None or adapters is not None:
            if getattr(model.config, "scan_layers", False):
                # a scan applies its blocks apart from these collections: the adapters would be lost
                raise ValueError("the train layout and unmerged adapters need unrolled layers "
                                 "(scan_layers=False)")
            if layout is not None:
                variables[train_layout.COLLECTION] = layout
                columns = layout["token_embedding"]["columns"]
            if adapters is not None:
                variables[train_layout.LORA] = dict(adapters)
            products = train_layout.products(1.0 if adapters is None else adapters.scale)
        with products:
            hidden = model.apply(variables, inputs, input_mask, return_hidden=True, **packed)
        m = chunked_cross_entropy(hidden, params["token_embedding"]["embeddings"], targets, weights,
                                  chunk_size=chunk_size, logit_soft_cap=cap,
                                  chunk_logits=chunk_logits, columns=columns)
        return m["loss_sum"], m
    return loss_fn
