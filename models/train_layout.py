"""The CPU train layout: every product of a bfloat16 LoRA step in XLA:CPU's one fast form.

XLA:CPU multiplies bfloat16 fast in one form only: [N, K] @ [K, M], both operands bfloat16
and row-major, a float32 result (on an AMX-BF16 host 550-1390 GFLOP/s against float32's
215-280; with the second operand transposed, a bfloat16 result, or the weight first,
150-260). A training step multiplies each frozen weight twice, x @ W forward and dy @ W^T
backward, so no one stored layout serves both, and transposing inside the step costs more
than the product saves. The train layout is therefore the frozen weights stored a second
time, in the form their stored layout lacks, built once before training (`build`): the
frozen base is doubled in memory, so it is for bases that are small next to the machine
(`pays`). The real Gemma 3 270M's bfloat16 LoRA step, 8 x 128 tokens, one device of a
2-core AMX-BF16 host: 4923 -> 2714 ms (`python bench/real_step_ab.py --what=train_layout
--seq=128`'s `BENCH real_ab_train_layout`; bench/README.md).
tests/test_train_layout.py checks it against the plain step.

    layout = train_layout.build(model, base)
    with train_layout.products(adapters.scale):
        model.apply({"params": base, train_layout.COLLECTION: layout,
                     train_layout.LORA: dict(adapters)}, ...)

(`jaxlm.train.loss.lm_loss_fn` does the last two, `jaxlm.train.trainer` the first.) Like the
decoder's step layout (models/decode_kernels.py), it is state its caller owns, passed to every
step.

The base is not merged with the LoRA factors here, so the targeted kernels keep their copies
too: an adapted product is x @ W through the layout plus scale * (x @ A) @ B (PEFT's form;
`jaxlm.lora.merge` multiplies by W + scale * A @ B, the same sum). Merged, the step would
multiply a new kernel every step in the slow form (about 400 ms of a 3 s step for the 270M's
query and value kernels), and a bfloat16 merge rounds away a small update A @ B.

Without a layout (float32, which has no fast form to gain; a narrow base too large for the
copies, or on a CPU without AMX, where `product` multiplies the stored kernels both ways)
the factors stay unmerged all the same: an adapted product is the stored kernel's product
plus the low-rank term, so the step computes no gradient for a merged kernel (the
270M's float32 LoRA step at 8 x 128 tokens 3-4% faster than merged, Gemma 2B's bfloat16 one
4-6%, bench/README.md). The low-rank term's backward (`_factored`)
transposes only its rank-r operands.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax.custom_derivatives import SymbolicZero

from models import cpu_forms, layers

COLLECTION = "train_layout"  # the Flax collection that holds it
LORA = "lora"  # and the one that holds the LoRA factors, unmerged, at their modules
MAX_BYTES = 2 << 30  # copies held for the whole run; larger bases train without


def pays(platform: str, dtype, nbytes: int) -> bool:
    """Whether a step over a frozen base of `nbytes` in `dtype` should train with the layout:
    on a CPU with AMX, for a base narrower than float32 whose copies fit MAX_BYTES.

    Without AMX, XLA:CPU multiplies a narrow dy @ W^T with W in place (`cpu_forms.times_t`),
    so the stored kernels serve both products (`product` without a layout): the real Gemma 3
    270M's bfloat16 LoRA step at 8 x 128 tokens on a 2-core AMD EPYC took 3328 ms with the
    layout and 3328 without (medians 3371 / 3413; merged 3419 / 3503), and the layout held 0.50 GiB
    more (`python bench/real_step_ab.py --what=train_layout --batch=8 --seq=128`,
    bench/README.md)."""
    return (platform == "cpu" and jnp.dtype(dtype) != jnp.float32 and nbytes <= MAX_BYTES
            and cpu_forms.amx())


def build(model, params) -> dict:
    """-> the train layout of `params` (a Gemma tree), the COLLECTION's variables: mirroring
    the modules, per Einsum its kernel as [in, out] ("forward") and [out, in]
    ("backward") matrices where that is not the stored kernel reshaped, and the tied table
    as [H, V] ("columns"). Built by one model call over two tokens with the collection
    mutable, so every product's axes are read from its own einsum. Unrolled layers only: a
    layer scan's modules are unbound, and the step multiplies them as written."""
    if getattr(model.config, "scan_layers", False):
        model = type(model)(model.config.replace(scan_layers=False))

    def make(params):
        with nn.intercept_methods(_intercept):
            _, made = model.apply({"params": params}, jnp.zeros((1, 2), jnp.int32),
                                  return_hidden=True, mutable=[COLLECTION])
        table = params["token_embedding"]["embeddings"].astype(model.config.dtype)
        return {**made[COLLECTION], "token_embedding": {"columns": table.T}}
    return jax.jit(make)(params)


