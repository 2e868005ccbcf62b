"""Masked-LM pretraining of RoBERTa on TFRecord shards, the TF+TPU blog's `run_mlm.py` in JAX.

    python train.py --task=mlm --preset=roberta_base_en --tokenizer=DIR --data=DIR --mesh=8x1

--data is the folder `python -m jaxlm.shards` wrote (its train/ and validation/), or a folder of
shards itself. A built-in preset name trains from scratch: that architecture with the tokenizer's
vocabulary size. A Keras preset or jaxlm folder continues from its weights.

The blog's recipe is the default: AdamW (b1 .9, b2 .999, eps 1e-8) at peak 1e-4, weight decay
1e-3 except on biases and LayerNorm, 5% linear warmup then linear decay to 0, 8 sequences per
data replica, 15% dynamic masking, dropout 0.1, one epoch; `--bfloat16` computes in bfloat16
with float32 parameters (the blog's mixed_bfloat16). The step, loop and checkpoints are the
generic ones in jaxlm/train and jaxlm/checkpoint.py; only the loss, optimizer and data differ.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxlm
import sharding
from jaxlm import checkpoint, distributed, families, loading, precision, shards, storage
from jaxlm.data.mlm import Readers, masking_for, prefetch
from jaxlm.errors import UserError, cli
from jaxlm.train import flags, loop, optim, report, trainer
from jaxlm.train.step import make_eval_step
from models.roberta import Roberta, RobertaConfig

NO_DECAY = ("bias", "gamma", "beta")  # biases and LayerNorm (the blog's exclude list)


def parse(argv: list[str]) -> argparse.Namespace:
    p = flags.ArgumentParser(prog="python train.py --task=mlm", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter,
                             allow_abbrev=False)
    flags.add_shared(p, {"layout": "data", "epochs": 1.0, "learning_rate": 1e-4,
                         "weight_decay": 1e-3, "seed": 0, "out": "runs/mlm", "save_every": 0,
                         "keep": 3, "log_every": 10}, helps={
        "mesh": "DxM devices (default: all devices on batch, Nx1)",
        "layout": "RoBERTa sharding table: data | model",
        "steps": "total steps (default: --epochs of the training shards)",
        "batch_size": "global batch (default: 8 per data replica, the blog's)",
        "warmup_steps": "linear warmup steps (default: --warmup_fraction of the steps)"},
        aliases={"epochs": ("num_epochs",)})
    p.add_argument("--preset", default="roberta_base_en",
                   help="built-in preset name (from scratch), Keras preset or jaxlm folder")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder (python -m jaxlm.tokenizer train)")
    p.add_argument("--data", required=True, help="shard folder (python -m jaxlm.shards), local or gs://")
    p.add_argument("--per_replica_batch_size", type=int, default=None,
                   help="the blog's spelling of the batch: rows per data replica (default 8)")
    p.add_argument("--max_length", type=int, default=512, help="must equal the shards' length")
    p.add_argument("--warmup_fraction", type=float, default=None,
                   help="warmup as a fraction of the steps (default 0.05, the blog's)")
    p.add_argument("--mlm_probability", type=float, default=0.15)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--bfloat16", action="store_true",
                   help="the blog's mixed_bfloat16: --compute_dtype=bfloat16 (float32 parameters)")
    p.add_argument("--shuffle_buffer", type=int, default=1 << 16, help="rows (blog: 2**18)")
    p.add_argument("--eval_every", type=int, default=0, help="validate every N steps (0: at the end)")
    p.add_argument("--eval_batches", type=int, default=0, help="cap on validation batches (0: all)")
    p.add_argument("--allow_data_change", action="store_true",
                   help="resume even though the shards changed (names or sizes) since the checkpoint")
    p.add_argument("--data_readers", type=int, default=0,
                   help="shard readers the global batch is split over (default: one per host); "
                        "the batches depend on it, not on the number of hosts")
    distributed.add_flags(p)
    a = p.parse_args(argv)
    ns = vars(a)
    flags.check_dtypes(ns)
    if a.bfloat16:
        if a.compute_dtype not in (None, "bfloat16") or a.dtype not in (None, "bfloat16"):
            raise UserError("--bfloat16 means --compute_dtype=bfloat16; drop one of the two")
        a.compute_dtype = "bfloat16"
    if a.batch_size is not None and a.per_replica_batch_size is not None:
        raise UserError("give --batch_size (global) or --per_replica_batch_size, not both")
    if a.warmup_steps is not None and a.warmup_fraction is not None:
        raise UserError("give --warmup_steps or --warmup_fraction, not both")
    for flag in ("batch_size", "per_replica_batch_size", "steps", "max_length", "log_every", "keep"):
        v = ns.get(flag)
        if v is not None and v < 1:
            raise UserError(f"--{flag}={v} must be >= 1")
    return a


def split_dirs(data: str) -> tuple[str, str | None]:
    """(train dir, validation dir or None) from --data."""
    train = storage.join(data, "train")
    if storage.exists(train):
        val = storage.join(data, "validation")
        return train, val if storage.exists(val) else None
    return data, None


def optimizer_config(a, total_steps: int, mu_dtype: str | None = None):
    """The blog's AdamW: eps 1e-8, no decay on biases and LayerNorm, linear warmup over
    `--warmup_steps` (default 5% of the steps) then linear decay to 0, no clipping."""
    warmup = a.warmup_steps if a.warmup_steps is not None else int(
        total_steps * (0.05 if a.warmup_fraction is None else a.warmup_fraction))
    return optim.OptimConfig(learning_rate=a.learning_rate, weight_decay=a.weight_decay,
                             warmup_steps=warmup, schedule="linear", total_steps=total_steps,
                             clip_norm=None, eps=1e-8, no_decay=NO_DECAY, mu_dtype=mu_dtype)


def mlm_loss_fn(model, deterministic: bool = False):
    """(params, batch, rng) -> (loss_sum, {"loss_sum", "correct", "count"}) over the masked slots.

    The head runs only at `mask_positions` [B, M]: ~85% of the vocabulary projection is skipped.
    """
    def loss_fn(params, batch, rng):
        rngs = None if deterministic else {"dropout": rng}
        logits = model.apply({"params": params}, batch["token_ids"], batch["padding_mask"],
                             mask_positions=batch["mask_positions"], deterministic=deterministic,
                             rngs=rngs).astype(jnp.float32)  # [B, M, V]
        labels, w = batch["mask_ids"], batch["mask_weights"].astype(jnp.float32)
        target = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        ce = jax.nn.logsumexp(logits, axis=-1) - target
        correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
        sums = {"loss_sum": jnp.sum(ce * w), "correct": jnp.sum(correct * w), "count": jnp.sum(w)}
        return sums["loss_sum"], sums
    return loss_fn


def build_model(preset: str, tokenizer, mesh, layout: str, *, max_length: int, dropout: float,
                policy: precision.Policy, seed: int = 0):
    """-> (compute model, parameters in the policy's master dtype, placed on the mesh).

    A built-in preset name is that architecture with the tokenizer's vocabulary, randomly
    initialised; a Keras preset or jaxlm folder continues from its weights.
    """
    found = families.preset(preset)
    try:
        if found is not None:
            _, cfg = found
            if not isinstance(cfg, RobertaConfig):
                raise UserError(f"--preset={preset} is not a RoBERTa preset; masked-LM training "
                                "needs roberta_base_en, roberta_large_en or roberta_tiny")
            cfg = cfg.replace(vocab_size=tokenizer.vocab_size, dtype=policy.param)
            rules = sharding.rules_for(cfg, layout)
            stored = Roberta(cfg)
            params = loading.init_params(stored, loading.abstract_params(stored, cfg),
                                         sharding.placement(mesh, rules), seed)
        else:
            _, _, cfg = loading.resolve(preset, policy.param)
            if not isinstance(cfg, RobertaConfig):
                raise UserError(f"--preset={preset} is not a RoBERTa model")
            if cfg.vocab_size < tokenizer.vocab_size:
                raise UserError(f"{preset} has {cfg.vocab_size} token embeddings but the tokenizer "
                                f"has {tokenizer.vocab_size} ids; use the model's own tokenizer")
            rules = sharding.rules_for(cfg, layout)
            _, params = jaxlm.load(preset, policy.param, placement=sharding.placement(mesh, rules))
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise UserError(str(e)) from None
    if max_length > cfg.max_sequence_length:
        raise UserError(f"--max_length {max_length} exceeds the model's {cfg.max_sequence_length} "
                        "positions; write shorter shards")
    return Roberta(cfg.replace(dropout=dropout, dtype=policy.compute)), params


@cli
def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    checkpoint.check_run_folder(a.out)  # before anything loads
    try:
        mesh = sharding.make_mesh(a.mesh or f"{jax.device_count()}x1")
    except ValueError as e:
        raise UserError(str(e)) from None
    replicas = mesh.shape["batch"]
    global_batch = a.batch_size or (a.per_replica_batch_size or 8) * replicas
    if global_batch % replicas:
        raise UserError(f"--batch_size={global_batch} is not divisible by the mesh's {replicas} "
                        "data replicas; use a multiple of it")
    batch_shd = NamedSharding(mesh, P("batch"))
    rows = distributed.local_rows(batch_shd, (global_batch, a.max_length))  # this host's rows
    readers = a.data_readers or jax.process_count()
    policy = precision.resolve(dtype=a.dtype, param_dtype=a.param_dtype, compute_dtype=a.compute_dtype)
    for line in precision.warnings(policy, lora=False):
        print(line, file=sys.stderr)

    tokenizer = jaxlm.load_tokenizer(a.tokenizer)
    masking = masking_for(tokenizer, rate=a.mlm_probability)
    train_dir, val_dir = split_dirs(a.data)
    stream = Readers(train_dir, global_batch=global_batch, count=readers, rows=rows,
                     max_length=a.max_length, masking=masking, shuffle_buffer=a.shuffle_buffer,
                     seed=a.seed)
    if jax.process_count() > 1:  # stderr: every host says which shards it reads
        print(f"process {jax.process_index()}/{jax.process_count()} reads {len(stream.files)} "
              f"train shard(s): {' '.join(storage.basename(f) for f, _ in stream.files)}",
              file=sys.stderr, flush=True)
    first = next(iter(stream.epoch(0)))  # fail now, not after compiling, on bad shards
    del first
    steps = a.steps or max(1, int(stream.steps_per_epoch * a.epochs))

    model, params = build_model(a.preset, tokenizer, mesh, a.layout, max_length=a.max_length,
                                dropout=a.dropout, policy=policy, seed=a.seed)
    ocfg = optimizer_config(a, steps, mu_dtype=policy.optimizer)
    run_ = trainer.build(params, mesh,
                         param_specs=sharding.partition_specs(params, sharding.rules_for(
                             model.config, a.layout), mesh),
                         loss_fn=mlm_loss_fn(model), optimizer=optim.make_optimizer(ocfg),
                         seed=a.seed)
    state = run_.state
    del params
    jaxlm.summary(model, state["trainable"])
    print(f"precision: {policy.describe(lora=False)}")

    storage.makedirs(a.out)
    fingerprint = {k: v for k, v in vars(a).items()
                   if k in ("preset", "tokenizer", "data", "max_length", "learning_rate",
                            "weight_decay", "seed", "mlm_probability", "dtype", "param_dtype",
                            "compute_dtype")}
    fingerprint.update(steps=steps, mesh=f"{replicas}x{mesh.shape['model']}", data_readers=readers,
                       batch_size=global_batch, warmup_steps=ocfg.warmup_steps,
                       data_files=checkpoint.files_fingerprint(  # shards can be many GB: sizes only
                           [f for d in (train_dir, val_dir) if d for f, _ in shards.list_shards(d)],
                           hashed=lambda p: False))
    mngr = checkpoint.manager(storage.join(a.out, "checkpoints"), keep=a.keep)
    restored = checkpoint.resume(mngr, state, fingerprint, a.out,
                                 allow_change=checkpoint.DATA_KEYS if a.allow_data_change else ())
    if restored is not None:
        state, meta = restored
        print(f"resuming from step {meta['step']} (epoch {meta['epoch']}, batch {meta['batch']})")

    evaluate = make_eval_step(mlm_loss_fn(model, deterministic=True))

    def place(local: dict) -> dict:
        return distributed.place_batch(batch_shd, local,
                                       {k: (global_batch,) + v.shape[1:] for k, v in local.items()})

    batches = _Positioned(stream)

    def validate(step: int) -> dict | None:
        if val_dir is None:
            return None
        val = Readers(val_dir, global_batch=global_batch, count=readers, rows=rows,
                      max_length=a.max_length, masking=masking, shuffle=False, repeat=False,
                      seed=a.seed + 1)
        totals = None
        for i, b in enumerate(val.epoch(0)):
            if a.eval_batches and i >= a.eval_batches:
                break
            sums = evaluate(state["trainable"], None, place(b))
            totals = sums if totals is None else jax.tree.map(lambda x, y: x + y, totals, sums)
        host = {k: float(v) for k, v in jax.device_get(totals).items()}
        n = max(host["count"], 1.0)
        out = {"step": step, "val_loss": host["loss_sum"] / n, "val_accuracy": host["correct"] / n}
        print(f"validation at step {step}: loss {out['val_loss']:.4f}  accuracy {out['val_accuracy']:.3f}"
              f"  ({int(host['count'])} masked tokens)")
        return out

    print(f"training {steps} steps of {global_batch} x {a.max_length} tokens "
          f"({stream.steps_per_epoch} steps per epoch) on a {replicas}x{mesh.shape['model']} mesh, "
          f"peak learning rate {a.learning_rate:g}, warmup {ocfg.warmup_steps} steps")
    start = int(jax.device_get(state["step"]))
    chunk = a.eval_every or steps
    history = []
    validations = loop.MetricsFile(storage.join(a.out, "validation.jsonl")) \
        if val_dir is not None and jax.process_index() == 0 else None
    board = [report.TensorBoard(a.out)] if jax.process_index() == 0 else []
    for stop in list(range(start - start % chunk + chunk, steps, chunk)) + [steps]:
        if stop <= int(jax.device_get(state["step"])):
            continue
        state, h = loop.run(run_.step, state, None, lambda s: place(batches(s)), num_steps=stop,
                            mngr=mngr, save_every=a.save_every, log_every=a.log_every,
                            meta=lambda s: {"step": s, **batches.position(s), "fingerprint": fingerprint},
                            metrics_path=loop.metrics_file(a.out), sinks=board)
        history += h
        result = validate(stop)
        if result is not None and validations is not None:
            validations.write([result])
            for sink in board:
                sink.write([result])
    if validations is not None:
        validations.close()
    mngr.close()
    for sink in board:
        sink.close()
    if jax.process_index() == 0 and report.plot(a.out):
        print(f"wrote {storage.join(a.out, 'metrics.png')} and TensorBoard events in "
              f"{storage.join(a.out, 'tensorboard')}")
    if len(history) > 1:
        (s0, m0), (s1, m1) = history[0], history[-1]
        print(f"MLM loss {m0['loss']:.3f} -> {m1['loss']:.3f}, masked-token accuracy "
              f"{m0['accuracy']:.3f} -> {m1['accuracy']:.3f} (steps {s0} -> {s1})")
    base = dataclasses.replace(model.config, dropout=0.0, dtype=policy.param)
    jaxlm.save(storage.join(a.out, "model"), type(model)(base), state["trainable"], tokenizer)
    print(f"saved the trained model to {storage.join(a.out, 'model')} (jaxlm folder)")
    return 0


class _Positioned:
    """`batches(step)` for the loop: the stream re-entered at any step (resume-safe)."""

    def __init__(self, stream):
        self.stream, self.prefetch = stream, prefetch
        self.next_step, self.it = None, None

    def position(self, step: int) -> dict:
        return {"epoch": step // self.stream.steps_per_epoch, "batch": step % self.stream.steps_per_epoch}

    def _from(self, step: int):
        epoch, skip = divmod(step, self.stream.steps_per_epoch)
        while True:
            it = self.stream.epoch(epoch)
            for _ in range(skip):  # deterministic replay: masks depend only on (seed, epoch)
                next(it)
            yield from it
            epoch, skip = epoch + 1, 0

    def __call__(self, step: int) -> dict:
        if self.it is None or step != self.next_step:
            self.it = self.prefetch(self._from(step))
        self.next_step = step + 1
        return next(self.it)


if __name__ == "__main__":
    sys.exit(main())
