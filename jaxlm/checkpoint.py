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
"""
from __future__ import annotations

import logging
import os
import re
import time

import jax
import orbax.checkpoint as ocp

from jaxlm import storage
from jaxlm.errors import UserError

log = logging.getLogger("jaxlm")
COMMIT_FILE = "commit_success.txt"
INCOMPLETE_DIR = "incomplete_checkpoints"


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
    return ocp.Checkpointer(ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt()))


def manager(directory: str, *, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
    """An orbax CheckpointManager keeping the last `keep` steps; sweeps crash leftovers first."""
    if keep < 1:
        raise UserError(f"--keep={keep}: keep at least 1 checkpoint")
    directory = storage.absolute(directory)
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
    """Start an (async) save of `state` at `step`; returns once device buffers are copied."""
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(meta)), force=True)


def abstract_like(tree):
    """ShapeDtypeStructs carrying each array's sharding: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def restore_latest(mngr: ocp.CheckpointManager, like_state: dict):
    """-> (state, meta) of the latest complete step, placed like `like_state`; None if none.

    like_state: the freshly initialised state (arrays or ShapeDtypeStructs with shardings).
    """
    steps = complete_steps(str(mngr.directory))
    if jax.process_count() > 1:  # hosts on separate disks would each resume somewhere else
        from jaxlm import distributed
        distributed.check_same({"the latest checkpoint": steps[-1] if steps else None},
                               fix=f"put --out on storage every host shares (now {mngr.directory})")
    if not steps:
        return None
    step = steps[-1]
    target = abstract_like(like_state)
    try:
        out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                         meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise UserError(f"cannot resume from {mngr.directory}/{step} ({str(e).splitlines()[0]}); "
                        "it was written by a different configuration — use another --out "
                        "or delete that folder") from None
    return out["state"], out["meta"]


def resume(mngr: ocp.CheckpointManager, like_state: dict, fingerprint: dict, out: str):
    """`restore_latest`, refusing a checkpoint whose run had different flags (the `fingerprint`
    saved in its meta): resuming it would silently mix two trainings."""
    restored = restore_latest(mngr, like_state)
    if restored is not None:
        saved = restored[1].get("fingerprint", {})
        diff = sorted(k for k in fingerprint if saved.get(k) != fingerprint[k])
        if diff or set(saved) != set(fingerprint):
            raise UserError(f"{out} holds a checkpoint of a different run (flags differ: "
                            f"{', '.join(diff) or 'the set of flags'}); use another --out or the same flags")
    return restored


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
