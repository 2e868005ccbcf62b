"""`python train.py`: one-line errors with exit code 2; kill -9 or SIGTERM + rerun == uninterrupted run."""
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from jaxlm.train import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tiny and quick, but long enough (in steps) that a kill lands mid-run.
TINY = ["--mesh=1x8", "--lora_rank=4", "--steps=50", "--save_every=3", "--keep=2",
        "--batch_size=8", "--sequence_length=16", "--loss_on=all", "--eval_examples=0", "--num_samples=0",
        "--log_every=20"]


def env():
    e = dict(os.environ)
    # train.py sets the simulated device count itself from --mesh; the conftest's value (8)
    # must not leak in, so the device-count logic is what these runs exercise.
    e["XLA_FLAGS"] = " ".join(f for f in e.get("XLA_FLAGS", "").split()
                              if "xla_force_host_platform_device_count" not in f)
    e["JAX_PLATFORMS"] = "cpu"
    return e


def launch(args, **kw):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    csv = tmp_path / "qa.csv"
    csv.write_text("question,answer\nq,a\n")
    cases = {
        "--mesh=1x": "is not of the form DxM",
        "--mesh=0x8": "dimension < 1",
        "--mesh=3x4 --xla": "needs 12 devices but 8 are available",
        "--lora_rank=-1": "--lora_rank=-1 must be >= 0",
        f"--data={tmp_path}/missing.csv": "does not exist",
        f"--data={csv}": "found: 'question', 'answer'",
        "--steps=5 --epochs=1": "not both",
        "--no_such_flag": "unrecognized arguments",
        "--lora_targets=.*nothing/kernel": "matches no parameter",
        "--layout=diagonal": "diagonal",
        "--attention=cudnn": "needs an NVIDIA GPU",
        "--attention=cudnn --compile_only=v5e:2x4": "drop the flag",
    }
    procs = {}
    for case in cases:
        args = [a for a in case.split() if a != "--xla"]
        if "--mesh" not in case:
            args.append("--mesh=1x2")
        extra = {}
        if case.endswith("--xla"):  # 8 devices exist; a 3x4 mesh does not fit them
            e = env()
            e["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
            extra["env"] = e
        procs[case] = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "train.py"), *args, f"--out={tmp_path}/o"],
            cwd=ROOT, env=extra.get("env", env()), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        lines = [l for l in err.splitlines() if l.strip()]
        assert proc.returncode == 2, (case, out[-2000:], err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, err)
        assert cases[case] in lines[0], (case, lines[0])


def test_task_mlm_is_dispatched():
    """--task=mlm hands the other flags to jaxlm.mlm (which asks for its own required flags)."""
    proc = launch(["--task=mlm", "--mesh=1x2"])
    out, err = proc.communicate(timeout=300)
    message = err.split("error:")[-1].split("(see ")[0]  # the "(see ... --help)" hint names the task
    assert proc.returncode == 2 and "--tokenizer" in message and "--task" not in message
    assert len(err.strip().splitlines()) == 1  # one line, not argparse's usage block


def final_adapters(out_dir):
    with h5py.File(os.path.join(out_dir, "adapters.lora.h5"), "r") as f:
        return {f"{k}/{n}": np.asarray(f["lora"][k]["vars"][n]) for k in f["lora"] if k != "vars"
                for n in f["lora"][k]["vars"]}


def finished(proc):
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    return out


def _committed(out):
    ckpts = os.path.join(out, "checkpoints")
    return any(os.path.exists(os.path.join(ckpts, d, "commit_success.txt"))
               for d in (os.listdir(ckpts) if os.path.isdir(ckpts) else []) if d.isdigit())


def _stop_at_first_commit(runs):
    """Send each (proc, out, signal) its signal as soon as the run in `out` has committed a
    checkpoint, watching all of them at once: waiting on one first lets the others run on,
    sometimes to their end (CI once sent SIGTERM to a run already saving its last step)."""
    waiting, deadline = list(runs), time.time() + 300
    while waiting and time.time() < deadline:
        for run in list(waiting):
            proc, out, sig = run
            assert proc.poll() is None, "the run finished before it could be stopped; raise --steps"
            if _committed(out):
                proc.send_signal(sig)
                waiting.remove(run)
        time.sleep(0.05)
    assert not waiting, "no checkpoint was committed within 300 s"


