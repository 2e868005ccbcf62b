"""XLA:CPU's kernels for Gemma's GeGLU feed-forward block: the FFN with its backward written
out (`gated_ffn`) and the gated activation alone (`geglu`), which a step multiplying through the
train layout uses. How a kernel is chosen by platform: models/kernels.py.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models import layers, train_layout
from models.cpu_forms import bits_slice, product, row_major_t, times_t
from models.kernels import by_platform, narrow_by_platform, slices


# --- Training: the GeGLU FFN with a written-out backward -------------------------------------

def gated_ffn(x, gate: layers.Einsum, up: layers.Einsum, down: layers.Einsum):
    """Gemma's FFN, down(geglu(gate(x), up(x))): x [B, T, H] -> [B, T, H].

    gate, up: Einsum layers with [H, F] kernels, down: [F, H]. A decode step (T = 1), and a
    step with a train layout or LoRA factors at any of them (`train_layout.intercepts`), go
    through the layers themselves, so the interceptors can replace each product; other inputs
    run `layers.gated_ffn` on the flat tokens, on CPU with `_cpu_gated_ffn`'s backward.
    """
    b, t, h = x.shape
    w_gate, w_up, w_down = gate(None), up(None), down(None)
    if t == 1 or any(train_layout.intercepts(m) for m in (gate, up, down)):
        return down("BTF,FH->BTH", geglu(gate("BTH,HF->BTF", x), up("BTH,HF->BTF", x)))
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
    [H, N] @ [N, F] product, so no [N, F] activation is ever transposed. When none of the
    three kernels is differentiated (a LoRA step that leaves the FFN frozen) the backward
    computes the input gradient only, as autodiff would.

    Narrow kernels go a slice of F at a time (`slices`), forward and backward; the slices'
    products are summed in float32. Their products are all in XLA:CPU's fast bfloat16 form
    (models/cpu_forms.py; a narrow kernel's transpose, one slice at a time, is written out
    too): the real Gemma 3 270M's bfloat16 full fine-tune step at 8 x 128 went from ~7.6 to ~6.45
    s, its FFN products from 1.5 to 0.6 s (an A/B and a profile, ad hoc; the bench line is
    `BENCH real_bf16_train_full_t128`, bench/README.md).

    The input gradient multiplies each kernel slice transposed (`cpu_forms.times_t`): in place
    on a CPU without AMX, where the copies written out for it had cost Gemma 2B's bfloat16 LoRA
    step at 2 x 128 tokens 6-7 s of ~16 (a 2-core AMD EPYC; its FFN forward + input gradient at
    256 tokens 724 -> ~325 ms a layer, at 80 tokens -> ~115; the 270M's at 1024 tokens the
    same, ad hoc; bench/README.md).
    """
    return _ffn_forward(x, w_gate, w_up, w_down)[0]


def _ffn_slices(w_gate, w_up, w_down, i, n):
    f = w_down.shape[0] // n
    return bits_slice(w_gate, i, f, 1), bits_slice(w_up, i, f, 1), bits_slice(w_down, i, f, 0)


def _ffn_forward(x, w_gate, w_up, w_down):
    """-> (out [N, H], (gate, up) [n, N, F / n]) over the kernels' n slices."""
    n = slices(*w_gate.shape, w_gate.dtype)
    if n == 1:
        gate, up = product(x, w_gate), product(x, w_up)
        return product(_geglu_value(gate, up), w_down), (gate[None], up[None])

    def body(out, i):
        wg, wu, wd = _ffn_slices(w_gate, w_up, w_down, i, n)
        gate, up = product(x, wg), product(x, wu)
        out = out + jnp.dot(_geglu_value(gate, up), wd, preferred_element_type=jnp.float32)
        return out, (gate, up)
    out, gate_up = jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), jnp.arange(n))
    return out.astype(x.dtype), gate_up


def _cpu_gated_ffn_fwd(x, w_gate, w_up, w_down):
    """Arguments are CustomVJPPrimals (symbolic zeros): `.perturbed` says which are trained.
    The residual x is None when no kernel needs a gradient."""
    trained = w_gate.perturbed or w_up.perturbed or w_down.perturbed
    x, w_gate, w_up, w_down = x.value, w_gate.value, w_up.value, w_down.value
    out, (gate, up) = _ffn_forward(x, w_gate, w_up, w_down)
    return out, (x if trained else None, w_gate, w_up, w_down, gate, up)


def _ffn_slice_backward(x, w_gate, w_up, w_down, gate, up, d_out):
    """One slice's float32 d_x and, given x, its kernels' gradients (else None)."""
    d_hidden = times_t(d_out, w_down)
    d_gate, d_up, act = _geglu_backward(gate, up, d_hidden)
    d_x = times_t(d_gate, w_gate) + times_t(d_up, w_up)
    if x is None:
        return d_x, None
    x_t = row_major_t(x)
    return d_x, (product(x_t, d_gate), product(x_t, d_up), product(row_major_t(d_out), act).T)


