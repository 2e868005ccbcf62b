"""Loading holds little beyond the parameters it returns: random init needs few temporaries
(the compiler's own count), and a GGUF file is dequantised one tensor at a time, each placed
before the next is read, the embedding by the rows each device holds."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxlm
import sharding
from jaxlm import loading
from models.gemma import PRESETS, Gemma, GemmaConfig
from test_gguf import SMALL, write_gguf


def test_random_init_needs_few_temporaries():
    """Default threefry keys made XLA:CPU hold ~6x the parameters in uint32 counters (Gemma 2B
    in bfloat16: 23.7 GB for 5.0 GB); init_params' keys need a few percent."""
    cfg = PRESETS["gemma_tiny"].replace(dtype="bfloat16")
    model = Gemma(cfg)
    fn = loading.initializer(model, loading.abstract_params(model, cfg))
    mem = fn.lower().compile().memory_analysis()
    assert mem.temp_size_in_bytes < 0.25 * mem.output_size_in_bytes
    params = loading.init_params(model, loading.abstract_params(model, cfg), None, seed=0)
    assert params["token_embedding"]["embeddings"].dtype == jnp.bfloat16
    assert float(jnp.std(params["token_embedding"]["embeddings"].astype(jnp.float32))) > 0


def test_random_init_draws_threefry_bits_the_same_on_any_mesh():
    """The built-in presets' random init makes its bits with XLA's ThreeFry, not the backend's
    default (XLA:CPU's Philox is ~6x slower), and a seed gives the same parameters whole on
    one device as split over a mesh."""
    cfg = PRESETS["gemma_tiny"].replace(dtype="bfloat16")
    model = Gemma(cfg)
    shapes = loading.abstract_params(model, cfg)
    text = loading.initializer(model, shapes).lower().as_text()
    algorithms = set(re.findall(r"rng_bit_generator .*?algorithm = (\w+)", text))
    assert algorithms == {"THREE_FRY"}
    whole = loading.init_params(model, shapes, None, seed=3)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("batch", "model"))
    split = loading.init_params(model, shapes, sharding.placement(mesh, sharding.rules_for(cfg)), seed=3)
    emb = split["token_embedding"]["embeddings"]
    assert len(emb.addressable_shards) == 8 and emb.addressable_shards[0].data.size < emb.size
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), whole, split)))
    other = loading.init_params(model, shapes, None, seed=4)
    assert not jnp.array_equal(other["token_embedding"]["embeddings"], whole["token_embedding"]["embeddings"])
    std = float(jnp.std(whole["token_embedding"]["embeddings"].astype(jnp.float32)))
    assert abs(std / cfg.vocab_size ** -0.5 - 1) < 0.05


def one_layer_gguf(spm_tokenizer, tmp_path):
    s = {**SMALL, "layers": 1}
    cfg = GemmaConfig(vocab_size=s["vocab"], num_layers=1, num_heads=s["heads"], num_kv_heads=s["kv"],
                      hidden_dim=s["hidden"], ffw_dim=s["ffw"], head_dim=s["head_dim"],
                      use_post_attention_norm=True, use_post_ffw_norm=True, use_query_key_norm=True)
    params = Gemma(cfg).init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
    path = tmp_path / "one_layer.gguf"
    write_gguf(path, params, tokenizer=spm_tokenizer, s=s)
    return path, params


def test_gguf_tensors_are_read_one_at_a_time(spm_tokenizer, tmp_path, monkeypatch):
    path, params = one_layer_gguf(spm_tokenizer, tmp_path)
    from jaxlm.convert import gguf
    log = []
    read, put = gguf._dequantise, jax.device_put
    monkeypatch.setattr(gguf, "_dequantise", lambda *a: log.append("read") or read(*a))
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: log.append("put") or put(*a, **k))
    jaxlm.load(str(path))
    assert log == ["read", "put"] * len(jax.tree.leaves(params))


def test_gguf_embedding_is_read_by_the_rows_of_each_device(spm_tokenizer, tmp_path, monkeypatch):
    """Split over the vocabulary on 8 devices, the embedding is dequantised in 8 row blocks,
    never whole: in a multi-process run a process reads only its own devices' rows."""
    path, params = one_layer_gguf(spm_tokenizer, tmp_path)
    from jaxlm.convert import gguf
    blocks, read = [], gguf._dequantise
    monkeypatch.setattr(gguf, "_dequantise", lambda t, layout, *rows: (
        blocks.append(rows) if t.name == "token_embd.weight" else None) or read(t, layout, *rows))
    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
    rows = NamedSharding(mesh, P("model", None))
    _, loaded = jaxlm.load(str(path), placement=lambda p, shape: rows if len(shape) == 2
                           else NamedSharding(mesh, P()))
    vocab = SMALL["vocab"]
    assert sorted(blocks) == [(i * vocab // 8, (i + 1) * vocab // 8) for i in range(8)]
    table = loaded["token_embedding"]["embeddings"]
    assert table.sharding == rows
    np.testing.assert_allclose(np.asarray(table), params["token_embedding"]["embeddings"],
                               atol=1e-2)

    blocks.clear()  # split over the hidden axis, every device holds all rows: read once
    columns = NamedSharding(mesh, P(None, "model"))
    _, loaded = jaxlm.load(str(path), placement=lambda p, shape: columns if len(shape) == 2
                           else NamedSharding(mesh, P()))
    assert blocks == [(0, vocab)] and loaded["token_embedding"]["embeddings"].sharding == columns
    np.testing.assert_array_equal(np.asarray(loaded["token_embedding"]["embeddings"]),
                                  np.asarray(table))
