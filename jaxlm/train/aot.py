"""Compile the training step for a TPU slice that is not there, and report what it needs.

The `libtpu` package carries the real TPU compiler. `jax.experimental.topologies` describes a
slice ("v3:2x2" = the 8 cores of a v3-8) as abstract devices; we lower the SAME sharded step
`train.py` runs (`jaxlm.train.step.make_train_step`, the layout rules, LoRA merged inside jit)
on `ShapeDtypeStruct` inputs placed on that slice, and read back the compiler's own
`memory_analysis()` (per device), `cost_analysis()` and partitioned HLO. Nothing is loaded or
allocated, so Gemma 7B compiles for a v3-8 on a laptop:

    python train.py --preset=gemma_7b_en --mesh=1x8 --lora_rank=4 --compile_only=v3:2x2

A program over the core's HBM fails inside the TPU compiler; `compile_train_step` turns that
into a report with `fits=False` and the compiler's message. Without libtpu, "cpu" compiles for
the host's (simulated) CPU devices instead; CPU memory numbers say nothing about a TPU.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import sharding
from jaxlm import precision
from jaxlm.errors import UserError
from jaxlm.train import optim, trainer
from jaxlm.train.loss import CHUNK_LOGITS, lm_loss_fn

GiB = 1024 ** 3
# Usable HBM per device as the TPU compiler reports it in its out-of-memory message; v6e: the
# 32 GiB spec less the same ~0.5 GiB reserve (not checked against the compiler's message).
HBM_GIB = {"v2": 7.48, "v3": 15.48, "v4": 30.75, "v5e": 15.75, "v5p": 95.73, "v6e": 31.25}
# Topologies known to compile (vX:AxB[xC] form; "v5e-8" is rejected by libtpu).
TOPOLOGIES = ("v3:2x2", "v4:2x2x1", "v5e:2x4", "v5p:2x2x1", "v6e:2x4", "v2:2x2")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def has_libtpu() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def topology_devices(topology: str) -> list:
    """Abstract devices of a TPU slice ("v3:2x2"), or the host's devices for "cpu"."""
    if topology == "cpu":
        return list(jax.devices("cpu"))
    if not has_libtpu():
        raise UserError(f"compiling for {topology} needs the TPU compiler: pip install libtpu "
                        "(or use 'cpu' to compile for this host's devices)")
    # Several processes (parallel tests, a bench next to a run) may compile at once; without
    # this the second one fails on libtpu's lockfile. No TPU is opened, so sharing is safe.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    kwargs = {"chip_config_name": "megacore"} if topology.split(":")[0] in ("v4", "v5p") else {}
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                                 **kwargs).devices)
    except Exception as e:  # libtpu raises plain RuntimeErrors/XlaRuntimeErrors
        raise UserError(f"cannot describe TPU topology {topology!r} "
                        f"({str(e).splitlines()[0][:160]}); known to work: "
                        f"{', '.join(TOPOLOGIES)}") from None


def hbm_bytes(topology: str) -> float | None:
    gen = topology.split(":")[0]
    return HBM_GIB[gen] * GiB if gen in HBM_GIB else None


def _abstract(tree, specs, mesh):
    return jax.tree.map(lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                             sharding=NamedSharding(mesh, spec)),
                        tree, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def _bytes_per_device(tree) -> int:
    """Bytes one device holds of an abstract tree (its shard of every leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _compiled_bytes(tree, shardings) -> tuple[int, int]:
    """-> (bytes one device holds of `tree` as the compiled step places it, bytes of its leaves
    the step does not read): jit drops an unused argument (sharding None), as the step drops
    the base's kernels the train layout has copies of, though the run still holds them."""
    specs = jax.tree.leaves(shardings, is_leaf=lambda s: s is None or hasattr(s, "shard_shape"))
    leaves = list(zip(jax.tree.leaves(tree), specs, strict=True))
    placed = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in leaves if s is not None]
    return _bytes_per_device(placed), _bytes_per_device([x for x, s in leaves if s is None])


