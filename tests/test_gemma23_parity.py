"""Gemma 2 (GemmaBackbone flags) and Gemma 3 (Gemma3Backbone) logits parity with KerasHub,
on sequences longer than the sliding window, and the KV cache under sliding windows."""
import numpy as np
import pytest

import jax.numpy as jnp

import jaxlm
from conftest import random_norm_scales, ragged_batch

WIDTH, LENGTHS = 13, [13, 8, 2]  # window 4 < 13: local layers really cut context


def save_preset(backbone, tmp_path):
    path = str(tmp_path / "preset")
    backbone.save_to_preset(path)
    return path


def keras_logits(backbone, ids, mask):
    h = backbone({"token_ids": ids, "padding_mask": mask})
    logits = backbone.token_embedding(h, reverse=True)
    return np.asarray(logits, np.float32)


def gemma2(**kw):
    import keras_hub
    args = dict(vocabulary_size=97, num_layers=3, num_query_heads=4, num_key_value_heads=2,
                hidden_dim=32, intermediate_dim=64, head_dim=8, use_post_ffw_norm=True,
                use_post_attention_norm=True, attention_logit_soft_cap=1.5, final_logit_soft_cap=2.0,
                use_sliding_window_attention=True, sliding_window_size=4)
    args.update(kw)
    return keras_hub.models.GemmaBackbone(**args)


def gemma3(**kw):
    import keras_hub
    args = dict(vocabulary_size=97, image_size=None, num_layers=7, num_query_heads=4,
                num_key_value_heads=1, hidden_dim=32, intermediate_dim=48, head_dim=8,
                use_post_ffw_norm=True, use_post_attention_norm=True, use_sliding_window_attention=True,
                sliding_window_size=4, vision_encoder=None)
    args.update(kw)
    return keras_hub.models.Gemma3Backbone(**args)


@pytest.mark.parametrize("make", [gemma2, gemma3, lambda: gemma3(query_head_dim_normalize=False,
                                                                  global_rope_scaling_factor=8.0)],
                         ids=["gemma2", "gemma3", "gemma3_scaled"])
def test_logits_match_keras(make, tmp_path, monkeypatch):
    import keras
    from models import layers
    keras.utils.set_random_seed(0)
    backbone = make()
    random_norm_scales(backbone)
    path = save_preset(backbone, tmp_path)
    ids, mask = ragged_batch(97, LENGTHS, WIDTH)
    ref = keras_logits(backbone, ids, mask)
    model, params = jaxlm.load(path)
    out = np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(out - ref)[mask].max() <= 1e-4
    # causal attention in query blocks of 4, each cut to its keys on both sides by the window
    monkeypatch.setattr(layers, "QUERY_BLOCK", 4)
    blocked = np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(blocked - ref)[mask].max() <= 1e-4
    # the switches are live: without the window (or the caps) the logits differ
    no_window = type(model)(model.config.replace(sliding_window_size=None))
    far = np.asarray(no_window.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(far - ref)[mask].max() > 1e-3


@pytest.mark.parametrize("make", [gemma2, gemma3], ids=["gemma2", "gemma3"])
def test_keras_roundtrip(make, tmp_path):
    import keras
    import keras_hub
    from jaxlm import families
    from jaxlm.convert import keras_preset
    keras.utils.set_random_seed(1)
    backbone = make()
    random_norm_scales(backbone)
    model, params = jaxlm.load(save_preset(backbone, tmp_path))
    out = str(tmp_path / "back")
    keras_preset.write_preset(families.by_config(model.config), model.config, params, out)
    back = keras_hub.models.Backbone.from_preset(out)
    assert type(back) is type(backbone)
    ids, mask = ragged_batch(97, LENGTHS, WIDTH)
    np.testing.assert_array_equal(keras_logits(back, ids, mask), keras_logits(backbone, ids, mask))


def test_kv_cache_decoding_respects_the_sliding_window(tmp_path):
    """Token-by-token decoding through the cache equals the full forward pass past the window."""
    import keras
    from models.gemma import init_cache
    keras.utils.set_random_seed(2)
    backbone = gemma3()
    random_norm_scales(backbone)
    model, params = jaxlm.load(save_preset(backbone, tmp_path))
    ids, mask = ragged_batch(97, [WIDTH], WIDTH)
    full = np.asarray(model.apply({"params": params}, jnp.asarray(ids)))
    cache = init_cache(model.config, 1, 16)
    key_mask = jnp.ones((1, 16), bool)
    steps = []
    for t in range(WIDTH):
        logits, cache = model.apply({"params": params}, jnp.asarray(ids[:, t:t + 1]), key_mask,
                                    cache=cache, cache_index=t)
        steps.append(np.asarray(logits[:, 0]))
    np.testing.assert_allclose(np.stack(steps, 1), full, atol=1e-4)
