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
import os
import sys


from jaxlm.errors import UserError, cli

NO_DECAY = ("bias", "gamma", "beta")  # biases and LayerNorm (the blog's exclude list)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python train.py --task=mlm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="roberta_base_en",
                   help="built-in preset name (from scratch), Keras preset or jaxlm folder")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder (python -m jaxlm.tokenizer train)")
    p.add_argument("--data", required=True, help="shard folder (python -m jaxlm.shards), local or gs://")
    p.add_argument("--mesh", default=None, help="DxM devices (default: all devices on batch, Nx1)")
    p.add_argument("--layout", default="data", help="RoBERTa sharding table: data | model")
    p.add_argument("--per_replica_batch_size", type=int, default=8)
    p.add_argument("--max_length", type=int, default=512, help="must equal the shards' length")
    p.add_argument("--num_epochs", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=0, help="total steps (overrides --num_epochs)")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=1e-3)
    p.add_argument("--warmup_fraction", type=float, default=0.05)
    p.add_argument("--mlm_probability", type=float, default=0.15)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--bfloat16", action="store_true", help="bfloat16 compute, float32 parameters")
    p.add_argument("--shuffle_buffer", type=int, default=1 << 16, help="rows (blog: 2**18)")
    p.add_argument("--eval_every", type=int, default=0, help="validate every N steps (0: at the end)")
    p.add_argument("--eval_batches", type=int, default=0, help="cap on validation batches (0: all)")
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--save_every", type=int, default=0, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/mlm")
    p.add_argument("--data_readers", type=int, default=0,
                   help="shard readers the global batch is split over (default: one per host); "
                        "the batches depend on it, not on the number of hosts")
    from jaxlm import distributed
    distributed.add_flags(p)
    return p.parse_args(argv)


def split_dirs(data: str) -> tuple[str, str | None]:
    """(train dir, validation dir or None) from --data."""
    from jaxlm import shards
    train = shards.join(data, "train")
    if shards.exists(train):
        val = shards.join(data, "validation")
        return train, val if shards.exists(val) else None
    return data, None


def decay_mask(params: dict) -> dict:
    from jaxlm.tree import flatten, unflatten
    return unflatten({p: not any(n in p.split("/")[-1] for n in NO_DECAY) for p in flatten(params)})


def make_optimizer(a, total_steps: int):
    """AdamW, linear warmup over `warmup_fraction` of the steps, then linear decay to 0."""
    import optax
    warmup = int(total_steps * a.warmup_fraction)
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, a.learning_rate, max(warmup, 1)),
         optax.linear_schedule(a.learning_rate, 0.0, max(total_steps - warmup, 1))], [max(warmup, 1)])
    return optax.adamw(sched, b1=0.9, b2=0.999, eps=1e-8, weight_decay=a.weight_decay,
                       mask=decay_mask), sched


def mlm_loss_fn(model, deterministic: bool = False):
    """(params, batch, rng) -> (loss_sum, {"loss_sum", "correct", "count"}) over the masked slots.

    The head runs only at `mask_positions` [B, M]: ~85% of the vocabulary projection is skipped.
    """
    import jax
    import jax.numpy as jnp

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


def build_model(a, tokenizer, mesh, rules_layout):
    """-> (compute model, float32 params placed on the mesh)."""
    import jaxlm
    import sharding
    from jaxlm import families, loading
    from models.roberta import Roberta, RobertaConfig
    found = families.preset(a.preset)
    try:
        if found is not None:
            family, cfg = found
            if not isinstance(cfg, RobertaConfig):
                raise UserError(f"--preset={a.preset} is not a RoBERTa preset; masked-LM training "
                                "needs roberta_base_en, roberta_large_en or roberta_tiny")
            cfg = cfg.replace(vocab_size=tokenizer.vocab_size, dtype="float32")
            rules = sharding.rules_for(cfg, rules_layout)
            model = Roberta(cfg)
            shapes = loading.abstract_params(model, cfg)
            params = loading.init_params(model, shapes, sharding.placement(mesh, rules), a.seed)
        else:
            _, family, cfg = loading.resolve(a.preset, "float32")
            if not isinstance(cfg, RobertaConfig):
                raise UserError(f"--preset={a.preset} is not a RoBERTa model")
            if cfg.vocab_size < tokenizer.vocab_size:
                raise UserError(f"{a.preset} has {cfg.vocab_size} token embeddings but the tokenizer "
                                f"has {tokenizer.vocab_size} ids; use the model's own tokenizer")
            rules = sharding.rules_for(cfg, rules_layout)
            model, params = jaxlm.load(a.preset, "float32", placement=sharding.placement(mesh, rules))
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise UserError(str(e)) from None
    if a.max_length > cfg.max_sequence_length:
        raise UserError(f"--max_length {a.max_length} exceeds the model's {cfg.max_sequence_length} "
                        "positions; write shorter shards")
    compute = cfg.replace(dropout=a.dropout, dtype="bfloat16" if a.bfloat16 else "float32")
    return Roberta(compute), params


