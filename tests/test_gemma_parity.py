"""Live logit parity with KerasHub's GemmaBackbone: small random presets, loaded by jaxlm."""
import numpy as np
import pytest

from conftest import ragged_batch

import jax
import jax.numpy as jnp

import jaxlm

LENGTHS, WIDTH = [9, 5, 1], 9  # ragged, right-padded; one row is BOS only


def keras_logits(backbone, ids, mask):
    import keras_hub
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    return np.asarray(lm({"token_ids": ids, "padding_mask": mask}), np.float32)


def jaxlm_logits(path, ids, mask, **load_kwargs):
    model, params = jaxlm.load(path, **load_kwargs)
    return np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)), np.float32)


@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_float32_logits_match_keras(keras_gemma_preset, kv_heads):
    path, backbone = keras_gemma_preset(f"gemma_kv{kv_heads}", num_key_value_heads=kv_heads)
    ids, mask = ragged_batch(backbone.vocabulary_size, LENGTHS, WIDTH)
    ref = keras_logits(backbone, ids, mask)
    out = jaxlm_logits(path, ids, mask, dtype="float32")
    assert out.shape == ref.shape == (3, WIDTH, backbone.vocabulary_size)
    assert np.abs(out - ref)[mask].max() <= 1e-4


def test_query_head_dim_normalize_false_matches_what_kerashub_computes(keras_gemma_preset, capsys):
    """KerasHub 0.32's GemmaDecoderBlock ignores the backbone's query_head_dim_normalize=False
    (it always scales by 1/sqrt(head_dim)); jaxlm matches what KerasHub computes and says so."""
    path, backbone = keras_gemma_preset("gemma_qnorm", num_key_value_heads=2, head_dim=16,
                                        query_head_dim_normalize=False)  # hidden/heads = 8 != 16
    ids, mask = ragged_batch(backbone.vocabulary_size, LENGTHS, WIDTH)
    ref = keras_logits(backbone, ids, mask)
    capsys.readouterr()
    out = jaxlm_logits(path, ids, mask, dtype="float32")
    warned = [l for l in capsys.readouterr().err.splitlines() if "query_head_dim_normalize" in l]
    assert len(warned) == 1 and warned[0].startswith("warning:")
    assert np.abs(out - ref)[mask].max() <= 1e-4


def test_bfloat16_logits_match_keras_within_bf16_tolerance(keras_gemma_preset):
    import keras_hub
    path, _ = keras_gemma_preset("gemma_bf16", num_key_value_heads=1)
    backbone = keras_hub.models.GemmaBackbone.from_preset(path, dtype="bfloat16")
    ids, mask = ragged_batch(backbone.vocabulary_size, LENGTHS, WIDTH)
    ref = keras_logits(backbone, ids, mask)
    out = jaxlm_logits(path, ids, mask, dtype="bfloat16")
    ref32 = jaxlm_logits(path, ids, mask, dtype="float32")
    err = np.abs(out - ref)[mask].max()
    # bfloat16 keeps 8 mantissa bits: allow a few ulps of the logit scale, and require jaxlm to
    # be no further from KerasHub than bf16 rounding itself moves the float32 result.
    scale = np.abs(ref32[mask]).max()
    assert err <= 4 * 2.0 ** -8 * scale
    assert err <= 2 * np.abs(ref32 - ref)[mask].max() + 1e-6
    assert (out[mask].argmax(-1) == ref[mask].argmax(-1)).mean() > 0.9


def test_bfloat16_preset_file_is_read(keras_gemma_preset, tmp_path):
    """A preset saved in bfloat16 stores `|V2` datasets; they must decode to the same values."""
    import keras_hub
    path, _ = keras_gemma_preset("gemma_bf16_src", num_key_value_heads=2)
    bf16 = keras_hub.models.GemmaBackbone.from_preset(path, dtype="bfloat16")
    bf16.save_to_preset(str(tmp_path))
    model, params = jaxlm.load(str(tmp_path), dtype="bfloat16")
    q = np.asarray(bf16.get_layer("decoder_block_1").attention.query_dense.kernel).astype(np.float32)
    ours = np.asarray(params["decoder_block_1"]["attention"]["query"]["kernel"]).astype(np.float32)
    np.testing.assert_array_equal(ours, q)


