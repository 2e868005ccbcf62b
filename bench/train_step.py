"""One training step, jaxlm vs KerasHub `GemmaCausalLM.fit`, LoRA (rank 4) and full fine-tuning.

    python bench/train_step.py [--steps=5] [--warmup=2] [--rounds=2] [--layers=6] [--skip_keras]

The bench config of the performance issue: vocab 32000, 6 layers, hidden 512, 8 query heads /
1 KV head, head_dim 64, FFN width 2048 (KerasHub intermediate_dim 4096), batch 8 x 256 tokens,
float32, ONE CPU device (no simulated mesh). A random KerasHub GemmaBackbone is saved with
`save_to_preset` and jaxlm loads that preset, so both train the same weights on the same
batch with the same optimizer (AdamW 5e-5, weight decay 0.01 off for norm scales, global-norm
clipping 1.0) and the same metrics (loss + weighted token accuracy). Each step is synced
(`block_until_ready` / the Keras logs). After `--warmup` steps each, the two take turns:
`--steps` steps of jaxlm, then `--steps` of KerasHub (one more `fit` on the compiled model),
`--rounds` times (each turn's first step, a switch, is not counted), and the median over all
of a framework's timed steps is reported. The host is shared and its load drifts over a run's
minutes; taking turns puts that drift on both sides. The per-round medians and the load
average are printed with the numbers.

Model FLOPs (the usual MFU convention; embedding lookups, norms and the optimizer not
counted), per token, N = matmul parameters incl. the tied output projection, L layers, T
tokens per sequence, q heads x head_dim = Nq*D:
    full: 6N + 12 L T Nq D   (forward 2N, backward 4N; attention scores and values)
    LoRA: 4N +  8 L T Nq D   (no weight gradients for the frozen base)
The machine's peak is measured here: the best of jitted float32 [n, n] matmuls, n = 1024, 2048, 4096
(`bench.common.matmul_peak`), before and after the steps; the MFU lines are over the higher.

Ends with
    BENCH train_lora jaxlm=<tok/s> keras=<tok/s> ratio=<x> unit=tokens/s
    BENCH train_full jaxlm=<tok/s> keras=<tok/s> ratio=<x> unit=tokens/s
    BENCH train_mfu_cpu jaxlm=<full fraction> lora=<fraction> keras_full=<fraction> peak_gflops=<x>
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxlm  # noqa: E402
from jaxlm import lora  # noqa: E402
from jaxlm.train import optim  # noqa: E402
from jaxlm.train.loss import lm_loss_fn  # noqa: E402
from jaxlm.train.step import make_train_step  # noqa: E402
from jaxlm.train.trainer import init_state  # noqa: E402
from bench.common import allocator_line, host_line, matmul_peak, model_flops_per_token, peak_after, timed  # noqa: E402


def build_keras(args, preset_dir: str):
    import keras
    import keras_hub
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=args.vocab, num_layers=args.layers, num_query_heads=8,
        num_key_value_heads=1, hidden_dim=512, intermediate_dim=4096, head_dim=64,
        dtype="float32")
    backbone.save_to_preset(preset_dir)
    return backbone


def keras_runner(backbone, batch, batch_size: int, lora_rank: int, task: str = "GemmaCausalLM"):
    """-> run(n): seconds per synced `fit` step for n more steps of the same compiled model
    (`keras_hub.models.<task>` on `backbone`, LoRA enabled on it first when lora_rank > 0)."""
    import keras
    import keras_hub
    if lora_rank:
        backbone.enable_lora(lora_rank)
    lm = getattr(keras_hub.models, task)(backbone=backbone, preprocessor=None)
    opt = keras.optimizers.AdamW(learning_rate=5e-5, weight_decay=0.01, global_clipnorm=1.0)
    opt.exclude_from_weight_decay(var_names=["bias", "scale"])
    lm.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               weighted_metrics=["accuracy"])

    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            jax.block_until_ready(logs)
            times.append(time.perf_counter() - self.t0)

    ids, mask = batch["token_ids"], batch["padding_mask"]

    def run(n: int) -> list[float]:
        del times[:]
        x = {"token_ids": np.tile(ids[:, :-1], (n, 1)), "padding_mask": np.tile(mask[:, :-1], (n, 1))}
        lm.fit(x, np.tile(ids[:, 1:], (n, 1)),
               sample_weight=np.tile(mask[:, 1:], (n, 1)).astype("float32"),
               batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
        return list(times)
    return run


def jaxlm_runner(model, params, batch, lora_rank: int, train_layout=None):
    """-> run(n): seconds per synced step for n more steps of the same jitted step.
    train_layout: under LoRA, the trainer's (`jaxlm.train.trainer.train_layout_of`)."""
    step, state, frozen, device_batch = jaxlm_step(model, params, batch, lora_rank, train_layout)

    def one():
        nonlocal state
        state, metrics = step(state, frozen, device_batch)
        jax.block_until_ready((state, metrics))
    return lambda n: timed(one, n)


