"""Compile time of the training step vs depth: a 28-layer config against a 7-layer one.

    python bench/compile_time.py [--layers=7,28] [--lora_rank=4]

The bench config of the performance issue (vocab 32000, hidden 512, 8 query heads / 1 KV head,
head_dim 64, FFN width 2048, float32, batch 8 x 256) at two depths. The step is the one
`train.py` runs (`jaxlm.train.aot.compile_train_step`: LoRA merged inside jit, the layout
rules, AdamW), lowered on abstract inputs for this host's single CPU device, so nothing is
allocated; the time is trace + lower + XLA compile in CPU seconds of this process (wall
time on a shared host measures the neighbours), the best of `--repeats` fresh compiles,
after a 1-layer warm-up compile.

Ends with
    BENCH compile_28_vs_7 l7=<s> l28=<s> ratio=<l28/l7> unit=cpu_s goal=2.0
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One CPU device, as above, even where XLA_FLAGS simulates several (the test suite does): the
# step is compiled for a 1x1 mesh, which must span every device.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxlm.machine import with_host_devices  # noqa: E402

os.environ["XLA_FLAGS"] = with_host_devices(os.environ.get("XLA_FLAGS", ""), None)

import jax  # noqa: E402

import jaxlm  # noqa: E402
from jaxlm.train import aot  # noqa: E402
from models.gemma import Gemma, GemmaConfig  # noqa: E402


def compile_seconds(layers: int, lora_rank: int, remat: bool) -> tuple[float, float]:
    """-> (CPU seconds of this process, wall seconds); CPU time is robust to a busy host."""
    cfg = GemmaConfig(vocab_size=32000, num_layers=layers, num_heads=8, num_kv_heads=1,
                      hidden_dim=512, ffw_dim=2048, head_dim=64, remat=remat)
    model = Gemma(cfg)
    params = jaxlm.tree.unflatten(jaxlm.loading.abstract_params(model, cfg))
    jax.clear_caches()
    t0, c0 = time.perf_counter(), time.process_time()
    aot.compile_train_step(model, params, topology="cpu", mesh_spec="1x1", lora_rank=lora_rank,
                           batch_size=8, sequence_length=256)
    return time.process_time() - c0, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="7,28")
    p.add_argument("--lora_rank", type=int, default=4)
    p.add_argument("--remat", action="store_true")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    small, big = (int(x) for x in args.layers.split(","))
    compile_seconds(1, args.lora_rank, args.remat)  # warm-up: first-use costs of jax/optax/XLA
    times = {}
    for n in (small, big):
        times[n], wall = min(compile_seconds(n, args.lora_rank, args.remat)
                             for _ in range(args.repeats))
        print(f"{n:>3} layers: {times[n]:.1f} CPU s ({wall:.1f} s wall) to trace, lower and "
              "compile the train step")
    print(f"load: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    print(f"BENCH compile_{big}_vs_{small} l{small}={times[small]:.1f} l{big}={times[big]:.1f} "
          f"ratio={times[big] / times[small]:.2f} unit=cpu_s goal=2.0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
