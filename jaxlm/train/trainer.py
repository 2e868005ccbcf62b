"""One builder for what every trainer steps: the train state, its shardings and the jitted step.

    trainer = build(params, mesh, param_specs=specs, loss_fn=loss, optimizer=opt,
                    lora=LoraSpec(rank=4, alpha=16.0))
    state, metrics = trainer.step(trainer.state, trainer.frozen, batch)

The causal-LM trainer (`train.py`), the RoBERTa MLM trainer and the ahead-of-time compiler
(`--compile_only`) all build their state here, so they cannot drift apart. The compiler passes
abstract parameters (`jax.ShapeDtypeStruct`s carrying shardings) and gets an abstract state
back: nothing is allocated, and the step it lowers is the one training runs.

Under LoRA the trainable tree is the `jaxlm.lora.Adapters`, created directly in their
shardings (each factor follows its kernel's spec, `sharding.adapter_specs`) in the policy's
master dtype; the base parameters are the frozen tree, passed to every step and never donated.
At rank 0 the parameters themselves are trained. The optimizer state follows the trainable
tree's shardings; the step counter and RNG are replicated.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import sharding
from models import train_layout as layout_lib
from jaxlm import lora as lora_lib
from jaxlm.train.step import make_train_step, micro_batch_sharding, shardings_of


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What `train.py --lora_rank/--lora_alpha/--lora_targets` ask for (None: KerasHub's)."""
    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] | None = None


@dataclasses.dataclass
class Trainer:
    state: dict            # {"step", "trainable", "opt_state", "rng"}: arrays or ShapeDtypeStructs
    frozen: dict | None    # the LoRA base (None when every parameter trains)
    step: Callable         # jitted (state, step_frozen(frozen), batch) -> (state, metrics); donates state
    batch_sharding: NamedSharding
    # What the step takes for the frozen base: the base itself, or (base, its train layout)
    # (`models.train_layout.build`), built from the base where it lies when training starts.
    step_frozen: Callable = lambda frozen: frozen


def training_model(model, *, platform: str, remat: bool = False, attention: str = "xla"):
    """The model the step trains: `model` with the run's remat and attention, and on CPU the
    layers unrolled. XLA:CPU's layer scan copies every frozen block weight each step (Gemma 2B
    LoRA at 2 x 128 tokens: 10.6 GiB of temporaries scanned, 1.7 GiB unrolled), widens a
    scanned bfloat16 weight stack to float32 whole, which the unrolled layers' slices avoid
    (Gemma 2B bfloat16 full fine-tune: 21.0 GiB scanned, 10.8 unrolled; `python
    bench/memory.py --platform=cpu --dtype=bfloat16`), and in a float32 full fine-tune stacks
    the weights and their gradients each step (2B: 19.7 GiB scanned, 18.7 unrolled; the real
    Gemma 3 270M's step at 8 x 128 tokens 3-7% faster unrolled, at 2 x 512 ~3%, bench/README.md).
    TPU and GPU keep the scan: compile time flat in depth. Raises ValueError for an attention
    the config cannot take."""
    changes = {}
    if remat:
        changes["remat"] = True
    if attention != "xla":
        changes["attention"] = attention
    if platform == "cpu" and getattr(model.config, "scan_layers", False):
        changes["scan_layers"] = False
    return type(model)(model.config.replace(**changes)) if changes else model


def train_layout_of(model, params, *, lora: bool, platform: str) -> Callable | None:
    """How a LoRA step of `model` (as `training_model` returns it) on `platform` takes its base
    `params`. None: the step merges the adapters into it (TPU, GPU, RoBERTa). Otherwise, on
    CPU, a Gemma step keeps them unmerged beside its products, and this returns base -> its
    train layout, `build`'s, where that pays (`models.train_layout.pays`: a narrow compute
    dtype, a base whose copies fit; the Gemma 3 270M's bfloat16 LoRA step 1.8x faster on a
    2-core AMX-BF16 host, bench/README.md), else base -> None: the stored kernels as they are
    with the factors beside (narrow ones through `train_layout.product`, without a layout), so
    the step computes no gradient for a targeted kernel (the 270M's float32 step at 8 x 128
    tokens 3-4% faster; Gemma 2B's bfloat16 step at 2 x 128 on a 2-core AMD EPYC 8951 -> 8547
    ms, best of 6, `python bench/real_step_ab.py --what=unmerged --preset=gemma_2b_en
    --dtype=bfloat16 --batch=2 --seq=128`; bench/README.md). A layer scan merges: its blocks
    see only their params."""
    if (not lora or getattr(model.config, "family", None) != "gemma" or platform != "cpu"
            or getattr(model.config, "scan_layers", False)):
        return None
    dtype = model.config.dtype
    nbytes = sum(x.size for x in jax.tree.leaves(params)) * jnp.dtype(dtype).itemsize
    if layout_lib.pays(platform, dtype, nbytes):
        return functools.partial(layout_lib.build, model)
    return lambda base: None


def activation_rules(model, layout: str | None, platform: str) -> dict:
    """The layout table's activation rules (`sharding.activation_rules`) for a step of `model`
    (as `training_model` returns it) on `platform`; none for a CPU step that keeps the layer
    scan (`training_model` unrolls it; `bench/memory.py --layers=scan` does not). There
    XLA:CPU, asked to re-lay out activations inside the loop, gathered the stacked weights
    instead: Gemma 3 270M on the simulated 1x8 mesh took 1.32 instead of 0.26 GiB of
    temporaries a device for LoRA, 2.11 instead of 0.41 for a full fine-tune; unrolled, 0.27
    instead of 0.30 (LoRA) and 0.46 instead of 0.52 (full). On a TPU the scanned step shrinks
    with them (Gemma 7B LoRA on a v3-8: 7.2 instead of 20.0 GiB a core; `bench/memory.py`)."""
    if platform == "cpu" and getattr(model.config, "scan_layers", False):
        return {}
    return sharding.activation_rules(model.config, layout)


