"""LoRA as a tree transform: counts, init, merge, and KerasHub .lora.h5 files both ways."""
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm import lora
from jaxlm.tree import flatten
from conftest import ragged_batch


@pytest.mark.parametrize("name,expected", [("gemma_2b_en", 1_363_968), ("gemma_7b_en", 11_067_392)])
def test_trainable_count_matches_kerashub_without_allocating(name, expected):
    _, params = jaxlm.load(name, abstract=True)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in flatten(params).values())
    assert lora.trainable_count(params, 4) == expected
    adapters = jax.eval_shape(lambda k: lora.init(params, 4, key=k), jax.random.key(0))
    assert lora.num_params(adapters) == expected


def test_init_shapes_dtypes_and_keras_he_uniform():
    _, params = jaxlm.load("gemma_tiny", dtype="bfloat16", abstract=True)
    adapters = lora.init(params, 8, key=jax.random.key(1))
    flat = flatten(adapters)
    # KerasHub's defaults: query and value only, in every block.
    assert sorted(flat) == sorted(f"decoder_block_{i}/attention/{n}/lora_{f}"
                                  for i in range(2) for n in ("query", "value") for f in "ab")
    a, b = (flat[f"decoder_block_0/attention/query/lora_{f}"] for f in "ab")
    assert a.shape == (4, 128, 8) and b.shape == (8, 32)
    assert a.dtype == jnp.float32 and b.dtype == jnp.float32  # whatever the model dtype
    assert not np.any(np.asarray(b))
    limit = math.sqrt(6 / (128 * 4))  # Keras fans: fan_in = shape[-2] * prod(shape[:-2])
    a = np.asarray(a)
    assert np.abs(a).max() <= limit and np.abs(a).max() > 0.95 * limit
    assert abs(a.std() / (limit / math.sqrt(3)) - 1) < 0.05
    v = np.asarray(flat["decoder_block_1/attention/value/lora_a"])
    assert v.shape == (1, 128, 8) and np.abs(v).max() <= math.sqrt(6 / 128)
    assert not np.array_equal(np.asarray(flat["decoder_block_1/attention/query/lora_a"]), a)


def test_targets_regexes_and_roberta_default():
    _, params = jaxlm.load("gemma_tiny", abstract=True)
    every = ".*(query|key|value|attention_output|ffw_.*)/kernel"
    # rank 2 x 2 blocks x (q, k, v, out, gating, gating_2, linear): prod(K[:-1]) + K[-1] each
    assert lora.trainable_count(params, 2, [every]) == 2 * 2 * (
        (512 + 32) + 2 * (128 + 32) + (128 + 128) + 3 * (128 + 256))
    _, rob = jaxlm.load("roberta_tiny", abstract=True)
    targets = lora.find_targets(rob)
    assert targets == [f"transformer_layer_{i}/self_attention_layer/{n}/kernel"
                       for i in range(2) for n in ("query", "value")]


@pytest.mark.parametrize("kwargs,message", [
    (dict(rank=0), "rank must be an integer >= 1"),
    (dict(rank=4, targets=["nothing/here"]), "matches no parameter"),
    (dict(rank=4, targets=[".*/scale"]), "end the regex in /kernel"),
    (dict(rank=4, targets=["("]), "not a valid regex"),
    (dict(rank=4, dropout=0.1), "dropout"),
    (dict(rank=4, alpha=0), "alpha must be > 0"),
])
def test_init_errors_are_one_clear_line(kwargs, message):
    _, params = jaxlm.load("gemma_tiny", abstract=True)
    with pytest.raises(jaxlm.UserError, match=message) as e:
        lora.init(params, key=jax.random.key(0), **kwargs)
    assert "\n" not in str(e.value)


def _random_adapters(params, rank=4, seed=0, **kwargs):
    adapters = lora.init(params, rank, key=jax.random.key(seed), **kwargs)
    return jax.tree.map(lambda x: jax.random.normal(jax.random.key(seed + 1), x.shape) * 0.1,
                        adapters)