def axes(eq: str):
    """The kernel's contracted (input) and output axes in an einsum `x,kernel->y`."""
    x_spec, k_spec = eq.split("->")[0].split(",")
    ins = [i for i, c in enumerate(k_spec) if c in x_spec]
    if [k_spec[i] for i in ins] != list(x_spec[-len(ins):]):
        raise ValueError(f"the layouts need x's contracted axes last, in kernel order: {eq}")
    return ins, [i for i, c in enumerate(k_spec) if c not in x_spec]


def matrix(kernel, rows, cols):
    """kernel as a [prod rows, prod cols] matrix, axes `rows` then `cols`."""
    shape = kernel.shape
    return jnp.transpose(kernel, rows + cols).reshape(math.prod(shape[i] for i in rows), -1)


def _intercept(next_fun, args, kwargs, context, scale=1.0):
    """Flax method interceptor: builds the train layout (collection mutable) or multiplies
    through it (collection passed in), adding a module's LoRA factors times `scale`; anything
    without an entry runs as written, its factors (if any) added beside."""
    module = context.module
    if not (isinstance(module, layers.Einsum) and context.method_name == "__call__"):
        return next_fun(*args, **kwargs)
    bound = {**dict(zip(("eq", "x"), args)), **kwargs}
    eq, x = bound.get("eq"), bound.get("x")
    if eq is None:
        return next_fun(*args, **kwargs)
    lora = module.has_variable(LORA, "lora_a")
    if not holds(module) and (not lora or jnp.dtype(module.dtype) == jnp.float32):
        y = next_fun(*args, **kwargs)  # as written, the factors (if any) beside
        return y + _adapted(module, eq, x, scale) if lora else y
    kernel = next_fun(None)
    ins, outs = axes(eq)
    if module.is_mutable_collection(COLLECTION):  # building: each form not the stored kernel
        for name, (rows, cols) in (("forward", (ins, outs)), ("backward", (outs, ins))):
            if rows + cols != sorted(rows + cols):
                module.variable(COLLECTION, name, lambda r=rows, c=cols: matrix(kernel, r, c))

    def form(name, rows, cols):
        if module.has_variable(COLLECTION, name):
            return module.get_variable(COLLECTION, name)
        return matrix(kernel, rows, cols)
    # A narrow kernel without a layout (too large a base, or no AMX): as written, XLA:CPU would
    # multiply it and its gradient in float32; `product` takes its backward from the forward.
    backward = form("backward", outs, ins) if holds(module) else None
    n_in = len(ins)
    flat = x.reshape(-1, math.prod(x.shape[-n_in:])).astype(module.dtype)
    y = product(flat, form("forward", ins, outs), backward)
    y = y.reshape(*x.shape[:-n_in], *(module.shape[i] for i in outs))
    return y + _adapted(module, eq, x, scale) if lora else y


def _adapted(module, eq: str, x, scale):
    """scale * einsum(eq, x, A @ B) with the module's LoRA factors, in its compute dtype."""
    a, b = (module.get_variable(LORA, f).astype(module.dtype) for f in ("lora_a", "lora_b"))
    return _low_rank(eq, x.astype(module.dtype), a, b * jnp.asarray(scale, module.dtype))


