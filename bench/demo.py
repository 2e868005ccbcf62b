"""The README's main job, measured end to end: wall time, peak memory and exact match of

    python train.py --mesh=1x8 --lora_rank=4                                 (one process)
    python -m jaxlm.launch --num_processes=2 --devices_per_process=4 -- \\
        python train.py --mesh=1x8 --lora_rank=4                             (two processes)

Each train.py runs under this script's `--peak` wrapper, which waits for it with wait4 and
prints its peak RSS (ru_maxrss: what `/usr/bin/time -v` calls "Maximum resident set size");
the two processes' total is the sum of their peaks. The runs take turns, never overlap, and
run without the compile cache (`--compile_cache=`): a first run, as a new user sees it.
Goals: one process <= 4 minutes and <= 3 GB with exact match >= 17/40; two processes
<= 1.3x the one process's memory in all.

    python bench/demo.py                                  # ~1.5 + 4 min on 2 cores (demo extra)
    python bench/demo.py -- --preset=gemma_tiny --steps=4   # flags after -- go to train.py

    BENCH demo_one wall_s=<s> peak_kb=<kb> exact_match=<n/N>
    BENCH demo_two wall_s=<s> peak_kb=<p0>+<p1> total_kb=<kb> over_one=<ratio> exact_match=<n/N>
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["train.py", "--mesh=1x8", "--lora_rank=4", "--compile_cache="]
LAUNCH = ["-m", "jaxlm.launch", "--num_processes=2", "--devices_per_process=4", "--"]


def peak(command: list[str]) -> int:
    """Run `command` with this process's stdout and stderr, print its peak RSS, -> its code."""
    child = subprocess.Popen(command)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait
    print(f"peak_kb={usage.ru_maxrss}", flush=True)  # kilobytes on Linux
    return child.returncode


def run(command: list[str]) -> tuple[float, str]:
    """-> (wall seconds, output) of `command` in the repository root; exits on failure."""
    t0 = time.perf_counter()
    r = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"error: {' '.join(command)} failed (exit code {r.returncode}):\n{r.stdout[-3000:]}")
    return wall, r.stdout


def exact_match(output: str) -> str:
    found = re.findall(r"\[after\] exact match on \d+ held-out examples: (\d+/\d+)", output)
    return found[-1] if found else "n/a"


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--peak"]:
        sys.exit(peak(argv[2:] if argv[1:2] == ["--"] else argv[1:]))
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("one", "two"), help="run one of the two commands")
    a = p.parse_args(argv[:cut])
    extra = argv[cut + 1:]
    # the repository root, as the other bench scripts: bench.common imports models
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.common import host_line
    print(host_line(), flush=True)
    wrap = [sys.executable, os.path.abspath(__file__), "--peak", "--", sys.executable]
    one = None
    with tempfile.TemporaryDirectory() as tmp:
        if a.only != "two":
            wall, out = run(wrap + TRAIN + [f"--out={tmp}/one", *extra])
            kb = [int(x) for x in re.findall(r"^peak_kb=(\d+)$", out, re.M)]
            one = kb[0]
            print(f"one process: {wall:.1f} s, peak {one:,} KB, exact match {exact_match(out)}")
            print(f"BENCH demo_one wall_s={wall:.1f} peak_kb={one} exact_match={exact_match(out)}",
                  flush=True)
        if a.only != "one":
            wall, out = run([sys.executable, *LAUNCH, *wrap] + TRAIN + [f"--out={tmp}/two", *extra])
            kb = [int(x) for x in re.findall(r"^\[p\d\] peak_kb=(\d+)$", out, re.M)]
            total = sum(kb)
            ratio = f"{total / one:.3f}" if one else "n/a"
            print(f"two processes: {wall:.1f} s, peaks {' + '.join(f'{k:,}' for k in kb)} = "
                  f"{total:,} KB ({ratio}x one process), exact match {exact_match(out)}")
            print(f"BENCH demo_two wall_s={wall:.1f} peak_kb={'+'.join(map(str, kb))} "
                  f"total_kb={total} over_one={ratio} exact_match={exact_match(out)}")


if __name__ == "__main__":
    main()
