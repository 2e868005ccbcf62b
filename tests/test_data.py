"""Instruction files (CSV/JSONL/JSON), malformed rows, clear errors, packing, batching, built-ins."""
import json

import numpy as np
import pytest

from jaxlm import data
from jaxlm.errors import UserError


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


def test_csv_with_quotes_multiline_and_extra_columns(tmp_path):
    path = write(tmp_path, "d.csv", 'id,instruction,output\n1,"Say ""hi""","hi\nthere"\n2,Add 1+1,2\n')
    r = data.read_records(path)
    assert r.instructions == ['Say "hi"', "Add 1+1"] and r.outputs == ["hi\nthere", "2"]
    assert r.skipped == 0 and r.report(path) is None
    texts = data.format_examples(r)
    assert texts[1] == "Instruction:\nAdd 1+1\n\nResponse:\n2"  # the seed's template


def test_malformed_rows_are_counted_and_skipped(tmp_path):
    lines = [json.dumps({"instruction": "a", "output": "b"}),
             "{not json",
             json.dumps({"instruction": "c"}),
             json.dumps({"instruction": ["x"], "output": "y"}),
             json.dumps(["a list"]),
             json.dumps({"instruction": "", "output": "y"}),
             "",
             json.dumps({"instruction": "n", "output": 42})]
    path = write(tmp_path, "d.jsonl", "\n".join(lines))
    r = data.read_records(path)
    assert r.instructions == ["a", "n"] and r.outputs == ["b", "42"]
    assert r.skipped == 5
    assert r.reasons == {"bad JSON line": 1, "missing output": 1, "non-text instruction": 1,
                         "line is not an object": 1, "empty instruction": 1}
    line = r.report(path)
    assert "\n" not in line and "skipped 5" in line and "kept 2" in line


def test_csv_short_row_is_malformed(tmp_path):
    path = write(tmp_path, "d.csv", "instruction,output\nonly one field\nq,a\n")
    r = data.read_records(path)
    assert r.instructions == ["q"] and r.skipped == 1


