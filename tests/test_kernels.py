"""models/kernels.py: each XLA:CPU kernel equals the plain math it replaces (values and, for
training, gradients), and each is chosen by the platform: the CPU one only in programs for
CPU, the plain math for TPU and GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from fast_form import NARROW_KERNEL_CHOICES, dot_operand_types, narrow, transposed_sizes
from models import ffn_kernels, kernels, layers
from models.gemma import PRESETS, Gemma

TINY = PRESETS["gemma_tiny"].replace(vocab_size=256, num_layers=1)


def test_cpu_ffn_backward_equals_autodiff():
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (24, 16))
    ws = [jax.random.normal(k, s) * 0.5 for k, s in zip(keys[1:4], [(16, 40), (16, 40), (40, 16)])]
    d_out = jax.random.normal(keys[4], (24, 16))
    np.testing.assert_allclose(ffn_kernels._cpu_gated_ffn(x, *ws), layers.gated_ffn(x, *ws),
                               rtol=1e-6, atol=1e-6)
    _, ours = jax.vjp(ffn_kernels._cpu_gated_ffn, x, *ws)
    _, reference = jax.vjp(layers.gated_ffn, x, *ws)
    for a, b in zip(ours(d_out), reference(d_out)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_frozen_ffn_kernels_get_no_gradient_work():
    """Differentiated for x only (a LoRA step leaves the FFN frozen), the CPU backward runs
    the input gradient's two products and no [H, F] weight gradient; for x and the kernels,
    all of them, equal to autodiff's."""
    x = jax.random.normal(jax.random.key(0), (6, 4))
    ws = [jax.random.normal(jax.random.key(i), s) for i, s in ((1, (4, 10)), (2, (4, 10)), (3, (10, 4)))]
    loss = lambda f: lambda x, *w: f(x, *w).sum()  # noqa: E731
    frozen = str(jax.make_jaxpr(jax.grad(loss(ffn_kernels._cpu_gated_ffn)))(x, *ws))
    trained = str(jax.make_jaxpr(jax.grad(loss(ffn_kernels._cpu_gated_ffn), argnums=(0, 1, 2, 3)))(x, *ws))
    assert "f32[4,10] = dot_general" not in frozen and "f32[4,10] = dot_general" in trained
    np.testing.assert_allclose(jax.grad(loss(ffn_kernels._cpu_gated_ffn))(x, *ws),
                               jax.grad(loss(layers.gated_ffn))(x, *ws), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slice_bytes", [None, 4 * 16 * 16])
def test_every_product_of_the_bfloat16_ffn_kernel_multiplies_bfloat16(monkeypatch, slice_bytes):
    """Compiled, the forward and the full backward (input and kernel gradients) of a bfloat16
    FFN, whole or a slice of F at a time, take bfloat16 operands in every product (a
    transposed operand written out, float32 results): autodiff's take float32 in some, and so
    did this kernel's before. Its values and gradients stay as close to float32 as autodiff's."""
    if slice_bytes:
        monkeypatch.setattr(kernels, "SLICE_BYTES", slice_bytes)
    x, w_gate, w_up, w_down, d_out = narrow((24, 16), (16, 64), (16, 64), (64, 16), (24, 16))

    def grads(f, *args):
        out, vjp = jax.vjp(f, *args)
        return [out, *vjp(d_out.astype(out.dtype))]

    def types(f):
        return dot_operand_types(jax.jit(lambda *a: grads(f, *a)).lower(
            x, w_gate, w_up, w_down).compile().as_text())
    ours, plain = types(ffn_kernels._cpu_gated_ffn), types(layers.gated_ffn)
    assert len(ours) >= 2 * 9 and set(ours) == {"bf16"}
    assert "f32" in plain
    exact = grads(layers.gated_ffn, *(a.astype(jnp.float32) for a in (x, w_gate, w_up, w_down)))

    def error(f):
        got = grads(f, x, w_gate, w_up, w_down)
        return sum(float(np.abs(np.float32(g) - e).max() / np.abs(e).max()) for g, e in zip(got, exact))
    assert error(ffn_kernels._cpu_gated_ffn) <= 1.2 * error(layers.gated_ffn) + 1e-3


def test_narrow_ffn_kernels_go_a_slice_at_a_time_with_the_same_values_and_gradients(monkeypatch):
    """bfloat16 kernels split in F (4 slices here) give the whole-kernel products' values and
    gradients, for the input alone (LoRA) and for input and kernels (full fine-tune)."""
    x, w_gate, w_up, w_down, d_out = narrow((24, 16), (16, 64), (16, 64), (64, 16), (24, 16))
    monkeypatch.setattr(kernels, "SLICE_BYTES", 4 * 16 * 16)
    assert kernels.slices(16, 64, jnp.bfloat16) == 4 and kernels.slices(16, 64, jnp.float32) == 1
    ws = (w_gate, w_up, w_down)
    wide = [a.astype(jnp.float32) for a in (x, *ws, d_out)]
    ours, vjp = jax.vjp(ffn_kernels._cpu_gated_ffn, x, *ws)
    reference, reference_vjp = jax.vjp(layers.gated_ffn, *wide[:4])
    def close(a, b):  # bfloat16 rounding, on the scale of the array
        np.testing.assert_allclose(np.float32(a), b, rtol=0, atol=0.02 * float(np.abs(b).max()))
    close(ours, reference)
    assert ours.dtype == jnp.bfloat16
    for a, b in zip(vjp(d_out), reference_vjp(wide[4])):
        assert a.shape == b.shape
        close(a, b)
    d_x = jax.grad(lambda x: ffn_kernels._cpu_gated_ffn(x, *ws).astype(jnp.float32).sum())(x)
    close(d_x, jax.grad(lambda x: layers.gated_ffn(x, *wide[1:4]).sum())(wide[0]))


@pytest.mark.parametrize("slice_bytes", [None, 4 * 32 * 16])
def test_the_bfloat16_ffn_input_gradient_multiplies_its_kernels_in_place_without_amx(monkeypatch, amx, slice_bytes):
    """Without AMX the backward multiplies each kernel (or slice of F) transposed in place and
    transposes nothing of a kernel's size; with AMX it writes the kernels out transposed
    first. Either way every compiled product takes bfloat16 and d_x is autodiff's to
    bfloat16 rounding."""
    if slice_bytes:
        monkeypatch.setattr(kernels, "SLICE_BYTES", slice_bytes)  # 4 slices of F
    x, w_gate, w_up, w_down, d_out = narrow((4, 32), (32, 64), (32, 64), (64, 32), (4, 32))

    def d_x(x, *ws):
        return jax.vjp(lambda x: ffn_kernels._cpu_gated_ffn(x, *ws), x)[1](d_out)[0]
    kernel = 32 * 64 // kernels.slices(32, 64, jnp.bfloat16)  # elements of a kernel (slice)
    transposed = transposed_sizes(jax.make_jaxpr(d_x)(x, w_gate, w_up, w_down).jaxpr)
    assert (kernel in transposed) == amx, transposed
    types = dot_operand_types(jax.jit(d_x).lower(x, w_gate, w_up, w_down).compile().as_text())
    assert len(types) >= 6 and set(types) == {"bf16"}
    wide = [a.astype(jnp.float32) for a in (x, w_gate, w_up, w_down, d_out)]
    reference = jax.vjp(lambda x: layers.gated_ffn(x, *wide[1:4]), wide[0])[1](wide[4])[0]
    ours = np.float32(jax.jit(d_x)(x, w_gate, w_up, w_down))
    np.testing.assert_allclose(ours, reference, rtol=0, atol=0.02 * float(np.abs(reference).max()))


def test_a_narrow_tied_table_goes_a_slice_of_the_vocabulary_at_a_time(monkeypatch):
    h, emb = narrow((6, 16), (40, 16))
    monkeypatch.setattr(kernels, "SLICE_BYTES", 4 * 16 * 10)
    assert kernels.slices(16, 40, jnp.bfloat16) == 4
    ours = kernels._cpu_tied_logits(h, emb)
    assert ours.dtype == jnp.float32 and ours.shape == (6, 40)
    reference = kernels._tied_logits(h, emb)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=0.01 * float(np.abs(reference).max()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab, sliced", [(40, True), (37, False)])
def test_the_hidden_gradient_goes_a_slice_of_the_vocabulary_at_a_time(monkeypatch, dtype, vocab, sliced):
    """d @ emb as a loop over slices of the table's rows (here 4 of 10: the slice is float32
    rows' bytes) equals the one product, to float32 summation order; a vocabulary with no even
    split of the slice size runs whole."""
    monkeypatch.setattr(kernels, "HIDDEN_GRADIENT_ROWS", 10 if dtype == "float32" else 5)
    d, emb = (a.astype(dtype) for a in narrow((6, vocab), (vocab, 16)))
    ours = jax.jit(kernels._cpu_tied_hidden_gradient)(d, emb)
    jaxpr = str(jax.make_jaxpr(kernels._cpu_tied_hidden_gradient)(d, emb))
    assert ("scan[" in jaxpr and "length=4" in jaxpr) == sliced
    assert ours.dtype == jnp.float32 and ours.shape == (6, 16)
    reference = np.float32(d) @ np.float32(emb)
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5 * float(np.abs(reference).max()))


def test_the_hidden_gradient_multiplies_the_whole_table_in_a_program_on_several_devices(monkeypatch):
    """A layout may split the table over its vocabulary: on a mesh the slices would gather it."""
    monkeypatch.setattr(kernels, "HIDDEN_GRADIENT_ROWS", 10)
    d, emb = narrow((6, 40), (40, 16))
    def jaxpr():  # traced afresh each time: jax caches a trace per function, not per context
        return str(jax.make_jaxpr(lambda d, emb: kernels._cpu_tied_hidden_gradient(d, emb))(d, emb))
    with layers.activation_layout(Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("batch", "model")), {}):
        assert "scan[" not in jaxpr()
    assert "scan[" in jaxpr()


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_no_widened_copy_of_a_narrow_weight_outlives_its_slice(monkeypatch):
    """What the slicing is for: XLA:CPU's compiled LoRA-style FFN gradient and tied logits of
    bfloat16 weights hold no float32 copy of a whole weight (each 4 MiB here), only slices."""
    h, f, v = 256, 4096, 4096
    x, w_gate, w_up, w_down, emb = narrow((64, h), (h, f), (h, f), (f, h), (v, h))
    whole = 4 * h * f
    monkeypatch.setattr(kernels, "SLICE_BYTES", whole // 8)
    ffn_grad = jax.grad(lambda x, *ws: ffn_kernels._cpu_gated_ffn(x, *ws).astype(jnp.float32).sum())
    assert _temp_bytes(ffn_grad, x, w_gate, w_up, w_down) < whole
    assert _temp_bytes(kernels._cpu_tied_logits, x, emb) < whole // 2 + 4 * 64 * v


def test_a_bfloat16_lora_step_is_the_same_sliced_or_whole(monkeypatch):
    """The slices in a whole model: a bfloat16 Gemma's LoRA loss and adapter gradients (the FFN
    and the tied logits sliced, frozen base, symbolic zeros) equal those with one slice."""
    from jaxlm import lora
    from jaxlm.train.loss import lm_loss_fn
    cfg = TINY.replace(num_layers=2, scan_layers=False, dtype="bfloat16")
    model = Gemma(cfg)
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16),
                          model.init(jax.random.key(0), ids[:, :-1])["params"])
    adapters = lora.init(params, 4, key=jax.random.key(2))
    adapters = jax.tree.map(lambda a: a + 0.1, adapters)  # B starts at zero: make it count
    batch = {"token_ids": ids, "padding_mask": jnp.ones_like(ids, bool)}
    loss = lm_loss_fn(model)

    def value_and_grad():  # traced afresh: the slice count is read while tracing
        f = lambda a: loss(lora.merge(params, a), batch, None)[0].astype(jnp.float32)  # noqa: E731
        return jax.jit(jax.value_and_grad(f))(adapters)
    whole = value_and_grad()
    monkeypatch.setattr(kernels, "SLICE_BYTES", cfg.hidden_dim * cfg.ffw_dim)  # 4 FFN slices
    assert kernels.slices(cfg.hidden_dim, cfg.ffw_dim, jnp.bfloat16) == 4
    assert kernels.slices(cfg.hidden_dim, cfg.vocab_size, jnp.bfloat16) > 1
    sliced = value_and_grad()
    np.testing.assert_allclose(sliced[0], whole[0], rtol=1e-2)
    for a, b in zip(jax.tree.leaves(sliced[1]), jax.tree.leaves(whole[1])):
        scale = float(np.abs(np.float32(b)).max())
        assert scale > 0
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=0, atol=0.05 * scale)


