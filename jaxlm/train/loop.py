"""The step loop: batches in, checkpoints and metrics out, host syncs only at log points.

Generic over the task: `get_batch(step) -> batch` (already placed on the mesh) and a step
function from `jaxlm.train.step.make_train_step`, so the MLM trainer reuses it as is.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Callable

import jax

from jaxlm import checkpoint, machine, storage
from jaxlm.train import preemption


def progress_line(step: int, total: int, m: dict, tok_s: float, step_s: float, width: int = 20) -> str:
    done = int(width * step / max(total, 1))
    bar = "#" * done + "." * (width - done)
    return (f"[{bar}] step {step:>{len(str(total))}}/{total}  loss {m['loss']:.4f}  "
            f"acc {m['accuracy']:.3f}  {tok_s:,.0f} scored tok/s  {step_s * 1e3:,.1f} ms/step")


def run(step_fn: Callable, state: dict, frozen, get_batch: Callable[[int], dict], *,
        num_steps: int, mngr=None, save_every: int = 0, meta: Callable[[int], dict] = lambda s: {},
        log_every: int = 10, metrics_path: str | None = None, sinks=(), phases=None,
        print_fn=print):
    """Train from `state["step"]` to `num_steps`; -> (final state, [(step, host metrics)]).

    step_fn(state, frozen, batch) -> (state, metrics) with metrics {loss, accuracy, count, ...}.
    Checkpoints (via `mngr`, async) every `save_every` steps and at the end; `meta(step)` is
    stored with each (data position, run fingerprint). Metrics are fetched from the devices only
    every `log_every` steps and appended to `metrics_path` as JSON lines, and given to each of
    `sinks` (`write(rows)`, `close()`: e.g. `report.TensorBoard`). With `phases`
    (`report.Phases`), the first step is marked "compile" and the rest "train".

    Memory malloc holds freed is handed back to the system (`machine.return_freed_memory`) when
    no step runs: after the step is compiled, before it first runs, and at each log point. On
    CPU glibc kept the compiler's working memory under the first step's temporaries, and each
    step allocates its temporaries afresh from several threads, so what it kept grew by 70-250
    MB per process over the demo's 40 steps; the demo's peak fell from 2,642,572 to 2,449,340
    KB in one process, from 1.70-1.79 to 1.57 GB in each of two (bench/README.md).

    SIGTERM or Ctrl-C (`jaxlm.train.preemption`): the current step finishes, is checkpointed and
    logged, and `jaxlm.errors.Stopped` is raised. A save that fails raises a UserError naming the
    folder and the cause.
    """
    start = int(jax.device_get(state["step"]))
    pending: list = []  # (step, device metrics) since the last log point
    history: list = []  # (step, host metrics) of every step run here
    t_last = time.perf_counter()
    lead = jax.process_index() == 0
    log_file = MetricsFile(metrics_path) if metrics_path and lead else None
    outputs = ([log_file] if log_file else []) + (list(sinks) if lead else [])
    stopped_at = None
    with preemption.watch() as stop:
        try:
            for s in range(start, num_steps):
                batch = get_batch(s)
                if s == start and hasattr(step_fn, "lower"):
                    step_fn.lower(state, frozen, batch).compile()  # the call below reuses it
                    machine.return_freed_memory()
                state, metrics = step_fn(state, frozen, batch)
                pending.append((s + 1, metrics))
                last = s + 1 == num_steps
                stopping = stop.now(s + 1)
                if s == start:  # the first step compiles; time it apart so ms/step means steady state
                    jax.block_until_ready(metrics)
                    now = time.perf_counter()
                    print_fn(f"compiled and ran step {s + 1} in {now - t_last:.1f}s")
                    if phases is not None:
                        phases.mark("compile")
                    history += _log(pending, now - t_last, num_steps, outputs, print_fn,
                                    quiet=not (last or stopping))
                    pending, t_last = [], now
                elif (s + 1) % log_every == 0 or last or stopping:
                    host = jax.device_get([m for _, m in pending])  # the only sync point
                    machine.return_freed_memory()  # counted in the steps' time
                    now = time.perf_counter()
                    history += _log(list(zip([p for p, _ in pending], host)), now - t_last,
                                    num_steps, outputs, print_fn)
                    pending, t_last = [], now
                if mngr is not None and ((save_every and (s + 1) % save_every == 0) or last
                                         or stopping):
                    checkpoint.save(mngr, s + 1, state, meta(s + 1))
                if stopping:
                    stopped_at = s + 1
                    break
        finally:
            if log_file:
                log_file.close()
            if mngr is not None:
                checkpoint.wait(mngr)
            if phases is not None and num_steps > start + 1:
                phases.mark("train")
        if stopped_at is not None:
            raise stop.stopped(stopped_at, saved=mngr is not None)
    return state, history


def _log(items, seconds: float, total: int, outputs: list, print_fn, quiet: bool = False) -> list:
    items = [(s, {k: float(v) for k, v in jax.device_get(m).items()}) for s, m in items]
    if not items:
        return items
    step_s = seconds / len(items)
    tokens = sum(m["count"] for _, m in items)
    tok_s = tokens / max(seconds, 1e-9)
    rows = [{"step": s, **m, "step_time_s": step_s, "tokens_per_s": tok_s} for s, m in items]
    for out in outputs:
        out.write(rows)
    if not quiet:
        step, m = items[-1]
        print_fn(progress_line(step, total, m, tok_s, step_s))
        sys.stdout.flush()
    return items


def metrics_file(out_dir: str) -> str:
    return storage.join(out_dir, "metrics.jsonl")


class MetricsFile:
    """metrics.jsonl, one JSON object per step, kept across resumed runs: appended to on a local
    disk; on an object store (no appends) rewritten whole at each log point."""

    def __init__(self, path: str):
        self.path = path
        if storage.is_url(path):
            self.lines = storage.read_text(path).splitlines(True) if storage.exists(path) else []
            self.file = None
        else:
            self.file = open(path, "a")

    def write(self, rows: list[dict]) -> None:
        text = [json.dumps(r) + "\n" for r in rows]
        if self.file is not None:
            self.file.writelines(text)
            self.file.flush()
        else:
            self.lines += text
            storage.write_text(self.path, "".join(self.lines))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