def _cpu_gated_ffn_bwd(residuals, d_out):
    x, w_gate, w_up, w_down, gate, up = residuals
    n = gate.shape[0]
    if n == 1:
        d_x, grads = _ffn_slice_backward(x, w_gate, w_up, w_down, gate[0], up[0], d_out)
        return (d_x.astype(d_out.dtype), *(grads or (None,) * 3))

    def body(d_x, xs):
        i, g, u = xs
        d, grads = _ffn_slice_backward(x, *_ffn_slices(w_gate, w_up, w_down, i, n), g, u, d_out)
        return d_x + d, grads
    d_x, grads = jax.lax.scan(body, jnp.zeros(d_out.shape, jnp.float32), (jnp.arange(n), gate, up))
    if grads is None:
        return d_x.astype(d_out.dtype), None, None, None
    d_gate, d_up, d_down = grads  # [n, H, F / n], [n, H, F / n], [n, F / n, H]
    join = lambda g: jnp.moveaxis(g, 0, 1).reshape(g.shape[1], -1)  # noqa: E731
    return d_x.astype(d_out.dtype), join(d_gate), join(d_up), d_down.reshape(-1, d_out.shape[1])


_cpu_gated_ffn.defvjp(_cpu_gated_ffn_fwd, _cpu_gated_ffn_bwd, symbolic_zeros=True)


def geglu(gate, up):
    """`layers.geglu` (gate, up [..., F]); on CPU in a narrow dtype `_cpu_geglu`."""
    return narrow_by_platform(gate, up, cpu=_cpu_geglu, plain=layers.geglu)


@jax.custom_vjp
def _cpu_geglu(gate, up):
    """gelu_tanh(gate) * up computed in float32 from the narrow gate and up and rounded once,
    and its backward the same way: one pass over [..., F] each way.

    As written, in bfloat16, XLA:CPU rounds after every operation of the GELU and of its
    autodiff backward, each a pass of conversions: [1024, 2048] forward and backward 6.4 ->
    2.6 ms; the real Gemma 3 270M's bfloat16 LoRA step (train layout) at 8 x 128 tokens 2364
    -> 2306 ms (medians of 8, interleaved, ad hoc, a 2-core AMX Xeon; float32 gains nothing).
    Rounded once, the values are closer to float32's (tests/test_kernels.py)."""
    return _geglu_value(gate, up)


def _geglu_value(gate, up):
    gelu, _ = _gelu_and_slope(gate)
    return (gelu * up.astype(jnp.float32)).astype(gate.dtype)


def _gelu_and_slope(gate):
    """float32 gelu_tanh(gate) and its derivative."""
    a, c = math.sqrt(2.0 / math.pi), 0.044715
    g = gate.astype(jnp.float32)
    t = jnp.tanh(a * (g + c * g ** 3))
    return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * a * (1 + 3 * c * g * g)


def _geglu_backward(gate, up, d_act):
    """(d_gate, d_up) in gate's dtype from d_act = dLoss/d(geglu), computed in float32, and
    the activation itself (`_geglu_value`'s), which the down kernel's gradient needs, from the
    same GELU.

    The barrier keeps XLA from sharing this GELU with the forward pass's: it then kept the
    forward's float32 tanh [N, F] for the backward and split the forward into three passes (the
    real Gemma 3 270M's bfloat16 LoRA step at 8 x 128: 1.274 -> 1.133 GiB of temporaries,
    median 2306 -> 2265 ms, an A/B, ad hoc). The GELU's input also takes a term from d_act
    (zero, as XLA does not fold x * 0 for floats): XLA removes the barrier before it schedules,
    and a GELU of the saved gate alone was computed ahead, every layer's float32 tanh alive at
    once (the same step: 1.012 -> 0.871 GiB, median 2088 -> 2063 ms, an A/B, ad hoc)."""
    gate, up = jax.lax.optimization_barrier((gate, up))
    d_act, u = d_act.astype(jnp.float32), up.astype(jnp.float32)
    gelu, slope = _gelu_and_slope(gate.astype(jnp.float32) + 0.0 * d_act)
    return ((d_act * u * slope).astype(gate.dtype), (d_act * gelu).astype(up.dtype),
            (gelu * u).astype(gate.dtype))


_cpu_geglu.defvjp(lambda gate, up: (_geglu_value(gate, up), (gate, up)),
                  lambda res, d_act: _geglu_backward(*res, d_act)[:2])
