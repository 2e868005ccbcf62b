"""models/kernels.py's attention projections: `_cpu_projection` equals the einsum it replaces
(values and gradients), multiplies bfloat16 in every product, does no kernel-gradient work for
a frozen kernel, and is chosen only for a bfloat16 program lowered for CPU."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fast_form import NARROW_KERNEL_CHOICES, dot_operand_types, narrow, transposed_sizes
from models import cpu_forms, kernels
from models.gemma import PRESETS, Gemma

# (einsum, x's shape, the kernel's): the query/key/value projections and the output's
PROJECTIONS = [("BTH,NHD->BTND", (2, 6, 16), (4, 16, 8)), ("BTND,NDH->BTH", (2, 6, 4, 8), (4, 8, 16))]


def _ours(eq):
    return functools.partial(kernels.cpu_project, eq)


def _plain(eq):
    return lambda x, kernel: jnp.einsum(eq, x, kernel)


@pytest.mark.parametrize("eq, x_shape, kernel_shape", PROJECTIONS)
def test_the_cpu_projection_equals_the_einsum(eq, x_shape, kernel_shape):
    """In float32 (the kernel's math is dtype-free): the value and both gradients."""
    keys = jax.random.split(jax.random.key(0), 3)
    x, kernel = jax.random.normal(keys[0], x_shape), jax.random.normal(keys[1], kernel_shape)
    results = []
    for f in (_ours(eq), _plain(eq)):
        out, vjp = jax.vjp(f, x, kernel)
        results.append((out, *vjp(jax.random.normal(keys[2], out.shape))))
    for a, b in zip(*results):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eq, x_shape, kernel_shape", PROJECTIONS)
def test_a_frozen_projection_kernel_gets_no_gradient_work(eq, x_shape, kernel_shape):
    """Differentiated for x only (a LoRA step's frozen key), the backward is one product: the
    jaxpr holds the forward's and d_x's, and d_kernel's only when the kernel is trained."""
    x, kernel = jax.random.normal(jax.random.key(0), x_shape), jax.random.normal(jax.random.key(1), kernel_shape)
    loss = lambda x, kernel: _ours(eq)(x, kernel).sum()  # noqa: E731
    frozen = str(jax.make_jaxpr(jax.grad(loss))(x, kernel))
    trained = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, kernel))
    assert frozen.count("dot_general[") == 2 and trained.count("dot_general[") == 3
    np.testing.assert_allclose(jax.grad(loss)(x, kernel),
                               jax.grad(lambda x, k: _plain(eq)(x, k).sum())(x, kernel), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eq, x_shape, kernel_shape", PROJECTIONS)
def test_a_frozen_bfloat16_projection_multiplies_its_matrix_transposed_in_place_without_amx(
        monkeypatch, eq, x_shape, kernel_shape):
    """d_x = d_y @ W^T with W the forward's matrix: without AMX multiplied in place, so the
    only kernel-sized transposes are those that make W (the query's [N, H, D] needs one, for
    the forward and again for the backward); with AMX W^T is written out as well."""
    x, kernel = narrow(x_shape, kernel_shape)
    counts = {}
    for amx in (False, True):
        monkeypatch.setattr(cpu_forms, "amx", lambda amx=amx: amx)
        d_x = jax.grad(lambda x: _ours(eq)(x, kernel).astype(jnp.float32).sum())
        counts[amx] = transposed_sizes(jax.make_jaxpr(d_x)(x).jaxpr).count(kernel.size)
    assert counts[False] == (0 if eq.startswith("BTND") else 2)  # the output's [N, D, H] reshapes as it is
    assert counts[True] == counts[False] + 1


@pytest.mark.parametrize("eq, x_shape, kernel_shape", PROJECTIONS)
def test_every_product_of_a_bfloat16_projection_multiplies_bfloat16(eq, x_shape, kernel_shape):
    """Compiled, the forward and both backward products take bfloat16 operands (the einsum's
    autodiff takes float32 in them), and the results stay as close to float32 as its."""
    x, kernel, d_y = narrow(x_shape, kernel_shape, _plain(eq)(jnp.zeros(x_shape), jnp.zeros(kernel_shape)).shape)

    def grads(f, x, kernel):
        out, vjp = jax.vjp(f, x, kernel)
        return [out, *vjp(d_y.astype(out.dtype))]

    def types(f):
        return dot_operand_types(jax.jit(lambda *a: grads(f, *a)).lower(x, kernel).compile().as_text())
    ours, plain = types(_ours(eq)), types(_plain(eq))
    assert len(ours) == 6 and set(ours) == {"bf16"}
    assert "f32" in plain
    exact = [np.float32(g) for g in jax.vjp(_plain(eq), x.astype(jnp.float32), kernel.astype(jnp.float32))[1](
        d_y.astype(jnp.float32))]
    exact = [np.float32(_plain(eq)(x.astype(jnp.float32), kernel.astype(jnp.float32))), *exact]

    def error(f):
        return sum(float(np.abs(np.float32(g) - e).max() / np.abs(e).max()) for g, e in zip(grads(f, x, kernel), exact))
    assert error(_ours(eq)) <= 1.1 * error(_plain(eq)) + 1e-3


@pytest.mark.parametrize("platform, dtype, cpu_kernel", NARROW_KERNEL_CHOICES)
def test_the_projection_kernel_is_chosen_by_platform_and_dtype(platform, dtype, cpu_kernel):
    """A training gradient's attention projections: the CPU kernel only for a bfloat16 program
    lowered for CPU; a decode step (one token) goes through the layer either way."""
    model = Gemma(PRESETS["gemma_tiny"].replace(vocab_size=256, num_layers=1, dtype=dtype))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32)))["params"]
    for length, expected in ((8, cpu_kernel), (1, False)):
        ids = jnp.zeros((2, length), jnp.int32)
        grad = jax.grad(lambda p: model.apply({"params": p}, ids).astype(jnp.float32).sum())
        lowered = jax.jit(grad).trace(params).lower(lowering_platforms=(platform,))
        assert ("cpu_kernel/cpu_projection" in lowered.as_text(debug_info=True)) == expected
