"""Compiled KV-cache decoding on token ids: one prefill pass, then a `lax.while_loop`.

This is the token-level API under `jaxlm.generate` (text in, text out):

    ids, mask = decode.generate_ids(model, params, token_ids [B, T], lengths [B], max_length)
    # ids [B, max_length] int32: prompt + completion, right-padded with pad (0) after a stop;
    # mask [B, max_length] bool: True for the prompt and the completion up to and including the
    # first generated stop token (KerasHub's returned `padding_mask`).

Semantics are KerasHub's `CausalLM.generate_step`: the loop starts at
index = min(row lengths) with one scalar cache index for the whole batch; each step feeds the
token at index-1 and writes position `index`, keeping the prompt token for rows still inside
their prompt. So each row of a ragged batch decodes exactly as it would alone (its position-p
token only ever attends to its own positions < p) and the cache needs no per-row index.
Rows stop independently (they then emit pad); the loop ends at max_length or when all rows
have stopped.

Random samplers draw with `seed`: one int keys the whole batch (as KerasHub: a row's draw then
depends on its place in the batch, and repeated prompts give different samples), one int per
row keys each row on its own (row r with seed s draws exactly what that prompt draws alone with
seed=s). The key of step i is fold_in(key(seed), i) either way.

No recompilation when only the prompts change: prompt length and total length are bucketed
to powers of two, the batch to a power of two up to 8 rows and a multiple of 8 beyond, max_length, the seeds and the stop ids are traced (not static), and
one jitted function per (model, sampler, buckets, mesh, per-row seeds or not) is kept in
`_compiled`'s cache. `TRACES` counts traces (= compilations) for tests.

On a mesh (`mesh=`), which may span several processes: every process passes the same prompts,
places the shards its devices hold, and gets the whole result back (the outputs are
replicated).

Greedy float32 decoding on one CPU device with AMX takes each step's token through a bfloat16
screen of the tied table, built once a call (models/greedy_screen.py): the same tokens, from
about half the table's bytes a step.

Streaming: `stream(position, tokens)` receives, after each step, the new token of every row
(np.int32 [B], -1 for rows still inside their prompt or already stopped). It is a
`jax.debug.callback` inside the loop: one device->host round trip per step, which on CPU costs
tens of microseconds and on an accelerator stalls the device for the host's turn each token.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlm import sampling
from jaxlm.errors import UserError
from jaxlm.tree import place
from models import cpu_forms, decode_kernels, greedy_screen

Stream = Callable[[int, np.ndarray], None]
TRACES = 0  # incremented each time a decode function is traced, i.e. compiled
MIN_PROMPT_BUCKET = 16
MIN_TOTAL_BUCKET = 32
_STOP_SLOTS = 8  # stop ids are a traced [8] array (-1 = unused), so changing them never recompiles


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


BATCH_STEP = 8


def batch_bucket(rows: int) -> int:
    """The rows a batch of `rows` prompts runs as: a power of two up to BATCH_STEP, then the
    next multiple of it. Powers of two all the way ran the demo's 40 held-out prompts as 64
    rows, whose KV cache and prefill were 60% padding (and held on every device of a mesh
    whose model axis cannot split Gemma 3 270M's one KV head)."""
    return bucket(rows) if rows <= BATCH_STEP else -(-rows // BATCH_STEP) * BATCH_STEP


def generate_ids(model, params, token_ids, lengths, max_length: int, sampler="greedy",
                 seed: int | Sequence[int] = 0, stop_token_ids=(), *, mesh: Mesh | None = None,
                 stream: Stream | None = None):
    """Decode right-padded prompts [B, T] (BOS included) of `lengths` [B] up to `max_length`.
    `seed`: an int, or one int per row (see the module docstring).

    -> (ids [B, max_length] int32, mask [B, max_length] bool), numpy. See the module docstring.
    """
    sampler = sampling.resolve(sampler)
    token_ids = np.asarray(token_ids, np.int32)
    lengths = np.asarray(lengths, np.int32).reshape(-1)
    b = token_ids.shape[0]
    if b == 0 or token_ids.ndim != 2 or lengths.shape[0] != b:
        raise UserError(f"expected token_ids [B, T] with B >= 1 and lengths [B]; got "
                        f"{token_ids.shape} and {lengths.shape}")
    if lengths.min() < 1 or lengths.max() > token_ids.shape[1]:
        raise UserError(f"lengths must be in [1, {token_ids.shape[1]}] (the token_ids width); "
                        f"got {lengths.tolist()}")
    if lengths.max() > max_length:
        raise UserError(f"a prompt has {int(lengths.max())} tokens (BOS included) but "
                        f"max_length={max_length}; raise max_length or shorten the prompt")
    stop = [int(s) for s in (stop_token_ids or ())]
    if len(stop) > _STOP_SLOTS:
        raise UserError(f"at most {_STOP_SLOTS} stop token ids are supported; got {len(stop)}")

    batch_axis = 1 if mesh is None else mesh.shape["batch"]
    bb = max(batch_bucket(b), batch_axis)
    bb = -(-bb // batch_axis) * batch_axis
    total = bucket(max_length, MIN_TOTAL_BUCKET)
    plen = min(bucket(int(lengths.max()), MIN_PROMPT_BUCKET), total)

    # Filler rows repeat row 0, so they change neither min(lengths) nor when the loop ends.
    prompt = np.zeros((bb, plen), np.int32)
    width = min(plen, token_ids.shape[1])
    prompt[:b, :width] = token_ids[:, :width]
    prompt[b:] = prompt[0]
    rows = np.concatenate([lengths, np.full(bb - b, lengths[0], np.int32)])
    prompt[np.arange(plen)[None, :] >= rows[:, None]] = 0
    stops = np.full((_STOP_SLOTS,), -1, np.int32)
    stops[:len(stop)] = stop
    seeds = _seeds(seed, b)
    per_row = seeds.ndim == 1 and not isinstance(sampler, sampling.Greedy)
    if per_row:  # filler rows repeat row 0
        seeds = np.concatenate([seeds, np.full(bb - b, seeds[0], np.int32)])
    elif seeds.ndim:  # greedy draws nothing
        seeds = seeds[0]
    args = (prompt, rows, np.int32(max_length), seeds, stops)
    if mesh is not None:
        if stream is not None and jax.process_count() > 1:
            raise UserError("streaming generation runs in one process; drop stream= or "
                            "generate on one host")
        data = NamedSharding(mesh, P("batch"))
        rep = NamedSharding(mesh, P())
        args = (place(prompt, data), place(rows, data), place(args[2], rep),
                place(seeds, data if per_row else rep), place(stops, rep))

    fn = _compiled(model, sampler, bb, plen, total, stream is not None, mesh, per_row)
    with _streaming(stream, b):
        ids, mask = fn(params, *args)
        ids, mask = np.asarray(ids), np.asarray(mask)  # waits, so the callback is still set
    return ids[:b, :max_length], mask[:b, :max_length]


def _seeds(seed, rows: int) -> np.ndarray:
    """An int -> an int32 scalar; a list of `rows` ints (one per row) -> int32 [rows]."""
    single = not isinstance(seed, (list, tuple, np.ndarray))
    values = [seed] if single else list(np.asarray(seed, object).reshape(-1))
    is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)  # noqa: E731
    shape_ok = single or (np.ndim(seed) == 1 and len(values) == rows)
    if not shape_ok or not all(map(is_int, values)):
        raise UserError(f"seed must be an int or a list of {rows} ints (one per prompt); "
                        f"got {seed!r}")
    if not all(-2**31 <= int(v) < 2**31 for v in values):
        raise UserError(f"seeds must fit in int32, [-2**31, 2**31); got {seed!r}")
    out = np.asarray([int(v) for v in values], np.int32)
    return out[0] if single else out


class _StreamSlot:  # not thread-local: XLA runs the host callback on its own thread
    fn: Stream | None = None
    rows: int = 0


_STREAM = _StreamSlot()


class _streaming:
    """Route the compiled function's debug callback to this call's `stream` (the compiled
    function is shared between calls, so the callback itself cannot close over it)."""

    def __init__(self, fn, rows):
        self.fn, self.rows = fn, rows

    def __enter__(self):
        _STREAM.fn, _STREAM.rows = self.fn, self.rows

    def __exit__(self, *exc):
        _STREAM.fn = None


def _emit(position, tokens):
    if _STREAM.fn is not None:
        _STREAM.fn(int(position), np.asarray(tokens)[:_STREAM.rows])


@functools.lru_cache(maxsize=64)
def _compiled(model, sampler, batch: int, prompt_len: int, total: int, streaming: bool,
              mesh: Mesh | None, per_row_seeds: bool = False):
    """One jitted prefill + decode loop for these static sizes (cached: see module docstring)."""
    from models.gemma import init_cache  # only Gemma decodes; imported here to keep the
    cfg = model.config                   # module importable for other families' tooling
    kv_spec = None
    platform = (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform
    block_bytes = (cfg.num_params - cfg.vocab_size * cfg.hidden_dim) * jnp.dtype(cfg.dtype).itemsize
    step_layout = decode_kernels.step_layout_pays(platform, block_bytes, batch, cfg.dtype)
    screen = SCREEN and _screen_pays(platform, cfg, sampler, mesh)
    if mesh is not None:
        heads = "model" if cfg.num_kv_heads % mesh.shape["model"] == 0 else None
        kv_spec = NamedSharding(mesh, P("batch", None, heads, None))

    def draw(logits, key, index):
        """logits [Bb, V], key [] or [Bb] (per row) -> tokens [Bb] with step `index`'s key(s)."""
        if not per_row_seeds:
            return sampler(logits, jax.random.fold_in(key, index))
        one = lambda row, k: sampler(row[None], jax.random.fold_in(k, index))[0]  # noqa: E731
        return jax.vmap(one)(logits, key)

    def run(params, prompt, lengths, max_length, seed, stops):
        """prompt [Bb, Pb], lengths [Bb], seed [] or [Bb] -> (ids [Bb, Tb], mask [Bb, Tb])."""
        global TRACES
        TRACES += 1
        with decode_kernels.decode_steps(platform):  # this platform's decode kernels, traced in
            return decode(params, prompt, lengths, max_length, seed, stops)

    def decode(params, prompt, lengths, max_length, seed, stops):
        key = jax.vmap(jax.random.key)(seed) if per_row_seeds else jax.random.key(seed)
        cache = init_cache(cfg, batch, total)
        if kv_spec is not None:
            cache = jax.lax.with_sharding_constraint(cache, kv_spec)
        # Prefill: causal attention only (no key mask), as KerasHub's _build_cache; a row's
        # slots past its prompt hold junk that the loop overwrites before anything reads it.
        _, cache = model.apply({"params": params}, prompt, cache=cache, cache_index=0)
        variables = {"params": params}
        if step_layout:  # one traced step with the collection mutable builds the kernels'
            _, layout = model.apply(variables, prompt[:, :1], cache=cache,  # rows; XLA keeps
                                    cache_index=0, mutable=["step_layout"])  # only those
            variables = {**variables, **layout}
        table = params["token_embedding"]["embeddings"]
        screened = screen and jnp.dtype(table.dtype) == jnp.float32
        if screened:  # once a call: the bfloat16 table and its norms (models/greedy_screen.py)
            rounded = greedy_screen.build(table)
        ids = jnp.zeros((batch, total), jnp.int32).at[:, :prompt_len].set(prompt)
        positions = jnp.arange(total)
        start = jnp.min(lengths)

        def cond(state):
            index, _, _, done, _ = state
            return (index < max_length) & ~jnp.all(done)

        def body(state):
            index, ids, cache, done, stop_at = state
            last = jax.lax.dynamic_slice_in_dim(ids, index - 1, 1, axis=1)  # [Bb, 1]
            out, cache = model.apply(variables, last, cache=cache, cache_index=index - 1,
                                     return_hidden=screened)
            if screened:
                pick = lambda logits: sampler(logits, None)  # noqa: E731
                token = greedy_screen.greedy(table, rounded, out[:, 0], pick,
                                             tie=SCREEN_TIE * sampler.temperature)
            else:
                token = draw(out[:, 0], key, index)
            in_prompt = index < lengths
            token = jnp.where(in_prompt, ids[:, index], jnp.where(done, 0, token))
            ids = jax.lax.dynamic_update_slice_in_dim(ids, token[:, None], index, axis=1)
            new = ~in_prompt & ~done
            stopped = new & jnp.any(token[:, None] == stops[None, :], axis=-1)
            stop_at = jnp.where(stopped, index, stop_at)
            if streaming:
                jax.debug.callback(_emit, index, jnp.where(new, token, -1))
            return index + 1, ids, cache, done | stopped, stop_at

        no_stop = jnp.full((batch,), total, jnp.int32)
        state = (start, ids, cache, jnp.zeros((batch,), bool), no_stop)
        end, ids, _, _, stop_at = jax.lax.while_loop(cond, body, state)
        mask = (positions[None, :] < end) & (positions[None, :] <= stop_at[:, None])
        return jnp.where(mask, ids, 0), mask

    # On a mesh the results come back replicated, so every process can read them whole.
    return jax.jit(run, out_shardings=None if mesh is None else NamedSharding(mesh, P()))


SCREEN = True  # False: never use the screen (the bench's A/B, bench/real_step_ab.py)
# The greedy sampler's rule ties logits within ~2^-20 x its temperature (as the softmax does,
# `sampling._most_probable`); the screen keeps every row that close to the largest logit.
SCREEN_TIE = 2.0 ** -16
# The screen saves about half the table's share of a step's weight stream, and is held while
# generating (half the table's bytes): models whose table is a smaller share decode without it
# (Gemma 3 270M: 62%; Gemma 2B: 21%, where it would save ~10% for 1 GB more).
SCREEN_MIN_SHARE = 0.25


def _screen_pays(platform, cfg, sampler, mesh) -> bool:
    """Whether greedy tokens go through the bfloat16 screen of the tied table
    (models/greedy_screen.py): float32 on one CPU device with AMX, where bfloat16 products
    are fast, and no logit soft cap (its tanh ties logits far apart once it saturates)."""
    return (platform == "cpu" and mesh is None and isinstance(sampler, sampling.Greedy)
            and jnp.dtype(cfg.dtype) == jnp.float32 and cfg.final_logit_soft_cap is None
            and cpu_forms.amx() and greedy_screen.fits(cfg.vocab_size)
            and cfg.vocab_size * cfg.hidden_dim >= SCREEN_MIN_SHARE * cfg.num_params)


def clear_cache() -> None:
    """Drop every compiled decode function (e.g. to free their memory)."""
    _compiled.cache_clear()
