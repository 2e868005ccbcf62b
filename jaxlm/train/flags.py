"""The flags both trainers share, spelled once: the same name means the same setting in
`python train.py` (causal LM) and `python train.py --task=mlm` (RoBERTa MLM).

Each trainer passes its own defaults (the seed article's for Gemma, the TF+TPU blog's for
RoBERTa); the MLM trainer keeps the blog's spellings as aliases (`--num_epochs`,
`--per_replica_batch_size`, `--bfloat16`, `--warmup_fraction`).
"""
from __future__ import annotations

import argparse

from jaxlm import errors, precision

ArgumentParser = errors.ArgumentParser  # every entry point's parser: one `error:` line, exit 2


SHARED = {  # flag -> (type, help)
    "mesh": (str, "DxM devices on the (batch, model) axes, e.g. 1x8"),
    "layout": (str, "sharding table name (see sharding/rules.py)"),
    "steps": (int, "optimizer steps in all (default: the epochs below)"),
    "epochs": (float, "passes over the training data"),
    "batch_size": (int, "global batch: rows per optimizer step (per micro-batch)"),
    "learning_rate": (float, "peak learning rate"),
    "weight_decay": (float, "AdamW weight decay (never on biases and norms)"),
    "warmup_steps": (int, "linear warmup steps from 0 to the peak learning rate"),
    "seed": (int, "seeds initialisation, data order and dropout"),
    "out": (str, "checkpoints, metrics.jsonl and exports go here (local folder or gs://...)"),
    "save_every": (int, "checkpoint every N steps (and at the end)"),
    "keep": (int, "checkpoints kept"),
    "log_every": (int, "print and record metrics every N steps"),
    "param_dtype": (str, "dtype of the trained (master) weights and Adam moments "
                         "(default float32)"),
    "compute_dtype": (str, "dtype of matmuls and activations (default float32 on CPU, bfloat16 "
                           "on GPU/TPU; under LoRA the frozen base is stored in it)"),
    "dtype": (str, "shorthand setting both --param_dtype and --compute_dtype"),
    "compile_cache": (str, "folder where XLA's compiled steps are kept for the next run "
                           "(default $JAXLM_COMPILE_CACHE, else ~/.cache/jaxlm/xla; empty: off)"),
}


def add_shared(parser: argparse.ArgumentParser, defaults: dict, helps: dict | None = None,
               aliases: dict | None = None) -> None:
    """Add every SHARED flag with this trainer's `defaults` (and help overrides / aliases)."""
    helps, aliases = helps or {}, aliases or {}
    for name, (kind, text) in SHARED.items():
        names = [f"--{name}"] + [f"--{a}" for a in aliases.get(name, ())]
        parser.add_argument(*names, dest=name, type=kind, default=defaults.get(name),
                            help=helps.get(name, text))


def check_dtypes(ns: dict) -> None:
    """Normalise the three dtype flags in a parsed namespace dict (one line for a bad name)."""
    for flag in ("dtype", "param_dtype", "compute_dtype"):
        ns[flag] = precision.check_dtype(ns.get(flag), f"--{flag}")
