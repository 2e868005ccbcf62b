"""Masked-LM TFRecord shards in the TF+TPU blog's format, written and read without TensorFlow.

    python -m jaxlm.shards --input FILES --tokenizer DIR --max_length 512 --shard_size 1000 \
        --out DIR_OR_BUCKET [--validation_fraction 0.05]
    python -m jaxlm.shards --input tfds:NAME[/CONFIG][:VERSION][:SPLIT] --text_feature text \
        [--tfds_data_dir DIR] [--process_index I --process_count N] --tokenizer DIR --out DIR

A `tfds:` input is a prepared TFDS dataset read without TensorFlow (`jaxlm.data.tfds`); each
example's text feature gives its lines, so it makes the shards the same examples would make
as a text file, one per line. With --process_count N, run I of N shards only its contiguous
1/N of the examples and numbers its shards I, I+N, I+2N, ..., so N machines can write one
shard set into the same --out.

As `prepare_tfrecord_shards.py`: every line (empty ones included) becomes `[CLS] … [SEP]`;
lines are taken 1000 at a time, concatenated, cut to a multiple of `max_length` (the remainder
of each group is dropped) and split into `max_length` chunks with an all-ones attention mask.
Chunks go to `{out}/{split}/dataset-{i}-{count}.tfrecord`, `shard_size` records per file, each
a tf.train.Example with int64 `input_ids` and `attention_mask` of length `max_length`.

Whole groups go to the validation split (`is_validation`), so no chunk straddles the two.

Paths may be local or any fsspec URL (`gs://bucket/dir` needs `pip install gcsfs`).
"""
from __future__ import annotations

import argparse
import itertools
import re
import sys
from typing import Iterable, Iterator

import numpy as np

from jaxlm import storage, tfrecord
from jaxlm.errors import ArgumentParser, UserError, cli

GROUP_LINES = 1000  # the blog's `map(batched=True, batch_size=1000)`
# `dataset-{index}-{count}.tfrecord`: the record count in the name is what the blog's
# run_mlm.count_samples reads; a `.tmp` suffix marks a shard still being written.
SHARD_RE = re.compile(r"-(\d+)-(\d+)\.tfrecord(?:\.tmp)?$")


def list_shards(directory: str) -> list[tuple[str, int]]:
    """[(path, record count)] of the `*.tfrecord` files in `directory`, sorted by shard index."""
    if not storage.isdir(directory):
        raise UserError(f"shard folder {directory} does not exist")
    names = [storage.join(directory, n) for n in storage.listdir(directory) if n.endswith(".tfrecord")]
    if not names:
        raise UserError(f"{directory} holds no .tfrecord shards; write some with `python -m jaxlm.shards`")
    out = []
    for name in sorted(names, key=lambda n: (_shard_index(n), n)):
        m = SHARD_RE.search(name)
        if not m:
            raise UserError(f"{name} is not named dataset-{{i}}-{{count}}.tfrecord; the record count "
                            "must be in the name (as the blog writes it)")
        out.append((name, int(m.group(2))))
    return out


def _shard_index(name: str) -> int:
    """i of `dataset-{i}-{count}.tfrecord` (or of its `.tmp`), 0 for another name."""
    m = SHARD_RE.search(name)
    return int(m.group(1)) if m else 0


# --- writing ---------------------------------------------------------------------------------

def encode_lines(tokenizer, lines: list[str]) -> list[list[int]]:
    """Each line -> [CLS] ids [SEP] (sentencepiece's batch encoder when there is one)."""
    sp = getattr(tokenizer, "sp", None)
    if sp is not None:
        return sp.encode(lines, add_bos=True, add_eos=True)
    return [tokenizer.encode(l, bos=True, eos=True) for l in lines]


def chunk_groups(tokenizer, lines: Iterable[str], max_length: int,
                 group_lines: int = GROUP_LINES) -> Iterator[np.ndarray]:
    """Yield, per group of `group_lines` lines, its chunks as int64 [n, max_length] (n may be 0)."""
    group: list[str] = []
    for line in lines:
        group.append(line)
        if len(group) == group_lines:
            yield _chunks(encode_lines(tokenizer, group), max_length)
            group = []
    if group:
        yield _chunks(encode_lines(tokenizer, group), max_length)


def _chunks(encoded: list[list[int]], max_length: int) -> np.ndarray:
    flat = np.fromiter((i for ids in encoded for i in ids), np.int64)
    n = len(flat) // max_length
    return flat[:n * max_length].reshape(n, max_length)


