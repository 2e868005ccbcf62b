"""Hugging Face folders both ways, checked live by transformers on tiny random models built here:
HF -> jaxlm logits, jaxlm -> HF logits, HF -> jaxlm -> HF tensors, Keras preset -> HF vs
KerasHub, tokenizers, sharded / bfloat16 / multimodal checkpoints, and bad input."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from conftest import random_norm_scales, ragged_batch
from test_convert import run_cli  # one error line, exit code 2
from jaxlm.convert.__main__ import main as convert_main
from jaxlm.convert.hf_tensors import Reader
from jaxlm.errors import UserError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402

VOCAB, WIDTH, LENGTHS = 512, 13, [13, 8, 2]  # window 4 < 13: local layers really cut context
CONFIGS = {
    "gemma": lambda: transformers.GemmaConfig(  # multi-query attention
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, rope_theta=5000.0),
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=4),
    "gemma3": lambda: transformers.Gemma3TextConfig(  # 7 layers: local, global (5) and local again
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        rope_theta=30_000.0, rope_local_base_freq=2000.0, query_pre_attn_scalar=8,
        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "roberta": lambda: transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=34, layer_norm_eps=1e-5, type_vocab_size=1),
}


def auto_class(kind):
    return transformers.AutoModelForMaskedLM if kind == "roberta" else transformers.AutoModelForCausalLM


def build(kind, seed=0, **overrides):
    """A random HF model of CONFIGS[kind] with non-trivial norms, biases and token types, and
    weights large enough (std 0.2, not 0.02) that attention is far from uniform."""
    torch.manual_seed(seed)
    config = CONFIGS[kind]()
    config.initializer_range = 0.2
    for k, v in overrides.items():
        setattr(config, k, v)
    model = auto_class(kind).from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or "bias" in name or "token_type" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def hf_logits(model, ids, mask):
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask.astype("int64")))
    return out.logits.float().numpy()


def jaxlm_logits(model, params, ids, mask):
    return np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)), np.float32)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """kind -> (folder, HF model), built once per module."""
    made = {}

    def get(kind):
        if kind not in made:
            model = build(kind)
            path = str(tmp_path_factory.mktemp(f"hf_{kind}"))
            model.save_pretrained(path)
            made[kind] = path, model
        return made[kind]
    return get


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_hf_to_jaxlm_to_hf(kind, hf_folder, tmp_path):
    """HF logits == jaxlm's; the export loads in transformers with no arguments and gives the
    same logits; its tensors are the original ones bit for bit."""
    path, hf_model = hf_folder(kind)
    ids, mask = ragged_batch(VOCAB, LENGTHS, WIDTH)
    want = hf_logits(hf_model, ids, mask)
    model, params = jaxlm.load(path)
    assert np.abs(jaxlm_logits(model, params, ids, mask) - want)[mask].max() <= 1e-4

    out = str(tmp_path / "export")
    jaxlm.save(out, model, params, format="hf")
    back = auto_class(kind).from_pretrained(out).eval()
    assert type(back) is type(hf_model)
    assert np.abs(hf_logits(back, ids, mask) - want)[mask].max() <= 1e-4

    original, exported = load_file(os.path.join(path, "model.safetensors")), \
        load_file(os.path.join(out, "model.safetensors"))
    if kind == "roberta":  # no token-type table in jaxlm: row 0 lives in the position rows
        pos, typ = "roberta.embeddings.position_embeddings.weight", "roberta.embeddings.token_type_embeddings.weight"
        np.testing.assert_array_equal(exported[pos][2:], original[pos][2:] + original[typ][0])
        assert not exported[pos][:2].any() and not exported[typ].any()
        original = {k: v for k, v in original.items() if k not in (pos, typ)}
    assert set(original) <= set(exported)
    for key, tensor in original.items():
        np.testing.assert_array_equal(exported[key], tensor, err_msg=key)
    # and the switches are live: the config really carries the window / caps / RoPE bases
    if kind != "roberta":
        cfg = model.config
        other = type(model)(cfg.replace(rope_base=cfg.rope_base * 2, local_rope_base=None))
        assert np.abs(jaxlm_logits(other, params, ids, mask) - want)[mask].max() > 1e-3


def gemma3_backbone():
    import keras_hub
    return keras_hub.models.Gemma3Backbone(
        vocabulary_size=VOCAB, image_size=None, num_layers=7, num_query_heads=4, num_key_value_heads=1,
        hidden_dim=32, intermediate_dim=48, head_dim=8, use_post_ffw_norm=True,
        use_post_attention_norm=True, use_sliding_window_attention=True, sliding_window_size=4,
        vision_encoder=None)


@pytest.mark.parametrize("kind", ["gemma", "gemma3"])
def test_keras_preset_to_hf_gives_kerashub_logits(kind, keras_gemma_preset, tmp_path, capsys):
    """A KerasHub user's path to vLLM: preset -> `python -m jaxlm.convert --to=hf` -> transformers."""
    import keras
    if kind == "gemma":
        preset, backbone = keras_gemma_preset("hf_gemma1", num_key_value_heads=1)
    else:
        keras.utils.set_random_seed(3)
        backbone = gemma3_backbone()
        random_norm_scales(backbone)
        preset = str(tmp_path / "preset")
        backbone.save_to_preset(preset)
    ids, mask = ragged_batch(backbone.vocabulary_size, LENGTHS, WIDTH)
    hidden = backbone({"token_ids": ids, "padding_mask": mask})
    want = np.asarray(backbone.token_embedding(hidden, reverse=True), np.float32)
    out = str(tmp_path / "hf")
    convert_main([preset, out, "--to=hf"])
    printed = capsys.readouterr().out
    assert "AutoModelForCausalLM.from_pretrained" in printed
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert np.abs(hf_logits(hf_model, ids, mask) - want)[mask].max() <= 1e-4
    if kind == "gemma":  # the preset's tokenizer came along and encodes as ours
        ours = jaxlm.load_tokenizer(preset)
        theirs = transformers.AutoTokenizer.from_pretrained(out)
        for text in TEXTS:
            assert theirs(text)["input_ids"] == ours.encode(text), text