def test_the_narrow_geglu_kernel_rounds_once_and_stays_closer_to_float32():
    """gelu_tanh(gate) * up and its gradients from bfloat16 gate and up: the CPU kernel's
    values and gradients are as close to float32's (computed from the same rounded inputs) as
    the plain math's or closer, and its float32 is the plain math exactly."""
    gate, up, d = (a * 4 for a in narrow((64, 96), (64, 96), (64, 96)))

    def grads(f, *args):
        out, vjp = jax.vjp(f, *args)
        return [out, *vjp(d.astype(out.dtype))]
    exact = grads(layers.geglu, gate.astype(jnp.float32), up.astype(jnp.float32))

    def errors(f):
        return [float(np.abs(np.float32(g) - e).max() / np.abs(e).max())
                for g, e in zip(grads(jax.jit(f), gate, up), exact)]
    ours, plain = errors(ffn_kernels._cpu_geglu), errors(layers.geglu)
    assert all(o <= p for o, p in zip(ours, plain)) and sum(ours) < 0.5 * sum(plain), (ours, plain)
    assert all(o <= 2 ** -8 for o in ours), ours  # one bfloat16 rounding of each
    wide = [a.astype(jnp.float32) for a in (gate, up)]
    for g, e in zip(grads(ffn_kernels._cpu_geglu, *wide), exact):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)  # jax.nn.gelu arranges it apart


