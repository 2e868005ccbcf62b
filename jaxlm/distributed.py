"""One program per host over one global mesh: `jax.distributed` set up from flags or the cluster.

    settings, argv = distributed.from_argv(argv)   # string ops only: call before jax starts
    distributed.initialize(settings)               # no-op for a single process
    distributed.check_same({"argv": argv})         # every process must run the same command

Flags (also read from the environment, which is how `jaxlm.launch` passes them):
  --coordinator_address=HOST:PORT  (JAX_COORDINATOR_ADDRESS)  process 0's address
  --num_processes=N                (JAXLM_NUM_PROCESSES)
  --process_id=I                   (JAXLM_PROCESS_ID)
  --initialization_timeout=S       (JAXLM_INITIALIZATION_TIMEOUT, default 300) bounded waits
  --distributed=auto|on|off        auto: initialise when the flags above are given or a SLURM /
                                   Open MPI / TPU-worker environment with several tasks is
                                   detected; on: always call jax.distributed.initialize() and let
                                   JAX fill in what is missing (e.g. a GCE TPU pod's metadata).
On CPU the collectives run over gloo (`jax_cpu_collectives_implementation`), so processes on one
laptop stand in for hosts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import threading
import time

from jaxlm.errors import UserError

DEFAULT_TIMEOUT = 300
ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAXLM_NUM_PROCESSES",
       "process_id": "JAXLM_PROCESS_ID", "initialization_timeout": "JAXLM_INITIALIZATION_TIMEOUT",
       "distributed": "JAXLM_DISTRIBUTED"}


@dataclasses.dataclass(frozen=True)
class Settings:
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: int = DEFAULT_TIMEOUT
    distributed: str = "auto"  # auto | on | off


def add_flags(parser: argparse.ArgumentParser) -> None:
    """List the flags in `--help`. They are consumed by `from_argv` before the parser runs, so
    SUPPRESS keeps them out of the parsed namespace."""
    g = parser.add_argument_group("multi-host (see jaxlm/distributed.py)")
    s = argparse.SUPPRESS
    g.add_argument("--coordinator_address", default=s, help="process 0's HOST:PORT")
    g.add_argument("--num_processes", default=s, help="processes (hosts) in the run")
    g.add_argument("--process_id", default=s, help="this process's index, 0..N-1")
    g.add_argument("--initialization_timeout", default=s, help="seconds to wait for the others")
    g.add_argument("--distributed", default=s, help="auto | on | off (auto-detect SLURM/MPI/TPU)")


def from_argv(argv: list[str], environ=None) -> tuple[Settings, list[str]]:
    """-> (Settings from flags, else the environment; argv without those flags). No jax import."""
    environ = os.environ if environ is None else environ
    values, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
        if name in ENV:
            if "=" in arg:
                values[name] = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                values[name], i = argv[i + 1], i + 1
            else:
                raise UserError(f"--{name} needs a value")
        else:
            rest.append(arg)
        i += 1
    for name, var in ENV.items():
        if name not in values and environ.get(var):
            values[name] = environ[var]
    out = {}
    for name in ("num_processes", "process_id", "initialization_timeout"):
        if name in values:
            try:
                out[name] = int(values[name])
            except ValueError:
                raise UserError(f"--{name}={values[name]!r} is not an integer") from None
    if values.get("distributed", "auto") not in ("auto", "on", "off"):
        raise UserError(f"--distributed={values['distributed']!r}: use auto, on or off")
    settings = Settings(coordinator_address=values.get("coordinator_address") or None,
                        distributed=values.get("distributed", "auto"), **out)
    _check(settings)
    return settings, rest


def _check(s: Settings) -> None:
    if s.num_processes is not None and s.num_processes < 1:
        raise UserError(f"--num_processes={s.num_processes} must be >= 1")
    if s.process_id is not None and s.num_processes is not None \
            and not 0 <= s.process_id < s.num_processes:
        raise UserError(f"--process_id={s.process_id} must be in 0..{s.num_processes - 1} "
                        f"for --num_processes={s.num_processes}")
    if s.initialization_timeout < 1:
        raise UserError(f"--initialization_timeout={s.initialization_timeout} must be >= 1 second")
    if s.coordinator_address is not None:
        _host_port(s.coordinator_address)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--coordinator_address={address!r} is not HOST:PORT (e.g. 10.0.0.1:1234)")
    return host.strip("[]"), int(port)


def cluster_env(environ=None) -> str | None:
    """The multi-task launcher this process runs under, as JAX's auto-detection knows it."""
    env = os.environ if environ is None else environ

    def many(var):
        try:
            return int(env.get(var, "1")) > 1
        except ValueError:
            return False
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and (many("SLURM_STEP_NUM_TASKS")
                                                            or many("SLURM_NTASKS")):
        return "slurm"
    if many("OMPI_COMM_WORLD_SIZE"):
        return "openmpi"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if "," in hosts:
        return "tpu"
    return None


def num_processes_hint(argv: list[str], environ=None) -> int:
    """The process count known before jax starts (flags, launcher env, SLURM/MPI), else 1."""
    try:
        s, _ = from_argv(list(argv), environ)
    except UserError:
        return 1  # reported properly once the run starts
    if s.num_processes:
        return s.num_processes
    env = os.environ if environ is None else environ
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if cluster_env(env) and env.get(var, "").isdigit():
            return int(env[var])
    return 1