def test_merge_formula_passthrough_and_round_trip():
    _, params = jaxlm.load("gemma_tiny")
    zero = lora.init(params, 4, key=jax.random.key(0))
    merged = lora.merge(params, zero)
    q = "decoder_block_0/attention/query/kernel"
    np.testing.assert_array_equal(flatten(merged)[q], flatten(params)[q])  # B = 0: no change
    adapters = _random_adapters(params)
    merged = jax.jit(lambda p, a: lora.merge(p, a, alpha=8.0))(params, adapters)
    a, b = (flatten(adapters)[f"decoder_block_0/attention/query/lora_{f}"] for f in "ab")
    want = flatten(params)[q] + 2.0 * np.einsum("nhr,rd->nhd", a, b)
    np.testing.assert_allclose(flatten(merged)[q], want, atol=1e-6)
    eager = lora.merge(params, adapters)
    assert flatten(eager)["decoder_block_0/attention/key/kernel"] is \
        flatten(params)["decoder_block_0/attention/key/kernel"]
    back = lora.unmerge(lora.merge(params, adapters, alpha=8.0), adapters, alpha=8.0)
    for p, w in flatten(params).items():
        np.testing.assert_allclose(flatten(back)[p], w, atol=1e-6)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert flatten(lora.merge(bf16, adapters))[q].dtype == jnp.bfloat16


def test_merge_rejects_foreign_adapters():
    _, params = jaxlm.load("gemma_tiny", abstract=True)
    _, other = jaxlm.load("gemma_2b_en", abstract=True)
    adapters = jax.eval_shape(lambda k: lora.init(other, 4, key=k), jax.random.key(0))
    with pytest.raises(jaxlm.UserError, match="another model"):
        jax.eval_shape(lambda: lora.merge(params, adapters))


def _keras_logits(backbone, ids, mask):
    import keras_hub
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    return np.asarray(lm({"token_ids": ids, "padding_mask": mask}))


def _jaxlm_logits(model, params, ids, mask):
    return np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)))


def test_keras_layer_order_equals_kerashub():
    import keras_hub
    from jaxlm.convert.keras_gemma import config_from_keras
    g = keras_hub.models.GemmaBackbone(vocabulary_size=64, num_layers=2, num_query_heads=2,
                                       num_key_value_heads=1, hidden_dim=8, intermediate_dim=16,
                                       head_dim=4)
    weighted = [l.path for l in g._flatten_layers(include_self=False) if l.weights]
    assert lora.keras_layers(config_from_keras(g.get_config())) == weighted
    r = keras_hub.models.RobertaBackbone(vocabulary_size=64, num_layers=2, num_heads=2,
                                         hidden_dim=8, intermediate_dim=16, max_sequence_length=8)
    weighted = [l.path for l in r._flatten_layers(include_self=False) if l.weights]
    config = jaxlm.load("roberta_tiny", abstract=True)[0].config
    assert config.num_layers == 2 and lora.keras_layers(config) == weighted


def test_kerashub_lora_file_both_ways(keras_gemma_preset, tmp_path):
    """KerasHub LoRA file -> jaxlm merge == KerasHub logits; jaxlm's file -> KerasHub == jaxlm."""
    import keras_hub
    preset, backbone = keras_gemma_preset(name="lora")
    backbone.enable_lora(4)
    rng = np.random.RandomState(0)
    for w in backbone.weights:
        if "lora_kernel" in w.path:
            w.assign(rng.randn(*w.shape).astype("float32") * 0.2)
    keras_file = str(tmp_path / "keras.lora.h5")
    backbone.save_lora_weights(keras_file)
    ids, mask = ragged_batch(backbone.vocabulary_size, [9, 4, 1], 12)
    want = _keras_logits(backbone, ids, mask)

    model, params = jaxlm.load(preset)
    adapters = lora.load_keras_lora(keras_file, model, params)
    assert sorted(flatten(adapters)) == sorted(
        f"decoder_block_{i}/attention/{n}/lora_{f}" for i in range(2) for n in ("query", "value")
        for f in "ab")
    got = _jaxlm_logits(model, lora.merge(params, adapters), ids, mask)
    assert np.abs(got - want)[mask].max() <= 1e-4
    assert np.abs(_jaxlm_logits(model, params, ids, mask) - want)[mask].max() > 1e-2  # LoRA matters

    # Round trip through our writer, then KerasHub reads our file (alpha folded into B).
    ours = str(tmp_path / "ours.lora.h5")
    lora.save_keras_lora(ours, adapters, model.config)
    again = lora.load_keras_lora(ours, model.config)
    for p, x in flatten(adapters).items():
        np.testing.assert_array_equal(flatten(again)[p], x)
    lora.save_keras_lora(ours, adapters, model.config, alpha=8)
    fresh = keras_hub.models.GemmaBackbone.from_preset(preset)
    fresh.load_lora_weights(ours)
    got = _jaxlm_logits(model, lora.merge(params, adapters, alpha=8), ids, mask)
    assert np.abs(got - _keras_logits(fresh, ids, mask))[mask].max() <= 1e-4


