"""--loss_on=response and --packing: hand-counted weights, the packing layout, and a packed batch
giving the loss and gradients of the same examples unpacked on a sharded 2x4 step."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sharding
from conftest import ragged_batch
from jaxlm import data, lora
from jaxlm.data import packing
from jaxlm.errors import UserError
from jaxlm.train import loss as L, step as S, trainer as T
from models import layers
from models.gemma import Gemma, PRESETS

# Local (window 5) and global layers, so the packed mask meets both kinds.
CFG = PRESETS["gemma_tiny"].replace(vocab_size=512, sliding_window_size=5, sliding_window_pattern=2)


class Chars:
    """One token per character (id = code point), so weights can be counted by hand."""
    pad_id, eos_id, bos_id = 0, 1, 2

    def encode(self, text, bos=None):
        return [ord(c) for c in text]


def test_loss_on_response_scores_only_the_answer_and_eos():
    records = data.Records(["hi", "a long question"], ["yo", "no"])
    template = "Q:{instruction} A:{output}"
    rows = data.encode(Chars(), records, template, sequence_length=12, loss_on="response")
    # Row 0: BOS "Q:hi A:yo" EOS = 11 tokens; the prompt "Q:hi A:" is 7, so the scored targets
    # are y, o (positions 8, 9) and EOS (10): 3 of the 10 that loss_on="all" scores.
    assert rows["token_ids"][0, :11].tolist() == [2] + [ord(c) for c in "Q:hi A:yo"] + [1]
    assert np.flatnonzero(rows["loss_mask"][0]).tolist() == [8, 9, 10]
    # Row 1 is truncated inside its 20-token prompt (11 of 22 body tokens kept): nothing scored.
    assert rows["padding_mask"][1].all() and not rows["loss_mask"][1].any()
    everything = data.encode(Chars(), records, template, 12)
    np.testing.assert_array_equal(everything["loss_mask"], everything["padding_mask"])
    for k in ("token_ids", "padding_mask"):  # the rows themselves do not change
        np.testing.assert_array_equal(rows[k], everything[k])
    ids, mask = data.pack(Chars(), data.format_examples(records, template), 12)
    np.testing.assert_array_equal(ids, rows["token_ids"])
    with pytest.raises(UserError, match="--loss_on"):
        data.encode(Chars(), records, template, 12, loss_on="prompt")

    # The loss and token accuracy count the same 3 targets, and equal the naive sums there.
    model = Gemma(CFG)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    batch = {k: v[:1] for k, v in rows.items()}
    batch["token_ids"] = batch["token_ids"] % CFG.vocab_size
    _, m = jax.jit(L.lm_loss_fn(model))(params, batch, None)
    assert float(m["count"]) == 3
    logits = jax.jit(model.apply)({"params": params}, batch["token_ids"][:, :-1], batch["padding_mask"][:, :-1])
    weights = np.zeros((1, 12), np.float32)
    weights[0, [7, 8, 9]] = 1  # targets 8, 9, 10 are predicted at positions 7, 8, 9
    ref = L.naive_cross_entropy(logits, batch["token_ids"][:, 1:], weights)
    np.testing.assert_allclose(float(m["loss_sum"]), float(ref["loss_sum"]), rtol=1e-5)
    assert float(m["correct"]) == float(ref["correct"])


def test_best_fit_decreasing_by_hand():
    # Longest first: 6 -> new row (2 left), 5 -> new (3 left), 4 -> new (4 left), then 3 goes
    # where it leaves least room (the row with 3 left) and 2 into the row with 2 left.
    assert packing.assign(np.array([5, 3, 4, 2, 6]), 8) == [[4, 3], [0, 1], [2]]
    with pytest.raises(ValueError, match="more than the row width"):
        packing.assign(np.array([9]), 8)


def test_pack_rows_layout_and_coverage():
    ids, mask = ragged_batch(CFG.vocab_size, [5, 3, 4, 2, 6], 8, seed=3)
    loss_mask = mask.copy()
    loss_mask[0, :3] = False  # a response-only example keeps its own weights
    packed = packing.pack_rows({"token_ids": ids, "padding_mask": mask, "loss_mask": loss_mask})
    assert packed["token_ids"].shape == (3, 8)
    # Row 0 holds example 4 (6 tokens) then example 3 (2 tokens).
    np.testing.assert_array_equal(packed["token_ids"][0], np.r_[ids[4, :6], ids[3, :2]])
    assert packed["segment_ids"][0].tolist() == [1] * 6 + [2] * 2
    assert packed["positions"][0].tolist() == list(range(6)) + [0, 1]
    # An example's first token is never a target (it would be predicted across examples).
    assert packed["loss_mask"][0].tolist() == [False] + [True] * 5 + [False, True]
    assert packed["loss_mask"][1].tolist() == [False, False, False, True, True, False, True, True]
    assert packed["segment_ids"][2].tolist() == [1] * 4 + [0] * 4
    assert not packed["padding_mask"][2, 4:].any() and not packed["loss_mask"][2, 4:].any()
    # Every example appears once, whole; the targets scored are those scored unpacked, less none.
    assert packed["padding_mask"].sum() == mask.sum()
    assert packed["loss_mask"].sum() == loss_mask[:, 1:].sum()
    again = packing.pack_rows({"token_ids": ids, "padding_mask": mask, "loss_mask": loss_mask})
    for k in packed:  # packing is a function of the data alone: a resumed run packs the same
        np.testing.assert_array_equal(again[k], packed[k])
    assert packing.pack_rows({"token_ids": ids, "padding_mask": mask}, multiple_of=4)["token_ids"].shape == (4, 8)
    with pytest.raises(ValueError, match="right-padded"):
        packing.pack_rows({"token_ids": ids, "padding_mask": mask[:, ::-1]})


def test_batches_of_packed_rows_are_a_function_of_seed_and_step():
    rows = packing.pack_rows(dict(zip(("token_ids", "padding_mask"),
                                      ragged_batch(CFG.vocab_size, np.arange(2, 12), 12, seed=1))))
    first = [data.batch_rows(rows, s, batch_size=2, seed=7) for s in range(6)]
    resumed = [data.batch_rows(rows, s, batch_size=2, seed=7) for s in range(3, 6)]
    for a, b in zip(first[3:], resumed):
        assert a.keys() == b.keys() == rows.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    half = data.batch_rows(rows, 4, batch_size=2, seed=7, process_index=1, process_count=2)
    np.testing.assert_array_equal(half["segment_ids"], first[4]["segment_ids"][1:])


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh("2x4")


@pytest.fixture(scope="module")
def params(mesh):
    p = Gemma(CFG).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return jax.device_put(p, sharding.named_shardings(p, sharding.rules_for(CFG), mesh))


def examples(n=8, width=17, seed=0):
    """n right-padded examples with response-only weights (scored from a random start)."""
    rng = np.random.RandomState(seed)
    ids, mask = ragged_batch(CFG.vocab_size, rng.randint(3, width + 1, n), width, seed)
    start = rng.randint(1, 6, n)
    return {"token_ids": ids, "padding_mask": mask,
            "loss_mask": mask & (np.arange(width)[None] >= start[:, None])}


@pytest.mark.parametrize("with_lora", [False, True])
def test_packed_batch_gives_the_loss_and_gradients_of_the_examples_unpacked(params, mesh, with_lora):
    """One SGD(1) step (the update IS the gradient) on 8 examples, unpacked [8, 17] and packed
    into fewer rows, float32 on a 2x4 mesh: the same loss, token count, accuracy and update."""
    unpacked = examples()
    packed = packing.pack_rows(unpacked, multiple_of=mesh.shape["batch"])
    assert len(packed["token_ids"]) < len(unpacked["token_ids"])  # rows really hold several

    opt = optax.sgd(1.0)
    if with_lora:
        adapters = jax.tree.map(lambda x: x + 0.05, lora.init(params, 4, key=jax.random.key(1)))
        specs = sharding.adapter_specs(adapters, sharding.partition_specs(
            params, sharding.rules_for(CFG), mesh), mesh)
        trainable = jax.device_put(adapters, adapters.with_factors(jax.tree.map(
            lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))))
        frozen, merge = params, lora.merge
    else:
        trainable, frozen, merge = params, None, None
    state = T.init_state(trainable, opt, mesh)
    fn = S.make_train_step(L.lm_loss_fn(Gemma(CFG), chunk_size=8), opt, merge=merge,
                           state_shardings=S.shardings_of(state),
                           frozen_shardings=None if frozen is None else S.shardings_of(frozen),
                           batch_shardings=S.micro_batch_sharding(mesh), mesh=mesh, donate=False)
    new_u, m_u = fn(state, frozen, unpacked)
    new_p, m_p = fn(state, frozen, packed)
    assert float(m_u["count"]) == float(m_p["count"]) == unpacked["loss_mask"][:, 1:].sum()
    np.testing.assert_allclose(float(m_p["loss"]), float(m_u["loss"]), rtol=1e-5)
    assert float(m_p["accuracy"]) == float(m_u["accuracy"])
    np.testing.assert_allclose(float(m_p["grad_norm"]), float(m_u["grad_norm"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_p["trainable"]), jax.tree.leaves(new_u["trainable"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_rope_positions_come_from_the_batch():
    """`positions` reach RoPE: positions with other gaps than the indices change the output,
    shifted ones do not (RoPE is relative: restarting keeps each example's angles, and so their
    rounding, as they were alone)."""
    cfg = CFG.replace(num_layers=1, sliding_window_size=None)
    ids = jax.random.randint(jax.random.key(0), (1, 6), 3, cfg.vocab_size)
    p = Gemma(cfg).init(jax.random.key(1), ids)["params"]
    apply = jax.jit(lambda pos: Gemma(cfg).apply({"params": p}, ids, positions=pos, return_hidden=True))
    index = jnp.arange(6)[None]
    base = np.asarray(apply(index))
    np.testing.assert_allclose(np.asarray(apply(index + 5)), base, atol=1e-5)
    assert not np.allclose(np.asarray(apply(2 * index)), base, atol=1e-3)


@pytest.mark.parametrize("window", [None, 3])
def test_fused_attention_call_keeps_packed_examples_apart(window):
    """The cuDNN call's mask and window, run through XLA's implementation of the same API (no
    GPU here): equal to the blocked XLA attention on every real query of a packed batch."""
    keys = jax.random.split(jax.random.key(0), 3)
    b, t, n, kv, d = 2, 10, 4, 2, 8
    q = jax.random.normal(keys[0], (b, t, n, d)) / np.sqrt(d)
    k, v = (jax.random.normal(key, (b, t, kv, d)) for key in keys[1:])
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2, 2]])
    pos = jnp.arange(t)
    mask = (pos[:, None] >= pos[None, :]) & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    if window:
        mask &= (pos[:, None] - pos[None, :] < window)
    got = layers.fused_causal_attention(q, k, v, window, mask, implementation="xla")
    ref = layers.grouped_attention(q, k, v, mask, causal=True, window=window)
    real = np.asarray(seg > 0)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(ref)[real], rtol=1e-5, atol=1e-6)
    plain = layers.fused_causal_attention(q, k, v, window, None, implementation="xla")
    assert not np.allclose(np.asarray(plain)[real], np.asarray(ref)[real])  # the mask is used


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_packed_rows_with_cudnn_attention_on_gpu():
    """bfloat16 Gemma on packed rows: loss and gradients with attention="cudnn" match "xla"."""
    cfg = CFG.replace(dtype="bfloat16", head_dim=64)
    rows = packing.pack_rows(examples(16, width=129, seed=2))
    p = Gemma(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]

    def loss_and_grads(attention):
        loss_fn = L.lm_loss_fn(Gemma(cfg.replace(attention=attention)))
        return jax.jit(jax.value_and_grad(lambda p: loss_fn(p, rows, None)[0]))(p)

    (loss, grads), (ref_loss, ref_grads) = loss_and_grads("cudnn"), loss_and_grads("xla")
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-2)
    refs = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g, r = np.asarray(g, np.float32), np.asarray(refs[path], np.float32)
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 5e-2, jax.tree_util.keystr(path)


def test_packing_bench_runs_and_counts_real_tokens():
    """bench/packing.py end to end on the toy (speed is not asserted: the lead runs the demo)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "bench/packing.py", "--preset=gemma_tiny", "--seq=64", "--batch=2",
                        "--steps=1", "--warmup=1", "--rounds=1"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("BENCH packing ")]
    assert len(line) == 1, r.stdout
    f = dict(x.split("=", 1) for x in line[0].split()[2:])
    assert int(f["rows_packed"]) < int(f["rows_unpacked"]) and float(f["fill_packed"]) > float(f["fill_unpacked"])
    assert float(f["packed"]) > 0 and float(f["unpacked"]) > 0 and f["unit"] == "tokens/s"
    assert abs(float(f["ratio"]) - float(f["packed"]) / float(f["unpacked"])) < 1e-2