@cli
def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxlm
    import sharding
    from jaxlm import checkpoint, distributed
    from jaxlm.data.mlm import Readers, masking_for
    from jaxlm.train import loop
    from jaxlm.train.step import init_state, make_eval_step, make_train_step, shardings_of

    try:
        mesh = sharding.make_mesh(a.mesh or f"{jax.device_count()}x1")
    except ValueError as e:
        raise UserError(str(e)) from None
    replicas = mesh.shape["batch"]
    global_batch = a.per_replica_batch_size * replicas
    batch_shd = NamedSharding(mesh, P("batch"))
    rows = distributed.local_rows(batch_shd, (global_batch, a.max_length))  # this host's rows
    readers = a.data_readers or jax.process_count()

    tokenizer = jaxlm.load_tokenizer(a.tokenizer)
    masking = masking_for(tokenizer, rate=a.mlm_probability)
    train_dir, val_dir = split_dirs(a.data)
    stream = Readers(train_dir, global_batch=global_batch, count=readers, rows=rows,
                     max_length=a.max_length, masking=masking, shuffle_buffer=a.shuffle_buffer,
                     seed=a.seed)
    if jax.process_count() > 1:  # stderr: every host says which shards it reads
        print(f"process {jax.process_index()}/{jax.process_count()} reads {len(stream.files)} "
              f"train shard(s): {' '.join(os.path.basename(f) for f, _ in stream.files)}",
              file=sys.stderr, flush=True)
    first = next(iter(stream.epoch(0)))  # fail now, not after compiling, on bad shards
    del first
    steps = a.steps or max(1, int(stream.steps_per_epoch * a.num_epochs))

    model, params = build_model(a, tokenizer, mesh, a.layout)
    optimizer, sched = make_optimizer(a, steps)
    state = init_state(params, optimizer, a.seed, mesh)
    del params
    jaxlm.summary(model, state["trainable"])

    os.makedirs(a.out, exist_ok=True)
    fingerprint = {k: v for k, v in vars(a).items()
                   if k in ("preset", "tokenizer", "data", "max_length", "learning_rate",
                            "weight_decay", "per_replica_batch_size", "seed", "mlm_probability")}
    fingerprint.update(steps=steps, mesh=f"{replicas}x{mesh.shape['model']}", data_readers=readers)
    mngr = checkpoint.manager(os.path.join(a.out, "checkpoints"), keep=a.keep)
    restored = checkpoint.resume(mngr, state, fingerprint, a.out)
    if restored is not None:
        state, meta = restored
        print(f"resuming from step {meta['step']} (epoch {meta['epoch']}, batch {meta['batch']})")

    step_fn = make_train_step(mlm_loss_fn(model), optimizer, state_shardings=shardings_of(state),
                              batch_shardings=batch_shd, mesh=mesh)
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
          f"peak learning rate {a.learning_rate:g}, warmup {int(steps * a.warmup_fraction)} steps")
    start = int(jax.device_get(state["step"]))
    chunk = a.eval_every or steps
    history = []
    for stop in list(range(start - start % chunk + chunk, steps, chunk)) + [steps]:
        if stop <= int(jax.device_get(state["step"])):
            continue
        state, h = loop.run(step_fn, state, None, lambda s: place(batches(s)), num_steps=stop,
                            mngr=mngr, save_every=a.save_every, log_every=a.log_every,
                            meta=lambda s: {"step": s, **batches.position(s), "fingerprint": fingerprint},
                            metrics_path=loop.metrics_file(a.out))
        history += h
        result = validate(stop)
        if result is not None and jax.process_index() == 0:
            with open(os.path.join(a.out, "validation.jsonl"), "a") as f:
                f.write(__import__("json").dumps(result) + "\n")
    mngr.close()
    if len(history) > 1:
        (s0, m0), (s1, m1) = history[0], history[-1]
        print(f"MLM loss {m0['loss']:.3f} -> {m1['loss']:.3f}, masked-token accuracy "
              f"{m0['accuracy']:.3f} -> {m1['accuracy']:.3f} (steps {s0} -> {s1})")
    base = dataclasses.replace(model.config, dropout=0.0, dtype="float32")
    jaxlm.save(os.path.join(a.out, "model"), type(model)(base), state["trainable"], tokenizer)
    print(f"saved the trained model to {os.path.join(a.out, 'model')} (jaxlm folder)")
    return 0


class _Positioned:
    """`batches(step)` for the loop: the stream re-entered at any step (resume-safe)."""

    def __init__(self, stream):
        from jaxlm.data.mlm import prefetch
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
