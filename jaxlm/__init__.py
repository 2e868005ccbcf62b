"""jaxlm: Gemma and RoBERTa in plain JAX/Flax.

The public face (see ARCHITECTURE.md, "Public API contract"):

    model, params = jaxlm.load(path, dtype=None, abstract=False)
    logits = model.apply({"params": params}, token_ids, padding_mask)
    tokenizer = jaxlm.load_tokenizer(path)
    jaxlm.summary(model, params)
"""
from jaxlm.errors import UserError
from jaxlm.generate import generate
from jaxlm.loading import load, save
from jaxlm.summary import summary
from jaxlm.tokenizer import Tokenizer, load_tokenizer

__all__ = ["UserError", "load", "save", "summary", "Tokenizer", "load_tokenizer"]