def jaxlm_step(model, params, batch, lora_rank: int, train_layout=None):
    """-> (jitted step, state, frozen, device batch) of `jaxlm_runner`: AdamW, LoRA factors
    of `lora_rank` (or every weight trained at 0)."""
    optimizer = optim.make_optimizer(optim.OptimConfig())
    if lora_rank:
        trainable = lora.init(params, lora_rank, key=jax.random.key(0))
        frozen, merge = params, lora.merge
        if train_layout is not None:
            frozen = (params, train_layout(params))
    else:
        trainable, frozen, merge = params, None, None
    state = init_state(trainable, optimizer)
    del trainable, params
    step = make_train_step(lm_loss_fn(model), optimizer, merge=merge,
                           layout=train_layout is not None and bool(lora_rank))
    return step, state, frozen, jax.device_put(batch)


def interleaved(runners: dict, warmup: int, steps: int, rounds: int) -> dict:
    """{name: run(n)} -> {name: per-round lists of step seconds}: every runner warms up, then
    the runners take turns, `steps` steps each, `rounds` times, so a change in the shared
    host's load over the minutes of a run falls on all of them alike. Each turn runs one step
    more and drops its first: in a new `fit` call KerasHub's first step takes ~0.3 s longer
    (its data feed starting), which a user's single long `fit` pays once."""
    for run in runners.values():
        run(warmup)
    out = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            out[name].append(run(steps + 1)[1:])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2,
                   help="turns of --steps steps each framework takes, alternating")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--skip_keras", action="store_true")
    args = p.parse_args(argv)
    if len(jax.devices()) != 1:
        print(f"note: {len(jax.devices())} devices visible; the bench uses the first only")

    rng = np.random.RandomState(0)
    ids = rng.randint(3, args.vocab, (args.batch, args.seq + 1)).astype("int32")
    ids[:, 0] = 2  # BOS
    batch = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    tokens = args.batch * args.seq

    peak = matmul_peak()
    print(f"measured float32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    results = {}
    with tempfile.TemporaryDirectory() as preset:
        backbone = build_keras(args, preset)
        cfg = jaxlm.load(preset, "float32", abstract=True)[0].config
        for mode, rank in (("full", 0), ("lora", args.rank)):
            runners = {"jaxlm": jaxlm_runner(*jaxlm.load(preset, "float32"), batch, rank)}
            if not args.skip_keras:  # full first: enable_lora is one-way
                runners["keras"] = keras_runner(backbone, batch, args.batch, rank)
            times = interleaved(runners, args.warmup, args.steps, args.rounds)
            print(f"{mode:>4} rounds (median ms/step): " + ", ".join(
                f"{name} " + " ".join(f"{statistics.median(r) * 1e3:.0f}" for r in rounds)
                for name, rounds in times.items()))
            j, k = (statistics.median(sum(times[name], [])) if name in times else None
                    for name in ("jaxlm", "keras"))
            results[mode] = (j, k)
    peak = peak_after(peak)
    for mode, rank in (("full", 0), ("lora", args.rank)):
        (j, k), flops = results[mode], model_flops_per_token(cfg, args.seq, rank) * tokens
        print(f"{mode:>4}: jaxlm {j * 1e3:8.1f} ms/step {tokens / j:8.1f} tok/s "
              f"{flops / j / 1e9:6.1f} GFLOP/s ({flops / j / peak:.0%} of peak)"
              + ("" if k is None else f" | keras {k * 1e3:8.1f} ms/step {tokens / k:8.1f} tok/s "
                 f"({flops / k / peak:.0%}) | ratio {k / j:.2f}x"))
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} (1, 5 min) on {os.cpu_count()} cores")
    print(allocator_line())
    print(host_line())
    for mode in ("lora", "full"):
        j, k = results[mode]
        keras_part = "keras=nan ratio=nan" if k is None else f"keras={tokens / k:.1f} ratio={k / j:.2f}"
        print(f"BENCH train_{mode} jaxlm={tokens / j:.1f} {keras_part} unit=tokens/s")
    mfu = lambda mode, t, r: model_flops_per_token(cfg, args.seq, r) * tokens / t / peak  # noqa: E731
    kf = results["full"][1]
    print(f"BENCH train_mfu_cpu jaxlm={mfu('full', results['full'][0], 0):.3f} "
          f"lora={mfu('lora', results['lora'][0], args.rank):.3f} "
          f"keras_full={'nan' if kf is None else f'{mfu(None, kf, 0):.3f}'} "
          f"peak_gflops={peak / 1e9:.1f} unit=fraction_of_matmul_peak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
