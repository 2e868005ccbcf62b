"""Masked-LM Unigram tokenizer training: the blog's ids and normalisation, CLI, clear errors."""
import os

import pytest

import jaxlm
from jaxlm import tokenizer as tokenizer_mod
from jaxlm import tokenizer_train
from jaxlm.errors import UserError


def _corpus(tmp_path, n=2500):
    from pydoc_data import topics
    text = "\n".join(topics.topics[k] for k in sorted(topics.topics)).splitlines()[:n]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(text) + "\n" + "x" * 20000 + " longline\n")
    return str(path)


def test_cli_trains_blog_layout(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    out = str(tmp_path / "tok")
    assert tokenizer_mod.main(["train", "--input", corpus, "--vocab_size", "800", "--out", out]) == 0
    assert "800 pieces" in capsys.readouterr().out
    tok = jaxlm.load_tokenizer(out)
    sp = tok.sp
    assert [sp.id_to_piece(i) for i in range(6)] == ["[CLS]", "[SEP]", "<unk>", "<pad>", "[MASK]", "▁"]
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tokenizer_train.mask_id(tok)) == (0, 1, 3, 4)
    # Only the two quote rules: `` and '' become ", nothing else is normalised (no NFKC: ﬁ stays).
    assert sp.decode(sp.encode("``quick'' it's 'y'")) == '"quick" it\'s \'y\''
    assert sp.encode("[MASK]")[-1] == 4
    assert sp.encode("ﬁ") == [5, 2] or "ﬁ" in "".join(sp.encode("ﬁ", out_type=str))
    ids = tok.encode("hello world", eos=True)
    assert ids[0] == 0 and ids[-1] == 1
    # The 20 000-character line was not skipped: its run of x's was learnt as long pieces.
    assert any(set(p.strip("▁")) == {"x"} and len(p) >= 8 for p in
               (sp.id_to_piece(i) for i in range(sp.get_piece_size())))
    # KerasHub's AlbertTokenizer (the blog wraps its tokenizer as one) reads the model as is.
    keras_hub = pytest.importorskip("keras_hub")
    albert = keras_hub.models.AlbertTokenizer(proto=os.path.join(out, "assets", "tokenizer", "vocabulary.spm"))
    assert [int(i) for i in albert("hello world")] == ids[1:-1]


def test_missing_input_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tokenizer_mod.main(["train", "--input", str(tmp_path / "nope.txt"), "--vocab_size", "100",
                            "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "nope.txt does not exist" in err and len(err.strip().splitlines()) == 1


def test_vocab_too_small_for_characters(tmp_path):
    with pytest.raises(UserError, match="too small for this corpus.*distinct characters"):
        tokenizer_train.train(open(_corpus(tmp_path)).read().splitlines(), 60)
    assert not os.path.exists(tmp_path / "o")


def test_empty_corpus():
    with pytest.raises(UserError, match="no non-empty line"):
        tokenizer_train.train(["", "  "], 100)