def abstract_trainer(model, params, mesh, *, lora_rank: int, layout=None, accum_steps: int = 1,
                     optimizer=None, lora_alpha=None, lora_targets=None,
                     trainable_dtype: str = "float32", chunk_logits: int | None = None):
    """-> the `jaxlm.train.trainer.Trainer` train.py builds, its state ShapeDtypeStructs on `mesh`.

    params: abstract parameter tree (`jaxlm.load(..., abstract=True)`), in the dtype the run
    stores them (the frozen dtype under LoRA). The same rules, adapter specs, optimizer-state
    placement, batch sharding and (a LoRA step on CPU) train layout as a real run, because it is
    the same builder: lower its step with `built.step_frozen(built.frozen)`.
    """
    rules = sharding.rules_for(model.config, layout)
    param_specs = sharding.partition_specs(params, rules, mesh)
    params = _abstract(params, param_specs, mesh)
    spec = trainer.LoraSpec(lora_rank, lora_alpha, lora_targets) if lora_rank else None
    platform = mesh.devices.flat[0].platform
    return trainer.build(params, mesh, param_specs=param_specs,
                         loss_fn=lm_loss_fn(model, chunk_logits=chunk_logits),
                         optimizer=optimizer or optim.make_optimizer(), lora=spec,
                         trainable_dtype=trainable_dtype, accum_steps=accum_steps,
                         activations=trainer.activation_rules(model, layout, platform),
                         train_layout=trainer.train_layout_of(model, params, lora=bool(lora_rank),
                                                              platform=platform))


@dataclasses.dataclass
class Report:
    """Per-device numbers of one compiled step (bytes unless named otherwise)."""
    topology: str
    device_kind: str
    mesh: tuple
    weights: int          # frozen base parameters (LoRA) or the trained parameters (full)
    trainable: int        # adapters (LoRA); 0 at full fine-tuning (counted in weights)
    layout: int           # the CPU train layout's copies of the frozen base (0 without one)
    optimizer: int        # optimizer state
    batch: int
    temporaries: int      # compiler's temp buffers (activations, gradients, workspace)
    total: int            # arguments (those the step drops but the run holds too) + outputs
                          # not aliased to them + temporaries + code
    hbm: float | None     # usable HBM per device; None when unknown (cpu)
    flops: float | None   # per device, from cost_analysis() (the layer scan's body counts once)
    collectives: dict     # op name -> count in the partitioned program
    compile_s: float
    fits: bool
    error: str = ""

    def table(self) -> str:
        g = lambda b: f"{b / GiB:8.3f} GiB" if b >= GiB / 10 else f"{b / 2 ** 20:8.2f} MiB"  # noqa: E731
        rows = [("weights (base, frozen)" if self.trainable else "weights", self.weights)]
        if self.layout:
            rows.append(("train layout (copies)", self.layout))
        if self.trainable:
            rows.append(("LoRA adapters", self.trainable))
        rows += [("optimizer state", self.optimizer), ("batch", self.batch),
                 ("temporaries", self.temporaries), ("total", self.total)]
        lines = [f"per-device memory of the train step on {self.topology} ({self.device_kind}), "
                 f"mesh {self.mesh[0]}x{self.mesh[1]}, compiled in {self.compile_s:.1f} s:"]
        lines += [f"  {name:<24}{g(v)}" for name, v in rows]
        if self.hbm:
            lines.append(f"  {'HBM per device':<24}{g(self.hbm)}  -> "
                         + (f"fits ({self.total / self.hbm:.0%} used)" if self.fits
                            else "DOES NOT FIT"))
        if self.error:
            lines.append(f"  compiler: {self.error}")
        if self.flops:
            lines.append(f"  {'XLA FLOPs per device':<24}{self.flops:.3e}  (a loop body counts once)")
        lines.append("  collectives in the program text (loop bodies once): " + (", ".join(f"{k} x{v}" for k, v in self.collectives.items()
                                                    if v) or "none"))
        return "\n".join(lines)


def count_collectives(hlo_text: str) -> dict:
    """{op: count} of cross-device ops (sync or async "-start" forms) in partitioned HLO."""
    out = {}
    for op in COLLECTIVES:
        out[op] = len(re.findall(rf"=\s*\S+\s+{op}(?:-start)?\(", hlo_text))
    return out


