"""PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`), both ways, exactly.

    jaxlm.lora.save_peft("run/adapters_peft", adapters, model, base_model_name_or_path="run/hf")
    model = peft.PeftModel.from_pretrained(transformers_model, "run/adapters_peft")
    adapters = jaxlm.lora.load_peft("some/peft_adapter", model)     # -> Adapters

PEFT adapts an `nn.Linear` weight W [out, in] by (lora_alpha / r) * B' @ A', A' [r, in],
B' [out, r]. Ours adapts an einsum kernel by (alpha / r) * A @ B with A = kernel.shape[:-1] + (r,)
and B [r, kernel.shape[-1]] (jaxlm/lora/core.py). Per kernel layout (N heads, K key/value
heads, H hidden, D head dim):

    FFN [in, out], attention output [N, D, H]: the same rank-r product, transposed and
        reshaped: rank r both ways.
    query [N, H, D] (and K for key/value): A is per head but B [r, D] is shared by the heads,
        so in HF's [N*D, H] layout the update is block-diagonal and has rank up to N*r. The
        exact PEFT equivalent has r' = N*r (K*r): A' stacks the heads' A, B' = diag(B^T, ..., B^T).
        The other way, an HF adapter of rank r' on q_proj becomes ours of rank N*r': head n's
        block of A is A' (zero elsewhere) and B stacks the heads' blocks of B'.

So an export has the adapters' rank r on FFN/output modules and `rank_pattern` {q_proj: N*r,
k_proj / v_proj: K*r} with `alpha_pattern` keeping every module's scale (lora_alpha / r) equal
to ours. Before writing, components that add nothing exactly are dropped (an all-zero row of A')
and components with identical rows of A' are summed into one, so an adapter that came from
PEFT through `load_peft` is written back with its original ranks and factors.

An import gets one rank R (the largest per-module rank after the mapping above, smaller
modules zero-padded, which adds exactly nothing) and alpha = s * R, where s is PEFT's scale
(lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora), so `merge` applies s exactly. Modules
whose PEFT scale differs from the most common one (alpha_pattern) get the ratio folded into B.
"""
from __future__ import annotations

import collections
import json
import math
import re

import numpy as np

from jaxlm import families, storage
from jaxlm.convert import hf
from jaxlm.convert.hf_tensors import Reader, write_file
from jaxlm.errors import UserError
from jaxlm.lora.core import Adapters, pairs
from jaxlm.tree import flatten, unflatten

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
TASK_TYPES = {"gemma": "CAUSAL_LM", "roberta": None}  # peft has no masked-LM task: a plain PeftModel


def _kernels(config) -> dict:
    """{our kernel path: (HF module name, hf_tensors.Tensor)} for the kernels LoRA may adapt."""
    fmt = hf.FORMATS.get(families.by_config(config).name)
    if fmt is None:
        raise UserError(f"no Hugging Face format for {type(config).__name__}")
    return {path: (t.keys[0].removesuffix(".weight"), t) for path, t in fmt.tensors(config).items() if t.lora}


# --- layouts: ours (a, b) <-> PEFT (A' [r', in], B' [out, r']) --------------------------------

def to_peft(kind: str, a: np.ndarray, b: np.ndarray):
    if kind == "linear":  # kernel [in, out]
        return a.T, b.T
    if kind == "heads_out":  # kernel [N, D, H], a [N, D, r]
        return a.reshape(-1, a.shape[-1]).T, b.T
    if kind in ("heads_in", "hidden_heads"):  # kernel [N, H, D] / [H, N, D]
        per_head = a.transpose(0, 2, 1) if kind == "heads_in" else a.transpose(1, 2, 0)  # [N, r, H]
        n = per_head.shape[0]
        return per_head.reshape(-1, per_head.shape[-1]), np.kron(np.eye(n, dtype=b.dtype), b.T)
    raise ValueError(kind)


