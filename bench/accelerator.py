"""Gemma 2B on one GPU or TPU host: train-step MFU and greedy decode vs the bandwidth limit.

    python bench/accelerator.py [--mesh=auto] [--batch_size=N] [--remat] [--steps=5]
                                [--attention=xla,cudnn] [--layers=scan,unrolled]
    python bench/accelerator.py --smoke        # tiny config, runs anywhere (CPU) in a minute

Random weights (no download), bfloat16 compute over float32 master weights (train.py's
accelerator policy; the LoRA base frozen in bfloat16), sequence 2048:
  1. full fine-tuning and LoRA (rank 4) steps built by `jaxlm.train.trainer.build`, sharded
     by the layout rules on the host's devices: tokens/s and MFU = model FLOPs (see
     `bench.common.model_flops_per_token`) / (devices x the chip's bf16 peak); once per
     `--attention` kind (`GemmaConfig.attention`: "cudnn" is the fused kernel, NVIDIA only)
     and `--layers` mode (`GemmaConfig.scan_layers`);
  2. greedy decoding (`jaxlm.decode.generate_ids`) on one device at batch 1 and 32: new
     tokens/s, and the fraction of the memory-bandwidth limit, i.e. of
     batch / (bytes read per step / HBM bytes/s) with bytes = all weights + the live KV cache.
     The step time is the slope between two generation lengths in the same compiled bucket
     (the fastest of interleaved calls of each), so prefill and dispatch cancel out.
Peaks come from `bench.common.PEAKS` (spec sheets); an unknown device prints MFU as nan (on
CPU, --smoke uses the measured float32 matmul peak instead). Budget: under 8 minutes.

Ends with
    BENCH accel_train_full tokens_per_s=<x> mfu=<x> device=<kind> devices=<n>
    BENCH accel_train_lora tokens_per_s=<x> mfu=<x> ...
    BENCH accel_train_full_cudnn ..., accel_train_lora_cudnn ...   (with --attention=...,cudnn)
    BENCH accel_train_full_unrolled ...                             (with --layers=...,unrolled)
    BENCH accel_decode_b1 tokens_per_s=<x> bw_fraction=<x> ...
    BENCH accel_decode_b32 tokens_per_s=<x> bw_fraction=<x> ...
"""
from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxlm  # noqa: E402
import sharding  # noqa: E402
from bench.common import chip_peak, matmul_peak, median, model_flops_per_token, timed  # noqa: E402
from jaxlm import decode, precision  # noqa: E402
from jaxlm.train import optim, trainer  # noqa: E402
from jaxlm.train.loss import lm_loss_fn  # noqa: E402


