"""Training: chunked LM loss, AdamW, the jitted sharded step, the step loop.

    loss_fn = loss.lm_loss_fn(model)                     # (params, batch, rng) -> (sum, metrics)
    opt = optim.make_optimizer(optim.OptimConfig(learning_rate=5e-5))
    state = step.init_state(trainable, opt, seed, mesh)
    train_step = step.make_train_step(loss_fn, opt, merge=lora.merge, ...)
    state, history = loop.run(train_step, state, frozen, get_batch, num_steps=...)

`python train.py` wires these (jaxlm/train/lm.py); the MLM trainer reuses them with its own loss.
"""
from jaxlm.train import loop, loss, optim, step

__all__ = ["loop", "loss", "optim", "step"]
