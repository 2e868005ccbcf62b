"""TFDS datasets as input: prepared ArrayRecord datasets, read without TensorFlow, never downloaded.

    tfds:NAME[/CONFIG][:VERSION][:SPLIT]

    tfds:my_instructions                 newest prepared version, split "train"
    tfds:c4/en:validation                config "en"
    tfds:lm1b:1.1.0:test[:1000]          version 1.1.0, the first 1000 test examples
    tfds:wiki:3.*.*:train[10%:]+test     tfds' version wildcards, split slicing and unions

NAME and CONFIG are tfds' (`tfds build NAME --config=CONFIG`). tfds writes a version as
`NAME:x.y.z`; here the part after NAME is a VERSION when it looks like x.y.z (digits or `*`)
and the SPLIT otherwise, so `tfds:NAME:x.y.z` and `tfds:NAME:SPLIT` both read as tfds users
expect. SPLIT takes tfds' split syntax as it is (its `:` inside brackets are kept).

Datasets are looked up in the data dir only (`data_dir`, else $TFDS_DATA_DIR, else
~/tensorflow_datasets): `DIR/NAME[/CONFIG]/VERSION/` holding `dataset_info.json`, opened with
`tfds.builder_from_directory` and read with `as_data_source` (ArrayRecord, random access,
decoded with NumPy). No catalog lookup, no dataset code, no download, no network: a dataset
that is not there is one UserError saying how to prepare it. Neither path imports TensorFlow
(tests/test_tfds.py checks it in a fresh process); `jaxlm.storage` has set EPATH_USE_TF=false
before tfds reads it, so tfds' file access goes through etils, not tf.io.gfile.

Text features (`tfds.features.Text`, or a scalar string Tensor) are bytes in a data source
and are decoded as UTF-8.

Hosts: `read_records` reads the whole split on every host (instruction batches are drawn
from all examples by every host, see `jaxlm.data.batch_rows`); `read_texts` reads one host's
contiguous block of examples, `host_range(n, process_index, process_count)`, because a
contiguous block is a sequential read of the ArrayRecord files.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from typing import Iterator

import numpy as np

from jaxlm import storage  # sets EPATH_USE_TF=false before tensorflow_datasets is imported
from jaxlm.data.instructions import Records, collect
from jaxlm.errors import UserError

import tensorflow_datasets as tfds  # noqa: E402  (after jaxlm.storage, see above)

PREFIX = "tfds:"
_VERSION = r"(?:\d+|\*)\.(?:\d+|\*)\.(?:\d+|\*)"
_SPEC = re.compile(rf"^(?P<name>[\w.-]+)(?:/(?P<config>[\w.-]+))?"
                   rf"(?::(?P<version>{_VERSION}))?(?::(?P<split>.+))?$")
READ_CHUNK = 1024  # examples fetched per data-source call


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    config: str | None = None
    version: str | None = None  # x.y.z, `*` allowed; None: the newest prepared
    split: str = "train"

    def __str__(self):
        return (PREFIX + self.name + (f"/{self.config}" if self.config else "")
                + (f":{self.version}" if self.version else "") + f":{self.split}")


def is_spec(source) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def parse(spec: str) -> Spec:
    """`tfds:NAME[/CONFIG][:VERSION][:SPLIT]` -> Spec (see the module docstring)."""
    m = _SPEC.match(spec[len(PREFIX):] if is_spec(spec) else "")
    if not m:
        raise UserError(f"{spec!r} is not a TFDS dataset; write tfds:NAME[/CONFIG][:VERSION][:SPLIT], "
                        "e.g. tfds:lm1b:train or tfds:c4/en:3.0.1:validation")
    return Spec(m["name"], m["config"], m["version"], m["split"] or "train")


def default_data_dir() -> str:
    return os.environ.get("TFDS_DATA_DIR") or os.path.join(os.path.expanduser("~"), "tensorflow_datasets")


def _is_version(name: str) -> bool:
    return re.fullmatch(r"\d+\.\d+\.\d+", name) is not None


def _versions(folder: str) -> list[str]:
    """The prepared versions in `folder` (x.y.z folders with a dataset_info.json), oldest first."""
    found = [v for v in storage.listdir(folder)
             if _is_version(v) and storage.exists(storage.join(folder, v, "dataset_info.json"))]
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def dataset_dir(spec: Spec, data_dir: str | None = None) -> str:
    """The prepared `DIR/NAME[/CONFIG]/VERSION` folder of `spec`, or a UserError saying how to
    prepare it (never a download)."""
    root = data_dir or default_data_dir()
    build = (f"prepare it with `tfds build {spec.name}"
             + (f" --config={spec.config}" if spec.config else "")
             + f" --data_dir={root} --file_format=array_record`")
    where = f"--tfds_data_dir={root}" if data_dir else f"{root} (the default; set --tfds_data_dir)"
    if not storage.isdir(root):
        raise UserError(f"TFDS data dir {root} does not exist; {build}, or point --tfds_data_dir "
                        "at the folder that holds it")
    base = storage.join(root, spec.name)
    if not storage.isdir(base):
        there = [n for n in storage.listdir(root) if n != "downloads" and storage.isdir(storage.join(root, n))]
        raise UserError(f"tfds:{spec.name} is not prepared in {where} (found: {', '.join(there) or 'nothing'}); "
                        f"{build}")
    folder = base
    if spec.config:
        folder = storage.join(base, spec.config)
        if not storage.isdir(folder):
            raise UserError(f"tfds:{spec.name} has no prepared config {spec.config!r} in {root} "
                            f"(configs: {', '.join(_configs(base)) or 'none'}); {build}")
    elif not _versions(base):
        configs = _configs(base)
        if len(configs) == 1:
            folder = storage.join(base, configs[0])
        elif configs:
            raise UserError(f"tfds:{spec.name} has several configs in {root} ({', '.join(configs)}); "
                            f"name one: tfds:{spec.name}/CONFIG")
    versions = _versions(folder)
    if spec.version:
        versions = [v for v in versions if fnmatch.fnmatchcase(v, spec.version)]
    if not versions:
        have = ", ".join(_versions(folder)) or "none complete"
        raise UserError(f"{spec} is not prepared in {where} (versions there: {have}); {build}")
    return storage.join(folder, versions[-1])


def _configs(base: str) -> list[str]:
    return [c for c in storage.listdir(base) if _versions(storage.join(base, c))]


def open_split(spec: Spec, data_dir: str | None = None):
    """-> (random-access source of example dicts, FeaturesDict) of the split."""
    folder = dataset_dir(spec, data_dir)
    try:
        builder = tfds.builder_from_directory(folder)
    except Exception as e:  # noqa: BLE001 - tfds raises many kinds for a damaged folder
        raise UserError(f"cannot open the TFDS dataset in {folder}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    splits = list(builder.info.splits.keys())
    base_split = re.split(r"[\[+]", spec.split, maxsplit=1)[0]
    if base_split not in splits:
        raise UserError(f"{spec} has no split {base_split!r} (splits: {', '.join(splits)}); "
                        f"write {PREFIX}{spec.name}{'/' + spec.config if spec.config else ''}:SPLIT")
    fmt = builder.info.file_format
    if fmt is None or fmt.value != "array_record":
        raise UserError(f"{folder} was prepared as {fmt.value if fmt else 'an unknown format'}, which "
                        "needs TensorFlow to read; convert it with `tfds convert_format "
                        f"--dataset_version_dir={folder} --out_file_format=array_record` or rebuild "
                        "it with --file_format=array_record")
    try:
        source = builder.as_data_source(split=spec.split)
    except (ValueError, KeyError, AssertionError) as e:  # a bad slice such as train[:200%]
        raise UserError(f"{spec}: bad split {spec.split!r} ({str(e).splitlines()[0]})") from None
    return source, builder.info.features


def _text_feature(spec: Spec, features, name: str, flag: str) -> None:
    """A UserError unless `name` is a top-level text feature of the dataset."""
    if name not in features:
        raise UserError(f"{spec} has no feature {name!r} (features: {', '.join(sorted(features.keys()))}); "
                        f"pass {flag}=NAME")
    f = features[name]
    if not _is_text(f):
        kind = repr(f).splitlines()[0].rstrip("({")
        texts = sorted(k for k in features.keys() if _is_text(features[k]))
        raise UserError(f"feature {name!r} of {spec} is {kind}, not text; pass {flag}=NAME with a "
                        f"text feature ({', '.join(texts) or 'this dataset has none'})")


def _is_text(f) -> bool:
    """Text, or a scalar string Tensor (what a data source gives as bytes)."""
    return (isinstance(f, tfds.features.Tensor) and tuple(f.shape) == ()
            and np.dtype(f.np_dtype) == np.dtype(object) and getattr(f, "encoder", None) is None)


def _examples(source, indices: range) -> Iterator[dict]:
    """The examples at `indices`, fetched READ_CHUNK at a time."""
    for lo in range(indices.start, indices.stop, READ_CHUNK):
        yield from source.__getitems__(list(range(lo, min(lo + READ_CHUNK, indices.stop))))


def read_records(spec: str, instruction_column: str = "instruction", output_column: str = "output",
                 limit: int | None = None, data_dir: str | None = None) -> Records:
    """The (instruction, output) Records of a TFDS split, exactly as `jaxlm.data.read_records`
    gives them for the same rows in a CSV/JSONL file: same skipping (empty values, counted in
    `skipped`), same `limit` (the first `limit` good rows), same errors for no usable row.
    A value that is not valid UTF-8 is a skipped row ("non-UTF-8 COLUMN")."""
    s = parse(spec)
    source, features = open_split(s, data_dir)
    _text_feature(s, features, instruction_column, "--instruction_column")
    _text_feature(s, features, output_column, "--output_column")
    columns = (instruction_column, output_column)

    def rows():
        for ex in _examples(source, range(len(source))):
            try:
                yield ("row", {c: ex[c].decode("utf-8") for c in columns})
            except UnicodeDecodeError:
                bad = next(c for c in columns if not _utf8(ex[c]))
                yield ("bad", f"non-UTF-8 {bad}")
    return collect(rows(), str(s), instruction_column, output_column, limit)


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def host_range(n: int, process_index: int = 0, process_count: int = 1) -> range:
    """Host p's contiguous block of n examples: [n*p // P, n*(p+1) // P)."""
    if not 0 <= process_index < process_count:
        raise UserError(f"process index {process_index} is not in 0..{process_count - 1}")
    return range(n * process_index // process_count, n * (process_index + 1) // process_count)


def open_texts(spec: str, feature: str = "text", data_dir: str | None = None,
               process_index: int = 0, process_count: int = 1) -> tuple[Iterator[str], int]:
    """-> (lines, examples read): this host's block of the split as lines of text.

    Each example's text is split at "\\n", so the lines are those of a text file holding the
    examples one after another, one per line (`python -m jaxlm.shards` makes the same shards
    from either). Bytes that are not UTF-8 are replaced, as the text-file reader does. The
    dataset, split and feature are checked here, before the iterator is consumed.
    """
    s = parse(spec)
    source, features = open_split(s, data_dir)
    _text_feature(s, features, feature, "--text_feature")
    block = host_range(len(source), process_index, process_count)

    def lines():
        for ex in _examples(source, block):
            yield from ex[feature].decode("utf-8", errors="replace").split("\n")
    return lines(), len(block)
