"""KerasHub `.lora.h5` for Gemma 2 (GemmaBackbone with post norms) and Gemma 3 (Gemma3Backbone):
the layer order, and the files both ways against KerasHub's own save/load_lora_weights."""
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from conftest import random_norm_scales, ragged_batch
from jaxlm import lora
from jaxlm.tree import flatten

keras_hub = pytest.importorskip("keras_hub")


def gemma2():
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=97, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
        intermediate_dim=64, head_dim=8, use_post_ffw_norm=True, use_post_attention_norm=True,
        attention_logit_soft_cap=1.5, final_logit_soft_cap=2.0, use_sliding_window_attention=True,
        sliding_window_size=4)


def gemma3():
    return keras_hub.models.Gemma3Backbone(
        vocabulary_size=97, image_size=None, num_layers=2, num_query_heads=4, num_key_value_heads=1,
        hidden_dim=32, intermediate_dim=48, head_dim=8, use_post_ffw_norm=True,
        use_post_attention_norm=True, use_sliding_window_attention=True, sliding_window_size=4,
        vision_encoder=None)


def logits(backbone, ids, mask):
    hidden = backbone({"token_ids": ids, "padding_mask": mask})
    return np.asarray(backbone.token_embedding(hidden, reverse=True), np.float32)


@pytest.mark.parametrize("make", [gemma2, gemma3], ids=["gemma2", "gemma3"])
def test_lora_file_both_ways(make, tmp_path):
    import keras
    keras.utils.set_random_seed(0)
    backbone = make()
    random_norm_scales(backbone)
    preset = str(tmp_path / "preset")
    backbone.save_to_preset(preset)
    model, params = jaxlm.load(preset)
    weighted = [l.path for l in backbone._flatten_layers(include_self=False) if l.weights]
    assert lora.keras_layers(model.config) == weighted and lora.keras_lora_supported(model.config)

    backbone.enable_lora(4)
    rng = np.random.RandomState(0)
    for w in backbone.weights:
        if "lora_kernel" in w.path:
            w.assign(rng.randn(*w.shape).astype("float32") * 0.3)
    theirs = str(tmp_path / "theirs.lora.h5")
    backbone.save_lora_weights(theirs)
    ids, mask = ragged_batch(97, [11, 6, 2], 11)
    want = logits(backbone, ids, mask)
    adapters = lora.load_keras_lora(theirs, model, params)
    merged = np.asarray(model.apply({"params": lora.merge(params, adapters)}, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(merged - want)[mask].max() <= 1e-4
    base = np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(base - want)[mask].max() > 1e-2  # the adapters matter

    ours = str(tmp_path / "ours.lora.h5")
    lora.save_keras_lora(ours, adapters, model.config, alpha=8)
    fresh = type(backbone).from_preset(preset)
    fresh.enable_lora(4)
    fresh.load_lora_weights(ours)
    got = np.asarray(model.apply({"params": lora.merge(params, adapters, alpha=8)}, jnp.asarray(ids),
                                 jnp.asarray(mask)))
    assert np.abs(got - logits(fresh, ids, mask))[mask].max() <= 1e-4
    assert sorted(flatten(adapters)) == sorted(f"decoder_block_{i}/attention/{n}/lora_{f}"
                                               for i in range(2) for n in ("query", "value") for f in "ab")
