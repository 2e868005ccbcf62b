"""Train the masked-LM Unigram tokenizer with the TF+TPU blog's choices, in sentencepiece.

    python -m jaxlm.tokenizer train --input FILES --vocab_size 25000 --out DIR

The blog (`train_unigram.py`, HF tokenizers) normalises only `` and '' to ", splits on spaces
with a Metaspace prefix, has no byte fallback (unseen characters become <unk>), and fixes the
special ids [CLS]=0 [SEP]=1 <unk>=2 <pad>=3 [MASK]=4. The sentencepiece options below reproduce
that. Long lines (WikiText paragraphs) are kept, not
silently skipped as sentencepiece's 4192-byte default would.

DIR gets `assets/tokenizer/vocabulary.spm` + `tokenizer.json`, KerasHub's AlbertTokenizer layout
(the blog wraps its tokenizer as an AlbertTokenizer too): `jaxlm.load_tokenizer(DIR)` reads it,
and so does `keras_hub.models.AlbertTokenizer(proto=DIR/assets/tokenizer/vocabulary.spm)`.
"""
from __future__ import annotations

import io
import os
import tempfile

from jaxlm import storage
from jaxlm.errors import ArgumentParser, UserError

SPECIALS = {"[CLS]": 0, "[SEP]": 1, "<unk>": 2, "<pad>": 3, "[MASK]": 4}
# sentencepiece normalisation rules: source code points <TAB> target code points (hex).
_QUOTE_RULES = "60 60\t22\n27 27\t22\n"  # `` -> "  and  '' -> "
MAX_LINE_BYTES = 1 << 16


def read_lines(paths: list[str]):
    """Yield the lines of every file (local or a path library URL), failing fast on a missing one."""
    for p in paths:
        if not storage.exists(p):
            raise UserError(f"input file {p} does not exist")
    for p in paths:
        with storage.open_file(p, "rb") as f:
            for raw in f:
                yield raw.decode("utf-8", errors="replace").rstrip("\n")


def train(lines, vocab_size: int, *, num_threads: int = 2,
          input_sentence_size: int = 2_000_000) -> bytes:
    """Train on an iterable of lines; returns the serialized sentencepiece model."""
    import sentencepiece as spm
    if vocab_size <= len(SPECIALS) + 1:
        raise UserError(f"--vocab_size {vocab_size} is too small; it must exceed {len(SPECIALS) + 1}")
    lines = [l[:MAX_LINE_BYTES // 4] for l in lines if l.strip()]
    if not lines:
        raise UserError("the input has no non-empty line to train a tokenizer on")
    chars = len(set("".join(lines)) - {" "})
    needed = chars + len(SPECIALS) + 1  # every character seen, the specials and the bare "▁"
    if vocab_size < needed:
        raise UserError(f"--vocab_size {vocab_size} is too small for this corpus: it has {chars} "
                        f"distinct characters, so use at least {needed}")
    out = io.BytesIO()
    with tempfile.NamedTemporaryFile("w", suffix=".tsv", delete=False) as rules:
        rules.write(_QUOTE_RULES)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=out, model_type="unigram",
            vocab_size=vocab_size, normalization_rule_tsv=rules.name,
            remove_extra_whitespaces=False, add_dummy_prefix=True, split_by_whitespace=True,
            byte_fallback=False, character_coverage=1.0,
            max_sentencepiece_length=16, shrinking_factor=0.75, num_sub_iterations=2,
            bos_id=0, bos_piece="[CLS]", eos_id=1, eos_piece="[SEP]", unk_id=2, unk_piece="<unk>",
            pad_id=3, pad_piece="<pad>", user_defined_symbols=["[MASK]"],
            max_sentence_length=MAX_LINE_BYTES, hard_vocab_limit=False, num_threads=num_threads,
            input_sentence_size=input_sentence_size, shuffle_input_sentence=True, minloglevel=2)
    except RuntimeError as e:
        msg = str(e).splitlines()[0]
        if "smaller than required_chars" in msg or "Vocabulary size" in msg:
            raise UserError(f"--vocab_size {vocab_size} is too small for this corpus ({msg})") from None
        raise
    finally:
        os.unlink(rules.name)
    return out.getvalue()


def save(proto: bytes, out_dir: str) -> None:
    """assets/tokenizer/vocabulary.spm + tokenizer.json (KerasHub AlbertTokenizer) under out_dir
    (a local folder or a URL)."""
    assets = storage.join(out_dir, "assets", "tokenizer")
    storage.makedirs(assets)
    storage.write_bytes(storage.join(assets, "vocabulary.spm"), proto)
    from jaxlm.convert.keras_preset import write_tokenizer_json
    write_tokenizer_json(out_dir, "keras_hub.src.models.albert.albert_tokenizer", "AlbertTokenizer",
                         "albert_tokenizer", proto=None, sequence_length=None, add_bos=False,
                         add_eos=False)


def mask_id(tokenizer) -> int:
    """The mask token id of a jaxlm tokenizer: `[MASK]` (Unigram) or `<mask>` (BPE)."""
    if getattr(tokenizer, "mask_id", None) is not None:
        return tokenizer.mask_id
    for piece in ("[MASK]", "<mask>"):
        i = tokenizer.sp.piece_to_id(piece)
        if i != tokenizer.sp.unk_id():
            return i
    raise UserError("the tokenizer has no [MASK] or <mask> token; train one with "
                    "`python -m jaxlm.tokenizer train`")


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m jaxlm.tokenizer train",
                       description="Train the masked-LM Unigram tokenizer (blog choices).")
    p.add_argument("--input", nargs="+", default=None,
                   help="text files, one example per line (default: pydoc_data.topics)")
    p.add_argument("--vocab_size", type=int, default=25000)
    p.add_argument("--out", required=True, help="output folder (local or gs://...)")
    p.add_argument("--num_threads", type=int, default=2)
    args = p.parse_args(argv)
    storage.check_output_folder(args.out, "--out")  # before minutes of training
    if args.num_threads < 1:
        raise UserError(f"--num_threads={args.num_threads} must be >= 1")
    if args.input:
        lines = read_lines(args.input)
    else:
        from jaxlm.corpus import pydoc_corpus
        lines = pydoc_corpus().splitlines()
    proto = train(lines, args.vocab_size, num_threads=args.num_threads)
    save(proto, args.out)
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_proto=proto)
    print(f"wrote {args.out}: Unigram, {sp.get_piece_size()} pieces "
          f"([CLS]=0 [SEP]=1 <unk>=2 <pad>=3 [MASK]=4)")
    if sp.get_piece_size() < args.vocab_size:
        print(f"note: the corpus supports only {sp.get_piece_size()} of the {args.vocab_size} pieces "
              "asked for; a bigger corpus gives the full vocabulary")
    return 0