class ShardWriter:
    """Buffers chunks and writes `dataset-{i}-{count}.tfrecord` files of `shard_size` records."""

    def __init__(self, directory: str, shard_size: int, first_index: int = 0, index_step: int = 1):
        self.directory, self.shard_size = directory, shard_size
        self.pending: list[np.ndarray] = []
        self.index, self.index_step = first_index, index_step  # writers sharing a folder interleave
        self.records = 0
        self.paths: list[str] = []
        if not storage.is_url(directory):  # object stores have no folders to make
            storage.makedirs(directory)

    def add(self, chunks: np.ndarray) -> None:
        self.pending.extend(chunks)
        while len(self.pending) >= self.shard_size:
            self._flush(self.pending[:self.shard_size])
            self.pending = self.pending[self.shard_size:]

    def close(self) -> None:
        if self.pending:
            self._flush(self.pending)
            self.pending = []

    def _flush(self, rows: list[np.ndarray]) -> None:
        path = storage.join(self.directory, f"dataset-{self.index}-{len(rows)}.tfrecord")
        local = not storage.is_url(path)
        target = path + ".tmp" if local else path  # local: atomic rename when complete
        with storage.open_file(target, "wb") as f:
            for ids in rows:
                tfrecord.write_record(f, tfrecord.encode_example(
                    {"input_ids": ids, "attention_mask": np.ones_like(ids)}))
        if local:
            storage.rename(target, path)
        self.paths.append(path)
        self.index += self.index_step
        self.records += len(rows)


def is_validation(group: int, fraction: float) -> bool:
    """Group g is held out when g % period == 1, period = round(1 / fraction): the fraction is
    met on large corpora and a corpus of two groups or more always gets one."""
    if fraction <= 0:
        return False
    return group % max(2, round(1 / fraction)) == 1


def write_shards(tokenizer, lines: Iterable[str], out: str, *, max_length: int = 512,
                 shard_size: int = 1000, validation_fraction: float = 0.0,
                 group_lines: int = GROUP_LINES, part: int = 0, parts: int = 1) -> dict[str, ShardWriter]:
    """Tokenize, chunk and write train (and validation) shards; -> {split: writer}.

    part / parts: this writer's shards are numbered part, part + parts, ... so `parts` writers
    (one per slice of a corpus) can share `out`."""
    if max_length < 2:
        raise UserError(f"--max_length {max_length} is too small; it must be at least 2")
    if shard_size < 1:
        raise UserError(f"--shard_size {shard_size} must be positive")
    if not 0 <= validation_fraction < 1:
        raise UserError(f"--validation_fraction {validation_fraction} must be in [0, 1)")
    if storage.is_url(out):  # a missing path library (gcsfs for gs://) fails before any tokenizing
        try:
            storage.exists(out)
        except ImportError as e:
            raise UserError(f"cannot open {out}: {e}") from None
    writers = {"train": ShardWriter(storage.join(out, "train"), shard_size, part, parts)}
    if validation_fraction > 0:
        writers["validation"] = ShardWriter(storage.join(out, "validation"), shard_size, part, parts)
    for g, chunks in enumerate(chunk_groups(tokenizer, lines, max_length, group_lines)):
        writers["validation" if is_validation(g, validation_fraction) else "train"].add(chunks)
    for w in writers.values():
        w.close()
    return writers


