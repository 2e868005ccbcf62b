"""What the bench scripts share: model FLOPs, chip peaks, a measured matmul peak, timing."""
from __future__ import annotations

import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from models import cpu_forms

# Dense bf16 spec peaks per JAX device (FLOP/s, HBM bytes/s), from the published TPU and NVIDIA datasheet figures).
# On v2/v3 a JAX device is one core (half a chip); v4/v5p use megacore (a device is a chip).
PEAKS = {
    "TPU v2": (2.25e13, 3.5e11), "TPU v3": (7.0e13, 4.5e11), "TPU v4": (2.75e14, 1.2e12),
    "TPU v5 lite": (1.97e14, 8.1e11), "TPU v5e": (1.97e14, 8.1e11), "TPU v5p": (4.59e14, 2.8e12),
    "TPU v5": (4.59e14, 2.8e12), "TPU v6 lite": (9.2e14, 1.6e12), "TPU v6e": (9.2e14, 1.6e12),
    "H100": (9.9e14, 3.35e12), "H200": (9.9e14, 4.8e12), "A100": (3.12e14, 2.0e12),
}


def chip_peak(device) -> tuple[float, float] | None:
    """(bf16 FLOP/s, HBM bytes/s) of a device from its `device_kind`, or None if unknown."""
    kind = device.device_kind
    for name in sorted(PEAKS, key=len, reverse=True):  # "TPU v5 lite" before "TPU v5"
        if name.lower() in kind.lower():
            return PEAKS[name]
    return None


def model_flops_per_token(cfg, seq_len: int, lora_rank: int) -> float:
    """The usual MFU count; embedding lookups, norms and the optimizer are not counted.

    N = matmul parameters including the tied output projection:
      full: 6N + 12 L T Nq D  (forward 2N, backward 4N; attention scores and values)
      LoRA: 4N +  8 L T Nq D  (no weight gradients for the frozen base)
    """
    n = cfg.num_params - cfg.hidden_dim * (1 + 2 * cfg.num_layers)  # drop norm scales
    attn = cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
    return 4 * n + 8 * attn if lora_rank else 6 * n + 12 * attn


def matmul_peak(sizes=(1024, 2048, 4096), repeats: int = 5, dtype=jnp.float32) -> float:
    """Best FLOP/s of jitted [n, n] @ [n, n] over `sizes` on the default device. Several sizes,
    because the fastest differs by machine: on the 2-core CPU n = 1024-2048 runs ~15% faster
    than 4096 (which alone would flatter every fraction of peak). A float32 result: XLA:CPU's
    fast bfloat16 form (see models/cpu_forms.py)."""
    f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    best = 0.0
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), dtype)
        f(a, b).block_until_ready()
        seconds = min(timed(lambda: f(a, b).block_until_ready(), repeats))
        best = max(best, 2 * n ** 3 / seconds)
    return best


def peak_after(peak: float, **kw) -> float:
    """`matmul_peak(**kw)` measured again after a bench's steps -> the higher of it and `peak`
    (both printed): a shared host's speed drifts, and a peak caught on a slow spell flatters
    every fraction of it (bfloat16 760 vs 1344 GFLOP/s in two runs an hour apart on one 2-core
    Xeon)."""
    again = matmul_peak(**kw)
    dtype = jnp.dtype(kw.get("dtype", jnp.float32)).name
    print(f"measured {dtype} matmul peak after the steps: {again / 1e9:.1f} GFLOP/s "
          f"(MFU over {max(peak, again) / 1e9:.1f})")
    return max(peak, again)


def timed(fn, n: int) -> list[float]:
    """Seconds of each of `n` calls of `fn()` (fn must block until its work is done)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs) -> float:
    return statistics.median(xs)


def allocator_line() -> str:
    """Which malloc settings this run has: on CPU, huge pages change step times by up to ~15%
    (bench/README.md, "Page faults")."""
    return f"allocator: GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset: glibc defaults)')}"


def host_line() -> str:
    """Which CPU ran the bench. The ratios depend on it: the same commit gave different LoRA
    ratios on two 2-core hosts (bench/README.md, "a second 2-core host")."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    family = f" (family {info['cpu family']} model {info['model']})" if "cpu family" in info else ""
    avx512 = " avx512" if "avx512f" in info.get("flags", "").split() else ""
    amx = " amx_bf16" if cpu_forms.amx() else ""  # the decoder's bfloat16 products follow it
    return f"host: {name}{family}{avx512}{amx}, {os.cpu_count()} cores"


def versions_line() -> str:
    """Which releases of the libraries the frameworks run on: the peers' speed moves with them
    (HF transformers' bfloat16 steps, bench/README.md "a fifth session")."""
    from importlib import metadata
    found = []
    for name in ("jax", "jaxlib", "torch", "transformers", "peft", "keras", "keras-hub"):
        try:
            found.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return "versions: " + " ".join(found)
