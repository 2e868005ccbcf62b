"""PEFT adapters both ways, checked live by peft on the HF export of tiny models built here:
jaxlm adapters (trained two steps) -> peft == jaxlm's merged logits; a peft-saved adapter ->
`load_peft` == peft's logits, and back to bit-identical files; unsupported adapters."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from conftest import ragged_batch
from jaxlm import lora
from jaxlm.errors import UserError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.numpy import load_file  # noqa: E402

VOCAB = 256
ALL = [".*(query|key|value|attention_output|ffw_gating|ffw_gating_2|ffw_linear"
       "|intermediate_dense|output_dense)/kernel"]


def hf_model(kind):
    torch.manual_seed(0)
    if kind == "gemma3":  # grouped-query attention: q_proj gets N*r, k/v_proj K*r
        config = transformers.Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
            query_pre_attn_scalar=8, initializer_range=0.2)
        return transformers.Gemma3ForCausalLM(config).eval()
    config = transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=18, layer_norm_eps=1e-5, type_vocab_size=1,
        initializer_range=0.2)
    return transformers.RobertaForMaskedLM(config).eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """kind -> (HF folder, jaxlm model, params), once per module."""
    made = {}

    def get(kind):
        if kind not in made:
            path = str(tmp_path_factory.mktemp(kind))
            hf_model(kind).save_pretrained(path)
            made[kind] = (path, *jaxlm.load(path))
        return made[kind]
    return get


def batch():
    return ragged_batch(VOCAB, [12, 7, 2], 12)


def peft_logits(model, ids, mask):
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask.astype("int64")))
    return out.logits.float().numpy()


def jaxlm_logits(model, params, ids, mask):
    return np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)))


def trained_adapters(model, params, steps=2):
    """Rank-2 adapters on every kernel, trained `steps` AdamW steps by jaxlm's own train step."""
    from jaxlm.train import loss, optim, step, trainer
    adapters = lora.init(params, 2, key=jax.random.key(0), alpha=6.0, targets=ALL)
    opt = optim.make_optimizer(optim.OptimConfig(learning_rate=0.05))
    train = step.make_train_step(loss.lm_loss_fn(model), opt, merge=lora.merge, donate=False)
    state = trainer.init_state(adapters, opt)
    ids, mask = ragged_batch(VOCAB, [12, 12, 9, 5], 12, seed=1)
    for _ in range(steps):
        state, _ = train(state, params, {"token_ids": jnp.asarray(ids), "padding_mask": jnp.asarray(mask)})
    return state["trainable"]


def test_trained_adapters_load_in_peft_with_jaxlm_logits(base, tmp_path):
    path, model, params = base("gemma3")
    adapters = trained_adapters(model, params)
    b = np.asarray(adapters["decoder_block_0"]["attention"]["query"]["lora_b"])
    assert np.abs(b).max() > 0.01  # the training moved B off zero
    out = str(tmp_path / "adapters_peft")
    assert lora.save_peft(out, adapters, model, base_model_name_or_path=path) == [
        "adapter_model.safetensors", "adapter_config.json"]
    with open(os.path.join(out, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (2, 6.0, "CAUSAL_LM")
    assert config["rank_pattern"] == {"q_proj": 8, "k_proj": 4, "v_proj": 4}  # N*r, K*r
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                               "up_proj", "down_proj"])
    ids, mask = batch()
    want = jaxlm_logits(model, lora.merge(params, adapters), ids, mask)
    from jaxlm.convert import hf
    namespace = {}  # the lines a run prints for its user load it
    exec("\n".join(hf.usage(path, model.config, adapter_dir=out)), namespace)
    loaded = namespace["model"].eval()
    assert isinstance(loaded, peft.PeftModel)
    assert np.abs(peft_logits(loaded, ids, mask) - want)[mask].max() <= 1e-4
    assert np.abs(jaxlm_logits(model, params, ids, mask) - want)[mask].max() > 1e-2  # LoRA matters
    # peft adapted exactly the modules in the file, and the file back in jaxlm is the same LoRA
    adapted = {n for n, m in loaded.named_modules() if hasattr(m, "lora_A")}
    assert len(adapted) == 2 * 7
    back = lora.load_peft(out, model, params)
    assert np.abs(jaxlm_logits(model, lora.merge(params, back), ids, mask) - want)[mask].max() <= 1e-4


