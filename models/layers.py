"""Layers shared by the hand-written models: einsum projections, norms, RoPE, attention.

Numerics follow KerasHub: norms and softmax in float32, everything else in the module's
compute dtype. Each computation is written once, as the math; where XLA:CPU runs a piece
faster written another way, models/kernels.py holds that version and picks it.
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

# Keras' glorot_uniform for EinsumDense kernels: fans from the last two axes is close enough for a
# random init; parity only matters for loaded weights.
kernel_init = nn.initializers.xavier_uniform()


# --- Activation layout ----------------------------------------------------------------------
# The layout table places the weights; XLA's partitioner then places the activations. Where a
# table leaves a whole computation repeated on every device of an axis (the seed table splits
# the hidden dim of q/k/v, so every model-axis device computes all of attention), it names a
# better layout for the activations by logical name, and the trainer traces its step under it.
_ACTIVATIONS: contextvars.ContextVar = contextvars.ContextVar("activation_layout", default=None)


@contextlib.contextmanager
def activation_layout(mesh, rules: dict):
    """While tracing inside it, the program runs on `mesh` (`traced_devices`) and `constrain`
    pins activations: rules {logical name: mesh axes}, none for none."""
    token = _ACTIVATIONS.set(None if mesh is None else (mesh, dict(rules or {})))
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def traced_devices() -> int:
    """How many devices the program being traced runs on: the size of `activation_layout`'s
    mesh, 1 outside it."""
    layout = _ACTIVATIONS.get()
    return 1 if layout is None else layout[0].size


def constrain(x, names: tuple):
    """x with dim i split over the mesh axes of rule `names[i]`, inside `activation_layout`.

    A dim takes the longest prefix of its axes whose product divides it; a dim with no rule
    (or None) stays whole. Outside the context, or when no dim is split, x is left as it is
    (to the partitioner)."""
    layout = _ACTIVATIONS.get()
    if layout is None or x is None:
        return x
    mesh, rules = layout
    spec = []
    for name, size in zip(names, x.shape):
        # an axis of one device splits nothing: left out, a spec of none is no constraint
        axes = [a for a in rules.get(name, ()) if mesh.shape.get(a, 1) > 1] if name else []
        while axes and size % math.prod(mesh.shape[a] for a in axes):
            axes.pop()
        spec.append(tuple(axes) or None)
    if all(a is None for a in spec):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


class Einsum(nn.Module):
    """A bias-free projection `einsum(eq, x, kernel)`, kernel of `shape`, computed in `dtype`."""
    shape: tuple[int, ...]
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, eq: str | None, x=None):
        """`einsum(eq, x, kernel)`; with eq None, the kernel itself in the compute dtype (for
        callers that do their own products)."""
        kernel = self.param("kernel", kernel_init, self.shape, self.dtype)
        if eq is None:
            return kernel.astype(self.dtype)
        return jnp.einsum(eq, x.astype(self.dtype), kernel.astype(self.dtype))


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + scale), in float32, cast back to x.dtype."""
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


class Embedding(nn.Module):
    """Token embedding [V, H] whose transpose is the (tied) output projection."""
    vocab_size: int
    dim: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        # Keras VarianceScaling(1, fan_in, normal) on a (V, H) table: std = 1/sqrt(V).
        init = nn.initializers.normal(stddev=self.vocab_size ** -0.5)
        self.embeddings = self.param("embeddings", init, (self.vocab_size, self.dim), self.dtype)

    def __call__(self, ids):
        """ids [B, T] -> [B, T, H]."""
        return jnp.take(self.embeddings, ids, axis=0).astype(self.dtype)

    def attend(self, x):
        """x [B, T, H] -> logits [B, T, V]."""
        return jnp.einsum("BTH,VH->BTV", x.astype(self.dtype), self.embeddings.astype(self.dtype))


def geglu(gate, up):
    """Gemma's gated activation, gelu_tanh(gate) * up (any shape)."""
    return jax.nn.gelu(gate, approximate=True) * up


def gated_ffn(x, w_gate, w_up, w_down):
    """Gemma's GeGLU FFN: x [N, H] -> geglu(x @ w_gate, x @ w_up) @ w_down [N, H].
    w_gate, w_up [H, F], w_down [F, H]."""
    return geglu(x @ w_gate, x @ w_up) @ w_down


def rope_table(positions, dim: int, base: float, scaling_factor: float = 1.0):
    """RoPE's (cos, sin) for `positions` [B or 1, T]: each float32 [B or 1, T, 1, dim/2].

    inv_freq[i] = base^(-2i/dim) / scaling_factor (linear scaling, Gemma 3 global layers).
    """
    inv_freq = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)) / scaling_factor
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B or 1, T, dim/2]
    return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def rope(x, table):
    """Half-split rotary embedding. x [B, T, N, D], table = rope_table(...) -> [B, T, N, D].

    out = x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1]; cos/sin are cast to x.dtype
    before the multiply (as KerasHub).
    """
    cos, sin = (c.astype(x.dtype) for c in table)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


QUERY_BLOCK = 64  # causal attention: query rows per block (at most 16 blocks)


