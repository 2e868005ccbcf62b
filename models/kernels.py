"""XLA:CPU's own kernels for parts of the model's math, and the one place that picks them.

models/gemma.py and models/layers.py write every computation once, as the math. A few of them
run markedly faster on XLA:CPU written another way; those versions live here, each with the
bench measurement that justifies it, and each is checked against the plain math in
tests/test_kernels.py. On TPU and GPU the plain math runs.

How the platform is chosen:
  * Training (`gated_ffn`) goes through `by_platform`, i.e. `jax.lax.platform_dependent`: both
    versions are traced and the one for the platform the program is *lowered* for is kept,
    so a step compiled on a CPU host for a TPU slice (`jaxlm.train.aot`) gets the plain math.
  * Decoding (`decode_steps`) needs some kernels in another layout, built once before the
    decode loop: state the decoder owns. `jaxlm.decode` knows the devices it compiles for and
    traces its model calls inside `decode_steps(platform)`, which on CPU swaps the decode
    step's products for the kernels below (a Flax method interceptor: the layers keep their
    plain `__call__`) and elsewhere changes nothing.
"""
from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import flax.linen as nn

from models import layers

# The step layout (below) holds a second, transposed copy of the block kernels while a
# generate call runs; models whose block kernels exceed this decode with their stored layout.
STEP_LAYOUT_MAX_BYTES = 2 << 30


def by_platform(*args, cpu, plain):
    """`cpu(*args)` in a program lowered for CPU, `plain(*args)` for any other platform. The
    CPU version's ops are named `cpu_kernel/<its name>` (in profiles and lowered text)."""
    return jax.lax.platform_dependent(
        *args, cpu=jax.named_scope(f"cpu_kernel/{cpu.__name__}")(cpu), default=plain)


# --- Training: the GeGLU FFN with a written-out backward -------------------------------------

def gated_ffn(x, gate: layers.Einsum, up: layers.Einsum, down: layers.Einsum):
    """Gemma's FFN, down(geglu(gate(x), up(x))): x [B, T, H] -> [B, T, H].

    gate, up: Einsum layers with [H, F] kernels, down: [F, H]. A decode step (T = 1) goes
    through the layers themselves, so `decode_steps` can replace each product; longer inputs
    run `layers.gated_ffn` on the flat tokens, on CPU with `_cpu_gated_ffn`'s backward.
    """
    if x.shape[1] == 1:
        return down("BTF,FH->BTH", layers.geglu(gate("BTH,HF->BTF", x), up("BTH,HF->BTF", x)))
    b, t, h = x.shape
    w_gate, w_up, w_down = gate(None), up(None), down(None)
    flat = x.reshape(b * t, h).astype(w_gate.dtype)
    out = by_platform(flat, w_gate, w_up, w_down, cpu=_cpu_gated_ffn, plain=layers.gated_ffn)
    return out.reshape(b, t, h)


@jax.custom_vjp
def _cpu_gated_ffn(x, w_gate, w_up, w_down):
    """`layers.gated_ffn` (x [N, H]) with its backward written out, for XLA:CPU.

    With autodiff XLA:CPU was free to transpose the [N, F] activation gradients for the
    weight-gradient dots, and it fused those transposes into the elementwise GELU backward,
    which then wrote [F, N] with strided stores: about a fifth of a full fine-tune step on the
    bench config. Justified by `python bench/train_step.py`'s `BENCH train_full` and `BENCH
    train_lora` lines (jaxlm tokens/s: full 465.6 -> 567-582, LoRA 789 -> 823-849 when it
    came in on 2026-11-30; bench/README.md, "CPU, 2 cores"). Here every weight gradient is an
    [H, N] @ [N, F] product, so only [N, H]-sized arrays are ever transposed. When none of the
    three kernels is differentiated (a LoRA step that leaves the FFN frozen) the backward
    computes the input gradient only, as autodiff would.
    """
    return layers.gated_ffn(x, w_gate, w_up, w_down)


def _cpu_gated_ffn_fwd(x, w_gate, w_up, w_down):
    """Arguments are CustomVJPPrimals (symbolic zeros): `.perturbed` says which are trained.
    The residual x is None when no kernel needs a gradient."""
    trained = w_gate.perturbed or w_up.perturbed or w_down.perturbed
    x, w_gate, w_up, w_down = x.value, w_gate.value, w_up.value, w_down.value
    gate, up = x @ w_gate, x @ w_up
    return layers.geglu(gate, up) @ w_down, (x if trained else None, w_gate, w_up, w_down, gate, up)


def _cpu_gated_ffn_bwd(residuals, d_out):
    x, w_gate, w_up, w_down, gate, up = residuals
    a, c = math.sqrt(2.0 / math.pi), 0.044715
    t = jnp.tanh(a * (gate + c * gate ** 3))
    gelu = 0.5 * gate * (1 + t)
    d_gelu = 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * a * (1 + 3 * c * gate * gate)
    d_hidden = d_out @ w_down.T
    d_gate, d_up = d_hidden * up * d_gelu, d_hidden * gelu
    if x is None:
        return d_gate @ w_gate.T + d_up @ w_up.T, None, None, None
    x_t = x.T
    d_w_down = (d_out.T @ (gelu * up)).T
    d_x = d_gate @ w_gate.T + d_up @ w_up.T
    return d_x, x_t @ d_gate, x_t @ d_up, d_w_down


