"""Bad input on every command line: each is one `error:` line, exit code 2, nothing saved touched.

The sweep runs train.py (causal LM and --task=mlm), `python -m jaxlm.convert` (also --to=hf),
`jaxlm.generate`, `jaxlm.tokenizer train`, `jaxlm.shards` and `jaxlm.launch` on mistakes a new
user makes -- paths that are files, flags out of range, damaged or edited inputs, a saved run
resumed with other flags or data -- two processes at a time, cheap cases first. Around it, every
file under the sweep's folder (a finished run, shards, a tokenizer, data) is fingerprinted
before and after: a refusal may not change, add or remove anything.
"""
import concurrent.futures as futures
import hashlib
import os
import resource
import subprocess
import sys

import pytest

from test_train_cli import ROOT, env

PY = sys.executable
TRAIN = [PY, "train.py"]
TINY = ["--preset=gemma_tiny", "--mesh=1x2", "--batch_size=2", "--sequence_length=16",
        "--loss_on=all", "--eval_examples=0", "--num_samples=0"]


def _snapshot(root: str, skip: str | None = None) -> dict:
    """{relative path: (size, mtime_ns, sha1)} of every file and folder under root."""
    out = {}
    for base, dirs, files in os.walk(root):
        if skip and os.path.commonpath([base, skip]) == skip:
            continue
        for name in dirs:
            out[os.path.relpath(os.path.join(base, name), root)] = "dir"
        for name in files:
            path = os.path.join(base, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns,
                                                    hashlib.sha1(f.read()).hexdigest())
    return out


def _diff(before: dict, after: dict) -> list[str]:
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The sweep's folder: data files good and bad, a tokenizer, shards, a broken model."""
    from jaxlm import shards, tokenizer_train
    from jaxlm.corpus import pydoc_corpus
    w = tmp_path_factory.mktemp("sweep")

    def write(name, text):
        (w / name).parent.mkdir(parents=True, exist_ok=True)
        (w / name).write_text(text)
        return str(w / name)
    rows = "".join(f"question {i},answer {i}\n" for i in range(8))
    write("good.csv", "instruction,output\n" + rows)
    write("run_data.csv", "instruction,output\n" + rows)
    write("quote.csv", 'instruction,output\nq,"never closed\n' + rows)
    write("columns.csv", "question,answer\nq,a\n")
    write("empty.csv", "")
    write("bad.json", "[{\"instruction\": ")
    write("data.tsv", "instruction\toutput\nq\ta\n")
    write("long.csv", "instruction,output\n" + "".join(
        f"{' '.join(['a long question'] * 20)} {i},answer {i}\n" for i in range(4)))
    write("corpus.txt", "\n".join(pydoc_corpus().splitlines()[:1200]) + "\n")
    write("afile", "a file where a folder should be\n")
    write("broken/jaxlm.json", '{"family": "gemma", "config": {')
    write("nonempty/keep.txt", "a previous conversion\n")
    (w / "ckfile").mkdir()
    write("ckfile/checkpoints", "not a folder\n")
    tok = str(w / "tok")
    lines = (w / "corpus.txt").read_text().splitlines()
    tokenizer_train.save(tokenizer_train.train(lines, 400, num_threads=1), tok)
    assert shards.main(["--input", str(w / "corpus.txt"), "--tokenizer", tok, "--max_length",
                        "32", "--shard_size", "100", "--out", str(w / "shards"),
                        "--validation_fraction", "0"]) == 0
    return w


