"""Instruction data: CSV / JSONL / JSON rows -> templated text -> KerasHub-packed token ids.

The seed article reads the OpenHermes CSV (columns `instruction`, `output`), formats each row
with `"Instruction:\n{instruction}\n\nResponse:\n{output}"`, keeps the first 1000 and lets
`GemmaCausalLMPreprocessor` pack them (BOS + text + EOS, length sequence_length + 1). This
module does the same without pandas or TensorFlow. Bad rows are counted and skipped, because
one broken line in 240k should not kill a run; a file without the columns is a UserError.

Batches are a pure function of (seed, step): the stream is the concatenation of per-epoch
permutations, so resuming at step s reads exactly what an uninterrupted run would have read.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import string

import numpy as np

from jaxlm.errors import UserError

TEMPLATE = "Instruction:\n{instruction}\n\nResponse:\n{output}"


@dataclasses.dataclass
class Records:
    instructions: list[str]
    outputs: list[str]
    skipped: int = 0
    reasons: dict = dataclasses.field(default_factory=dict)  # reason -> count

    def __len__(self):
        return len(self.instructions)

    def report(self, path: str) -> str | None:
        """One line about skipped rows, or None when every row was good."""
        if not self.skipped:
            return None
        why = ", ".join(f"{n} {r}" for r, n in sorted(self.reasons.items()))
        return f"{path}: skipped {self.skipped} malformed row(s) ({why}); kept {len(self)}"


def _value(row: dict, column: str):
    """A usable text field, or the reason it is not."""
    if column not in row or row[column] is None:
        return None, f"missing {column}"
    v = row[column]
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        return None, f"non-text {column}"
    v = str(v)
    return (v, None) if v.strip() else (None, f"empty {column}")


def _rows(path: str):
    """Yield dict rows or the string reason a row is unreadable; also report the columns seen."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        yield from _csv_rows(path)
    elif ext in (".jsonl", ".ndjson"):
        with open(path, encoding="utf-8-sig") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    yield ("bad", "bad JSON line")
                    continue
                yield ("row", row) if isinstance(row, dict) else ("bad", "line is not an object")
    elif ext == ".json":
        with open(path, encoding="utf-8-sig") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); "
                                "use a JSON list of objects or JSONL") from None
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))  # {"data": [...]}
        if not isinstance(data, list):
            raise UserError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        for row in data:
            yield ("row", row) if isinstance(row, dict) else ("bad", "item is not an object")
    else:
        raise UserError(f"{path}: unsupported data format {ext or '(no extension)'!r}; "
                        "use .csv, .jsonl or .json")


MAX_ROW_LINES = 5000  # a quoted field longer than this is taken for a quote never closed


def _csv_rows(path: str):
    """CSV rows as dicts, reading Excel's UTF-8 byte-order mark, refusing a runaway quote.

    An unterminated quote makes the csv module read every following line, up to the next
    quote or the end of the file, into one field: thousands of rows would vanish behind one
    "malformed row". Refused, with the line numbers: a row spanning several lines that has not
    the header's number of fields or breaks the quoting rules (it ends inside a quote at the
    end of the file, or a quote closes before more text); any row spanning more than
    MAX_ROW_LINES lines. A well-formed multi-line field is kept, and a malformed one-line row
    is skipped and counted as before.
    """
    with open(path, newline="", encoding="utf-8-sig") as f:
        lines = _Recorded(f)
        reader = csv.reader(lines)
        try:
            header = next(reader, [])
            yield ("columns", header)
            end = reader.line_num
            for fields in reader:
                start, end = end + 1, reader.line_num
                if end - start >= MAX_ROW_LINES or (end > start and (
                        len(fields) != len(header) or _misquoted(lines.taken))):
                    raise UserError(
                        f"{path}: line {start} opens a quote that runs on to line {end}, which "
                        f"would read the {end - start} line(s) after it as one field and lose "
                        f"their rows; close the quote on line {start} (a quote inside a field "
                        'is written "")')
                lines.taken = []
                if fields:  # a blank line is no row (as csv.DictReader)
                    yield ("row", dict(zip(header, fields)))
        except csv.Error as e:
            raise UserError(f"cannot read {path} at line {reader.line_num}: {e} (an unterminated "
                            "quote?); expected UTF-8 CSV with a header row") from None


class _Recorded:
    """A file's lines, keeping those handed out since `taken` was last cleared (one row's)."""

    def __init__(self, f):
        self.f, self.taken = f, []

    def __iter__(self):
        return self

    def __next__(self):
        line = next(self.f)
        self.taken.append(line)
        return line


def _misquoted(raw: list[str]) -> bool:
    """Whether a row's text breaks the quoting rules the lenient reader forgives: it ends
    inside a quoted field (the file ran out first), or a quote that closed a field is followed
    by more text (a runaway quote closed by the next field's opening quote)."""
    try:
        for _ in csv.reader(raw, strict=True):
            pass
    except csv.Error:
        return True
    return False


