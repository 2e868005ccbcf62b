"""Loading holds little beyond the parameters it returns: random init needs few temporaries
(the compiler's own count), and a GGUF file is dequantised one tensor at a time, each placed
before the next is read."""
import jax
import jax.numpy as jnp

import jaxlm
from jaxlm import loading
from models.gemma import PRESETS, Gemma
from test_gguf import small_gemma3  # noqa: F401  (fixture)


def test_random_init_needs_few_temporaries():
    """Default threefry keys made XLA:CPU hold ~6x the parameters in uint32 counters (Gemma 2B
    in bfloat16: 23.7 GB for 5.0 GB); init_params' keys need a few percent."""
    cfg = PRESETS["gemma_tiny"].replace(dtype="bfloat16")
    model = Gemma(cfg)
    fn = loading.initializer(model, loading.abstract_params(model, cfg))
    mem = fn.lower(jnp.int32(0)).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 0.25 * mem.output_size_in_bytes
    params = loading.init_params(model, loading.abstract_params(model, cfg), None, seed=0)
    assert params["token_embedding"]["embeddings"].dtype == jnp.bfloat16
    assert float(jnp.std(params["token_embedding"]["embeddings"].astype(jnp.float32))) > 0


def test_gguf_tensors_are_read_one_at_a_time(small_gemma3, monkeypatch):  # noqa: F811
    path, _, params = small_gemma3
    from jaxlm.convert import gguf
    log = []
    read, put = gguf._dequantise, jax.device_put
    monkeypatch.setattr(gguf, "_dequantise", lambda *a: log.append("read") or read(*a))
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: log.append("put") or put(*a, **k))
    jaxlm.load(str(path))
    assert log == ["read", "put"] * len(jax.tree.leaves(params))