def test_keras_roundtrip_gives_same_logits(keras_gemma_preset, tmp_path):
    """jaxlm -> jaxlm folder -> --to-keras -> KerasHub loads it and gives the same logits."""
    import keras_hub
    from jaxlm.convert.__main__ import main
    path, backbone = keras_gemma_preset("gemma_rt", num_key_value_heads=2)
    main([path, str(tmp_path / "converted")])
    main(["--to-keras", str(tmp_path / "converted"), str(tmp_path / "keras")])
    lm = keras_hub.models.GemmaCausalLM.from_preset(str(tmp_path / "keras"))
    ids, mask = ragged_batch(backbone.vocabulary_size, LENGTHS, WIDTH)
    back = np.asarray(lm({"token_ids": ids, "padding_mask": mask}))
    np.testing.assert_array_equal(back, keras_logits(backbone, ids, mask))
    np.testing.assert_allclose(jaxlm_logits(str(tmp_path / "converted"), ids, mask), back, atol=1e-4)
    assert lm.preprocessor.tokenizer.vocabulary_size() == backbone.vocabulary_size


def test_task_level_weights_file_applies_on_preset(keras_gemma_preset, tmp_path):
    """`GemmaCausalLM.save_weights` nests the backbone under layers/gemma_backbone/ (the seed's
    fine-tuned `gemma_2b_openhermes.weights.h5`); `jaxlm.load(preset, weights=FILE)` reads it."""
    import keras_hub
    path, backbone = keras_gemma_preset("gemma_task", num_key_value_heads=1)
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    for w in backbone.weights:  # "fine-tune": the file must differ from the preset
        w.assign(w.numpy() + 0.01 * np.random.RandomState(3).randn(*w.shape).astype("float32"))
    weights = str(tmp_path / "finetuned.weights.h5")
    lm.save_weights(weights)
    ids, mask = ragged_batch(backbone.vocabulary_size, LENGTHS, WIDTH)
    ref = keras_logits(backbone, ids, mask)
    assert np.abs(jaxlm_logits(path, ids, mask) - ref)[mask].max() > 1e-3  # the preset alone differs
    assert np.abs(jaxlm_logits(path, ids, mask, weights=weights) - ref)[mask].max() <= 1e-4


def test_sharded_preset_index_is_read(keras_gemma_preset, tmp_path):
    """Large presets are saved as model.weights.json + model_0000k.weights.h5 shards."""
    path, backbone = keras_gemma_preset("gemma_shards", num_key_value_heads=2)
    backbone.save_to_preset(str(tmp_path), max_shard_size=0.0001)  # GB: forces several shards
    assert (tmp_path / "model.weights.json").exists() and (tmp_path / "model_00001.weights.h5").exists()
    assert not (tmp_path / "model.weights.h5").exists()
    ids, mask = ragged_batch(backbone.vocabulary_size, LENGTHS, WIDTH)
    assert np.abs(jaxlm_logits(str(tmp_path), ids, mask) - keras_logits(backbone, ids, mask))[mask].max() <= 1e-4


def test_parameters_are_placed_directly_on_their_shardings(keras_gemma_preset):
    """`placement` puts each tensor on its devices as it is read: embedding split over 8 devices."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    path, backbone = keras_gemma_preset("gemma_placed", num_key_value_heads=2)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("batch", "model"))

    def placement(p, shape):
        return NamedSharding(mesh, P(None, "model") if p == "token_embedding/embeddings" else P())
    model, params = jaxlm.load(path, placement=placement)
    emb = params["token_embedding"]["embeddings"]
    assert {s.data.shape for s in emb.addressable_shards} == {(backbone.vocabulary_size, 32 // 8)}
    ids, mask = ragged_batch(backbone.vocabulary_size, LENGTHS, WIDTH)
    out = np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(out - keras_logits(backbone, ids, mask))[mask].max() <= 1e-4