def initialize(s: Settings) -> bool:
    """Start `jax.distributed` when the settings or the environment ask for it; -> started.

    Every wait is bounded by `initialization_timeout` and ends in one line (UserError, or
    exit 2 from a watchdog): a worker (process_id > 0) first waits for the coordinator's port to
    accept connections, and no process waits past the timeout for the others to join. JAX alone
    would abort the process with a C++ stack trace in both cases.
    """
    explicit = (s.coordinator_address, s.num_processes, s.process_id) != (None, None, None)
    detected = cluster_env()
    if s.distributed == "off" or (s.distributed == "auto" and not explicit and detected is None):
        return False
    if s.distributed == "auto" and detected is None and None in (
            s.coordinator_address, s.num_processes, s.process_id):
        raise UserError("give --coordinator_address, --num_processes and --process_id together "
                        "(or run under SLURM / Open MPI / a TPU pod, or use jaxlm.launch)")
    if s.num_processes == 1 and s.coordinator_address is None:
        return False
    import jax
    # CPU devices talk over gloo; TPU/GPU ignore this option.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = time.monotonic() + s.initialization_timeout
    if s.coordinator_address is not None and s.process_id is not None:
        if s.process_id == 0:
            _check_bindable(s.coordinator_address)
        else:
            _wait_for(s.coordinator_address, s.process_id, deadline, s.initialization_timeout)
    remaining = max(int(deadline - time.monotonic()), 5)
    # When the others never join, JAX aborts the process with a C++ stack trace once its own
    # timeout passes; this watchdog fires first and says it in one line (exit 2, like UserError).
    who = f"process {s.process_id}" if s.process_id is not None else "this process"
    count = f"{s.num_processes} " if s.num_processes else ""
    watchdog = threading.Timer(remaining, _give_up, args=(
        f"error: {who}: not all {count}processes joined the coordinator "
        f"{s.coordinator_address or '(auto-detected)'} within {s.initialization_timeout}s; start "
        "every process with the same --num_processes and --coordinator_address",))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(s.coordinator_address, s.num_processes, s.process_id,
                                   initialization_timeout=remaining + 30)
    except (ValueError, TypeError, RuntimeError) as e:
        raise UserError(f"jax.distributed could not start ({str(e).splitlines()[0]})") from None
    finally:
        watchdog.cancel()
    return True


def _give_up(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    os._exit(2)  # the main thread is blocked inside JAX's C++ connect


def _check_bindable(address: str) -> None:
    _, port = _host_port(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError as e:
            raise UserError(f"process 0 cannot serve the coordinator on port {port} ({e.strerror}); "
                            "pick a free port in --coordinator_address") from None


def _wait_for(address: str, process_id: int, deadline: float, timeout: int) -> None:
    host, port = _host_port(address)
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise UserError(f"process {process_id}: the coordinator {address} was unreachable for "
                                f"{timeout}s; start process 0 first, and check --coordinator_address "
                                "(process 0's reachable HOST:PORT) and firewalls") from None
            time.sleep(0.25)


def is_lead() -> bool:
    """Process 0 writes plain files and prints; orbax coordinates its own writes."""
    import jax
    return jax.process_index() == 0


def quiet_followers() -> None:
    """Progress and reports on process 0 only: other processes' stdout goes to /dev/null (their
    stderr, where errors and warnings go, stays)."""
    import jax
    if jax.process_index() != 0:
        sys.stdout.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())  # also what C++ (gloo, XLA) prints
        os.close(null)


def check_same(values: dict, fix: str = "launch every process with the same flags") -> None:
    """Fail with one line, on every process, when processes were given different `values`
    (e.g. a different --mesh): otherwise their collectives would not match and the run hangs."""
    import jax
    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils
    blob = np.frombuffer(json.dumps(values, sort_keys=True).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([blob.size], np.int32)).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:blob.size] = blob
    rows = multihost_utils.process_allgather(padded).reshape(len(sizes), -1)
    seen = [json.loads(bytes(r[:n]).decode()) for r, n in zip(rows, sizes)]
    for key in values:
        got = [v.get(key) for v in seen]
        if any(g != got[0] for g in got):
            raise UserError(f"processes disagree on {key}: {_describe(got)}; {fix}")


def _describe(got: list) -> str:
    if all(isinstance(g, list) for g in got):  # argv: show only the tokens that differ
        common = set.intersection(*(set(g) for g in got))
        got = [" ".join(t for t in g if t not in common) or "(nothing)" for g in got]
    return ", ".join(f"process {i}: {g}" for i, g in enumerate(got))


def local_rows(sharding, global_shape: tuple, axis: int = 0) -> slice:
    """The contiguous block of indices along `axis` that this process's devices hold.

    E.g. a [8, L] batch on P("batch") of a 2x4 mesh over 2 hosts -> 0:4 on host 0; on a 1x8
    mesh (batch replicated) every host holds -> 0:8, so every host must provide all rows.
    """
    ranges = {(idx[axis].start or 0, global_shape[axis] if idx[axis].stop is None else idx[axis].stop)
              for idx in sharding.addressable_devices_indices_map(tuple(global_shape)).values()}
    lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
    covered = [False] * (hi - lo)
    for a, b in ranges:
        covered[a - lo:b - lo] = [True] * (b - a)
    if not all(covered):
        raise UserError(f"this process's devices hold a non-contiguous part of axis {axis} of the "
                        "batch; build the mesh with each host's devices adjacent on 'batch'")
    return slice(lo, hi)


def place_batch(sharding, local: dict, global_shape_of: dict):
    """Host-local rows -> global jax Arrays (`jax.make_array_from_process_local_data`)."""
    import jax
    return {k: jax.make_array_from_process_local_data(sharding, v, global_shape_of[k])
            for k, v in local.items()}
