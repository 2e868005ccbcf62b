"""The chunked LM loss equals a naive full-logits loss with KerasHub's packing semantics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ragged_batch
from fast_form import NARROW_KERNEL_CHOICES, buffers, dots
from jaxlm.train import loss as L
from models.gemma import Gemma, PRESETS

CFG = PRESETS["gemma_tiny"].replace(vocab_size=512, num_layers=1)


@pytest.fixture(scope="module")
def model_params():
    model = Gemma(CFG)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return model, params


def _on_a_mesh(monkeypatch):
    """Trace as in a program on several devices, where a frozen table's loss is token-major."""
    monkeypatch.setattr(L.layers, "traced_devices", lambda: 2)


def keras_reference(logits, y, sw):
    """Per-token CE as Keras' SparseCategoricalCrossentropy(from_logits=True), in numpy float64."""
    logits = np.asarray(logits, np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce = lse - np.take_along_axis(logits, y[..., None], -1)[..., 0]
    return (ce * sw).sum() / sw.sum(), ((logits.argmax(-1) == y) * sw).sum() / sw.sum()


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])  # 7 does not divide T=11: the tail is padded
def test_chunked_equals_naive(model_params, chunk):
    model, params = model_params
    ids, mask = ragged_batch(CFG.vocab_size, [12, 5, 9], 12)
    ids[np.arange(3), np.asarray([12, 5, 9]) - 1] = 1  # EOS ends each packed row
    batch = {"token_ids": jnp.asarray(ids), "padding_mask": jnp.asarray(mask)}
    loss_sum, m = L.lm_loss_fn(model, chunk_size=chunk)(params, batch, None)

    x, xm, y, sw = ids[:, :-1], mask[:, :-1], ids[:, 1:], mask[:, 1:]
    logits = model.apply({"params": params}, x, xm)
    ref_loss, ref_acc = keras_reference(logits, y, sw.astype(np.float64))
    naive = L.naive_cross_entropy(logits, y, sw)
    assert float(m["count"]) == sw.sum() == 11 + 4 + 8
    np.testing.assert_allclose(float(loss_sum / m["count"]), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(float(m["correct"] / m["count"]), ref_acc, rtol=1e-6)
    np.testing.assert_allclose(float(m["loss_sum"]), float(naive["loss_sum"]), rtol=1e-5)


def test_chunked_gradient_equals_naive(model_params):
    model, params = model_params
    ids, mask = ragged_batch(CFG.vocab_size, [10, 6], 10, seed=3)
    batch = {"token_ids": jnp.asarray(ids), "padding_mask": jnp.asarray(mask)}

    def naive(p):
        x, xm, y, sw = L.shift(batch["token_ids"], batch["padding_mask"])
        return L.naive_cross_entropy(model.apply({"params": p}, x, xm), y, sw)["loss_sum"]

    chunked = lambda p: L.lm_loss_fn(model, chunk_size=4)(p, batch, None)[0]  # noqa: E731
    g1, g2 = jax.grad(chunked)(params), jax.grad(naive)(params)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)


def test_padding_is_ignored(model_params):
    """Extra right padding changes neither the loss nor the count (we divide by real tokens)."""
    model, params = model_params
    ids, mask = ragged_batch(CFG.vocab_size, [6, 4], 6)
    wide_ids = np.pad(ids, ((0, 0), (0, 5)))
    wide_mask = np.pad(mask, ((0, 0), (0, 5)))
    f = L.lm_loss_fn(model, chunk_size=4)
    a = f(params, {"token_ids": ids, "padding_mask": mask}, None)[1]
    b = f(params, {"token_ids": wide_ids, "padding_mask": wide_mask}, None)[1]
    assert float(a["count"]) == float(b["count"]) == 5 + 3
    np.testing.assert_allclose(float(a["loss_sum"]), float(b["loss_sum"]), rtol=1e-5)


def test_no_full_logits_in_float32():
    """The jaxpr of the chunked loss never holds a [B, T, V] float32 array."""
    b, t, h, v = 2, 64, 16, 1000
    hidden = jnp.zeros((b, t, h), jnp.bfloat16)
    emb = jnp.zeros((v, h), jnp.bfloat16)
    y = jnp.zeros((b, t), jnp.int32)
    w = jnp.ones((b, t))
    f = lambda hh, e: L.chunked_cross_entropy(hh, e, y, w, chunk_size=8)["loss_sum"]  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(hidden, emb))
    assert f"f32[{b},{t},{v}]" not in jaxpr and f"bf16[{b},{t},{v}]" not in jaxpr
    assert f"f32[{b},8,{v}]" in jaxpr  # the chunk is there


