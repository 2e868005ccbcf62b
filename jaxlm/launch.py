"""Try a multi-host run on one machine: N local processes stand in for N hosts.

    python -m jaxlm.launch --num_processes=2 --devices_per_process=4 -- \\
        python train.py --mesh=1x8 --lora_rank=4 --steps=20

Each child gets the `jaxlm.distributed` settings in its environment (JAX_COORDINATOR_ADDRESS on
127.0.0.1 and a free port, JAXLM_NUM_PROCESSES, JAXLM_PROCESS_ID) and, with
--devices_per_process, that many simulated CPU devices (XLA_FLAGS) and JAX_PLATFORMS=cpu, so
jax.devices() is the global N * devices_per_process. On Linux each also starts with two malloc
arenas (`ARENAS`, in GLIBC_TUNABLES): the processes share the machine's memory. Output is
streamed line by line prefixed with `[pI]`. If one process fails, the others are stopped and
the launcher exits with its code.

Ctrl-C or SIGTERM to the launcher is passed on to every process, so `train.py` processes finish
their step, save a checkpoint and exit (0 after SIGTERM; the launcher then exits with the worst
child's code, 130 after Ctrl-C); a second Ctrl-C kills them at once. On real hosts run the
command once per host instead (see README).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxlm import hugepages, machine
from jaxlm.errors import ArgumentParser, UserError, cli

GRACE_S = 5.0  # SIGTERM, then SIGKILL, for the others when one process failed
STOP_GRACE_S = 600.0  # after forwarding SIGINT/SIGTERM: time to finish a step and checkpoint


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise UserError("give the command after --, e.g. python -m jaxlm.launch --num_processes=2 "
                        "-- python train.py --mesh=1x8")
    cut = argv.index("--")
    p = ArgumentParser(prog="python -m jaxlm.launch", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num_processes", type=int, default=2)
    p.add_argument("--devices_per_process", type=int, default=0,
                   help="simulated CPU devices per process (0: leave the platform alone)")
    p.add_argument("--coordinator_address", default=None, help="default 127.0.0.1:<free port>")
    p.add_argument("--initialization_timeout", type=int, default=60,
                   help="seconds each process waits for the others to join")
    a = p.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        raise UserError("nothing to run after --")
    if a.num_processes < 1:
        raise UserError(f"--num_processes={a.num_processes} must be >= 1")
    if a.devices_per_process < 0:
        raise UserError(f"--devices_per_process={a.devices_per_process} must be >= 0")
    return a, command


# The processes share one machine's memory, and each pays for its own: glibc gives every
# thread that allocates an arena of its own (up to 8 per core), and the runtime's threads
# (XLA's, and jax.distributed's) each keep what they freed in theirs. Two arenas a process:
# the demo's two processes peaked ~150 MB lower in all (`python bench/demo.py`, 2 cores,
# bench/README.md "a fourth session"), and trained as fast (2% slower, within the runs'
# spread). Not train.py's own default: one process's training took 45.3-47.6 s with it against
# 43.9 s. A value in the caller's GLIBC_TUNABLES is kept.
ARENAS = "glibc.malloc.arena_max=2"


def child_env(a, process_id: int, address: str, base=None) -> dict:
    env = dict(os.environ if base is None else base)
    if sys.platform.startswith("linux"):
        env["GLIBC_TUNABLES"] = hugepages.with_tunables(env.get("GLIBC_TUNABLES", ""), ARENAS)
    env.update(JAX_COORDINATOR_ADDRESS=address, JAXLM_NUM_PROCESSES=str(a.num_processes),
               JAXLM_PROCESS_ID=str(process_id),
               JAXLM_INITIALIZATION_TIMEOUT=str(a.initialization_timeout), PYTHONUNBUFFERED="1")
    if a.devices_per_process:
        env["XLA_FLAGS"] = machine.with_host_devices(env.get("XLA_FLAGS", ""), a.devices_per_process)
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _stream(i: int, pipe, lock) -> None:
    for raw in iter(pipe.readline, b""):
        with lock:
            sys.stdout.write(f"[p{i}] {raw.decode(errors='replace').rstrip()}\n")
            sys.stdout.flush()
    pipe.close()


def _signal_all(procs, sig) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)  # the child's own session: whatever it spawned too
            except ProcessLookupError:
                pass


def _stop(procs) -> None:
    """SIGTERM every live child's process group, SIGKILL what is left after GRACE_S."""
    _signal_all(procs, signal.SIGTERM)
    _wait_all(procs, GRACE_S)
    _signal_all(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def _wait_all(procs, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


def exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N -> 128 + N


def run(a, command: list[str], received: list[int] | None = None) -> int:
    """Start the processes and watch them; -> the exit code (see the module docstring).

    Signals are not acted on where they land (an exception raised in the middle of Popen or
    poll can leave a child unstarted-but-running or a lock held, and the launcher hung): the
    handlers `main` installs append to `received`, and this loop acts between its steps.
    """
    received = [] if received is None else received
    address = a.coordinator_address or f"127.0.0.1:{free_port()}"
    lock = threading.Lock()
    procs, threads = [], []
    for i in range(a.num_processes):
        if received:
            break
        try:  # own session per child: stopping it also stops whatever it spawned
            p = subprocess.Popen(command, env=child_env(a, i, address), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            _stop(procs)
            raise UserError(f"cannot start {command[0]!r}: {e.strerror or e}; check the command "
                            "after --") from None
        procs.append(p)
        with lock:
            print(f"[launch] process {i}/{a.num_processes} started (pid {p.pid}), "
                  f"coordinator {address}", flush=True)
        t = threading.Thread(target=_stream, args=(i, p.stdout, lock), daemon=True)
        t.start()
        threads.append(t)
    forwarded = 0  # signals passed on to the children so far
    deadline = None
    while True:
        if len(received) > forwarded:
            if forwarded:  # a second signal: stop waiting for them
                _signal_all(procs, signal.SIGKILL)
                for p in procs:
                    p.wait()
                print("[launch] interrupted again; killed all processes", file=sys.stderr, flush=True)
                return 130
            # The first: every child gets it (train.py saves a checkpoint and exits); a child
            # not started yet never will be.
            _signal_all(procs, received[0])
            forwarded, deadline = len(received), time.monotonic() + STOP_GRACE_S
        codes = [p.poll() for p in procs]
        if forwarded:
            if all(c is not None for c in codes) or time.monotonic() > deadline:
                _stop(procs)
                for t in threads:
                    t.join(timeout=2)
                if received[0] == signal.SIGINT:
                    print("[launch] interrupted; stopped all processes", file=sys.stderr, flush=True)
                    return 130
                worst = max((exit_code(p.returncode) for p in procs), default=128 + signal.SIGTERM)
                print("[launch] stopped all processes on SIGTERM", file=sys.stderr, flush=True)
                return worst
        else:
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, c = failed[0]
                others = [j for j, cj in enumerate(codes) if cj is None]
                _stop(procs)
                for t in threads:
                    t.join(timeout=2)
                print(f"[launch] process {i} failed (exit code {exit_code(c)})"
                      + (f"; stopped process(es) {', '.join(map(str, others))}" if others else ""),
                      file=sys.stderr, flush=True)
                return exit_code(c)
            if codes and all(c == 0 for c in codes):
                for t in threads:
                    t.join(timeout=2)
                return 0
        time.sleep(0.1)


@cli
def main(argv: list[str] | None = None) -> int:
    a, command = parse(sys.argv[1:] if argv is None else list(argv))
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, and a scheduler or `kill`
        signal.signal(sig, on_signal)
    return run(a, command, received)


if __name__ == "__main__":
    sys.exit(main())
