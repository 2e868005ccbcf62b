"""TFDS input offline: tiny ArrayRecord datasets built here, read like the equivalent CSV / text
file, without TensorFlow in the reading process, and one clear line for each bad input."""
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxlm import data, shards
from jaxlm.data import tfds as T
from jaxlm.errors import UserError

tensorflow_datasets = pytest.importorskip("tensorflow_datasets")

INSTRUCTIONS = [{"instruction": f"What is {i} + {i}?", "output": str(2 * i), "n": i} for i in range(6)]
INSTRUCTIONS[2]["output"] = ""  # skipped as "empty output", in TFDS as in CSV
INSTRUCTIONS[4]["instruction"] = "Grüße, \"quoted\",\nand a second line"
CORPUS = ["first document", "two lines\nin one example", "", "naïve café", "last"] * 300


def build(data_dir, dataset, features, splits, version="1.0.0"):
    """Prepare `dataset` from {split: [example dicts]} in ArrayRecord format."""
    tfds = tensorflow_datasets

    class Local(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        name = dataset
        VERSION = tfds.core.Version(version)
        code_path = None  # else tfds looks for checksum files beside this module

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features),
                                         disable_shuffling=True)

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(rows) for split, rows in splits.items()}

        def _generate_examples(self, rows):
            for i, row in enumerate(rows):
                yield i, row

    Local(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tfds = tensorflow_datasets
    d = tmp_path_factory.mktemp("tfds")
    build(d, "tiny_instructions", {"instruction": tfds.features.Text(), "output": tfds.features.Text(),
                                   "n": tfds.features.Scalar(np.int32)},
          {"train": INSTRUCTIONS, "test": INSTRUCTIONS[:2]})
    build(d, "tiny_corpus", {"text": tfds.features.Text()}, {"train": [{"text": t} for t in CORPUS]})
    return str(d)


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory, spm_tokenizer):
    path = tmp_path_factory.mktemp("tok") / "vocabulary.spm"
    path.write_bytes(spm_tokenizer.proto)
    return str(path)


def test_spec_grammar():
    assert T.parse("tfds:lm1b") == T.Spec("lm1b")
    assert T.parse("tfds:c4/en:validation") == T.Spec("c4", "en", None, "validation")
    assert T.parse("tfds:lm1b:1.1.0") == T.Spec("lm1b", None, "1.1.0", "train")  # a version
    assert T.parse("tfds:wiki/en:3.*.*:train[:10%]+test") == T.Spec("wiki", "en", "3.*.*", "train[:10%]+test")
    assert str(T.parse("tfds:c4/en:3.0.1:test[:5]")) == "tfds:c4/en:3.0.1:test[:5]"
    assert T.is_spec("tfds:x") and not T.is_spec("data.csv")
    for bad in ("tfds:", "tfds:/en", "tfds:a b", "c4"):
        with pytest.raises(UserError, match="tfds:NAME"):
            T.parse(bad)


def test_instructions_read_as_from_the_equivalent_csv(data_dir, tmp_path, spm_tokenizer):
    path = tmp_path / "same.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, ["instruction", "output", "n"])
        w.writeheader()
        w.writerows(INSTRUCTIONS)
    for limit in (None, 3):
        ours = T.read_records("tfds:tiny_instructions", limit=limit, data_dir=data_dir)
        ref = data.read_records(str(path), limit=limit)
        assert (ours.instructions, ours.outputs, ours.skipped, ours.reasons) == \
               (ref.instructions, ref.outputs, ref.skipped, ref.reasons)
    assert ours.skipped == 1 and "Grüße" not in "".join(ours.instructions)  # limit 3 stops early
    full = T.read_records("tfds:tiny_instructions", data_dir=data_dir)
    assert full.instructions[3] == INSTRUCTIONS[4]["instruction"] and full.report("x").startswith("x: skipped 1")
    # Same Records -> same rows -> the same batch at every step.
    a, b = (data.encode(spm_tokenizer, r, data.TEMPLATE, 32, loss_on="response")
            for r in (full, data.read_records(str(path))))
    for step in range(3):
        x, y = data.batch_rows(a, step, batch_size=2, seed=5), data.batch_rows(b, step, batch_size=2, seed=5)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    test = T.read_records("tfds:tiny_instructions:test", data_dir=data_dir)
    assert test.outputs == ["0", "2"]
    sliced = T.read_records("tfds:tiny_instructions:1.0.0:train[3:]", data_dir=data_dir)
    assert sliced.outputs == ["6", "8", "10"]


def test_tfds_corpus_shards_as_the_text_file_and_reading_never_imports_tensorflow(
        data_dir, tok_file, tmp_path):
    """`python -m jaxlm.shards --input=tfds:...` and the same corpus as a text file write the same
    shards; the process that read the dataset (shards and instruction records) has no TF."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
    common = ["--tokenizer", tok_file, "--max_length", "16", "--shard_size", "40",
              "--validation_fraction", "0.5"]
    assert shards.main(["--input", str(corpus), "--out", str(tmp_path / "from_text"), *common]) == 0
    script = f"""
