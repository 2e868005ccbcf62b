"""Masked-LM input: 15/80/10/10 statistics, specials never picked, host split, epochs redraw."""
import numpy as np
import pytest

from jaxlm import shards
from jaxlm.data.mlm import Masking, MLMStream, mask_tokens, max_predictions, prefetch
from jaxlm.errors import UserError

SPEC = Masking(vocab_size=1000, mask_id=4, special_ids=(0, 1, 3, 4), unk_id=2)
L = 64


def _rows(n, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(5, 1000, (n, L))
    ids[:, ::9] = 0   # [CLS] and [SEP] sprinkled through, as concatenated lines give
    ids[:, 4::9] = 1
    att = np.ones_like(ids)
    att[: n // 4, L - 10:] = 0  # some padding
    ids[: n // 4, L - 10:] = 3
    return ids, att


def test_masking_statistics():
    ids, att = _rows(256)
    rng = np.random.default_rng(0)
    picked = masked = randomised = kept = selectable = 0
    for _ in range(40):
        b = mask_tokens(ids, att, SPEC, rng)
        pos, w = b["mask_positions"], b["mask_weights"].astype(bool)
        new = np.take_along_axis(b["token_ids"], pos, axis=1)[w]
        orig = b["mask_ids"][w]
        np.testing.assert_array_equal(orig, np.take_along_axis(ids, pos, axis=1)[w])
        assert not np.isin(orig, SPEC.special_ids).any(), "a special token was picked"
        assert att[np.arange(len(ids))[:, None].repeat(pos.shape[1], 1)[w], pos[w]].all()
        # Outside the picks nothing changes; no special id is ever drawn as a random token.
        untouched = np.ones_like(ids, bool)
        for r in range(len(ids)):
            untouched[r, pos[r][w[r]]] = False
        np.testing.assert_array_equal(b["token_ids"][untouched], ids[untouched])
        rand = (new != SPEC.mask_id) & (new != orig)
        assert not np.isin(new[rand], SPEC.special_ids + (SPEC.unk_id,)).any()
        picked += w.sum()
        masked += (new == SPEC.mask_id).sum()
        randomised += rand.sum()
        kept += (new == orig).sum()
        selectable += (att.astype(bool) & ~np.isin(ids, SPEC.special_ids)).sum()
    assert abs(picked / selectable - 0.15) < 0.005
    assert abs(masked / picked - 0.8) < 0.01
    # A random draw equal to the original (1/995) counts as kept; tolerance covers it.
    assert abs(randomised / picked - 0.1) < 0.01 and abs(kept / picked - 0.1) < 0.01


def test_overflow_keeps_first_m_picks():
    ids, att = _rows(8)
    spec = Masking(vocab_size=1000, mask_id=4, special_ids=(0, 1, 3, 4), rate=0.9)
    b = mask_tokens(ids, att, spec, np.random.default_rng(0), num_predictions=8)
    assert b["mask_weights"].sum(axis=1).max() == 8
    changed = (b["token_ids"] != ids).sum(axis=1)
    assert changed.max() <= 8
    assert max_predictions(512) == 112 and max_predictions(16) == 16


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlm_shards")
    w = shards.ShardWriter(str(d), 30)
    ids, _ = _rows(200, seed=1)
    w.add(ids)
    w.close()  # 6 shards of 30 + one of 20
    return str(d)


def test_stream_epochs_hosts_and_redraw(shard_dir):
    s = MLMStream(shard_dir, batch_size=16, max_length=L, masking=SPEC, shuffle_buffer=40,
                  cycle_length=3, seed=0, process_index=0, process_count=1)
    assert s.steps_per_epoch == 200 // 16
    e0, e1 = list(s.epoch(0)), list(s.epoch(1))
    assert len(e0) == len(e1) == s.steps_per_epoch
    assert e0[0]["token_ids"].shape == (16, L) and e0[0]["mask_positions"].shape == (16, max_predictions(L))
    assert not np.array_equal(e0[0]["token_ids"], e1[0]["token_ids"])  # order and masks redrawn
    # Every row of the epoch is a distinct stored row: the shuffle buffer loses or repeats nothing.
    stored = {r.tobytes() for r in _rows(200, seed=1)[0].astype(np.int32)}
    seen = []
    for b in e0:
        orig = b["token_ids"].copy()
        np.put_along_axis(orig, b["mask_positions"],
                          np.where(b["mask_weights"] > 0, b["mask_ids"],
                                   np.take_along_axis(orig, b["mask_positions"], axis=1)), axis=1)
        seen += [r.tobytes() for r in orig]
    assert len(set(seen)) == len(seen) == 16 * s.steps_per_epoch and set(seen) <= stored
    np.testing.assert_array_equal([b["token_ids"] for b in s.epoch(0)][0], e0[0]["token_ids"])

    hosts = [MLMStream(shard_dir, batch_size=8, max_length=L, masking=SPEC, process_index=i,
                       process_count=2) for i in range(2)]
    files = [set(p for p, _ in h.files) for h in hosts]
    assert not files[0] & files[1] and len(files[0] | files[1]) == 7
    assert hosts[0].steps_per_epoch == hosts[1].steps_per_epoch == min(30 * 3 + 20, 30 * 3) // 8
    assert len(list(prefetch(hosts[1].epoch(0)))) == hosts[1].steps_per_epoch


def test_stream_errors(shard_dir, tmp_path):
    with pytest.raises(UserError, match="length 64 but --max_length is 32"):
        next(iter(MLMStream(shard_dir, batch_size=4, max_length=32, masking=SPEC,
                            process_index=0, process_count=1)))
    with pytest.raises(UserError, match="holds no .tfrecord shards"):
        MLMStream(str(tmp_path), batch_size=4, max_length=L, masking=SPEC)
    with pytest.raises(UserError, match="lower the batch size"):
        MLMStream(shard_dir, batch_size=1000, max_length=L, masking=SPEC, process_index=0, process_count=1)
    with pytest.raises(UserError, match="shards for 8 hosts"):
        MLMStream(shard_dir, batch_size=4, max_length=L, masking=SPEC, process_index=0, process_count=8)
