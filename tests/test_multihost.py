"""Multi-host training on jax.distributed, with local processes (CPU devices, gloo) as hosts.

2 processes x 4 devices must train exactly what 1 process x 8 devices trains (same mesh, same
batches), for the LM (LoRA) and the MLM (TFRecord shards, each read by one host) trainers, and
generate the same before/after samples on a mesh spanning both;
killing every process and relaunching resumes from the collective checkpoint; bad setups fail
with one line instead of hanging.
"""
import os
import re
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from jaxlm import distributed, launch
from jaxlm.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, "-m", "jaxlm.launch", "--num_processes=2", "--devices_per_process=4",
          "--initialization_timeout=60", "--"]
TRAIN = [sys.executable, "train.py"]
LM = ["--preset=gemma_tiny", "--mesh=1x8", "--lora_rank=4", "--steps=6", "--save_every=2",
      "--log_every=2", "--num_samples=0", "--eval_examples=0"]


def _run(cmd, timeout=240, env=None):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def _metrics(out):
    import json
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _h5(path):
    with h5py.File(path) as f:
        out = {}
        f.visititems(lambda k, v: out.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset) else None)
    return out


def _assert_same_training(a, b):
    ma, mb = _metrics(a), _metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for key in ("loss", "accuracy", "count"):
        np.testing.assert_allclose([m[key] for m in ma], [m[key] for m in mb], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    """The same LoRA run on 2 hosts x 4 devices (via the launcher) and on 1 host x 8 devices."""
    root = tmp_path_factory.mktemp("lm")
    two, one = str(root / "two"), str(root / "one")
    # 4 KiB gathers: the Hugging Face base export takes its block path on this tiny model
    log = _run(LAUNCH + TRAIN + LM + [f"--out={two}"], env={**os.environ, "JAXLM_GATHER_BYTES": "4096"})
    _run(TRAIN + LM + [f"--out={one}"])
    return root, two, one, log


def test_lm_two_hosts_train_what_one_host_trains(lm_runs):
    root, two, one, log = lm_runs
    _assert_same_training(two, one)
    a, b = _h5(os.path.join(two, "adapters.lora.h5")), _h5(os.path.join(one, "adapters.lora.h5"))
    assert a.keys() == b.keys() and a
    for k in a:  # Adam rescales tiny gradients, so summation-order noise reaches ~2e-6 here
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)
    from safetensors.numpy import load_file
    ta, tb = (load_file(os.path.join(d, "base_hf", "model.safetensors")) for d in (two, one))
    assert ta.keys() == tb.keys() and max(v.nbytes for v in ta.values()) > 4096
    for k in ta:  # gathered from both hosts in blocks: the same bytes
        np.testing.assert_array_equal(ta[k], tb[k], err_msg=k)
    # Progress and the export report come from process 0 only; both processes ran.
    assert "[p0] exported to" in log and "[p1] exported" not in log
    assert "[p0] [####################] step 6/6" in log and "[p1] [#" not in log
    assert "process 1/2 started" in log


def test_two_hosts_generate_what_one_host_generates(tmp_path):
    """Before/after samples and exact match run on a mesh that spans both processes."""
    flags = ["--preset=gemma_tiny", "--mesh=2x4", "--lora_rank=0", "--steps=2", "--log_every=1",
             "--num_samples=2", "--eval_examples=4", "--max_new_tokens=6"]
    log = _run(LAUNCH + TRAIN + flags + [f"--out={tmp_path / 'two'}"])
    one = _run(TRAIN + flags + [f"--out={tmp_path / 'one'}"])

    def generated(text, prefix=""):
        return [line[len(prefix):] for line in text.splitlines()
                if line.startswith(prefix + "[before]") or line.startswith(prefix + "[after]")]
    lines = generated(log, "[p0] ")
    assert len(lines) == 6 and any("exact match on 4" in line for line in lines), log[-3000:]
    assert lines == generated(one)
    assert "[p1] [after]" not in log  # printed by process 0 only


