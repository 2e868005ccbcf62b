"""Hand-written pieces of models/layers.py that replace what autodiff or a plain einsum would
do, checked against those: the GeGLU FFN's written-out backward and Einsum's step layout."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers


def plain_ffn(x, w_gate, w_up, w_down):
    return (jax.nn.gelu(x @ w_gate, approximate=True) * (x @ w_up)) @ w_down


def test_gated_ffn_matches_autodiff():
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (24, 16))
    ws = [jax.random.normal(k, s) * 0.5 for k, s in zip(keys[1:4], [(16, 40), (16, 40), (40, 16)])]
    d_out = jax.random.normal(keys[4], (24, 16))
    np.testing.assert_allclose(layers.gated_ffn(x, *ws), plain_ffn(x, *ws), rtol=1e-6, atol=1e-6)
    _, ours = jax.vjp(layers.gated_ffn, x, *ws)
    _, reference = jax.vjp(plain_ffn, x, *ws)
    for a, b in zip(ours(d_out), reference(d_out)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("eq, kernel, x", [
    ("BTH,NHD->BTND", (4, 8, 3), (2, 1, 8)),      # query/key/value
    ("BTND,NDH->BTH", (4, 3, 8), (2, 1, 4, 3)),   # attention output
    ("BTH,HF->BTF", (8, 12), (2, 1, 8)),          # FFN
])
def test_step_layout_equals_the_einsum(eq, kernel, x):
    layer = layers.Einsum(kernel)
    params = layer.init(jax.random.key(0), eq, jnp.zeros(x, jnp.float32))
    x = jax.random.normal(jax.random.key(1), x)
    plain = layer.apply(params, eq, x)
    y, built = layer.apply(params, eq, x, mutable=["step_layout"])
    rows = built["step_layout"]["kernel"]
    assert rows.shape == (plain[0, 0].size, x[0, 0].size)  # [out, in]
    np.testing.assert_allclose(y, plain, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layer.apply({**params, **built}, eq, x), plain, rtol=1e-6, atol=1e-6)
    if x.shape[1] == 1:  # the layout only ever applies to single-token steps
        longer = jnp.concatenate([x, x], axis=1)
        np.testing.assert_allclose(layer.apply({**params, **built}, eq, longer),
                                   layer.apply(params, eq, longer), rtol=1e-6)


def test_init_on_a_single_token_builds_no_step_layout():
    """init makes every collection mutable; jaxlm.load initialises on [1, 1] ids."""
    from models.gemma import PRESETS, Gemma
    variables = Gemma(PRESETS["gemma_tiny"]).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    assert set(variables) == {"params"}
