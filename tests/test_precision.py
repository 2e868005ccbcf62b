"""The precision policy: float32 master weights and Adam moments under bfloat16 compute.

CI runs on CPU, where the default is float32 everywhere; `--compute_dtype=bfloat16` gives the
accelerator default (float32 master weights, bfloat16 compute, the LoRA base frozen in
bfloat16) on any platform, which is how these tests see what a TPU or GPU run does.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxlm
import sharding
from jaxlm import data, precision
from models import cpu_forms, train_layout
from jaxlm.errors import UserError
from jaxlm.train import loss as L, optim, trainer
from test_train_cli import finished, launch

QUICK = ["--preset=gemma_tiny", "--mesh=1x8", "--batch_size=8", "--sequence_length=16", "--loss_on=all",
         "--eval_examples=0", "--num_samples=0", "--steps=3", "--save_every=1", "--keep=3",
         "--log_every=1", "--learning_rate=5e-5", "--compute_dtype=bfloat16"]


def test_defaults_and_flags():
    assert precision.resolve(platform="cpu") == precision.Policy()  # float32 everywhere
    accel = precision.resolve(platform="tpu")
    assert (accel.param, accel.compute, accel.frozen, accel.optimizer) == (
        "float32", "bfloat16", "bfloat16", "float32")
    assert precision.resolve(platform="gpu") == accel
    assert precision.resolve(compute_dtype="bf16", platform="cpu") == accel
    one = precision.resolve(dtype="bfloat16", platform="cpu")  # the old one-dtype shorthand
    assert (one.param, one.compute, one.frozen) == ("bfloat16",) * 3
    assert precision.warnings(one, lora=False) and not precision.warnings(accel, lora=True)
    explicit = precision.resolve(param_dtype="float32", platform="tpu")
    assert explicit.frozen == "float32"  # asked for float32 weights: the base is kept so
    with pytest.raises(UserError, match="use one of float32, bfloat16, float16"):
        precision.resolve(dtype="int8")


def _checkpoint(out, step):
    with ocp.StandardCheckpointer() as c:
        return c.restore(os.path.join(out, "checkpoints", str(step), "state"))


def _moved(a, b) -> float:
    """Fraction of elements that differ between two versions of a tensor."""
    return float(np.mean(np.asarray(a) != np.asarray(b)))


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _moments(state):
    """(mu, nu) trees of the AdamW state inside the clip chain."""
    found = [x for x in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: hasattr(x, "mu"))
             if hasattr(x, "mu")]
    if not found:  # restored without a target: the chain comes back as nested containers
        flat = {jax.tree_util.keystr(k): v for k, v in _leaves(state["opt_state"])}
        mu = {k: v for k, v in flat.items() if "mu" in k}
        nu = {k: v for k, v in flat.items() if "nu" in k}
        return mu, nu
    return found[0].mu, found[0].nu


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_every_trained_weight_and_both_moments_move_under_bfloat16_compute(tmp_path, lora_rank):
    """At the seed's 5e-5, a bfloat16 master copy loses most updates (|w| >= 2^-6 cannot move
    by 5e-5) and Adam's nu stops decaying; float32 master weights keep every one: steps 1 -> 2
    and 2 -> 3 each change every trained weight and both moments, all float32 in the
    checkpoint. ("Every" up to the rare element whose Adam update and weight decay cancel
    below half an ulp in float32: a handful in 10^5, so at most 1 in 1000 over all of them and
    1 in 100 in any one leaf, where a LoRA factor of 512 elements may hold one; in bfloat16
    about half of them stick.)"""
    out = str(tmp_path / "run")
    text = finished(launch(QUICK + [f"--lora_rank={lora_rank}", f"--out={out}"]))
    assert "compute bfloat16" in text and "warning:" not in text
    states = [_checkpoint(out, s) for s in (1, 2, 3)]
    for before, after in zip(states, states[1:]):  # each step moves the weights and moments
        moved = size = 0
        for (path, a), (_, b) in zip(_leaves(before["trainable"]), _leaves(after["trainable"])):
            assert a.dtype == np.float32, path
            assert _moved(a, b) > 0.99, jax.tree_util.keystr(path)
            moved, size = moved + _moved(a, b) * a.size, size + a.size
        assert moved / size > 0.999
        for m1, m2 in zip(_moments(before), _moments(after)):
            leaves1, leaves2 = jax.tree.leaves(m1), jax.tree.leaves(m2)
            assert leaves1 and len(leaves1) == len(jax.tree.leaves(before["trainable"]))
            for a, b in zip(leaves1, leaves2):
                assert a.dtype == np.float32 and _moved(a, b) > 0.999
    if lora_rank:  # the frozen base is stored where it is computed: bfloat16
        assert "frozen base bfloat16" in text


def test_one_dtype_shorthand_warns_and_shows_what_bfloat16_weights_lose(tmp_path):
    """--dtype=bfloat16 (parameters and compute in one dtype, today's shorthand) warns, and its
    bfloat16 weights do stick at 5e-5: the failure the float32 master weights above prevent."""
    out = str(tmp_path / "run")
    proc = launch([a for a in QUICK if not a.startswith("--compute_dtype")]
                  + ["--dtype=bfloat16", "--lora_rank=0", f"--out={out}"])
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-2000:]
    assert "warning: trainable weights and their Adam moments are bfloat16" in err
    before, after = _checkpoint(out, 2), _checkpoint(out, 3)
    kernel = lambda s: s["trainable"]["decoder_block_0"]["ffw_gating"]["kernel"]  # noqa: E731
    assert kernel(after).dtype == jnp.bfloat16
    assert _moved(kernel(before), kernel(after)) < 0.8  # in float32: > 0.999


def _loss_after(policy, steps=50):
    """Full fine-tune of gemma_tiny on the built-in tasks under `policy`; -> last 5 mean loss."""
    mesh = sharding.make_mesh("1x8")
    model, params = jaxlm.load("gemma_tiny", policy.compute, param_dtype=policy.param,
                               placement=sharding.placement(mesh, sharding.rules_for(
                                   jaxlm.load("gemma_tiny", abstract=True)[0].config), quiet=True))
    tok = jaxlm.load_tokenizer("gemma_tiny")
    train, _ = data.builtin_dataset()
    ids, mask = data.pack(tok, data.format_examples(train, data.TEMPLATE), 40)
    opt = optim.make_optimizer(optim.OptimConfig(learning_rate=3e-3, mu_dtype=policy.optimizer))
    built = trainer.build(params, mesh, param_specs=sharding.partition_specs(
        params, sharding.rules_for(model.config), mesh), loss_fn=L.lm_loss_fn(model),
        optimizer=opt, trainable_dtype=policy.param)
    state, losses = built.state, []
    for s in range(steps):
        state, m = built.step(state, None, data.host_batch(ids, mask, s, batch_size=8))
        losses.append(float(m["loss"]))
    return float(np.mean(losses[-5:])), losses[0]


def test_mixed_precision_trains_like_float32():
    f32, first32 = _loss_after(precision.resolve(platform="cpu"))
    mixed, first16 = _loss_after(precision.resolve(platform="tpu"))
    print(f"gemma_tiny, 50 full fine-tune steps: float32 loss {first32:.4f} -> {f32:.4f}, "
          f"float32 master + bfloat16 compute {first16:.4f} -> {mixed:.4f}")
    assert f32 < first32 - 1.0  # it learned
    assert abs(mixed - f32) / f32 < 0.03


def test_lora_alpha_is_evaluated_and_exported_as_trained(tmp_path):
    """With --lora_alpha=16 the "after" evaluation, the exported adapters/ (loaded with no flag)
    and the .lora.h5 all give the model that was trained."""
    out = str(tmp_path / "alpha")
    finished(launch(["--preset=gemma_tiny", "--mesh=1x8", "--lora_rank=4", "--lora_alpha=16",
                     "--steps=6", "--batch_size=8", "--num_samples=2", "--eval_examples=8",
                     "--learning_rate=0.05", f"--out={out}"]))
    after = json.load(open(os.path.join(out, "eval_after.json")))
    adapters = jaxlm.lora.load(os.path.join(out, "adapters"))
    assert (adapters.rank, adapters.alpha) == (4, 16.0)
    model, base = jaxlm.load("gemma_tiny")
    tok = jaxlm.load_tokenizer("gemma_tiny")
    # the samples are the first held-out prompts, generated in the exact-match batch of 8
    prompts = [data.prompt(data.TEMPLATE, i) for i in data.builtin_dataset()[1].instructions[:8]]
    assert list(after["samples"]) == prompts[:2]
    longest = max(len(tok.encode(p)) for p in prompts)
    got = jaxlm.generate(model, base, tok, prompts, max_length=longest + 12, strip_prompt=True,
                         adapters=adapters)
    assert got[:2] == [after["samples"][p] for p in prompts[:2]]
    # The scale matters: alpha 16 is not the default alpha = rank, and the .lora.h5 (alpha
    # folded into B, as KerasHub reads it) merges to the same weights.
    ids = jnp.asarray(np.arange(2, 18, dtype=np.int32)[None])
    logits = lambda p: np.asarray(model.apply({"params": p}, ids))  # noqa: E731
    trained = logits(jaxlm.lora.merge(base, adapters))
    assert not np.allclose(trained, logits(jaxlm.lora.merge(base, adapters, alpha=4)), atol=1e-4)
    keras = jaxlm.lora.load_keras_lora(os.path.join(out, "adapters.lora.h5"), model.config, base)
    np.testing.assert_allclose(logits(jaxlm.lora.merge(base, keras)), trained, atol=1e-5)


def _lora_losses(policy, laid: bool, steps=4):
    """LoRA rank 4 on gemma_tiny (1x8 mesh, built-in tasks) under `policy`, with or without the
    CPU train layout (for float32: unmerged beside the stored kernels, or merged); -> (the
    layout or None, the step losses)."""
    mesh = sharding.make_mesh("1x8")
    rules = sharding.rules_for(jaxlm.load("gemma_tiny", abstract=True)[0].config)
    model, params = jaxlm.load("gemma_tiny", policy.compute, param_dtype=policy.frozen,
                               placement=sharding.placement(mesh, rules, quiet=True))
    model = trainer.training_model(model, platform="cpu")
    tok = jaxlm.load_tokenizer("gemma_tiny")
    train, _ = data.builtin_dataset()
    ids, mask = data.pack(tok, data.format_examples(train, data.TEMPLATE), 40)
    layout = trainer.train_layout_of(model, params, lora=True, platform="cpu") if laid else None
    built = trainer.build(params, mesh, param_specs=sharding.partition_specs(params, rules, mesh),
                          loss_fn=L.lm_loss_fn(model), lora=trainer.LoraSpec(rank=4),
                          optimizer=optim.make_optimizer(optim.OptimConfig(learning_rate=1e-2)),
                          train_layout=layout)
    state, frozen, losses = built.state, built.step_frozen(built.frozen), []
    for s in range(steps):
        state, m = built.step(state, frozen, data.host_batch(ids, mask, s, batch_size=8))
        losses.append(float(m["loss"]))
    return frozen[1] if laid else None, losses


def test_bfloat16_lora_on_cpu_trains_through_the_layout_as_without_it(monkeypatch):
    """The trainer builds the CPU train layout for a bfloat16 LoRA step (on a CPU with AMX)
    and its steps on the 1x8 mesh lose as the plain ones do; float32 gets none (no fast form
    to gain there)."""
    monkeypatch.setattr(cpu_forms, "amx", lambda: True)
    policy = precision.resolve(compute_dtype="bfloat16", platform="cpu")
    layout, laid = _lora_losses(policy, laid=True)
    assert layout is not None and "columns" in layout["token_embedding"]
    _, plain = _lora_losses(policy, laid=False)
    print(f"gemma_tiny bfloat16 LoRA losses: through the layout {laid}, plain {plain}")
    np.testing.assert_allclose(laid, plain, rtol=2e-3)
    assert laid[-1] < laid[0]  # it trains
    model, params = jaxlm.load("gemma_tiny")
    narrow = type(model)(model.config.replace(dtype="bfloat16"))
    assert trainer.train_layout_of(narrow, params, lora=False, platform="cpu") is None
    assert trainer.train_layout_of(narrow, params, lora=True, platform="tpu") is None


def test_a_narrow_base_too_large_for_the_layout_keeps_the_adapters_unmerged(monkeypatch):
    """A bfloat16 base whose layout would not fit (Gemma 2B's) trains without one, its factors
    beside the stored kernels (`train_layout.product` without a layout): no merged kernel, no
    gradient for it; on the 1x8 mesh it loses as the merged step does, to bfloat16's rounding."""
    monkeypatch.setattr(train_layout, "MAX_BYTES", 1)
    calls, laid = [], train_layout.product
    monkeypatch.setattr(train_layout, "product", lambda x, forward, backward=None: (
        backward is None and calls.append(forward.shape)) or laid(x, forward, backward))
    policy = precision.resolve(compute_dtype="bfloat16", platform="cpu")
    model, params = jaxlm.load("gemma_tiny")
    narrow = trainer.training_model(type(model)(model.config.replace(dtype="bfloat16")), platform="cpu")
    assert trainer.train_layout_of(narrow, params, lora=True, platform="cpu")(params) is None
    layout, beside = _lora_losses(policy, laid=True)
    cfg = model.config
    query, value = (cfg.hidden_dim, cfg.num_heads * cfg.head_dim), (cfg.hidden_dim, cfg.num_kv_heads * cfg.head_dim)
    assert layout is None and set(calls) == {query, value}  # the adapted kernels, as stored
    _, merged = _lora_losses(policy, laid=False)
    print(f"gemma_tiny bfloat16 LoRA losses: unmerged without a layout {beside}, merged {merged}")
    np.testing.assert_allclose(beside, merged, rtol=2e-3)
    assert beside[-1] < beside[0]


def test_float32_lora_on_cpu_keeps_the_adapters_unmerged_as_merged():
    """A float32 Gemma LoRA step on CPU takes no layout but keeps the factors beside the
    stored kernels (no gradient for a merged kernel); on the 1x8 mesh it loses as the merged
    step does, to float32's summation order. A layer scan, whose blocks see only their params,
    merges."""
    policy = precision.resolve(platform="cpu")
    model, params = jaxlm.load("gemma_tiny")
    assert model.config.scan_layers
    assert trainer.train_layout_of(model, params, lora=True, platform="cpu") is None
    model = trainer.training_model(model, platform="cpu")  # unrolled, as train.py
    assert trainer.train_layout_of(model, params, lora=True, platform="cpu")(params) is None
    assert trainer.train_layout_of(model, params, lora=True, platform="gpu") is None
    _, beside = _lora_losses(policy, laid=True)
    _, merged = _lora_losses(policy, laid=False)
    print(f"gemma_tiny float32 LoRA losses: unmerged {beside}, merged {merged}")
    np.testing.assert_allclose(beside, merged, rtol=1e-5)
    assert beside[-1] < beside[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpu_step_compile_only_measures_is_the_one_train_py_runs(dtype, amx):
    """`aot.abstract_trainer` on a CPU mesh (`--compile_only=cpu`, bench/memory.py) builds a
    LoRA step as train.py does: through the train layout in bfloat16 on a CPU with AMX (its
    copies among the compiled arguments), else the adapters unmerged beside the stored
    kernels, merged with a layer scan."""
    from jaxlm.train import aot
    from models import train_layout
    model, params = jaxlm.load("gemma_tiny", dtype, abstract=True)
    mesh = sharding.make_mesh("1x1", jax.devices()[:1])
    scanned = aot.abstract_trainer(model, params, mesh, lora_rank=4)
    assert scanned.step_frozen(scanned.frozen) is scanned.frozen
    model = trainer.training_model(model, platform="cpu")
    built = aot.abstract_trainer(model, params, mesh, lora_rank=4)
    base, laid = built.step_frozen(built.frozen)
    assert base is built.frozen
    laid_out = dtype == "bfloat16" and amx
    if not laid_out:
        assert laid is None
    else:
        want = jax.eval_shape(lambda p: train_layout.build(model, p), params)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), laid) == jax.tree.map(lambda x: (x.shape, x.dtype), want)
    report, compiled = aot.compile_train_step(model, params, topology="cpu", mesh_spec="1x8",
                                              lora_rank=4, batch_size=8, sequence_length=16)
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(laid))  # the copies, whole
    mem = compiled.memory_analysis()
    dropped = report.total - (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                              + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
    extra = mem.argument_size_in_bytes + dropped - (
        report.weights + report.trainable + report.optimizer + report.batch + report.layout)
    print(f"{dtype}: layout {report.layout} bytes a device of {held}; base kernels the step "
          f"drops {dropped}; arguments beyond the rows {extra}")
    assert 0 <= extra < 1024  # the table's rows are what the run holds: the step's arguments
    if laid_out:  # at least a device's share of the copies, whose kernels it drops
        assert held >= report.layout >= held / 8 > 0 and dropped > 0
        assert "train layout (copies)" in report.table()
    else:
        assert report.layout == dropped == 0 and "train layout" not in report.table()
