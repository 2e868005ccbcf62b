"""What pods and people do: signals mid-run, failed saves, damaged checkpoints, edited data,
runaway CSV quotes, stale shards, meshes out of proportion, vocabularies pydoc cannot give.

Each case ends in one line (a UserError, a warning, a `Stopped`) and loses nothing saved. The
train.py-level runs (SIGTERM and resume, the 2-process stop) are in test_train_cli.py and
test_multihost.py; the sweep of bad command lines is test_sweep.py.
"""
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import checkpoint, machine, shards
from jaxlm.data import instructions
from jaxlm.errors import Stopped, UserError
from jaxlm.train import cli, loop
from test_checkpoint import state_at
from test_train_cli import ROOT, env


@pytest.fixture(scope="module")
def mesh():
    import sharding
    return sharding.make_mesh("1x8")


def _toy_step(state, frozen, batch):
    return ({"step": state["step"] + 1, "w": state["w"] * 2.0},
            {"loss": jnp.float32(1.0), "accuracy": jnp.float32(0.0), "count": jnp.float32(1.0)})


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_signal_finishes_the_step_checkpoints_and_stops(tmp_path, sig, code):
    d = str(tmp_path / "checkpoints")
    mngr = checkpoint.manager(d, keep=5)
    state = {"step": jnp.int32(0), "w": jnp.ones(4)}

    def get_batch(step):
        if step == 2:  # arrives while step 3 runs: steps 3 finishes, is saved, and the run ends
            os.kill(os.getpid(), sig)
        return None
    before = signal.getsignal(sig)
    with pytest.raises(Stopped) as e:
        loop.run(_toy_step, state, None, get_batch, num_steps=50, mngr=mngr, save_every=10,
                 log_every=100, meta=lambda s: {"step": s}, print_fn=lambda *a: None)
    mngr.close()
    assert e.value.code == code
    assert str(e.value) == "stopped at step 3; rerun the same command to resume"
    assert checkpoint.complete_steps(d) == [3]
    assert signal.getsignal(sig) is before  # the loop's handlers are gone again
    mngr = checkpoint.manager(d, keep=5)
    restored, meta = checkpoint.restore_latest(mngr, state)
    mngr.close()
    assert meta["step"] == 3 and np.asarray(restored["w"]).tolist() == [8.0] * 4


SAVE_FAILS = """
import os, sys
import jax.numpy as jnp
from jaxlm import checkpoint
from jaxlm.errors import cli
from jaxlm.train import loop
out = sys.argv[1]
ckpt = os.path.join(out, "checkpoints")

def step_fn(state, frozen, batch):
    return ({"step": state["step"] + 1, "w": state["w"] * 2},
            {"loss": 1.0, "accuracy": 0.0, "count": 1.0})

def get_batch(step):
    if step == 4:  # the checkpoint folder turns into a file under the running job
        mngr.wait_until_finished()  # else step 2's finishing save may re-create the folder
        os.rename(ckpt, ckpt + ".moved")
        open(ckpt, "w").close()

mngr = None

@cli
def main():
    global mngr
    mngr = checkpoint.manager(ckpt, keep=2)
    loop.run(step_fn, {"step": jnp.int32(0), "w": jnp.ones(4)}, None, get_batch, num_steps=10,
             mngr=mngr, save_every=2, log_every=100)
main()
"""


def test_a_failed_save_is_one_line_and_exits_in_seconds(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SAVE_FAILS)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and time.monotonic() - t0 < 30, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: cannot save"), r.stderr[-3000:]
    assert str(tmp_path / "checkpoints") in lines[0] and "Error" in lines[0]


