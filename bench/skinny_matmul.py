"""Why a batch-4 decode step cannot reach one weight read on CPU: XLA's skinny products.

    python bench/skinny_matmul.py [--rows=32000] [--cols=512] [--columns=1,2,4,8] [--cores=N]

A decode step at batch B multiplies every weight matrix by B columns. If the product kept pace
with memory it would take as long as one read of the matrix, whatever B is (B FMAs per weight
loaded is far below a core's compute). This script times, on the bench config's largest matrix
(the tied [32000, 512] float32 vocabulary table, 65.5 MB): one read (a jitted max over it),
then `W @ x.T` for each column count, each as a multiple of the read and in GFLOP/s, and the
same products in NumPy (its BLAS) for comparison. `--cores=N` pins the process to its first N
CPUs before jax starts (XLA sizes its thread pool from the affinity mask), so the per-core
numbers show whether the product is bound by memory or by the kernel: with one core a read
loses little speed, the product much more.

`bench/generate.py` streams all the weights this way ("through batch-4 matmuls"), and the decode
step can only approach that, not the read (bench/README.md, the decode section).

Ends with
    BENCH skinny_matmul read_ms=<ms> c<k>_ms=<ms> c<k>_x_read=<x> numpy_c<k>_ms=<ms>... cores=<n> unit=ms
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32000)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--columns", default="1,2,4,8", help="batch sizes, comma separated")
    parser.add_argument("--cores", type=int, default=0, help="pin to the first N CPUs (0: all)")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds; the best round's median is kept")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.cores:
        cpus = sorted(os.sched_getaffinity(0))
        if not 0 < args.cores <= len(cpus):
            print(f"error: --cores={args.cores}, but this process may use {len(cpus)} CPU(s); "
                  f"pass 1 to {len(cpus)}", file=sys.stderr)
            sys.exit(2)
        os.sched_setaffinity(0, cpus[:args.cores])  # before jax: XLA reads it for its threads
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    import jax
    import jax.numpy as jnp
    import numpy as np
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.common import allocator_line, host_line, median, timed

    columns = [int(c) for c in args.columns.split(",")]
    w = jax.random.normal(jax.random.key(0), (args.rows, args.cols), jnp.float32)
    xs = {b: jax.random.normal(jax.random.key(b), (b, args.cols), jnp.float32) for b in columns}
    read = jax.jit(jnp.max)
    product = jax.jit(lambda w, x: w @ x.T)  # the decode step's `rows @ x^T` form
    calls = {"read": lambda: read(w).block_until_ready()}
    w_np = np.asarray(w)
    for b in columns:
        calls[b] = lambda x=xs[b]: product(w, x).block_until_ready()
        calls["numpy", b] = lambda x=np.asarray(xs[b]): w_np @ x.T
    best = {}
    for _ in range(args.rounds):  # interleaved, so a slow minute hits every variant alike
        for name, call in calls.items():
            call()
            best[name] = min(best.get(name, float("inf")), median(timed(call, args.repeats)))

    nbytes = w.size * w.dtype.itemsize
    cores = len(os.sched_getaffinity(0))
    print(f"matrix [{args.rows}, {args.cols}] float32, {nbytes / 2**20:.1f} MiB; "
          f"{cores} core(s) ({jax.devices()[0].platform})")
    print(allocator_line())
    print(host_line())
    print(f"one read: {best['read'] * 1e3:.2f} ms ({nbytes / best['read'] / 1e9:.1f} GB/s)")
    fields = [f"read_ms={best['read'] * 1e3:.3f}"]
    for b in columns:
        t, flop = best[b], 2 * w.size * b
        print(f"W @ x.T, {b} column(s): {t * 1e3:.2f} ms = {t / best['read']:.2f}x the read, "
              f"{flop / t / 1e9:.1f} GFLOP/s ({flop / t / cores / 1e9:.1f} per core); at the read's "
              f"speed it would need {flop / best['read'] / 1e9:.1f}; NumPy "
              f"{best['numpy', b] * 1e3:.2f} ms")
        fields += [f"c{b}_ms={t * 1e3:.3f}", f"c{b}_x_read={t / best['read']:.2f}",
                   f"numpy_c{b}_ms={best['numpy', b] * 1e3:.3f}"]
    print("BENCH skinny_matmul " + " ".join(fields) + f" cores={cores} unit=ms")


if __name__ == "__main__":
    main()
