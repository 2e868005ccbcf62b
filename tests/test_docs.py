"""README.md and docs/*.md as a newcomer reads them: every code block runs, every flag exists.

How a page is run (docs/architecture.md, "The doc test"):
- Its blocks run in order in one fresh working directory that looks like a checkout (its
  top-level entries link to the repository's), with the repository on PYTHONPATH and the
  suite's environment (conftest: 8 simulated CPU devices, JAXLM_DEFAULT_PRESET=gemma_tiny), so
  a page can train into `runs/x` in one block and read it in the next.
- ```bash / ```sh blocks run with `bash -e`; ```python blocks with `python`; every other info
  string (```text for listings and output) is shown, never run. A fence without an info
  string is an error: say what the block is.
- A block that cannot run here is marked on the line before its fence, with the reason in
  parentheses, which a reader of the source sees:
      <!-- doc-test: skip (needs a TPU VM) -->          not run
      <!-- doc-test: no-install (CI installs them) -->  run without its `pip install ...` commands
  A mark without a reason, an unknown mark, or `pip install` in a block without one is an error.
- Every `--flag` of a jaxlm command line (in a block or an inline code span) must appear in that
  command's `--help`; every other `--flag` in the text must belong to some jaxlm command or be
  listed in EXTERNAL_FLAGS (other tools' flags).
"""
from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
README_MAX_LINES = 250
RUN = {"bash": "bash", "sh": "bash", "python": "python"}
MARKS = ("skip", "no-install")
BLOCK_TIMEOUT_S = 240
# Flags of other tools the pages mention (gcloud, srun, tfds, XLA, pip, hf), never ours.
EXTERNAL_FLAGS = {"--worker", "--command", "--zone", "--data_dir", "--config", "--local-dir",
                  "--nodes", "--ntasks-per-node",
                  "--xla_force_host_platform_device_count", "--xla_dump_to",
                  "--xla_dump_hlo_as_text", "--xla_gpu_enable_dynamic_slice_fusion",
                  "--upgrade", "--pyargs", "--logdir"}
# The jaxlm entry points; any other `python -m jaxlm.X` or `python bench/X.py` on a page is
# checked against its own --help too.
ENTRY_POINTS = ["train.py", "train.py --task=mlm", "-m jaxlm.convert", "-m jaxlm.generate",
                "-m jaxlm.shards", "-m jaxlm.tokenizer train", "-m jaxlm.launch"]


@dataclasses.dataclass
class Block:
    page: str
    line: int          # 1-based line of the opening fence
    lang: str          # first word of the info string ("" when there is none)
    text: str
    mark: str | None = None
    reason: str | None = None


FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
MARK = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")


def parse(text: str, page: str = "<text>") -> tuple[list[Block], list[str]]:
    """-> (fenced blocks with their marks, problems found while parsing)."""
    blocks, problems, lines = [], [], text.splitlines()
    i, pending = 0, None  # pending: (line, mark body) of a doc-test comment awaiting its fence
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            mk = MARK.match(lines[i])
            if mk:
                if pending:
                    problems.append(f"{page}:{pending[0]}: doc-test mark without a block after it")
                pending = (i + 1, mk.group(1))
            elif lines[i].strip() and pending:
                problems.append(f"{page}:{pending[0]}: doc-test mark not directly before a block")
                pending = None
            i += 1
            continue
        fence, info = m.group(1), m.group(2).strip()
        close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        block = Block(page, i + 1, info.split()[0].lower() if info else "", "\n".join(lines[i + 1:j]) + "\n")
        if not info:
            problems.append(f"{page}:{i + 1}: a fence without an info string; say what it is "
                            "(bash, python, text, ...)")
        if pending:
            body = re.fullmatch(r"([\w-]+)\s*(?:\((.*)\))?", pending[1])
            if body is None or body.group(1) not in MARKS:
                problems.append(f"{page}:{pending[0]}: unknown doc-test mark {pending[1]!r}; "
                                f"use one of {', '.join(MARKS)} with a (reason)")
            elif not (body.group(2) or "").strip():
                problems.append(f"{page}:{pending[0]}: doc-test {body.group(1)} needs a reason "
                                "in parentheses, e.g. (needs a TPU)")
            else:
                block.mark, block.reason = body.group(1), body.group(2).strip()
            pending = None
        if block.lang in RUN and block.mark is None and re.search(r"\bpip install\b", block.text):
            problems.append(f"{page}:{i + 1}: `pip install` in a block the doc test would run; "
                            "mark it no-install or skip")
        blocks.append(block)
        i = j + 1
    if pending:
        problems.append(f"{page}:{pending[0]}: doc-test mark without a block after it")
    return blocks, problems


def logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def without_install(script: str) -> str:
    """The script with its `pip install ...` commands (one `&&` segment each) left out."""
    kept = []
    for line in logical_lines(script):
        parts = [p for p in line.split("&&")
                 if not re.match(r"\s*(python -m )?pip install\b", p)]
        if any(p.strip() for p in parts):
            kept.append("&&".join(parts).strip())
    return "\n".join(kept) + "\n"


def workdir(path: str) -> str:
    """A fresh folder that looks like a checkout: links to the repository's top-level entries."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(ROOT):
        if not name.startswith(".") and name not in ("runs", "__pycache__"):
            os.symlink(os.path.join(ROOT, name), os.path.join(path, name))
    return path


def environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_block(block: Block, cwd: str, scratch: str, timeout: float = BLOCK_TIMEOUT_S):
    """-> (exit code, output, seconds). scratch: where the block's own file goes."""
    body = without_install(block.text) if block.mark == "no-install" else block.text
    name = os.path.join(scratch, f"block_{block.line}.{'py' if RUN[block.lang] == 'python' else 'sh'}")
    with open(name, "w") as f:
        f.write(body)
    argv = [sys.executable, name] if RUN[block.lang] == "python" else ["bash", "-e", name]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, cwd=cwd, env=environment(), capture_output=True, text=True,
                           timeout=timeout)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n(timed out after {timeout:.0f} s)", time.perf_counter() - t0


def run_page(blocks: list[Block], cwd: str, scratch: str) -> list[str]:
    """Run a page's runnable blocks in order; -> failure reports (empty when all passed)."""
    failures = []
    for b in blocks:
        if b.lang not in RUN or b.mark == "skip":
            continue
        rc, out, seconds = run_block(b, cwd, scratch)
        print(f"{b.page}:{b.line}: {b.lang} block, exit {rc}, {seconds:.1f} s")
        if rc != 0:
            tail = "\n".join(out.splitlines()[-25:])
            failures.append(f"{b.page}:{b.line}: the {b.lang} block exits {rc}:\n{b.text}"
                            f"--- last lines of its output ---\n{tail}")
            break  # later blocks of the page usually build on this one
    return failures


# --- flags --------------------------------------------------------------------------------

PYTHON = {"python", "python3"}
SHELL_OPS = {"&&", "||", "|", ";", ">", "2>&1", "--"}


def commands(line: str) -> list[tuple[str, list[str]]]:
    """jaxlm command lines in one shell line -> [(entry point, its flags)]; the entry point is
    what follows `python`: "train.py" (or "train.py --task=mlm"), "-m jaxlm.X [subcommand]",
    "bench/X.py". Quoted arguments holding a command (gcloud --command="...") count too."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    found, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        if " " in tok and "python" in tok:
            inner = tok.split("=", 1)[1] if tok.startswith("--") and "=" in tok else tok
            found += commands(inner)
        if tok in PYTHON and i + 1 < len(tokens):
            if tokens[i + 1] == "-m" and i + 2 < len(tokens) and tokens[i + 2].startswith("jaxlm"):
                entry, j = f"-m {tokens[i + 2]}", i + 3
                if tokens[i + 2] == "jaxlm.tokenizer" and j < len(tokens) and not tokens[j].startswith("-"):
                    entry, j = f"{entry} {tokens[j]}", j + 1
            elif re.fullmatch(r"(\./)?(train\.py|bench/\w+\.py)", tokens[i + 1]):
                entry, j = tokens[i + 1].removeprefix("./"), i + 2
            else:
                i += 1
                continue
            flags = []
            while j < len(tokens) and tokens[j] not in SHELL_OPS:
                if tokens[j] in PYTHON:  # `srun python ...` etc. never nest, but a launcher's `--` does
                    break
                if re.match(r"--[A-Za-z]", tokens[j]):
                    flags.append(tokens[j].split("=", 1)[0])
                j += 1
            if entry == "train.py" and "--task" in flags and any(
                    t in ("--task=mlm", "mlm") for t in tokens[i:j]):
                entry = "train.py --task=mlm"
            found.append((entry, flags))
            i = j
            continue
        i += 1
    return found


def inline_code(text: str) -> list[str]:
    """The inline code spans of markdown prose (fenced blocks removed)."""
    prose = re.sub(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1\s*$", "", text, flags=re.M | re.S)
    return re.findall(r"`([^`\n]+)`", prose)


def help_argv(entry: str) -> list[str]:
    argv = [sys.executable] + entry.split() + ["--help"]
    return argv + (["--"] if entry == "-m jaxlm.launch" else [])


@pytest.fixture(scope="module")
def pages():
    out = {}
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            out[page] = f.read()
    return out


@pytest.fixture(scope="module")
def help_flags(pages):
    """entry point -> the set of `--flags` its --help prints (four asked at a time)."""
    entries = set(ENTRY_POINTS)
    for text in pages.values():
        for chunk in [b.text for b in parse(text)[0] if b.lang in RUN] + inline_code(text):
            entries |= {e for line in logical_lines(chunk) for e, _ in commands(line)}

    def ask(entry):
        return subprocess.run(help_argv(entry), cwd=ROOT, env=environment(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)

    with futures.ThreadPoolExecutor(4) as pool:  # each is a Python start-up (~0.3 GB)
        done = dict(zip(sorted(entries), pool.map(ask, sorted(entries))))
    flags, broken = {}, []
    for e, p in done.items():
        if p.returncode != 0:
            broken.append(f"`python {e} --help` exits {p.returncode}: {p.stdout.strip()[-300:]}")
        flags[e] = set(re.findall(r"--[A-Za-z][\w-]*", p.stdout))
    assert not broken, "\n".join(broken)
    return flags


# --- the tests ------------------------------------------------------------------------------

def test_readme_is_short(pages):
    n = len(pages["README.md"].splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; keep it <= {README_MAX_LINES} (move detail to docs/)"


def test_every_block_says_what_it_is_and_every_mark_has_a_reason(pages):
    problems = [p for page, text in pages.items() for p in parse(text, page)[1]]
    assert not problems, "\n".join(problems)


def test_every_flag_exists(pages, help_flags):
    every = set().union(*help_flags.values()) | EXTERNAL_FLAGS
    wrong = []
    for page, text in pages.items():
        chunks = [(b.line, b.text) for b in parse(text, page)[0] if b.lang in RUN]
        chunks += [(None, span) for span in inline_code(text)]
        for line_no, chunk in chunks:
            for line in logical_lines(chunk):
                for entry, flags in commands(line):
                    wrong += [f"{page}:{line_no or '(prose)'}: `python {entry}` has no {f} "
                              f"(not in its --help)" for f in flags if f not in help_flags[entry]]
        for number, line in enumerate(text.splitlines(), 1):
            wrong += [f"{page}:{number}: {f} is no jaxlm flag (nor in EXTERNAL_FLAGS)"
                      for f in re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", line) if f not in every]
    assert not wrong, "\n".join(sorted(set(wrong)))


@pytest.mark.parametrize("page", PAGES)
def test_page_runs(page, pages, tmp_path):
    blocks, problems = parse(pages[page], page)
    assert not problems, "\n".join(problems)
    scratch = tmp_path / "blocks"
    scratch.mkdir()
    failures = run_page(blocks, workdir(str(tmp_path / "checkout")), str(scratch))
    assert not failures, "\n\n".join(failures)


# --- the test's own checks: it must fail on what it guards against -------------------------

BROKEN = """Intro.

