"""The jitted train step: explicit shardings, donated state, LoRA merged inside jit.

State is a plain dict, so orbax checkpoints it as any other tree (built by
`jaxlm.train.trainer`)::

    {"step": int32 [], "trainable": tree, "opt_state": optax state, "rng": uint32 [2]}

`trainable` is the LoRA adapter tree (base parameters frozen, passed separately and never in
the optimizer state) or, at rank 0, the full parameter tree.

The step is generic over the loss: `loss_fn(params, batch, rng) -> (loss_sum, metrics)` where
`loss_sum` is the SUM of per-token losses and `metrics` holds sums including "count" (the
number of weighted tokens); see `jaxlm.train.loss.lm_loss_fn`. The gradient is
grad(sum over all micro-batches) / total count, so accumulating k micro-batches of B rows is the
same update as one step on k*B rows (a mean of per-micro-batch means would not be).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from models import layers

LossFn = Callable  # (params, batch, rng) -> (loss_sum [], metrics {str: []} with "count")
MergeFn = Callable  # (frozen, trainable) -> params the loss sees


def shardings_of(tree):
    """The live sharding of every array in `tree` (for in/out_shardings and checkpoint restore)."""
    return jax.tree.map(lambda x: x.sharding, tree)


def micro_batch_sharding(mesh, accum_steps: int = 1) -> NamedSharding:
    """Batch leaves [B, ...] (or [A, B, ...] when accumulating) split on the mesh's "batch" axis."""
    return NamedSharding(mesh, P("batch") if accum_steps == 1 else P(None, "batch"))


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                    merge: MergeFn | None = None, accum_steps: int = 1,
                    state_shardings=None, frozen_shardings=None, batch_shardings=None,
                    mesh=None, activations: dict | None = None, donate: bool = True,
                    layout: bool = False):
    """-> step(state, frozen, batch) -> (new_state, metrics), jitted.

    loss_fn: (params, batch, rng) -> (loss_sum, metric sums incl. "count").
    merge: (frozen, trainable) -> params; None means `trainable` are the params (full fine-tune)
      and `frozen` is ignored (pass None).
    accum_steps: batch leaves carry a leading micro-batch axis [A, B, ...] when > 1.
    *_shardings, mesh: explicit jit in/out shardings (all or none); metrics come back replicated.
    activations: the layout table's activation rules (`jaxlm.train.trainer.activation_rules`),
      which the model's `layers.constrain` calls follow on `mesh`; None leaves them to XLA.
    layout: `frozen` is a pair (base, its CPU train layout from `models.train_layout.build`)
      and `trainable` the LoRA adapters, which the step does not merge: it calls
      `loss_fn(base, batch, rng, layout=..., adapters=trainable)`.
    Returned metrics: loss, accuracy (per weighted token), count, grad_norm (before clipping).
    """
    def params_of(frozen, trainable):
        return trainable if merge is None else merge(frozen, trainable)

    def grads_and_sums(trainable, frozen, batch, rng):
        def objective(tr):
            if layout:
                base, laid = frozen
                return loss_fn(base, batch, rng, layout=laid, adapters=tr)
            return loss_fn(params_of(frozen, tr), batch, rng)
        with layers.activation_layout(mesh, activations):
            (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
        return grads, sums

    def step(state, frozen, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        trainable = state["trainable"]
        if accum_steps == 1:
            grads, sums = grads_and_sums(trainable, frozen, batch, rng)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        else:
            def body(carry, xs):
                i, micro = xs
                g, s = grads_and_sums(trainable, frozen, micro, jax.random.fold_in(rng, i))
                acc_g, acc_s = carry
                acc_g = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc_g, g)
                return (acc_g, jax.tree.map(jnp.add, acc_s, s)), None
            zero_g = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), trainable)
            _, s0 = jax.eval_shape(grads_and_sums, trainable, frozen,
                                   jax.tree.map(lambda x: x[0], batch), rng)
            zero_s = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), s0)
            (grads, sums), _ = jax.lax.scan(body, (zero_g, zero_s),
                                            (jnp.arange(accum_steps), batch))
        count = jnp.maximum(sums["count"], 1.0)
        grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, trainable)
        updates, opt_state = optimizer.update(grads, state["opt_state"], trainable)
        new_state = {"step": state["step"] + 1, "trainable": optax.apply_updates(trainable, updates),
                     "opt_state": opt_state, "rng": state["rng"]}
        metrics = {"loss": sums["loss_sum"] / count, "accuracy": sums["correct"] / count,
                   "count": sums["count"], "grad_norm": optax.tree.norm(grads)}
        for k, v in sums.items():  # extra sums a custom loss reports, normalised the same way
            if k not in ("loss_sum", "correct", "count"):
                metrics[k] = v / count
        return new_state, metrics

    kwargs = {}
    if state_shardings is not None:
        replicated = NamedSharding(mesh, P())
        if layout:  # the layout's shardings are whatever building it gave
            frozen_shardings = (frozen_shardings, None)
        kwargs = dict(in_shardings=(state_shardings, frozen_shardings, batch_shardings),
                      out_shardings=(state_shardings, replicated))
    return jax.jit(step, donate_argnums=(0,) if donate else (), **kwargs)


def make_eval_step(loss_fn: LossFn, *, merge: MergeFn | None = None):
    """-> eval(trainable, frozen, batch) -> metric sums (jitted; no gradients)."""
    @jax.jit
    def evaluate(trainable, frozen, batch):
        params = trainable if merge is None else merge(frozen, trainable)
        _, sums = loss_fn(params, batch, jax.random.key(0))
        return sums
    return evaluate
