"""jaxlm.generate against KerasHub's GemmaCausalLM.generate, live, on a small random Gemma."""
import numpy as np
import pytest

import jaxlm
from jaxlm import decode
from jaxlm.errors import UserError
from jaxlm.generate import generate, main, place

PROMPTS = ["The quick brown fox", "def", "Return the value of the attribute named by the string",
           "import os"]
MAX_LENGTH = 20


@pytest.fixture(scope="module")
def gemma(keras_gemma_preset):
    """(preset path, KerasHub GemmaCausalLM, jaxlm model, params, tokenizer) on the same weights."""
    import keras_hub
    path, _ = keras_gemma_preset(name="gen", num_key_value_heads=1)
    causal = keras_hub.models.GemmaCausalLM.from_preset(path)
    model, params = jaxlm.load(path)
    return path, causal, model, params, jaxlm.load_tokenizer(path)


def test_greedy_matches_kerashub_strings(gemma):
    _, causal, model, params, tok = gemma
    for stop in (None, "auto"):
        ours = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH, stop_token_ids=stop)
        theirs = causal.generate(PROMPTS, max_length=MAX_LENGTH, stop_token_ids=stop)
        assert ours == list(theirs)
    ours = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH, strip_prompt=True)
    assert ours == list(causal.generate(PROMPTS, max_length=MAX_LENGTH, strip_prompt=True))
    assert all(ours)  # something was generated
    one = generate(model, params, tok, PROMPTS[0], max_length=MAX_LENGTH, strip_prompt=True)
    assert isinstance(one, str) and one == ours[0]


def test_stops_at_eos_per_row_like_kerashub(gemma):
    """Swap the EOS row of the tied embedding with a token greedy produces mid-completion:
    the model then emits EOS exactly there, so stopping is deterministic."""
    _, causal, model, params, tok = gemma
    ids, _ = decode.generate_ids(model, params, *_encode(tok, PROMPTS), MAX_LENGTH)
    lengths = [len(tok.encode(p)) for p in PROMPTS]
    in_prompts = set(_encode(tok, PROMPTS)[0].ravel().tolist())
    # A token some row emits once, neither first nor last, that no prompt holds.
    row, at = next((r, i) for r in range(len(PROMPTS))
                   for new in [ids[r, lengths[r]:].tolist()]
                   for i, t in enumerate(new[:-1]) if i > 0 and new.count(t) == 1
                   and t not in in_prompts and t not in tok.special_ids)
    target = int(ids[row, lengths[row] + at])
    emb = np.array(params["token_embedding"]["embeddings"])
    emb[[target, tok.eos_id]] = emb[[tok.eos_id, target]]
    swapped = {**params, "token_embedding": {"embeddings": emb}}
    kvar = causal.backbone.token_embedding.embeddings
    original = np.array(kvar.numpy())
    kvar.assign(emb)
    outputs = {}
    try:
        for stop in ("auto", None):
            ours = generate(model, swapped, tok, PROMPTS, max_length=MAX_LENGTH,
                            stop_token_ids=stop)
            assert ours == list(causal.generate(PROMPTS, max_length=MAX_LENGTH,
                                                stop_token_ids=stop))
            outputs[stop] = ours
        # That row stopped at its EOS, rows without that token ran on to max_length.
        assert outputs["auto"][row] != outputs[None][row]
        ids_stop, mask = decode.generate_ids(model, swapped, *_encode(tok, PROMPTS), MAX_LENGTH,
                                             stop_token_ids=(tok.eos_id,))
        end = lengths[row] + at
        assert mask[row].sum() == end + 1 and ids_stop[row, end] == tok.eos_id
        assert (ids_stop[row, end + 1:] == 0).all()
        assert mask.sum(axis=1).max() == MAX_LENGTH
    finally:
        kvar.assign(original)


def _encode(tok, prompts):
    enc = [tok.encode(p) for p in prompts]
    ids = np.zeros((len(enc), max(map(len, enc))), np.int32)
    for row, e in zip(ids, enc):
        row[:len(e)] = e
    return ids, np.array([len(e) for e in enc])


def test_ragged_rows_equal_rows_alone(gemma):
    _, _, model, params, tok = gemma
    batch = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH, stop_token_ids=None)
    alone = [generate(model, params, tok, p, max_length=MAX_LENGTH, stop_token_ids=None)
             for p in PROMPTS]
    assert batch == alone
    ids, mask = decode.generate_ids(model, params, *_encode(tok, PROMPTS), MAX_LENGTH)
    assert ids.shape == mask.shape == (len(PROMPTS), MAX_LENGTH) and mask.all()


