"""Orbax checkpoints: keep-N, exact restore onto the mesh, crash leftovers never loaded; exports."""
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sharding
from jaxlm import checkpoint
from jaxlm.errors import UserError
from test_train_cli import finished, launch


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh("1x8")


def state_at(mesh, step):
    w = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) * step
    return {"step": jax.device_put(jnp.int32(step), NamedSharding(mesh, P())),
            "trainable": {"w": jax.device_put(w, NamedSharding(mesh, P(None, "model")))},
            "rng": jax.device_put(jax.random.key_data(jax.random.key(step)), NamedSharding(mesh, P()))}


def test_keep_n_and_exact_restore(tmp_path, mesh):
    d = str(tmp_path / "ckpt")
    mngr = checkpoint.manager(d, keep=2)
    for s in (1, 2, 3):
        checkpoint.save(mngr, s, state_at(mesh, s), {"step": s, "data_position": 8 * s})
    mngr.wait_until_finished()
    mngr.close()
    assert checkpoint.complete_steps(d) == [2, 3]

    mngr = checkpoint.manager(d, keep=2)
    state, meta = checkpoint.restore_latest(mngr, state_at(mesh, 0))
    mngr.close()
    assert meta == {"step": 3, "data_position": 24}
    want = state_at(mesh, 3)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert state["trainable"]["w"].sharding.spec == P(None, "model")


def test_partial_checkpoints_are_ignored_with_a_warning(tmp_path, mesh, caplog):
    d = str(tmp_path / "ckpt")
    mngr = checkpoint.manager(d, keep=3)
    checkpoint.save(mngr, 2, state_at(mesh, 2), {"step": 2})
    mngr.wait_until_finished()
    mngr.close()
    # What a kill -9 mid-save leaves: orbax's tmp folder, and (non-atomic filesystems) a step
    # folder without the commit marker. Both are newer than the good step 2.
    os.makedirs(os.path.join(d, "4.orbax-checkpoint-tmp-1700000000/state"))
    os.makedirs(os.path.join(d, "6/state"))
    with open(os.path.join(d, "6/state/garbage"), "w") as f:
        f.write("half a tensor")
    assert checkpoint.complete_steps(d) == [2]

    with caplog.at_level(logging.WARNING, logger="jaxlm"):
        mngr = checkpoint.manager(d, keep=3)
    lines = [r.getMessage() for r in caplog.records if "incomplete" in r.getMessage()]
    assert len(lines) == 1 and "4.orbax-checkpoint-tmp-1700000000" in lines[0] and "6" in lines[0]
    assert sorted(os.listdir(d)) == ["2"]  # moved aside, not deleted
    assert len(os.listdir(tmp_path / checkpoint.INCOMPLETE_DIR)) == 2
    state, meta = checkpoint.restore_latest(mngr, state_at(mesh, 0))
    assert meta["step"] == 2 and int(state["step"]) == 2
    # a later save at a step the crash had left behind works
    checkpoint.save(mngr, 6, state_at(mesh, 6), {"step": 6})
    mngr.wait_until_finished()
    mngr.close()
    assert checkpoint.complete_steps(d) == [2, 6]


def test_restore_into_a_different_structure_is_a_user_error(tmp_path, mesh):
    d = str(tmp_path / "ckpt")
    mngr = checkpoint.manager(d, keep=1)
    checkpoint.save(mngr, 1, state_at(mesh, 1), {"step": 1})
    mngr.wait_until_finished()
    other = state_at(mesh, 0)
    other["trainable"] = {"w": other["trainable"]["w"][:4]}
    with pytest.raises(UserError, match="different configuration"):
        checkpoint.restore_latest(mngr, other)
    mngr.close()


def test_empty_directory_restores_nothing(tmp_path, mesh):
    mngr = checkpoint.manager(str(tmp_path / "none"), keep=1)
    assert checkpoint.restore_latest(mngr, state_at(mesh, 0)) is None
    mngr.close()


def test_save_tree_round_trip(tmp_path, mesh):
    tree = state_at(mesh, 5)["trainable"]
    checkpoint.save_tree(str(tmp_path / "adapters"), tree)
    back = checkpoint.load_tree(str(tmp_path / "adapters"), like=tree)
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(tree["w"]))
    assert back["w"].sharding.spec == P(None, "model")


def test_merged_export_sharding_listing_and_full_finetune(tmp_path):
    import jaxlm
    from jaxlm import lora

    quick = ["--mesh=1x8", "--steps=3", "--batch_size=8", "--sequence_length=16", "--loss_on=all",
             "--eval_examples=0", "--num_samples=0", "--learning_rate=0.05"]
    merged_run = launch(quick + ["--lora_rank=4", "--print_sharding", "--export=merged",
                                 f"--out={tmp_path}/lora"])
    full_run = launch(quick + ["--lora_rank=0", "--remat", "--dtype=bfloat16", "--layout=keras",
                               f"--out={tmp_path}/full"])
    out = finished(merged_run)
    assert "RANDOMLY INITIALISED" in out
    listing = [l for l in out.splitlines() if l.startswith("token_embedding/embeddings ")]
    assert listing and "8 shards of (512, 128)" in listing[0]  # the default table: over the vocabulary
    assert any(l.startswith("decoder_block_1/attention/query/lora_a") and "8 shards" in l
               for l in out.splitlines())
    assert "Trainable params: 5,632" in out

    # merged folder == base (same seed) + exported .lora.h5 adapters
    base_model, base = jaxlm.load("gemma_tiny", seed=0)
    adapters = lora.load_keras_lora(f"{tmp_path}/lora/adapters.lora.h5", base_model.config, base)
    _, merged = jaxlm.load(f"{tmp_path}/lora/merged")
    want = lora.merge(base, adapters)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert not np.array_equal(np.asarray(merged["decoder_block_0"]["attention"]["query"]["kernel"]),
                              np.asarray(base["decoder_block_0"]["attention"]["query"]["kernel"]))
    assert os.path.exists(f"{tmp_path}/lora/merged_keras/config.json")

    out = finished(full_run)
    assert "Non-trainable params: 0" in out
    _, full = jaxlm.load(f"{tmp_path}/full/merged", dtype="bfloat16")
    assert full["token_embedding"]["embeddings"].dtype == np.dtype("bfloat16")
    assert not os.path.exists(f"{tmp_path}/full/adapters.lora.h5")