def _overflow_message(e: Exception) -> str:
    text = str(e)
    for line in text.splitlines():
        if "memory" in line.lower() or "hbm" in line.lower():
            return line.strip()[:300]
    return text.splitlines()[0][:300] if text else type(e).__name__


def compile_train_step(model, params, *, topology: str, mesh_spec="auto", lora_rank: int = 4,
                       layout=None, batch_size: int = 8, sequence_length: int = 512,
                       accum_steps: int = 1, lora_alpha=None, lora_targets=None,
                       trainable_dtype: str = "float32", packing: bool = False):
    """Lower and compile the train step for `topology`; -> (Report, compiled or None).

    model, params: from `jaxlm.load(preset, dtype, abstract=True, param_dtype=...)` (set `remat`
    on the model's config beforehand if wanted). mesh_spec: "DxM" over the topology's devices.
    trainable_dtype: the master dtype (LoRA adapters; at full fine-tuning `params`' own dtype).
    """
    devices = topology_devices(topology)
    try:
        mesh = sharding.make_mesh(mesh_spec, devices)
    except ValueError as e:
        raise UserError(f"{e} (topology {topology} has {len(devices)} devices)") from None
    if batch_size % mesh.shape["batch"]:
        raise UserError(f"batch size {batch_size} is not divisible by the mesh's batch axis "
                        f"({mesh.shape['batch']}); use a multiple of it")
    built = abstract_trainer(model, params, mesh, lora_rank=lora_rank, layout=layout,
                             accum_steps=accum_steps, lora_alpha=lora_alpha,
                             lora_targets=lora_targets, trainable_dtype=trainable_dtype,
                             chunk_logits=None if topology == "cpu" else CHUNK_LOGITS["tpu"])
    state, frozen = built.state, built.frozen
    batch = trainer.abstract_batch(batch_size, sequence_length, built.batch_sharding, accum_steps,
                                   packing)
    t0 = time.perf_counter()
    frozen_in = built.step_frozen(frozen)
    lowered = built.step.lower(state, frozen_in, batch)
    weights = _bytes_per_device(frozen if lora_rank else state["trainable"])
    report = Report(topology=topology, device_kind=devices[0].device_kind,
                    mesh=(mesh.shape["batch"], mesh.shape["model"]), weights=weights,
                    trainable=_bytes_per_device(state["trainable"]) if lora_rank else 0, layout=0,
                    optimizer=_bytes_per_device(state["opt_state"]),
                    batch=_bytes_per_device(batch), temporaries=0, total=0,
                    hbm=hbm_bytes(topology), flops=None, collectives={}, compile_s=0.0,
                    fits=True)
    try:
        compiled = lowered.compile()
    except Exception as e:  # the TPU compiler refuses programs over the HBM budget
        report.compile_s = time.perf_counter() - t0
        if topology == "cpu" or "memory" not in str(e).lower():
            raise
        report.fits, report.error = False, _overflow_message(e)
        # "...HLO temporaries (17.69G) exceeds available HBM...": keep the compiler's number.
        m = re.search(r"temporaries \(([\d.]+)G\)", str(e))
        if m:
            report.temporaries = int(float(m.group(1)) * GiB)
            report.total = (report.weights + report.trainable + report.optimizer + report.batch
                            + report.temporaries)
        return report, None
    report.compile_s = time.perf_counter() - t0
    (state_shd, frozen_shd, _), _ = compiled.input_shardings
    unused = _compiled_bytes(state, state_shd)[1]
    if frozen_in is not frozen:  # (base, its train layout or None)
        unused += _compiled_bytes(frozen, frozen_shd[0])[1]
        if frozen_in[1] is not None:
            report.layout = _compiled_bytes(frozen_in[1], frozen_shd[1])[0]
    elif frozen is not None:
        unused += _compiled_bytes(frozen, frozen_shd)[1]
    mem = compiled.memory_analysis()
    if mem is not None:
        report.temporaries = int(mem.temp_size_in_bytes)
        report.total = int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                           - mem.alias_size_in_bytes + mem.temp_size_in_bytes
                           + mem.generated_code_size_in_bytes + unused)
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    report.flops = float(cost.get("flops", 0.0)) or None if cost else None
    report.collectives = count_collectives(compiled.as_text())
    if report.hbm:
        report.fits = report.total <= report.hbm
    return report, compiled


