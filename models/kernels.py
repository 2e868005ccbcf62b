"""XLA:CPU's own kernels for parts of the model's math, and the one place that picks them.

models/gemma.py and models/layers.py write every computation once, as the math. A few of them
run markedly faster on XLA:CPU written another way; those versions live here, each with the
bench measurement that justifies it, and each is checked against the plain math in
tests/test_kernels.py (the projections in tests/test_projection_kernel.py). On TPU and GPU the
plain math runs.

How the platform is chosen:
  * Training (`gated_ffn`, `project`, `causal_attention`, and the loss's `tied_logits` and
    `tied_hidden_gradient`) and
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
from models.cpu_forms import (batched_product, bits_slice, product, row_major, row_major_t,
                              transposed)


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
    return _fewest_parts(cols, -(-4 * rows * cols // SLICE_BYTES))


def _fewest_parts(total: int, at_least: int) -> int:
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
    6900 ms (`BENCH real_ab_hidden`, `python bench/real_step_ab.py --what=hidden`)."""
    return by_platform(d, emb, cpu=_cpu_tied_hidden_gradient, plain=_tied_hidden_gradient)


def _tied_hidden_gradient(d, emb):
    return jnp.dot(d, emb, preferred_element_type=jnp.float32)


def _cpu_tied_hidden_gradient(d, emb):
    v, rows = emb.shape[0], HIDDEN_GRADIENT_ROWS * 4 // jnp.dtype(emb.dtype).itemsize
    n = _fewest_parts(v, -(-v // rows))
    size = v // n
    if n == 1 or 4 * size < rows or layers.traced_devices() > 1:  # one slice, no fit
        return _tied_hidden_gradient(d, emb)
    narrow = jnp.dtype(emb.dtype).itemsize < 4
    cut = bits_slice if narrow else (lambda w, i, size, axis: jax.lax.dynamic_slice_in_dim(  # noqa: E731
        w, i * size, size, axis))

    def body(i, total):
        return total + jnp.dot(cut(d, i, size, 1), cut(emb, i, size, 0),
                               preferred_element_type=jnp.float32)
    return jax.lax.fori_loop(0, n, body, jnp.zeros((d.shape[0], emb.shape[1]), jnp.float32))


# --- Training: the GeGLU FFN with a written-out backward -------------------------------------

def gated_ffn(x, gate: layers.Einsum, up: layers.Einsum, down: layers.Einsum):
    """Gemma's FFN, down(geglu(gate(x), up(x))): x [B, T, H] -> [B, T, H].

    gate, up: Einsum layers with [H, F] kernels, down: [F, H]. A decode step (T = 1), and a
    step with a train layout or LoRA factors at any of them (`train_layout.intercepts`), go
    through the layers themselves, so the interceptors can replace each product; other inputs
    run `layers.gated_ffn` on the flat tokens, on CPU with `_cpu_gated_ffn`'s backward.
    """
    b, t, h = x.shape
    w_gate, w_up, w_down = gate(None), up(None), down(None)
    if t == 1 or any(train_layout.intercepts(m) for m in (gate, up, down)):
        return down("BTF,FH->BTH", layers.geglu(gate("BTH,HF->BTF", x), up("BTH,HF->BTF", x)))
    flat = x.reshape(b * t, h).astype(w_gate.dtype)
    out = by_platform(flat, w_gate, w_up, w_down, cpu=_cpu_gated_ffn, plain=layers.gated_ffn)
    return out.reshape(b, t, h)


@jax.custom_vjp
def _cpu_gated_ffn(x, w_gate, w_up, w_down):
    """`layers.gated_ffn` (x [N, H]) with its backward written out, for XLA:CPU.

    With autodiff XLA:CPU was free to transpose the [N, F] activation gradients for the
    weight-gradient dots, and it fused those transposes into the elementwise GELU backward,
    which then wrote [F, N] with strided stores: about a fifth of a full fine-tune step on the
    bench config. Justified by `python bench/train_step.py`'s `BENCH train_full` and `BENCH
    train_lora` lines (jaxlm tokens/s: full 465.6 -> 567-582, LoRA 789 -> 823-849 when it
    came in on 2026-11-30; bench/README.md, "CPU, 2 cores"). Here every weight gradient is an
    [H, N] @ [N, F] product, so no [N, F] activation is ever transposed. When none of the
    three kernels is differentiated (a LoRA step that leaves the FFN frozen) the backward
    computes the input gradient only, as autodiff would.

    Narrow kernels go a slice of F at a time (`slices`), forward and backward; the slices'
    products are summed in float32. Their products are all in XLA:CPU's fast bfloat16 form
    (models/cpu_forms.py; a narrow kernel's transpose, one slice at a time, is written out
    too): the real Gemma 3 270M's bfloat16 full fine-tune step at 8 x 128 went from ~7.6 to ~6.45
    s, its FFN products from 1.5 to 0.6 s (an A/B and a profile, ad hoc; the bench line is
    `BENCH real_bf16_train_full_t128`, bench/README.md).
    """
    return _ffn_forward(x, w_gate, w_up, w_down)[0]


def _ffn_slices(w_gate, w_up, w_down, i, n):
    f = w_down.shape[0] // n
    return bits_slice(w_gate, i, f, 1), bits_slice(w_up, i, f, 1), bits_slice(w_down, i, f, 0)


def _ffn_forward(x, w_gate, w_up, w_down):
    """-> (out [N, H], (gate, up) [n, N, F / n]) over the kernels' n slices."""
    n = slices(*w_gate.shape, w_gate.dtype)
    if n == 1:
        gate, up = product(x, w_gate), product(x, w_up)
        return product(layers.geglu(gate, up), w_down), (gate[None], up[None])

    def body(out, i):
        wg, wu, wd = _ffn_slices(w_gate, w_up, w_down, i, n)
        gate, up = product(x, wg), product(x, wu)
        out = out + jnp.dot(layers.geglu(gate, up), wd, preferred_element_type=jnp.float32)
        return out, (gate, up)
    out, gate_up = jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), jnp.arange(n))
    return out.astype(x.dtype), gate_up


