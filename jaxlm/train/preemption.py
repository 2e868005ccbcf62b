"""Stop a run cleanly on SIGTERM (a preempted TPU VM, a scheduler, `kill`) or Ctrl-C.

    with preemption.watch() as stop:
        for step in range(start, total):
            state = train_step(state)
            if stop.now(step + 1):        # True at the same step on every process
                save(step + 1)
                raise stop.stopped(step + 1)

The current step finishes, a checkpoint is written and the run exits with one line, 0 after
SIGTERM, 130 after Ctrl-C; a second Ctrl-C exits at once (130, one line, the last complete
checkpoint kept).

One process: Python handlers set a flag that is read after each step (no host sync).
Several processes (jax.distributed): hosts must stop at the same step, or the ones still
stepping wait forever in a collective. They agree through JAX's preemption service:
`jax.distributed.initialize` installs a SIGTERM notifier, the coordination service tells every
host, and `multihost_utils.reached_preemption_sync_point(step)` is True on all of them at the
first step none has finished yet (within about a second of the signal: the notifier polls).
Ctrl-C is handed to the same notifier by raising SIGTERM in this process.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

import jax

from jaxlm.errors import Stopped

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class Watch:
    """What the loop asks after each step; see the module docstring."""

    def __init__(self, collective: bool, active: bool = True):
        self.collective, self.active = collective, active
        self.signals: list[int] = []  # received here, in order

    def _on_signal(self, signum, frame) -> None:
        self.signals.append(signum)
        if signum == signal.SIGINT and self.signals.count(signal.SIGINT) > 1:
            # os.write, not print: a handler may run in the middle of another print.
            os.write(2, b"interrupted again: exiting now; the last complete checkpoint is kept\n")
            os._exit(INTERRUPTED)
        if signum == signal.SIGINT:
            os.write(2, b"interrupt: finishing this step and saving a checkpoint "
                        b"(Ctrl-C again exits at once)\n")
            if self.collective:  # tell every host, through JAX's SIGTERM notifier
                signal.raise_signal(signal.SIGTERM)

    def now(self, step: int) -> bool:
        """Whether to stop after `step` (call at every step; the same answer on every host)."""
        if not self.active:
            return False
        if self.collective:
            from jax.experimental import multihost_utils
            return multihost_utils.reached_preemption_sync_point(step)
        return bool(self.signals)

    def stopped(self, step: int, saved: bool = True) -> Stopped:
        code = INTERRUPTED if signal.SIGINT in self.signals else 0
        if not saved:
            return Stopped(f"stopped at step {step} (no checkpoint is kept)", code)
        return Stopped(f"stopped at step {step}; rerun the same command to resume", code)


@contextlib.contextmanager
def watch():
    """Catch SIGTERM and SIGINT for the duration (main thread only; elsewhere signals keep
    their behaviour and `now` is always False)."""
    collective = jax.process_count() > 1
    if threading.current_thread() is not threading.main_thread() or (
            collective and not jax.config.jax_enable_preemption_service):
        yield Watch(collective, active=False)
        return
    w = Watch(collective)
    # Several processes: SIGTERM stays with JAX's notifier (a Python handler would replace it).
    caught = (signal.SIGINT,) if collective else (signal.SIGINT, signal.SIGTERM)
    # A signal the parent chose to ignore (nohup, `cmd &` in a script) stays ignored.
    previous = {s: signal.signal(s, w._on_signal) for s in caught
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield w
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
