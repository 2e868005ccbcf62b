"""Memory of the compiled train step, as the compiler itself computes it (nothing is allocated).

    python bench/memory.py                     # TPU v3-8: Gemma 2B and 7B LoRA, remat off/on
    python bench/memory.py --platform=cpu      # one CPU device: Gemma 2B LoRA vs full fine-tune
    options: [--topology=v3:2x2] [--presets=gemma_2b_en,gemma_7b_en] [--modes=lora|full|lora,full]
             [--layers=scan|unrolled|scan,unrolled] [--remat=both|on|off] [--lora_rank=4]
             [--sequence_length=N] [--batch_size=N] [--mesh=1x8] [--dtype=D] [--layout=megatron]

TPU (`--platform=tpu`, the default): `libtpu` compiles the step `train.py` runs (the same trainer
builder, layout rules, LoRA merge and optimizer; see `jaxlm.train.aot`) for the named slice on
abstract (`ShapeDtypeStruct`) inputs. For each preset, mode, layer form and remat setting it
prints weights, adapters, optimizer state, temporaries and the total per core against the
core's HBM, and the collectives of the partitioned program. A step over budget is refused by
the compiler; the table then shows the temporaries it asked for. Without libtpu it compiles for
8 simulated CPU devices instead and says so (those numbers say nothing about a TPU).
Defaults: batch 8 x 512 tokens, mesh 1x8, LoRA only, remat off and on.

CPU (`--platform=cpu`): the step `train.py --compile_only=cpu --mesh=1x1` compiles, for ONE CPU
device (its loss blocks and, under LoRA, its train layout), read back from XLA:CPU's
`memory_analysis()`, with the same table. `args_gib` is what the step holds besides its
temporaries (weights, adapters, the layout's copies, optimizer state, batch). Defaults: Gemma 2B,
LoRA and full fine-tuning, the layer scan and unrolled layers, batch 2 x 128 tokens, remat off.

Precision is the platform's policy (`jaxlm.precision`: on a TPU float32 master weights and
moments over bfloat16 compute, the frozen LoRA base in bfloat16; on CPU float32 throughout);
`--dtype=D` is train.py's one-dtype shorthand (parameters, compute and frozen base in D).

Ends with one line per row, and on CPU one ratio per preset and layer form:
    BENCH memory_<preset>_<lora|full>[_unrolled][_remat] total_gib=<x> hbm_gib=<x> fits=<0|1> topology=<t> ...
    BENCH memory_cpu_<preset>_<lora|full>_<scan|unrolled> temp_gib=<x> args_gib=<x> total_gib=<x> dtype=<d>
    BENCH memory_cpu_<preset>_<scan|unrolled> lora_over_full=<temp ratio>
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxlm.machine import with_host_devices  # noqa: E402

try:
    import libtpu  # noqa: F401
    LIBTPU = True
except ImportError:
    LIBTPU = False


def _host_devices(argv: list[str]) -> int | None:
    """Host devices this run needs, set before jax starts: one for --platform=cpu (the loss's
    CPU block is split between the host's devices, so 8 simulated ones would compile a smaller
    block than `train.py --mesh=1x1` runs), 8 for the TPU fallback without libtpu."""
    cpu = "--platform=cpu" in argv or any(a == "--platform" and b == "cpu"
                                          for a, b in zip(argv, argv[1:]))
    return 1 if cpu else None if LIBTPU else 8


if (_count := _host_devices(sys.argv[1:])) is not None:
    os.environ["XLA_FLAGS"] = with_host_devices(os.environ.get("XLA_FLAGS", ""), _count)


import jaxlm  # noqa: E402
from jaxlm import precision  # noqa: E402
from jaxlm.train import aot  # noqa: E402


def load(preset: str, policy: precision.Policy, lora: bool, scan: bool, remat: bool = False):
    """The abstract model and parameters a run of this policy steps (the base stored frozen
    under LoRA), with the layer form and remat set on the config."""
    stored = policy.frozen if lora else policy.param
    model, params = jaxlm.load(preset, policy.compute, abstract=True, param_dtype=stored)
    return type(model)(model.config.replace(scan_layers=scan, remat=remat)), params


def cpu_step_memory(preset: str, policy: precision.Policy, *, lora_rank: int, scan: bool,
                    batch_size: int, sequence_length: int) -> aot.Report:
    """The step `train.py --compile_only=cpu --mesh=1x1` compiles (its loss blocks, train layout
    and report), with the layer form `scan` asks for."""
    model, params = load(preset, policy, bool(lora_rank), scan)
    report, _ = aot.compile_train_step(model, params, topology="cpu", mesh_spec="1x1",
                                       lora_rank=lora_rank, batch_size=batch_size,
                                       sequence_length=sequence_length,
                                       trainable_dtype=policy.param)
    return report


def run_cpu(args, modes, layer_forms) -> list[str]:
    policy = precision.resolve(dtype=args.dtype, platform="cpu")
    lines = []
    for preset in args.presets.split(","):
        for scan in layer_forms:
            temps = {}
            for mode in modes:
                rank = args.lora_rank if mode == "lora" else 0
                r = cpu_step_memory(preset, policy, lora_rank=rank, scan=scan,
                                    batch_size=args.batch_size, sequence_length=args.sequence_length)
                held = r.weights + r.trainable + r.layout + r.optimizer + r.batch
                temps[mode] = r.temporaries
                form = "scan" if scan else "unrolled"
                print(f"{preset} {mode} ({policy.describe(mode == 'lora')}), {form} layers, "
                      f"batch {args.batch_size} x {args.sequence_length}, one CPU device:")
                print(r.table())
                lines.append(f"BENCH memory_cpu_{preset}_{mode}_{form} "
                             f"temp_gib={r.temporaries / aot.GiB:.6g} args_gib={held / aot.GiB:.3f} "
                             f"total_gib={r.total / aot.GiB:.3f} "
                             f"dtype={policy.compute} batch={args.batch_size}x{args.sequence_length}")
            if len(temps) == 2:
                ratio = temps["lora"] / max(temps["full"], 1)
                print(f"  -> LoRA temporaries are {ratio:.1%} of the full fine-tune's")
                lines.append(f"BENCH memory_cpu_{preset}_{'scan' if scan else 'unrolled'} "
                             f"lora_over_full={ratio:.3f}")
    return lines


def run_tpu(args, modes, layer_forms) -> list[str]:
    topology = args.topology
    if not LIBTPU:
        print(f"NOTE: libtpu is not installed (pip install libtpu): compiling for 8 simulated "
              f"CPU devices with the CPU compiler instead of {topology}; these numbers are NOT "
              "TPU memory")
        topology = "cpu"
    policy = precision.resolve(dtype=args.dtype, platform="cpu" if topology == "cpu" else "tpu")
    remats = {"both": (False, True), "on": (True,), "off": (False,)}[args.remat]
    lines = []
    for preset in args.presets.split(","):
        for mode in modes:
            rank = args.lora_rank if mode == "lora" else 0
            for scan in layer_forms:
                for remat in remats:
                    model, params = load(preset, policy, bool(rank), scan, remat)
                    print(f"\n== {preset} ({policy.describe(bool(rank))}), "
                          f"{'LoRA rank ' + str(rank) if rank else 'full fine-tuning'}, "
                          f"batch {args.batch_size} x {args.sequence_length} tokens, mesh {args.mesh}, "
                          f"layout {args.layout or 'megatron'}, {'scan' if scan else 'unrolled'} layers, "
                          f"remat {'on' if remat else 'off'}")
                    report, _ = aot.compile_train_step(
                        model, params, topology=topology, mesh_spec=args.mesh, lora_rank=rank,
                        layout=args.layout, batch_size=args.batch_size,
                        sequence_length=args.sequence_length, trainable_dtype=policy.param)
                    print(report.table())
                    name = (f"memory_{preset}_{mode}" + ("" if scan else "_unrolled")
                            + ("_remat" if remat else ""))
                    hbm = f"{report.hbm / aot.GiB:.2f}" if report.hbm else "nan"
                    lines.append(f"BENCH {name} total_gib={report.total / aot.GiB:.3f} hbm_gib={hbm} "
                                 f"fits={int(report.fits)} topology={topology} "
                                 f"temp_gib={report.temporaries / aot.GiB:.3f} "
                                 f"all_reduce={report.collectives.get('all-reduce', 0)} "
                                 f"all_gather={report.collectives.get('all-gather', 0)} "
                                 f"compile_s={report.compile_s:.0f}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--platform", default="tpu", choices=["tpu", "cpu"])
    p.add_argument("--topology", default="v3:2x2", help=f"one of {', '.join(aot.TOPOLOGIES)}")
    p.add_argument("--presets", default=None, help="default: gemma_2b_en,gemma_7b_en (tpu), gemma_2b_en (cpu)")
    p.add_argument("--modes", default=None, help="lora,full; default: lora (tpu), lora,full (cpu)")
    p.add_argument("--layers", default=None, help="scan,unrolled; default: scan (tpu), scan,unrolled (cpu)")
    p.add_argument("--lora_rank", type=int, default=4)
    p.add_argument("--sequence_length", type=int, default=None, help="default: 512 (tpu), 128 (cpu)")
    p.add_argument("--batch_size", type=int, default=None, help="default: 8 (tpu), 2 (cpu)")
    p.add_argument("--mesh", default="1x8", help="tpu only")
    p.add_argument("--dtype", default=None, help="one dtype for parameters and compute (default: the policy)")
    p.add_argument("--layout", default=None, help="megatron (default) | seed | keras")
    p.add_argument("--remat", default=None, choices=["both", "on", "off"], help="default: both (tpu), off (cpu)")
    args = p.parse_args(argv)
    cpu = args.platform == "cpu"
    args.presets = args.presets or ("gemma_2b_en" if cpu else "gemma_2b_en,gemma_7b_en")
    args.sequence_length = args.sequence_length or (128 if cpu else 512)
    args.batch_size = args.batch_size or (2 if cpu else 8)
    args.remat = args.remat or ("off" if cpu else "both")
    modes = (args.modes or ("lora,full" if cpu else "lora")).split(",")
    forms = {"scan": True, "unrolled": False}
    layer_forms = [forms[f] for f in (args.layers or ("scan,unrolled" if cpu else "scan")).split(",")]
    lines = (run_cpu if cpu else run_tpu)(args, modes, layer_forms)
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