def cases(w) -> list[tuple[str, list[str], str]]:
    """(name, command, text the error line must contain), cheapest first."""
    def p(name):
        return str(w / name)
    tok, sh, new = p("tok"), p("shards"), p("new")
    launch = [PY, "-m", "jaxlm.launch"]
    tokenizer = [PY, "-m", "jaxlm.tokenizer"]
    convert = [PY, "-m", "jaxlm.convert"]
    generate = [PY, "-m", "jaxlm.generate"]
    shards = [PY, "-m", "jaxlm.shards"]
    mlm = TRAIN + ["--task=mlm", "--preset=roberta_tiny", f"--tokenizer={tok}", f"--data={sh}",
                   "--mesh=1x2", "--max_length=32"]
    return [
        ("launch: no --", launch + ["--num_processes=2", PY], "give the command after --"),
        ("launch: 0 processes", launch + ["--num_processes=0", "--", PY], "must be >= 1"),
        ("launch: unknown flag", launch + ["--bogus", "--", PY], "unrecognized arguments"),
        ("launch: no command", launch + ["--"], "nothing to run after --"),
        ("launch: child cannot start", launch + ["--num_processes=2", "--", p("no/such/prog")],
         "cannot start"),
        ("tokenizer: unknown command", tokenizer + ["fit"], "unknown command 'fit'"),
        ("tokenizer: --out a file", tokenizer + ["train", f"--out={p('afile')}"], "is a file"),
        ("tokenizer: --out under a file", tokenizer + ["train", f"--out={p('afile')}/tok"],
         "lies under the file"),
        ("tokenizer: missing input", tokenizer + ["train", "--input", p("none.txt"), f"--out={new}"],
         "does not exist"),
        ("tokenizer: tiny vocabulary", tokenizer + ["train", "--vocab_size=3", f"--out={new}"],
         "is too small"),
        ("shards: stale --out", shards + ["--input", p("corpus.txt"), f"--tokenizer={tok}",
                                          f"--out={sh}"], "shard(s) of an earlier run"),
        ("shards: --out a file", shards + [f"--tokenizer={tok}", f"--out={p('afile')}"], "is a file"),
        ("shards: missing input", shards + ["--input", p("none.txt"), f"--tokenizer={tok}",
                                            f"--out={new}"], "does not exist"),
        ("shards: missing tokenizer", shards + [f"--tokenizer={p('notok')}", f"--out={new}"],
         "tokenizer path"),
        ("shards: --max_length 1", shards + ["--input", p("corpus.txt"), f"--tokenizer={tok}",
                                             "--max_length=1", f"--out={new}"], "too small"),
        ("generate: no --model", generate + ["--prompt=hi"], "required: --model"),
        ("generate: no prompt", generate + ["--model=gemma_tiny"], "no prompts given"),
        ("generate: bad sampler", generate + ["--model=gemma_tiny", "--prompt=hi", "--sampler=best"],
         "best"),
        ("generate: missing prompts file", generate + ["--model=gemma_tiny",
                                                       f"--prompts_file={p('none.txt')}"],
         "cannot read --prompts_file"),
        ("generate: broken model", generate + [f"--model={p('broken')}", "--prompt=hi"], "is damaged"),
        ("convert: no args", convert, "required: source, out_dir"),
        ("convert: OUT a file", convert + ["gemma_tiny", p("afile")], "is a file"),
        ("convert: OUT under a file", convert + ["gemma_tiny", p("afile") + "/hf", "--to=hf"],
         "lies under the file"),
        ("convert: OUT not empty", convert + ["gemma_tiny", p("nonempty")], "is not empty"),
        ("convert: bad --to", convert + ["gemma_tiny", new, "--to=onnx"], "--to=onnx: choose one of"),
        ("convert: bad --dtype", convert + ["gemma_tiny", new, "--dtype=int7"],
         "use one of float32, bfloat16, float16"),
        ("convert: unknown model", convert + [p("nomodel"), new, "--to=hf"], "not a built-in preset"),
        ("convert: broken model", convert + [p("broken"), new], "is damaged"),
        ("train: 1000-device mesh", TRAIN + ["--mesh=1x1000"], "simulated CPU devices"),
        ("train: --out a file", TRAIN + TINY + [f"--out={p('afile')}"], "is a file"),
        ("train: --out under a file", TRAIN + TINY + [f"--out={p('afile')}/run"], "lies under the file"),
        ("train: checkpoints a file", TRAIN + TINY + [f"--out={p('ckfile')}"],
         "the checkpoint folder"),
        ("train: bad --dtype", TRAIN + TINY + ["--dtype=int7", f"--out={new}"], "use one of"),
        ("train: unknown flag", TRAIN + TINY + ["--lora-rank=4", f"--out={new}"],
         "unrecognized arguments"),
        ("train: missing data", TRAIN + TINY + [f"--data={p('none.csv')}", f"--out={new}"],
         "does not exist"),
        ("train: runaway quote", TRAIN + TINY + [f"--data={p('quote.csv')}", f"--out={new}"],
         "line 2 opens a quote that runs on to line 10"),
        ("train: wrong columns", TRAIN + TINY + [f"--data={p('columns.csv')}", f"--out={new}"],
         "found: 'question', 'answer'"),
        ("train: empty data", TRAIN + TINY + [f"--data={p('empty.csv')}", f"--out={new}"], "is empty"),
        ("train: broken JSON", TRAIN + TINY + [f"--data={p('bad.json')}", f"--out={new}"],
         "is not valid JSON"),
        ("train: no response token", TRAIN + TINY + [f"--data={p('long.csv')}", "--loss_on=response",
                                                 f"--out={new}"],
         "no example has a response token within --sequence_length=16"),
        ("train: bad template", TRAIN + TINY + ["--template={question}", f"--out={new}"],
         "bad --template"),
        ("train: broken model", TRAIN + TINY[1:] + [f"--preset={p('broken')}", f"--out={new}"],
         "is damaged"),
        ("train: unknown preset", TRAIN + TINY[1:] + ["--preset=gemma_9000", f"--out={new}"],
         "not a built-in preset"),
        ("train: batch vs mesh", TRAIN + TINY + ["--mesh=2x1", "--batch_size=3", f"--out={new}"],
         "not divisible"),
        ("mlm: no tokenizer", TRAIN + ["--task=mlm", "--mesh=1x2"], "required: --tokenizer"),
        ("mlm: --out a file", mlm + [f"--out={p('afile')}"], "is a file"),
        ("mlm: missing shards", mlm[:-3] + [f"--data={p('none')}", "--mesh=1x2",
                                            f"--out={new}"], "does not exist"),
        ("mlm: bad --dtype", mlm + ["--dtype=int4", f"--out={new}"], "use one of"),
        ("mlm: shard length", mlm[:-1] + ["--max_length=64", f"--out={new}"],
         "pass --max_length 32"),
    ]