def test_prompt_length_changes_within_a_bucket_compile_once(gemma):
    _, _, model, params, tok = gemma
    words = "the value of the attribute named by the string".split()
    prompts = [" ".join(words[:n]) for n in (1, 2, 4, 6, 8)]
    lengths = {len(tok.encode(p)) for p in prompts}
    assert len(lengths) == 5 and max(lengths) <= decode.MIN_PROMPT_BUCKET
    decode.clear_cache()
    before = decode.TRACES
    for p, max_length in zip(prompts, (17, 20, 24, 30, 32)):  # total lengths share a bucket too
        generate(model, params, tok, [p, p], max_length=max_length, seed=len(p))
    assert decode.TRACES - before == 1


def test_batches_past_eight_rows_pad_to_a_multiple_of_eight(gemma):
    """40 prompts (the demo's evaluation) run as 40 rows, not 64; 33 share their program."""
    from unittest import mock
    assert [decode.batch_bucket(n) for n in (1, 3, 5, 8, 9, 33, 40, 41)] == [1, 4, 8, 8, 16, 40, 40, 48]
    _, _, model, params, tok = gemma
    decode.clear_cache()
    before = decode.TRACES
    with mock.patch.object(decode, "_compiled", wraps=decode._compiled) as compiled:
        for n in (33, 40):
            ids, _ = decode.generate_ids(model, params, *_encode(tok, (PROMPTS * 40)[:n]), MAX_LENGTH)
            assert ids.shape[0] == n
    assert decode.TRACES - before == 1
    assert [c.args[2] for c in compiled.call_args_list] == [40, 40]


@pytest.mark.parametrize("shape", ["1x8", "2x4"])
def test_mesh_gives_the_unsharded_strings(gemma, shape):
    import jax
    import sharding
    _, _, model, params, tok = gemma
    expected = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH)
    mesh = sharding.make_mesh(shape)
    got = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH, mesh=mesh)
    assert got == expected
    if shape == "2x4":  # per-row seeds are split on `batch` with the rows
        kwargs = dict(max_length=MAX_LENGTH, sampler="top_k", seed=[5, 6, 7, 8])
        assert generate(model, params, tok, PROMPTS, mesh=mesh, **kwargs) == \
            generate(model, params, tok, PROMPTS, **kwargs)
    placed = place(model, params, mesh)
    kernel = placed["decoder_block_0"]["ffw_gating"]["kernel"]
    assert len(kernel.sharding.device_set) == 8 and not kernel.sharding.is_fully_replicated
    # weights already on the mesh under another table are decoded where they are
    seeded = jax.tree.map(jax.device_put, params, sharding.named_shardings(
        params, sharding.rules_for(model.config, "seed"), mesh))
    assert all(a is b for a, b in zip(jax.tree.leaves(place(model, seeded, mesh)), jax.tree.leaves(seeded)))
    assert generate(model, seeded, tok, PROMPTS, max_length=MAX_LENGTH, mesh=mesh) == expected


def test_lora_adapters_are_merged_before_decoding(gemma):
    import jax
    from jaxlm import lora
    _, _, model, params, tok = gemma
    adapters = lora.init(params, rank=2, key=jax.random.key(0))
    # Fresh adapters are a no-op (B = 0); make them matter.
    adapters = jax.tree.map(lambda x: x + 0.5, adapters)
    merged = lora.merge(params, adapters)
    with_adapters = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH,
                             adapters=adapters)
    assert with_adapters == generate(model, merged, tok, PROMPTS, max_length=MAX_LENGTH)
    assert with_adapters != generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH)


def test_stream_receives_tokens_as_they_are_produced(gemma):
    _, _, model, params, tok = gemma
    seen = []
    ids, _ = decode.generate_ids(model, params, *_encode(tok, PROMPTS[:2]), MAX_LENGTH,
                                 stream=lambda pos, tokens: seen.append((pos, tokens.copy())))
    start = min(len(tok.encode(p)) for p in PROMPTS[:2])
    assert [pos for pos, _ in seen] == list(range(start, MAX_LENGTH))
    for pos, tokens in seen:
        assert tokens.shape == (2,)
        for row in range(2):
            assert tokens[row] in (-1, ids[row, pos])
            if pos >= len(tok.encode(PROMPTS[row])):
                assert tokens[row] == ids[row, pos]