def test_default_chunk_keeps_a_gemma3_vocabulary_block_within_budget():
    """Gemma 3's 262k vocabulary at 8 x 40 tokens: without a logits budget one [8, 40, V] float32
    block is 335 MB, held by every model-axis device under the seed layout (an OOM on 8 simulated
    CPU devices). The default chunk keeps every [B, C, V] block within CHUNK_LOGITS."""
    b, t, h, v = 8, 40, 16, 262_144
    assert L.chunk_length(b, t, v) * b * v <= L.CHUNK_LOGITS["cpu"] < b * t * v
    # Accelerators take 16x larger blocks: Gemma 2B at 2 x 2048 tokens runs 8 chunks, not 128.
    assert L.chunk_length(2, 2048, 256_000, L.CHUNK_LOGITS["gpu"]) == 256
    assert L.chunk_length(2, 6, 100) == 6  # small vocabularies: one chunk
    abstract = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    f = lambda hh, e: L.chunked_cross_entropy(  # noqa: E731
        hh, e, jnp.zeros((b, t), jnp.int32), jnp.ones((b, t)))["loss_sum"]
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0,)))(abstract((b, t, h), jnp.float32),
                                                       abstract((v, h), jnp.float32))
    text = str(jaxpr)
    c = L.chunk_length(b, t, v)
    assert f"f32[{b},{c},{v}]" in text and f"f32[{b},{t},{v}]" not in text


def test_final_logit_soft_cap_matches_the_model():
    """Gemma 2's capped logits: the chunked loss caps per chunk exactly as the model does."""
    cfg = CFG.replace(final_logit_soft_cap=0.5)  # small, so the cap changes the loss a lot
    model = Gemma(cfg)
    params = model.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"]
    ids, mask = ragged_batch(cfg.vocab_size, [9, 6], 9, seed=2)
    _, m = L.lm_loss_fn(model, chunk_size=4)(params, {"token_ids": ids, "padding_mask": mask}, None)
    x, xm, y, sw = ids[:, :-1], mask[:, :-1], ids[:, 1:], mask[:, 1:]
    naive = L.naive_cross_entropy(model.apply({"params": params}, x, xm), y, sw)
    uncapped = L.naive_cross_entropy(Gemma(CFG).apply({"params": params}, x, xm), y, sw)
    np.testing.assert_allclose(float(m["loss_sum"]), float(naive["loss_sum"]), rtol=1e-5)
    assert abs(float(naive["loss_sum"]) - float(uncapped["loss_sum"])) > 1e-3


@pytest.mark.parametrize("path", ["online", "token_major"])
def test_hits_break_ties_as_argmax(monkeypatch, path):
    """`correct` counts jnp.argmax hits: on a tied maximum only the first index is a hit, and
    the loss equals the naive one there too (sum and first index share one reduction), for the
    loss alone and with its gradient; online the tie is between slices of the vocabulary."""
    if path == "token_major":
        _on_a_mesh(monkeypatch)
    monkeypatch.setattr(L.online_softmax, "COLUMNS", 10)  # 4 slices: 7 and 23 in the 1st and 3rd
    v, h = 40, 4
    emb = np.zeros((v, h), np.float32)
    emb[7] = emb[23] = [3.0, 0, 0, 0]  # tokens 7 and 23 tie for the top logit
    emb[30] = [1.0, 0, 0, 0]
    hidden = jnp.asarray(np.tile([[[1.0, 0, 0, 0]]], (1, 4, 1)), jnp.float32)  # [1, 4, H]
    y = jnp.asarray([[7, 23, 7, 30]], jnp.int32)  # first-index rule: 2 hits (last: 1, any: 3)
    w = jnp.ones((1, 4), jnp.float32)
    naive = L.naive_cross_entropy(hidden @ emb.T, y, w)
    for chunk in (1, 4):
        def f(hh):
            m = L.chunked_cross_entropy(hh, jnp.asarray(emb), y, w, chunk_size=chunk)
            return m["loss_sum"], m
        for m in (f(hidden)[1], jax.grad(f, has_aux=True)(hidden)[1]):
            assert float(m["correct"]) == float(naive["correct"]) == 2.0  # the two 7s
            np.testing.assert_allclose(float(m["loss_sum"]), float(naive["loss_sum"]), rtol=1e-6)