def _launch_until(out: str, marker: str):
    """Launch the 2-host LM run into `out`, read its output up to a line containing `marker`;
    -> (launcher process, the children's pids, the lines read)."""
    proc = subprocess.Popen(LAUNCH + TRAIN + LM + [f"--out={out}"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids, lines = [], []
    for line in proc.stdout:
        lines.append(line)
        pids += [int(p) for p in re.findall(r"process \d/2 started \(pid (\d+)\)", line)]
        if marker in line:
            break
    return proc, pids, lines


def _same_adapters(out: str, ref: str) -> None:
    a, b = _h5(os.path.join(out, "adapters.lora.h5")), _h5(os.path.join(ref, "adapters.lora.h5"))
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_kill_every_process_then_resume(lm_runs):
    root, two, _, _ = lm_runs
    out = str(root / "killed")
    proc, pids, lines = _launch_until(out, "step 2/6")
    try:  # wait for the first committed checkpoint
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "checkpoints", "2", "commit_success.txt")):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        assert len(pids) == 2
        for pid in pids:  # every host dies at once, mid-run
            os.kill(pid, signal.SIGKILL)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, rest
    assert "[launch] process" in rest and "failed" in rest
    assert not os.path.exists(os.path.join(out, "adapters.lora.h5"))

    log = _run(LAUNCH + TRAIN + LM + [f"--out={out}"])
    assert re.search(r"\[p0\] resuming from step [246] ", log), log[-3000:]
    _same_adapters(out, two)
    final = {m["step"]: m["loss"] for m in _metrics(out)}  # resumed steps repeat what was lost
    for m in _metrics(two):
        assert final[m["step"]] == pytest.approx(m["loss"], rel=1e-5)


def test_sigterm_to_one_host_stops_every_host_at_one_step_then_resume(lm_runs):
    """A preemption notice reaches one host; both finish the same step, checkpoint, exit 0."""
    root, two, _, _ = lm_runs
    out = str(root / "preempted")
    # That line is printed after both processes joined jax.distributed (SIGTERM is JAX's then).
    proc, pids, lines = _launch_until(out, "RANDOMLY INITIALISED")
    try:
        os.kill(pids[1], signal.SIGTERM)  # host 1 only
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines) + rest
    assert proc.returncode == 0, log[-3000:]
    # JAX's preemption sync point: the notice arrives while the first step compiles, so both
    # hosts stop after step 1, the first step neither has finished.
    for i in (0, 1):
        assert f"[p{i}] stopped at step 1; rerun the same command to resume" in log, log[-3000:]
    assert os.path.exists(os.path.join(out, "checkpoints", "1", "commit_success.txt"))
    assert "Traceback" not in log and not os.path.exists(os.path.join(out, "adapters.lora.h5"))

    log = _run(LAUNCH + TRAIN + LM + [f"--out={out}"])  # the very same command
    assert "[p0] resuming from step 1 " in log, log[-3000:]
    _same_adapters(out, two)


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
    from jaxlm import shards, tokenizer_train
    from jaxlm.corpus import pydoc_corpus
    root = tmp_path_factory.mktemp("mlm")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(pydoc_corpus().splitlines()[:1500]) + "\n")
    tok = str(root / "tok")
    assert tokenizer_train.main(["--input", str(corpus), "--vocab_size", "400", "--out", tok]) == 0
    data = str(root / "shards")
    assert shards.main(["--input", str(corpus), "--tokenizer", tok, "--max_length", "32",
                        "--shard_size", "100", "--out", data, "--validation_fraction", "0.25"]) == 0
    return root, tok, data


def test_mlm_two_hosts_train_what_one_host_trains(shards_dir):
    root, tok, data = shards_dir
    args = ["--task=mlm", "--preset=roberta_tiny", f"--tokenizer={tok}", f"--data={data}",
            "--mesh=8x1", "--per_replica_batch_size=1", "--max_length=32", "--steps=4",
            "--learning_rate=2e-3", "--dropout=0", "--log_every=2", "--shuffle_buffer=64",
            "--eval_batches=2", "--data_readers=2"]
    two, one = str(root / "two"), str(root / "one")
    log = _run(LAUNCH + TRAIN + args + [f"--out={two}"])
    _run(TRAIN + args + [f"--out={one}"])
    _assert_same_training(two, one)

    # Each train shard is read by exactly one host.
    read = {int(p): set(names.split()) for p, names in
            re.findall(r"\[p\d\] process (\d)/2 reads \d+ train shard\(s\): (.*)", log)}
    assert set(read) == {0, 1} and read[0] and read[1] and not read[0] & read[1], log[-2000:]
    assert read[0] | read[1] == set(os.listdir(os.path.join(data, "train")))

    import jaxlm
    from jaxlm.tree import flatten
    pa, pb = (flatten(jaxlm.load(os.path.join(d, "model"))[1]) for d in (two, one))
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_allclose(np.asarray(pa[k]), np.asarray(pb[k]), rtol=1e-4, atol=1e-5,
                                   err_msg=k)