def test_samplers_are_seeded(gemma):
    _, _, model, params, tok = gemma
    a = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH, sampler="top_k", seed=1)
    b = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH, sampler="top_k", seed=1)
    c = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH, sampler="random", seed=2)
    assert a == b and a != c


def test_per_row_seeds_draw_as_each_prompt_alone(gemma):
    _, _, model, params, tok = gemma
    seeds = [7, 3, 7, 11]
    for sampler in ("top_k", "random"):
        batch = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH, sampler=sampler,
                         seed=seeds, stop_token_ids=None)
        alone = [generate(model, params, tok, p, max_length=MAX_LENGTH, sampler=sampler, seed=s,
                          stop_token_ids=None) for p, s in zip(PROMPTS, seeds)]
        assert batch == alone
    # One int keys the batch as a whole (KerasHub's behaviour): rows are not drawn as alone.
    shared = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH, sampler="random",
                      seed=7, stop_token_ids=None)
    alone = [generate(model, params, tok, p, max_length=MAX_LENGTH, sampler="random", seed=7,
                      stop_token_ids=None) for p in PROMPTS]
    assert shared != alone
    greedy = generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH)
    assert generate(model, params, tok, PROMPTS, max_length=MAX_LENGTH, seed=seeds) == greedy


def test_bad_input_is_one_clear_line(gemma):
    _, _, model, params, tok = gemma
    cases = [(dict(prompts=["word " * 40]), "max_length"),
             (dict(prompts=[]), "no prompts"),
             (dict(prompts=["hi"], sampler="beam"), "unknown sampler"),
             (dict(prompts=["hi"], stop_token_ids="eos"), "stop_token_ids"),
             (dict(prompts=["hi", "yo"], sampler="top_k", seed=[1]), "one per prompt"),
             (dict(prompts=["hi"], sampler="top_k", seed=1.5), "one per prompt"),
             (dict(prompts=["hi"], sampler="top_k", seed=2**40), "int32")]
    for kwargs, words in cases:
        with pytest.raises(UserError) as e:
            generate(model, params, tok, max_length=MAX_LENGTH, **kwargs)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_cli_prints_completions_and_fails_in_one_line(gemma, tmp_path, capsys):
    path, _, model, params, tok = gemma
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("import os\n\ndef\n")
    main([f"--model={path}", "--prompt=The quick brown fox", f"--prompts_file={prompts_file}",
          f"--max_length={MAX_LENGTH}"])
    out = capsys.readouterr().out.splitlines()
    assert out == generate(model, params, tok, ["The quick brown fox", "import os", "def"],
                           max_length=MAX_LENGTH)
    main([f"--model={path}", "--prompt=import os", "--prompt=def", f"--max_length={MAX_LENGTH}",
          "--sampler=top_k", "--seed=4,9"])
    assert capsys.readouterr().out.splitlines() == [
        generate(model, params, tok, p, max_length=MAX_LENGTH, sampler="top_k", seed=s)
        for p, s in (("import os", 4), ("def", 9))]
    for argv, words in [([f"--model={path}", "--prompt=" + "word " * 40], "max_length"),
                        ([f"--model={path}", "--prompt=hi", "--sampler=top_k", "--seed=1,2"],
                         "one per prompt"),
                        ([f"--model={path}", "--prompt=hi", "--seed=x"], "--seed"),
                        ([f"--model={path}"], "no prompts"),
                        ([f"--model={path}", "--prompt=hi", "--sampler=beam"], "unknown sampler"),
                        ([f"--model={tmp_path}/nope", "--prompt=hi"], "does not exist")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith("error:") and words in err
        assert len(err.splitlines()) == 1


def test_gemma2_sliding_window_and_soft_caps_match_kerashub(keras_gemma_preset):
    """Decoding past a 4-token window with Gemma 2's soft-caps gives KerasHub's strings."""
    import keras_hub
    path, _ = keras_gemma_preset(
        name="gen2", num_key_value_heads=1, use_post_ffw_norm=True, use_post_attention_norm=True,
        attention_logit_soft_cap=1.5, final_logit_soft_cap=2.0,
        use_sliding_window_attention=True, sliding_window_size=4)
    causal = keras_hub.models.GemmaCausalLM.from_preset(path)
    model, params = jaxlm.load(path)
    assert model.config.sliding_window_size == 4
    ours = generate(model, params, jaxlm.load_tokenizer(path), PROMPTS, max_length=MAX_LENGTH,
                    stop_token_ids=None)
    assert ours == list(causal.generate(PROMPTS, max_length=MAX_LENGTH, stop_token_ids=None))
