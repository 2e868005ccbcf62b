"""AdamW with the schedules, decay masks and clipping both trainers use.

The seed article (Gemma): `AdamW(learning_rate=5e-5, weight_decay=0.01)` with
`exclude_from_weight_decay(var_names=["bias", "scale"])`; Keras matches those names as
substrings of the variable path, so norm scales and biases are not decayed. We mask by the
last path component the same way (LoRA's `lora_a`/`lora_b` are decayed, as Keras decays its
`lora_kernel_a/b`). The TF+TPU blog (RoBERTa MLM): eps 1e-8, no decay on biases and LayerNorm
(`gamma`, `beta`), a linear warmup then linear decay to 0 (`schedule="linear"`).
"""
from __future__ import annotations

import dataclasses

import optax

from jaxlm.tree import map_with_path

NO_DECAY = ("bias", "scale")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 5e-5
    weight_decay: float = 0.01
    warmup_steps: int = 0
    schedule: str = "constant"  # "constant" | "cosine" (to 0 at total_steps) | "linear" (likewise)
    total_steps: int = 0
    clip_norm: float | None = 1.0  # global-norm clipping; None or <= 0 disables it
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-7  # Keras' AdamW epsilon
    no_decay: tuple[str, ...] = NO_DECAY  # substrings of a parameter's last path component
    mu_dtype: str | None = None  # Adam's first moment (precision.Policy.optimizer); None: the params'


def decay_mask(params: dict, no_decay: tuple[str, ...] = NO_DECAY) -> dict:
    """Tree of bools shaped like `params`: True where weight decay applies (not biases or norm
    scales)."""
    return map_with_path(lambda p, _: not any(n in p.split("/")[-1] for n in no_decay), params)


def schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate`, then constant, cosine or linear to 0 at
    `total_steps`."""
    if cfg.schedule not in ("constant", "cosine", "linear"):
        raise ValueError(f"unknown schedule {cfg.schedule!r}; use constant, cosine or linear")
    if cfg.schedule == "cosine":
        decay = max(cfg.total_steps, cfg.warmup_steps + 1)
        return optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, decay, 0.0)
    if cfg.schedule == "linear":  # the blog's: at least one warmup step
        warmup = max(cfg.warmup_steps, 1)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.learning_rate, warmup),
             optax.linear_schedule(cfg.learning_rate, 0.0, max(cfg.total_steps - cfg.warmup_steps, 1))],
            [warmup])
    if cfg.warmup_steps:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
             optax.constant_schedule(cfg.learning_rate)], [cfg.warmup_steps])
    return optax.constant_schedule(cfg.learning_rate)


def make_optimizer(cfg: OptimConfig = OptimConfig()) -> optax.GradientTransformation:
    """optax chain: [clip_by_global_norm] -> AdamW(decay masked off for `cfg.no_decay`)."""
    adamw = optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mu_dtype=cfg.mu_dtype,
                        mask=lambda p: decay_mask(p, cfg.no_decay))
    if cfg.clip_norm and cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw
