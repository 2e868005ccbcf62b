"""Start the command-line tools with glibc's malloc backed by transparent huge pages.

On CPU every XLA step allocates its temporaries afresh, and glibc returns large blocks to the
kernel when they are freed, so each step faults its memory in again 4 KiB at a time: 114k minor
faults and ~0.23 s of kernel time per LoRA step of the bench config. With
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` malloc asks for transparent huge pages (2 MiB), the
faults drop ~150-fold and (fewer TLB misses, presumably) the weights stream faster: the demo's
steps took 4.8 s instead of 5.7, a batch-4 decode step 6.9 ms instead of 7.8-8.8
(bench/README.md, "Page faults").

glibc reads its tunables once, when the process starts, so `python train.py` and `python -m
jaxlm.generate` re-execute themselves once with the tunable added (same PID, arguments and
environment otherwise) before any work, and before JAX is imported (~1.6 s on a 2-core host,
which the restarted process would pay again): train.py loads this module by its path; for
`python -m jaxlm.generate`, which Python starts by importing the jaxlm package, the package
restarts first thing (`starting_module`).
Library code never does this: in your own scripts, set the variable before starting Python.
`JAXLM_HUGE_PAGES=0` turns it off; an older glibc ignores the tunable, and the variable being
set stops a second re-exec. `jaxlm.launch` adds its own tunable for the local processes it
starts (`with_tunables`).
"""
from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"


def with_tunables(tunables: str, *wanted: str) -> str:
    """`tunables` (a GLIBC_TUNABLES value) with each `name=value` of `wanted` added whose name
    it does not set: a setting already there (the user's) is kept as it is."""
    names = {t.split("=")[0] for t in tunables.split(":")}
    return ":".join(filter(None, [tunables, *(t for t in wanted if t.split("=")[0] not in names)]))


def tuned_environ(environ) -> dict | None:
    """The environment to restart with, or None when there is nothing to do."""
    if not sys.platform.startswith("linux") or environ.get("JAXLM_HUGE_PAGES") == "0":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    tuned = with_tunables(tunables, TUNABLE)
    return None if tuned == tunables else {**environ, "GLIBC_TUNABLES": tuned}


def starting_module(argv=None, orig_argv=None) -> str | None:
    """The module `python -m` is about to run, while Python imports its packages (it sets
    sys.argv[0] to "-m" until the module itself starts); None otherwise."""
    argv = getattr(sys, "argv", []) if argv is None else argv  # an embedded interpreter may
    orig_argv = sys.orig_argv if orig_argv is None else orig_argv  # have no argv
    if argv[:1] != ["-m"] or "-m" not in orig_argv[:-1]:
        return None
    return orig_argv[orig_argv.index("-m") + 1]


def restart_with_huge_pages(execve=os.execve) -> None:
    """Re-execute this interpreter with the tunable (see the module docstring); returns only
    when nothing needs doing. Call it first thing in a `__main__` block."""
    env = tuned_environ(os.environ)
    if env is None or not sys.executable:  # an embedded interpreter has nothing to re-execute
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # only speed is at stake: run on with the default allocator
        pass
