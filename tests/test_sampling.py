"""Samplers: KerasHub's defaults and behaviour, seeded, and one-line errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import sampling
from jaxlm.errors import UserError

LOGITS = jnp.log(jnp.array([[0.05, 0.4, 0.3, 0.15, 0.1],
                            [0.5, 0.02, 0.08, 0.1, 0.3]], jnp.float32))


def draws(sampler, n=2000):
    keys = jax.random.split(jax.random.key(0), n)
    return np.asarray(jax.vmap(lambda k: sampler(LOGITS, k))(keys))  # [n, B]


def test_names_resolve_to_kerashub_defaults():
    assert sampling.resolve("greedy") == sampling.Greedy()
    assert sampling.resolve("top_k") == sampling.TopK(k=5, temperature=1.0)
    assert sampling.resolve("top_p") == sampling.TopP(p=0.1, k=None, temperature=1.0)
    assert sampling.resolve("random") == sampling.resolve("temperature") == sampling.Random()
    custom = sampling.TopK(k=2, temperature=0.5)
    assert sampling.resolve(custom) is custom
    hash(custom)  # keys the compiled decode function


def test_unknown_sampler_is_one_line_naming_the_choices():
    with pytest.raises(UserError) as e:
        sampling.resolve("beam")
    msg = str(e.value)
    assert "'beam'" in msg and "\n" not in msg
    assert all(name in msg for name in ("greedy", "top_k", "top_p", "random", "temperature"))
    with pytest.raises(UserError):
        sampling.TopK(k=0)
    with pytest.raises(UserError):
        sampling.TopP(p=0.0)


def test_greedy_is_argmax():
    assert sampling.Greedy()(LOGITS, None).tolist() == [1, 0]


def test_greedy_is_the_first_argmax_of_the_probabilities_including_their_ties():
    """Ties among the logits, ties the softmax makes (exp(-1e-9) rounds to exp(0)), rows of
    -inf, +inf and NaN, and a temperature: the first index of the largest probability."""
    x = jax.random.randint(jax.random.key(0), (64, 300), 0, 7).astype(jnp.float32)  # many ties
    x = x.at[3].set(-jnp.inf).at[5, 10].set(jnp.inf).at[6, 20].set(jnp.nan)
    x = x.at[7].set(-1.0).at[7, 40].set(-1e-9).at[7, 50].set(0.0)  # 40 and 50: probability 1/(2 + ...)
    for temperature in (1.0, 0.7):
        probs = jax.nn.softmax(x / temperature, axis=-1)
        # a row whose probabilities are NaN (-inf, +inf or NaN logits here) gives its last index
        want = jnp.where(jnp.isnan(probs).any(-1), 299, jnp.argmax(probs, axis=-1))
        got = jax.jit(sampling.Greedy(temperature))(x, None)
        np.testing.assert_array_equal(got, want)
        assert got[7] == 40
        assert got.dtype == jnp.int32
    assert jnp.argmax(x[7]) == 50  # the logits' own argmax would differ


def test_greedy_with_a_temperature_is_the_argmax_of_logits_a_program_computes():
    """The decoder's logits come from a product inside its program, where XLA:CPU divided them
    by the temperature twice, to two roundings: every row got the last index."""
    from models.decode_kernels import matmul_rows
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((4096, 128)).astype(np.float32) * 8)
    hidden = jnp.asarray(rng.standard_normal((4, 128)).astype(np.float32))
    for temperature in (1.0, 0.7, 2.0):
        greedy = sampling.Greedy(temperature)
        got = jax.jit(lambda t, h: greedy(matmul_rows(t, h), None))(table, hidden)  # noqa: B023
        np.testing.assert_array_equal(got, jnp.argmax(hidden @ table.T, axis=-1))


def test_random_follows_the_softmax_and_is_seeded():
    freq = np.stack([np.bincount(d, minlength=5) for d in draws(sampling.Random()).T]) / 2000
    np.testing.assert_allclose(freq, jax.nn.softmax(LOGITS), atol=0.04)
    a = sampling.Random()(LOGITS, jax.random.key(3))
    b = sampling.Random()(LOGITS, jax.random.key(3))
    assert a.tolist() == b.tolist()
    # Low temperature sharpens towards the argmax.
    cold = draws(sampling.Random(temperature=0.01), 200)
    assert (cold == np.array([1, 0])).all()


def test_top_k_only_draws_the_k_most_likely():
    d = draws(sampling.TopK(k=2))
    assert set(d[:, 0]) == {1, 2} and set(d[:, 1]) == {0, 4}
    # Renormalised over the top 2: 0.4 / 0.7 for token 1 in row 0.
    assert abs((d[:, 0] == 1).mean() - 0.4 / 0.7) < 0.04


def test_top_p_keeps_the_nucleus():
    # p=0.1 keeps only the single most likely token (the one that crosses p).
    assert (draws(sampling.TopP(), 200) == np.array([1, 0])).all()
    d = draws(sampling.TopP(p=0.6))  # row 0: 0.4 then 0.3 crosses 0.6 -> {1, 2}
    assert set(d[:, 0]) == {1, 2} and set(d[:, 1]) == {0, 4}
    d = draws(sampling.TopP(p=1.0, k=3))
    assert set(d[:, 0]) == {1, 2, 3}