def _is_abstract(tree) -> bool:
    return all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def make_adapters(params, param_specs, mesh, spec: LoraSpec, *, seed: int = 0,
                  dtype: str = "float32", abstract: bool = False) -> lora_lib.Adapters:
    """LoRA factors created in their shardings (or their ShapeDtypeStructs when `abstract`)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)

    def init(key):
        return lora_lib.init(shapes, spec.rank, key=key, alpha=spec.alpha, targets=spec.targets,
                             dtype=dtype)
    key = jax.random.key(seed)
    specs = sharding.adapter_specs(jax.eval_shape(init, key), param_specs, mesh)
    out = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    if abstract:
        return jax.tree.map(lambda s, shd: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shd),
                            jax.eval_shape(init, key), out)
    return jax.jit(init, out_shardings=out)(key)


def init_state(trainable, optimizer: optax.GradientTransformation, mesh=None, *, seed: int = 0,
               abstract: bool = False) -> dict:
    """A fresh train state; the optimizer state inherits the shardings of `trainable` (without
    a mesh: jit's default placement, for one-device benchmarks)."""
    if mesh is None:
        return {"step": jnp.zeros((), jnp.int32), "trainable": trainable,
                "opt_state": jax.jit(optimizer.init)(trainable),
                "rng": jax.random.key_data(jax.random.key(seed))}
    replicated = NamedSharding(mesh, P())
    shapes = jax.eval_shape(optimizer.init, trainable)
    # Moments follow their parameter's sharding; counters and the like are replicated (left to
    # itself, jit would put them on one device and the step would refuse the mix).
    opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, shapes, shardings_of(trainable),
                                          transform_non_params=lambda _: replicated)
    if abstract:
        sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)  # noqa: E731
        opt_state = jax.tree.map(lambda s, shd: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shd),
                                 shapes, opt_shardings)
        return {"step": sds((), jnp.int32), "trainable": trainable, "opt_state": opt_state,
                "rng": sds((2,), jnp.uint32)}
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(trainable)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    rng = jax.device_put(jax.random.key_data(jax.random.key(seed)), replicated)
    return {"step": step, "trainable": trainable, "opt_state": opt_state, "rng": rng}


def build(params, mesh, *, param_specs, loss_fn: Callable,
          optimizer: optax.GradientTransformation, lora: LoraSpec | None = None,
          trainable_dtype: str = "float32", accum_steps: int = 1, seed: int = 0,
          activations: dict | None = None, train_layout: Callable | None = None) -> Trainer:
    """The state, frozen tree and jitted step for training `params` (see the module docstring).

    params: placed arrays, or ShapeDtypeStructs with shardings (then everything is abstract).
    param_specs: `sharding.partition_specs(params, rules, mesh)`. loss_fn: (params, batch, rng)
    -> (loss_sum, metric sums incl. "count"), e.g. `jaxlm.train.loss.lm_loss_fn(model)`.
    trainable_dtype: the adapters' dtype (the precision policy's master dtype).
    activations: the layout table's activation rules for this step (`activation_rules`).
    train_layout: under LoRA, base -> the base's CPU train layout or None
      (`train_layout_of`): the step keeps the adapters unmerged beside its products, through
      the layout if there is one, and `Trainer.step_frozen` builds it.
    """
    abstract = _is_abstract(params)
    if lora is not None:
        trainable = make_adapters(params, param_specs, mesh, lora, seed=seed,
                                  dtype=trainable_dtype, abstract=abstract)
        frozen, merge = params, lora_lib.merge
    else:
        trainable, frozen, merge, train_layout = params, None, None, None
    state = init_state(trainable, optimizer, mesh, seed=seed, abstract=abstract)
    batch_shd = micro_batch_sharding(mesh, accum_steps)
    step = make_train_step(loss_fn, optimizer, merge=merge, accum_steps=accum_steps,
                           state_shardings=shardings_of(state),
                           frozen_shardings=None if frozen is None else shardings_of(frozen),
                           batch_shardings=batch_shd, mesh=mesh, activations=activations,
                           layout=train_layout is not None)
    if train_layout is None:
        laid = {}
    elif abstract:  # the layout's shapes, for lowering (`jaxlm.train.aot`)
        laid = {"step_frozen": lambda base: (base, jax.eval_shape(train_layout, base))}
    else:
        laid = {"step_frozen": lambda base: (base, train_layout(base))}
    return Trainer(state=state, frozen=frozen, step=step, batch_sharding=batch_shd, **laid)


def abstract_batch(batch_size: int, sequence_length: int, sharding_, accum_steps: int = 1,
                   packing: bool = False) -> dict:
    """ShapeDtypeStructs of an LM batch [B, L+1] ([A, B, L+1] when accumulating), for lowering:
    token_ids, padding_mask and loss_mask, plus segment_ids and positions for packed rows."""
    shape = ((accum_steps,) if accum_steps > 1 else ()) + (batch_size, sequence_length + 1)
    dtypes = {"token_ids": jnp.int32, "padding_mask": jnp.bool_, "loss_mask": jnp.bool_}
    if packing:
        dtypes |= {"segment_ids": jnp.int32, "positions": jnp.int32}
    return {k: jax.ShapeDtypeStruct(shape, d, sharding=sharding_) for k, d in dtypes.items()}


__all__ = ["LoraSpec", "Trainer", "build", "init_state", "make_adapters", "abstract_batch",
           "training_model", "activation_rules"]
