"""Greedy generation: jaxlm vs KerasHub `GemmaCausalLM.generate` on the same random weights.

    python bench/generate.py [--batch=4] [--max_length=128] [--repeats=3]

The bench config of the performance issue (vocab 32000, 6 layers, hidden 512, 8 query heads /
1 KV head, head_dim 64, FFN width 2048 = KerasHub intermediate_dim 4096, float32), one CPU
device. A KerasHub GemmaCausalLM is built with random weights and a sentencepiece tokenizer
(trained on pydoc_data, padded with never-encoded pieces up to the vocab size), saved with
`save_to_preset`, and the same preset is loaded by jaxlm. Both generate the same prompts
greedily without early stopping, measured in this run after a warm-up.

Decoding a small model is bound by reading every weight once per step, so the script also
times one streaming read of the weights, interleaved with the generate calls, and reports each
decode step as a multiple of it. The read is the faster of a jitted max over the parameter tree
in place and over the same bytes as one flat array: XLA:CPU reads one large array up to 45%
faster than a tree of 60, and a slow read would flatter the ratio (a max rather than a sum:
XLA's in-order float sum reads ~8% slower). The step time is the slope between two max_lengths
(so prefill and call overhead cancel out). It also times every weight matrix once through a
batch-wide product (each kernel as stored, flattened to [rows, last] @ [last, B], all in one
call): about the best a step made of XLA's matmuls can do, since on CPU a skinny matmul streams
its weights slower than a plain read.

Ends with
    BENCH generate_b4 jaxlm=<tok/s> keras=<tok/s> ratio=<x> unit=new_tokens/s
    BENCH decode_step_vs_weight_read jaxlm=<ms> keras=<ms> ratio=<jaxlm/keras> unit=ms ...
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxlm  # noqa: E402
from jaxlm.tokenizer import Tokenizer, default_tokenizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import allocator_line, host_line, timed  # noqa: E402

PROMPTS = ["The quick brown fox jumps over the lazy dog",
           "Return the value of the named attribute of object",
           "import os",
           "A class is a user-defined type whose instances are created by calling it"]


def padded_tokenizer(vocab_size: int) -> Tokenizer:
    """The pydoc tokenizer (4096 pieces: the corpus supports no more) padded to `vocab_size`
    with pieces that never win an encoding (score -1e9), so the model has the real vocab."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    proto = pb.ModelProto()
    proto.ParseFromString(default_tokenizer(min(vocab_size, 4096)).proto)
    for i in range(vocab_size - len(proto.pieces)):
        piece = proto.pieces.add()
        piece.piece, piece.score = f"<unused{i}>", -1e9
        piece.type = pb.ModelProto.SentencePiece.NORMAL
    return Tokenizer(proto.SerializeToString())


def build_preset(out_dir: str, tok: Tokenizer, args) -> None:
    import keras
    import keras_hub
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tok.vocab_size, num_layers=args.layers, num_query_heads=8,
        num_key_value_heads=1, hidden_dim=512, intermediate_dim=4096, head_dim=64,
        dtype="float32")
    tokenizer = keras_hub.models.GemmaTokenizer(proto=tok.proto)
    pre = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=args.max_length)
    keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=pre).save_to_preset(out_dir)


def weight_readers(params) -> dict:
    """Two streaming reads of every parameter's bytes (see the module docstring): a jitted max
    over the tree in place, and over a flat copy (one array per dtype)."""
    read = jax.jit(lambda xs: jnp.stack([jnp.max(x).astype(jnp.float32) for x in xs]).max())
    leaves = jax.tree.leaves(params)
    dtypes = sorted({x.dtype.name for x in leaves})
    flat = [jnp.concatenate([x.reshape(-1) for x in leaves if x.dtype.name == d]) for d in dtypes]
    out = {}
    for name, xs in (("tree", leaves), ("flat", flat)):
        read(xs).block_until_ready()
        out[name] = lambda xs=xs: read(xs).block_until_ready()
    return out


def matmul_streamer(params, batch: int):
    """Every weight matrix once through a product with `batch` columns, all in one jitted call
    (see the module docstring)."""
    mats = [x.reshape(-1, x.shape[-1]) for x in jax.tree.leaves(params) if x.ndim >= 2]
    cols = {m.shape[1]: jnp.ones((m.shape[1], batch), m.dtype) for m in mats}
    stream = jax.jit(lambda ms: sum(jnp.sum(m @ cols[m.shape[1]], dtype=jnp.float32) for m in ms))
    stream(mats).block_until_ready()
    return lambda: stream(mats).block_until_ready()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--short_length", type=int, default=40,
                        help="second max_length for the per-step slope")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    import keras_hub

    tok = padded_tokenizer(args.vocab)
    prompts = (PROMPTS * args.batch)[:args.batch]
    with tempfile.TemporaryDirectory() as preset:
        build_preset(preset, tok, args)
        causal = keras_hub.models.GemmaCausalLM.from_preset(preset)
        model, params = jaxlm.load(preset)
    lengths = [len(tok.encode(p)) for p in prompts]
    print(f"config: {model.config}")
    print(f"batch {args.batch}, prompt lengths {lengths}, max_length {args.max_length}, "
          f"{jax.device_count()} device(s) {jax.devices()[0].platform}")
    print(allocator_line())
    print(host_line())

    def ours(n):
        return jaxlm.generate(model, params, tok, prompts, max_length=n, stop_token_ids=None)

    def theirs(n):
        return list(causal.generate(prompts, max_length=n, stop_token_ids=None))

    calls = {"jaxlm": ours, "keras": theirs}
    sizes = (args.short_length, args.max_length)
    for fn in calls.values():  # warm-up: compile both shapes
        for n in sizes:
            fn(n)
    readers = weight_readers(params)
    stream = matmul_streamer(params, args.batch)
    # Interleaved, weight reads included, so a burst of load or a dip in memory bandwidth on
    # the shared machine hits every side alike; the fastest of the repeats is the least disturbed.
    samples = {name: {n: [] for n in sizes} for name in calls}
    reads, streams = {name: [] for name in readers}, []
    for _ in range(args.repeats):
        for name, fn in calls.items():
            for n in sizes:
                samples[name][n].extend(timed(lambda: fn(n), 1))
            for kind, read in readers.items():
                reads[kind].append(min(timed(read, 4)))
            streams.append(min(timed(stream, 4)))
    timings = {name: {n: min(ts) for n, ts in by_n.items()} for name, by_n in samples.items()}
    same = ours(args.max_length) == theirs(args.max_length)

    new_tokens = sum(args.max_length - n for n in lengths)
    steps = args.max_length - args.short_length
    tok_s = {k: new_tokens / t[args.max_length] for k, t in timings.items()}
    step_ms = {k: 1e3 * (t[args.max_length] - t[args.short_length]) / steps
               for k, t in timings.items()}
    read_by = {name: 1e3 * min(ts) for name, ts in reads.items()}
    read_ms, stream_ms = min(read_by.values()), 1e3 * min(streams)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"identical strings: {same}")
    print(f"weights: {nbytes / 2**20:.1f} MiB, one read {read_ms:.2f} ms "
          f"({nbytes / read_ms / 1e6:.1f} GB/s; tree in place {read_by['tree']:.2f} ms, "
          f"flat {read_by['flat']:.2f} ms); through batch-{args.batch} matmuls "
          f"{stream_ms:.2f} ms ({nbytes / stream_ms / 1e6:.1f} GB/s)")
    for k in timings:
        print(f"{k}: {tok_s[k]:.1f} new tok/s (batch {args.batch}, "
              f"{timings[k][args.max_length]:.3f} s per call), decode step {step_ms[k]:.2f} ms "
              f"= {step_ms[k] / read_ms:.2f}x weight read, {step_ms[k] / stream_ms:.2f}x matmul stream")
    print(f"BENCH generate_b{args.batch} jaxlm={tok_s['jaxlm']:.1f} keras={tok_s['keras']:.1f} "
          f"ratio={tok_s['jaxlm'] / tok_s['keras']:.2f} unit=new_tokens/s")
    print(f"BENCH decode_step_vs_weight_read jaxlm={step_ms['jaxlm']:.2f} "
          f"keras={step_ms['keras']:.2f} ratio={step_ms['jaxlm'] / step_ms['keras']:.2f} "
          f"unit=ms weight_read_ms={read_ms:.2f} "
          f"jaxlm_x_read={step_ms['jaxlm'] / read_ms:.2f} keras_x_read={step_ms['keras'] / read_ms:.2f} "
          f"matmul_stream_ms={stream_ms:.2f} jaxlm_x_stream={step_ms['jaxlm'] / stream_ms:.2f}")


if __name__ == "__main__":
    main()
