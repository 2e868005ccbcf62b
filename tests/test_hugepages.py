"""The command-line tools restart once with glibc's huge-page tunable (jaxlm.hugepages)."""
import os
import re
import subprocess
import sys

import pytest

from jaxlm import hugepages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tuned_environ_adds_the_tunable_once_and_keeps_the_users(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert hugepages.tuned_environ({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": hugepages.TUNABLE}
    other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert hugepages.tuned_environ(other)["GLIBC_TUNABLES"] == \
        "glibc.malloc.arena_max=2:" + hugepages.TUNABLE
    assert hugepages.tuned_environ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
    assert hugepages.tuned_environ({"GLIBC_TUNABLES": hugepages.TUNABLE}) is None
    assert hugepages.tuned_environ({"JAXLM_HUGE_PAGES": "0"}) is None
    monkeypatch.setattr(sys, "platform", "darwin")
    assert hugepages.tuned_environ({}) is None


def test_with_tunables_adds_only_the_names_not_set():
    assert hugepages.with_tunables("", "a.b=1", "c.d=2") == "a.b=1:c.d=2"
    assert hugepages.with_tunables("c.d=5", "a.b=1", "c.d=2") == "c.d=5:a.b=1"
    assert hugepages.with_tunables("a.b=0:c.d=5", "a.b=1", "c.d=2") == "a.b=0:c.d=5"
    assert hugepages.with_tunables("a.bc=0", "a.b=1") == "a.bc=0:a.b=1"  # names, not prefixes


def test_restart_execs_the_same_command_line(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("JAXLM_HUGE_PAGES", raising=False)
    calls = []
    hugepages.restart_with_huge_pages(execve=lambda *a: calls.append(a))
    (path, argv, env), = calls
    assert path == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env["GLIBC_TUNABLES"] == hugepages.TUNABLE

    def refuse(*args):
        raise PermissionError("exec refused")
    hugepages.restart_with_huge_pages(execve=refuse)  # runs on instead of failing the command


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables are Linux-only")
def test_a_script_restarts_exactly_once_with_its_arguments(tmp_path):
    script = tmp_path / "tool.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from jaxlm.hugepages import restart_with_huge_pages\n"
        "print('start', os.environ.get('GLIBC_TUNABLES'), flush=True)\n"
        "restart_with_huge_pages()\n"
        "print('run', os.environ['GLIBC_TUNABLES'], sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXLM_HUGE_PAGES")}
    out = subprocess.run([sys.executable, str(script), "a", "--b=1"], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out == ["start None", f"start {hugepages.TUNABLE}",
                   f"run {hugepages.TUNABLE} ['a', '--b=1']"]
    env["JAXLM_HUGE_PAGES"] = "0"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout.splitlines() == ["start None"]  # KeyError: no restart


def test_starting_module_is_the_m_target_only_while_python_locates_it():
    assert hugepages.starting_module(["-m"], ["python", "-X", "importtime", "-m", "jaxlm.generate",
                                              "--model=m"]) == "jaxlm.generate"
    assert hugepages.starting_module(["/x/jaxlm/generate.py"], ["python", "-m", "jaxlm.generate"]) \
        is None  # the module runs: the package's import is over
    assert hugepages.starting_module(["train.py"], ["python", "train.py", "-m", "x"]) is None
    assert hugepages.starting_module(["-m"], ["python", "-m"]) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables are Linux-only")
@pytest.mark.parametrize("command, flag", [([os.path.join(ROOT, "train.py")], "--lora_rank"),
                                           (["-m", "jaxlm.generate"], "--max_length")],
                         ids=["train.py", "jaxlm.generate"])
def test_the_commands_restart_before_importing_jax(command, flag):
    """train.py and `python -m jaxlm.generate` restart before JAX is imported, so it is imported
    once, by the restarted process (`-X importtime` lines of both processes share stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXLM_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-X", "importtime", *command, "--help"], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True)
    assert flag in out.stdout  # the command's own help
    assert len(re.findall(r"\|\s+jax\s*$", out.stderr, re.MULTILINE)) == 1