def train_throughput(preset, dtype, mesh, *, lora_rank, batch_size, seq, steps, remat,
                     attention="xla", scan_layers=True, profile_dir=None, seed=0):
    """-> (tokens/s, seconds per step, model config) of a warmed-up, synced train step.

    dtype is the compute dtype; the weights follow train.py's precision policy: float32 master
    weights and moments, and under LoRA a frozen base stored in the compute dtype."""
    policy = precision.resolve(compute_dtype=dtype)
    stored = policy.frozen if lora_rank else policy.param
    model, _ = jaxlm.load(preset, policy.compute, abstract=True, param_dtype=stored)
    rules = sharding.rules_for(model.config)
    model, params = jaxlm.load(preset, policy.compute, param_dtype=stored,
                               placement=sharding.placement(mesh, rules, quiet=True), seed=seed)
    model = type(model)(model.config.replace(remat=remat, attention=attention,
                                             scan_layers=scan_layers))
    optimizer = optim.make_optimizer(optim.OptimConfig())
    built = trainer.build(params, mesh, param_specs=sharding.partition_specs(params, rules, mesh),
                          loss_fn=lm_loss_fn(model), optimizer=optimizer,
                          lora=trainer.LoraSpec(lora_rank) if lora_rank else None,
                          trainable_dtype=policy.param, seed=seed)
    state, frozen, step, batch_shd = built.state, built.frozen, built.step, built.batch_sharding
    params = built = None  # the state owns them (donated to every step)
    rng = np.random.RandomState(seed)
    ids = rng.randint(3, model.config.vocab_size, (batch_size, seq + 1)).astype(np.int32)
    batch = jax.device_put({"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}, batch_shd)

    holder = {"state": state}
    del state

    def one():
        holder["state"], metrics = step(holder["state"], frozen, batch)
        return jax.block_until_ready(metrics)

    t0 = time.perf_counter()
    first = one()  # compile
    # The same weights and batch for every attention kind and layer mode: first losses agree.
    print(f"  compiled + first step in {time.perf_counter() - t0:.1f} s, loss "
          f"{float(first['loss']):.4f}")
    one()
    t = median(timed(one, steps))
    if profile_dir:  # two more steps, traced (perfetto_trace.json.gz under profile_dir)
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            one()
            one()
    holder = frozen = None  # free the model before the next one is built
    gc.collect()
    return batch_size * seq / t, t, model.config


def decode_throughput(preset, dtype, *, batch_size, prompt_len, short, long, repeats, seed=0):
    """-> (new tokens/s per row x rows, seconds per decode step, bytes read per step)."""
    model, params = jaxlm.load(preset, dtype, seed=seed)
    cfg = model.config
    rng = np.random.RandomState(seed)
    prompts = rng.randint(3, cfg.vocab_size, (batch_size, prompt_len)).astype(np.int32)
    lengths = np.full((batch_size,), prompt_len, np.int32)

    def run(max_length):
        return lambda: decode.generate_ids(model, params, prompts, lengths, max_length)

    run(long)()  # compile (both lengths share one bucket, so one compilation)
    # Interleaved, and the fastest of each: on a busy host (CI runs tests in parallel) a median
    # of a few calls of a tiny model let the noise swamp the step's share of the difference.
    times = {short: [], long: []}
    for _ in range(3):  # a slope noise swamped (the longer call no slower): more calls, twice
        for _ in range(repeats):
            for n in times:
                times[n] += timed(run(n), 1)
        t_short, t_long = min(times[short]), min(times[long])
        if t_long > t_short:
            break
    # Still no slope after that: report nan rather than a made-up rate.
    per_step = (t_long - t_short) / (long - short) if t_long > t_short else float("nan")
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    total = decode.bucket(long, decode.MIN_TOTAL_BUCKET)
    kv_bytes = (2 * cfg.num_layers * batch_size * total * cfg.num_kv_heads * cfg.head_dim
                * np.dtype(dtype).itemsize)  # the loop attends over every cache slot
    params = None
    gc.collect()
    return batch_size / per_step, per_step, weights + kv_bytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny config (any machine, CPU included)")
    p.add_argument("--preset", default=None, help="default gemma_2b_en (gemma_tiny with --smoke)")
    p.add_argument("--mesh", default="auto", help="DxM over this host's devices (auto = 1xN)")
    p.add_argument("--batch_size", type=int, default=None, help="global train batch (default: "
                   "2 per device; 2 with --smoke)")
    p.add_argument("--sequence_length", type=int, default=None, help="default 2048 (64 smoke)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--remat", action="store_true", help="recompute block activations")
    p.add_argument("--lora_rank", type=int, default=4)
    p.add_argument("--decode_batches", default="1,32")
    p.add_argument("--profile", default=None, metavar="DIR", help="trace two steps of each "
                   "train run into DIR/<run> (a perfetto trace beside the XLA profile)")
    p.add_argument("--layers", default="scan", help="comma-separated: scan (one lax.scan over "
                   "stacked weights) and/or unrolled (GemmaConfig.scan_layers=False)")
    p.add_argument("--attention", default="xla", help="comma-separated GemmaConfig.attention "
                   "kinds to train with: xla (any platform), cudnn (NVIDIA GPU, fused)")
    args = p.parse_args(argv)

    smoke = args.smoke
    preset = args.preset or ("gemma_tiny" if smoke else "gemma_2b_en")
    dtype = "float32" if smoke and jax.default_backend() == "cpu" else "bfloat16"
    seq = args.sequence_length or (64 if smoke else 2048)
    mesh = sharding.make_mesh(args.mesh)
    n_dev = mesh.size
    batch_size = args.batch_size or (2 if smoke else 2 * n_dev)
    device = jax.devices()[0]
    peak = chip_peak(device)
    if peak is None and device.platform == "cpu":
        peak = (matmul_peak((1024,) if smoke else (1024, 2048, 4096), dtype=dtype), float("nan"))
        print(f"CPU: using the measured {dtype} matmul peak {peak[0] / 1e9:.1f} GFLOP/s; no HBM "
              "bandwidth figure (bw_fraction = nan)")
    flops_peak, hbm_bw = peak if peak else (float("nan"), float("nan"))
    kind = device.device_kind.replace(" ", "_")  # one token in the BENCH lines
    print(f"{preset} {dtype} on {n_dev} x {device.device_kind} (mesh {mesh.shape['batch']}x"
          f"{mesh.shape['model']}), batch {batch_size} x {seq} tokens"
          + (", remat" if args.remat else ""))
    start = time.perf_counter()
    lines, failed = [], []
    for name, rank in (("full", 0), ("lora", args.lora_rank)):
        for attention, layers in itertools.product(args.attention.split(","),
                                                   args.layers.split(",")):
            label = "_".join([name] + [k for k in (attention, layers) if k not in ("xla", "scan")])
            print(f"train {label}:")
            try:
                tps, t, cfg = train_throughput(preset, dtype, mesh, lora_rank=rank,
                                               batch_size=batch_size, seq=seq, steps=args.steps,
                                               remat=args.remat, attention=attention,
                                               scan_layers=layers == "scan",
                                               profile_dir=args.profile and os.path.join(
                                                   args.profile, label))
            except Exception as e:  # noqa: BLE001  one kind failing must not cost the others
                print(f"  FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                failed.append(label)
                gc.collect()
                continue
            mfu = model_flops_per_token(cfg, seq, rank) * tps / (n_dev * flops_peak)
            print(f"  {t * 1e3:.1f} ms/step, {tps:.0f} tokens/s, MFU {mfu:.1%}")
            lines.append(f"BENCH accel_train_{label} tokens_per_s={tps:.1f} mfu={mfu:.3f} "
                         f"device={kind} devices={n_dev} seq={seq} "
                         f"batch={batch_size} remat={int(args.remat)}")
    prompt_len = 16 if smoke else 128
    # Both lengths in one cache bucket (one compilation), as far apart as it allows.
    short, long = (65, 128) if smoke else (320, 512)
    for b in (int(x) for x in args.decode_batches.split(",") if x):
        print(f"decode batch {b}:")
        tps, per_step, read = decode_throughput(preset, dtype, batch_size=b, prompt_len=prompt_len,
                                                short=short, long=long,
                                                repeats=5 if smoke else 3)
        limit = b * hbm_bw / read
        print(f"  {per_step * 1e3:.2f} ms/step, {tps:.0f} new tokens/s; {read / 1e9:.2f} GB read "
              f"per step -> limit {limit:.0f} tokens/s ({tps / limit:.1%})")
        lines.append(f"BENCH accel_decode_b{b} tokens_per_s={tps:.1f} bw_fraction={tps / limit:.3f} "
                     f"device={kind} ms_per_step={per_step * 1e3:.3f}")
    print(f"total {time.perf_counter() - start:.0f} s")
    print("\n".join(lines))
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