_cpu_gated_ffn.defvjp(_cpu_gated_ffn_fwd, _cpu_gated_ffn_bwd, symbolic_zeros=True)


# --- Decoding: one token per step ------------------------------------------------------------

def decode_steps(platform: str):
    """Context in which the decoder traces its model calls for `platform`'s devices.

    On CPU, every single-token product runs through a decode kernel:
      * with the `step_layout` collection mutable (to build it) or passed in, each Einsum
        multiplies its kernel's step layout, the same weights as an [out, in] row-major
        matrix, as rows @ x^T: XLA:CPU streams that ~15% faster than x @ [in, out], and a
        decode step of a small model is bound by that stream. Transposing costs a full read
        and write of the kernel, so the decoder builds the layout once per call (one step
        with the collection mutable) and passes it to every step (see `step_layout_pays`);
      * without it, the query/key/value projections are dots batched over heads, which read
        the [N, H, D] kernels in place instead of re-transposing them to [H, N*D] on every
        step of the loop (~6-9% of a decode step);
      * the tied embedding's logits are rows @ x^T as well (the table is already [V, H]),
        ~1.5x faster than [B, H] @ [H, V] at batch 4.
    Together with a vectorised argmax and one dot for the attention output these took the
    bench config's decode step from 12.9 to ~8.4 ms: `python bench/generate.py`'s `BENCH
    decode_step_vs_weight_read` line (`jaxlm=` ms per step) and `BENCH generate_b4` (new
    tokens/s), 2026-11-30, bench/README.md. Elsewhere the layers run as written.
    """
    if platform != "cpu":
        return contextlib.nullcontext()
    return nn.intercept_methods(_cpu_decode_step)


def step_layout_pays(platform: str, block_bytes: int) -> bool:
    """Whether the decoder should build the step layout: on CPU, for block kernels of at most
    STEP_LAYOUT_MAX_BYTES (the copy is held while generating)."""
    return platform == "cpu" and block_bytes <= STEP_LAYOUT_MAX_BYTES


_PER_HEAD = "BTH,NHD->BTND"  # the query/key/value projections


def _cpu_decode_step(next_fun, args, kwargs, context):
    """Flax method interceptor: single-token Einsum products and tied logits -> CPU kernels."""
    module = context.module
    if isinstance(module, layers.Einsum) and context.method_name == "__call__":
        bound = {**dict(zip(("eq", "x"), args)), **kwargs}
        eq, x = bound.get("eq"), bound.get("x")
        if x is not None and x.shape[1] == 1 and not module.is_initializing():
            if module.is_mutable_collection("step_layout") or module.has_variable("step_layout", "kernel"):
                return _step_product(module, next_fun(None), eq, x)
            if eq == _PER_HEAD:
                return _per_head(next_fun(None), x)
    if isinstance(module, layers.Embedding) and context.method_name == "attend":
        x = args[0] if args else kwargs["x"]
        if x.shape[1] == 1:
            return matmul_rows(module.embeddings.astype(module.dtype), x[:, 0].astype(module.dtype))[:, None]
    return next_fun(*args, **kwargs)


def _step_product(module: layers.Einsum, kernel, eq: str, x):
    """x [B, 1, *in] -> [B, 1, *out] through the kernel's [out, in] rows (see decode_steps)."""
    x_spec, k_spec = eq.split("->")[0].split(",")
    in_axes = [i for i, c in enumerate(k_spec) if c in x_spec]
    out_axes = [i for i, c in enumerate(k_spec) if c not in x_spec]
    if [k_spec[i] for i in in_axes] != list(x_spec[-len(in_axes):]):
        raise ValueError(f"step layout needs x's contracted axes last, in kernel order: {eq}")
    out_shape = [module.shape[i] for i in out_axes]

    def rows():
        return jnp.transpose(kernel, out_axes + in_axes).reshape(math.prod(out_shape), -1)

    rows = module.variable("step_layout", "kernel", rows).value
    b = x.shape[0]
    y = matmul_rows(rows, x.reshape(b, -1).astype(module.dtype))
    return y.reshape(b, 1, *out_shape)


def _per_head(kernel, x):
    """x [B, 1, H], kernel [N, H, D] -> [B, 1, N, D] as a dot batched over the heads."""
    b, _, h = x.shape
    xb = jnp.broadcast_to(x[:, 0][None].astype(kernel.dtype), (kernel.shape[0], b, h))
    return jnp.transpose(jnp.einsum("NBH,NHD->NBD", xb, kernel), (1, 0, 2))[:, None]


def matmul_rows(rows, x):
    """rows [O, I], x [B, I] -> x @ rows^T [B, O], computed as rows @ x^T. The barrier stops
    XLA from folding the output transpose back into the dot (which would undo the layout)."""
    return jax.lax.optimization_barrier(rows @ x.T).T