def test_the_geglu_backward_waits_for_its_cotangent():
    """Each layer's backward GELU depends on its cotangent, so XLA computes it in that layer's
    backward: computed from the saved gate alone, it was scheduled ahead and every layer's
    float32 tanh [N, F] was alive at once (the real Gemma 3 270M's bfloat16 LoRA step:
    1.012 -> 0.871 GiB of temporaries). A layer of this stack keeps its bfloat16 gate, up and
    activation for the backward pass (6 bytes an [N, F] element), not a float32 tanh more (10)."""
    n, d, f = 64, 32, 256
    keys = jax.random.split(jax.random.key(0), 3)

    def temps(layers):
        w = [(jax.random.normal(k, (layers, *s)) * 0.1).astype(jnp.bfloat16)
             for k, s in zip(keys, [(d, f), (d, f), (f, d)])]

        def loss(x):
            for i in range(layers):
                x = x + ffn_kernels.geglu(x @ w[0][i], x @ w[1][i]) @ w[2][i]
            return x.astype(jnp.float32).sum()
        x = jnp.ones((n, d), jnp.bfloat16)
        return jax.jit(jax.grad(loss)).lower(x).compile().memory_analysis().temp_size_in_bytes
    assert (temps(8) - temps(4)) / 4 < 8 * n * f