```bash
echo fine
```

<!-- doc-test: skip (needs a TPU) -->
```bash
exit 3
```

```python
raise SystemExit(4)
```
"""


def test_a_failing_unmarked_block_fails_and_a_marked_one_is_skipped(tmp_path):
    blocks, problems = parse(BROKEN)
    assert not problems
    assert [(b.lang, b.mark) for b in blocks] == [("bash", None), ("bash", "skip"), ("python", None)]
    failures = run_page(blocks, str(tmp_path), str(tmp_path))
    assert len(failures) == 1 and ":12: the python block exits 4" in failures[0]


def test_marks_need_a_reason_and_fences_a_language():
    text = ("<!-- doc-test: skip -->\n```bash\nx\n```\n\n<!-- doc-test: skip () -->\n```bash\n"
            "x\n```\n\n<!-- doc-test: later (soon) -->\n```bash\nx\n```\n\n```\nno language\n"
            "```\n\n```bash\npip install foo && echo ok\n```\n")
    problems = parse(text)[1]
    assert sum("needs a reason" in p for p in problems) == 2
    assert any("unknown doc-test mark" in p for p in problems)
    assert any("without an info string" in p for p in problems)
    assert any("`pip install` in a block" in p for p in problems)


def test_no_install_drops_only_the_install():
    assert without_install('pip install -e ".[demo]" && python train.py --mesh=1x8\n') == \
        "python train.py --mesh=1x8\n"
    assert without_install("pip install -U jax\necho hi\n") == "echo hi\n"


def test_command_lines_are_found_with_their_flags():
    assert commands("python train.py --mesh=1x8 --lora_rank 4  # --not_a_flag") == [
        ("train.py", ["--mesh", "--lora_rank"])]
    assert commands("python train.py --task=mlm --tokenizer=t") == [
        ("train.py --task=mlm", ["--task", "--tokenizer"])]
    assert commands("python -m jaxlm.launch --num_processes=2 -- python train.py --mesh=1x8") == [
        ("-m jaxlm.launch", ["--num_processes"]), ("train.py", ["--mesh"])]
    assert commands('gcloud x ssh N --worker=all --command="python train.py --out=gs://b/r"') == [
        ("train.py", ["--out"])]
    assert commands("python -m jaxlm.tokenizer train --vocab_size 8 --out d") == [
        ("-m jaxlm.tokenizer train", ["--vocab_size", "--out"])]