def test_a_mesh_out_of_proportion_is_refused_fast_and_small():
    # Linux counts the parent's RSS at fork into a child's ru_maxrss, so train.py is started
    # from a fresh small interpreter (not from pytest, which holds GBs by now), which reports
    # its child's peak. The address-space cap is a safety net only: the old code grew to ~20 GB.
    wrapper = ("import resource, subprocess, sys; limit = 8 << 30; "
               "resource.setrlimit(resource.RLIMIT_AS, (limit, limit)); "
               "r = subprocess.run([sys.executable, 'train.py', '--mesh=1x1000', '--steps=1'], "
               "stdout=subprocess.DEVNULL, timeout=60); "
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", wrapper], cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=90)
    seconds = time.monotonic() - t0
    err = r.stderr.strip()
    code, maxrss = (int(x) for x in r.stdout.split())
    assert code == 2 and seconds < 10, (seconds, err[-2000:])
    assert maxrss < 1 << 20, maxrss  # KiB: under 1 GiB
    assert err.count("\n") == 0 and "needs 1000 simulated CPU devices" in err
    assert f"at most {machine.max_simulated_devices()}" in err


def test_closed_event_loop_callbacks_are_dropped_and_nothing_else(tmp_path, capsys):
    """What a failed orbax save or restore leaves behind: tensorstore reads completing into
    orbax's closed event loop, each an unraisable "Event loop is closed" traceback."""
    import types
    seen = []
    hook = checkpoint._drop_closed_loop_callbacks(seen.append)
    closed = types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"))
    other = types.SimpleNamespace(exc_value=RuntimeError("something else"))
    hook(closed)
    hook(other)
    assert seen == [other]
    checkpoint.manager(str(tmp_path / "c"), keep=1).close()
    assert getattr(sys.unraisablehook, "jaxlm", False)  # installed with every manager


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None or machine.has_tpu()
                    or machine.has_gpu(), reason="needs libtpu installed on a CPU-only machine")