@pytest.mark.parametrize("platform, cpu_kernel", [("cpu", True), ("tpu", False)])
def test_the_geglu_kernel_is_chosen_by_the_platform_lowered_for_in_a_narrow_dtype(platform, cpu_kernel):
    gate, up = narrow((4, 16), (4, 16))
    lowered = jax.jit(ffn_kernels.geglu).trace(gate, up).lower(lowering_platforms=(platform,))
    assert ("cpu_kernel/_cpu_geglu" in lowered.as_text(debug_info=True)) == cpu_kernel
    wide = jax.jit(ffn_kernels.geglu).trace(*(a.astype(jnp.float32) for a in (gate, up)))
    assert "cpu_kernel" not in wide.lower(lowering_platforms=(platform,)).as_text(debug_info=True)


@pytest.mark.parametrize("platform, cpu_kernel", [("cpu", True), ("tpu", False)])
def test_the_tied_logits_kernel_is_chosen_by_the_platform_lowered_for(platform, cpu_kernel):
    h, emb, d = narrow((4, 16), (40, 16), (4, 40))
    lowered = jax.jit(kernels.tied_logits).trace(h, emb).lower(lowering_platforms=(platform,))
    assert ("cpu_kernel/_cpu_tied_logits" in lowered.as_text(debug_info=True)) == cpu_kernel
    lowered = jax.jit(kernels.tied_hidden_gradient).trace(d, emb).lower(lowering_platforms=(platform,))
    assert ("cpu_kernel/_cpu_tied_hidden_gradient" in lowered.as_text(debug_info=True)) == cpu_kernel


def _loss_grad(model, ids):
    def loss(p):
        return model.apply({"params": p}, ids).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss))