def _cpu_gated_ffn_fwd(x, w_gate, w_up, w_down):
    """Arguments are CustomVJPPrimals (symbolic zeros): `.perturbed` says which are trained.
    The residual x is None when no kernel needs a gradient."""
    trained = w_gate.perturbed or w_up.perturbed or w_down.perturbed
    x, w_gate, w_up, w_down = x.value, w_gate.value, w_up.value, w_down.value
    out, (gate, up) = _ffn_forward(x, w_gate, w_up, w_down)
    return out, (x if trained else None, w_gate, w_up, w_down, gate, up)


def _ffn_slice_backward(x, w_gate, w_up, w_down, gate, up, d_out):
    """One slice's float32 d_x and, given x, its kernels' gradients (else None)."""
    a, c = math.sqrt(2.0 / math.pi), 0.044715
    t = jnp.tanh(a * (gate + c * gate ** 3))
    gelu = 0.5 * gate * (1 + t)
    d_gelu = 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * a * (1 + 3 * c * gate * gate)
    d_hidden = product(d_out, row_major_t(w_down))
    d_gate, d_up = d_hidden * up * d_gelu, d_hidden * gelu
    d_x = (jnp.dot(d_gate, row_major_t(w_gate), preferred_element_type=jnp.float32)
           + jnp.dot(d_up, row_major_t(w_up), preferred_element_type=jnp.float32))
    if x is None:
        return d_x, None
    x_t = row_major_t(x)
    return d_x, (product(x_t, d_gate), product(x_t, d_up), product(row_major_t(d_out), gelu * up).T)


def _cpu_gated_ffn_bwd(residuals, d_out):
    x, w_gate, w_up, w_down, gate, up = residuals
    n = gate.shape[0]
    if n == 1:
        d_x, grads = _ffn_slice_backward(x, w_gate, w_up, w_down, gate[0], up[0], d_out)
        return (d_x.astype(d_out.dtype), *(grads or (None,) * 3))

    def body(d_x, xs):
        i, g, u = xs
        d, grads = _ffn_slice_backward(x, *_ffn_slices(w_gate, w_up, w_down, i, n), g, u, d_out)
        return d_x + d, grads
    d_x, grads = jax.lax.scan(body, jnp.zeros(d_out.shape, jnp.float32), (jnp.arange(n), gate, up))
    if grads is None:
        return d_x.astype(d_out.dtype), None, None, None
    d_gate, d_up, d_down = grads  # [n, H, F / n], [n, H, F / n], [n, F / n, H]
    join = lambda g: jnp.moveaxis(g, 0, 1).reshape(g.shape[1], -1)  # noqa: E731
    return d_x.astype(d_out.dtype), join(d_gate), join(d_up), d_down.reshape(-1, d_out.shape[1])


_cpu_gated_ffn.defvjp(_cpu_gated_ffn_fwd, _cpu_gated_ffn_bwd, symbolic_zeros=True)


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
    d_x = product(d_y, _matrix(kernel, outs, ins))
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
