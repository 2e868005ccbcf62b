"""Resumable training checkpoints on orbax: async, atomic, keep-N, crash-safe.

Layout under `directory` (one folder per step, orbax's own format)::

    <step>/state/   the train state tree {"step", "trainable", "opt_state", "rng"}
    <step>/meta/    JSON: step, data position, and the run's fingerprint

Orbax writes each step into `<step>.orbax-checkpoint-tmp-<t>/` and renames it after writing
`commit_success.txt`, so a step folder is complete iff it has that file. A crash mid-save (kill
-9, preemption) leaves a tmp folder or, on filesystems without atomic rename, a step folder with
no commit file; `sweep_incomplete` warns and moves such folders out of the way (never deleting
what the user might want to inspect), so they are never loaded. (On Cloud Storage orbax writes
the step folder in place and the commit file last, so the same test applies.)

`directory` may be a local path or a URL (`gs://bucket/run/checkpoints`): orbax writes arrays
through tensorstore and everything else through etils.epath, as `jaxlm.storage` does.

Arrays go into orbax's default OCDBT store (one small database of chunks per process). OCDBT
updates its manifest with conditional writes, so it needs an object store that honours
generation preconditions; `JAXLM_OCDBT=0` writes one plain zarr array per tensor instead, for
stores that do not (the Cloud Storage emulator the tests run against, some S3-compatible
stores). Restores read either layout.

Failures are one line each: a save that fails (a full disk, a folder that became a file) is a
UserError naming the folder and the cause, raised at the next save or wait, and orbax's own
tracebacks from its background threads are kept off the console. A committed step that
cannot be read (files missing, arrays unreadable) is moved to `<directory>/../
damaged_checkpoints/` with a warning saying what is wrong, and the next older one is resumed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import time

import jax
import orbax.checkpoint as ocp

from jaxlm import storage
from jaxlm.errors import UserError

log = logging.getLogger("jaxlm")
COMMIT_FILE = "commit_success.txt"
INCOMPLETE_DIR = "incomplete_checkpoints"
DAMAGED_DIR = "damaged_checkpoints"


class _QuietOrbax(logging.Filter):
    """Drop orbax's warnings and errors (tracebacks logged from its background threads, ~300
    lines for one failed save); the failure itself reaches the caller as an exception, which
    `save` / `wait` turn into one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.WARNING and "orbax" in record.pathname)


def _quiet_orbax() -> None:
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _QuietOrbax) for f in absl.filters):
        absl.addFilter(_QuietOrbax())
    if not getattr(sys.unraisablehook, "jaxlm", False):
        sys.unraisablehook = _drop_closed_loop_callbacks(sys.unraisablehook)


def _drop_closed_loop_callbacks(previous):
    """A failed save or restore abandons tensorstore operations that complete later into the
    event loop orbax ran them on, closed by then: each prints an unraisable "Event loop is
    closed" traceback (a page of them after one correct error line). The operation was given
    up already, so those are dropped; everything else goes to the previous hook."""
    def hook(unraisable):
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
            return
        previous(unraisable)
    hook.jaxlm = True
    return hook


def _is_step_dir(name: str) -> bool:
    return re.fullmatch(r"\d+", name) is not None


def sweep_incomplete(directory: str) -> list[str]:
    """Move checkpoints cut short by a crash to `<directory>/../incomplete_checkpoints/`.

    Returns the folder names moved (and prints one warning line for them).
    """
    if jax.process_index() != 0 or not storage.isdir(directory):
        return []
    bad = [n for n in storage.listdir(directory)
           if storage.isdir(storage.join(directory, n))
           and (ocp_tmp(n) or (_is_step_dir(n)
                               and not storage.exists(storage.join(directory, n, COMMIT_FILE))))]
    if not bad:
        return []
    aside = storage.join(storage.parent(directory), INCOMPLETE_DIR)
    storage.makedirs(aside)
    for n in bad:
        storage.rename(storage.join(directory, n), storage.join(aside, f"{n}.{time.time_ns()}"))
    log.warning("checkpoint: ignored %d incomplete checkpoint(s) cut short by a crash (%s); "
                "moved to %s", len(bad), ", ".join(bad), aside)
    return bad


def ocp_tmp(name: str) -> bool:
    return ".orbax-checkpoint-tmp" in name


def complete_steps(directory: str) -> list[int]:
    """Steps whose folder is complete (committed), ascending."""
    return sorted(int(n) for n in storage.listdir(directory)
                  if _is_step_dir(n) and storage.exists(storage.join(directory, n, COMMIT_FILE)))


def use_ocdbt() -> bool:
    """Whether arrays are written to OCDBT (the default) or as plain zarr (JAXLM_OCDBT=0)."""
    return os.environ.get("JAXLM_OCDBT", "1").lower() not in ("0", "false", "no", "off")