def from_peft(kind: str, a_hf: np.ndarray, b_hf: np.ndarray, kernel_shape: tuple):
    r = a_hf.shape[0]
    if kind == "linear":
        return a_hf.T, b_hf.T
    if kind == "heads_out":
        return a_hf.T.reshape(*kernel_shape[:-1], r), b_hf.T
    if kind in ("heads_in", "hidden_heads"):
        n, h, d = kernel_shape if kind == "heads_in" else (kernel_shape[1], kernel_shape[0], kernel_shape[2])
        eye = np.eye(n, dtype=a_hf.dtype)
        eq = "nm,jh->nhmj" if kind == "heads_in" else "nm,jh->hnmj"
        a = np.einsum(eq, eye, a_hf).reshape(*kernel_shape[:-1], n * r)
        b = b_hf.reshape(n, d, r).transpose(0, 2, 1).reshape(n * r, d)
        return a, b
    raise ValueError(kind)


def simplify(a_hf: np.ndarray, b_hf: np.ndarray):
    """The same product B' @ A' with fewer components: all-zero rows of A' dropped, identical
    rows merged (their columns of B' summed), first occurrences kept in order."""
    live = np.flatnonzero(np.any(a_hf != 0, axis=1))
    if live.size == 0:
        return a_hf[:1], b_hf[:, :1]
    a_hf, b_hf = a_hf[live], b_hf[:, live]
    _, first, inverse = np.unique(a_hf, axis=0, return_index=True, return_inverse=True)
    if first.size == a_hf.shape[0]:
        return a_hf, b_hf
    order = np.argsort(first)
    rank_of = np.empty_like(order)
    rank_of[order] = np.arange(order.size)
    merged = np.zeros((b_hf.shape[0], order.size), b_hf.dtype)
    for col, group in enumerate(rank_of[inverse.reshape(-1)]):
        merged[:, group] += b_hf[:, col]
    return a_hf[first[order]], merged


# --- writing -----------------------------------------------------------------------------------

def save_peft(directory: str, adapters, config, *, base_model_name_or_path: str | None = None) -> list[str]:
    """Write `adapters` as a PEFT LoRA adapter that `peft.PeftModel.from_pretrained(base, directory)`
    loads onto the HF export of the same base model (`jaxlm.save(..., format="hf")`).

    config: the model's config (or the model). base_model_name_or_path: recorded in the config
    (the HF export's folder or hub name, from which `peft.AutoPeftModelForCausalLM` loads the
    base). `directory` may be a URL. Returns the file names written. See the module docstring
    for the ranks. The factors are read whole: on a multi-host run gather them first
    (`multihost_utils.process_allgather(adapters, tiled=True)`) and call from process 0.
    """
    config = getattr(config, "config", config)
    kernels = _kernels(config)
    alpha = getattr(adapters, "alpha", None)
    modules, tensors = {}, []
    for parent, (a, b) in sorted(pairs(adapters).items()):
        path = f"{parent}/kernel"
        if path not in kernels:
            raise UserError(f"adapter {parent} has no Hugging Face module; PEFT export covers the "
                            "attention and FFN kernels")
        name, t = kernels[path]
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        rank = a.shape[-1]
        a_hf, b_hf = simplify(*to_peft(t.lora, a, b))
        modules[name] = (a_hf.shape[0], (rank if alpha is None else alpha) / rank)  # (r', scale)
        tensors += [(f"{PREFIX}{name}.lora_A.weight", a_hf), (f"{PREFIX}{name}.lora_B.weight", b_hf)]
    if not modules:
        raise UserError("the adapters are empty; nothing to export")
    family = families.by_config(config).name
    peft_config = _peft_config(modules, set(name for name, _ in kernels.values()), family,
                               base_model_name_or_path)
    storage.makedirs(directory)
    write_file(storage.join(directory, WEIGHTS), [(k, v.shape, "float32") for k, v in tensors],
               iter(v for _, v in tensors))
    storage.write_text(storage.join(directory, CONFIG), json.dumps(peft_config, indent=2))
    return [WEIGHTS, CONFIG]