def test_processes_disagreeing_on_the_mesh_fail_with_one_line(tmp_path):
    a = launch.parse(["--num_processes=2", "--devices_per_process=4", "--", "x"])[0]
    address = f"127.0.0.1:{launch.free_port()}"
    flags = [f for f in LM if not f.startswith("--mesh")]
    procs = [subprocess.Popen(TRAIN + [*flags, f"--mesh={mesh}", f"--out={tmp_path}"], cwd=ROOT,
                              env=launch.child_env(a, i, address), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i, mesh in enumerate(["1x8", "2x4"])]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 2, err[-2000:]
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert lines == ["error: processes disagree on command line: process 0: --mesh=1x8, "
                         "process 1: --mesh=2x4; launch every process with the same flags"], err


def test_unreachable_coordinator_is_a_bounded_one_line_error():
    port = launch.free_port()  # nothing listens there

    def alone(process_id):
        """Process `process_id` of 2 started on its own: -> its stderr lines (after checking it
        gave up with exit 2 well within the test's bound)."""
        t0 = time.monotonic()
        r = subprocess.run(TRAIN + LM + [f"--coordinator_address=127.0.0.1:{port}",
                                         "--num_processes=2", f"--process_id={process_id}",
                                         "--initialization_timeout=3"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and time.monotonic() - t0 < 30
        return r.stderr.strip().splitlines()

    assert alone(1) == [
        f"error: process 1: the coordinator 127.0.0.1:{port} was unreachable for 3s; start process "
        "0 first, and check --coordinator_address (process 0's reachable HOST:PORT) and firewalls"]
    # Process 0 serves the coordinator but its peer never comes: bounded too, one line.
    assert alone(0) == [
        f"error: process 0: not all 2 processes joined the coordinator 127.0.0.1:{port} within 3s; "
        "start every process with the same --num_processes and --coordinator_address"]


def test_launcher_stops_the_others_when_one_fails():
    child = ("import os, sys, time\n"
             "print('hello from', os.environ['JAXLM_PROCESS_ID'], flush=True)\n"
             "if os.environ['JAXLM_PROCESS_ID'] == '1': sys.exit(3)\n"
             "time.sleep(120)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "jaxlm.launch", "--num_processes=2", "--",
                        sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and time.monotonic() - t0 < 30
    assert "[p1] hello from 1" in r.stdout and "[p0] hello from 0" in r.stdout
    assert "[launch] process 1 failed (exit code 3); stopped process(es) 0" in r.stderr

    # Ctrl-C on the launcher stops every child.
    proc = subprocess.Popen([sys.executable, "-m", "jaxlm.launch", "--num_processes=2", "--",
                             sys.executable, "-c", "import time; print('up', flush=True); "
                             "time.sleep(120)"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    pids = []
    for line in proc.stdout:
        pids += [int(p) for p in re.findall(r"\(pid (\d+)\)", line)]
        if line.startswith("[p1] up") or line.startswith("[p0] up") and len(pids) == 2:
            break
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130 and "interrupted; stopped all" in proc.stderr.read()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launcher_signals_during_start_up_stop_everything_started():
    """Signals are acted on between the launcher's steps, never inside Popen or poll (where an
    exception once left a lock held and the launcher waiting forever): one sent while the
    children start, and SIGTERM, which is passed on to the children."""
    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]
    for sig, delay, code in ((signal.SIGINT, 0.0, 130), (signal.SIGTERM, None, 128 + 15)):
        proc = subprocess.Popen([sys.executable, "-m", "jaxlm.launch", "--num_processes=4", "--",
                                 *sleeper], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        pids = []
        for line in proc.stdout:  # the first child is started: the others are on their way
            pids += [int(p) for p in re.findall(r"\(pid (\d+)\)", line)]
            if pids and (delay is not None or line.startswith("[p3] up")):
                break
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == code, (out, err)
        pids += [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]
        assert pids and "Traceback" not in err
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_a_user_error_on_one_process_ends_the_run_at_once():
    """Process 1 fails with a UserError while process 0 waits for it in a collective: process 1
    must not sit in jax.distributed's shutdown barrier (5 minutes) waiting for process 0."""
    child = ("import sys\n"
             "from jaxlm import distributed\n"
             "from jaxlm.errors import UserError, cli\n"
             "@cli\n"
             "def main():\n"
             "    distributed.initialize(distributed.from_argv([])[0])\n"
             "    import jax\n"
             "    from jax.experimental import multihost_utils\n"
             "    if jax.process_index() == 1:\n"
             "        raise UserError('no data on this host; copy it there')\n"
             "    multihost_utils.sync_global_devices('never reached by process 1')\n"
             "main()\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "jaxlm.launch", "--num_processes=2",
                        "--devices_per_process=1", "--", sys.executable, "-c", child],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and time.monotonic() - t0 < 60, (r.stdout[-2000:], r.stderr[-2000:])
    assert "[p1] error: no data on this host; copy it there" in r.stdout
    assert "[launch] process 1 failed (exit code 2); stopped process(es) 0" in r.stderr


def test_flags_and_environment():
    s, rest = distributed.from_argv(["--mesh=1x8", "--num_processes", "4", "--process_id=3",
                                     "--coordinator_address=10.0.0.1:1234"], environ={})
    assert rest == ["--mesh=1x8"]
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("10.0.0.1:1234", 4, 3)
    env = launch.child_env(launch.parse(["--devices_per_process=4", "--", "x"])[0], 1, "h:1",
                           base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"})
    s, _ = distributed.from_argv([], environ=env)
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("h:1", 2, 1)
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    if sys.platform.startswith("linux"):  # local processes take few malloc arenas, unless told
        assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
        a = launch.parse(["--", "x"])[0]
        assert launch.child_env(a, 0, "h:1", base={"GLIBC_TUNABLES": "glibc.malloc.arena_max=8"})[
            "GLIBC_TUNABLES"] == "glibc.malloc.arena_max=8"
        assert launch.child_env(a, 0, "h:1", base={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})[
            "GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"
    assert distributed.cluster_env({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) == "slurm"
    assert distributed.cluster_env({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    assert distributed.cluster_env({"OMPI_COMM_WORLD_SIZE": "2"}) == "openmpi"
    assert distributed.num_processes_hint([], {"OMPI_COMM_WORLD_SIZE": "2"}) == 2
    for bad, msg in ((["--process_id=2", "--num_processes=2"], "must be in 0..1"),
                     (["--coordinator_address=nohost"], "is not HOST:PORT"),
                     (["--num_processes=x"], "is not an integer")):
        with pytest.raises(UserError, match=msg):
            distributed.from_argv(bad, environ={})


def test_local_rows_follow_the_mesh():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import sharding
    for spec in ("1x8", "8x1", "2x4"):  # one process holds every row, whatever the mesh
        s = NamedSharding(sharding.make_mesh(spec), P("batch"))
        assert distributed.local_rows(s, (8, 5)) == slice(0, 8)
    assert jax.process_count() == 1

    class Host:  # what host 1 of 2 sees: its devices' index map only
        def __init__(self, blocks):
            self.blocks = blocks

        def addressable_devices_indices_map(self, shape):
            return {d: (slice(a, b), slice(None)) for d, (a, b) in enumerate(self.blocks)}
    assert distributed.local_rows(Host([(4, 6), (6, 8), (4, 6)]), (8, 5)) == slice(4, 8)
    assert distributed.local_rows(Host([(0, 2), (0, 2)]), (4, 5)) == slice(0, 2)
    with pytest.raises(UserError, match="non-contiguous"):
        distributed.local_rows(Host([(0, 2), (4, 6)]), (8, 5))
