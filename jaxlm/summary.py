"""`jaxlm.summary(model, params)`: a Keras-style table of parameters, with shardings once placed."""
from __future__ import annotations

import numpy as np

from jaxlm.tree import flatten


def _spec(leaf) -> str | None:
    sharding = getattr(leaf, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return None if spec is None else str(tuple(spec))


def summary(model, params: dict, trainable: dict | None = None, print_fn=print) -> str:
    """Print (and return) path, shape, dtype, count — and PartitionSpec when params are sharded.

    trainable: an optional second tree (e.g. LoRA adapters) listed after the base parameters and
    counted as the trainable total; without it every parameter counts as trainable.
    """
    rows = [(p, leaf) for p, leaf in flatten(params).items()]
    extra = [(p, leaf) for p, leaf in flatten(trainable or {}).items()]
    show_spec = any(_spec(leaf) for _, leaf in rows + extra)
    header = ["parameter", "shape", "dtype", "count"] + (["partition spec"] if show_spec else [])
    table = [[p, str(tuple(leaf.shape)), str(leaf.dtype), f"{int(np.prod(leaf.shape)):,}"]
             + ([_spec(leaf) or "-"] if show_spec else []) for p, leaf in rows + extra]
    widths = [max(len(r[i]) for r in table + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    total = sum(int(np.prod(leaf.shape)) for _, leaf in rows)
    n_train = sum(int(np.prod(leaf.shape)) for _, leaf in extra) if trainable is not None else total
    size = sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for _, leaf in rows + extra)
    lines = [f"Model: {type(model).__name__} ({getattr(model.config, 'family', '')})", fmt(header),
             "-" * (sum(widths) + 2 * (len(widths) - 1))]
    lines += [fmt(r) for r in table]
    lines += ["-" * (sum(widths) + 2 * (len(widths) - 1)),
              f"Total params: {total + (n_train if trainable is not None else 0):,} ({size / 2**20:,.1f} MiB)",
              f"Trainable params: {n_train:,}",
              f"Non-trainable params: {(total if trainable is not None else 0):,}"]
    text = "\n".join(lines)
    if print_fn is not None:
        print_fn(text)
    return text