def _peft_config(modules: dict, all_modules: set, family: str, base: str | None) -> dict:
    """modules: {HF module name: (rank, scale)}; all_modules: every adaptable module's name."""
    r = collections.Counter(rank for rank, _ in modules.values()).most_common(1)[0][0]
    scale = collections.Counter(s for _, s in modules.values()).most_common(1)[0][0]
    rank_pattern, alpha_pattern = {}, {}
    targets = _targets(set(modules), all_modules)
    for suffix, members in targets.items():
        # peft matches a pattern key k against module names as (.*\.)?(k)$
        shared = len({modules[m] for m in members}) == 1
        for key, member in ([(re.escape(suffix), members[0])] if shared else
                            [(re.escape(m), m) for m in members]):
            rank, s = modules[member]
            if rank != r:
                rank_pattern[key] = rank
            if rank != r or s != scale:
                alpha_pattern[key] = s * rank
    return {
        "peft_type": "LORA", "task_type": TASK_TYPES[family], "base_model_name_or_path": base,
        "r": r, "lora_alpha": scale * r, "target_modules": sorted(targets),
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "inference_mode": True,
    }


def _targets(adapted: set, all_modules: set) -> dict:
    """{suffix: adapted modules it matches} for target_modules, matched by peft as
    `name == t or name.endswith("." + t)`: each module gets the shortest dotted suffix that
    matches adapted modules only ("q_proj" when every layer's q_proj is adapted), so the
    suffixes partition the adapted modules."""
    def matches(suffix):
        return {m for m in all_modules if m == suffix or m.endswith("." + suffix)}
    out = {}
    for name in sorted(adapted):
        parts = name.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if matches(suffix) <= adapted:
                out.setdefault(suffix, sorted(matches(suffix)))
                break
    return out


# --- reading -----------------------------------------------------------------------------------

_UNSUPPORTED = {  # adapter_config.json key -> the value jaxlm's LoRA can represent
    "use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none",
}