def _low_rank(eq: str, x, a, b):
    """einsum(eq, x, A @ B) as (x . A) . B: A [*K[:-1], r], B [r, K[-1]] (`jaxlm.lora`'s factors,
    the product batched over the kernel's leading axes), never forming A @ B. Where eq's output
    is x's leading axes then the kernel's output axes in order (every Gemma projection), as
    `_factored`'s matrices."""
    (x_spec, k_spec), y_spec = eq.split("->")[0].split(","), eq.split("->")[1]
    ins, outs = axes(eq)
    lead = x.shape[:-len(ins)]
    if y_spec != x_spec[:-len(ins)] + "".join(k_spec[i] for i in outs) or outs[-1] != a.ndim - 1:
        r = next(c for c in "ZYXWVUSRQPOMLKJIGFEDCBA" if c not in eq)
        return jnp.einsum(f"{x_spec},{k_spec[:-1]}{r},{r}{k_spec[-1]}->{y_spec}", x, a, b,
                          optimize="optimal")
    heads = outs[:-1]  # the output axes A keeps its own factor for (attention heads)
    flat = x.reshape(math.prod(lead), -1)
    y = _factored(flat, matrix(a, ins, heads + [a.ndim - 1]), b)
    return y.reshape(*lead, *(a.shape[i] for i in heads), b.shape[-1])


@jax.custom_vjp
def _factored(x, a, b):
    """x [M, K] @ a [K, G * r] -> read as [M * G, r] @ b [r, D] -> [M * G, D], each product in
    XLA:CPU's fast form. Autodiff's d_b multiplied the [M * G, D] output gradient transposed,
    and XLA:CPU wrote that copy out each layer (the float32 query's ~100 ms of a 4.8 s step of
    the real Gemma 3 270M, a profile); here only the rank-r operands are transposed."""
    return _factored_fwd(x, a, b)[0]


def _factored_fwd(x, a, b):
    h = cpu_forms.product(x, a)
    return cpu_forms.product(h.reshape(-1, b.shape[0]), b), (x, a, b, h)


def _factored_bwd(res, dy):
    x, a, b, h = res
    t = cpu_forms.transposed
    dh = cpu_forms.product(dy, t(b)).reshape(h.shape)  # [M, G * r]
    db = cpu_forms.product(t(h.reshape(-1, b.shape[0])), dy)  # [r, D]
    da = cpu_forms.product(t(dh), x).T  # [K, G * r], as [G * r, K] first: x stays as it is
    return cpu_forms.product(dh, t(a)), da, db


_factored.defvjp(_factored_fwd, _factored_bwd)


def holds(module) -> bool:
    """Whether `module` (bound) multiplies through a layout: one being built or passed in."""
    return module.is_mutable_collection(COLLECTION) or any(
        module.has_variable(COLLECTION, name) for name in ("forward", "backward"))


def intercepts(module) -> bool:
    """Whether a call of `module` (bound) must go through its `__call__`, where `products`
    multiplies: it holds a layout, or LoRA factors (added beside its product there)."""
    return holds(module) or module.has_variable(LORA, "lora_a")


def products(scale: float = 1.0):
    """Context in which a model traced with its train layout (and LoRA factors, times `scale`)
    passed in multiplies through them."""
    return nn.intercept_methods(functools.partial(_intercept, scale=scale))


@jax.custom_vjp
def product(x, forward, backward=None):
    """x [N, I] @ forward [I, O] -> [N, O] in x's dtype, its input gradient dy @ backward
    [O, I], both in the fast form, no gradient for the (frozen) weights. Without a layout
    (backward None) the input gradient is dy @ forward^T as `cpu_forms.times_t` takes it
    (forward in place on a CPU without AMX)."""
    return cpu_forms.product(x, forward)


def _laid_fwd(x, forward, backward):
    forward = forward.value
    backward = None if backward is None else backward.value
    return product(x.value, forward, backward), (forward, backward)


def _laid_bwd(weights, dy):
    if isinstance(dy, SymbolicZero):
        return None, None, None
    forward, backward = weights
    if backward is None:
        return cpu_forms.times_t(dy.astype(forward.dtype), forward).astype(dy.dtype), None, None
    return cpu_forms.product(dy.astype(backward.dtype), backward).astype(dy.dtype), None, None


product.defvjp(_laid_fwd, _laid_bwd, symbolic_zeros=True)
