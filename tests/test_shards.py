"""Blog-format TFRecord shards without TensorFlow: framing, protos, both ways with TF, CLI, errors."""
import io
import os

import numpy as np
import pytest

from jaxlm import shards, tfrecord
from jaxlm.errors import UserError

MAXLEN = 32


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from jaxlm import tokenizer_train
    from jaxlm.corpus import pydoc_corpus
    from jaxlm.tokenizer import Tokenizer
    proto = tokenizer_train.train(pydoc_corpus().splitlines()[:3000], 400, num_threads=1)
    return Tokenizer(proto)


def test_crc32c_and_varints():
    assert tfrecord._crc32c_py(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert tfrecord.crc32c(b"123456789") == 0xE3069283
    values = np.array([0, 1, 127, 128, 300, 2**31, 2**62, -1, -300])
    np.testing.assert_array_equal(tfrecord._decode_varints(tfrecord._varints(values)), values)


def test_record_errors():
    buf = io.BytesIO()
    tfrecord.write_record(buf, b"hello")
    data = buf.getvalue()
    assert list(tfrecord.read_records(io.BytesIO(data))) == [b"hello"]
    with pytest.raises(UserError, match="truncated"):
        list(tfrecord.read_records(io.BytesIO(data[:-2])))
    with pytest.raises(UserError, match="corrupt"):
        list(tfrecord.read_records(io.BytesIO(data[:12] + b"jello" + data[17:])))


def test_write_shards_blog_layout(tokenizer, tmp_path):
    lines = ["first line of text", "", "x"] * 700  # 2100 lines = 3 groups of (up to) 1000
    writers = shards.write_shards(tokenizer, lines, str(tmp_path), max_length=MAXLEN, shard_size=50,
                                  validation_fraction=0.3)
    files = shards.list_shards(str(tmp_path / "train"))
    assert [os.path.basename(p) for p, _ in files][:2] == ["dataset-0-50.tfrecord", "dataset-1-50.tfrecord"]
    assert sum(n for _, n in files) == writers["train"].records > 0
    assert writers["validation"].records > 0  # group 1 of 3 is held out
    ids, att = shards.read_shard(files[0][0], MAXLEN)
    assert ids.shape == (50, MAXLEN) and att.min() == 1
    # Each group is [CLS] line [SEP] ... concatenated; an empty line gives [CLS][SEP].
    expected = np.concatenate([tokenizer.encode(l, bos=True, eos=True) for l in lines[:1000]])
    np.testing.assert_array_equal(ids.ravel()[:100], expected[:100])


def test_tensorflow_reads_ours_and_we_read_tensorflow(tokenizer, tmp_path):
    tf = pytest.importorskip("tensorflow")
    shards.write_shards(tokenizer, ["some words here", "and more"] * 400, str(tmp_path / "ours"),
                        max_length=MAXLEN, shard_size=40)
    path, count = shards.list_shards(str(tmp_path / "ours" / "train"))[0]

    def decode_fn(sample):  # the blog's run_mlm.py decode_fn, verbatim
        features = {
            "input_ids": tf.io.FixedLenFeature(dtype=tf.int64, shape=(MAXLEN,)),
            "attention_mask": tf.io.FixedLenFeature(dtype=tf.int64, shape=(MAXLEN,)),
        }
        return tf.io.parse_single_example(sample, features)

    parsed = list(tf.data.TFRecordDataset([path]).map(decode_fn).as_numpy_iterator())
    ours_ids, _ = shards.read_shard(path, MAXLEN)
    assert len(parsed) == count == len(ours_ids)
    np.testing.assert_array_equal(np.stack([p["input_ids"] for p in parsed]), ours_ids)

    # ...and a shard written the blog's way (prepare_tfrecord_shards.get_serialized_examples).
    rng = np.random.RandomState(0)
    rows = rng.randint(0, 30000, (7, MAXLEN))
    theirs = str(tmp_path / "dataset-0-7.tfrecord")
    with tf.io.TFRecordWriter(theirs) as out:
        for r in rows:
            features = {"input_ids": tf.train.Feature(int64_list=tf.train.Int64List(value=r)),
                        "attention_mask": tf.train.Feature(int64_list=tf.train.Int64List(value=np.ones_like(r)))}
            out.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())
    ids, att = shards.read_shard(theirs, MAXLEN)
    np.testing.assert_array_equal(ids, rows)
    assert att.min() == att.max() == 1


def test_cli_and_errors(tokenizer, tmp_path, capsys):
    tok_dir = str(tmp_path / "tok")
    from jaxlm import tokenizer_train
    tokenizer_train.save(tokenizer.proto, tok_dir)
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world, this is text\n" * 1500)
    out = str(tmp_path / "out")
    assert shards.main(["--input", str(corpus), "--tokenizer", tok_dir, "--max_length", "16",
                        "--shard_size", "100", "--out", out]) == 0
    assert "train:" in capsys.readouterr().out
    assert shards.list_shards(os.path.join(out, "validation"))  # 2 groups: 1 held out

    with pytest.raises(SystemExit) as e:
        shards.main(["--input", str(tmp_path / "missing.txt"), "--tokenizer", tok_dir, "--out", out])
    assert e.value.code == 2 and "missing.txt does not exist" in capsys.readouterr().err
    path = shards.list_shards(os.path.join(out, "train"))[0][0]
    with pytest.raises(UserError, match="length 16 but --max_length is 32"):
        shards.read_shard(path, 32)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(UserError, match="holds no .tfrecord shards"):
        shards.list_shards(str(tmp_path / "empty"))
    with pytest.raises(UserError, match="does not exist"):
        shards.list_shards(str(tmp_path / "nowhere"))