def test_a_frozen_embedding_gets_no_gradient_work():
    """With the tied embedding frozen (a LoRA step) the loss computes d_hidden only: no float32
    [H, V] accumulator is traced, and d_hidden equals the one computed with the embedding
    trained (and the naive loss's)."""
    b, t, h, v = 2, 12, 6, 300  # h != b * chunk: the logits block is f32[8, 300]
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (b, t, h))
    emb = jax.random.normal(keys[1], (v, h)) * 0.3
    y = jax.random.randint(keys[2], (b, t), 0, v)
    w = jnp.ones((b, t))
    f = lambda hh, e: L.chunked_cross_entropy(hh, e, y, w, chunk_size=4)["loss_sum"]  # noqa: E731
    frozen = jax.make_jaxpr(jax.grad(f))(hidden, emb)
    trained = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(hidden, emb)
    assert f"f32[{h},{v}]" not in str(frozen) and f"f32[{h},{v}]" in str(trained)
    naive = jax.grad(lambda hh: L.naive_cross_entropy(hh @ emb.T, y, w)["loss_sum"])(hidden)
    np.testing.assert_allclose(jax.grad(f)(hidden, emb), naive, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(f, argnums=(0, 1))(hidden, emb)[0], naive, rtol=1e-5, atol=1e-6)


