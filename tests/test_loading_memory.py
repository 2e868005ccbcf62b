"""Loading holds little beyond the parameters it returns: random init needs few temporaries
(the compiler's own count), and a GGUF file is dequantised one tensor at a time, each placed
before the next is read."""
import jax
import jax.numpy as jnp

import jaxlm
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


def test_gguf_tensors_are_read_one_at_a_time(spm_tokenizer, tmp_path, monkeypatch):
    s = {**SMALL, "layers": 1}
    cfg = GemmaConfig(vocab_size=s["vocab"], num_layers=1, num_heads=s["heads"], num_kv_heads=s["kv"],
                      hidden_dim=s["hidden"], ffw_dim=s["ffw"], head_dim=s["head_dim"],
                      use_post_attention_norm=True, use_post_ffw_norm=True, use_query_key_norm=True)
    params = Gemma(cfg).init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
    path = tmp_path / "one_layer.gguf"
    write_gguf(path, params, tokenizer=spm_tokenizer, s=s)
    from jaxlm.convert import gguf
    log = []
    read, put = gguf._dequantise, jax.device_put
    monkeypatch.setattr(gguf, "_dequantise", lambda *a: log.append("read") or read(*a))
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: log.append("put") or put(*a, **k))
    jaxlm.load(str(path))
    assert log == ["read", "put"] * len(jax.tree.leaves(params))
