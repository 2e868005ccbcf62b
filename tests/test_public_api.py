"""The promise to users (docs/architecture.md, "Public API"): entry points and their shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxlm


def test_load_builtin_preset_and_apply():
    model, params = jaxlm.load("gemma_tiny")
    cfg = model.config
    assert isinstance(params, dict) and "token_embedding" in params
    ids = jnp.array([[2, 10, 11, 12], [2, 20, 0, 0]], jnp.int32)
    mask = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
    logits = model.apply({"params": params}, ids, mask)
    assert logits.shape == (2, 4, cfg.vocab_size) and logits.dtype == jnp.float32
    # causal: a token never sees the future
    changed = model.apply({"params": params}, ids.at[0, 3].set(99), mask)
    np.testing.assert_allclose(changed[0, :3], logits[0, :3], atol=1e-6)
    assert not np.allclose(changed[0, 3], logits[0, 3])


def test_load_is_seeded_and_dtype_is_honoured():
    _, a = jaxlm.load("gemma_tiny", seed=1)
    _, b = jaxlm.load("gemma_tiny", seed=1)
    _, c = jaxlm.load("gemma_tiny", seed=2)
    emb = lambda p: np.asarray(p["token_embedding"]["embeddings"], np.float32)  # noqa: E731
    np.testing.assert_array_equal(emb(a), emb(b))
    assert not np.array_equal(emb(a), emb(c))
    model, p16 = jaxlm.load("gemma_tiny", dtype="bfloat16")
    assert p16["token_embedding"]["embeddings"].dtype == jnp.bfloat16
    assert model.apply({"params": p16}, jnp.ones((1, 3), jnp.int32)).dtype == jnp.bfloat16


def test_abstract_load_allocates_nothing():
    model, shapes = jaxlm.load("gemma_7b_en", abstract=True)
    leaves = jax.tree.leaves(shapes)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert shapes["decoder_block_27"]["attention"]["query"]["kernel"].shape == (16, 3072, 256)


def test_load_unknown_name_is_a_clear_error():
    with pytest.raises(jaxlm.UserError, match="built-in preset"):
        jaxlm.load("gemma_13b_en")


def test_tokenizer_bos_policy_and_round_trip(keras_gemma_preset):
    path, _ = keras_gemma_preset("gemma_tok")
    tok = jaxlm.load_tokenizer(path)
    ids = tok.encode("def fibonacci(n):")
    assert ids[0] == tok.bos_id == 2 and tok.eos_id == 1 and tok.pad_id == 0
    assert tok.encode("def fibonacci(n):", bos=False) == ids[1:]
    assert tok.encode("x", eos=True)[-1] == tok.eos_id
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == "def fibonacci(n):"
    import keras_hub  # same ids as KerasHub's GemmaTokenizer on the same proto
    kh = keras_hub.models.GemmaTokenizer.from_preset(path)
    assert [int(i) for i in kh("def fibonacci(n):")] == ids[1:]


def test_jaxlm_folder_round_trip(tmp_path):
    model, params = jaxlm.load("gemma_tiny", seed=3)
    tok = jaxlm.load_tokenizer("gemma_tiny")
    jaxlm.save(str(tmp_path / "m"), model, params, tok)
    model2, params2 = jaxlm.load(str(tmp_path / "m"))
    assert model2.config == model.config
    jax.tree.map(np.testing.assert_array_equal, params, params2)
    assert jaxlm.load_tokenizer(str(tmp_path / "m")).encode("hi") == tok.encode("hi")


def test_summary_lists_parameters_and_partition_specs(capsys):
    model, params = jaxlm.load("gemma_tiny")
    text = jaxlm.summary(model, params, print_fn=None)
    assert "decoder_block_1/attention/query/kernel" in text and "(4, 128, 32)" in text
    assert f"Total params: {model.config.num_params:,}" in text
    assert "partition spec" not in text

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("batch", "model"))
    sharded = jax.device_put(params, NamedSharding(mesh, P()))
    sharded["token_embedding"]["embeddings"] = jax.device_put(
        params["token_embedding"]["embeddings"], NamedSharding(mesh, P(None, "model")))
    text = jaxlm.summary(model, sharded, print_fn=None)
    assert "partition spec" in text
    line = next(l for l in text.splitlines() if l.startswith("token_embedding/embeddings"))
    assert "(None, 'model')" in line

    adapters = {"a": jnp.zeros((3, 4))}
    text = jaxlm.summary(model, params, trainable=adapters, print_fn=None)
    assert "Trainable params: 12" in text and f"Non-trainable params: {model.config.num_params:,}" in text
