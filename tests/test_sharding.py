"""Meshes, layout tables and their checks, on 8 simulated CPU devices."""
import logging

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxlm
import sharding
from jaxlm import lora
from jaxlm.tree import flatten


@pytest.mark.parametrize("spec,shape", [("1x8", (1, 8)), ("8x1", (8, 1)), ("2x4", (2, 4)),
                                        ("auto", (1, 8)), ((4, 2), (4, 2))])
def test_make_mesh(spec, shape):
    mesh = sharding.make_mesh(spec)
    assert mesh.axis_names == ("batch", "model")
    assert (mesh.shape["batch"], mesh.shape["model"]) == shape
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


@pytest.mark.parametrize("spec,message", [
    ("abc", "not of the form DxM"), ("1x8x1", "not of the form DxM"), ("0x8", "dimension < 1"),
    ("-1x8", "dimension < 1"), ("3x3", "needs 9 devices but 8 are available.*XLA_FLAGS"),
    ((1, 2, 4), "give two"), ("2x2", "needs 4 devices but 8"),
])
def test_make_mesh_errors_are_one_line(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        sharding.make_mesh(spec)
    assert "\n" not in str(e.value)


def test_make_mesh_on_given_devices_and_batch_sharding():
    mesh = sharding.make_mesh("2x2", devices=jax.devices()[:4])
    assert mesh.devices.size == 4
    s = sharding.batch_sharding(mesh)
    x = jax.device_put(np.zeros((4, 6), np.int32), s)
    assert {sh.data.shape for sh in x.addressable_shards} == {(2, 6)}


def _tree(**shapes):
    return {k: jax.ShapeDtypeStruct(v, np.float32) for k, v in shapes.items()}


def test_first_match_wins_and_catch_all_replicates():
    params = {"a": _tree(kernel=(8, 16), bias=(16,)), "b": _tree(kernel=(8, 16))}
    rules = [("a/kernel", P("model", None)), (".*kernel", P(None, "model")), (".*", P())]
    specs = sharding.partition_specs(params, rules)
    assert specs == {"a": {"kernel": P("model", None), "bias": P()},
                     "b": {"kernel": P(None, "model")}}


@pytest.mark.parametrize("rules,message", [
    ([("a/kernel", P("model", None))], "no layout rule matches 'a/bias'"),
    ([("zzz", P("model")), (".*", P())], "'zzz' matches no parameter"),
    ([("a/kernel", P("model")), (".*", P())], "rank 1.*rank 2"),
    ([("a/kernel", P("nope", None)), (".*", P())], "mesh axis 'nope'"),
    ([("a/kernel", P("model", "model")), (".*", P())], "twice"),
    ([("(", P())], "not a valid regex"),
])
def test_rule_errors(rules, message):
    params = {"a": _tree(kernel=(8, 16), bias=(16,))}
    with pytest.raises(ValueError, match=message) as e:
        sharding.partition_specs(params, rules, sharding.make_mesh("1x8"))
    assert "\n" not in str(e.value)


def test_non_dividing_dim_is_replicated_with_one_warning(caplog):
    model, params = jaxlm.load("gemma_2b_en", abstract=True)
    mesh = sharding.make_mesh("1x8")
    with caplog.at_level(logging.WARNING, logger="sharding"):
        specs = sharding.partition_specs(params, sharding.rules_for(model.config, "keras"), mesh)
    assert len(caplog.records) == 1 and "\n" not in caplog.text.strip()
    assert "attention/key/kernel dim 0 (1)" in caplog.text and "attention/value" in caplog.text
    block = specs["decoder_block_3"]["attention"]
    assert block["query"]["kernel"] == P("model", "batch", None)
    for name in ("query", "key", "value"):  # queries split 8 ways, the one KV head kept whole
        shape = params["decoder_block_3"]["attention"][name]["kernel"].shape
        got = NamedSharding(mesh, block[name]["kernel"]).shard_shape(shape)
        assert got == (1, 2048, 256)
    # The seed table splits the hidden dim instead, so nothing needs replicating.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sharding"):
        specs = sharding.partition_specs(params, sharding.rules_for(model.config), mesh)
    assert not caplog.records
    assert specs["decoder_block_0"]["attention"]["key"]["kernel"] == P(None, "model", None)


def test_placement_creates_params_split_over_8_devices(capsys):
    mesh = sharding.make_mesh("1x8")
    model, _ = jaxlm.load("gemma_tiny", abstract=True)
    rules = sharding.rules_for(model.config, "seed")
    _, params = jaxlm.load("gemma_tiny", placement=sharding.placement(mesh, rules))
    q = params["decoder_block_1"]["attention"]["query"]["kernel"]  # [4, 128, 32]
    assert q.sharding.spec == P(None, "model", None) and len(q.sharding.device_set) == 8
    assert [s.data.shape for s in q.addressable_shards] == [(4, 16, 32)] * 8
    emb = params["token_embedding"]["embeddings"]
    assert {s.data.shape for s in emb.addressable_shards} == {(4096, 16)}
    norm = params["final_normalization"]["scale"]
    assert norm.sharding.spec == P() and len(norm.addressable_shards) == 8
    listing = sharding.format_sharding(params, "decoder_block_1/")
    lines = listing.splitlines()
    assert len(lines) == 9 and all(l.startswith("decoder_block_1/") for l in lines)
    assert any("attention/query/kernel" in l and "(4, 128, 32)" in l and "8 shards of (4, 16, 32)"
               in l for l in lines)
    assert any("pre_ffw_norm/scale" in l and "replicated" in l for l in lines)
    specs = sharding.named_shardings(params, rules, mesh)
    assert specs["decoder_block_1"]["attention"]["query"]["kernel"] == q.sharding
    # the default table splits the embedding over the vocabulary and the FFN over its width
    default = sharding.named_shardings(params, sharding.rules_for(model.config), mesh)
    assert default["token_embedding"]["embeddings"].shard_shape((4096, 128)) == (512, 128)
    assert default["decoder_block_1"]["ffw_gating"]["kernel"].shard_shape((128, 256)) == (128, 32)
    assert default["decoder_block_1"]["ffw_linear"]["kernel"].shard_shape((256, 128)) == (32, 128)
    assert default["decoder_block_1"]["attention"]["query"]["kernel"] == q.sharding


def test_adapters_follow_their_kernel():
    mesh = sharding.make_mesh("1x8")
    model, params = jaxlm.load("gemma_2b_en", abstract=True)
    adapters = jax.eval_shape(lambda k: lora.init(params, 4, key=k), jax.random.key(0))
    seed = sharding.adapter_specs(
        adapters, sharding.partition_specs(params, sharding.rules_for(model.config), mesh), mesh)
    q = seed["decoder_block_0"]["attention"]["query"]
    assert q == {"lora_a": P(None, "model", None), "lora_b": P()}
    keras = sharding.adapter_specs(adapters, sharding.partition_specs(
        params, sharding.rules_for(model.config, "keras"), mesh), mesh)
    assert keras["decoder_block_0"]["attention"]["query"]["lora_a"] == P("model", "batch", None)
    assert keras["decoder_block_0"]["attention"]["value"]["lora_a"] == P(None, "batch", None)
    # A factor dim that does not divide (the rank, here split by a hand-made spec) is replicated.
    odd = {"x": {"kernel": P(None, "model")}}
    got = sharding.adapter_specs({"x": _tree(lora_a=(16, 4), lora_b=(4, 12))}, odd, mesh)
    assert got == {"x": {"lora_a": P(), "lora_b": P()}}
    with pytest.raises(ValueError, match="no spec for y/kernel"):
        sharding.adapter_specs({"y": _tree(lora_a=(16, 4), lora_b=(4, 8))}, odd, mesh)


def test_roberta_tables():
    mesh = sharding.make_mesh("2x4")
    model, params = jaxlm.load("roberta_tiny", abstract=True)
    data = sharding.partition_specs(params, sharding.rules_for(model.config), mesh)
    assert set(flatten(data).values()) == {P()}
    mp = flatten(sharding.partition_specs(params, sharding.rules_for(model.config, "model"), mesh))
    attn = "transformer_layer_1/self_attention_layer"
    assert mp[f"{attn}/query/kernel"] == P(None, "model", None)
    assert mp[f"{attn}/value/bias"] == P("model", None)
    assert mp[f"{attn}/attention_output/kernel"] == P("model", None, None)
    assert mp["transformer_layer_0/feedforward_output_dense/kernel"] == P("model", None)
    assert mp["mlm_head/intermediate_dense/kernel"] == P()
    with pytest.raises(ValueError, match="unknown layout 'seed' for roberta"):
        sharding.rules_for(model.config, "seed")


def test_keras_table_equals_kerashub_get_layout_map():
    """Our "keras" Gemma table == GemmaBackbone.get_layout_map on a (1, 8) mesh, per weight."""
    import keras
    import keras_hub
    from jaxlm.convert.keras_gemma import config_from_keras
    from jaxlm.loading import abstract_params
    from models.gemma import Gemma

    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=8, num_key_value_heads=8,
        hidden_dim=16, intermediate_dim=32, head_dim=8)
    device_mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"],
                                                devices=keras.distribution.list_devices())
    layout_map = backbone.get_layout_map(device_mesh)
    config = config_from_keras(backbone.get_config())
    params = abstract_params(Gemma(config), config)
    assert sorted(params) == sorted(w.path for w in backbone.weights)
    ours = flatten(sharding.partition_specs(params, sharding.rules_for(config, "keras"),
                                            sharding.make_mesh("1x8")))
    split = 0
    for w in backbone.weights:
        layout = layout_map[w.path]
        theirs = tuple(layout.axes) if layout is not None else (None,) * len(w.shape)
        mine = tuple(ours[w.path]) or (None,) * len(w.shape)
        assert mine == theirs, w.path
        split += any(a is not None for a in theirs)
    assert split == 1 + 2 * 7  # embedding + 7 kernels per block: the comparison is not vacuous


def test_placement_warns_once_per_rule(caplog):
    mesh = sharding.make_mesh("1x8")
    model, _ = jaxlm.load("gemma_tiny", abstract=True)
    place = sharding.placement(mesh, sharding.rules_for(model.config, "keras"))
    with caplog.at_level(logging.WARNING, logger="sharding"):
        for i in range(2):
            for name in ("query", "key", "value"):
                heads = 8 if name == "query" else 1
                s = place(f"decoder_block_{i}/attention/{name}/kernel", (heads, 128, 32))
                assert s.spec == (P("model", "batch", None) if name == "query" else
                                  P(None, "batch", None))
    assert len(caplog.records) == 1
    assert "attention/key/kernel dim 0 (1)" in caplog.text
    with pytest.raises(ValueError, match="rank 2"):
        place("decoder_block_0/attention/query/kernel", (4, 128))
    caplog.clear()
    quiet = sharding.placement(mesh, sharding.rules_for(model.config, "keras"), quiet=True)
    with caplog.at_level(logging.WARNING, logger="sharding"):
        assert quiet("decoder_block_0/attention/key/kernel", (1, 128, 32)).spec == \
            P(None, "batch", None)
    assert not caplog.records


def test_constrain_splits_a_dim_over_the_axes_that_divide_it():
    from models import layers
    mesh = sharding.make_mesh("1x8")
    rules = {"rows": ("batch", "model")}
    f = lambda x: layers.constrain(x, ("rows", None))  # noqa: E731
    x = np.ones((8, 3), np.float32)
    assert f(x) is x  # outside an activation layout nothing changes
    with layers.activation_layout(mesh, rules):
        y = jax.jit(f)(x)
        odd = jax.jit(f)(np.ones((4, 3), np.float32))  # 8 devices do not divide 4 rows
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("batch", "model"), None)), 2)
    assert not y.sharding.is_fully_replicated and odd.sharding.is_fully_replicated
    cfg = jaxlm.load("gemma_tiny", abstract=True)[0].config
    assert sharding.activation_rules(cfg, "seed") == {"attention_batch": ("batch", "model")}
    assert sharding.activation_rules(cfg) == {"attention_batch": ("batch", "model"),
                                              "batch": ("batch",), "hidden": ("model",)}
    assert sharding.activation_rules(cfg, "keras") == {}


def test_the_step_takes_the_activation_rules_except_scanned_on_cpu():
    from jaxlm.train import trainer
    model = jaxlm.load("gemma_tiny", abstract=True)[0]
    unrolled = type(model)(model.config.replace(scan_layers=False))
    assert model.config.scan_layers and trainer.activation_rules(model, None, "cpu") == {}
    seed = {"attention_batch": ("batch", "model")}
    assert trainer.activation_rules(unrolled, "seed", "cpu") == seed
    assert trainer.activation_rules(model, "seed", "tpu") == seed
    assert trainer.activation_rules(model, None, "tpu") == sharding.activation_rules(model.config)
    assert trainer.activation_rules(model, "keras", "tpu") == {}


def test_seed_table_splits_attention_rows_with_the_same_step():
    """The seed table's activation rules put attention's rows over both mesh axes (the compiled
    step gathers attention outputs instead of repeating attention on every device) and train
    exactly as the partitioner's own layout."""
    from jaxlm import data
    from jaxlm.train import loss as L, optim, trainer
    mesh = sharding.make_mesh("1x8")
    cfg = jaxlm.load("gemma_tiny", abstract=True)[0].config
    rules = sharding.rules_for(cfg, "seed")
    model, params = jaxlm.load("gemma_tiny", placement=sharding.placement(mesh, rules, quiet=True))
    model = trainer.training_model(model, platform="cpu")  # unrolled, as train.py
    tok = jaxlm.load_tokenizer("gemma_tiny")
    ids, mask = data.pack(tok, data.format_examples(data.builtin_dataset()[0], data.TEMPLATE), 24)
    batch = data.host_batch(ids, mask, 0, batch_size=8)
    out = {}
    for name, acts in (("table", trainer.activation_rules(model, "seed", "cpu")), ("partitioner", None)):
        built = trainer.build(params, mesh, param_specs=sharding.partition_specs(params, rules, mesh),
                              loss_fn=L.lm_loss_fn(model), optimizer=optim.make_optimizer(),
                              lora=trainer.LoraSpec(4), activations=acts)
        text = built.step.lower(built.state, built.frozen, batch).compile().as_text()
        state, metrics = built.step(built.state, built.frozen, batch)
        state, metrics = built.step(state, built.frozen, batch)
        out[name] = (text.count("all-gather("), float(metrics["loss"]), flatten(state["trainable"]))
    assert out["table"][0] > 0 == out["partitioner"][0]
    np.testing.assert_allclose(out["table"][1], out["partitioner"][1], rtol=1e-5)
    for k, v in out["table"][2].items():
        np.testing.assert_allclose(np.asarray(v), np.asarray(out["partitioner"][2][k]), rtol=1e-4, atol=1e-6)


