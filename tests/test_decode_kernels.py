"""models/decode_kernels.py: each decoding kernel equals the plain math it replaces, and each
is chosen by the platform: the CPU one only for CPU, the plain math for TPU and GPU."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fast_form import NARROW_KERNEL_CHOICES, dot_operand_types, narrow
from models import decode_kernels, layers
from models.gemma import PRESETS, Gemma, init_cache

TINY = PRESETS["gemma_tiny"].replace(vocab_size=256, num_layers=1)
BF16_DECODE = TINY.replace(vocab_size=1024, dtype="bfloat16")  # `_bfloat16_generate_hlo`'s model


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
    with decode_kernels.decode_steps("cpu"):
        y, built = layer.apply(params, eq, x, mutable=["step_layout"])
        rows = built["step_layout"]["kernel"]
        assert rows.shape == (plain[0, 0].size, x[0, 0].size)  # [out, in]
        np.testing.assert_allclose(y, plain, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(layer.apply({**params, **built}, eq, x), plain, rtol=1e-6, atol=1e-6)
        # the layout only ever applies to single-token steps
        longer = jnp.concatenate([x, x], axis=1)
        np.testing.assert_allclose(layer.apply({**params, **built}, eq, longer),
                                   layer.apply(params, eq, longer), rtol=1e-6)


def test_per_head_projection_and_tied_logits_equal_the_einsums():
    """Without a step layout, a one-token query/key/value projection is a dot batched over
    heads and the tied logits are rows @ x^T behind a barrier; outside decode_steps("cpu")
    (or for another platform) neither appears."""
    x = jax.random.normal(jax.random.key(1), (3, 1, 8))
    proj = layers.Einsum((4, 8, 5))
    p = proj.init(jax.random.key(0), "BTH,NHD->BTND", x)
    emb = layers.Embedding(11, 8)
    e = emb.init(jax.random.key(2), jnp.zeros((1, 1), jnp.int32))

    def run(*_):  # traced afresh for each platform (jax caches a trace per function)
        return proj.apply(p, "BTH,NHD->BTND", x), emb.apply(e, x, method="attend")
    plain = run()
    for platform, replaced in (("cpu", True), ("tpu", False)):
        with decode_kernels.decode_steps(platform):
            for a, b in zip(run(), plain):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
            jaxpr = str(jax.make_jaxpr(lambda: run())())
        assert ("[4,3,8]" in jaxpr and "optimization_barrier" in jaxpr) == replaced, jaxpr


def test_a_gemma_decode_step_equals_the_plain_step_with_or_without_the_layout():
    cfg = TINY.replace(num_layers=2)
    model = Gemma(cfg)
    prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, cfg.vocab_size)
    params = model.init(jax.random.key(0), prompt)["params"]
    cache = model.apply({"params": params}, prompt, cache=init_cache(cfg, 2, 8), cache_index=0)[1]
    step = lambda v, **kw: model.apply(v, prompt[:, -1:], cache=cache, cache_index=5, **kw)  # noqa: E731
    plain, _ = step({"params": params})
    with decode_kernels.decode_steps("cpu"):
        per_head, _ = step({"params": params})
        (_, _), layout = step({"params": params}, mutable=["step_layout"])
        assert len(jax.tree.leaves(layout)) == 2 * 7  # q, k, v, out, 3 FFN kernels per block
        with_layout, _ = step({"params": params, **layout})
    for out in (per_head, with_layout):
        np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-5)


def test_init_on_a_single_token_builds_no_step_layout():
    """init makes every collection mutable; jaxlm.load initialises on [1, 1] ids."""
    with decode_kernels.decode_steps("cpu"):
        variables = Gemma(TINY).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    assert set(variables) == {"params"}


def test_the_step_layout_is_built_for_small_models_and_batches_on_cpu_only(amx):
    most, rows = decode_kernels.STEP_LAYOUT_MAX_BYTES, decode_kernels.STEP_LAYOUT_MAX_ROWS
    assert decode_kernels.step_layout_pays("cpu", most, rows) and decode_kernels.step_layout_pays("cpu", 1, 4)
    assert not decode_kernels.step_layout_pays("cpu", most + 1, 4)
    assert not decode_kernels.step_layout_pays("cpu", 1, rows + 1)  # the demo's 40-prompt evaluation
    assert not decode_kernels.step_layout_pays("tpu", 1, 4) and not decode_kernels.step_layout_pays("gpu", 1, 4)
    # narrow kernels: without AMX one row only (several multiply as stored)
    assert decode_kernels.step_layout_pays("cpu", 1, 1, "bfloat16")
    assert decode_kernels.step_layout_pays("cpu", 1, 2, "bfloat16") == amx
    assert decode_kernels.step_layout_pays("cpu", 1, rows, "bfloat16") == amx
    assert not decode_kernels.step_layout_pays("cpu", 1, rows + 1, "bfloat16")
    # float32: without AMX from two rows (one row is a vector-matrix loop either way)
    assert decode_kernels.step_layout_pays("cpu", 1, 1) == amx
    assert decode_kernels.step_layout_pays("cpu", 1, 2)


@pytest.mark.parametrize("eq, kernel, x", [
    ("BTND,NDH->BTH", (4, 3, 8), (2, 1, 4, 3)),   # attention output
    ("BTH,HF->BTF", (8, 12), (2, 1, 8)),          # FFN
])
def test_narrow_kernels_without_the_layout_multiply_as_stored(eq, kernel, x):
    """Without a step layout a narrow single-token product is x @ kernel as stored: equal to
    the einsum to bfloat16 rounding, and one dot of bfloat16 operands (the plain einsum
    widens both)."""
    layer = layers.Einsum(kernel, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), x).astype(jnp.bfloat16)
    params = layer.init(jax.random.key(0), eq, x)
    want = jnp.einsum(eq, np.float32(x), np.float32(params["params"]["kernel"]))
    with decode_kernels.decode_steps("cpu"):
        got = layer.apply(params, eq, x)
        hlo = jax.jit(lambda p, x: layer.apply(p, eq, x)).lower(params, x).compile().as_text()
    assert got.shape == want.shape and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(got), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    assert set(dot_operand_types(hlo)) == {"bf16"}
    plain = jax.jit(lambda p, x: layer.apply(p, eq, x)).lower(params, x).compile().as_text()
    assert "f32" in dot_operand_types(plain)


@pytest.mark.parametrize("batch", [4, 32])
def test_a_bfloat16_decode_loop_multiplies_only_in_the_fast_form(batch, amx):
    """Every product of a bfloat16 generate program on CPU takes bfloat16 operands, at 4 rows
    (through the step layout with AMX, as stored without) and beyond the step layout's rows:
    none widens its weights."""
    assert set(dot_operand_types(_bfloat16_generate_hlo(batch))) == {"bf16"}


def _cache_inputs(dtype, t, kv, b=2, s=16, n=4, d=8):
    """Queries [B, T, N, D] over a cache [B, S, K, D] whose row 1 holds 9 slots so far."""
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (b, t, n, d)) * 0.5
    k, v = (jax.random.normal(key, (b, s, kv, d)) for key in keys[1:])
    mask = jnp.broadcast_to(jnp.arange(s) < jnp.array([s, 9])[:, None], (t, b, s)).transpose(1, 0, 2)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), mask


@pytest.mark.parametrize("t, kv, soft_cap", [(1, 1, None), (1, 2, 2.0), (1, 4, None), (3, 1, 2.0), (3, 4, None)])
def test_the_cpu_cache_core_equals_the_plain_core(t, kv, soft_cap):
    """Decode steps (T = 1) and prefills, one and several KV heads, one query row per head
    (T = 1, G = 1) and several, in float32 (the kernel's math is dtype-free): the same
    attention over the cache."""
    q, k, v, mask = _cache_inputs(jnp.float32, t, kv)
    got, want = (layers.grouped_attention(q, k, v, mask, soft_cap, core=core)
                 for core in (decode_kernels._cpu_cache_core, layers.softmax_attention))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t, kv", [(1, 1), (4, 1), (1, 4)])
def test_bfloat16_cache_attention_multiplies_the_cache_as_it_lies(t, kv):
    """Compiled for CPU, both products take bfloat16 operands (the plain core widens the
    cache to float32), also with one query row per KV head (a matrix-vector product would
    not), and the result is as close to float32 as the plain core's."""
    q, k, v, mask = _cache_inputs(jnp.bfloat16, t, kv)
    def attend(q, k, v):  # writes slots 0..t-1 with what they hold
        return decode_kernels.cached_attention(q, k[:, :t], v[:, :t], {"k": k, "v": v}, 0, mask, None)[0]
    plain = lambda q, k, v: layers.grouped_attention(q, k, v, mask)  # noqa: E731
    ours = dot_operand_types(jax.jit(attend).lower(q, k, v).compile().as_text())
    assert len(ours) == 4 and set(ours) == {"bf16"}
    assert "f32" in dot_operand_types(jax.jit(plain).lower(q, k, v).compile().as_text())
    exact = np.float32(plain(*(np.float32(x) for x in (q, k, v))))
    error = lambda f: float(np.abs(np.float32(f(q, k, v)) - exact).max())  # noqa: E731
    assert error(attend) <= 1.5 * error(plain) + 1e-3


@pytest.mark.parametrize("kv, soft_cap, index", [(1, None, 9), (2, 2.0, 0), (4, None, 15)])
def test_the_float32_step_attention_equals_writing_then_attending(kv, soft_cap, index):
    """One new token attended apart from the old cache: the same output and the same new cache
    as writing it in first, also for a row that sees no slot (its output is wiped to 0)."""
    keys = jax.random.split(jax.random.key(6), 5)
    q = jax.random.normal(keys[0], (3, 1, 4, 8)) * 0.5
    k, v = (jax.random.normal(key, (3, 16, kv, 8)) for key in keys[1:3])
    new_k, new_v = (jax.random.normal(key, (3, 1, kv, 8)) for key in keys[3:])
    mask = (jnp.arange(16) <= jnp.array([index, 9, -1])[:, None])[:, None]  # [B, 1, S]
    cache = {"k": k, "v": v}
    args = (q, new_k, new_v, cache, jnp.int32(index), mask)
    got = decode_kernels._cpu_step_attention(*args, soft_cap=soft_cap)
    want = decode_kernels._write_then_attend(*args, soft_cap=soft_cap)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert not np.asarray(got[0][2]).any()
    for name in ("k", "v"):
        np.testing.assert_array_equal(got[1][name], want[1][name])


def test_a_float32_decode_loop_updates_its_cache_in_place():
    """The compiled float32 generate program on CPU copies no KV cache: XLA:CPU copied each
    layer's key and value cache four times a step when the step attended over the updated
    cache (the 270M at batch 4: ~6 ms of a ~58 ms step)."""
    from jaxlm import decode, sampling
    model = Gemma(TINY)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    fn = decode._compiled(model, sampling.resolve("greedy"), 4, 8, 32, False, None)
    args = (np.zeros((4, 8), np.int32), np.full((4,), 4, np.int32), np.int32(32), np.int32(0),
            np.full((decode._STOP_SLOTS,), -1, np.int32))
    hlo = fn.lower(params, *args).compile().as_text()
    cache = f"f32[4,32,{TINY.num_kv_heads},{TINY.head_dim}]"
    assert re.search(re.escape(cache) + r"\{[\d,]+\} dynamic-update-slice", hlo)  # the test's shape
    assert not re.search(re.escape(cache) + r"\{[\d,]+\} copy\(", hlo)


@pytest.mark.parametrize("platform, dtype, cpu_kernel", NARROW_KERNEL_CHOICES)
def test_the_cache_attention_kernel_is_chosen_by_platform_and_dtype(platform, dtype, cpu_kernel):
    model = Gemma(TINY.replace(dtype=dtype))
    ids = jnp.zeros((2, 1), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids))["params"]
    step = lambda p, c: model.apply({"params": p}, ids, cache=c, cache_index=3)  # noqa: E731
    lowered = jax.jit(step).trace(params, init_cache(TINY.replace(dtype=dtype), 2, 8)).lower(
        lowering_platforms=(platform,))
    text = lowered.as_text(debug_info=True)
    assert ("cpu_kernel/cpu_cache_attention" in text) == cpu_kernel
    # a float32 step attends apart from the old cache on CPU only
    assert ("cpu_kernel/cpu_step_attention" in text) == (platform == "cpu" and dtype == "float32")


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_products_equal_the_einsum(b, dtype, amx):
    """rows @ x^T (the step layout's and the tied logits' product) equals x @ rows^T, to
    bfloat16 rounding where narrow."""
    rows, x = (a.astype(dtype) for a in narrow((96, 40), (b, 40)))
    got = jax.jit(decode_kernels.matmul_rows)(rows, x)
    want = np.float32(x) @ np.float32(rows).T
    assert got.shape == (b, 96) and got.dtype == dtype
    tol = 1e-2 if dtype == "bfloat16" else 1e-6
    np.testing.assert_allclose(np.float32(got), want, rtol=tol, atol=tol * np.abs(want).max())


