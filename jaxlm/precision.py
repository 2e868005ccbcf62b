"""The precision policy: which dtype each kind of tensor is kept in, for every trainer.

    policy = precision.resolve(platform="tpu")           # the accelerator default
    policy.param       float32    master copy of every trained weight (and its gradient)
    policy.compute     bfloat16   matmuls and activations (the model config's `dtype`)
    policy.frozen      bfloat16   a LoRA run's frozen base: it never updates, so it is stored
                                  where it is computed, and that is where the memory goes
    policy.optimizer   float32    Adam's first moment (optax keeps the second in the
                                  parameter dtype); the master dtype unless asked otherwise

Keras calls the accelerator default `mixed_bfloat16`; MaxText splits it as `weight_dtype` /
`dtype`. Trained weights must stay float32 under bfloat16 compute: at the seed's learning
rate 5e-5 every update smaller than half a bfloat16 ulp of its weight rounds away (all of them
on |w| >= 2^-6), and in bfloat16 Adam's `0.999 * nu` rounds back to `nu`, so the second moment
never decays. Norms, softmax and the loss run in float32 whatever the policy (the models do
that themselves). On CPU everything is float32, which is what exact KerasHub parity needs.

`--dtype=D` is the old one-dtype shorthand: it sets both the parameter and the compute dtype
(and the frozen base) to D; `warnings(policy, lora)` says when that makes trainable weights
bfloat16.
"""
from __future__ import annotations

import dataclasses

import jax

from jaxlm.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Policy:
    param: str = "float32"
    compute: str = "float32"
    frozen: str = "float32"
    optimizer: str = "float32"

    def describe(self, lora: bool) -> str:
        trained = "adapters" if lora else "weights"
        text = f"{trained} {self.param}, compute {self.compute}"
        if lora:
            text += f", frozen base {self.frozen}"
        return text + f", Adam moments {self.optimizer}"


def check_dtype(name: str | None, flag: str) -> str | None:
    """A dtype name from the command line, or one line listing the valid ones."""
    if name is None:
        return None
    aliases = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
               "f16": "float16", "half": "float16"}
    name = aliases.get(str(name).lower(), str(name).lower())
    if name not in DTYPES:
        raise UserError(f"{flag}={name!r} is not a dtype jaxlm trains in; use one of "
                        f"{', '.join(DTYPES)}")
    return name


def default(platform: str | None = None) -> Policy:
    """float32 everywhere on CPU; float32 master weights and moments over bfloat16 compute
    (and a bfloat16 frozen LoRA base) on accelerators."""
    platform = platform or jax.default_backend()
    if platform == "cpu":
        return Policy()
    return Policy(param="float32", compute="bfloat16", frozen="bfloat16", optimizer="float32")


def resolve(*, dtype: str | None = None, param_dtype: str | None = None,
            compute_dtype: str | None = None, platform: str | None = None) -> Policy:
    """The policy for these flags: `dtype` sets parameters and compute together; the two
    specific flags override it; what none of them sets keeps the platform default."""
    dtype = check_dtype(dtype, "--dtype")
    param = check_dtype(param_dtype, "--param_dtype") or dtype
    compute = check_dtype(compute_dtype, "--compute_dtype") or dtype
    base = default(platform)
    compute = compute or base.compute
    param = param or base.param
    # The frozen base is stored in the compute dtype, unless the parameter dtype was asked for
    # explicitly: then the base is kept as asked (float32 stays float32).
    frozen = param if (param_dtype or dtype) else compute
    optimizer = param  # Adam's moments follow the master weights
    return Policy(param=param, compute=compute, frozen=frozen, optimizer=optimizer)


def warnings(policy: Policy, lora: bool) -> list[str]:
    """Lines to print for a policy that trains in a narrow dtype."""
    if policy.param == "float32":
        return []
    what = "LoRA adapters" if lora else "trainable weights"
    return [f"warning: {what} and their Adam moments are {policy.param}: updates smaller than "
            f"half a {policy.param} ulp of a weight are lost (most of them at learning rate "
            "5e-5); --param_dtype=float32 keeps float32 master weights under "
            f"--compute_dtype={policy.compute}"]
