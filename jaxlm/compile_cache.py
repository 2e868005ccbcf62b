"""XLA's persistent compilation cache for the command-line tools: a second run of the same
program loads its compiled steps from disk instead of compiling them again.

JAX can keep every compiled program above a second of compile time in a folder, keyed by the
program, the compile options, the devices and the jax/jaxlib versions (a CPU program also
records the host's CPU features and is refused, then recompiled, on a host without them).
`python train.py` and `python -m jaxlm.generate` turn it on by default in
`~/.cache/jaxlm/xla` (`$XDG_CACHE_HOME/jaxlm/xla`; `JAXLM_COMPILE_CACHE` or `--compile_cache`
name another folder, an empty value turns it off). The demo's second run (`python train.py
--mesh=1x8 --lora_rank=4`) took 73.9 s against 86.1 s, its step's compile 11.8 -> 6.3 s, with
1.6 MB in the folder (a 2-core AMD EPYC, 2026-12-07; bench/README.md). In a process of your
own, `jax.config.update("jax_compilation_cache_dir", folder)` does the same.

Only process 0 of a multi-process run writes entries; every process reads them. An entry that
cannot be read is compiled again. The folder is not pruned: delete it to start over.
"""
from __future__ import annotations

import os
import tempfile

from jaxlm.errors import UserError

ENV = "JAXLM_COMPILE_CACHE"


def default_dir() -> str:
    """`$JAXLM_COMPILE_CACHE` where set (empty: off), else `$XDG_CACHE_HOME/jaxlm/xla`
    (`~/.cache/jaxlm/xla`)."""
    if ENV in os.environ:
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxlm", "xla")


def enable(folder: str | None = None, flag: str = "--compile_cache") -> str | None:
    """Turn the cache on in `folder` (None: `default_dir()`; "": off) -> the folder in use, or
    None. A folder JAX was already given (`JAX_COMPILATION_CACHE_DIR`) is kept. A folder given
    explicitly that cannot be written is an error naming the fix; the default one is skipped
    quietly (a read-only home), the run is only slower."""
    import jax
    given = jax.config.jax_compilation_cache_dir
    if given:
        return given
    explicit = folder is not None
    folder = default_dir() if folder is None else folder
    if not folder:
        return None
    if "://" in folder:
        raise UserError(f"{flag}={folder}: the compile cache must be a local folder (it is "
                        f"read at every start); give one, or {flag}= to run without it")
    folder = os.path.abspath(os.path.expanduser(folder))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        if not explicit:
            return None
        raise UserError(f"{flag}={folder}: cannot write there ({e.strerror or e}); give a "
                        f"writable folder, or {flag}= to run without the cache") from None
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder


class Hits:
    """Counts the programs loaded from the cache from now on (JAX's monitoring events) until
    `close()`, which gives the line a run's report ends with."""

    def __init__(self):
        import jax
        self.count = 0
        jax.monitoring.register_event_listener(self._event)

    def _event(self, event: str, **_):
        if event == "/jax/compilation_cache/cache_hits":
            self.count += 1

    def close(self) -> str | None:
        """Stop counting -> "compile cache: FOLDER (N compiled programs loaded from it)", or
        None where no cache is in use."""
        import jax
        jax.monitoring.unregister_event_listener(self._event)
        folder = jax.config.jax_compilation_cache_dir
        if not folder:
            return None
        return (f"compile cache: {folder} ({self.count} compiled program"
                f"{'' if self.count == 1 else 's'} loaded from it; --compile_cache= turns it off)")