def grouped_attention(q, k, v, mask, soft_cap: float | None = None, *, causal: bool = False,
                      window: int | None = None, block: int | None = None, core=None):
    """Multi/grouped/multi-query attention. Query head n reads KV head n // G.

    q [B, T, N, D] (already scaled), k/v [B, S, K, D], mask [B, T, S] (True = attend)
    -> [B, T, N, D]. Softmax in float32 with masked probabilities exactly 0, so a query with no
    visible key gets a zero output (KerasHub's "wipe").

    causal: the caller promises that the mask never lets query t see a key s > t (training
    without a cache). The queries then go in blocks of QUERY_BLOCK rows, each against the
    keys up to its own last row only: the masked upper triangle is never computed (the keys
    it skips would get probability exactly 0), and each block's logits stay in cache. On the
    bench config (T 256, 4 blocks) attention forward + backward takes a third less time; at
    T 512 (8 blocks) 60% less.
    window: with causal, the caller also promises that query t sees no key s <= t - window (a
    sliding-window layer); each block then starts at its first row's earliest visible key.
    block: the query rows per block (QUERY_BLOCK unless given; at least T / 16).
    core: `softmax_attention` or a replacement computing the same math over the same
    arguments (models/kernels.py's CPU kernel).
    """
    t = q.shape[1]
    block = max(block or QUERY_BLOCK, -(-t // 16))
    core = core or softmax_attention
    if not causal or t <= block:
        return _attention(q, k, v, mask, soft_cap, core)
    mask = jnp.broadcast_to(mask, (q.shape[0], t, k.shape[1]))
    first = lambda i: 0 if window is None else max(0, i - window + 1)  # noqa: E731  a block's first key
    outs = [_attention(q[:, i:i + block], k[:, first(i):i + block], v[:, first(i):i + block],
                       mask[:, i:i + block, first(i):i + block], soft_cap, core)
            for i in range(0, t, block)]
    return jnp.concatenate(outs, axis=1)


def fused_causal_attention(q, k, v, window: int | None = None, mask=None, *,
                           implementation: str = "cudnn"):
    """cuDNN flash attention for training on NVIDIA GPUs (`GemmaConfig.attention="cudnn"`).

    q [B, T, N, D] (already scaled, bfloat16 or float16), k/v [B, T, K, D] -> [B, T, N, D].
    Query t sees keys s <= t (and s > t - window). Padding is not masked: with right padding
    (what `jaxlm.data` and KerasHub's preprocessor produce) a real query never reaches a padded
    key, and the padded queries' outputs are dropped by the loss, so loss and gradients equal
    `grouped_attention`'s. A row padded on the left or with holes would differ: use "xla".
    The [T, S] logits never reach memory (memory linear in T), and the masked triangle is skipped.

    mask [B, T, S] (True = attend), for packed rows only (several examples per row): JAX's
    public API takes it as a [B, 1, T, S] additive bias, so memory is no longer linear in T (T
    2048 x batch 8: 64 MiB in bfloat16, and as much for its gradient, which cuDNN computes).
    jax 0.10 also has a Hopper-only packed layout (segment offsets) but only as a private API.
    cuDNN needs an even T with a bias. `implementation="xla"` runs the same call on any
    platform (the tests check the arguments on CPU that way).
    """
    if mask is not None and implementation == "cudnn" and q.shape[1] % 2:
        raise ValueError(f"cuDNN attention over packed rows needs an even sequence length, got "
                         f"{q.shape[1]}; use an even --sequence_length or --attention=xla")
    return jax.nn.dot_product_attention(
        q, k.astype(q.dtype), v.astype(q.dtype), mask=None if mask is None else mask[:, None],
        scale=1.0, is_causal=True, local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation)


def _attention(q, k, v, mask, soft_cap, core):
    """grouped_attention over all S keys.

    Each KV head's queries are one [T*G, D] matrix with rows (t, g) -- for multi-query
    attention (K = 1, Gemma 2B) a free reshape of q, and the output goes back the same way --
    and both products are plain batched dot_generals over (B, K). An einsum with the group
    axis before T left XLA:CPU choosing operand orders that transposed the [T*G, S] logits and
    probabilities around each product (36% of the attention forward on the bench config).
    """
    b, t, n, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = n // kv
    q = q.reshape(b, t, kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, d)
    k, v = (x.astype(q.dtype).transpose(0, 2, 1, 3) for x in (k, v))  # [B, K, S, D]
    m = jnp.broadcast_to(mask[:, None, :, None, :], (b, 1, t, g, s)).reshape(b, 1, t * g, s)
    out = core(q, k, v, m, soft_cap)  # [B, K, T*G, D]
    out = out.reshape(b, kv, t, g, d).transpose(0, 2, 1, 3, 4)  # [B, T, K, G, D]
    # With at least one visible key every masked one gets probability exactly 0, so only
    # queries that see no key need the wipe: applied to their output rows, which is cheaper
    # than a select over every probability.
    sees_a_key = jnp.any(mask, axis=-1)[:, :, None, None, None]  # [B, T, 1, 1, 1]
    return jnp.where(sees_a_key, out, 0).reshape(b, t, n, d)


def softmax_attention(q, k, v, m, soft_cap):
    """q [B, K, R, D], k/v [B, K, S, D], m [B, 1, R, S] (True = attend) -> [B, K, R, D]:
    softmax(q k^T) v per (B, K), the softmax in float32, a masked key's probability exactly
    0 wherever a row sees any key (exp(-1e9 - max) = 0)."""
    batch = ((0, 1), (0, 1))
    logits = jax.lax.dot_general(q, k, (((3,), (3,)), batch)).astype(jnp.float32)  # [B, K, R, S]
    probs = masked_softmax(logits, m, soft_cap).astype(q.dtype)
    return jax.lax.dot_general(probs, v, (((3,), (2,)), batch))


def soft_cap(logits, cap: float | None):
    """tanh(logits / cap) * cap (Gemma 2's logit caps); identity when cap is None."""
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def masked_softmax(logits, m, cap: float | None, axis: int = -1):
    """Attention probabilities over `axis` from float32 logits: soft-capped where `cap` is
    given, a key where m is False at -1e9, so its probability is exactly 0 wherever a row sees
    any key (exp(-1e9 - max) = 0)."""
    return jax.nn.softmax(jnp.where(m, soft_cap(logits, cap), -1e9), axis=axis)
