"""The compile cache (jaxlm/compile_cache.py): a second `python train.py` loads its compiled
programs instead of compiling them; a folder that cannot be used is one line, or skipped."""
import os
import subprocess
import sys

import pytest

from jaxlm import compile_cache
from jaxlm.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--mesh=1x2", "--lora_rank=4", "--steps=2", "--batch_size=4", "--sequence_length=16",
        "--loss_on=all", "--eval_examples=0", "--num_samples=0"]


def _train(args, cache=None, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    e.update(JAX_PLATFORMS="cpu", **env)
    if cache is not None:
        e["JAXLM_COMPILE_CACHE"] = str(cache)
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                          env=e, capture_output=True, text=True, timeout=300)


def _last_loss(out: str) -> str:
    return [line for line in out.splitlines() if line.startswith("loss ")][-1]


def test_second_run_loads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "xla"
    # every program, however quick to compile (the default keeps those over a second)
    quick = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    first = _train([*TINY, f"--out={tmp_path}/a"], cache, **quick)
    assert first.returncode == 0, first.stderr
    written = sorted(os.listdir(cache))
    assert any(name.startswith("jit_step") for name in written), written
    assert f"compile cache: {cache} (0 compiled programs loaded" in first.stdout

    second = _train([*TINY, f"--out={tmp_path}/b"], cache, **quick)
    assert second.returncode == 0, second.stderr
    loaded = int(second.stdout.split(f"compile cache: {cache} (")[1].split()[0])
    assert loaded >= 1, second.stdout
    assert _last_loss(second.stdout) == _last_loss(first.stdout)  # the same programs

    before = sorted(os.listdir(cache))
    other = [a if a != "--batch_size=4" else "--batch_size=2" for a in TINY]  # a new step
    off = _train([*other, f"--out={tmp_path}/c", "--compile_cache="], cache, **quick)
    assert off.returncode == 0, off.stderr
    assert "compile cache:" not in off.stdout
    assert sorted(os.listdir(cache)) == before


def test_an_unusable_folder_given_is_one_line(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    for value, says in ((f"{blocked}/xla", "cannot write there"), ("gs://b/xla", "local folder")):
        r = _train([*TINY, f"--out={tmp_path}/o", f"--compile_cache={value}"])
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --compile_cache=") and says in lines[0], r.stderr
        assert "--compile_cache= to run without" in lines[0]


def test_default_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == os.path.join(str(tmp_path), "jaxlm", "xla")
    monkeypatch.setenv(compile_cache.ENV, "")
    assert compile_cache.default_dir() == ""
    assert compile_cache.enable() is None  # off: nothing set


def test_an_unusable_default_is_skipped(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(compile_cache.ENV, f"{blocked}/xla")
    assert compile_cache.enable() is None  # the run goes on uncached
    with pytest.raises(UserError, match="cannot write there"):
        compile_cache.enable(f"{blocked}/xla")