# --- tokenizers ----------------------------------------------------------------------------------

TEXTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)", "The capital of France is",
         "  two  spaces, tabs\tand ünïcode 😀", "<start_of_turn>user\nhi<end_of_turn>"]


@pytest.fixture(scope="module")
def gemma_style_spm():
    """A sentencepiece model trained as Gemma's: BPE, no normalization, byte fallback."""
    import io

    import sentencepiece as spm
    from jaxlm.corpus import pydoc_corpus
    from jaxlm.tokenizer import Tokenizer
    out = io.BytesIO()
    lines = [l for l in pydoc_corpus().splitlines() if l.strip()][:4000]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, vocab_size=VOCAB, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
        bos_piece="<bos>", unk_piece="<unk>", byte_fallback=True, character_coverage=1.0,
        num_threads=1, minloglevel=2, normalization_rule_name="identity", add_dummy_prefix=False,
        remove_extra_whitespaces=False, split_digits=True,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"])
    return Tokenizer(out.getvalue())


def roberta_bpe():
    from pydoc_data import topics
    from tokenizers import ByteLevelBPETokenizer
    from jaxlm.bpe import BPETokenizer
    trainer = ByteLevelBPETokenizer(add_prefix_space=False)
    trainer.train_from_iterator([topics.topics[k] for k in sorted(topics.topics)][:30], vocab_size=VOCAB - 1,
                                min_frequency=2, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    vocab = trainer.get_vocab()
    vocab["<mask>"] = len(vocab)
    merges = json.loads(trainer._tokenizer.to_str())["model"]["merges"]
    return BPETokenizer(vocab, [m if isinstance(m, str) else " ".join(m) for m in merges])


@pytest.mark.parametrize("which", ["gemma_bpe", "unigram", "roberta_bpe"])
def test_tokenizer_files_encode_as_ours(which, gemma_style_spm, spm_tokenizer, tmp_path):
    """Our files -> AutoTokenizer encodes as we do -> jaxlm reads them back; and the lone
    tokenizer.json transformers 5 saves in their place reads back the same."""
    from jaxlm.convert import hf_tokenizer
    ours = {"gemma_bpe": lambda: gemma_style_spm, "unigram": lambda: spm_tokenizer,
            "roberta_bpe": roberta_bpe}[which]()
    hf_tokenizer.write_tokenizer(str(tmp_path / "ours"), ours)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "ours"))
    texts = TEXTS + ["a <mask> b"] * (which == "roberta_bpe")
    for text in texts:
        assert theirs(text)["input_ids"] == ours.encode(text), text
    folders = [tmp_path / "ours"]
    if which != "unigram":  # (transformers saves a Unigram model as tokenizer.json only, which jaxlm does not read)
        theirs.save_pretrained(str(tmp_path / "resaved"))
        assert "tokenizer.json" in os.listdir(tmp_path / "resaved")
        folders.append(tmp_path / "resaved")
    for folder in folders:
        again = jaxlm.load_tokenizer(str(folder))
        assert type(again) is type(ours) and all(again.encode(t) == ours.encode(t) for t in texts), folder


