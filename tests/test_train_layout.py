"""models/train_layout.py: a CPU LoRA step through the train layout (each frozen weight in
the form a product lacks, the LoRA factors beside) or beside the stored kernels is the merged
step's math; it multiplies through the layout where one is passed; the low-rank backward
writes no transposed output gradient."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import train_layout
from models.gemma import PRESETS, Gemma

LAID = PRESETS["gemma_tiny"].replace(vocab_size=256, num_layers=2, num_kv_heads=2,
                                     scan_layers=False, dtype="bfloat16")

def _laid_setup(alpha=None):
    from jaxlm import lora
    model = Gemma(LAID)
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, LAID.vocab_size)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16),
                          model.init(jax.random.key(0), ids[:, :-1])["params"])
    adapters = jax.tree.map(lambda a: a + 0.1, lora.init(params, 4, key=jax.random.key(2), alpha=alpha))
    layout = train_layout.build(model, params)
    return model, params, adapters, layout, {"token_ids": ids, "padding_mask": jnp.ones_like(ids, bool)}


def test_the_train_layout_holds_each_frozen_weight_in_the_form_it_lacks():
    """Each kernel as [in, out] and [out, in] matrices where the stored kernel is not that
    reshaped (the LoRA targets too: the factors are added beside, not merged); the table as
    [H, V]. The copies are the weights, exactly."""
    _, params, _, layout, _ = _laid_setup()
    h, n, k, d, f = LAID.hidden_dim, LAID.num_heads, LAID.num_kv_heads, LAID.head_dim, LAID.ffw_dim
    shapes = jax.tree.map(lambda x: x.shape, layout)
    assert set(shapes["decoder_block_0"]["attention"]) == {"query", "key", "value", "attention_output"}
    assert shapes["decoder_block_0"]["attention"]["key"] == {"forward": (h, k * d), "backward": (k * d, h)}
    assert shapes["decoder_block_0"]["attention"]["query"] == {"forward": (h, n * d), "backward": (n * d, h)}
    assert shapes["decoder_block_1"]["attention"]["attention_output"] == {"backward": (h, n * d)}
    assert shapes["decoder_block_1"]["ffw_gating"] == {"backward": (f, h)}
    assert shapes["decoder_block_1"]["ffw_linear"] == {"backward": (h, f)}
    assert shapes["token_embedding"] == {"columns": (h, LAID.vocab_size)}
    key = params["decoder_block_1"]["attention"]["key"]["kernel"]  # [K, H, D]
    laid = layout["decoder_block_1"]["attention"]["key"]
    np.testing.assert_array_equal(laid["forward"], key.transpose(1, 0, 2).reshape(h, -1))
    np.testing.assert_array_equal(laid["backward"], key.transpose(0, 2, 1).reshape(-1, h))
    np.testing.assert_array_equal(layout["token_embedding"]["columns"],
                                  params["token_embedding"]["embeddings"].T)


def _wide_setup(targets=None):
    from jaxlm import lora
    model = Gemma(LAID.replace(dtype="float32"))
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, LAID.vocab_size)
    params = model.init(jax.random.key(0), ids[:, :-1])["params"]
    adapters = jax.tree.map(lambda a: a + 0.1, lora.init(params, 4, key=jax.random.key(2),
                                                          alpha=16.0, targets=targets))
    return model, params, adapters, {"token_ids": ids, "padding_mask": jnp.ones_like(ids, bool)}


@pytest.mark.parametrize("laid", [True, False])
@pytest.mark.parametrize("targets", [None, (".*/kernel",)])
def test_lora_beside_the_products_is_the_merged_step_in_float32(targets, laid):
    """The math, without bfloat16's rounding: the step with the LoRA factors added beside
    each product (scale 4), through the train layout or the stored kernels, equals the merged
    plain step, for KerasHub's targets and with every kernel adapted (each einsum's low-rank
    form)."""
    from jaxlm import lora
    from jaxlm.train.loss import lm_loss_fn
    model, params, adapters, batch = _wide_setup(targets)
    layout = train_layout.build(model, params) if laid else None
    loss = lm_loss_fn(model)
    plain = jax.jit(jax.value_and_grad(lambda a: loss(lora.merge(params, a), batch, None)[0]))(adapters)
    beside = jax.jit(jax.value_and_grad(
        lambda a: loss(params, batch, None, layout=layout, adapters=a)[0]))(adapters)
    np.testing.assert_allclose(beside[0], plain[0], rtol=1e-6)
    # float32 summation order: with every kernel adapted, block 0's ffw_linear lora_a gets a
    # gradient 10x smaller than the rest, and each step is within 1.3e-4 of its largest entry
    # from the naive full-logits loss's (2026-12-05)
    for a, b in zip(jax.tree.leaves(beside[1]), jax.tree.leaves(plain[1])):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4 * float(np.abs(b).max()))


@pytest.mark.parametrize("low_rank", ["factored", "einsum"])
def test_the_low_rank_backward_transposes_no_output_gradient(low_rank):
    """d_B = (x A)^T dy: autodiff's einsum had XLA:CPU write the output gradient dy out
    transposed, [D, B * T * N], for the query behind a norm as in Gemma 3 (the real 270M's
    float32 step: ~100 ms); `_factored` transposes the rank-r operand instead. The plain
    einsum is checked too, so the test shows the copy it looks for still happens there."""
    b_, t, h, n, d, r = 2, 16, 32, 4, 16, 4
    ks = jax.random.split(jax.random.key(0), 5)
    x, a, b = (jax.random.normal(k, s) for k, s in zip(ks, ((b_, t, h), (n, h, r), (r, d))))
    kernel, scale = jax.random.normal(ks[3], (n, h, d)), jax.random.normal(ks[4], (d,))
    plain = functools.partial(jnp.einsum, "BTH,NHZ,ZD->BTND")
    low = functools.partial(train_layout._low_rank, "BTH,NHD->BTND") if low_rank == "factored" else plain

    def loss(x, a, b, low=low):  # the query: its product plus the factors', then Gemma 3's norm
        y = jnp.einsum("BTH,NHD->BTND", x, kernel) + low(x, a, b)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True)) * scale
        return jnp.sum(jnp.tanh(y))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    hlo = grad.lower(x, a, b).compile().as_text()
    transposed = re.search(rf"= f32\[{d},{b_ * t * n}\]", hlo)
    assert (transposed is None) == (low_rank == "factored"), transposed
    want = jax.grad(functools.partial(loss, low=plain), argnums=(0, 1, 2))(x, a, b)
    for got, want in zip(grad(x, a, b), want):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("alpha", [None, 16.0])
def test_a_bfloat16_lora_step_through_the_train_layout_is_as_close_to_float32_as_the_plain_one(alpha):
    """Loss and adapter gradients of a bfloat16 Gemma LoRA step through the layout, with the
    adapters unmerged beside it, are as close to the float32 step's as the plain merged
    bfloat16 step's are (the two round differently), and the step does multiply through the
    layout: every one of the seven kernels of each layer."""
    from jaxlm import lora
    from jaxlm.train.loss import lm_loss_fn
    model, params, adapters, layout, batch = _laid_setup(alpha)
    loss = lm_loss_fn(model)
    wide = Gemma(LAID.replace(dtype="float32"))
    wide_params = jax.tree.map(lambda p: p.astype(jnp.float32), params)

    def f(a, laid):
        if laid is None:
            return loss(lora.merge(params, a), batch, None)[0].astype(jnp.float32)
        return loss(params, batch, None, layout=laid, adapters=a)[0].astype(jnp.float32)
    exact = jax.jit(jax.value_and_grad(lambda a: lm_loss_fn(wide)(lora.merge(wide_params, a), batch, None)[0]))(adapters)
    plain = jax.jit(jax.value_and_grad(f))(adapters, None)
    laid = jax.jit(jax.value_and_grad(f))(adapters, layout)

    def errors(got):  # per gradient leaf, max |error| over the leaf's largest value
        return [float(np.abs(np.float32(g) - e).max() / np.abs(e).max())
                for g, e in zip(jax.tree.leaves(got[1]), jax.tree.leaves(exact[1]))]
    np.testing.assert_allclose(laid[0], exact[0], rtol=1e-3)
    assert max(errors(laid)) < 0.05
    assert sum(errors(laid)) < 1.5 * sum(errors(plain))
    program = str(jax.make_jaxpr(jax.grad(f))(adapters, layout))
    assert program.count("name=product") == 7 * LAID.num_layers
    assert "name=product" not in str(jax.make_jaxpr(jax.grad(f))(adapters, None))


def test_unmerged_adapters_never_go_unused():
    """Passed unmerged, the LoRA factors reach every adapted product: a layer scan (whose
    blocks see only their params) is refused, and a module the layout leaves out multiplies
    its stored kernel with the factors beside, as without a layout."""
    from jaxlm.train.loss import lm_loss_fn
    model, params, adapters, layout, batch = _laid_setup()
    scanned = Gemma(LAID.replace(scan_layers=True))
    for laid in (layout, None):
        with pytest.raises(ValueError, match="unrolled layers"):
            lm_loss_fn(scanned)(params, batch, None, layout=laid, adapters=adapters)
    model, params, adapters, batch = _wide_setup()
    layout = train_layout.build(model, params)
    partial = {**layout, "decoder_block_1": {k: v for k, v in layout["decoder_block_1"].items()
                                             if k != "attention"}}
    loss = lm_loss_fn(model)
    whole = loss(params, batch, None, layout=layout, adapters=adapters)[0]
    np.testing.assert_allclose(loss(params, batch, None, layout=partial, adapters=adapters)[0],
                               whole, rtol=1e-6)
    unadapted = loss(params, batch, None, layout=layout)[0]
    assert abs(float(unadapted) - float(whole)) > 1e-3 * abs(float(whole))


def test_the_train_layout_is_for_narrow_small_bases_on_cpus_with_amx_only(amx):
    most = train_layout.MAX_BYTES
    assert train_layout.pays("cpu", jnp.bfloat16, most) == amx  # without AMX: W^T in place
    assert not train_layout.pays("cpu", jnp.float32, 1)  # float32 has no fast form to gain
    assert not train_layout.pays("cpu", jnp.bfloat16, most + 1)  # Gemma 2B: 5 GB more
    assert not train_layout.pays("tpu", jnp.bfloat16, 1)
    assert not train_layout.pays("gpu", jnp.bfloat16, 1)
