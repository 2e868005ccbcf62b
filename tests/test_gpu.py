"""Checks that need an NVIDIA GPU (skipped elsewhere, so CI skips them; run on one with
`JAX_PLATFORMS=cuda python -m pytest tests/test_gpu.py`): the cuDNN fused attention
(`GemmaConfig.attention="cudnn"`) against the XLA attention it replaces in training."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("b, t, n, kv, d, window", [
    (2, 256, 8, 1, 256, None),   # Gemma 2B's heads (multi-query, head_dim 256)
    (2, 384, 4, 2, 64, None),    # grouped queries
    (1, 256, 4, 2, 64, 48),      # a sliding-window layer
])
def test_fused_attention_equals_xla_attention(b, t, n, kv, d, window):
    """Values and gradients in bfloat16, each against the float32 XLA attention: the fused
    kernel is as close to it as XLA's own bfloat16 attention (within a factor of 2)."""
    keys = jax.random.split(jax.random.key(t + d), 4)
    q = jax.random.normal(keys[0], (b, t, n, d)) / np.sqrt(d)
    k, v = (jax.random.normal(key, (b, t, kv, d)) for key in keys[1:3])
    d_out = jax.random.normal(keys[3], (b, t, n, d))
    pos = jnp.arange(t)
    mask = jnp.broadcast_to(pos[:, None] >= pos[None, :], (b, t, t))
    if window:
        mask &= (pos[:, None] - pos[None, :] < window)[None]

    def run(f, dtype):
        args = [x.astype(dtype) for x in (q, k, v)]
        out, vjp = jax.vjp(jax.jit(f), *args)
        return [out, *vjp(d_out.astype(dtype))]

    xla = lambda q, k, v: layers.grouped_attention(q, k, v, mask, causal=True, window=window)  # noqa: E731
    fused = lambda q, k, v: layers.fused_causal_attention(q, k, v, window)  # noqa: E731
    reference = run(xla, jnp.float32)
    for name, got, base, ref in zip("out dq dk dv".split(), run(fused, jnp.bfloat16),
                                    run(xla, jnp.bfloat16), reference):
        assert np.isfinite(np.asarray(got, np.float32)).all(), name
        assert rel_err(got, ref) < max(2 * rel_err(base, ref), 1e-2), name


def test_gemma_loss_and_grads_with_cudnn_attention():
    """A tiny bfloat16 Gemma (with local layers) on a right-padded batch: loss and gradients
    with attention="cudnn" equal those with "xla" to bfloat16 rounding."""
    from jaxlm.train.loss import lm_loss_fn
    from models.gemma import PRESETS, Gemma

    cfg = PRESETS["gemma_tiny"].replace(dtype="bfloat16", num_layers=4, head_dim=64,
                                        sliding_window_size=24, sliding_window_pattern=2)
    rng = np.random.RandomState(0)
    ids = rng.randint(3, cfg.vocab_size, (4, 129)).astype(np.int32)
    lengths = np.array([129, 100, 57, 2])
    batch = {"token_ids": ids, "padding_mask": np.arange(129)[None] < lengths[:, None]}
    params = Gemma(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]

    def loss_and_grads(attention):
        loss_fn = lm_loss_fn(Gemma(cfg.replace(attention=attention)))
        f = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, None)[0]))
        return f(params)

    (loss, grads), (ref_loss, ref_grads) = loss_and_grads("cudnn"), loss_and_grads("xla")
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-2)
    refs = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert rel_err(g, refs[path]) < 5e-2, jax.tree_util.keystr(path)