@pytest.mark.parametrize("kind", ["gemma3", "roberta"])
def test_peft_saved_adapter_gives_peft_logits(kind, base, tmp_path):
    """get_peft_model (per-module ranks and alphas, rsLoRA) -> save_pretrained -> load_peft."""
    path, model, params = base(kind)
    hf = (transformers.AutoModelForCausalLM if kind == "gemma3" else transformers.AutoModelForMaskedLM
          ).from_pretrained(path)
    if kind == "gemma3":  # per-module ranks and alphas and rsLoRA: several scales
        config = peft.LoraConfig(r=2, lora_alpha=3.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                                 use_rslora=True, rank_pattern={"q_proj": 3}, alpha_pattern={"down_proj": 5.0},
                                 task_type="CAUSAL_LM")
    else:  # one scale
        config = peft.LoraConfig(r=3, lora_alpha=4.0, target_modules=["query", "value", "attention.output.dense",
                                                                       "intermediate.dense"])
    theirs = peft.get_peft_model(hf, config)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    src = str(tmp_path / "theirs")
    theirs.save_pretrained(src)
    ids, mask = batch()
    want = peft_logits(theirs.eval(), ids, mask)
    adapters = lora.load_peft(src, model, params)
    assert isinstance(adapters, lora.Adapters)
    got = jaxlm_logits(model, lora.merge(params, adapters), ids, mask)
    assert np.abs(got - want)[mask].max() <= 1e-4
    assert np.abs(jaxlm_logits(model, params, ids, mask) - want)[mask].max() > 1e-2
    # written back: the same adapter for peft; with one scale, peft's own factors bit for bit
    # (the rank reductions are exact); several scales were folded into B on the way in
    again = str(tmp_path / "again")
    lora.save_peft(again, adapters, model)
    ours, original = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (again, src))
    assert sorted(ours) == sorted(original)
    for key, tensor in original.items():
        assert ours[key].shape == tensor.shape, key
        if kind == "roberta" or "lora_A" in key:
            np.testing.assert_array_equal(ours[key], tensor, err_msg=key)
    reloaded = peft.PeftModel.from_pretrained(type(hf).from_pretrained(path), again).eval()
    assert np.abs(peft_logits(reloaded, ids, mask) - want)[mask].max() <= 1e-4


def _edit(directory, **changes):
    path = os.path.join(directory, "adapter_config.json")
    with open(path) as f:
        c = json.load(f)
    c.update(changes)
    with open(path, "w") as f:
        json.dump(c, f)


def test_unsupported_adapters_are_one_clear_line(base, tmp_path):
    path, model, params = base("gemma3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    embedded = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    src = str(tmp_path / "embed")
    embedded.save_pretrained(src)
    cases = [(src, {}, "adapts model.embed_tokens, which jaxlm has no kernel for"),
             (src, {"modules_to_save": ["lm_head"]}, "modules_to_save"),
             (src, {"use_dora": True}, "use_dora"),
             (src, {"peft_type": "IA3"}, "IA3"),
             (str(tmp_path / "nothing"), None, "not a PEFT adapter folder")]
    for directory, changes, message in cases:
        if changes:
            _edit(directory, **changes)
        with pytest.raises(UserError, match=message) as e:
            lora.load_peft(directory, model, params)
        assert "\n" not in str(e.value)
        if changes:
            _edit(directory, **{k: v for k, v in [("modules_to_save", None), ("use_dora", False),
                                                  ("peft_type", "LORA")]})
    adapters = lora.init(params, 2, key=jax.random.key(0))
    lora.save_peft(str(tmp_path / "ours"), adapters, model)
    with pytest.raises(UserError, match="another model"):
        lora.load_peft(str(tmp_path / "ours"), jaxlm.load("gemma_tiny", abstract=True)[0])