def test_keras_lora_file_errors(tmp_path):
    model, params = jaxlm.load("gemma_tiny", abstract=True)
    adapters = lora.init(params, 4, key=jax.random.key(0))
    with pytest.raises(jaxlm.UserError, match="must end in .lora.h5"):
        lora.save_keras_lora(str(tmp_path / "x.h5"), adapters, model.config)
    path = str(tmp_path / "x.lora.h5")
    lora.save_keras_lora(path, adapters, model)
    _, big = jaxlm.load("gemma_2b_en", abstract=True)
    with pytest.raises(jaxlm.UserError, match="another model"):
        lora.load_keras_lora(path, model.config, big)


def test_roberta_kerashub_lora_file_gives_kerashub_effective_kernels(tmp_path):
    """RoBERTa: a KerasHub .lora.h5 merged by jaxlm equals KerasHub's effective (LoRA) kernels."""
    import keras_hub
    from jaxlm.convert.keras_roberta import config_from_keras
    from jaxlm.tree import unflatten
    backbone = keras_hub.models.RobertaBackbone(vocabulary_size=64, num_layers=2, num_heads=2,
                                                hidden_dim=8, intermediate_dim=16,
                                                max_sequence_length=8)
    params = unflatten({w.path: np.asarray(w.numpy()) for w in backbone.weights})
    backbone.enable_lora(3)
    rng = np.random.RandomState(0)
    for w in backbone.weights:
        if "lora_kernel" in w.path:
            w.assign(rng.randn(*w.shape).astype("float32"))
    path = str(tmp_path / "roberta.lora.h5")
    backbone.save_lora_weights(path)
    config = config_from_keras(backbone.get_config())
    merged = flatten(lora.merge(params, lora.load_keras_lora(path, config, params)))
    layers = {l.path: l for l in backbone._flatten_layers(include_self=False)}
    for i in range(2):
        for name in ("query", "value"):
            layer = layers[f"transformer_layer_{i}/self_attention_layer/{name}"]
            got = merged[f"{layer.path}/kernel"]
            np.testing.assert_allclose(got, np.asarray(layer.kernel), atol=1e-5)
            assert np.abs(got - flatten(params)[f"{layer.path}/kernel"]).max() > 1e-2


def test_adapter_folder_loads_on_another_topology(tmp_path):
    """Adapters saved sharded over 8 devices load with no flags in a 1-device process (a
    laptop reading what a pod wrote), whole on its device, with their alpha."""
    import subprocess
    import sys
    import sharding
    _, params = jaxlm.load("gemma_tiny", abstract=True)
    mesh = sharding.make_mesh("1x8")
    adapters = lora.init(params, 4, key=jax.random.key(0), alpha=12)
    specs = sharding.adapter_specs(adapters, sharding.partition_specs(params, sharding.rules_for(
        jaxlm.load("gemma_tiny", abstract=True)[0].config), mesh), mesh)
    adapters = jax.device_put(adapters, jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs))
    assert len(adapters["decoder_block_0"]["attention"]["query"]["lora_a"].sharding.device_set) == 8
    lora.save(str(tmp_path / "adapters"), adapters)
    code = ("import jax, jaxlm; a = jaxlm.lora.load(%r); "
            "x = a['decoder_block_0']['attention']['query']['lora_a']; "
            "print(jax.device_count(), a.alpha, x.shape, len(x.sharding.device_set))") % str(tmp_path / "adapters")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "12.0", "(4,", "128,", "4)", "1"]
