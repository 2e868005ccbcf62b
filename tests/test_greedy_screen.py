"""models/greedy_screen.py: the bfloat16 screen's bounds hold, its greedy token is the float32
argmax (ties to the lowest index, fallbacks included), and the decoder uses it only for
float32 greedy decoding on one CPU device with AMX, where it gives the same tokens."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import decode, sampling
from models import cpu_forms, greedy_screen
from models.gemma import PRESETS, Gemma

V, H = 4096, 64
PICK = lambda logits: sampling.Greedy()(logits, None)  # noqa: E731
TIE = decode.SCREEN_TIE


def _decided(m, e, tie=0.0) -> bool:
    """Whether the screen itself decides every row (no fallback to the whole product)."""
    return int(greedy_screen.widest(greedy_screen.candidates(m, e, tie)[0])) <= greedy_screen.BLOCKS


def _table(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((V, H)).astype(np.float32) * scale)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 3e4])
def test_the_bounds_hold_and_are_not_vacuous(scale):
    table = _table(scale=scale)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, H)).astype(np.float32) * 7)
    m, e = jax.jit(greedy_screen.bounds)(greedy_screen.build(table), x)
    exact = np.asarray(x, np.float64) @ np.asarray(table, np.float64).T
    block_max = exact.reshape(5, -1, greedy_screen.BLOCK).max(axis=-1)
    ratio = np.abs(np.asarray(m, np.float64) - block_max) / np.asarray(e)
    assert ratio.max() <= 1
    assert ratio.max() > 0.05  # the bound is near what rounding does, so the screen rules rows out


def test_the_candidate_blocks_are_the_first_that_hold_in_order():
    mask = np.zeros((3, 40), bool)
    mask[0, [3, 9, 30]] = True
    mask[1, :] = True  # more than k
    count, ids = greedy_screen._first(jnp.asarray(mask), 4)
    np.testing.assert_array_equal(count, [3, 40, 0])
    np.testing.assert_array_equal(ids, [[3, 9, 30, 30], [0, 1, 2, 3], [-1, -1, -1, -1]])


def test_the_step_sorts_nothing():
    """XLA:CPU's top-k is a sort, which took 2.5 ms of a 16 ms screen at the 270M's 4096
    blocks; the candidate blocks come from a running count instead."""
    table = _table()
    x = _peaked(table, [7, 4000])
    step = jax.jit(greedy_screen.greedy, static_argnums=(3, 4))
    hlo = step.lower(table, greedy_screen.build(table), x, PICK, TIE).compile().as_text()
    assert " sort(" not in hlo


def _peaked(table, rows, seed=2):
    """Hidden states whose logits have a clear winner: near copies of table rows `rows`."""
    noise = np.random.default_rng(seed).standard_normal((len(rows), H)).astype(np.float32)
    return table[np.asarray(rows)] * 3 + jnp.asarray(noise)


def test_a_clear_winner_is_found_by_the_screen_and_equals_the_argmax():
    table = _table()
    x = _peaked(table, [7, 4000, 1234, 64])
    screen = greedy_screen.build(table)
    m, e = greedy_screen.bounds(screen, x)
    assert _decided(m, e)  # the screen's own path, not the fallback
    got = jax.jit(greedy_screen.greedy, static_argnums=(3, 4))(table, screen, x, PICK, TIE)
    np.testing.assert_array_equal(got, [7, 4000, 1234, 64])
    np.testing.assert_array_equal(got, PICK(x @ table.T))


def test_ties_go_to_the_lowest_index_as_the_sampler_breaks_them():
    table = np.array(_table())
    table[3000] = table[100]  # the same row in two blocks
    table = jnp.asarray(table)
    x = _peaked(table, [3000])
    got = greedy_screen.greedy(table, greedy_screen.build(table), x, PICK, TIE)
    assert int(got[0]) == 100 == int(PICK(x @ table.T)[0])


@pytest.mark.parametrize("x", [
    np.zeros((2, H), np.float32),                        # every logit ties: the fallback
    np.full((2, H), np.nan, np.float32),                 # NaN: the fallback, as the plain rule
    np.full((2, H), 1e-12, np.float32),  # every logit within the sampler's ties of the largest
])
def test_rows_the_screen_cannot_decide_fall_back_to_the_float32_product(x):
    table = _table()
    screen = greedy_screen.build(table)
    m, e = greedy_screen.bounds(screen, jnp.asarray(x))
    assert not _decided(m, e, TIE)
    got = greedy_screen.greedy(table, screen, jnp.asarray(x), PICK, TIE)
    np.testing.assert_array_equal(got, PICK(jnp.asarray(x) @ table.T))


def test_the_screen_is_used_for_float32_greedy_on_one_amx_cpu_only(amx):
    cfg = PRESETS["gemma_tiny"].replace(vocab_size=V)
    greedy = sampling.Greedy()
    assert decode._screen_pays("cpu", cfg, greedy, None) == amx
    assert not decode._screen_pays("cpu", cfg, sampling.TopK(), None)
    assert not decode._screen_pays("cpu", cfg.replace(dtype="bfloat16"), greedy, None)
    assert not decode._screen_pays("gpu", cfg, greedy, None)
    assert not decode._screen_pays("cpu", cfg.replace(vocab_size=256), greedy, None)  # too few blocks
    assert not decode._screen_pays("cpu", cfg.replace(final_logit_soft_cap=30.0), greedy, None)
    assert not decode._screen_pays("cpu", PRESETS["gemma_2b_en"], greedy, None)  # a 21% table
    assert decode._screen_pays("cpu", PRESETS["gemma_2b_en"].replace(num_layers=2), greedy, None) == amx


@pytest.mark.parametrize("copies", [
    greedy_screen.FEW,         # the few blocks most steps recompute
    greedy_screen.FEW + 3,     # up to BLOCKS of them
    greedy_screen.BLOCKS + 2,  # more: the fallback to the whole product
])
def test_near_copies_of_the_winner_in_several_blocks_are_all_recomputed(copies):
    """One row a block, each a little larger than the last: all within the screen's bound,
    so every block is a candidate, and the largest logit is in the last."""
    table = np.array(_table())
    rows = np.arange(copies) * greedy_screen.BLOCK + 5
    table[rows] = table[5] * (1 + 1e-5 * np.arange(copies))[:, None]
    table = jnp.asarray(table)
    x = _peaked(table, [5])
    m, e = greedy_screen.bounds(greedy_screen.build(table), x)
    assert int(greedy_screen.candidates(m, e, TIE)[0][0]) == copies
    got = greedy_screen.greedy(table, greedy_screen.build(table), x, PICK, TIE)
    assert int(got[0]) == rows[-1] == int(PICK(x @ table.T)[0])


def test_screened_decoding_gives_the_plain_decoders_tokens(monkeypatch):
    """A tiny float32 Gemma whose table is scaled so that its logits have clear winners, a
    temperature on the greedy rule: the screen decides most steps itself, and the tokens
    equal the plain decoder's."""
    monkeypatch.setattr(cpu_forms, "amx", lambda: True)
    cfg = PRESETS["gemma_tiny"].replace(vocab_size=V)
    model = Gemma(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    emb = params["token_embedding"]["embeddings"]
    params = {**params, "token_embedding": {"embeddings": emb * (8 / jnp.std(emb))}}
    prompts = np.random.default_rng(0).integers(1, V, (4, 6)).astype(np.int32)
    lengths = np.array([6, 3, 5, 6], np.int32)
    out = {}
    for on in (False, True):
        monkeypatch.setattr(decode, "SCREEN", on)
        decode._compiled.cache_clear()
        out[on] = decode.generate_ids(model, params, prompts, lengths, 24, sampling.Greedy(0.7))
        fn = decode._compiled(model, sampling.Greedy(0.7), 4, 16, 32, False, None)
        args = (np.zeros((4, 16), np.int32), lengths, np.int32(24), np.int32(0),
                np.full((decode._STOP_SLOTS,), -1, np.int32))
        hlo = fn.lower(params, *args).compile().as_text()
        assert (f"bf16[{V},{cfg.hidden_dim}]" in hlo) == on  # the screen is in the program
    decode._compiled.cache_clear()
    np.testing.assert_array_equal(out[True][0], out[False][0])
    np.testing.assert_array_equal(out[True][1], out[False][1])
    # the screen decided most of these steps (not the fallback)
    hidden = model.apply({"params": params}, jnp.asarray(out[True][0]), return_hidden=True)
    m, e = greedy_screen.bounds(greedy_screen.build(params["token_embedding"]["embeddings"]),
                                hidden.reshape(-1, cfg.hidden_dim))
    decided = [_decided(m[i:i + 1], e[i:i + 1], TIE) for i in range(m.shape[0])]
    assert np.mean(decided) > 0.5
