"""User-facing errors and the command-line convention every jaxlm entry point follows.

A mistake the user can fix (a `UserError`), a bad flag (`ArgumentParser`) or a Ctrl-C outside
the training loop becomes one line on stderr and an exit code, never a traceback:

    error: <the problem and the fix>      exit 2
    interrupted                           exit 130
    stopped at step N; rerun ...          exit 0 (SIGTERM) / 130 (Ctrl-C), see `Stopped`
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import warnings

# `jaxlm/__init__` imports some entry-point modules (generate, tokenizer), so `python -m
# jaxlm.generate` finds its module imported already and runpy warns; harmless, and it would
# break the one-line convention.
warnings.filterwarnings("ignore", message=r"'jaxlm\.[\w.]+' found in sys\.modules",
                        category=RuntimeWarning)


class UserError(ValueError):
    """Bad input the user can fix (a wrong path, a malformed file, a mesh that does not fit).

    `abandoned_threads` is set when the failure left a library's threads waiting for what
    never comes (a failed orbax save leaves some for minutes): the command line then ends the
    process without waiting for them, after its one line."""

    abandoned_threads = False


class Stopped(Exception):
    """A run stopped early on a signal after saving what it had (see `jaxlm.train.preemption`);
    `code` is the exit status: 0 after SIGTERM (a scheduler asked), 130 after Ctrl-C."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one `error:` line (UserError -> exit 2) instead of a usage block."""

    def error(self, message):
        raise UserError(f"{message} (see {self.prog} --help)")


QUIET_LOGGERS = ("gcsfs",)  # log a traceback per retry, then raise what we report


def cli(main):
    """Wrap a command-line `main`: a UserError becomes one line on stderr and exit code 2, and
    so does an OSError (a disk full, a permission, an unreachable object store: faults of the
    machine, not of jaxlm); a Ctrl-C outside the training loop is one line and 130, a
    `Stopped` run its line and code."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            # the interpreter would wait for abandoned threads at exit
            leave(2, now=e.abandoned_threads)
        except OSError as e:
            print(f"error: {describe_os_error(e)}", file=sys.stderr)
            leave(2)
        except Stopped as e:
            print(str(e), file=sys.stderr)
            sys.exit(e.code)  # every process stopped at the same step: they leave together
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            leave(130)
    return wrapper


def leave(code: int, now: bool = False) -> None:
    """Exit with `code` after an error. In a multi-process run the interpreter's exit would
    enter jax.distributed's shutdown barrier and wait there (five minutes by default) for
    processes that are still working or waiting for this one: the process ends at once
    instead, and the others are stopped by jaxlm.launch or fail when they next need it."""
    if now or _in_multi_process_run():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _in_multi_process_run() -> bool:
    state = sys.modules.get("jax._src.distributed")  # no jax import for runs that never had one
    return state is not None and getattr(state.global_state, "client", None) is not None


def describe_os_error(e: OSError) -> str:
    """One line: what failed and where, e.g. `[Errno 28] No space left on device: '/data/x'`."""
    what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{what} ({type(e).__name__}); check the path, its permissions, free space and the network"
