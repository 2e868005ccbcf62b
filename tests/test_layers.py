"""Hand-written pieces of models/layers.py checked against the plain computation: causal
attention in query blocks, and the cuDNN attention wiring (the XLA:CPU kernels are checked in
tests/test_kernels.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import kernels, layers


@pytest.mark.parametrize("kv_heads, soft_cap, window", [(1, None, None), (2, 0.5, None), (1, None, 3)])
def test_causal_query_blocks_equal_full_attention(monkeypatch, kv_heads, soft_cap, window):
    """T = 11 in blocks of 4 (the last one short), with right padding and one fully padded row
    (its queries see no key and must come out zero), and once as a sliding-window layer:
    values and gradients match attention over every key, and the full [T*G, S] logits are
    never built."""
    monkeypatch.setattr(layers, "QUERY_BLOCK", 4)
    b, t, n, d = 3, 11, 4, 8
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, d))
    k, v = (jax.random.normal(key, (b, t, kv_heads, d)) for key in keys[1:3])
    pos = jnp.arange(t)
    lengths = jnp.array([t, 6, 0])
    mask = (pos[:, None] >= pos[None, :])[None] & (pos < lengths[:, None])[:, None, :]
    if window:  # query t sees keys in (t - window, t]
        mask &= (pos[:, None] - pos[None, :] < window)[None]
    d_out = jax.random.normal(keys[3], (b, t, n, d))

    def run(causal):
        f = lambda q, k, v: layers.grouped_attention(  # noqa: E731
            q, k, v, mask, soft_cap, causal=causal, window=window if causal else None)
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(d_out)

    (blocked, grads), (full, reference) = run(True), run(False)
    np.testing.assert_allclose(blocked, full, rtol=1e-5, atol=1e-6)
    assert not np.any(blocked[2])  # the padded row
    for a, r in zip(grads, reference):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(
        lambda q: layers.grouped_attention(q, k, v, mask, causal=True, window=window))(q))
    g = n // kv_heads
    assert f"f32[{b},{kv_heads},{t * g},{t}]" not in jaxpr
    assert f"f32[{b},{kv_heads},{4 * g},4]" in jaxpr  # the first block sees 4 keys
    last = 11 - 6 if window else 11  # the last block (rows 8-10) starts at key 8 - 3 + 1 = 6
    assert f"f32[{b},{kv_heads},{3 * g},{last}]" in jaxpr


def test_cudnn_attention_config_is_checked():
    from models.gemma import PRESETS
    tiny = PRESETS["gemma_tiny"]
    assert tiny.replace(dtype="bfloat16", attention="cudnn").attention == "cudnn"
    for bad in ({"attention": "flash"}, {"attention": "cudnn"},  # float32
                {"attention": "cudnn", "dtype": "bfloat16", "attention_logit_soft_cap": 50.0}):
        with pytest.raises(ValueError, match="attention="):
            tiny.replace(**bad)


def test_cudnn_attention_is_wired_into_training_only(monkeypatch):
    """On CPU, stand in for the cuDNN kernel with the CPU's causal attention: a Gemma with local
    layers gives the same training logits either way (so the window reaches the kernel), and
    decoding with a cache never calls it."""
    from models.gemma import PRESETS, Gemma, init_cache
    calls = []

    def stand_in(q, k, v, window=None, mask=None):
        assert mask is None  # unpacked rows: the kernel's own causal mask is all it needs
        calls.append(window)
        pos = jnp.arange(q.shape[1])
        mask = pos[:, None] >= pos[None, :]
        if window:
            mask &= pos[:, None] - pos[None, :] < window
        return kernels.causal_attention(q, k, v, mask[None], None, window)

    monkeypatch.setattr(layers, "fused_causal_attention", stand_in)
    cfg = PRESETS["gemma_tiny"].replace(dtype="bfloat16", num_layers=2, sliding_window_size=5)
    ids = jax.random.randint(jax.random.key(0), (2, 12), 3, cfg.vocab_size)
    mask = jnp.arange(12)[None] < jnp.array([[12], [7]])  # right padding
    params = Gemma(cfg).init(jax.random.key(1), ids)["params"]
    fused = Gemma(cfg.replace(attention="cudnn"))
    out = fused.apply({"params": params}, ids, mask)
    ref = Gemma(cfg).apply({"params": params}, ids, mask)
    assert sorted(calls, key=str) == [5, None]
    real = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[real], np.asarray(ref, np.float32)[real])
    calls.clear()
    cache = init_cache(cfg, 2, 16)
    fused.apply({"params": params}, ids, jnp.arange(16)[None] < 12, cache=cache, cache_index=0)
    assert calls == []
