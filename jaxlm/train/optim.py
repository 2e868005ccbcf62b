"""AdamW as the seed configures it, plus the schedule and clipping a real run wants.

The seed article: `AdamW(learning_rate=5e-5, weight_decay=0.01)` with
`exclude_from_weight_decay(var_names=["bias", "scale"])`; Keras matches those names as
substrings of the variable path, so norm scales and biases are not decayed. We mask by the
last path component the same way (LoRA's `lora_a`/`lora_b` are decayed, as Keras decays its
`lora_kernel_a/b`).
"""
from __future__ import annotations

import dataclasses

import optax

from jaxlm.tree import flatten, unflatten

NO_DECAY = ("bias", "scale")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 5e-5
    weight_decay: float = 0.01
    warmup_steps: int = 0
    schedule: str = "constant"  # "constant" | "cosine" (decays to 0 at total_steps)
    total_steps: int = 0
    clip_norm: float | None = 1.0  # global-norm clipping; None or <= 0 disables it
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-7  # Keras' AdamW epsilon


def decay_mask(params: dict) -> dict:
    """Tree of bools: True where weight decay applies (not biases or norm scales)."""
    flat = flatten(params)
    return unflatten({p: not any(n in p.split("/")[-1] for n in NO_DECAY) for p in flat})


def schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate`, then constant or cosine to 0 at `total_steps`."""
    if cfg.schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown schedule {cfg.schedule!r}; use constant or cosine")
    if cfg.schedule == "cosine":
        decay = max(cfg.total_steps, cfg.warmup_steps + 1)
        return optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, decay, 0.0)
    if cfg.warmup_steps:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
             optax.constant_schedule(cfg.learning_rate)], [cfg.warmup_steps])
    return optax.constant_schedule(cfg.learning_rate)


def make_optimizer(cfg: OptimConfig = OptimConfig()) -> optax.GradientTransformation:
    """optax chain: [clip_by_global_norm] -> AdamW(decay masked off for bias/scale)."""
    adamw = optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.clip_norm and cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw

