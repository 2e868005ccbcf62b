"""models/cpu_forms.py: each form holds the same values as the plain op it stands for. (That
the kernels written with them compile to the fast products is checked in test_kernels.py,
test_projection_kernel.py, test_decode_kernels.py and test_loss.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fast_form import narrow
from models import cpu_forms


@pytest.mark.parametrize("shape", [(96, 640), (3, 40, 24), (2, 5, 7, 130)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_transposed_and_row_major_hold_the_same_values(shape, dtype):
    """A column count that 64 divides, one it does not (k = 8), and one with k = 2."""
    (x,) = narrow(shape)
    x = x.astype(dtype)
    np.testing.assert_array_equal(jax.jit(cpu_forms.transposed)(x), jnp.swapaxes(x, -1, -2))
    np.testing.assert_array_equal(jax.jit(cpu_forms.row_major_t)(x), jnp.swapaxes(x, -1, -2))
    np.testing.assert_array_equal(jax.jit(cpu_forms.row_major)(x), x)


def test_products_multiply_in_the_first_operands_dtype():
    a, b = narrow((8, 16), (16, 4))
    assert cpu_forms.product(a, b).dtype == jnp.bfloat16
    np.testing.assert_allclose(cpu_forms.product(a, b).astype(jnp.float32),
                               a.astype(jnp.float32) @ b.astype(jnp.float32), rtol=1e-2, atol=1e-2)
    a4, b4 = narrow((2, 3, 8, 16), (2, 3, 16, 4))
    out = cpu_forms.batched_product(a4, b4)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, jnp.einsum("bknc,bkcm->bknm", a4, b4,
                                               preferred_element_type=jnp.float32), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_times_t_multiplies_b_in_place_without_amx(amx, dtype):
    """a @ b^T as float32: b contracted on its own last axis, no copy of it (the product's
    operands as they are), except a narrow b with AMX, written out transposed first."""
    a, b = (x.astype(dtype) for x in narrow((8, 64), (48, 64)))
    got = jax.jit(cpu_forms.times_t)(a, b)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np.float32(a) @ np.float32(b).T, rtol=1e-5, atol=1e-4)
    hlo = jax.jit(cpu_forms.times_t).lower(a, b).compile().as_text()
    copied = any("[64,48]" in line.split(" = ", 1)[1].split("{", 1)[0] for line in hlo.splitlines()
                 if " = " in line and "parameter(" not in line)
    assert copied == (amx and dtype == jnp.bfloat16), hlo


@pytest.mark.parametrize("dtype,bits", [(jnp.bfloat16, "uint16"), (jnp.float32, "uint32"),
                                        (jnp.int8, "uint8")])
def test_bits_type_is_as_wide_as_the_dtype(dtype, bits):
    assert cpu_forms.bits_type(dtype) == jnp.dtype(bits)


@pytest.mark.parametrize("axis", [0, 1])
def test_bits_slice_cuts_slice_i_in_a_loop(axis):
    (w,) = narrow((12, 20))
    size = w.shape[axis] // 4

    def cut(_, i):
        return None, cpu_forms.bits_slice(w, i, size, axis)
    parts = jax.lax.scan(cut, None, jnp.arange(4))[1]
    np.testing.assert_array_equal(jnp.concatenate(list(parts), axis=axis), w)
    assert parts.dtype == jnp.bfloat16


def test_bits_take_gathers_as_jnp_take():
    """Rows, a negative id counted from the end, and NaN rows for ids outside the table."""
    (table,) = narrow((10, 4))
    ids = jnp.asarray([[0, 9, -1], [3, 10, -11]])
    got = jax.jit(cpu_forms.bits_take)(table, ids)
    assert got.dtype == jnp.bfloat16 and np.isnan(np.float32(got[1, 1:])).all()
    np.testing.assert_array_equal(got, jnp.take(table, ids, axis=0))


def test_amx_is_read_from_the_cpus_flags(tmp_path):
    """The flag itself, not a flag it begins (amx_bf16 is what XLA:CPU's bfloat16 kernels use;
    amx_tile alone is not enough); no cpuinfo (not Linux) reads as no AMX."""
    def cpu(flags: str) -> str:
        f = tmp_path / f"cpuinfo{len(list(tmp_path.iterdir()))}"
        f.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
        return str(f)
    assert cpu_forms.amx(cpu("fpu avx512f amx_bf16 amx_tile avx512_bf16"))
    assert not cpu_forms.amx(cpu("fpu avx512f avx512_bf16 amx_tile"))
    assert not cpu_forms.amx(cpu("fpu amx_bf16x"))
    assert not cpu_forms.amx(str(tmp_path / "none"))