# --- other checkpoint shapes ---------------------------------------------------------------------

def test_sharded_bfloat16_and_our_sharded_writer(hf_folder, tmp_path):
    """A sharded bfloat16 save_pretrained loads exactly; our writer's shards load in transformers."""
    import ml_dtypes
    _, hf_model = hf_folder("gemma2")
    src = str(tmp_path / "bf16")
    hf_model.to(torch.bfloat16).save_pretrained(src, max_shard_size="20KB")
    hf_model.to(torch.float32)
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json"))
    model, params = jaxlm.load(src, dtype="bfloat16")
    q = params["decoder_block_1"]["attention"]["query"]["kernel"]
    want = hf_model.model.layers[1].self_attn.q_proj.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(q, np.float32), want.reshape(4, 8, 32).transpose(0, 2, 1))
    from jaxlm.convert import hf
    out = str(tmp_path / "ours")
    files = hf.write_folder(out, model.config, params, max_shard_bytes=20_000)
    assert "model.safetensors.index.json" in os.listdir(out) and len(files) > 3
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.dtype == torch.bfloat16
    assert back.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().tobytes() == \
        want.astype(ml_dtypes.bfloat16).astype(np.float32).tobytes()
    from jaxlm.convert.hf_tensors import Reader
    with Reader(src) as theirs, Reader(out) as ours:  # bfloat16 -> jaxlm -> bfloat16: bit for bit
        assert theirs.keys() == ours.keys()
        for key in theirs.keys():
            a, b = theirs.get(key), ours.get(key)
            assert a.dtype == b.dtype == ml_dtypes.bfloat16 and a.tobytes() == b.tobytes(), key
    hf.write_folder(out, model.config, params)  # again, unsharded: the old shards must go
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_multimodal_gemma3_text_tower(tmp_path):
    """The text tower of a Gemma3ForConditionalGeneration checkpoint (vision tower skipped)."""
    torch.manual_seed(0)
    text = CONFIGS["gemma3"]()
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    mm = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))
    mm.save_pretrained(str(tmp_path))
    model, params = jaxlm.load(str(tmp_path))
    assert model.config.use_query_key_norm and model.config.num_layers == 7
    lm = mm.model.language_model
    np.testing.assert_array_equal(np.asarray(params["token_embedding"]["embeddings"]),
                                  lm.embed_tokens.weight.detach().numpy())
    np.testing.assert_array_equal(np.asarray(params["decoder_block_6"]["ffw_linear"]["kernel"]),
                                  lm.layers[6].mlp.down_proj.weight.detach().numpy().T)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_missing_config_keys_take_transformers_defaults(kind, hf_folder, tmp_path):
    """A terse config.json means what transformers makes of it (Gemma 2: caps 50 / 30, query
    scalar 256 -- not jaxlm's defaults)."""
    src, _ = hf_folder(kind)
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "config.json") as f:
        c = json.load(f)
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                "sliding_window", "rope_parameters", "rope_theta", "rope_scaling", "rope_local_base_freq"):
        c.pop(key, None)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(c, f)
    theirs = transformers.AutoConfig.from_pretrained(str(tmp_path))
    from jaxlm.convert import hf
    _, ours = hf.read_config(str(tmp_path))
    assert ours.attention_logit_soft_cap == theirs.attn_logit_softcapping
    assert ours.final_logit_soft_cap == theirs.final_logit_softcapping
    assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar == 256
    assert ours.sliding_window_size == theirs.sliding_window
    rope = theirs.rope_parameters
    if kind == "gemma3":
        assert (ours.rope_base, ours.local_rope_base) == (rope["full_attention"]["rope_theta"],
                                                         rope["sliding_attention"]["rope_theta"])
    else:
        assert ours.rope_base == rope["rope_theta"]