def test_bfloat16_decode_products_multiply_the_rows_in_place(amx):
    """Compiled, a narrow product with several rows of x is one dot of bfloat16 operands
    (XLA:CPU's fast form; the plain product widens), and with one row, without AMX, a loop
    that reads the bfloat16 rows in place: no float32 copy of them in either."""
    for b in (1, 4):
        rows, x = narrow((96, 40), (b, 40))
        hlo = jax.jit(decode_kernels.matmul_rows).lower(rows, x).compile().as_text()
        assert "f32[96,40]" not in _written(hlo)
        if b == 1 and not amx:
            assert any("_dot_fusion" in line and "fusion(%rows" in line and "kind=kLoop" in line
                       for line in hlo.split("ENTRY")[1].splitlines())
        else:
            assert set(dot_operand_types(hlo)) == {"bf16"}
    wide = dot_operand_types(jax.jit(lambda r, x: r @ x.T).lower(rows, x).compile().as_text())
    assert "f32" in wide  # what the plain product compiles to


def test_a_float32_row_is_a_loop_without_amx_and_a_dot_with_it(amx):
    """One float32 row: the vector-matrix loop (a kLoop fusion reading the rows in place) where
    it is the fast form, XLA's matrix-vector dot on the AMX Xeon, where the loop read the
    weights at half its speed (see `matmul_rows`)."""
    rows, x = (a.astype("float32") for a in narrow((96, 40), (1, 40)))
    entry = jax.jit(decode_kernels.matmul_rows).lower(rows, x).compile().as_text().split("ENTRY")[1]
    loop = any("_dot_fusion" in line and "kind=kLoop" in line for line in entry.splitlines())
    assert loop == (not amx)
    assert any(re.search(r"= f32\[96,1\]\{[\d,]*\} dot\(", line) for line in entry.splitlines()) == amx


