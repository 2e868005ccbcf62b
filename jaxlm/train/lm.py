"""`python train.py` for causal LMs: load onto the mesh, LoRA, data, train, evaluate, export.

Only wiring lives here, from the command line's `Args` to explicit arguments of the pieces:
`jaxlm.precision` (the dtypes), `jaxlm.train.trainer` (state + step), `jaxlm.train.{loss,optim,
loop,evaluate,export}`, `jaxlm.data`, `jaxlm.checkpoint`, `jaxlm.lora` and `sharding`.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
import uuid

import jax

import jaxlm
import sharding
from jaxlm import checkpoint, compile_cache, data, distributed, machine, precision, storage
from jaxlm.errors import UserError
from jaxlm.loading import resolve
from jaxlm.train import cli, loop, optim, report, trainer as trainer_lib
from jaxlm.train.evaluate import Evaluator, sample_instructions
from jaxlm.train.export import export
from jaxlm.train.loss import lm_loss_fn


def build_mesh(spec: str):
    try:
        return sharding.make_mesh(spec)
    except ValueError as e:
        raise UserError(str(e)) from None


def default_preset() -> str:
    """The model when --preset is not given: the demo extra's pretrained Gemma 3 270M if it is
    installed, else the random toy. JAXLM_DEFAULT_PRESET overrides (the test suite pins the toy)."""
    forced = os.environ.get("JAXLM_DEFAULT_PRESET")
    if forced:
        return forced
    try:
        demo = importlib.import_module(cli.DEMO_PACKAGE)
    except ImportError:
        print(f"NOTE: the demo extra is not installed (pip install -e \".[demo]\" brings a pretrained "
              f"Gemma 3 270M), so the default model is {cli.TOY_PRESET}.")
        return cli.TOY_PRESET
    path = demo_file(demo)
    print(f"model: Gemma 3 270M, pretrained, from the demo extra ({path})")
    return path


def demo_file(demo) -> str:
    """The demo extra's GGUF, assembled from its package's chunks into ~/.cache on first use.

    The package writes the file in place, so a process that finds it half written (another
    process of a multi-host run, or a run killed while writing) reads a wrong checksum. Each
    process here assembles into its own temporary name and renames it into place: the file is
    there whole or not at all."""
    target = demo.default_output_path()
    if target.exists():
        try:
            return str(demo.assemble())  # checks the sha256
        except FileExistsError:
            pass  # left half written by a killed run: rebuilt below
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.part")
    try:
        demo.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return str(target)  # a str: the run's flags are stored as JSON


def resolve_defaults(a: cli.Args, toy: bool, demo: bool = False) -> cli.Args:
    """Fill the defaults that depend on the preset and data (see cli.TOY_* and cli.DEMO_*)."""
    if a.learning_rate:
        lr = a.learning_rate
    elif toy:
        lr = cli.TOY_LEARNING_RATE if a.lora_rank else cli.TOY_FULL_LEARNING_RATE
    else:
        lr = cli.DEMO_LEARNING_RATE if demo else 5e-5  # 5e-5: the seed's
    return dataclasses.replace(
        a,
        sequence_length=a.sequence_length or (cli.DATA_SEQUENCE_LENGTH if a.data else cli.TOY_SEQUENCE_LENGTH),
        learning_rate=lr,
        template=a.template or data.TEMPLATE,
        max_new_tokens=a.max_new_tokens or (128 if a.data else 12))


def load_data(a: cli.Args, tokenizer):
    """-> (train Records, held-out Records or None, rows): rows are the batchable arrays
    {"token_ids", "padding_mask", "loss_mask"[, "segment_ids", "positions"]}, [N, L+1] each."""
    template = data.check_template(a.template)
    if a.data:
        if a.data.startswith("tfds:"):  # imported only for TFDS runs
            from jaxlm.data import tfds as tfds_data
            train = tfds_data.read_records(a.data, a.instruction_column, a.output_column,
                                           a.limit or None, data_dir=a.tfds_data_dir)
        else:
            train = data.read_records(a.data, a.instruction_column, a.output_column, a.limit or None)
        note = train.report(a.data)
        if note:
            print(note)
        held = None
    else:
        train, held = data.builtin_dataset()
    loss_on = a.loss_on or cli.DEFAULT_LOSS_ON
    rows = data.encode(tokenizer, train, template, a.sequence_length, loss_on=loss_on)
    unscored = int((~rows["loss_mask"][:, 1:].any(1)).sum())
    if unscored == len(train):
        raise UserError(f"no example has a {loss_on} token within --sequence_length="
                        f"{a.sequence_length} (the prompts fill it); raise --sequence_length"
                        + (" or use --loss_on=all" if loss_on == "response" else ""))
    if unscored:
        print(f"warning: {unscored} of {len(train)} examples have no {loss_on} token within "
              f"--sequence_length={a.sequence_length} and teach nothing", file=sys.stderr)
    mask = rows["padding_mask"]
    truncated = int((mask.sum(1) == mask.shape[1]).sum())
    print(f"data: {len(train)} examples from {a.data or 'the built-in dataset'}, sequence_length "
          f"{a.sequence_length}" + (f" ({truncated} truncated)" if truncated else "")
          + f", loss on {a.loss_on or cli.DEFAULT_LOSS_ON} tokens")
    if a.packing:
        rows = data.pack_rows(rows)
        real = int(rows["padding_mask"].sum())
        print(f"packing: {len(train)} examples into {len(rows['token_ids'])} rows "
              f"({real / rows['padding_mask'].size:.0%} of the tokens are real)")
    rows = data.trim_padding(rows)
    width = rows["token_ids"].shape[1] - 1
    if width < a.sequence_length:
        print(f"data: every row fits in {width} of the {a.sequence_length} tokens; the step runs "
              f"on {width}")
    return train, held, rows


def num_steps(a: cli.Args, num_examples: int, default: int | None = None) -> int:
    """--steps, else --epochs, else `default` (toy/demo runs), else one epoch."""
    if a.steps:
        return a.steps
    per_step = a.batch_size * a.accum_steps
    if a.epochs:
        return max(1, math.ceil(a.epochs * num_examples / per_step))
    return default or max(1, math.ceil(num_examples / per_step))


def policy_of(a: cli.Args, platform: str | None = None) -> precision.Policy:
    """The precision policy these flags ask for on `platform` (default: this one)."""
    return precision.resolve(dtype=a.dtype, param_dtype=a.param_dtype,
                             compute_dtype=a.compute_dtype, platform=platform)


def lora_spec_of(a: cli.Args) -> trainer_lib.LoraSpec | None:
    return trainer_lib.LoraSpec(a.lora_rank, a.lora_alpha, a.lora_targets) if a.lora_rank else None


def evaluate(evaluator: Evaluator, when: str, model, state: dict, frozen: dict | None):
    """-> (result, state, frozen): the model evaluated with its LoRA adapters (`frozen` is the
    base) or its trainable weights; the evaluator may move the base or the trainable weights
    and hands them back (see `Evaluator.__call__`)."""
    if frozen is not None:
        result, frozen = evaluator(when, model, frozen, state["trainable"])
        return result, state, frozen
    result, trained = evaluator(when, model, state["trainable"])
    return result, {**state, "trainable": trained}, None


def run(a: cli.Args) -> int:
    if not a.compile_only:
        checkpoint.check_run_folder(a.out)  # before anything loads
    demo = False
    if a.preset is None:
        a = dataclasses.replace(a, preset=default_preset())
        demo = a.preset != cli.TOY_PRESET and not a.data
    if a.compile_only:  # abstract params only: nothing is read, tokenized or allocated
        from jaxlm.train import aot
        target = "cpu" if a.compile_only == "cpu" else "tpu"
        return aot.run_compile_only(
            a.preset, a.compile_only, mesh_spec=a.mesh, lora=lora_spec_of(a), layout=a.layout,
            batch_size=a.batch_size, sequence_length=a.sequence_length or cli.DATA_SEQUENCE_LENGTH,
            accum_steps=a.accum_steps, remat=a.remat, policy=policy_of(a, target), packing=a.packing)
    phases, hits = report.Phases(), compile_cache.Hits()
    policy = policy_of(a)
    kind, family, config = resolve(a.preset, policy.compute)
    toy = kind == "preset"
    a = resolve_defaults(a, toy, demo)
    mesh = build_mesh(a.mesh)
    if a.attention != "xla" and jax.default_backend() != "gpu":
        raise UserError(f"--attention={a.attention} needs an NVIDIA GPU (this is "
                        f"{jax.default_backend()}); drop the flag")
    if a.attention == "cudnn" and a.packing and a.sequence_length % 2:
        raise UserError(f"--attention=cudnn with --packing needs an even --sequence_length (cuDNN's "
                        f"masked attention); got {a.sequence_length}")
    if a.batch_size % mesh.shape["batch"]:
        raise UserError(f"--batch_size={a.batch_size} is not divisible by the mesh's batch axis "
                        f"({mesh.shape['batch']}); use a multiple of it")
    if toy:
        print(f"NOTE: {a.preset} is a built-in config with RANDOMLY INITIALISED weights: a toy to "
              "exercise the pipeline, not a trained model. Pass --preset=PATH for real weights.")
        if a.lora_rank:
            print("NOTE: adapters on a random base learn little (its frozen tied embedding keeps the "
                  "logits within about +-2, so the loss cannot go much below ~6.3); "
                  "--lora_rank=0 --steps=400 shows real learning.")
    for line in precision.warnings(policy, bool(a.lora_rank)):
        print(line, file=sys.stderr)
    tokenizer = jaxlm.load_tokenizer(a.preset)
    train, held, rows = load_data(a, tokenizer)  # bad data fails before the model loads
    default_steps = cli.TOY_STEPS if toy and not a.data else cli.DEMO_STEPS if demo else None
    steps = num_steps(a, len(rows["token_ids"]), default_steps)

    # The base is stored in the frozen dtype under LoRA (it never updates), else in the master one.
    stored = policy.frozen if a.lora_rank else policy.param
    try:
        rules = sharding.rules_for(config, a.layout)
        sharding.partition_specs(jaxlm.load(a.preset, policy.compute, abstract=True,
                                            param_dtype=stored)[1], rules, mesh)
    except ValueError as e:  # a bad --layout or a rule that fits no parameter
        raise UserError(str(e)) from None
    model, params = jaxlm.load(a.preset, policy.compute, param_dtype=stored,
                               placement=sharding.placement(mesh, rules), seed=a.seed)
    base_model = model
    try:
        model = trainer_lib.training_model(model, platform=jax.default_backend(),
                                           remat=a.remat, attention=a.attention)
    except ValueError as e:  # cudnn in float32, or Gemma 2's attention soft-cap
        raise UserError(f"--attention: {e}") from None
    param_specs = sharding.partition_specs(params, rules, mesh)
    ocfg = optim.OptimConfig(learning_rate=a.learning_rate, weight_decay=a.weight_decay,
                             warmup_steps=a.warmup_steps, schedule=a.schedule, total_steps=steps,
                             clip_norm=a.clip_norm, mu_dtype=policy.optimizer)
    optimizer = optim.make_optimizer(ocfg)
    try:
        run_ = trainer_lib.build(params, mesh, param_specs=param_specs, loss_fn=lm_loss_fn(model),
                                 optimizer=optimizer, lora=lora_spec_of(a), trainable_dtype=policy.param,
                                 accum_steps=a.accum_steps, seed=a.seed,
                                 activations=trainer_lib.activation_rules(
                                     model, a.layout, jax.default_backend()),
                                 train_layout=trainer_lib.train_layout_of(
                                     model, params, lora=bool(a.lora_rank),
                                     platform=jax.default_backend()))
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise UserError(str(e)) from None
    state, frozen = run_.state, run_.frozen
    del params  # the state (full fine-tune) or the frozen tree (LoRA) owns them now
    adapters = state["trainable"] if a.lora_rank else None
    if a.print_sharding:
        print(f"sharding on the {mesh.shape['batch']}x{mesh.shape['model']} (batch, model) mesh, "
              f"layout {a.layout or sharding.DEFAULT_LAYOUT[config.family]}:")
        print(sharding.format_sharding(frozen if a.lora_rank else state["trainable"]))
        if adapters is not None:
            print(sharding.format_sharding(adapters))
    jaxlm.summary(base_model, frozen if a.lora_rank else state["trainable"], trainable=adapters)
    print(f"precision: {policy.describe(bool(a.lora_rank))}")

    storage.makedirs(a.out)
    fp = cli.fingerprint(a) | ({"steps": steps} if a.schedule == "cosine" else {})
    mngr = checkpoint.manager(storage.join(a.out, "checkpoints"), keep=a.keep)
    restored = checkpoint.resume(mngr, state, fp, a.out,
                                 allow_change=checkpoint.DATA_KEYS if a.allow_data_change else ())
    evaluator = Evaluator(tokenizer, a.template, held,
                          sample_instructions(a.prompt, held, train.instructions, a.num_samples),
                          eval_examples=a.eval_examples, max_new_tokens=a.max_new_tokens, mesh=mesh)
    lead = jax.process_index() == 0
    # Drawing a built-in's random weights runs on the devices, asynchronously: wait for it here
    # or the time table counts it as the step's compile (Gemma 2B: ~38 s of a 63 s "compile").
    jax.block_until_ready((state, frozen))
    phases.mark("load")
    before_path = storage.join(a.out, "eval_before.json")
    if restored is not None:
        state, meta = restored
        print(f"resuming from step {meta['step']} ({storage.join(a.out, 'checkpoints', str(meta['step']))}, "
              f"data position {meta['data_position']})")
        before = json.loads(storage.read_text(before_path)) if storage.exists(before_path) else {}
    else:
        before, state, frozen = evaluate(evaluator, "before", base_model, state, frozen)
        if lead:
            storage.write_text(before_path, json.dumps(before, indent=1))
        phases.mark("eval before")

    def get_batch(step):
        # Every host can index the whole batch (the rows are in memory); it keeps the rows its
        # devices hold: half of them on a 2x4 mesh over 2 hosts, all of them on 1x8 (replicated).
        whole = data.batch_rows(rows, step, batch_size=a.batch_size, accum_steps=a.accum_steps,
                                seed=a.seed)
        axis = 0 if a.accum_steps == 1 else 1
        shapes = {k: v.shape for k, v in whole.items()}
        mine = distributed.local_rows(run_.batch_sharding, shapes["token_ids"], axis)
        local = {k: v[(slice(None),) * axis + (mine,)] for k, v in whole.items()}
        return distributed.place_batch(run_.batch_sharding, local, shapes)

    global_batch = a.batch_size * a.accum_steps
    board = [report.TensorBoard(a.out)] if lead else []
    done = int(jax.device_get(state["step"]))
    if done >= steps:
        print(f"already trained to step {done} (of {steps}); nothing left to run")
    else:
        print(f"training steps {done + 1}..{steps} of {global_batch} examples x "
              f"{rows['token_ids'].shape[1] - 1} tokens on a {mesh.shape['batch']}x"
              f"{mesh.shape['model']} mesh, learning rate {a.learning_rate:g}")
    # the base as the step takes it (with its train layout, held for the loop only)
    state, history = loop.run(run_.step, state, run_.step_frozen(frozen), get_batch,
                              num_steps=steps, mngr=mngr, save_every=a.save_every, log_every=a.log_every,
                              meta=lambda s: {"step": s, "data_position": s * global_batch,
                                              "fingerprint": fp},
                              metrics_path=loop.metrics_file(a.out), phases=phases, sinks=board)
    mngr.close()
    for sink in board:
        sink.close()
    machine.return_freed_memory()  # the steps' temporaries, which the evaluation would sit on
    if len(history) > 1:
        (s0, m0), (s1, m1) = history[0], history[-1]
        print(f"loss {m0['loss']:.3f} -> {m1['loss']:.3f}, token accuracy {m0['accuracy']:.3f} -> "
              f"{m1['accuracy']:.3f} (steps {s0} -> {s1})")

    after, state, frozen = evaluate(evaluator, "after", base_model, state, frozen)
    trained = state["trainable"]
    if lead:
        storage.write_text(storage.join(a.out, "eval_after.json"), json.dumps(after, indent=1))
    if "exact_match" in before and "exact_match" in after:
        print(f"exact match: {before['exact_match']:.1%} before -> {after['exact_match']:.1%} after")
    phases.mark("eval after")
    export(a.out, base_model, frozen if a.lora_rank else trained, trained if a.lora_rank else None,
           tokenizer, merged=a.export == "merged", base=a.preset)
    if lead:
        png = report.plot(a.out)
        if png:
            print(f"wrote {png} (loss and token accuracy) and TensorBoard events: "
                  f"tensorboard --logdir {storage.join(a.out, 'tensorboard')}")
    phases.mark("export")
    print(phases.table())
    cached = hits.close()
    if cached:
        print(cached)
    return 0