def load_peft(directory: str, model_or_config, params: dict | None = None) -> Adapters:
    """A PEFT LoRA adapter folder -> Adapters whose `merge` equals peft's merged model exactly.

    model_or_config: the model (or its config) the adapter was trained on, in jaxlm form
    (`jaxlm.load` of its HF base). params (arrays or abstract), if given, are checked to hold
    every adapted kernel. HF adapter folders are read from local disk.
    """
    config = getattr(model_or_config, "config", model_or_config)
    meta = _read_config(directory)
    kernels = {name: (path, t) for path, (name, t) in _kernels(config).items()}
    prefixes = getattr(hf.FORMATS[families.by_config(config).name], "TEXT_TOWER_PREFIXES", ())
    scale_of = _scales(meta)
    found = {}
    with Reader(directory, weights=WEIGHTS, index=None) as reader:
        keys = reader.keys()
        # LoRA factors first, so a target without a jaxlm kernel is what the error names
        for key in sorted(keys, key=lambda k: ".lora_" not in k):
            if ".lora_" not in key:
                raise UserError(f"{directory} holds {key}, a whole weight rather than a LoRA factor "
                                "(modules_to_save or an adapted embedding); jaxlm's LoRA cannot hold it")
            module, _, factor = key.removeprefix(PREFIX).partition(".lora_")
            name = module
            for prefix in prefixes:  # a multimodal Gemma 3's text tower
                if name.startswith(prefix):
                    name = "model." + name[len(prefix):]
            if name not in kernels:
                raise UserError(f"{directory} adapts {module}, which jaxlm has no kernel for "
                                "(jaxlm's LoRA adapts the attention and FFN linear layers)")
            m = re.fullmatch(r"([AB])(?:\.[^.]+)?\.weight", factor)
            if m is None:
                raise UserError(f"{directory}: {key} is not a plain LoRA factor (lora_A/lora_B); "
                                "DoRA and LoRA biases have no jaxlm equivalent")
            found.setdefault(name, {})[m.group(1)] = reader.get(key).astype(np.float32)
    if not found:
        raise UserError(f"{directory}/{WEIGHTS} holds no LoRA factors")
    flat_params = flatten(params) if params is not None else None
    converted, scales = {}, {}
    for name, factors in sorted(found.items()):
        if set(factors) != {"A", "B"}:
            raise UserError(f"{directory}: {name} lacks lora_{'A' if 'A' not in factors else 'B'}")
        path, t = kernels[name]
        a_hf, b_hf = factors["A"], factors["B"]
        out_dim, in_dim = t.shapes[0]
        r = a_hf.shape[0]
        if a_hf.shape != (r, in_dim) or b_hf.shape != (out_dim, r):
            raise UserError(f"{directory}: {name} factors {a_hf.shape}, {b_hf.shape} do not fit its "
                            f"weight [{out_dim}, {in_dim}]; the adapter belongs to another model")
        kernel_shape = t.shape
        if flat_params is not None and tuple(getattr(flat_params.get(path), "shape", ())) != kernel_shape:
            raise UserError(f"{directory}: the parameters have no {path} {kernel_shape}; the "
                            "adapter belongs to another model")
        converted[path] = from_peft(t.lora, a_hf, b_hf, kernel_shape)
        scales[path] = scale_of(name, r)
    rank = max(a.shape[-1] for a, _ in converted.values())
    scale = collections.Counter(scales.values()).most_common(1)[0][0]
    out = {}
    for path, (a, b) in converted.items():
        pad = rank - a.shape[-1]  # zero components add nothing
        a = np.concatenate([a, np.zeros(a.shape[:-1] + (pad,), a.dtype)], axis=-1)
        b = np.concatenate([b, np.zeros((pad, b.shape[1]), b.dtype)]) * np.float32(scales[path] / scale)
        parent = path.removesuffix("/kernel")
        out[f"{parent}/lora_a"], out[f"{parent}/lora_b"] = a, b
    targets = [re.escape(p) for p in sorted(converted)]
    return Adapters(unflatten(out), rank=rank, alpha=scale * rank, targets=targets)


def _read_config(directory: str) -> dict:
    path = storage.join(directory, CONFIG)
    if not storage.isfile(path):
        raise UserError(f"{directory} is not a PEFT adapter folder (no {CONFIG})")
    try:
        meta = json.loads(storage.read_text(path))
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    if meta.get("peft_type") != "LORA":
        raise UserError(f"{path}: peft_type {meta.get('peft_type')!r} is not supported; jaxlm reads LORA")
    for key, ok in _UNSUPPORTED.items():
        if meta.get(key, ok) not in (ok, None):
            raise UserError(f"{path} has {key}={meta[key]!r}; jaxlm's LoRA supports only {key}={ok!r}")
    for key in ("modules_to_save", "target_parameters", "trainable_token_indices"):
        if meta.get(key):
            raise UserError(f"{path} has {key}={meta[key]!r}: it trains weights jaxlm has no LoRA "
                            "kernel for; only plain LoRA on linear layers can be loaded")
    return meta


def _scales(meta: dict):
    """-> scale(module name, r): peft's lora_alpha / r (or / sqrt(r) with use_rslora), with
    alpha_pattern keys matched as peft matches them."""
    alpha, patterns = float(meta.get("lora_alpha", 8)), meta.get("alpha_pattern") or {}
    rslora = bool(meta.get("use_rslora"))

    def scale(name: str, r: int) -> float:
        a = next((float(v) for k, v in patterns.items() if re.match(rf"(.*\.)?({k})$", name)), alpha)
        return a / math.sqrt(r) if rslora else a / r
    return scale