import json, sys
from jaxlm import shards
from jaxlm.data import tfds
shards.main(["--input", "tfds:tiny_corpus", "--tfds_data_dir", {data_dir!r},
             "--out", {str(tmp_path / "from_tfds")!r}, *{common!r}])
r = tfds.read_records("tfds:tiny_instructions", data_dir={data_dir!r})
print(json.dumps({{"tensorflow": sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"),
                   "outputs": r.outputs}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tensorflow"] == []
    assert result["outputs"] == [r["output"] for r in INSTRUCTIONS if r["output"]]
    assert "input: tfds:tiny_corpus, 1500 examples" in out.stdout
    for split in ("train", "validation"):
        ours = sorted(os.listdir(tmp_path / "from_tfds" / split))
        assert ours == sorted(os.listdir(tmp_path / "from_text" / split)) and ours
        for name in ours:
            assert (tmp_path / "from_tfds" / split / name).read_bytes() == \
                   (tmp_path / "from_text" / split / name).read_bytes()


def test_hosts_read_contiguous_blocks_and_number_their_shards_apart(data_dir, tok_file, tmp_path):
    whole, n = T.open_texts("tfds:tiny_corpus", data_dir=data_dir)
    parts = [T.open_texts("tfds:tiny_corpus", data_dir=data_dir, process_index=i, process_count=3)
             for i in range(3)]
    assert n == sum(k for _, k in parts) == len(CORPUS)
    assert [line for lines, _ in parts for line in lines] == list(whole)
    assert list(T.host_range(10, 1, 3)) == [3, 4, 5]
    for i in range(2):
        shards.main(["--input", "tfds:tiny_corpus", "--tfds_data_dir", data_dir, "--tokenizer", tok_file,
                     "--max_length", "16", "--shard_size", "40", "--validation_fraction", "0",
                     "--process_index", str(i), "--process_count", "2", "--out", str(tmp_path)])
    names = [os.path.basename(p) for p, _ in shards.list_shards(str(tmp_path / "train"))]
    assert names[:4] == ["dataset-0-40.tfrecord", "dataset-1-40.tfrecord", "dataset-2-40.tfrecord",
                         "dataset-3-40.tfrecord"]  # host 0 wrote 0, 2, ...; host 1 wrote 1, 3, ...


def test_bad_input_is_one_clear_line(data_dir, tmp_path, tok_file, capsys):
    ins = "tfds:tiny_instructions"
    cases = [
        (lambda: T.read_records("tfds:nope", data_dir=data_dir),
         f"tfds:nope is not prepared in --tfds_data_dir={data_dir} (found: tiny_corpus, tiny_instructions); "
         f"prepare it with `tfds build nope --data_dir={data_dir} --file_format=array_record`"),
        (lambda: T.read_records("tfds:nope", data_dir=str(tmp_path / "nowhere")), "does not exist"),
        (lambda: T.read_records(ins + ":validation", data_dir=data_dir),
         "has no split 'validation' (splits: train, test)"),
        (lambda: T.read_records(ins + ":2.0.0", data_dir=data_dir), "(versions there: 1.0.0)"),
        (lambda: T.read_records("tfds:tiny_instructions/big", data_dir=data_dir), "no prepared config 'big'"),
        (lambda: T.read_records(ins, "prompt", data_dir=data_dir),
         "has no feature 'prompt' (features: instruction, n, output); pass --instruction_column=NAME"),
        (lambda: T.read_records(ins, output_column="n", data_dir=data_dir),
         "feature 'n' of tfds:tiny_instructions:train is Scalar(shape=(), dtype=int32), not text; pass "
         "--output_column=NAME with a text feature (instruction, output)"),
        (lambda: T.open_texts("tfds:tiny_corpus", "body", data_dir=data_dir), "pass --text_feature=NAME"),
        (lambda: T.read_records(ins + ":train[:200%]", data_dir=data_dir), "bad split 'train[:200%]'"),
    ]
    for call, needle in cases:
        with pytest.raises(UserError) as e:
            call()
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)

    # A dataset prepared in TFRecord (tfds' default) cannot be read without TensorFlow.
    src = os.path.join(data_dir, "tiny_corpus", "1.0.0")
    dst = tmp_path / "tfrec" / "tiny_corpus" / "1.0.0"
    dst.mkdir(parents=True)
    info = json.loads(open(os.path.join(src, "dataset_info.json")).read())
    info["fileFormat"] = "tfrecord"
    (dst / "dataset_info.json").write_text(json.dumps(info))
    (dst / "features.json").write_text(open(os.path.join(src, "features.json")).read())
    with pytest.raises(UserError, match="prepared as tfrecord, which needs TensorFlow.*convert_format"):
        T.open_texts("tfds:tiny_corpus", data_dir=str(tmp_path / "tfrec"))

    with pytest.raises(SystemExit) as e:  # the CLI: exit 2, one `error:` line, nothing written
        shards.main(["--input", "tfds:tiny_corpus:test", "--tfds_data_dir", data_dir,
                     "--tokenizer", tok_file, "--out", str(tmp_path / "never")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "no split 'test'" in err
    assert not (tmp_path / "never").exists()