def test_cpu_chunks_of_a_large_vocabulary_hold_half_the_hidden_width_in_tokens():
    """Gemma 3 270M on one CPU device: 8 x 128 tokens in 4 chunks of 32 positions (256 tokens
    >= H/2), not 32 chunks of 4; the bench config's 32 MiB blocks are unchanged; devices
    sharing the host split the budget."""
    v, h = 262_144, 640
    assert L.chunk_length(8, 128, v, L.cpu_budget(v, h, devices=1)) == 32
    assert L.chunk_length(8, 128, v, L.CHUNK_LOGITS["cpu"]) == 4
    assert L.cpu_budget(32_000, 512) == L.CHUNK_LOGITS["cpu"]
    assert L.cpu_budget(v, h, devices=8) == (h // 2) * v // 8 < L.cpu_budget(v, h)
    assert L.cpu_budget(4096, 16, devices=8) == L.CHUNK_LOGITS["cpu"]  # never below the floor


def test_cpu_chunks_split_between_every_device_of_the_run(monkeypatch):
    """One of 2 processes x 4 devices (jaxlm.launch on one machine) takes the blocks the single
    process of 8 devices takes, not twice them: its devices share the machine with the other's."""
    v, h = 262_144, 640
    one_process = L.chunk_length(8, 40, v, hidden=h)
    assert one_process == L.chunk_length(8, 40, v, L.cpu_budget(v, h, devices=jax.device_count()))
    monkeypatch.setattr(jax, "local_device_count", lambda *a, **k: jax.device_count() // 2)
    assert L.chunk_length(8, 40, v, hidden=h) == one_process == 5


def _scattered(b=3, t=16, h=6, v=50, seed=0):
    """hidden, emb, targets and weights with holes: row 0 scores 3 scattered targets (one at
    weight 0.5), row 1 two (first and last), row 2 none."""
    keys = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(keys[0], (b, t, h))
    emb = jax.random.normal(keys[1], (v, h)) * 0.5
    y = jax.random.randint(keys[2], (b, t), 0, v)
    w = np.zeros((b, t), np.float32)
    w[0, [1, 5, 9]] = [1.0, 0.5, 1.0]
    w[1, [0, t - 1]] = 1.0
    return hidden, emb, y, jnp.asarray(w)


def _sums_and_gradients_match(f, naive, hidden, emb):
    """f's loss sum, hits and both gradients equal naive's; -> f's gradients."""
    m, ref = f(hidden, emb), naive(hidden, emb)
    np.testing.assert_allclose(float(m["loss_sum"]), float(ref["loss_sum"]), rtol=1e-5)
    assert float(m["correct"]) == float(ref["correct"])
    grads = jax.grad(lambda hh, e: f(hh, e)["loss_sum"], argnums=(0, 1))(hidden, emb)
    ref_grads = jax.grad(lambda hh, e: naive(hh, e)["loss_sum"], argnums=(0, 1))(hidden, emb)
    for a, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6)
    return grads


@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_weights_with_holes_equal_naive(chunk):
    """Moving each row's weighted targets to its front changes no sum and no gradient: loss,
    hits, d_hidden (zero at every unweighted position) and d_embedding equal the naive loss's."""
    hidden, emb, y, w = _scattered()
    f = lambda hh, e: L.chunked_cross_entropy(hh, e, y, w, chunk_size=chunk)  # noqa: E731
    naive = lambda hh, e: L.naive_cross_entropy(hh @ e.T, y, w)  # noqa: E731
    m, ref = f(hidden, emb), naive(hidden, emb)
    assert float(m["count"]) == float(ref["count"]) == 4.5
    grads = _sums_and_gradients_match(f, naive, hidden, emb)
    assert not np.asarray(grads[0])[np.asarray(w) == 0].any()


@pytest.mark.parametrize("cap", [None, 0.5])
@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("path", ["online", "token_major"])
def test_a_frozen_tables_hidden_gradient_projects_the_target_term_apart(monkeypatch, cap, columns, path):
    """With the table frozen, d_hidden = (softmax * w) @ emb - w * emb[target] (times tanh'
    under the cap): equal to the naive loss's, weights with holes and a fractional one, through
    the table as stored and as the train layout's [H, V] columns, online on one device (here
    in 4 slices of the vocabulary) and token-major on a mesh."""
    if path == "token_major":
        _on_a_mesh(monkeypatch)
    monkeypatch.setattr(L.online_softmax, "COLUMNS", 13)  # 50 rows: 5 slices of 10
    hidden, emb, y, w = _scattered()
    kw = {"columns": emb.T} if columns else {}
    f = lambda hh: L.chunked_cross_entropy(hh, emb, y, w, chunk_size=4, logit_soft_cap=cap,  # noqa: E731
                                           **kw)["loss_sum"]
    capped = (lambda x: x) if cap is None else (lambda x: jnp.tanh(x / cap) * cap)
    naive = lambda hh: L.naive_cross_entropy(capped(hh @ emb.T), y, w)["loss_sum"]  # noqa: E731
    np.testing.assert_allclose(float(f(hidden)), float(naive(hidden)), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(f)(hidden), jax.grad(naive)(hidden), rtol=1e-5, atol=1e-6)


def test_a_frozen_bfloat16_tables_loss_writes_no_logits_block(monkeypatch):
    """Through the train layout's columns with the table frozen, on one device, the compiled
    loss and d_hidden write no array as wide as the vocabulary but the table's own (the logits
    are made, summed and projected back a slice of columns at a time), and every product is
    in XLA:CPU's fast form. d_hidden equals the one-hot block's, d rounded to bfloat16 and
    projected in float32."""
    monkeypatch.setattr(L.online_softmax, "COLUMNS", 50)
    hidden, emb, y, w = _scattered(t=16, v=200, seed=3)
    hidden, emb = hidden.astype(jnp.bfloat16), (emb * 4).astype(jnp.bfloat16)
    f = lambda hh: L.chunked_cross_entropy(hh, emb, y, w, chunk_size=8, columns=emb.T)["loss_sum"]  # noqa: E731
    grad = jax.jit(jax.grad(f))
    hlo = grad.lower(hidden).compile().as_text()
    wide = {s for s in buffers(hlo) if "200" in s.split("[", 1)[-1].split(",")}
    assert wide <= {"bf16[200,6]", "bf16[6,200]"}, wide
    assert set(dots(hlo)) == {("bf16", "bf16", "f32", "{1}", "{0}")}

    logits = jnp.dot(hidden, emb.T, preferred_element_type=jnp.float32)
    logits = logits.astype(jnp.bfloat16).astype(jnp.float32)
    d = (jax.nn.softmax(logits, axis=-1) - jax.nn.one_hot(y, 200)) * w[..., None]
    reference = jnp.dot(d.astype(jnp.bfloat16), emb, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.float32(grad(hidden)), np.float32(reference.astype(jnp.bfloat16)),
                               rtol=0.02, atol=0.02 * float(jnp.abs(reference).max()))


def test_bfloat16_logits_through_the_columns_take_their_max_before_rounding():
    """The max of the rounded logits is taken from the float32 product (rounding is monotone):
    loss and argmax hits equal those of the rounded logits exactly, ties from the rounding
    included (first index wins)."""
    hidden, emb, y, _ = _scattered(t=64, v=200, seed=4)
    hidden, emb = hidden.astype(jnp.bfloat16), (emb * 4).astype(jnp.bfloat16)
    rounded = jnp.dot(hidden, emb.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    y = jnp.argmax(rounded, axis=-1)  # every target at a row's top: ties decide the hits
    ties = (rounded == rounded.max(-1, keepdims=True)).sum(-1) > 1
    w = jnp.ones(y.shape, jnp.float32)
    m = jax.jit(lambda hh: L.chunked_cross_entropy(hh, emb, y, w, chunk_size=16, columns=emb.T))(hidden)
    ref = L.naive_cross_entropy(rounded, y, w)
    assert bool(ties.any())
    assert float(m["correct"]) == float(ref["correct"]) == y.size
    np.testing.assert_allclose(float(m["loss_sum"]), float(ref["loss_sum"]), rtol=1e-5)


@pytest.mark.parametrize("path", ["online", "token_major"])
def test_only_chunks_with_a_weighted_target_are_projected(monkeypatch, path):
    """The vocabulary projection runs for the chunks the fullest row's weighted targets fill,
    counted at run time, chunks of 4 positions of 3 rows (online, two of them joined into one
    of 24 tokens): 3 targets in a row -> one projection (the value and gradient come from one
    pass); 9 -> three chunks, two joined ones online, with the loss and d_hidden of the naive
    loss; a batch without one projects nothing."""
    calls = []
    if path == "token_major":
        _on_a_mesh(monkeypatch)
        module, name = L.kernels, "tied_logits"
    else:
        monkeypatch.setattr(L.online_softmax, "ONLINE_TOKENS", 24)
        module, name = L.online_softmax, "chunk"
    project = getattr(module, name)

    def counted(*args):
        jax.debug.callback(lambda: calls.append(1))
        return project(*args)
    monkeypatch.setattr(module, name, counted)
    hidden, emb, y, w = _scattered()
    step = jax.jit(jax.value_and_grad(
        lambda hh, ww: L.chunked_cross_entropy(hh, emb, y, ww, chunk_size=4)["loss_sum"]))
    loss, grad = step(hidden, w)
    jax.effects_barrier()
    assert len(calls) == 1
    calls.clear()
    nine = w.at[0, 10:].set(1.0)
    loss, grad = step(hidden, nine)
    jax.effects_barrier()
    assert len(calls) == {"online": 2, "token_major": 3}[path] and L.live_chunks(nine, 4) == 3
    naive = jax.value_and_grad(lambda hh: L.naive_cross_entropy(hh @ emb.T, y, nine)["loss_sum"])(hidden)
    np.testing.assert_allclose(float(loss), float(naive[0]), rtol=1e-5)
    np.testing.assert_allclose(grad, naive[1], rtol=1e-5, atol=1e-6)
    calls.clear()
    loss, grad = step(hidden, jnp.zeros_like(w))
    jax.effects_barrier()
    assert not calls and float(loss) == 0.0 and not np.asarray(grad).any()
    assert L.live_chunks(w, 4) == 1 and L.live_chunks(jnp.ones_like(w), 4) == 4


@pytest.mark.parametrize("form", ["token_major", "online", "summed"])
def test_a_trained_table_gets_zero_from_a_batch_without_a_weighted_target(monkeypatch, form):
    """With no weighted target no chunk is projected, and a trained table's loss, hits and
    both gradients are zero."""
    if form != "token_major":
        _trained_on_cpu(monkeypatch, form)
    hidden, emb, y, w = _scattered()
    def f(hh, e):
        m = L.chunked_cross_entropy(hh, e, y, jnp.zeros_like(w), chunk_size=4)
        return m["loss_sum"], m
    (loss, m), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hidden, emb)
    assert float(loss) == float(m["correct"]) == 0.0
    assert not any(np.asarray(g).any() for g in grads)


# --- A trained table on CPU in bfloat16: online on one device, else vocabulary-major ----------

# 48 tokens: vocabulary-major, a hidden width of 6 sums the table gradient chunk by chunk, one
# of 24 keeps every chunk's logit gradient for one product at the end.
TABLE_GRADIENTS = {"online": 6, "summed": 6, "kept": 24}


def _trained_on_cpu(monkeypatch, form):
    """The CPU form of a trained table's loss, forced on (in float32 too, where the platform
    choice runs the token-major loop): online on one device, in 5 slices of the vocabulary
    (V = 50) and chunks of at most 24 tokens joined, or vocabulary-major on a mesh."""
    monkeypatch.setattr(L.kernels, "narrow_by_platform", lambda *args, cpu, plain: cpu(*args))
    if form == "online":
        monkeypatch.setattr(L.online_softmax, "COLUMNS", 13)
        monkeypatch.setattr(L.online_softmax, "ONLINE_TOKENS", 24)
    else:
        _on_a_mesh(monkeypatch)


@pytest.mark.parametrize("table_gradient", TABLE_GRADIENTS)
@pytest.mark.parametrize("chunk, cap", [(1, None), (4, None), (3, 2.0), (16, None)])
def test_a_trained_tables_cpu_chunks_equal_naive(monkeypatch, chunk, cap, table_gradient):
    """The CPU forms of a trained table's loss give the naive loss's sums and gradients, with
    holes, padding (16 % 3), the soft cap, online (chunks of one position joined 8 at a time,
    the larger ones fewer) and vocabulary-major either way of taking the table gradient (3
    chunks of one position hold the weighted targets, the larger chunks one)."""
    _trained_on_cpu(monkeypatch, table_gradient)
    hidden, emb, y, w = _scattered(h=TABLE_GRADIENTS[table_gradient])
    assert L._keeps_logit_gradients(48, hidden.shape[-1]) == (table_gradient == "kept")
    capped = lambda logits: logits if cap is None else jnp.tanh(logits / cap) * cap  # noqa: E731
    f = lambda hh, e: L.chunked_cross_entropy(hh, e, y, w, chunk_size=chunk, logit_soft_cap=cap)  # noqa: E731
    naive = lambda hh, e: L.naive_cross_entropy(capped(hh @ e.T), y, w)  # noqa: E731
    _sums_and_gradients_match(f, naive, hidden, emb)


def test_online_a_trained_tables_gradient_sums_over_the_chunks(monkeypatch):
    """Every target weighted: four chunks of 12 tokens, joined two by two, each slice's table
    gradient summed over both joined chunks; sums and gradients equal the naive loss's."""
    _trained_on_cpu(monkeypatch, "online")
    hidden, emb, y, _ = _scattered()
    w = jnp.ones(y.shape, jnp.float32).at[2, 5].set(0.5)
    assert L.online_softmax._joined(4, 12) == 2
    f = lambda hh, e: L.chunked_cross_entropy(hh, e, y, w, chunk_size=4)  # noqa: E731
    naive = lambda hh, e: L.naive_cross_entropy(hh @ e.T, y, w)  # noqa: E731
    _sums_and_gradients_match(f, naive, hidden, emb)


@pytest.mark.parametrize("table_gradient", TABLE_GRADIENTS)
def test_every_product_of_a_trained_bfloat16_table_loss_is_in_the_fast_form(monkeypatch, amx, table_gradient):
    """Compiled for CPU, the loss with both gradients of a trained bfloat16 table multiplies
    [N, K] @ [K, M], bfloat16 in and float32 out, in all its products (token-major, the
    logits multiply a transposed table), and its gradients stay as close to float32's as the
    token-major ones; online without AMX, the logits for the sums multiply the table's rows in
    place ([N, K] @ [M, K]^T, `cpu_forms.times_t`). Online (one device) it writes no [V,
    tokens] array; vocabulary-major (on a mesh) it keeps the logit gradients as bits where it
    keeps them."""
    if table_gradient == "online":
        monkeypatch.setattr(L.online_softmax, "COLUMNS", 100)
    else:
        _on_a_mesh(monkeypatch)
    hidden, emb, y, w = _scattered(h=TABLE_GRADIENTS[table_gradient], v=300)

    def gradients():  # a new function per compile: jit would reuse the first trace
        return lambda hidden, emb: jax.grad(
            lambda hh, e: L.chunked_cross_entropy(hh, e, y, w, chunk_size=8)["loss_sum"], argnums=(0, 1))(hidden, emb)
    narrow = (hidden.astype(jnp.bfloat16), emb.astype(jnp.bfloat16))
    fast = ("bf16", "bf16", "f32", "{1}", "{0}")
    hlo = jax.jit(gradients()).lower(*narrow).compile().as_text()
    # online: the logits once for the sums, then again for both gradients
    in_place = ("bf16", "bf16", "f32", "{1}", "{1}")
    expected = [fast] * 3 + ([fast if amx else in_place] if table_gradient == "online" else [])
    assert sorted(dots(hlo)) == sorted(expected)
    # the kept logit gradients (V 300 x 48 tokens) are stored as bits, not widened to float32
    assert ("u16[300,48]" in hlo) == (table_gradient == "kept") and "f32[300,48]" not in hlo
    if table_gradient == "online":
        assert not {s for s in buffers(hlo) if "300" in s and "48" in s}
    exact = gradients()(hidden, emb)

    def error(got):
        return sum(float(np.abs(np.float32(g) - e).max() / np.abs(e).max()) for g, e in zip(got, exact))
    ours = error(gradients()(*narrow))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(L.kernels, "narrow_by_platform", lambda *args, cpu, plain: plain(*args))
        assert set(dots(jax.jit(gradients()).lower(*narrow).compile().as_text())) != {fast}
        token_major = error(gradients()(*narrow))
    assert ours <= 1.2 * token_major + 1e-3


@pytest.mark.parametrize("platform, dtype, cpu_kernel", NARROW_KERNEL_CHOICES)
def test_a_trained_tables_cpu_form_is_chosen_by_platform_and_dtype(platform, dtype, cpu_kernel):
    """Only a bfloat16 program lowered for CPU takes it, and only with the table trained."""
    hidden, emb, y, w = _scattered()
    hidden, emb = hidden.astype(dtype), emb.astype(dtype)
    loss = lambda hh, e: L.chunked_cross_entropy(hh, e, y, w, chunk_size=4)["loss_sum"]  # noqa: E731
    for argnums, expected in (((0, 1), cpu_kernel), (0, False)):
        lowered = jax.jit(jax.grad(loss, argnums)).trace(hidden, emb).lower(lowering_platforms=(platform,))
        assert ("cpu_kernel/cpu_trained" in lowered.as_text(debug_info=True)) == expected


@pytest.mark.parametrize("platform, online", [("cpu", True), ("tpu", False)])
def test_the_online_loss_is_chosen_by_the_platform_lowered_for(platform, online):
    """A frozen table's loss and d_hidden, and any loss's value alone, run online in a program
    lowered for CPU, in float32 and bfloat16 alike; token-major for any other platform."""
    hidden, emb, y, w = _scattered()
    for dtype in ("float32", "bfloat16"):
        h, e = hidden.astype(dtype), emb.astype(dtype)
        loss = lambda hh: L.chunked_cross_entropy(hh, e, y, w, chunk_size=4)["loss_sum"]  # noqa: E731
        for f in (loss, jax.grad(loss)):
            lowered = jax.jit(f).trace(h).lower(lowering_platforms=(platform,))
            assert ("cpu_kernel/cpu_online" in lowered.as_text(debug_info=True)) == online


def test_a_program_on_several_devices_takes_the_loss_token_major(monkeypatch):
    """A layout may split the table (the megatron table over its vocabulary): slices of it
    would gather it, so a program traced inside a mesh's activation layout does not go online."""
    from jax.sharding import Mesh
    traced, chunk = [], L.online_softmax.chunk
    monkeypatch.setattr(L.online_softmax, "chunk", lambda *args: traced.append(1) or chunk(*args))
    hidden, emb, y, w = _scattered()

    def trace():  # a new function each time: jax caches a trace per function, not per context
        jax.make_jaxpr(jax.grad(lambda hh: L.chunked_cross_entropy(hh, emb, y, w, chunk_size=4)["loss_sum"]))(hidden)
    with L.layers.activation_layout(Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("batch", "model")), {}):
        trace()
    assert not traced
    trace()
    assert traced
