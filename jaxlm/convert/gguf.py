"""Gemma from llama.cpp GGUF files: metadata -> GemmaConfig, tensors -> our tree, vocab -> sentencepiece.

`jaxlm.convert.gguf_file` parses the file (llama.cpp's `GGUFReader` takes 7 s on a 262k
vocabulary, see there) and the `gguf` package (llama.cpp's own) dequantises the block formats
(Q4_K, Q5_0, Q6_K, Q8_0, …) to float32; this module only maps names and layouts:

    token_embd                 [V, H]      -> token_embedding/embeddings
    blk.N.attn_q / attn_k / attn_v  [N*D, H] -> decoder_block_N/attention/{query,key,value}/kernel [N, H, D]
    blk.N.attn_output          [H, N*D]    -> decoder_block_N/attention/attention_output/kernel [N, D, H]
    blk.N.ffn_gate / ffn_up    [F, H]      -> decoder_block_N/ffw_gating / ffw_gating_2 [H, F]
    blk.N.ffn_down             [H, F]      -> decoder_block_N/ffw_linear [F, H]
    blk.N.attn_norm, ffn_norm, post_attention_norm, post_ffw_norm, attn_q_norm, attn_k_norm, output_norm

(shapes as numpy reads them: the reverse of GGUF's `ne` order.) llama.cpp's Gemma converters
store every RMSNorm weight as `1 + w` (`convert_hf_to_gguf.py`, Gemma*Model.modify_tensors); our
RMSNorm multiplies by `(1 + scale)`, so norms are read back as `w - 1`. The test that pins this
is the HF transformers comparison on the real model (tests/test_gguf.py).
"""
from __future__ import annotations

import functools
import os

import numpy as np

from jaxlm.convert import gguf_file
from jaxlm.errors import UserError
from jaxlm.tree import RowReader

ARCHITECTURES = ("gemma", "gemma2", "gemma3")

_NORMS = {
    "attn_norm": "pre_attention_norm/scale",
    "ffn_norm": "pre_ffw_norm/scale",
    "post_attention_norm": "post_attention_norm/scale",
    "post_ffw_norm": "post_ffw_norm/scale",
    "attn_q_norm": "attention/query_norm/scale",
    "attn_k_norm": "attention/key_norm/scale",
}


def open_reader(path: str) -> gguf_file.File:
    if not os.path.exists(path):
        raise UserError(f"GGUF file {path} does not exist")
    try:
        reader = gguf_file.read(path)
    except Exception as e:  # the reader raises ValueError/struct errors/IndexError on short files
        raise UserError(f"{path} is truncated or not a GGUF file ({type(e).__name__}: {e}); "
                        "download or assemble it again") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return reader


def _field(reader, key, default=None):
    return reader.fields.get(key, default)


