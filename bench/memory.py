"""Per-core memory of the sharded train step, as the TPU compiler itself computes it.

    python bench/memory.py [--topology=v3:2x2] [--presets=gemma_2b_en,gemma_7b_en]
                           [--lora_rank=4] [--sequence_length=512] [--batch_size=8]
                           [--mesh=1x8] [--remat=both|on|off] [--layout=seed]

No TPU and no weights are needed: `libtpu` compiles the step `train.py` runs (the same
`make_train_step`, layout rules, LoRA merge and optimizer) for the named slice on abstract
(`ShapeDtypeStruct`) inputs; see `jaxlm.train.aot`. For each preset and remat setting it prints
weights, adapters, optimizer state, temporaries and the total per core against the core's HBM,
and the collectives of the partitioned program. A step over budget is refused by the compiler;
the table then shows the temporaries it asked for. Without libtpu it compiles for 8 simulated
CPU devices instead and says so (CPU memory numbers say nothing about a TPU).

Ends with one line per row:
    BENCH memory_<preset>_<lora|full>[_remat] total_gib=<x> hbm_gib=<x> fits=<0|1> topology=<t>
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import libtpu  # noqa: F401
    LIBTPU = True
except ImportError:
    LIBTPU = False
    # The CPU fallback needs as many host devices as the mesh; set before jax starts.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jaxlm  # noqa: E402
from jaxlm.train import aot  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", default="v3:2x2", help=f"one of {', '.join(aot.TOPOLOGIES)}")
    p.add_argument("--presets", default="gemma_2b_en,gemma_7b_en")
    p.add_argument("--lora_rank", type=int, default=4, help="0 = full fine-tuning")
    p.add_argument("--sequence_length", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--mesh", default="1x8")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default=None, help="seed (default) | keras")
    p.add_argument("--remat", default="both", choices=["both", "on", "off"])
    args = p.parse_args(argv)

    topology = args.topology
    if not LIBTPU:
        print(f"NOTE: libtpu is not installed (pip install libtpu): compiling for 8 simulated "
              f"CPU devices with the CPU compiler instead of {topology}; these numbers are NOT "
              "TPU memory")
        topology = "cpu"
    remats = {"both": (False, True), "on": (True,), "off": (False,)}[args.remat]
    lines = []
    for preset in args.presets.split(","):
        model, params = jaxlm.load(preset, args.dtype, abstract=True)
        for remat in remats:
            m = type(model)(model.config.replace(remat=True)) if remat else model
            print(f"\n== {preset} {args.dtype}, "
                  f"{'LoRA rank ' + str(args.lora_rank) if args.lora_rank else 'full fine-tuning'}, "
                  f"batch {args.batch_size} x {args.sequence_length} tokens, mesh {args.mesh}, "
                  f"layout {args.layout or 'seed'}, remat {'on' if remat else 'off'}")
            report, _ = aot.compile_train_step(
                m, params, topology=topology, mesh_spec=args.mesh, lora_rank=args.lora_rank,
                layout=args.layout, batch_size=args.batch_size,
                sequence_length=args.sequence_length)
            print(report.table())
            name = (f"memory_{preset}_{'lora' if args.lora_rank else 'full'}"
                    + ("_remat" if remat else ""))
            hbm = f"{report.hbm / aot.GiB:.2f}" if report.hbm else "nan"
            lines.append(f"BENCH {name} total_gib={report.total / aot.GiB:.3f} hbm_gib={hbm} "
                         f"fits={int(report.fits)} topology={topology} "
                         f"temp_gib={report.temporaries / aot.GiB:.3f} "
                         f"all_reduce={report.collectives.get('all-reduce', 0)} "
                         f"all_gather={report.collectives.get('all-gather', 0)} "
                         f"compile_s={report.compile_s:.0f}")
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