def compile_decode(model, params, *, topology: str, mesh_spec="auto", batch_size: int = 8,
                   prompt_len: int = 16, total_len: int = 64, sampler="greedy", layout=None):
    """Compile `jaxlm.decode`'s prefill + while-loop decode for `topology`; -> compiled.

    The same jitted function `generate_ids` runs (bucketed sizes are taken as given), with
    params placed by the layout rules and the prompt rows split on the mesh's batch axis.
    """
    from jaxlm import decode, sampling
    mesh = sharding.make_mesh(mesh_spec, topology_devices(topology))
    rules = sharding.rules_for(model.config, layout)
    params = _abstract(params, sharding.partition_specs(params, rules, mesh), mesh)
    rows, rep = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
    args = (jax.ShapeDtypeStruct((batch_size, prompt_len), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),  # the sampling seed
            jax.ShapeDtypeStruct((decode._STOP_SLOTS,), jnp.int32, sharding=rep))
    fn = decode._compiled(model, sampling.resolve(sampler), batch_size, prompt_len, total_len,
                          False, mesh)
    return fn.lower(params, *args).compile()


def run_compile_only(preset: str, topology: str, *, mesh_spec: str = "auto",
                     lora: trainer.LoraSpec | None = None, layout=None, batch_size: int = 8,
                     sequence_length: int = 512, accum_steps: int = 1, remat: bool = False,
                     policy: precision.Policy | None = None, packing: bool = False) -> int:
    """`train.py --compile_only=TOPOLOGY`: compile, print the table; exit 0 if it fits, else 1.

    policy: the precision the run would use; default that of the target platform (float32
    master weights over bfloat16 compute on a TPU slice, the base frozen in bfloat16 under
    LoRA; float32 for "cpu"). A step that does not fit without remat is compiled again with
    it, so the output says whether --remat is the fix.
    """
    import jaxlm
    policy = policy or precision.resolve(platform="cpu" if topology == "cpu" else "tpu")
    stored = policy.frozen if lora else policy.param
    model, params = jaxlm.load(preset, policy.compute, abstract=True, param_dtype=stored)

    def compile_with(with_remat: bool):
        m = trainer.training_model(model, remat=with_remat,
                                   platform="cpu" if topology == "cpu" else "tpu")
        return compile_train_step(
            m, params, topology=topology, mesh_spec=mesh_spec, lora_rank=lora.rank if lora else 0,
            layout=layout, batch_size=batch_size, sequence_length=sequence_length,
            accum_steps=accum_steps, lora_alpha=lora.alpha if lora else None,
            lora_targets=lora.targets if lora else None, trainable_dtype=policy.param,
            packing=packing)[0]

    what = (f"{preset} ({policy.describe(bool(lora))}), "
            f"{'LoRA rank ' + str(lora.rank) if lora else 'full fine-tuning'}, batch {batch_size}"
            + (f" x {accum_steps} micro-batches" if accum_steps > 1 else "")
            + f", sequence {sequence_length}" + (", --remat" if remat else ""))
    print(f"compiling the train step of {what} for {topology}"
          + ("" if topology == "cpu" else " with the TPU compiler (libtpu)") + " ...")
    report = compile_with(remat)
    print(report.table())
    if not report.fits and not remat:
        print("compiling again with --remat (block activations recomputed in the backward pass) ...")
        again = compile_with(True)
        print(again.table())
        print("-> " + ("add --remat: it fits." if again.fits else
                       "still too big with --remat: use a larger slice, a smaller --batch_size "
                       "with --accum_steps, or a shorter --sequence_length."))
    return 0 if report.fits else 1


__all__ = ["compile_train_step", "abstract_trainer", "topology_devices", "count_collectives",
           "compile_decode", "Report", "TOPOLOGIES", "HBM_GIB", "has_libtpu", "run_compile_only"]