def read_shard(path: str, max_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """-> (input_ids, attention_mask), int32 [n, L]; L must equal `max_length` when given."""
    ids, masks = [], []
    with storage.open_file(path, "rb") as f:
        for record in tfrecord.read_records(f, path):
            ex = tfrecord.decode_example(record)
            if "input_ids" not in ex:
                raise UserError(f"{path} has records without input_ids; is it a masked-LM shard?")
            x = np.asarray(ex["input_ids"], np.int64)
            m = np.asarray(ex.get("attention_mask", np.ones_like(x)), np.int64)
            if max_length is not None and len(x) != max_length:
                raise UserError(f"{path} holds sequences of length {len(x)} but --max_length is "
                                f"{max_length}; pass --max_length {len(x)} or rewrite the shards")
            ids.append(x)
            masks.append(m)
    if not ids:
        return np.zeros((0, max_length or 0), np.int32), np.zeros((0, max_length or 0), np.int32)
    return np.stack(ids).astype(np.int32), np.stack(masks).astype(np.int32)


def input_lines(args) -> Iterator[str]:
    """The lines of --input: text files and tfds: datasets in order, each checked up front."""
    if args.process_count < 1:
        raise UserError(f"--process_count {args.process_count} must be at least 1")
    if not args.input:
        if args.process_count != 1:
            raise UserError("--process_count splits tfds: inputs only; pass --input=tfds:...")
        from jaxlm.corpus import pydoc_corpus
        return iter(pydoc_corpus().splitlines())
    from jaxlm.data import tfds
    from jaxlm.tokenizer_train import read_lines
    files = [i for i in args.input if not tfds.is_spec(i)]
    if files and args.process_count != 1:
        raise UserError(f"--process_count splits tfds: inputs only, and {files[0]} is a file; "
                        "split the files between the machines instead")
    parts = []
    for item in args.input:
        if tfds.is_spec(item):
            lines, n = tfds.open_texts(item, args.text_feature, args.tfds_data_dir,
                                       args.process_index, args.process_count)
            print(f"input: {item}, {n} examples" + (f" (slice {args.process_index} of "
                                                    f"{args.process_count})" if args.process_count > 1 else ""))
            parts.append(lines)
        else:
            parts.append(read_lines([item]))
    for f in files:  # a missing file fails now, not after the corpora before it
        if not storage.exists(f):
            raise UserError(f"input file {f} does not exist")
    return itertools.chain.from_iterable(parts)


def claim_out(out: str, overwrite: bool, part: int = 0, parts: int = 1) -> None:
    """Refuse an --out that already holds shards (or, for a single writer, anything): new
    shards next to old ones of another --max_length or corpus would be read as one set. With
    `overwrite` the old shards are deleted (only this writer's, i % parts == part, when several
    machines share --out); other files are left alone."""
    storage.check_output_folder(out, "--out")
    old = [storage.join(out, split, n) for split in ("train", "validation")
           for n in storage.listdir(storage.join(out, split))
           if n.endswith((".tfrecord", ".tfrecord.tmp")) and _shard_index(n) % parts == part]
    if overwrite:
        for path in old:
            storage.remove_tree(path)
        return
    if old or (parts == 1 and storage.listdir(out)):
        what = f"{len(old)} shard(s) of an earlier run" if old else "other files"
        raise UserError(f"--out {out} already holds {what}; pass --overwrite to replace the shards, "
                        "or choose an empty folder")


@cli
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m jaxlm.shards", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", default=None,
                   help="text files, one example per line, or tfds:NAME[/CONFIG][:VERSION][:SPLIT] "
                        "datasets (default: pydoc_data.topics)")
    p.add_argument("--text_feature", default="text", help="the text feature of tfds: inputs")
    p.add_argument("--tfds_data_dir", default=None,
                   help="where tfds: inputs are prepared (default $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    p.add_argument("--process_index", type=int, default=0,
                   help="with --process_count: which slice of the tfds: examples this run shards")
    p.add_argument("--process_count", type=int, default=1,
                   help="machines sharding one tfds: corpus into the same --out (default 1)")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder (python -m jaxlm.tokenizer train)")
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--shard_size", type=int, default=1000, help="records per shard")
    p.add_argument("--out", required=True, help="output folder or bucket URL (gs://…)")
    p.add_argument("--validation_fraction", type=float, default=0.05,
                   help="share of 1000-line groups written to {out}/validation")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the shards a previous run wrote into --out")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from jaxlm.loading import load_tokenizer
    lines = input_lines(args)  # bad inputs fail before the tokenizer loads
    claim_out(args.out, args.overwrite, args.process_index, args.process_count)
    tokenizer = load_tokenizer(args.tokenizer)
    writers = write_shards(tokenizer, lines, args.out, max_length=args.max_length,
                           shard_size=args.shard_size, validation_fraction=args.validation_fraction,
                           part=args.process_index, parts=args.process_count)
    for split, w in writers.items():
        print(f"{split}: {w.records} records of {args.max_length} tokens in {len(w.paths)} shards "
              f"under {w.directory}")
    if writers["train"].records == 0:
        raise UserError("no training record was written: the corpus is shorter than one "
                        f"{args.max_length}-token chunk per {GROUP_LINES} lines; lower --max_length")
    return 0


if __name__ == "__main__":
    sys.exit(main())