def resumes(w) -> tuple[list, list]:
    """Refusals against the finished run in `run/` (made next to the cheap cases): one with
    another flag, then (after its data file is edited) the very same command."""
    run = [*TRAIN, *TINY, "--steps=1", f"--data={w / 'run_data.csv'}", f"--out={w / 'run'}"]
    return ([("train: other flags on a saved run", run + ["--learning_rate=0.5"],
              "flags differ: learning_rate")],
            [("train: edited data on a saved run", run, "the data changed since")])


def _memory_cap():
    """8 GiB of address space per case: a refusal needs a fraction, a runaway (a 1000-device
    mesh once took ~20 GB) fails fast instead of taking the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def _run(case, sweep_env):
    name, cmd, needle = case
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=sweep_env, capture_output=True, text=True,
                           timeout=120, preexec_fn=_memory_cap)
    except subprocess.TimeoutExpired:
        return f"{name}: still running after 120 s (a hang)"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    ok = (r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")
          and needle in lines[0] and "Traceback" not in r.stdout)
    return None if ok else f"{name}: exit {r.returncode}, stderr {r.stderr[-1500:]!r}"


def test_every_bad_input_is_one_line_exit_2_and_touches_nothing(world):
    w = str(world)
    sweep_env = env() | {"JAXLM_HUGE_PAGES": "0"}  # no re-exec per case: half a second each
    run_dir = os.path.join(w, "run")
    before = _snapshot(w, skip=run_dir)
    cheap, (saved, edited) = cases(world), resumes(world)
    assert len(cheap) + len(saved) + len(edited) >= 40
    with futures.ThreadPoolExecutor(2) as pool:
        # The finished run the resume cases refuse to touch trains next to the cheap cases.
        train = pool.submit(subprocess.run, [*TRAIN, *TINY, "--steps=1",
                                             f"--data={world / 'run_data.csv'}", f"--out={run_dir}"],
                            cwd=ROOT, env=sweep_env, capture_output=True, text=True, timeout=300)
        failures = list(pool.map(lambda c: _run(c, sweep_env), cheap))
        r = train.result()
        assert r.returncode == 0, r.stderr[-3000:]
        run_before = _snapshot(run_dir)
        failures += list(pool.map(lambda c: _run(c, sweep_env), saved))
        with open(world / "run_data.csv", "a") as f:  # edited after the run
            f.write("one more question,one more answer\n")
        failures += list(pool.map(lambda c: _run(c, sweep_env), edited))
    failures = [f for f in failures if f]
    assert not failures, "\n".join(failures)
    assert _diff(before, _snapshot(w, skip=run_dir)) == ["run", "run_data.csv"]  # made, edited
    assert _diff(run_before, _snapshot(run_dir)) == []
