"""Masked-LM input: shards streamed in parallel through a shuffle buffer, masked on the host.

    stream = MLMStream("shards/train", batch_size=64, max_length=512, masking=spec_for(tok))
    for batch in stream: ...   # numpy dicts, [B, L] and [B, M], ready to shard on "batch"

Each host reads its own slice of the shard files (`files[process_index::process_count]`) and
yields the same number of batches per epoch as every other host (counts come from the file
names), so multi-host steps never wait on a host that ran dry. Masking is dynamic: redrawn from
`(seed, epoch, host)` on every pass, as the blog's `DataCollatorForLanguageModeling` does.

Batch keys: token_ids int32 [B, L] (masked), padding_mask bool [B, L], mask_positions int32
[B, M], mask_ids int32 [B, M] (the original ids there), mask_weights float32 [B, M] (1 = a real
prediction). M = `max_predictions`.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import queue
import threading
from typing import Iterator

import numpy as np

from jaxlm import shards
from jaxlm.errors import UserError


@dataclasses.dataclass(frozen=True)
class Masking:
    """15% of non-special tokens are picked; of those 80% -> mask, 10% -> random, 10% unchanged."""
    vocab_size: int
    mask_id: int
    special_ids: tuple[int, ...]  # never picked, never drawn as a random replacement
    rate: float = 0.15
    mask_rate: float = 0.8
    random_rate: float = 0.1
    unk_id: int = -1  # not drawn as a random replacement either


def masking_for(tokenizer, **overrides) -> Masking:
    """The Masking of a jaxlm tokenizer (Unigram [CLS]/[SEP]/<pad>/[MASK] or BPE <s>/</s>/<pad>/<mask>)."""
    from jaxlm.tokenizer_train import mask_id
    m = mask_id(tokenizer)
    specials = tuple(sorted({tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, m} - {-1}))
    unk = getattr(tokenizer, "unk_id", None)
    if unk is None and hasattr(tokenizer, "sp"):
        unk = tokenizer.sp.unk_id()
    return Masking(vocab_size=tokenizer.vocab_size, mask_id=m, special_ids=specials,
                   unk_id=-1 if unk is None else unk, **overrides)


def max_predictions(length: int, rate: float = 0.15) -> int:
    """Room for the picks of one row: mean + 4 standard deviations, rounded up to 8."""
    mean = length * rate
    m = math.ceil(mean + 4 * math.sqrt(length * rate * (1 - rate)))
    return min(length, 8 * math.ceil(m / 8))


def mask_tokens(ids: np.ndarray, attention_mask: np.ndarray, spec: Masking,
                rng: np.random.Generator, num_predictions: int | None = None) -> dict[str, np.ndarray]:
    """ids, attention_mask [B, L] -> a masked batch (see the module docstring for its keys).

    A row that picks more than M = num_predictions positions keeps its first M picks; the
    others are left unchanged and unscored (rare: M is 4 standard deviations above the mean).
    """
    ids = np.asarray(ids, np.int32)
    b, length = ids.shape
    m = num_predictions or max_predictions(length, spec.rate)
    valid = np.asarray(attention_mask).astype(bool)
    selectable = valid & ~np.isin(ids, spec.special_ids)
    picked = selectable & (rng.random(ids.shape) < spec.rate)
    picked &= np.cumsum(picked, axis=1) <= m  # overflow: keep the first M picks
    r = rng.random(ids.shape)
    to_mask = picked & (r < spec.mask_rate)
    to_random = picked & (r >= spec.mask_rate) & (r < spec.mask_rate + spec.random_rate)
    pool = np.setdiff1d(np.arange(spec.vocab_size), np.asarray(spec.special_ids + (spec.unk_id,)))
    random_ids = pool[rng.integers(0, len(pool), ids.shape)]
    token_ids = np.where(to_mask, spec.mask_id, np.where(to_random, random_ids, ids)).astype(np.int32)

    # Picked positions first (stable, so in order), then padding slots at position 0, weight 0.
    order = np.argsort(~picked, axis=1, kind="stable")[:, :m]
    weights = np.take_along_axis(picked, order, axis=1)
    positions = np.where(weights, order, 0).astype(np.int32)
    return {"token_ids": token_ids, "padding_mask": valid,
            "mask_positions": positions,
            "mask_ids": np.where(weights, np.take_along_axis(ids, positions, axis=1), 0).astype(np.int32),
            "mask_weights": weights.astype(np.float32)}


def host_files(files: list[tuple[str, int]], process_index: int, process_count: int):
    return files[process_index::process_count]


class MLMStream:
    """Batches of masked sequences from a folder of shards (local or gs://).

    batch_size: rows per host per step. shuffle_buffer: rows mixed before a batch is drawn.
    cycle_length: shards read at once by a thread pool. repeat: loop over epochs forever;
    otherwise one epoch (validation: pass shuffle=False for the same batches every time).
    """

    def __init__(self, directory: str, *, batch_size: int, max_length: int, masking: Masking,
                 shuffle_buffer: int = 1 << 14, cycle_length: int = 8, seed: int = 0,
                 process_index: int | None = None, process_count: int | None = None,
                 repeat: bool = True, shuffle: bool = True, num_predictions: int | None = None):
        import jax
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        all_files = shards.list_shards(directory)
        if len(all_files) < self.process_count:
            raise UserError(f"{directory} has {len(all_files)} shards for {self.process_count} hosts; "
                            "write smaller shards (--shard_size) so every host gets one")
        self.files = host_files(all_files, self.process_index, self.process_count)
        per_host = [sum(n for _, n in host_files(all_files, i, self.process_count))
                    for i in range(self.process_count)]
        self.steps_per_epoch = min(per_host) // batch_size
        if self.steps_per_epoch == 0:
            raise UserError(f"{directory} has {min(per_host)} sequences for a host but the batch "
                            f"needs {batch_size}; lower the batch size or write more data")
        self.directory, self.batch_size, self.max_length = directory, batch_size, max_length
        self.masking, self.shuffle_buffer, self.cycle_length = masking, shuffle_buffer, cycle_length
        self.seed, self.repeat, self.shuffle = seed, repeat, shuffle
        self.num_predictions = num_predictions or max_predictions(max_length, masking.rate)
        self.num_sequences = sum(per_host)

    def epoch(self, epoch: int) -> Iterator[dict[str, np.ndarray]]:
        """Exactly `steps_per_epoch` batches; masks and order drawn from (seed, epoch, host)."""
        rng = np.random.default_rng([self.seed, epoch if self.shuffle else 0, self.process_index])
        files = [p for p, _ in self.files]
        if self.shuffle:
            files = [files[i] for i in rng.permutation(len(files))]
        rows = self._rows(files, rng)
        for _ in range(self.steps_per_epoch):
            try:
                ids, att = next(rows)
            except StopIteration:
                raise UserError(f"the shards in {self.directory} hold fewer records than their "
                                "names say (dataset-{i}-{count}); write them again") from None
            yield mask_tokens(ids, att, self.masking, rng, self.num_predictions)

    def _rows(self, files: list[str], rng) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Batches of raw rows: shards read `cycle_length` at a time, mixed in the buffer."""
        bs = self.batch_size
        buf_ids = np.zeros((0, self.max_length), np.int32)
        buf_att = buf_ids
        with cf.ThreadPoolExecutor(self.cycle_length) as pool:
            pending = [pool.submit(shards.read_shard, f, self.max_length) for f in files[:self.cycle_length]]
            nxt = len(pending)
            while pending:
                ids, att = pending.pop(0).result()
                if nxt < len(files):
                    pending.append(pool.submit(shards.read_shard, files[nxt], self.max_length))
                    nxt += 1
                buf_ids, buf_att = np.concatenate([buf_ids, ids]), np.concatenate([buf_att, att])
                if self.shuffle:
                    perm = rng.permutation(len(buf_ids))
                    buf_ids, buf_att = buf_ids[perm], buf_att[perm]
                keep = self.shuffle_buffer if (pending and self.shuffle) else 0
                while len(buf_ids) - bs >= keep and len(buf_ids) >= bs:
                    yield buf_ids[:bs], buf_att[:bs]
                    buf_ids, buf_att = buf_ids[bs:], buf_att[bs:]

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        e = 0
        while True:
            yield from self.epoch(e)
            if not self.repeat:
                return
            e += 1


class Readers:
    """A global batch of `global_batch` rows as `count` equal blocks; block r comes from its own
    MLMStream over files[r::count] with randomness keyed on r. What a step sees depends on
    `count`, not on how many hosts share the readers, so 2 hosts x 1 reader and 1 host x 2
    readers train on the same batches. A host runs the readers of the blocks in `rows` (the
    rows its devices hold, see `jaxlm.distributed.local_rows`); `epoch`, `steps_per_epoch` and
    `files` are as MLMStream's, with batches [len(rows), ...].
    """

    def __init__(self, directory: str, *, global_batch: int, count: int, rows: slice, **kwargs):
        if count < 1 or global_batch % count:
            raise UserError(f"the global batch of {global_batch} does not split into {count} "
                            "equal reader blocks; use a batch that is a multiple of --data_readers")
        per = global_batch // count
        if rows.start % per or rows.stop % per:
            raise UserError(f"this host holds rows {rows.start}:{rows.stop} of the batch, which do "
                            f"not align with {count} reader blocks of {per}; use --data_readers "
                            "equal to a multiple of the number of hosts")
        self.streams = [MLMStream(directory, batch_size=per, process_index=r, process_count=count,
                                  **kwargs) for r in range(rows.start // per, rows.stop // per)]
        self.steps_per_epoch = self.streams[0].steps_per_epoch
        self.files = [f for st in self.streams for f in st.files]

    def epoch(self, epoch: int) -> Iterator[dict[str, np.ndarray]]:
        for parts in zip(*(st.epoch(epoch) for st in self.streams)):
            yield {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def prefetch(iterator, size: int = 2):
    """Run `iterator` in a background thread, `size` items ahead (errors surface in the caller)."""
    q: queue.Queue = queue.Queue(size)
    done = object()

    def work():
        try:
            for item in iterator:
                q.put(item)
            q.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)

    threading.Thread(target=work, daemon=True).start()
    while True:
        item = q.get()
        if item is done:
            return
        if isinstance(item, BaseException):
            raise item
        yield item
