"""Optimizer masks, exact gradient accumulation, and the sharded train step on a (1, 8) mesh."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sharding
from conftest import ragged_batch
from jaxlm import lora
from jaxlm.train import loss as L, optim, step as S, trainer as T
from models.gemma import Gemma, PRESETS

CFG = PRESETS["gemma_tiny"].replace(vocab_size=512)


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh("1x8")


@pytest.fixture(scope="module")
def model_params(mesh):
    model = Gemma(CFG)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return model, jax.device_put(params, sharding.named_shardings(params, sharding.rules_for(CFG), mesh))


def batch_of(n, width=17, seed=0):
    rng = np.random.RandomState(seed)
    ids, mask = ragged_batch(CFG.vocab_size, rng.randint(3, width + 1, n), width, seed)
    return {"token_ids": ids, "padding_mask": mask}


def test_decay_mask_spares_bias_and_scale():
    tree = {"a": {"kernel": 0, "bias": 0}, "norm": {"scale": 0}, "q": {"lora_a": 0, "lora_b": 0}}
    assert optim.decay_mask(tree) == {"a": {"kernel": True, "bias": False}, "norm": {"scale": False},
                                      "q": {"lora_a": True, "lora_b": True}}


def test_adamw_leaves_norm_scales_undecayed():
    """With zero gradients only weight decay moves parameters: kernels shrink, scales stay."""
    params = {"k": {"kernel": jnp.ones((2, 2))}, "n": {"scale": jnp.ones(2)}}
    opt = optim.make_optimizer(optim.OptimConfig(learning_rate=0.1, weight_decay=0.5))
    upd, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    new = optax.apply_updates(params, upd)
    np.testing.assert_allclose(new["n"]["scale"], 1.0)
    np.testing.assert_allclose(new["k"]["kernel"], 1.0 - 0.1 * 0.5, rtol=1e-6)


def test_schedule_warmup_then_cosine():
    cfg = optim.OptimConfig(learning_rate=1.0, warmup_steps=10, schedule="cosine", total_steps=110)
    f = optim.schedule(cfg)
    assert float(f(0)) == 0.0 and abs(float(f(5)) - 0.5) < 1e-6 and abs(float(f(10)) - 1.0) < 1e-6
    assert abs(float(f(60)) - 0.5) < 1e-6 and float(f(110)) < 1e-6


def _lora_step(model, params, mesh, accum, donate=True, opt=None):
    adapters = lora.init(params, 4, key=jax.random.key(1))
    # A non-zero B so the adapters affect the loss (B starts at zero).
    adapters = jax.tree.map(lambda x: x + 0.05, adapters)
    rules = sharding.rules_for(CFG)
    specs = sharding.adapter_specs(adapters, sharding.partition_specs(params, rules, mesh), mesh)
    adapters = jax.device_put(adapters, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                     is_leaf=lambda x: isinstance(x, P)))
    opt = opt or optim.make_optimizer(optim.OptimConfig(learning_rate=1e-2, clip_norm=None))
    state = T.init_state(adapters, opt, mesh)
    fn = S.make_train_step(L.lm_loss_fn(Gemma(CFG), chunk_size=8), opt, merge=lora.merge,
                           accum_steps=accum, state_shardings=S.shardings_of(state),
                           frozen_shardings=S.shardings_of(params),
                           batch_shardings=S.micro_batch_sharding(mesh, accum), mesh=mesh,
                           donate=donate)
    return state, fn


def test_accumulation_equals_one_big_step(model_params, mesh):
    """2 micro-batches of 4 == one batch of 8, normalised by the TOTAL count of real tokens."""
    model, params = model_params
    big = batch_of(8)
    micro = {k: v.reshape(2, 4, -1) for k, v in big.items()}
    counts = big["padding_mask"][:, 1:].reshape(2, 4, -1).sum((1, 2))
    assert counts[0] != counts[1]  # else a mean of means would agree by accident

    # SGD(1): the update IS the gradient (Adam's g/|g| would amplify rounding where g ~ 0).
    state1, fn1 = _lora_step(model, params, mesh, 1, opt=optax.sgd(1.0))
    state2, fn2 = _lora_step(model, params, mesh, 2, opt=optax.sgd(1.0))
    new1, m1 = fn1(state1, params, big)
    new2, m2 = fn2(state2, params, micro)
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-4)
    assert float(m1["count"]) == float(m2["count"]) == big["padding_mask"][:, 1:].sum()
    for a, b in zip(jax.tree.leaves(new1["trainable"]), jax.tree.leaves(new2["trainable"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_lora_step_is_sharded_and_trains_only_adapters(model_params, mesh):
    model, params = model_params
    before = jax.tree.map(np.asarray, params)
    state, fn = _lora_step(model, params, mesh, 1)
    emb = params["token_embedding"]["embeddings"]
    assert emb.sharding.spec == P("model", None) and len(emb.addressable_shards) == 8
    assert emb.addressable_shards[0].data.shape == (CFG.vocab_size // 8, CFG.hidden_dim)
    a0 = jax.tree.map(np.asarray, state["trainable"])
    batch = batch_of(8, seed=1)
    losses = []
    for _ in range(5):
        state, m = fn(state, params, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0]  # it learns the batch
    assert int(state["step"]) == 5
    # adapters moved and kept their shardings; the base stayed put (frozen, not donated)
    qa = state["trainable"]["decoder_block_0"]["attention"]["query"]["lora_a"]
    assert qa.sharding.spec == P(None, "model", None)
    assert not np.allclose(np.asarray(qa), a0["decoder_block_0"]["attention"]["query"]["lora_a"])
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y), params, before)
    # the optimizer state holds adapter moments only (no base parameters)
    n_opt = sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim)
    assert n_opt == 2 * lora.num_params(state["trainable"])


def test_full_finetune_step(model_params, mesh):
    """Rank 0: every parameter is trained; state stays on the mesh with its layout."""
    model, params = model_params
    params = jax.tree.map(jnp.copy, params)  # this state is donated
    opt = optim.make_optimizer(optim.OptimConfig(learning_rate=1e-3))
    state = T.init_state(params, opt, mesh)
    shardings = S.shardings_of(state)
    fn = S.make_train_step(L.lm_loss_fn(model), opt, state_shardings=shardings,
                           batch_shardings=S.micro_batch_sharding(mesh), mesh=mesh)
    batch = batch_of(8, seed=2)
    state, m1 = fn(state, None, batch)
    state, m2 = fn(state, None, batch)
    assert float(m2["loss"]) < float(m1["loss"])
    assert S.shardings_of(state) == shardings
    ffw = state["trainable"]["decoder_block_1"]["ffw_gating"]["kernel"]
    assert ffw.sharding.spec == P(None, "model")


def test_bfloat16_and_remat_match_float32(model_params, mesh):
    """--dtype=bfloat16 and --remat change memory/precision, not the objective."""
    model, params = model_params
    batch = batch_of(8, seed=4)
    ref_state, ref_fn = _lora_step(model, params, mesh, 1, donate=False)
    _, ref = ref_fn(ref_state, params, batch)

    cfg = CFG.replace(dtype="bfloat16", remat=True)
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim > 1 else x, params)
    adapters = ref_state["trainable"]
    opt = optim.make_optimizer(optim.OptimConfig(learning_rate=1e-2))
    state = T.init_state(adapters, opt, mesh)
    fn = S.make_train_step(L.lm_loss_fn(type(model)(cfg), chunk_size=8), opt, merge=lora.merge,
                           state_shardings=S.shardings_of(state),
                           frozen_shardings=S.shardings_of(p16),
                           batch_shardings=S.micro_batch_sharding(mesh), mesh=mesh)
    state, m = fn(state, p16, batch)
    assert state["trainable"]["decoder_block_0"]["attention"]["query"]["lora_a"].dtype == jnp.float32
    np.testing.assert_allclose(float(m["loss"]), float(ref["loss"]), rtol=2e-2)
    np.testing.assert_allclose(float(m["grad_norm"]), float(ref["grad_norm"]), rtol=0.1)


def test_step_count_and_defaults():
    from jaxlm.train import cli, lm
    a = cli.parse(["--batch_size=4", "--accum_steps=2"])
    assert lm.num_steps(a, 100, cli.TOY_STEPS) == cli.TOY_STEPS
    assert lm.num_steps(a, 100) == 13  # one epoch of 8-row optimizer steps
    assert lm.num_steps(cli.parse(["--epochs=2.5", "--batch_size=4"]), 100) == 63
    toy = lm.resolve_defaults(cli.parse([]), toy=True)
    real = lm.resolve_defaults(cli.parse(["--data=x.csv"]), toy=False)
    assert (toy.learning_rate, toy.sequence_length) == (cli.TOY_LEARNING_RATE, cli.TOY_SEQUENCE_LENGTH)
    assert (real.learning_rate, real.sequence_length) == (5e-5, 512)
    assert real.template == "Instruction:\n{instruction}\n\nResponse:\n{output}"
    demo = lm.resolve_defaults(cli.parse([]), toy=False, demo=True)
    assert (demo.learning_rate, demo.sequence_length) == (cli.DEMO_LEARNING_RATE, cli.TOY_SEQUENCE_LENGTH)
    full = lm.resolve_defaults(cli.parse(["--lora_rank=0"]), toy=True)
    assert full.learning_rate == cli.TOY_FULL_LEARNING_RATE
    assert cli.parse([r"--template=Q: {instruction}\nA: {output}"]).template == "Q: {instruction}\nA: {output}"


def test_default_preset_is_the_demo_model_when_installed(monkeypatch, capsys, tmp_path):
    import sys
    from jaxlm.train import cli, lm
    monkeypatch.delenv("JAXLM_DEFAULT_PRESET")
    monkeypatch.setitem(sys.modules, cli.DEMO_PACKAGE, None)  # not installed
    assert lm.default_preset() == cli.TOY_PRESET
    assert "demo extra is not installed" in capsys.readouterr().out
    fake = _FakeDemo(tmp_path)
    monkeypatch.setitem(sys.modules, cli.DEMO_PACKAGE, fake)
    assert lm.default_preset() == str(tmp_path / "model.gguf")  # a str: it goes into JSON
    monkeypatch.setenv("JAXLM_DEFAULT_PRESET", "gemma_tiny")
    assert lm.default_preset() == "gemma_tiny"


class _FakeDemo:
    """The demo package's file logic on a small payload: `assemble` writes the file in place from
    its chunks and checks its sha256; a file that exists with another checksum is an error."""

    PAYLOAD = b"GGUF" + bytes(range(256)) * 64

    def __init__(self, home, during_write=None):
        self.home, self.during_write = home, during_write

    def default_output_path(self):
        return self.home / "model.gguf"

    def assemble(self, output_path=None, overwrite=False):
        import hashlib
        target = self.default_output_path() if output_path is None else output_path
        sha = lambda data: hashlib.sha256(data).hexdigest()  # noqa: E731
        if target.exists() and not overwrite:
            if sha(target.read_bytes()) != sha(self.PAYLOAD):
                raise FileExistsError(f"{target} already exists with an unexpected sha256")
            return target
        with open(target, "wb") as f:
            f.write(self.PAYLOAD[:100])
            f.flush()
            if self.during_write:  # another process of the run looks for the file now
                self.during_write()
            f.write(self.PAYLOAD[100:])
        return target


def test_the_demo_file_appears_whole_to_every_process(tmp_path):
    """Every process of a multi-host run assembles the demo GGUF on a fresh machine: one that
    looks while another writes must not find a half file, nor must a run after a killed one."""
    from jaxlm.train import lm
    seen = []
    fake = _FakeDemo(tmp_path, during_write=lambda: seen.append(lm.demo_file(_FakeDemo(tmp_path))))
    path = lm.demo_file(fake)
    assert seen == [path] and open(path, "rb").read() == _FakeDemo.PAYLOAD
    assert sorted(os.listdir(tmp_path)) == ["model.gguf"]  # no temporary file left behind
    open(path, "wb").write(_FakeDemo.PAYLOAD[:100])  # a run killed while writing
    assert lm.demo_file(_FakeDemo(tmp_path)) == path
    assert open(path, "rb").read() == _FakeDemo.PAYLOAD


def test_the_loop_compiles_the_step_once_and_hands_back_freed_memory_between_steps(monkeypatch):
    """The step is compiled ahead of its first call (which reuses that compilation), and malloc's
    freed memory goes back to the system after that compilation and at every log point."""
    from jax._src import monitoring
    from jaxlm import machine
    from jaxlm.train import loop
    compiles, trims = [], []

    def on_event(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)
    monkeypatch.setattr(machine, "return_freed_memory", lambda: trims.append(len(compiles)))
    step = jax.jit(lambda state, frozen, batch: (
        {"step": state["step"] + 1, "w": state["w"] * batch},
        {"loss": jnp.sum(state["w"]), "accuracy": jnp.float32(0), "count": jnp.float32(1)}),
        donate_argnums=(0,))
    state = {"step": jnp.int32(0), "w": jnp.ones(4)}
    batch = jnp.full(4, 2.0)
    monitoring.register_event_duration_secs_listener(on_event)
    try:
        state, history = loop.run(step, state, None, lambda s: batch, num_steps=7, log_every=3,
                                  print_fn=lambda line: None)
    finally:
        monitoring.unregister_event_duration_listener(on_event)
    assert len(compiles) == 1, compiles  # lowering ahead did not cost a second compilation
    assert trims == [1, 1, 1, 1]  # after compiling, then at steps 3, 6 and 7 (the last)
    assert [s for s, _ in history] == list(range(1, 8)) and float(state["w"][0]) == 2.0 ** 7


def test_export_writes_every_adapter_format(tmp_path, capsys):
    """Gemma 1 and Gemma 3 (the demo model): adapters/ (no flags to load), KerasHub's .lora.h5,
    PEFT's adapter beside a Hugging Face export of the base, and the lines that load them."""
    from jaxlm import lora
    from jaxlm.train.export import export
    from models.gemma import Gemma, PRESETS
    gemma3 = PRESETS["gemma_tiny"].replace(use_post_attention_norm=True, use_post_ffw_norm=True,
                                           use_query_key_norm=True, sliding_window_size=8,
                                           sliding_window_pattern=6)
    for cfg, name in ((gemma3, "g3"), (PRESETS["gemma_tiny"], "g1")):
        model = Gemma(cfg)
        params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
        adapters = lora.init(params, 2, key=jax.random.key(1), alpha=8)
        written = export(str(tmp_path / name), model, params, adapters, None)
        assert written[:3] == ["adapters/", "adapters.lora.h5", "base_hf/ (the base model, Hugging Face)"]
        assert lora.load(str(tmp_path / name / "adapters")).alpha == 8
        for f in ("adapters.lora.h5", "adapters_peft/adapter_config.json", "base_hf/config.json"):
            assert (tmp_path / name / f).exists(), f
    out = capsys.readouterr().out
    assert "peft.PeftModel.from_pretrained(model, " in out and "no adapters.lora.h5" not in out


def test_training_unrolls_the_layers_on_cpu_only():
    """XLA:CPU's layer scan copies every frozen block weight each step, widens bfloat16 stacks
    whole and stacks a full fine-tune's weights and gradients each step: a CPU step trains the
    layers unrolled; on TPU and GPU the scan stays (compile time flat in depth)."""
    for dtype in ("float32", "bfloat16"):
        model = Gemma(CFG.replace(dtype=dtype))
        assert model.config.scan_layers
        assert not T.training_model(model, platform="cpu").config.scan_layers
        for platform in ("tpu", "gpu"):
            assert T.training_model(model, platform=platform).config.scan_layers
    model = Gemma(CFG)
    assert T.training_model(model, platform="gpu", remat=True).config.remat
    assert not T.training_model(model, platform="cpu").config.remat