def checkpointer() -> ocp.Checkpointer:
    """A synchronous orbax checkpointer of one tree (`save_tree`, jaxlm folders)."""
    _quiet_orbax()
    return ocp.Checkpointer(ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt()))


def check_run_folder(out: str) -> None:
    """A trainer's --out and its `checkpoints/` must be folders it can write (one line if not),
    checked before a model loads: a save that fails later is minutes of work lost."""
    storage.check_output_folder(out, "--out")
    storage.check_output_folder(storage.join(out, "checkpoints"), "the checkpoint folder")


def manager(directory: str, *, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
    """An orbax CheckpointManager keeping the last `keep` steps; sweeps crash leftovers first."""
    if keep < 1:
        raise UserError(f"--keep={keep}: keep at least 1 checkpoint")
    directory = storage.absolute(directory)
    _quiet_orbax()
    sweep_incomplete(directory)
    if jax.process_count() > 1:  # the others must not list steps while host 0 moves folders
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("jaxlm.checkpoint.sweep")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           create=True)
    return ocp.CheckpointManager(directory, options=options, item_handlers={
        "state": ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt()),
        "meta": ocp.JsonCheckpointHandler()})


def save(mngr: ocp.CheckpointManager, step: int, state: dict, meta: dict) -> None:
    """Start an (async) save of `state` at `step`; returns once device buffers are copied.

    Raises a UserError when this save cannot start or the previous one failed."""
    try:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                meta=ocp.args.JsonSave(meta)), force=True)
    except Exception as e:  # noqa: BLE001  orbax re-raises whatever its threads hit
        raise _save_error(mngr, step, e) from None


def wait(mngr: ocp.CheckpointManager) -> None:
    """Wait for the running save; a failed one is a UserError naming the folder and cause."""
    try:
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001
        raise _save_error(mngr, None, e) from None


def _save_error(mngr, step, e: Exception) -> UserError:
    done = complete_steps(str(mngr.directory)) if storage.isdir(str(mngr.directory)) else []
    kept = f"the last complete one is step {done[-1]}" if done else "none is complete yet"
    what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
    err = UserError(f"cannot save {what} in {mngr.directory} ({_cause(e)}); {kept}. Check that "
                    "the folder is writable, is a folder and has space, then rerun to resume")
    err.abandoned_threads = True  # orbax's commit threads wait for signals that never come
    return err


def _cause(e: BaseException, limit: int = 300) -> str:
    """The innermost cause of `e` as `Type: first line`, shortened (orbax wraps tensorstore's
    errors in a bare Exception whose message is a page of JSON)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def abstract_like(tree):
    """ShapeDtypeStructs carrying each array's sharding: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def restore_latest(mngr: ocp.CheckpointManager, like_state: dict):
    """-> (state, meta) of the latest complete step, placed like `like_state`; None if none.

    like_state: the freshly initialised state (arrays or ShapeDtypeStructs with shardings).
    A step that cannot be read is moved aside with a warning (see the module docstring) and
    the next older one is tried; one written for another configuration (other parameter
    shapes) is a UserError.
    """
    target = abstract_like(like_state)
    while True:
        steps = complete_steps(str(mngr.directory))
        if jax.process_count() > 1:  # hosts on separate disks would each resume somewhere else
            from jaxlm import distributed
            distributed.check_same({"the latest checkpoint": steps[-1] if steps else None},
                                   fix=f"put --out on storage every host shares (now {mngr.directory})")
        if not steps:
            return None
        step = steps[-1]
        # Shapes first, from the metadata: a restore that fails half-way leaves tensorstore
        # reads completing into a closed event loop, a traceback each ("Event loop is closed").
        problem = _check_shapes(mngr, step, target)
        if problem is None:
            try:
                out = mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001  orbax raises bare Exceptions for bad arrays
                problem = f"arrays unreadable: {_cause(e)}"
        if _any_process(problem is not None):
            set_aside(mngr, step, problem or "unreadable on another process")
            continue
        return out["state"], out["meta"]


def _check_shapes(mngr, step: int, target) -> str | None:
    """None if `step` holds arrays of `target`'s shapes; else what is wrong with its files (for
    the warning), or a UserError when it was written by another configuration."""
    folder = storage.join(str(mngr.directory), str(step))
    missing = [n for n in ("state", "meta", "_CHECKPOINT_METADATA")
               if not storage.exists(storage.join(folder, n))]
    if missing:
        return f"files missing: {', '.join(missing)}"
    try:
        saved = mngr.item_metadata(step)["state"]
        leaves = jax.tree.leaves(saved, is_leaf=lambda x: hasattr(x, "shape"))
        shapes = [tuple(x.shape) for x in leaves]
    except Exception as e:  # noqa: BLE001
        return f"metadata unreadable: {_cause(e)}"
    want = [tuple(x.shape) for x in jax.tree.leaves(target)]
    if shapes != want:
        diff = next((f"{a} saved, {b} now" for a, b in zip(shapes, want) if a != b),
                    f"{len(shapes)} arrays saved, {len(want)} now")
        raise UserError(f"cannot resume from {folder}: it was written by a different "
                        f"configuration (array shapes differ: {diff}); use another --out or "
                        "the flags of that run")
    return None