def test_without_a_tpu_the_tpu_runtime_is_never_started():
    """libtpu would print its start-up chatter and take /tmp/libtpu_lockfile."""
    code = ("from jaxlm import machine; machine.quiet_without_tpu(); import jax; jax.devices(); "
            "from jax._src import xla_bridge as xb; print(sorted(xb.backends()), "
            "sorted(xb._backend_errors))")
    child = {k: v for k, v in env().items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.strip() == "['cpu'] []" and not r.stderr.strip(), (r.stdout, r.stderr[-2000:])


def test_machine_rules():
    assert machine.max_simulated_devices() >= 8  # the test suite's meshes always fit
    with pytest.raises(UserError, match="--mesh=1x9999 needs 9999"):
        machine.check_simulated_devices(9999, "--mesh=1x9999")
    if not (machine.has_tpu() or machine.has_gpu()):
        environ = {}
        machine.quiet_without_tpu(environ)
        assert environ == {"JAX_PLATFORMS": "cpu", "TPU_MIN_LOG_LEVEL": "3",
                           "TPU_STDERR_LOG_LEVEL": "3"}
    environ = {"JAX_PLATFORMS": "cuda"}
    machine.quiet_without_tpu(environ)
    assert environ["JAX_PLATFORMS"] == "cuda"  # the user's choice stays
    # the device count is replaced, the other flags kept; None leaves XLA's one device
    flags = "--xla_foo=1 --xla_force_host_platform_device_count=8"
    assert machine.with_host_devices(flags, 2) == "--xla_foo=1  --xla_force_host_platform_device_count=2"
    assert machine.with_host_devices(flags, None) == "--xla_foo=1"
    assert machine.with_host_devices("--xla_force_host_platform_device_count=8", None) == ""


def _csv(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return str(path)


def test_a_runaway_csv_quote_is_refused_with_the_rows_it_would_lose(tmp_path):
    rows = "".join(f"q{i},a{i}\n" for i in range(5))
    for name, body in [("to_eof.csv", 'q,"broken\n' + rows),           # runs to the end
                       ("mid.csv", 'q,"broken\n' + rows + 'q5,"x"\nq6,a6\n')]:  # to a later quote
        with pytest.raises(UserError) as e:
            instructions.read_records(_csv(tmp_path, name, "instruction,output\nq0,a0\n" + body))
        msg = str(e.value)
        assert "line 3 opens a quote that runs on to line" in msg and "lose their rows" in msg, msg
        assert ("the 5 line(s)" in msg) if name == "to_eof.csv" else ("the 6 line(s)" in msg)
    # A real multi-line field is kept, and so is a quote left open on the last line (it
    # swallows nothing); a broken one-line row is still skipped and counted.
    ok = instructions.read_records(_csv(tmp_path, "ok.csv", 'instruction,output\n"a\nb",c\nd,e\n'))
    assert ok.instructions == ["a\nb", "d"] and ok.skipped == 0
    last = instructions.read_records(_csv(tmp_path, "last.csv", 'instruction,output\nd,e\nf,"g\n'))
    assert last.outputs == ["e", "g\n"]
    short = instructions.read_records(_csv(tmp_path, "short.csv", "instruction,output\nd,e\nf\n"))
    assert len(short) == 1 and short.report("short.csv").endswith("(1 missing output); kept 1")


def test_excel_utf8_bom_is_read(tmp_path):
    got = instructions.read_records(_csv(tmp_path, "excel.csv", "\ufeffinstruction,output\nq,a\n"))
    assert got.instructions == ["q"] and got.outputs == ["a"]
    path = tmp_path / "bom.jsonl"
    path.write_bytes('\ufeff{"instruction": "q", "output": "a"}\n'.encode())
    assert instructions.read_records(str(path)).instructions == ["q"]


def test_edited_data_is_refused_on_resume_unless_allowed(tmp_path, mesh):
    data = _csv(tmp_path, "d.csv", "instruction,output\nq,a\n")
    fp = {"data": data, "data_files": cli.data_files(data)}
    mngr = checkpoint.manager(str(tmp_path / "ckpt"), keep=1)
    checkpoint.save(mngr, 1, state_at(mesh, 1), {"step": 1, "fingerprint": fp})
    checkpoint.wait(mngr)
    assert checkpoint.resume(mngr, state_at(mesh, 0), fp, "OUT")[1]["step"] == 1
    _csv(tmp_path, "d.csv", "instruction,output\nq,b\n")  # same size, other content
    edited = {"data": data, "data_files": cli.data_files(data)}
    assert edited != fp
    with pytest.raises(UserError, match=r"the data changed since OUT was checkpointed \(.*d\.csv "
                                        r"differ.*--allow_data_change"):
        checkpoint.resume(mngr, state_at(mesh, 0), edited, "OUT")
    assert checkpoint.resume(mngr, state_at(mesh, 0), edited, "OUT",
                             allow_change=checkpoint.DATA_KEYS)[1]["step"] == 1
    with pytest.raises(UserError, match="flags differ: data"):  # another file is another run
        checkpoint.resume(mngr, state_at(mesh, 0), {**edited, "data": "other.csv"}, "OUT",
                          allow_change=checkpoint.DATA_KEYS)
    mngr.close()


@pytest.mark.parametrize("damage", ["garbage", "missing"])
def test_a_damaged_newest_step_is_set_aside_and_the_older_one_resumed(tmp_path, mesh, caplog,
                                                                       damage):
    d = str(tmp_path / "checkpoints")
    mngr = checkpoint.manager(d, keep=3)
    for s in (2, 4):
        checkpoint.save(mngr, s, state_at(mesh, s), {"step": s})
    checkpoint.wait(mngr)
    mngr.close()
    state_dir = os.path.join(d, "4", "state")
    if damage == "missing":
        shutil.rmtree(state_dir)
    else:  # every array chunk overwritten: the step folder and its metadata look fine
        for root, _, files in os.walk(state_dir):
            for name in files:
                if root != state_dir and "metadata" not in root:
                    with open(os.path.join(root, name), "wb") as f:
                        f.write(b"not a chunk")
    mngr = checkpoint.manager(d, keep=3)
    with caplog.at_level(logging.WARNING, logger="jaxlm"):
        state, meta = checkpoint.restore_latest(mngr, state_at(mesh, 0))
    assert meta["step"] == 2 and int(state["step"]) == 2
    warnings = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warnings) == 1 and "step 4" in warnings[0] and "resuming from step 2" in warnings[0]
    assert ("files missing: state" if damage == "missing" else "unreadable: ") in warnings[0]
    assert checkpoint.complete_steps(d) == [2]
    aside = os.listdir(tmp_path / checkpoint.DAMAGED_DIR)
    assert len(aside) == 1 and aside[0].startswith("4.")  # moved, not deleted
    checkpoint.save(mngr, 6, state_at(mesh, 6), {"step": 6})  # and the run goes on
    checkpoint.wait(mngr)
    mngr.close()
    assert checkpoint.complete_steps(d) == [2, 6]


def test_stale_shards_are_refused_and_overwrite_replaces_them(tmp_path):
    out = tmp_path / "shards"
    for split, names in (("train", ["dataset-0-10.tfrecord", "dataset-1-10.tfrecord"]),
                         ("validation", ["dataset-0-3.tfrecord"])):
        (out / split).mkdir(parents=True)
        for n in names:
            (out / split / n).write_bytes(b"old")
    with pytest.raises(UserError, match="already holds 3 shard"):
        shards.claim_out(str(out), overwrite=False)
    # A second machine of two writing into the same --out only minds its own slots (odd ones).
    with pytest.raises(UserError, match="already holds 1 shard"):
        shards.claim_out(str(out), overwrite=False, part=1, parts=2)
    shards.claim_out(str(out), overwrite=True, part=1, parts=2)
    assert sorted(os.listdir(out / "train")) == ["dataset-0-10.tfrecord"]
    shards.claim_out(str(out), overwrite=True)
    assert os.listdir(out / "train") == [] and os.listdir(out / "validation") == []
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("mine")
    with pytest.raises(UserError, match="already holds other files"):
        shards.claim_out(str(tmp_path / "notes"), overwrite=False)


def test_builtin_architectures_get_a_tokenizer_of_their_size(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLM_CACHE", str(tmp_path))
    import jaxlm
    from jaxlm.tokenizer import PYDOC_PIECES, default_tokenizer
    big = jaxlm.load_tokenizer("gemma_2b_en")
    assert big.vocab_size == 256_000 and (big.pad_id, big.eos_id, big.bos_id) == (0, 1, 2)
    small = default_tokenizer(PYDOC_PIECES)
    text = "def f(x):\n    return x  # Gemma"
    assert big.encode(text) == small.encode(text)  # the trained pieces keep their ids
    assert big.decode(big.encode(text)) == small.decode(small.encode(text))
    assert max(big.encode(text * 20)) < PYDOC_PIECES  # padding pieces are never produced


def test_second_ctrl_c_and_ctrl_c_at_start_up_are_one_line(tmp_path):
    """Ctrl-C twice exits at once (130, no traceback); before the loop, one line too.

    Each signal is sent only once the process has shown it is where the test wants it: two
    SIGINTs that land before Python runs its handler are delivered to it as one."""
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent("""
        import sys, time, jax.numpy as jnp
        from jaxlm.errors import cli
        from jaxlm.train import loop
        def step(state, frozen, batch):  # inside the loop: the watch is installed
            print("stepping", flush=True)
            time.sleep(20.0)  # far longer than the test needs: both signals land in this step
            return {"step": state["step"] + 1}, {"loss": 1.0, "accuracy": 0.0, "count": 1.0}
        def start_up():
            print("starting", flush=True)
            time.sleep(20.0)
        main = start_up if sys.argv[1:] == ["start-up"] else lambda: loop.run(
            step, {"step": jnp.int32(0)}, None, lambda s: None, num_steps=1000, log_every=1000,
            print_fn=lambda *a: None)
        cli(main)()
    """))

    def started(*args):
        proc = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, env=env(),
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.readline()
        return proc

    proc = started()
    proc.send_signal(signal.SIGINT)
    for line in proc.stderr:  # whatever the runtime printed before the handler's line
        if line.startswith("interrupt: finishing this step"):
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == ("interrupted again: exiting now; the last complete "
                                            "checkpoint is kept") and "Traceback" not in err

    proc = started("start-up")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