def test_json_list_custom_columns_and_limit(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": f"a{i}"} for i in range(5)]
    path = write(tmp_path, "d.json", json.dumps({"data": rows}))
    r = data.read_records(path, "prompt", "answer", limit=3)
    assert r.instructions == ["p0", "p1", "p2"]


@pytest.mark.parametrize("name,text,needle", [
    ("empty.csv", "", "is empty"),
    ("cols.csv", "question,answer\nq,a\n", "found: 'question', 'answer'"),
    ("cols.jsonl", '{"question": "q", "answer": "a"}\n', "found: 'answer', 'question'"),
    ("header.csv", "instruction,output\n", "no usable rows"),
    ("bad.json", "{oops", "not valid JSON"),
    ("notes.txt", "hello", "unsupported data format"),
])
def test_clear_errors(tmp_path, name, text, needle):
    path = write(tmp_path, name, text)
    with pytest.raises(UserError) as e:
        data.read_records(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_missing_file():
    with pytest.raises(UserError, match="does not exist"):
        data.read_records("/nonexistent/x.csv")


def test_template_checks():
    assert data.check_template("Q: {instruction}\nA: {output}")
    for bad in ("{instruction} {response}", "{instruction} only", "{output} {"):
        with pytest.raises(UserError):
            data.check_template(bad)


def test_pack_matches_keras_start_end_packer(spm_tokenizer):
    """BOS + tokens + EOS at sequence_length + 1, right-padded; EOS kept when truncating."""
    import keras_hub
    texts = ["the quick brown fox", "a much longer line of text that will certainly be truncated here"]
    ids, mask = data.pack(spm_tokenizer, texts, 8)
    pre = keras_hub.models.GemmaCausalLMPreprocessor(
        keras_hub.models.GemmaTokenizer(proto=spm_tokenizer.proto), sequence_length=8)
    x, y, sw = pre(texts)
    np.testing.assert_array_equal(ids[:, :-1], np.asarray(x["token_ids"]))
    np.testing.assert_array_equal(mask[:, :-1], np.asarray(x["padding_mask"]))
    np.testing.assert_array_equal(ids[:, 1:], np.asarray(y))
    np.testing.assert_array_equal(mask[:, 1:], np.asarray(sw))
    assert ids[1, -1] == spm_tokenizer.eos_id


def test_batches_are_a_pure_function_of_step():
    n, b = 10, 4
    seen = np.concatenate([data.batch_indices(n, b, s, seed=3) for s in range(5)])
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert not np.array_equal(seen[:10], seen[10:20])  # a new shuffle each epoch
    np.testing.assert_array_equal(data.batch_indices(n, b, 3, seed=3), seen[12:16])
    assert not np.array_equal(data.batch_indices(n, b, 0, seed=4), seen[:4])


def test_hosts_split_the_global_batch():
    ids = np.arange(40).reshape(20, 2)
    mask = np.ones_like(ids, bool)
    full = data.host_batch(ids, mask, 1, batch_size=8, accum_steps=2, seed=0)
    parts = [data.host_batch(ids, mask, 1, batch_size=8, accum_steps=2, seed=0,
                             process_index=i, process_count=2) for i in range(2)]
    assert full["token_ids"].shape == (2, 8, 2) and parts[0]["token_ids"].shape == (2, 4, 2)
    np.testing.assert_array_equal(np.concatenate([p["token_ids"] for p in parts], 1), full["token_ids"])


def test_builtin_dataset_is_deterministic_and_checkable():
    train, held = data.builtin_dataset()
    train2, held2 = data.builtin_dataset()
    assert train.instructions == train2.instructions and held.outputs == held2.outputs
    assert len(train) + len(held) == 400 and len(held) == 40
    assert not set(train.instructions) & set(held.instructions)
    for ins, out in zip(train.instructions + held.instructions, train.outputs + held.outputs):
        if ins.startswith("What is ") and " + " in ins:
            a, b = ins[len("What is "):-1].split(" + ")
            assert int(out) == int(a) + int(b)
        if ins.startswith("Reverse the word: "):
            assert out[::-1] == ins.split(": ")[1]
    assert data.exact_match(" 12\nInstruction: more", "12")
    assert not data.exact_match("123", "12") and not data.exact_match("", "12")


def test_non_utf8_file_is_a_clear_error(tmp_path):
    p = tmp_path / "latin1.csv"
    p.write_bytes("instruction,output\ncaf\xe9,ok\n".encode("latin-1"))
    with pytest.raises(UserError, match="cannot read .*expected UTF-8"):
        data.read_records(str(p))


def test_reading_stops_at_the_limit(tmp_path):
    rows = "".join(f"q{i},a{i}\n" for i in range(5)) + "broken\n"
    path = write(tmp_path, "d.csv", "instruction,output\n" + rows)
    r = data.read_records(path, limit=5)
    assert len(r) == 5 and r.skipped == 0  # the broken row after the limit is never read


def test_trim_padding_drops_the_columns_no_row_uses():
    """Rows of 5, 12 and 3 tokens at --sequence_length=40: 11 targets at most, rounded up to 16
    (width 17); every array keeps its first 17 columns. A longest row that fills the width, or
    a rounding past it, leaves the full width."""
    lengths, width = [5, 12, 3], 41
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    rows = {"token_ids": np.where(mask, 7, 0).astype(np.int32), "padding_mask": mask,
            "loss_mask": mask.copy()}
    trimmed = data.trim_padding(rows)
    assert {k: v.shape for k, v in trimmed.items()} == {k: (3, 17) for k in rows}
    for k in rows:
        np.testing.assert_array_equal(trimmed[k], rows[k][:, :17])
    assert trimmed["padding_mask"].sum() == mask.sum()
    assert data.trim_padding(rows, multiple_of=1)["token_ids"].shape == (3, 12)
    full = dict(rows, padding_mask=np.ones_like(mask))
    assert data.trim_padding(full)["token_ids"].shape == (3, 41)
    assert data.trim_padding({k: v[:, :15] for k, v in rows.items()})["token_ids"].shape == (3, 15)


def test_training_rows_are_trimmed_to_the_longest_example(capsys):
    """train.py's rows for the built-in tasks on the toy tokenizer: no column that is padding in
    every row, and the run says on how many tokens the step runs."""
    import jaxlm
    from jaxlm.train import cli, lm
    a = lm.resolve_defaults(cli.parse(["--preset=gemma_tiny", "--sequence_length=200"]), toy=True)
    rows = lm.load_data(a, jaxlm.load_tokenizer("gemma_tiny"))[2]
    width = rows["token_ids"].shape[1]
    assert (width - 1) % 8 == 0 and width < 201
    assert rows["padding_mask"][:, width - 9:].any()  # the last 8 targets hold the longest row's end
    assert f"the step runs on {width - 1}" in capsys.readouterr().out