def read_records(path: str, instruction_column: str = "instruction",
                 output_column: str = "output", limit: int | None = None) -> Records:
    """Read (instruction, output) pairs; malformed rows are counted in `skipped`, not raised.

    limit: keep the first `limit` good rows (the seed's `data[:1000]`); reading stops there, so
      `skipped` counts the malformed rows met before it.
    Raises UserError for a missing or empty file, or one without the two columns.
    """
    if not os.path.isfile(path):
        raise UserError(f"data file {path} does not exist")
    if os.path.getsize(path) == 0:
        raise UserError(f"data file {path} is empty")
    try:
        return collect(_rows(path), path, instruction_column, output_column, limit)
    except (csv.Error, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}; expected UTF-8 CSV with a header row") from None


def collect(items, source: str, instruction_column: str = "instruction",
            output_column: str = "output", limit: int | None = None) -> Records:
    """Records from a stream of ("columns", names) / ("row", dict) / ("bad", reason) items.

    Every reader (files here, TFDS in `jaxlm.data.tfds`) goes through this one loop, so the
    same rows give the same Records, skip counts and errors whatever they were stored in.
    """
    out = Records([], [])
    seen_columns: set[str] = set()
    wanted = (instruction_column, output_column)
    for kind, item in items:
        if kind == "columns":
            seen_columns.update(item)
            if not all(c in item for c in wanted):
                raise UserError(_columns_error(source, wanted, item))
            continue
        if kind == "bad":
            out.skipped += 1
            out.reasons[item] = out.reasons.get(item, 0) + 1
            continue
        seen_columns.update(item)
        (ins, why1), (res, why2) = _value(item, instruction_column), _value(item, output_column)
        if why1 or why2:
            out.skipped += 1
            out.reasons[why1 or why2] = out.reasons.get(why1 or why2, 0) + 1
            continue
        out.instructions.append(ins)
        out.outputs.append(res)
        if limit is not None and len(out) >= limit:
            break  # a 240k-row file is not parsed whole for its first 1000 rows
    if not len(out):
        if seen_columns and not all(c in seen_columns for c in wanted):
            raise UserError(_columns_error(source, wanted, sorted(seen_columns)))
        why = f" ({out.report(source).split('(', 1)[1]}" if out.skipped else ""
        raise UserError(f"data file {source} has no usable rows{why}")
    return out


def _columns_error(path, wanted, found) -> str:
    return (f"{path} has no {' / '.join(repr(c) for c in wanted)} columns (found: "
            f"{', '.join(repr(c) for c in found) or 'none'}); "
            "pass --instruction_column=NAME --output_column=NAME")


def check_template(template: str) -> str:
    """The template must format with exactly `instruction` and `output` fields."""
    try:
        template.format(instruction="", output="")
    except (KeyError, IndexError, ValueError) as e:
        raise UserError(f"bad --template {template!r} ({type(e).__name__}: {e}); it may use only "
                        "{instruction} and {output}") from None
    if "{output}" not in template:
        raise UserError(f"--template {template!r} has no {{output}} field")
    return template


def format_examples(records: Records, template: str = TEMPLATE) -> list[str]:
    return [template.format(instruction=i, output=o)
            for i, o in zip(records.instructions, records.outputs)]


def prompt(template: str, instruction: str) -> str:
    """The generation prompt: the template with an empty output, as the seed does."""
    return template.format(instruction=instruction, output="")


LOSS_ON = ("all", "response")


def pack(tokenizer, texts: list[str], sequence_length: int):
    """KerasHub's StartEndPacker at length sequence_length + 1.

    -> token_ids int32 [N, L+1] (BOS, text truncated to L-1 tokens, EOS, 0-padding) and
    padding_mask bool [N, L+1]. EOS is kept even when the text is truncated, as KerasHub does.
    """
    rows = _start_end_pack(tokenizer, [tokenizer.encode(t, bos=False) for t in texts],
                           sequence_length + 1)
    return rows["token_ids"], rows["padding_mask"]


