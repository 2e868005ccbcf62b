"""jaxlm adapter folders: the factors as an orbax checkpoint beside their description.

    adapters/
      lora.json    {"format": 1, "rank": 4, "alpha": 16.0, "targets": [...]}
      factors/     orbax checkpoint of the factor tree (written by every host together)

`load` needs nothing but the folder: rank, alpha and targets come back with the factors as an
`Adapters`. The folder may be local or a URL (`gs://...`).
"""
from __future__ import annotations

import json

import jax

from jaxlm import checkpoint, storage
from jaxlm.errors import UserError
from jaxlm.lora.core import Adapters

META = "lora.json"
FACTORS_DIR = "factors"


def save(directory: str, adapters: Adapters) -> None:
    """Write `adapters` (an `Adapters`, as `init` returns) to `directory`; collective on a
    multi-host run (orbax writes each host's shards), the description from process 0."""
    if not isinstance(adapters, Adapters):
        raise UserError("jaxlm.lora.save needs the Adapters that jaxlm.lora.init returns "
                        f"(got a {type(adapters).__name__}); wrap plain factors with "
                        "jaxlm.lora.Adapters(factors, rank=R, alpha=A)")
    checkpoint.save_tree(storage.join(directory, FACTORS_DIR), dict(adapters))
    if jax.process_index() == 0:
        storage.write_text(storage.join(directory, META),
                           json.dumps({"format": 1, **adapters.describe()}, indent=1))


def load(directory: str, like: Adapters | None = None) -> Adapters:
    """Read a folder written by `save` -> Adapters. `like` (adapters or ShapeDtypeStructs with
    shardings) places the factors as it is placed."""
    meta_path = storage.join(directory, META)
    if not storage.isfile(meta_path):
        raise UserError(f"{directory} is not a jaxlm adapter folder (no {META}); pass the "
                        "adapters/ folder a training run wrote")
    try:
        meta = json.loads(storage.read_text(meta_path))
        rank, alpha, targets = int(meta["rank"]), float(meta["alpha"]), tuple(meta["targets"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{meta_path} is damaged ({type(e).__name__}: {e}); export the "
                        "adapters again") from None
    try:
        factors = checkpoint.load_tree(storage.join(directory, FACTORS_DIR),
                                       None if like is None else dict(like))
    except (ValueError, FileNotFoundError, OSError, KeyError) as e:
        raise UserError(f"cannot read the factors in {directory} ({str(e).splitlines()[0]}); "
                        "export the adapters again") from None
    return Adapters(factors, rank=rank, alpha=alpha, targets=targets)
