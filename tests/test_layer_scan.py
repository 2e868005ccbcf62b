"""The training path runs the blocks as a `lax.scan` over layer periods (models/gemma.py); it
must equal the per-layer loop (which KV-cache decoding and `scan_layers=False` use), with and
without remat, including layers past the last whole local/global period, and keep the
parameter paths."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.train.loss import lm_loss_fn
from models.gemma import Gemma, PRESETS, init_cache

GEMMA2 = dict(sliding_window_size=4, sliding_window_pattern=2, use_post_attention_norm=True,
              use_post_ffw_norm=True, attention_logit_soft_cap=50.0, final_logit_soft_cap=30.0)
GEMMA3 = dict(sliding_window_size=4, sliding_window_pattern=3, use_query_key_norm=True,
              local_rope_base=10_000.0, rope_base=1e6)


@pytest.mark.parametrize("extra", [{}, GEMMA2, GEMMA3], ids=["gemma1", "gemma2", "gemma3"])
def test_scan_equals_loop_and_remat(extra):
    cfg = PRESETS["gemma_tiny"].replace(num_layers=5, **extra)  # 5: a partial period remains
    model = Gemma(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    assert sorted(k for k in params if k.startswith("decoder_block_")) == [
        f"decoder_block_{i}" for i in range(5)]
    ids = np.random.RandomState(0).randint(3, cfg.vocab_size, (2, 13)).astype(np.int32)

    scanned = model.apply({"params": params}, ids)
    looped, _ = model.apply({"params": params}, ids, cache=init_cache(cfg, 2, 13), cache_index=0)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(looped), atol=1e-5)

    batch = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    grad = lambda m: jax.jit(jax.grad(lambda p: lm_loss_fn(m)(p, batch, None)[0]))(params)  # noqa: E731
    g0 = grad(model)
    for other in (cfg.replace(remat=True), cfg.replace(scan_layers=False),
                  cfg.replace(scan_layers=False, remat=True)):
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(grad(Gemma(other)))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    unrolled = Gemma(cfg.replace(scan_layers=False))
    assert "scan" not in str(jax.make_jaxpr(lambda p: unrolled.apply({"params": p}, ids))(params))
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g0["decoder_block_4"])) > 0
