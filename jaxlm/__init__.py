"""jaxlm: Gemma and RoBERTa in plain JAX/Flax.

The public face (the promise to users; docs/architecture.md, "Public API"):

    model, params = jaxlm.load(path, dtype=None, abstract=False)
    logits = model.apply({"params": params}, token_ids, padding_mask)
    tokenizer = jaxlm.load_tokenizer(path)
    jaxlm.summary(model, params)
    texts = jaxlm.generate(model, params, tokenizer, prompts, max_length=64)
    adapters = jaxlm.lora.init(params, rank=4, key=jax.random.key(0))
    merged = jaxlm.lora.merge(params, adapters)
"""
from jaxlm import hugepages as _hugepages

if _hugepages.starting_module() == "jaxlm.generate":  # the command restarts before JAX is imported
    _hugepages.restart_with_huge_pages()

from jaxlm import lora  # noqa: E402 (after the restart)
from jaxlm.errors import UserError
from jaxlm.generate import generate
from jaxlm.loading import load, load_tokenizer, save
from jaxlm.summary import summary
from jaxlm.tokenizer import Tokenizer

__all__ = ["UserError", "generate", "load", "lora", "save", "summary", "Tokenizer", "load_tokenizer"]