def test_kill_9_or_sigterm_then_rerun_equals_uninterrupted(tmp_path):
    straight, crashed = str(tmp_path / "straight"), str(tmp_path / "crashed")
    termed = str(tmp_path / "termed")
    ref = launch(TINY + [f"--out={straight}"])
    victim = launch(TINY + [f"--out={crashed}"], start_new_session=True)
    preempted = launch(TINY + [f"--out={termed}"])
    ckpts = os.path.join(crashed, "checkpoints")
    _stop_at_first_commit([(victim, crashed, signal.SIGKILL), (preempted, termed, signal.SIGTERM)])
    victim.communicate()

    # SIGTERM (a preempted VM): the step running finishes, is checkpointed, exit 0, one line.
    out, err = preempted.communicate(timeout=120)
    assert preempted.returncode == 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped at step ") and last.endswith("; rerun the same command to resume")
    stopped_at = int(last.split()[3].rstrip(";"))
    assert 0 < stopped_at < 50 and "Traceback" not in err
    assert os.path.exists(os.path.join(termed, "checkpoints", str(stopped_at), "commit_success.txt"))
    assert not os.path.exists(os.path.join(termed, "adapters.lora.h5"))  # no export yet
    assert f"resuming from step {stopped_at} " in finished(launch(TINY + [f"--out={termed}"]))
    done = sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())
    assert done and max(done) < 50

    out = finished(launch(TINY + [f"--out={crashed}"]))  # the very same command
    assert "resuming from step" in out
    resumed_at = int(out.split("resuming from step ")[1].split()[0])
    assert 0 < resumed_at < 50
    printed = finished(ref)
    # What the run leaves to look at: the time table, the PNG, TensorBoard's events.
    table = printed[printed.index("time: phase"):].splitlines()
    assert [l.split()[0] for l in table[1:]] == ["load", "eval", "compile", "train", "eval",
                                                   "export", "total"], table
    peaks = [float(l.split()[-2]) for l in table[1:-1] if l.split()[0] != "eval"]
    assert peaks == sorted(peaks) and 0.2 < peaks[-1] < 20, table  # GB, a high-water mark
    with open(os.path.join(straight, "metrics.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    loss = report.read_scalars(os.path.join(straight, "tensorboard"))["train/loss"]
    jsonl = [json.loads(l) for l in open(os.path.join(straight, "metrics.jsonl"))]
    assert [s for s, _ in loss] == list(range(1, 51))
    np.testing.assert_allclose([v for _, v in loss], [r["loss"] for r in jsonl], rtol=1e-6)

    a, b, c = final_adapters(straight), final_adapters(crashed), final_adapters(termed)
    assert a.keys() == b.keys() == c.keys() and len(a) == 8  # 2 layers x (query, value) x (A, B)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        np.testing.assert_array_equal(a[k], c[k], err_msg=k)
    assert not np.all(a[next(k for k in a if "lora_kernel_b" in k)] == 0)  # it did train
    # metrics continue where the killed run stopped
    steps = [int(l.split('"step": ')[1].split(",")[0])
             for l in open(os.path.join(crashed, "metrics.jsonl"))]
    assert steps[-1] == 50
    # a clean stop logs its last steps first: every step once
    steps = [int(l.split('"step": ')[1].split(",")[0])
             for l in open(os.path.join(termed, "metrics.jsonl"))]
    assert steps == list(range(1, 51))

    # the same --out with a flag that changes the trajectory is refused, not silently mixed
    proc = launch(TINY + [f"--out={crashed}", "--learning_rate=0.5"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "flags differ: learning_rate" in err, err[-2000:]


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports torch, boto3 and google-cloud-storage when they are installed (0.18
    GB and 34 MB of RSS in every process of a run), and the Keras preset reader h5py (10 MB);
    train.py's libraries and the writer are imported without them, and the events read back."""
    pytest.importorskip("torch")  # without torch installed there is nothing to keep out
    code = ("import sys\nimport jaxlm.train.lm\nfrom jaxlm.train import report\n"
            "b = report.TensorBoard(sys.argv[1])\n"
            "b.write([{'step': 1, 'loss': 2.5}, {'step': 2, 'loss': 1.5}])\nb.close()\n"
            "print([m for m in ('torch', 'boto3', 'google.cloud.storage', 'h5py') "
            "if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]
    assert report.read_scalars(os.path.join(tmp_path, "tensorboard"))["train/loss"] == [(1, 2.5), (2, 1.5)]
