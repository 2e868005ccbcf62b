"""`--out=gs://...` against a real Cloud Storage API: the gcp-storage-emulator on 127.0.0.1.

gcsfs (what etils.epath and jaxlm.storage use for gs://) reaches the emulator through
STORAGE_EMULATOR_HOST, tensorstore (orbax's array store) through TENSORSTORE_GCS_HTTP_URL.
GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false skips gcsfs' gRPC bucket-type probe, which the
emulator does not answer (it would wait 60 s per bucket before falling back to HTTP).

One client cannot be pointed at it as is: orbax's default array store, OCDBT, updates its
manifest with conditional writes, and the emulator neither reports an object's generation on
download nor honours ifGenerationMatch (tensorstore fails with "Malformed StorageGeneration").
So these runs set JAXLM_OCDBT=0: arrays go to the bucket through the same tensorstore GCS
driver as plain zarr, and everything else through gcsfs, as on real Cloud Storage.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from test_train_cli import ROOT, env

BUCKET = "jaxlm-test"
# Two devices: every sharded array is two objects per checkpoint (the emulator serves one
# request at a time, ~20 ms each, so eight-way shards would make each save take seconds).
TINY = ["--preset=gemma_tiny", "--mesh=1x2", "--lora_rank=4", "--batch_size=8",
        "--sequence_length=16", "--loss_on=all", "--eval_examples=0", "--num_samples=0", "--log_every=2"]

pytestmark = pytest.mark.skipif(shutil.which("gcp-storage-emulator") is None,
                                reason="needs gcp-storage-emulator (the test extra)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """-> (environment for child processes, gcsfs filesystem) with the emulator running."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("emulator") / "log", "w")
    server = subprocess.Popen(["gcp-storage-emulator", "start", f"--port={port}", "--in-memory",
                               f"--default-bucket={BUCKET}"], stdout=log, stderr=log,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.time() < deadline and server.poll() is None, "the emulator did not start"
            time.sleep(0.2)
    settings = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "JAXLM_OCDBT": "0"}
    os.environ.update(settings)  # this process lists the bucket through gcsfs too
    import gcsfs
    fs = gcsfs.GCSFileSystem(token="anon")
    child = env() | settings
    yield child, fs
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=30)
    log.close()


def _train(args, child_env, cwd, **kw):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *TINY, *args],
                            cwd=cwd, env=child_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _done(proc, timeout=400):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    return out


def _committed(fs, run):
    found = fs.glob(f"{BUCKET}/{run}/checkpoints/*/commit_success.txt")
    return sorted(int(p.split("/")[-2]) for p in found)


def test_train_writes_checkpoints_and_exports_to_the_bucket_and_resumes_after_kill_9(gcs, tmp_path):
    child, fs = gcs
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = f"gs://{BUCKET}/run"
    args = ["--steps=24", "--save_every=4", "--keep=2", f"--out={out}"]
    victim = _train(args, child, cwd, start_new_session=True)
    deadline = time.time() + 300
    # Kill as the second save starts, so the rerun usually finds a step cut short in the
    # bucket (moved aside, then saved again: orbax must not see the moved one as still there).
    while time.time() < deadline and victim.poll() is None and not fs.find(f"{BUCKET}/run/checkpoints/8"):
        fs.invalidate_cache()
        time.sleep(0.1)
    assert victim.poll() is None, ("the run ended before it could be killed", victim.communicate())
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate()
    saved = _committed(fs, "run")
    assert saved and max(saved) < 24

    text = _done(_train(args, child, cwd))  # the very same command
    assert "resuming from step" in text
    assert int(text.split("resuming from step ")[1].split()[0]) >= max(saved)
    names = {p.split(f"{BUCKET}/run/", 1)[1] for p in fs.find(f"{BUCKET}/run")}
    assert {"metrics.jsonl", "eval_before.json", "eval_after.json", "adapters.lora.h5",
            "adapters/lora.json"} <= names
    assert any(n.startswith("adapters/factors/") for n in names)
    assert _committed(fs, "run")[-1] == 24 and len(_committed(fs, "run")) == 2  # --keep=2
    steps = [int(l.split('"step": ')[1].split(",")[0])
             for l in fs.cat(f"{BUCKET}/run/metrics.jsonl").decode().splitlines()]
    assert steps[-1] == 24
    assert list(cwd.iterdir()) == []  # nothing on the local disk
    assert not os.path.exists(os.path.join(ROOT, "gs:"))

    import jaxlm  # the exported adapter folder loads straight from the bucket, no flags
    adapters = jaxlm.lora.load(f"{out}/adapters")
    assert adapters.rank == 4


def test_two_processes_write_one_checkpoint_to_the_bucket(gcs, tmp_path):
    child, fs = gcs
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cmd = [sys.executable, "-m", "jaxlm.launch", "--num_processes=2", "--devices_per_process=1",
           "--initialization_timeout=60", "--", sys.executable, os.path.join(ROOT, "train.py"),
           *TINY, "--steps=4", "--save_every=2", f"--out=gs://{BUCKET}/two"]
    proc = subprocess.run(cmd, cwd=cwd, env=child | {"PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, child.get("PYTHONPATH")) if p)}, capture_output=True, text=True,
        timeout=400)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert _committed(fs, "two") == [2, 4]
    # one checkpoint written by both hosts: each holds half of a model-split array (its chunk)
    chunks = fs.ls(f"{BUCKET}/two/checkpoints/4/state/trainable.decoder_block_0.attention.query.lora_a")
    assert sorted(c.rsplit("/", 1)[1] for c in chunks) == [".zarray", "0.0.0", "0.1.0"]
    assert fs.exists(f"{BUCKET}/two/adapters/lora.json")
    assert list(cwd.iterdir()) == []


def test_mlm_shards_are_written_listed_and_read_in_the_bucket(gcs):
    """The MLM shards go through jaxlm.storage like every other file: written, listed in index
    order, read back and refused as an occupied --out, all in the emulator's bucket."""
    import numpy as np
    from jaxlm import shards
    from jaxlm.errors import UserError
    _, fs = gcs
    out = f"gs://{BUCKET}/mlm_shards"
    w = shards.ShardWriter(f"{out}/train", 1)
    w.add(np.arange(12 * 8).reshape(12, 8))  # dataset-0..11: by name, 10 and 11 sort before 2
    w.close()
    files = shards.list_shards(f"{out}/train")
    assert [p.rsplit("/", 1)[1] for p, _ in files] == [f"dataset-{i}-1.tfrecord" for i in range(12)]
    fs.invalidate_cache()
    assert len(fs.ls(f"{BUCKET}/mlm_shards/train")) == 12  # in the bucket itself
    np.testing.assert_array_equal(shards.read_shard(files[11][0], 8)[0], np.arange(88, 96).reshape(1, 8))
    with pytest.raises(UserError, match="already holds 12 shard"):
        shards.claim_out(out, overwrite=False)
    shards.claim_out(out, overwrite=True)
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/mlm_shards/train/dataset-0-1.tfrecord")