@pytest.mark.parametrize("batch", [1, 4])
def test_a_bfloat16_decode_loop_holds_no_float32_copy_of_the_table(batch, amx):
    """The compiled generate program of a bfloat16 Gemma on CPU reads its tied table in place,
    for the lookup (as bits) and for the logits: XLA:CPU otherwise widened the whole table
    to float32 once a call and kept it for the loop (the 270M: 671 MB and ~160 ms a call)."""
    hlo = _bfloat16_generate_hlo(batch)
    table = f"[{BF16_DECODE.vocab_size},{BF16_DECODE.hidden_dim}]"
    arrays = _written(hlo)
    assert f"bf16{table}" in arrays and f"f32{table}" not in arrays


def _bfloat16_generate_hlo(batch: int) -> str:
    """The compiled CPU generate program (greedy, 8-token prompts, 16 tokens) of a bfloat16
    Gemma (`BF16_DECODE`) for `batch` rows."""
    from jaxlm import decode, sampling
    model = Gemma(BF16_DECODE)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    fn = decode._compiled(model, sampling.resolve("greedy"), batch, 8, 16, False, None)
    args = (np.zeros((batch, 8), np.int32), np.full((batch,), 4, np.int32), np.int32(16), np.int32(0),
            np.full((decode._STOP_SLOTS,), -1, np.int32))
    return fn.lower(params, *args).compile().as_text()


def _written(hlo: str) -> list[str]:
    """The types (as "f32[96,40]") of the arrays compiled HLO text writes out: its instructions
    outside fusions (a fusion's own instructions are computed element by element as it runs)."""
    fused = set(re.findall(r"kind=k\w+, calls=(%[\w.-]+)", hlo))
    out, keep = [], True
    for line in hlo.splitlines():
        head = re.match(r"(ENTRY )?(%[\w.-]+) ", line)
        if head:
            keep = head.group(2) not in fused
        elif keep and " = " in line:
            out.append(line.split(" = ", 1)[1].split("{", 1)[0])
    return out
