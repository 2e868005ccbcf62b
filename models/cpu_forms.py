"""How an array or a product must be written for XLA:CPU to run it fast in a narrow dtype.

XLA:CPU multiplies bfloat16 fast in one form only: row-major operands, a float32 result
(`product`, `batched_product`). Given anything else (a transposed operand, a bfloat16 result)
it widens the operands to float32 first, and multiplies at float32's speed. XLA is free to
give a transposed array a transposed layout rather than move its elements, so the operands
are written out row-major behind a barrier (`transposed`, `row_major`). It also has no
bfloat16 dynamic slice or update, and widens the whole array for one: narrow data moves as
same-width unsigned integers (`bits_type`, `bits_slice`, `loop_slice`, `bits_take`).

How fast that form runs a product of a few rows depends on the CPU (`amx`). So does the form
itself: without AMX, XLA:CPU multiplies a narrow [N, K] @ [M, K]^T with the second operand in
place as fast, so a weight needs no transposed copy there (`times_t`).

The kernels in models/kernels.py and models/decode_kernels.py and the loss
(jaxlm/train/loss.py) are written with these; the tests there check that their compiled
products keep the form.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


def product(a, b):
    """a @ b in a's dtype, with a float32 result first where the operands are narrow (given
    row-major operands: `row_major_t`)."""
    if jnp.dtype(a.dtype) == jnp.float32:
        return a @ b
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def batched_product(a, b):
    """a [B, K, N, C] @ b [B, K, C, M] -> float32 [B, K, N, M]."""
    return jax.lax.dot_general(a, b, (((3,), (2,)), ((0, 1), (0, 1))),
                               preferred_element_type=jnp.float32)


def row_major_t(x):
    """x [..., M, N] -> [..., N, M]: written out row-major where x is narrow (`transposed`),
    left to XLA in float32."""
    return jnp.swapaxes(x, -1, -2) if jnp.dtype(x.dtype) == jnp.float32 else transposed(x)


def transposed(x):
    """x [..., M, N] -> [..., N, M], written out row-major.

    The barrier holds it as [..., N / k, k, M] (k = gcd(N, 64)), which XLA:CPU writes with its
    transposing copy. Flattened instead (`row_major`), the transpose fused with the reshapes
    into a loop that ran 2.4x slower: the 270M's [262144, 640] table 282 -> 118 ms, a
    [640, 2048] kernel 2.25 -> 0.33 ms (bfloat16, measured ad hoc).
    """
    *lead, m, n = x.shape
    k = math.gcd(n, 64)
    split = jnp.moveaxis(x.reshape(*lead, m, n // k, k), -3, -1)  # [..., N / k, k, M]
    return jax.lax.optimization_barrier(split).reshape(*lead, n, m)


def times_t(a, b):
    """a [N, K] @ b [M, K]^T -> float32 [N, M] for a b that is not to be copied (a weight).

    Without AMX (AVX512-BF16 at most) XLA:CPU multiplies narrow operands fast with b
    transposed too, in place: the Gemma 2B table's [2048, 2048] slice against 256 tokens took
    5.9 ms so against 7.7 ms with the slice written out transposed first (`transposed`), the
    Gemma 3 270M's [2048, 640] against 1024 tokens 6.6 against 7.0 ms (a 2-core AMD EPYC, ad
    hoc, bench/README.md). With AMX that form was measured slower: b is written out first."""
    if jnp.dtype(b.dtype) != jnp.float32 and amx():
        return jnp.dot(a, transposed(b), preferred_element_type=jnp.float32)
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def row_major(x):
    """x, held in memory row-major. XLA:CPU multiplies an operand in any layout but row-major
    in float32; a reshape to one row per leading index behind a barrier leaves it only the
    row-major layout."""
    return jax.lax.optimization_barrier(x.reshape(*x.shape[:-2], -1)).reshape(x.shape)


@functools.cache
def amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU has AMX for bfloat16 (`amx_bf16` in Linux's `cpuinfo`).

    With it, XLA:CPU's fast form multiplies a few rows by a large bfloat16 matrix as fast as
    the matrix can be read; without it (AVX512-BF16 at most) that product is compute-bound.
    The real Gemma 3 270M's bfloat16 tied table [262144, 640] times 2 rows: ~13 ms on a 2-core
    AMX Xeon, ~28 ms on a 2-core AMD EPYC (one loop that reads each row: 18 ms and 12.5 ms),
    measured ad hoc. The decoder chooses its products by it (models/decode_kernels.py)."""
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False


def bits_type(dtype):
    """The unsigned integer type as wide as `dtype`, in which narrow data is sliced and
    updated."""
    return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def bits_slice(w, i, size: int, axis: int):
    """Slice i (`size` long on `axis`) of w, inside a loop over the slices.

    It is cut from w's bits, as XLA:CPU would widen the whole of w to float32 for the slice
    (then hoist that copy out of the loop and keep it). The barrier makes w depend on the loop
    index, so the bitcast is not hoisted either (that would copy all of w); fused with the
    slice, it reads one slice.
    """
    w, i = jax.lax.optimization_barrier((w, i))
    bits = jax.lax.bitcast_convert_type(w, bits_type(w.dtype))
    part = jax.lax.dynamic_slice_in_dim(bits, i * size, size, axis)
    return jax.lax.bitcast_convert_type(part, w.dtype)


def loop_slice(w, i, size: int, axis: int):
    """Slice i of w inside a loop over the slices: cut from its bits where w is narrow
    (`bits_slice`), a plain dynamic slice of a float32 w (which XLA:CPU slices as it is)."""
    if jnp.dtype(w.dtype).itemsize < 4:
        return bits_slice(w, i, size, axis)
    return jax.lax.dynamic_slice_in_dim(w, i * size, size, axis)


def bits_take(table, ids):
    """table [V, ...][ids] -> [*ids.shape, ...], gathered as bits: XLA:CPU would widen the
    whole narrow table to float32 for the gather. The barrier makes the table depend on the
    ids, so inside a loop neither that copy nor the bitcast is hoisted out of it (and kept);
    fused with the gather, the bitcast reads the rows gathered. An id outside [0, V) gives
    NaN, as `jnp.take`."""
    table, ids = jax.lax.optimization_barrier((table, ids))
    bits = jax.lax.bitcast_convert_type(table, bits_type(table.dtype))
    nan = int(np.array(np.nan, table.dtype).view(bits.dtype))
    rows = jnp.take(bits, ids, axis=0, mode="fill", fill_value=nan)
    return jax.lax.bitcast_convert_type(rows, table.dtype)