def encode(tokenizer, records: Records, template: str, sequence_length: int,
           loss_on: str = "all") -> dict[str, np.ndarray]:
    """Records -> KerasHub-packed rows, one example per row, with the weight of each target.

    -> {"token_ids" int32, "padding_mask" bool, "loss_mask" bool}, each [N, L+1]; token_ids
    and padding_mask are exactly `pack(tokenizer, format_examples(records, template), L)`.
    The loss scores target t (predicted from tokens < t) iff loss_mask[:, t], t >= 1:
      loss_on="all": every real token (KerasHub's and the seed's objective): loss_mask is
        padding_mask.
      loss_on="response": the tokens from the template's {output} field on, and the EOS;
        the prompt stays in the row (attended to) but is not scored. The prompt's length is
        the tokens that the whole text shares with the prompt text tokenized alone, so a
        token that straddles the boundary counts as response. A row truncated inside its
        prompt scores nothing.
    """
    if loss_on not in LOSS_ON:
        raise UserError(f"--loss_on={loss_on!r}: use one of {', '.join(LOSS_ON)}")
    texts = format_examples(records, template)
    bodies = [tokenizer.encode(t, bos=False) for t in texts]
    rows = _start_end_pack(tokenizer, bodies, sequence_length + 1)
    if loss_on == "all":
        rows["loss_mask"] = rows["padding_mask"].copy()
        return rows
    head = _prompt_part(template)
    starts = np.array([1 + _shared_prefix(tokenizer.encode(head.format(instruction=ins), bos=False), body)
                       for ins, body in zip(records.instructions, bodies)])  # index of the first response token
    column = np.arange(sequence_length + 1)[None, :]
    rows["loss_mask"] = rows["padding_mask"] & (column >= starts[:, None])
    return rows


def _prompt_part(template: str) -> str:
    """The template up to its {output} field (itself a template, in {instruction} only)."""
    out = []
    for literal, field, spec, conversion in string.Formatter().parse(template):
        out.append(literal.replace("{", "{{").replace("}", "}}"))
        if field == "output":
            break
        if field is not None:
            out.append("{" + field + (f"!{conversion}" if conversion else "")
                       + (f":{spec}" if spec else "") + "}")
    return "".join(out)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _start_end_pack(tokenizer, bodies: list[list[int]], width: int) -> dict[str, np.ndarray]:
    """BOS + body[:width - 2] + EOS, right-padded to `width` (KerasHub's StartEndPacker)."""
    ids = np.full((len(bodies), width), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(bodies), width), bool)
    for row, body in enumerate(bodies):
        seq = [tokenizer.bos_id] + body[: width - 2] + [tokenizer.eos_id]
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = True
    return {"token_ids": ids, "padding_mask": mask}


def trim_padding(rows: dict[str, np.ndarray], multiple_of: int = 8) -> dict[str, np.ndarray]:
    """Right-padded rows [N, L+1] without the columns that are padding in every row: width
    1 + the longest row's targets rounded up to `multiple_of` (at most L + 1).

    One width for the whole dataset keeps one compiled step. Under causal attention a real
    token never sees a later column, so the dropped ones change no loss and no gradient;
    they only cost compute. The built-in tasks fit in 23 of the demo's 40 tokens.
    """
    mask = rows["padding_mask"]
    used = int(mask.any(0).nonzero()[0].max(initial=0)) + 1  # columns up to the last real token
    width = min(mask.shape[1], 1 + -(-(used - 1) // multiple_of) * multiple_of)
    return {k: v[:, :width] for k, v in rows.items()}


def batch_indices(num_examples: int, global_batch: int, step: int, seed: int) -> np.ndarray:
    """Row indices of the global batch at `step`: a slice of the endless stream of per-epoch
    permutations (epoch e shuffled with (seed, e)). Pure in its arguments, hence resumable."""
    start, stop = step * global_batch, (step + 1) * global_batch
    out = []
    for epoch in range(start // num_examples, (stop - 1) // num_examples + 1):
        perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
        lo, hi = max(start - epoch * num_examples, 0), min(stop - epoch * num_examples, num_examples)
        out.append(perm[lo:hi])
    return np.concatenate(out)


def host_batch(ids: np.ndarray, mask: np.ndarray, step: int, **kwargs) -> dict:
    """`batch_rows` of {"token_ids": ids, "padding_mask": mask} (the unweighted, unpacked rows)."""
    return batch_rows({"token_ids": ids, "padding_mask": mask}, step, **kwargs)


def batch_rows(rows: dict[str, np.ndarray], step: int, *, batch_size: int, accum_steps: int = 1,
               seed: int = 0, process_index: int = 0, process_count: int = 1) -> dict:
    """This host's rows of the global batch at `step`, for every array of `rows` ([R, ...],
    as `encode` or `packing.pack_rows` give them; R rows, examples or packed).

    The global batch is accum_steps * batch_size rows; each micro-batch of `batch_size` rows is
    split into `process_count` contiguous blocks and this host keeps block `process_index`.
    -> {key: [b, ...]}, or [A, b, ...] when accum_steps > 1, with b = batch_size // process_count.
    """
    if batch_size % process_count:
        raise UserError(f"--batch_size={batch_size} is not divisible by {process_count} hosts")
    num_rows = len(next(iter(rows.values())))
    idx = batch_indices(num_rows, batch_size * accum_steps, step, seed).reshape(accum_steps, batch_size)
    local = batch_size // process_count
    idx = idx[:, process_index * local:(process_index + 1) * local]
    batch = {k: v[idx] for k, v in rows.items()}
    return batch if accum_steps > 1 else {k: v[0] for k, v in batch.items()}
