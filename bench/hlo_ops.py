"""The compiled programs of the bench config, as text to diff between commits.

    python bench/hlo_ops.py --out=DIR     # then: diff -r DIR_before DIR_after

Compiles (abstract inputs, nothing allocated, one CPU device) the bench config's full and LoRA
train steps at batch 8 x 256 (bench/train_step.py's) and its greedy decode loop at batch 1
and 4 (bench/generate.py's, prompt bucket 16, total 128), and writes each optimised HLO module
with metadata, source tables and instruction names stripped, so two commits that compile to
the same program give the same file. Timing on a shared machine is noise; this is how a
refactor shows it left the CPU programs alone.

Ends with one line per program:
    BENCH hlo_<train_full|train_lora|decode_b1|decode_b4> dots=<n> fusions=<n> copies=<n> transposes=<n> temp_mib=<x>
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import sharding  # noqa: E402
from jaxlm import decode, lora, sampling  # noqa: E402
from jaxlm.train import optim  # noqa: E402
from jaxlm.train.loss import lm_loss_fn  # noqa: E402
from jaxlm.train.step import make_train_step  # noqa: E402
from jaxlm.train.trainer import init_state  # noqa: E402
from models.gemma import Gemma, GemmaConfig  # noqa: E402

BENCH_CONFIG = GemmaConfig(vocab_size=32000, num_layers=6, num_heads=8, num_kv_heads=1,
                           hidden_dim=512, ffw_dim=2048, head_dim=64, dtype="float32")


def normalize(text: str) -> str:
    """Optimised HLO text without what changes when only source lines or names do."""
    head, _, rest = text.partition("\nFileNames")
    if rest:  # the stack-frame tables, then a blank line before the first computation
        text = head + "\n" + rest[rest.index("\n\n\n%"):]
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"%[\w.\-]+", "%x", text)
    return re.sub(r"\bparam_\d+\.\d+\b", "p", text)


def programs(batch: int = 8, seq: int = 256) -> dict:
    """{name: compiled} for the bench config."""
    model = Gemma(BENCH_CONFIG)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    opt = optim.make_optimizer(optim.OptimConfig())
    tokens = {"token_ids": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32),
              "padding_mask": jax.ShapeDtypeStruct((batch, seq + 1), jnp.bool_)}
    mesh = sharding.make_mesh("1x1", jax.devices()[:1])
    out = {}
    for mode in ("full", "lora"):
        if mode == "lora":
            trainable = jax.eval_shape(lambda k: lora.init(params, 4, key=k), jax.random.key(0))
            frozen, merge = params, lora.merge
        else:
            trainable, frozen, merge = params, None, None
        state = init_state(trainable, opt, mesh, abstract=True)
        state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), state)
        step = make_train_step(lm_loss_fn(model), opt, merge=merge)
        out[f"train_{mode}"] = step.lower(state, frozen, tokens).compile()
    for b in (1, 4):
        fn = decode._compiled(model, sampling.resolve("greedy"), b, 16, 128, False, None)
        sds = jax.ShapeDtypeStruct
        out[f"decode_b{b}"] = fn.lower(params, sds((b, 16), jnp.int32), sds((b,), jnp.int32),
                                       sds((), jnp.int32), sds((), jnp.int32),
                                       sds((decode._STOP_SLOTS,), jnp.int32)).compile()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="folder for the normalised HLO texts")
    args = p.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    lines = []
    for name, compiled in programs().items():
        text = normalize(compiled.as_text())
        ops = collections.Counter(re.findall(r" = (?:\([^=]*\)|\S+) ([a-z][a-z0-9\-]*)\(", text))
        temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
        if args.out:
            with open(os.path.join(args.out, f"{name}.hlo.txt"), "w") as f:
                f.write(text)
        lines.append(f"BENCH hlo_{name} dots={ops['dot']} fusions={ops['fusion']} copies={ops['copy']} "
                     f"transposes={ops['transpose']} temp_mib={temp:.1f}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