def test_megatron_table_splits_the_loss_block_and_trains_as_the_seed_table():
    """The default table splits the tied embedding over the vocabulary and the FFN over its
    width: on 1x8 each device projects onto 1/8 of the vocabulary (no [B, C, V] block), keeps
    [N, F / 8] FFN products, needs fewer temporaries than with the seed's table, and a LoRA
    step updates the adapters as the seed's table does."""
    from jaxlm import data
    from jaxlm.train import loss as L, optim, trainer
    mesh = sharding.make_mesh("1x8")
    tok = jaxlm.load_tokenizer("gemma_tiny")
    ids, mask = data.pack(tok, data.format_examples(data.builtin_dataset()[0], data.TEMPLATE), 24)
    batch = data.host_batch(ids, mask, 0, batch_size=8)
    out = {}
    for layout in ("megatron", "seed"):
        cfg = jaxlm.load("gemma_tiny", abstract=True)[0].config
        rules = sharding.rules_for(cfg, layout)
        model, params = jaxlm.load("gemma_tiny", placement=sharding.placement(mesh, rules, quiet=True))
        model = trainer.training_model(model, platform="cpu")
        built = trainer.build(params, mesh, param_specs=sharding.partition_specs(params, rules, mesh),
                              loss_fn=L.lm_loss_fn(model), optimizer=optim.make_optimizer(),
                              lora=trainer.LoraSpec(4),
                              activations=trainer.activation_rules(model, layout, "cpu"))
        compiled = built.step.lower(built.state, built.frozen, batch).compile()
        text = compiled.as_text()
        state, metrics = built.step(built.state, built.frozen, batch)
        state, metrics = built.step(state, built.frozen, batch)
        out[layout] = (text, compiled.memory_analysis().temp_size_in_bytes, float(metrics["loss"]),
                       flatten(state["trainable"]))
    megatron, seed = out["megatron"], out["seed"]
    assert ",4096]" in seed[0] and ",4096]" not in megatron[0]  # [.., V] blocks: the seed's only
    assert "f32[192,256]" in seed[0] and "f32[192,256]" not in megatron[0]  # [N, F], N = 8 x 24
    assert megatron[1] < seed[1]
    np.testing.assert_allclose(megatron[2], seed[2], rtol=1e-5)
    for k, v in megatron[3].items():
        np.testing.assert_allclose(np.asarray(v), np.asarray(seed[3][k]), rtol=1e-4, atol=1e-6)
