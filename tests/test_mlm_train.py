"""The shortened MLM pipeline: train a tokenizer on pydoc topics -> shards -> train -> resume."""
import json
import os

import numpy as np
import pytest

from jaxlm import mlm, shards, tokenizer_train
from jaxlm.corpus import pydoc_corpus
from jaxlm.train import report

MAXLEN = 64


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlm")
    lines = pydoc_corpus().splitlines()[:4000]
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")
    tok_dir = str(root / "tok")
    assert tokenizer_train.main(["--input", str(corpus), "--vocab_size", "600", "--out", tok_dir]) == 0
    data = str(root / "shards")
    assert shards.main(["--input", str(corpus), "--tokenizer", tok_dir, "--max_length", str(MAXLEN),
                        "--shard_size", "100", "--out", data, "--validation_fraction", "0.25"]) == 0
    return root, tok_dir, data


def _args(tok_dir, data, out, steps, *extra):
    return ["--preset=roberta_tiny", f"--tokenizer={tok_dir}", f"--data={data}", "--mesh=8x1",
            "--per_replica_batch_size=2", f"--max_length={MAXLEN}", f"--steps={steps}",
            "--learning_rate=2e-3", "--warmup_fraction=0.1", "--dropout=0", "--log_every=5",
            "--shuffle_buffer=256", "--eval_batches=4", f"--out={out}", *extra]


def test_train_loss_falls_validates_and_resumes(pipeline, capsys):
    root, tok_dir, data = pipeline
    out = str(root / "run")
    assert mlm.main(_args(tok_dir, data, out, 30, "--save_every=15")) == 0
    text = capsys.readouterr().out
    assert "8x1 mesh" in text and "validation at step 30" in text
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = np.mean([r["loss"] for r in rows[:5]]), np.mean([r["loss"] for r in rows[-5:]])
    assert last < first - 0.5, (first, last)
    assert first == pytest.approx(np.log(600), abs=0.7)  # a fresh model is near uniform
    board = report.read_scalars(os.path.join(out, "tensorboard"))
    assert [s for s, _ in board["train/loss"]] == list(range(1, 31))
    assert [s for s, _ in board["validation/loss"]] == [30]
    with open(os.path.join(out, "metrics.png"), "rb") as f:
        assert f.read(4) == b"\x89PNG"

    # Preempted after step 15: drop the final checkpoint, rerun the same command. It resumes at
    # 15 and replays steps 16..30 on the same batches and masks: the same losses come out.
    import shutil
    shutil.rmtree(os.path.join(out, "checkpoints", "30"))
    assert mlm.main(_args(tok_dir, data, out, 30, "--save_every=15")) == 0
    assert "resuming from step 15 (epoch" in capsys.readouterr().out
    again = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))][30:]
    assert [r["step"] for r in again] == list(range(16, 31))
    np.testing.assert_allclose([r["loss"] for r in again], [r["loss"] for r in rows[15:]], rtol=1e-4)

    # A different run in the same folder is refused rather than silently mixed.
    with pytest.raises(SystemExit) as e:
        mlm.main(_args(tok_dir, data, out, 30, "--learning_rate=1e-3"))
    assert e.value.code == 2 and "flags differ: learning_rate" in capsys.readouterr().err

    import jaxlm
    model, params = jaxlm.load(os.path.join(out, "model"))
    assert model.config.vocab_size == 600 and model.config.family == "roberta"
    assert jaxlm.load_tokenizer(os.path.join(out, "model")).vocab_size == 600


def test_errors(pipeline, tmp_path, capsys):
    root, tok_dir, data = pipeline
    with pytest.raises(SystemExit) as e:
        mlm.main(_args(tok_dir, data, str(tmp_path / "o"), 2)[:-1] + ["--max_length=32", f"--out={tmp_path}/o"])
    assert e.value.code == 2 and "length 64 but --max_length is 32" in capsys.readouterr().err
    os.makedirs(tmp_path / "empty")
    with pytest.raises(SystemExit) as e:
        mlm.main(_args(tok_dir, str(tmp_path / "empty"), str(tmp_path / "o"), 2))
    assert e.value.code == 2 and "holds no .tfrecord shards" in capsys.readouterr().err