def _any_process(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def set_aside(mngr: ocp.CheckpointManager, step: int, problem: str) -> None:
    """Move a damaged committed `step` to `<directory>/../damaged_checkpoints/` (never deleted:
    the user may want to inspect it), warn, and make the manager forget it."""
    directory = str(mngr.directory)
    if jax.process_index() == 0:
        aside = storage.join(storage.parent(directory), DAMAGED_DIR)
        storage.makedirs(aside)
        target = storage.join(aside, f"{step}.{time.time_ns()}")
        storage.rename(storage.join(directory, str(step)), target)
        older = [s for s in complete_steps(directory) if s < step]
        log.warning("checkpoint: step %d in %s is damaged (%s); moved it to %s and %s", step,
                    directory, problem, target,
                    f"resuming from step {older[-1]}" if older else "no older one is complete")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("jaxlm.checkpoint.set_aside")
    mngr.reload()


def resume(mngr: ocp.CheckpointManager, like_state: dict, fingerprint: dict, out: str,
           allow_change: tuple[str, ...] = ()):
    """`restore_latest`, refusing a checkpoint whose run had different flags or data (the
    `fingerprint` saved in its meta): resuming it would silently mix two trainings.

    allow_change: fingerprint keys that may differ (e.g. "data_files" under
    --allow_data_change); the others must match.
    """
    # The flags first, from the newest step's small JSON meta: a run with another --preset or
    # --lora_rank is named as such, not as arrays of other shapes.
    _refuse_other_run(_latest_meta(mngr), fingerprint, out, allow_change)
    restored = restore_latest(mngr, like_state)
    if restored is not None:
        _refuse_other_run(restored[1], fingerprint, out, allow_change)
    return restored


def _latest_meta(mngr) -> dict | None:
    steps = complete_steps(str(mngr.directory))
    if not steps:
        return None
    try:
        return mngr.restore(steps[-1], args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception:  # noqa: BLE001  a damaged step: restore_latest says what is wrong
        return None


def _refuse_other_run(meta: dict | None, fingerprint: dict, out: str, allow_change) -> None:
    if meta is not None:
        saved = meta.get("fingerprint", {})
        keys = (set(saved) | set(fingerprint)) - set(allow_change)
        keys -= {k for k in DATA_KEYS if k not in saved}  # written before data was fingerprinted
        diff = sorted(k for k in keys if saved.get(k) != fingerprint.get(k))
        data = [k for k in diff if k in DATA_KEYS]
        if data and len(data) == len(diff):
            raise UserError(f"the data changed since {out} was checkpointed ({_data_diff(saved, fingerprint)}); "
                            "restore it, use another --out, or pass --allow_data_change to "
                            "resume on the new data")
        if diff:
            raise UserError(f"{out} holds a checkpoint of a different run (flags differ: "
                            f"{', '.join(diff)}); use another --out or the same flags")


DATA_KEYS = ("data_files",)  # fingerprint entries describing the data's content, not a flag


def files_fingerprint(paths: list[str], hashed=lambda path: True) -> dict:
    """{path: "SIZE" or "SIZE sha256:HEX"} of data files, for a run's fingerprint: resuming on
    edited data is then refused instead of silently mixing two datasets. `hashed(path)`
    says which files' content is hashed (all by default; streamed, ~1 s per GB)."""
    out = {}
    for p in paths:
        n = storage.size(p)
        if hashed(p):
            h = hashlib.sha256()
            with storage.open_file(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            out[p] = f"{n} sha256:{h.hexdigest()}"
        else:
            out[p] = str(n)
    return out


def _data_diff(saved: dict, now: dict) -> str:
    a, b = saved.get("data_files") or {}, now.get("data_files") or {}
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return f"{shown or 'its files'} differ in size or content"


def save_tree(path: str, tree) -> None:
    """Write one tree (e.g. the final adapters) as a standalone orbax checkpoint at `path`."""
    with checkpointer() as ckptr:
        ckptr.save(storage.absolute(path), args=ocp.args.StandardSave(tree), force=True)


def load_tree(path: str, like=None):
    """Read a tree written by `save_tree`: onto `like`'s shardings when given, else whole on
    this process's first device (whatever mesh wrote it: 8 simulated devices, a pod slice)."""
    path = storage.absolute(path)
    with checkpointer() as ckptr:
        if like is None:
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            stored = ckptr.metadata(path).item_metadata
            like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                                stored.tree if hasattr(stored, "tree") else stored)
        return ckptr.restore(path, args=ocp.args.StandardRestore(abstract_like(like)))