def test_tensors_land_in_their_shardings(hf_folder):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    path, _ = hf_folder("gemma")
    mesh = Mesh(np.asarray(jax.devices()).reshape(1, -1), ("batch", "model"))
    sharded = NamedSharding(mesh, P("model"))

    def placement(p, shape):
        return sharded if p == "token_embedding/embeddings" else NamedSharding(mesh, P())
    blocks, rows = [], Reader.rows
    with pytest.MonkeyPatch.context() as mp:  # the table is read by each device's rows
        mp.setattr(Reader, "rows", lambda self, key, *r: blocks.append(r) or rows(self, key, *r))
        _, params = jaxlm.load(path, placement=placement)
    n = len(jax.devices())
    assert sorted(blocks) == [(i * VOCAB // n, (i + 1) * VOCAB // n) for i in range(n)]
    emb = params["token_embedding"]["embeddings"]
    assert emb.sharding == sharded and len(emb.addressable_shards) == n
    assert emb.addressable_shards[0].data.shape == (VOCAB // n, 32)
    _, whole = jaxlm.load(path)
    np.testing.assert_array_equal(np.asarray(emb), np.asarray(whole["token_embedding"]["embeddings"]))


def test_reading_streams_one_tensor_at_a_time(tmp_path):
    import tracemalloc
    from jaxlm import families
    from jaxlm.convert import hf
    from jaxlm.loading import abstract_params
    build("gemma", num_hidden_layers=8, intermediate_size=256).save_pretrained(str(tmp_path))
    family, config = hf.read_config(str(tmp_path))
    shapes = abstract_params(family.module_cls(config), config)
    sizes = [int(np.prod(s.shape)) * 4 for s in shapes.values()]
    tracemalloc.start()
    hf.read_params(str(tmp_path), family, config, shapes)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(sizes) > 8 * max(sizes)
    assert peak < 3 * max(sizes) + 2**20, (peak, max(sizes), sum(sizes))
    assert families.by_config(config).name == "gemma"


# --- bad input: one clear line, exit code 2 ------------------------------------------------------

@pytest.fixture
def hf_copy(hf_folder, tmp_path):
    src, _ = hf_folder("gemma2")
    dst = str(tmp_path / "model")
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)


def test_safetensors_without_config(hf_copy, tmp_path, capsys):
    os.remove(os.path.join(hf_copy, "config.json"))
    assert "no config.json" in run_cli([hf_copy, str(tmp_path / "out")], capsys)


def test_unknown_model_type(hf_copy, tmp_path, capsys):
    edit_config(hf_copy, model_type="llama")
    err = run_cli([hf_copy, str(tmp_path / "out")], capsys)
    assert "'llama' is not supported" in err and "gemma2" in err


def test_tensor_shape_disagrees_with_config(hf_copy, tmp_path, capsys):
    edit_config(hf_copy, intermediate_size=96)
    err = run_cli([hf_copy, str(tmp_path / "out")], capsys)
    assert "shape" in err and "config" in err and "mlp" in err


def test_truncated_safetensors(hf_copy, tmp_path, capsys):
    weights = os.path.join(hf_copy, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    assert "truncated" in run_cli([hf_copy, str(tmp_path / "out"), "--to=hf"], capsys)


def test_non_empty_out_is_never_clobbered(hf_copy, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert "not empty" in run_cli([hf_copy, str(out), "--to=hf"], capsys)
    assert (out / "precious.txt").read_text() == "keep me" and len(os.listdir(out)) == 1


def test_config_transformers_cannot_run_writes_nothing(tmp_path):
    from models.gemma import GemmaConfig
    model = jaxlm.load("gemma_tiny", abstract=True)[0]
    capped = type(model)(GemmaConfig(**{**model.config.to_dict(), "final_logit_soft_cap": 30.0}))
    with pytest.raises(UserError, match="final_logit_soft_cap") as e:
        jaxlm.save(str(tmp_path / "out"), capped, {}, format="hf")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_a_tensor_is_written_from_its_own_bytes(tmp_path):
    """Writing a safetensors file holds no copy of a tensor beyond the tensor itself (a
    `tobytes()` copy cost 0.67 GB more at the export of Gemma 3 270M's embedding)."""
    import tracemalloc
    import ml_dtypes
    from jaxlm.convert.hf_tensors import Reader, write_file
    big = np.arange(4 << 20, dtype=np.float32).reshape(1024, 4096)  # 16 MiB
    small = np.arange(12, dtype=ml_dtypes.bfloat16).reshape(3, 4).T  # not contiguous
    specs = [("big", big.shape, "float32"), ("small", small.shape, "bfloat16")]
    tracemalloc.start()
    try:
        write_file(str(tmp_path / "model.safetensors"), specs, iter([big, small]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (4 << 20), peak  # a quarter of the big tensor
    with Reader(str(tmp_path)) as r:
        assert r.get("big").tobytes() == big.tobytes() and r.get("small").tobytes() == small.tobytes()


def test_writing_sharded_weights_keeps_no_host_copy(tmp_path):
    """Writing weights split over 8 devices leaves no host copy behind (`jax.device_get`
    cached one on every array: the demo's whole 1.07 GB until the run ended), and the files
    read back equal to the weights."""
    import tracemalloc
    import sharding
    from jaxlm.convert import hf
    mesh = sharding.make_mesh("1x8")
    cfg = jaxlm.load("gemma_tiny", abstract=True)[0].config
    model, params = jaxlm.load("gemma_tiny", placement=sharding.placement(
        mesh, sharding.rules_for(cfg), quiet=True))
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    tracemalloc.start()
    try:
        hf.write_folder(str(tmp_path / "hf"), model.config, params)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < total / 8, (kept, total)
    _, back = jaxlm.load(str(tmp_path / "hf"))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_block_for_the_gather_leaves_the_split_axis_split():
    """Across processes a tensor is gathered a block at a time, cut along an axis its sharding
    keeps whole: a block of rows of the embedding split over the vocabulary made the
    partitioner all-gather the whole embedding onto every device first (4.3 GB per process
    for the demo's, 2 processes x 4 devices)."""
    import sharding
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxlm.convert import hf
    mesh = sharding.make_mesh("1x8")
    x = jax.device_put(jnp.zeros((1024, 64)), NamedSharding(mesh, P("model", None)))
    assert hf.gather_axis(x) == 1
    assert hf.gather_axis(jax.device_put(x, NamedSharding(mesh, P(None, "model")))) == 0
    assert hf.gather_axis(jax.device_put(jnp.zeros((8, 16, 64)), NamedSharding(mesh, P(None, "model", None)))) == 2
    hlo = hf._block.lower(x, 0, 16, hf.gather_axis(x)).compile().as_text()
    assert "all-gather" not in hlo and "all-reduce" not in hlo
    assert "all-gather" in hf._block.lower(x, 0, 16, 0).compile().as_text()  # the cut it avoids


def test_a_tensor_is_written_a_block_of_rows_at_a_time(tmp_path):
    """`Rows` (a multi-host export's gathered blocks) write the same bytes as the whole array,
    and blocks that do not add up to the header's size fail the file."""
    from jaxlm.convert.hf_tensors import Reader, Rows, write_file
    whole = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    specs = [("w", whole.shape, "float32")]
    write_file(str(tmp_path / "model.safetensors"), specs,
               iter([Rows(whole.shape, whole.dtype, (whole[i:i + 3] for i in range(0, 10, 3)))]))
    with Reader(str(tmp_path)) as r:
        np.testing.assert_array_equal(r.get("w"), whole)
    with pytest.raises(RuntimeError, match="bytes written"):
        write_file(str(tmp_path / "short.safetensors"), specs,
                   iter([Rows(whole.shape, whole.dtype, iter([whole[:9]]))]))
    assert not os.path.exists(tmp_path / "short.safetensors")


def test_one_process_streams_a_row_split_tensor_from_its_shards(tmp_path, monkeypatch):
    """On one process a tensor split on its first axis goes to the writer as its shards' own
    buffers, never assembled whole on the host (the demo's 0.67 GB embedding raised the
    export's peak by 0.6 GB), and the file holds the same bytes."""
    from unittest import mock
    import sharding
    from jaxlm.convert import hf
    mesh = sharding.make_mesh("1x8")
    cfg = jaxlm.load("gemma_tiny", abstract=True)[0].config
    model, params = jaxlm.load("gemma_tiny", placement=sharding.placement(
        mesh, sharding.rules_for(cfg), quiet=True))
    table = params["token_embedding"]["embeddings"]
    assert [n != m for n, m in zip(table.shape, table.sharding.shard_shape(table.shape))] == [True, False]
    monkeypatch.setattr(hf, "GATHER_BYTES", 0)
    with mock.patch.object(hf, "to_host", wraps=hf.to_host) as whole:
        hf.write_folder(str(tmp_path / "hf"), model.config, params)
    assert whole.call_count and table.shape not in [c.args[0].shape for c in whole.call_args_list]
    _, back = jaxlm.load(str(tmp_path / "hf"))
    np.testing.assert_array_equal(np.asarray(back["token_embedding"]["embeddings"]), np.asarray(table))