@pytest.mark.parametrize("platform, cpu_kernel", [("cpu", True), ("tpu", False), ("cuda", False)])
def test_the_ffn_kernel_is_chosen_by_the_platform_lowered_for(platform, cpu_kernel):
    """A model's training gradient lowered for TPU or GPU (as jaxlm.train.aot does from a CPU
    host) holds the plain FFN only; lowered for CPU, the written-out backward."""
    model = Gemma(TINY)
    ids = jnp.zeros((2, 8), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids))["params"]
    lowered = jax.jit(_loss_grad(model, ids)).trace(params).lower(lowering_platforms=(platform,))
    assert ("cpu_kernel/_cpu_gated_ffn" in lowered.as_text(debug_info=True)) == cpu_kernel


def _attention_inputs(dtype, b=2, t=12, n=4, kv=2, d=8):
    keys = jax.random.split(jax.random.key(3), 4)
    q, d_out = (jax.random.normal(k, (b, t, n, d)).astype(dtype) for k in (keys[0], keys[3]))
    k, v = (jax.random.normal(key, (b, t, kv, d)).astype(dtype) for key in keys[1:3])
    pos = jnp.arange(t)
    mask = (pos[:, None] >= pos[None, :])[None] & (pos < jnp.array([t, 7])[:, None])[:, None, :]
    return q * 0.5, k, v, mask, d_out


@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_the_cpu_attention_core_equals_the_plain_core(soft_cap):
    """Values and gradients of q, k and v, in float32 (the kernel's math is dtype-free)."""
    q, k, v, mask, d_out = _attention_inputs(jnp.float32)
    results = []
    for core in (kernels._cpu_softmax_attention, layers.softmax_attention):
        f = lambda q, k, v, core=core: layers.grouped_attention(  # noqa: E731
            q, k, v, mask, soft_cap, causal=True, block=4, core=core)
        out, vjp = jax.vjp(f, q, k, v)
        results.append((out, *vjp(d_out)))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bfloat16_attention_through_the_cpu_kernel_is_as_close_to_float32_as_the_plain_one():
    wide = _attention_inputs(jnp.float32)
    narrow = [x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in wide]

    def grads(inputs, core):
        q, k, v, mask, d_out = inputs
        out, vjp = jax.vjp(lambda q, k, v: layers.grouped_attention(
            q, k, v, mask, causal=True, block=4, core=core), q, k, v)
        return [np.float32(x) for x in (out, *vjp(d_out))]
    exact = grads(wide, layers.softmax_attention)

    def errors(got):
        return [float(np.abs(g - e).max() / np.abs(e).max()) for g, e in zip(got, exact)]
    ours, plain = errors(grads(narrow, kernels._cpu_softmax_attention)), errors(grads(narrow, layers.softmax_attention))
    assert max(ours) < 0.03
    assert sum(ours) <= 1.1 * sum(plain)


def test_every_product_of_the_bfloat16_cpu_attention_multiplies_bfloat16():
    """XLA:CPU multiplies a dot with a column-major operand in float32: compiled, every
    product of the kernel's forward and backward takes bfloat16 operands (autodiff's do not)."""
    q, k, v, mask, _ = _attention_inputs(jnp.bfloat16, t=64, d=16)  # two KV heads: q, k, v transposed

    def types(core):
        def f(q, k, v):  # a loss that needs the output's value: all six products
            out = layers.grouped_attention(q, k, v, mask, causal=True, block=64, core=core)
            return jnp.sum(jnp.square(out.astype(jnp.float32)))
        return dot_operand_types(jax.jit(jax.grad(f, (0, 1, 2))).lower(q, k, v).compile().as_text())
    ours, plain = types(kernels._cpu_softmax_attention), types(layers.softmax_attention)
    assert len(ours) == 12 and set(ours) == {"bf16"}
    assert "f32" in plain


@pytest.mark.parametrize("platform, dtype, cpu_kernel", NARROW_KERNEL_CHOICES)
def test_the_attention_kernel_is_chosen_by_platform_and_dtype(platform, dtype, cpu_kernel):
    model = Gemma(TINY.replace(dtype=dtype))
    ids = jnp.zeros((2, 8), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids))["params"]
    lowered = jax.jit(_loss_grad(model, ids)).trace(params).lower(lowering_platforms=(platform,))
    assert ("cpu_kernel/cpu_attention" in lowered.as_text(debug_info=True)) == cpu_kernel
