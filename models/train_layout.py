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
2-core AMX-BF16 host: 4825 -> 2982 ms (`python bench/real_step_ab.py --what=train_layout
--seq=128`'s `BENCH real_ab_train_layout`), 339.1 tokens/s against HF transformers + PEFT's
249.8 in bfloat16 (`python bench/real_model.py --dtype=bfloat16`; bench/README.md).
tests/test_kernels.py checks it against the plain step.

    layout = train_layout.build(model, base, skip=lora.find_targets(base))
    with train_layout.products():
        model.apply({"params": merged, train_layout.COLLECTION: layout}, ...)

(`jaxlm.train.loss.lm_loss_fn` does the last two, `jaxlm.train.trainer` the first.) Like the
decoder's step layout (models/kernels.py), it is state its caller owns, passed to every step.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax.custom_derivatives import SymbolicZero

from models import layers

COLLECTION = "train_layout"  # the Flax collection that holds it
MAX_BYTES = 2 << 30  # copies held for the whole run; larger bases train without


def pays(platform: str, dtype, nbytes: int) -> bool:
    """Whether a step over a frozen base of `nbytes` in `dtype` should train with the layout:
    on CPU, for a base narrower than float32 whose copies fit MAX_BYTES."""
    return platform == "cpu" and jnp.dtype(dtype) != jnp.float32 and nbytes <= MAX_BYTES


def build(model, params, skip=()) -> dict:
    """-> the train layout of `params` (a Gemma tree), the COLLECTION's variables: mirroring
    the modules, per Einsum its kernel as [in, out] ("forward") and [out, in]
    ("backward") matrices where that is not the stored kernel reshaped, and the tied table
    as [H, V] ("columns"). Built by one model call over two tokens with the collection
    mutable, so every product's axes are read from its own einsum. `skip`: kernel paths
    ("decoder_block_0/attention/query/kernel") that change during training (LoRA targets,
    merged in every step) and so get no copy. Unrolled layers only: a layer scan's modules
    are unbound, and the step multiplies them as written."""
    if getattr(model.config, "scan_layers", False):
        model = type(model)(model.config.replace(scan_layers=False))
    skipped = {p.rsplit("/", 1)[0] for p in skip}

    def make(params):
        with nn.intercept_methods(_intercept):
            _, made = model.apply({"params": params}, jnp.zeros((1, 2), jnp.int32),
                                  return_hidden=True, mutable=[COLLECTION])
        table = params["token_embedding"]["embeddings"].astype(model.config.dtype)
        return {**_without(made[COLLECTION], skipped), "token_embedding": {"columns": table.T}}
    return jax.jit(make)(params)


def _without(tree: dict, paths: set, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if path in paths:
            continue
        out[k] = _without(v, paths, path + "/") if isinstance(v, dict) else v
    return out


def axes(eq: str):
    """The kernel's contracted (input) and output axes in an einsum `x,kernel->y`."""
    x_spec, k_spec = eq.split("->")[0].split(",")
    ins = [i for i, c in enumerate(k_spec) if c in x_spec]
    if [k_spec[i] for i in ins] != list(x_spec[-len(ins):]):
        raise ValueError(f"the layouts need x's contracted axes last, in kernel order: {eq}")
    return ins, [i for i, c in enumerate(k_spec) if c not in x_spec]


def _matrix(kernel, rows, cols):
    """kernel as a [prod rows, prod cols] matrix, axes `rows` then `cols`."""
    shape = kernel.shape
    return jnp.transpose(kernel, rows + cols).reshape(math.prod(shape[i] for i in rows), -1)


def _intercept(next_fun, args, kwargs, context):
    """Flax method interceptor: builds the train layout (collection mutable) or multiplies
    through it (collection passed in); anything without an entry runs as written."""
    module = context.module
    building = module.is_mutable_collection(COLLECTION)
    if not (isinstance(module, layers.Einsum) and context.method_name == "__call__"):
        return next_fun(*args, **kwargs)
    bound = {**dict(zip(("eq", "x"), args)), **kwargs}
    eq, x = bound.get("eq"), bound.get("x")
    if eq is None:
        return next_fun(*args, **kwargs)
    laid = any(module.has_variable(COLLECTION, name) for name in ("forward", "backward"))
    if not (building or laid):  # a LoRA target, or no layout passed
        return next_fun(*args, **kwargs)
    kernel = next_fun(None)
    ins, outs = axes(eq)
    if building:  # each form that is not the stored kernel reshaped
        for name, (rows, cols) in (("forward", (ins, outs)), ("backward", (outs, ins))):
            if rows + cols != sorted(rows + cols):
                module.variable(COLLECTION, name, lambda r=rows, c=cols: _matrix(kernel, r, c))

    def form(name, rows, cols):
        if module.has_variable(COLLECTION, name):
            return module.get_variable(COLLECTION, name)
        return _matrix(kernel, rows, cols)
    n_in = len(ins)
    flat = x.reshape(-1, math.prod(x.shape[-n_in:])).astype(module.dtype)
    y = product(flat, form("forward", ins, outs), form("backward", outs, ins))
    return y.reshape(*x.shape[:-n_in], *(module.shape[i] for i in outs))


def holds(module) -> bool:
    """Whether `module` (bound) multiplies through a layout: one being built or passed in."""
    return module.is_mutable_collection(COLLECTION) or any(
        module.has_variable(COLLECTION, name) for name in ("forward", "backward"))


def products():
    """Context in which a model traced with its `train_layout` passed in multiplies through it."""
    return nn.intercept_methods(_intercept)


@jax.custom_vjp
def product(x, forward, backward):
    """x [N, I] @ forward [I, O] -> [N, O] in x's dtype, its input gradient dy @ backward
    [O, I]: both products in the fast form, no gradient for the (frozen) weights."""
    return jnp.dot(x, forward, preferred_element_type=jnp.float32).astype(x.dtype)


def _laid_fwd(x, forward, backward):
    x, forward, backward = x.value, forward.value, backward.value
    return product(x, forward, backward), backward


def _laid_bwd(backward, dy):
    if isinstance(dy, SymbolicZero):
        return None, None, None
    return (jnp.dot(dy.astype(backward.dtype), backward,
                    preferred_element_type=jnp.float32).astype(dy.dtype), None, None)


product.defvjp(_laid_fwd, _laid_bwd, symbolic_zeros=True)