def config_kwargs(reader) -> dict:
    """GemmaConfig arguments from the GGUF metadata of a gemma / gemma2 / gemma3 file."""
    arch = _field(reader, "general.architecture")
    k = lambda name, default=None: _field(reader, f"{arch}.{name}", default)  # noqa: E731
    tokens = _field(reader, "tokenizer.ggml.tokens")
    head_dim = int(k("attention.key_length", k("embedding_length") // k("attention.head_count")))
    kwargs = dict(
        vocab_size=len(tokens), num_layers=int(k("block_count")), hidden_dim=int(k("embedding_length")),
        ffw_dim=int(k("feed_forward_length")), num_heads=int(k("attention.head_count")),
        num_kv_heads=int(k("attention.head_count_kv", k("attention.head_count"))), head_dim=head_dim,
        # stored as float32: its shortest repr recovers the intended 1e-06
        norm_eps=float(str(np.float32(k("attention.layer_norm_rms_epsilon", 1e-6)))),
        rope_base=float(k("rope.freq_base", 10_000.0)))
    kwargs["query_pre_attn_scalar"] = query_pre_attn_scalar(arch, k, kwargs)
    if arch == "gemma2":
        kwargs.update(use_post_attention_norm=True, use_post_ffw_norm=True,
                      attention_logit_soft_cap=k("attn_logit_softcapping", 50.0),
                      final_logit_soft_cap=k("final_logit_softcapping", 30.0),
                      sliding_window_size=int(k("attention.sliding_window", 4096)),
                      sliding_window_pattern=2)
    elif arch == "gemma3":
        # Gemma 3 text: local layers use RoPE base 10k, global layers the file's freq_base (1M).
        kwargs.update(use_post_attention_norm=True, use_post_ffw_norm=True, use_query_key_norm=True,
                      sliding_window_size=int(k("attention.sliding_window", 1024)),
                      sliding_window_pattern=6, local_rope_base=10_000.0)
        scaling = k("rope.scaling.factor")
        if scaling:
            kwargs["global_rope_scaling_factor"] = float(scaling)
    return kwargs


# llama.cpp's converters do not store Gemma 2/3's query_pre_attn_scalar; its loader keys the
# attention scale on the model size instead: 1/sqrt(hidden / heads) for the 27B models (46
# layers for Gemma 2, 62 for Gemma 3, whose query_pre_attn_scalar is hidden / heads: 144, 168),
# 1/sqrt(head_dim) for every other size. A file that does carry `{arch}.attention.scale` wins.
_HIDDEN_OVER_HEADS_LAYERS = {"gemma2": 46, "gemma3": 62}


def query_pre_attn_scalar(arch: str, key, kwargs: dict) -> float | None:
    """The query scale's denominator (queries x its -1/2 power) as llama.cpp runs this file;
    None means head_dim."""
    scale = key("attention.scale")
    if scale:
        return 1.0 / float(scale) ** 2
    if kwargs["num_layers"] == _HIDDEN_OVER_HEADS_LAYERS.get(arch):
        return kwargs["hidden_dim"] / kwargs["num_heads"]
    return None


def tensor_readers(reader, num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """{our path: () -> float32 numpy in our layout, or a `RowReader`}: a tensor is dequantised
    only when its reader is called, so a loader can place the file tensor by tensor instead of
    holding all of it dequantised (float32 is ~7x a Q4_K file). The embedding, a matrix kept in
    the file's layout, comes as a `RowReader`: each process dequantises its devices' rows."""
    out = {}
    for t in reader.tensors:
        name = t.name.removesuffix(".weight")
        if name == "token_embd":
            path, layout = "token_embedding/embeddings", None
        elif name == "output_norm":
            path, layout = "final_normalization/scale", _norm
        elif name == "output":
            continue  # an untied copy of the embedding some converters add; Gemma ties them
        elif name.startswith("blk."):
            _, i, part = name.split(".", 2)
            path, layout = _block_entry(f"decoder_block_{int(i)}", part, num_heads, num_kv_heads, head_dim)
        else:
            raise UserError(f"unexpected tensor {t.name} in a Gemma GGUF file")
        if layout is None and len(t.shape) == 2:
            rows = functools.partial(_dequantise, t, None)
            out[path] = functools.partial(RowReader, tuple(t.shape), rows)
        else:
            out[path] = functools.partial(_dequantise, t, layout)
    return out


# Rows dequantised at a time: llama.cpp's dequantiser makes several float32 temporaries of its
# input's size, which for the whole 262k x 640 Q8_0 embedding peaked at 1.5 GB above the
# 0.67 GB result; a block of rows keeps them to tens of MB.
DEQUANT_ROWS = 16384


def _dequantise(t, layout, start: int = 0, stop: int | None = None):
    """Tensor `t` as float32 in our layout; of a matrix, rows [start, stop) only."""
    import gguf
    try:
        if t.data.ndim < 2:  # a vector (its data may be bytes): whole
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        else:
            rows = _row_dequantiser(t.tensor_type)
            stop = t.shape[0] if stop is None else stop
            w = np.empty((stop - start, *t.shape[1:]), np.float32)  # numpy's shape (gguf_file)
            for r in range(start, stop, DEQUANT_ROWS):
                end = min(r + DEQUANT_ROWS, stop)
                w[r - start:end - start] = rows(t.data[r:end])
    except Exception as e:
        raise UserError(f"cannot read tensor {t.name} ({t.tensor_type.name}): {e}; "
                        "the file is truncated or uses an unsupported quantisation") from None
    return w if layout is None else layout(w)


def _row_dequantiser(kind):
    """-> rows (file bytes or typed, [R, ...]) -> float32 [R, ...], llama.cpp's own per-block
    dequantisation of `kind` applied to all the rows at once.

    `gguf.quants.dequantize` runs a block format's function over groups of 16 rows, and on the
    real Gemma 3 270M's GGUF those per-group numpy calls were most of its time: 2.37 -> 0.84 s
    for the file's tensors, its Q8_0 embedding 1.64 -> 0.50 s (ad hoc). The function and so
    the values are the same, bit for bit (tests/test_gguf.py)."""
    import gguf
    quant = getattr(gguf.quants, kind.name, None)  # the format's class, named after it
    if quant is None or not hasattr(quant, "dequantize_rows"):  # typed (F32, F16, ...)
        return lambda rows: gguf.quants.dequantize(rows, kind)
    quant.init_grid()  # the lookup grid of the IQ formats, as `dequantize` builds it first
    return quant.dequantize_rows


def _norm(w):
    return w - 1.0


def _block_entry(block, part, n, k, d):
    """-> (our path, w -> our layout) of tensor `blk.N.<part>`."""
    if part in _NORMS:
        return f"{block}/{_NORMS[part]}", _norm
    if part in ("attn_q", "attn_k", "attn_v"):
        heads = n if part == "attn_q" else k
        name = {"attn_q": "query", "attn_k": "key", "attn_v": "value"}[part]
        return (f"{block}/attention/{name}/kernel",
                lambda w: w.reshape(heads, d, w.shape[-1]).transpose(0, 2, 1))
    if part == "attn_output":
        return (f"{block}/attention/attention_output/kernel",
                lambda w: w.T.reshape(n, d, w.shape[0]))
    if part in ("ffn_gate", "ffn_up", "ffn_down"):
        name = {"ffn_gate": "ffw_gating", "ffn_up": "ffw_gating_2", "ffn_down": "ffw_linear"}[part]
        return f"{block}/{name}/kernel", lambda w: np.ascontiguousarray(w.T)
    raise UserError(f"unexpected tensor blk.?.{part} in a Gemma GGUF file")


def tokenizer_proto(reader) -> bytes:
    """Rebuild the sentencepiece model from the GGUF vocabulary (tokens, scores, types)."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2
    tokens = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores")
    types = _field(reader, "tokenizer.ggml.token_type")
    if _field(reader, "tokenizer.ggml.model") != "llama":
        raise UserError("only sentencepiece ('llama') GGUF vocabularies are supported")
    m = sp_pb2.ModelProto()
    m.trainer_spec.model_type = sp_pb2.TrainerSpec.BPE  # Gemma's vocabulary is a sentencepiece BPE model
    m.trainer_spec.vocab_size = len(tokens)
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = int(_field(reader, "tokenizer.ggml.unknown_token_id", 3))
    m.trainer_spec.bos_id = int(_field(reader, "tokenizer.ggml.bos_token_id", 2))
    m.trainer_spec.eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id", 1))
    m.trainer_spec.pad_id = int(_field(reader, "tokenizer.ggml.padding_token_id", 0))
    m.trainer_spec.unk_piece, m.trainer_spec.bos_piece = "<unk>", "<bos>"
    m.trainer_spec.eos_piece, m.trainer_spec.pad_piece = "<eos>", "<pad>"
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False))
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    # llama.cpp uses sentencepiece's type enum, with two departures undone here so encoding equals
    # the original tokenizer (checked against HF transformers on the same file): user-defined
    # pieces carry literal spaces where sentencepiece matches escaped "▁", and markup tokens such
    # as <start_of_turn> are CONTROL (never matched in text) where users expect them parsed.
    special = {m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id}
    for i, (tok, score, typ) in enumerate(zip(tokens, scores, types)):
        typ = int(typ)
        if i == m.trainer_spec.unk_id:
            typ = sp_pb2.ModelProto.SentencePiece.UNKNOWN
        elif typ == sp_pb2.ModelProto.SentencePiece.CONTROL and i not in special:
            typ = sp_pb2.ModelProto.SentencePiece.USER_DEFINED
        if typ == sp_pb2.ModelProto.SentencePiece.USER_DEFINED:
            tok = tok.replace(" ", "\u2581")
        piece = m.pieces.add()
        piece.piece, piece.score, piece.type = tok, float(score), typ
    return m.SerializeToString()
