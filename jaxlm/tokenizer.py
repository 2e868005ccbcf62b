"""SentencePiece tokenizer with an explicit BOS policy.

Gemma silently produces garbage when the leading `<bos>` is missing, so `encode` adds it by
default (the model's policy, `add_bos`) and leaving it out takes an explicit `bos=False`.
Special ids come from the model file itself (Gemma: pad 0, eos 1, bos 2).

`default_tokenizer()` builds a small Gemma-layout vocabulary from `pydoc_data.topics` (ships
with CPython), so the offline default model and the tests need no download.
"""
from __future__ import annotations

import hashlib
import io
import os

import sentencepiece as spm

from jaxlm import storage
from jaxlm.corpus import pydoc_corpus
from jaxlm.errors import UserError

SPM_ASSET = "assets/tokenizer/vocabulary.spm"


class Tokenizer:
    def __init__(self, proto: bytes, *, add_bos: bool = True):
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(proto)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError variants
            raise UserError(f"not a sentencepiece model ({e})") from None
        self.proto = proto
        self.add_bos = add_bos
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.sp.piece_to_id("<pad>")
        self.special_ids = frozenset(i for i in (self.pad_id, self.eos_id, self.bos_id) if i >= 0)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, *, bos: bool | None = None, eos: bool = False) -> list[int]:
        """text -> ids; BOS first unless `bos=False` (default: the model's policy)."""
        ids = self.sp.encode(text)
        if self.add_bos if bos is None else bos:
            ids = [self.bos_id] + ids
        return ids + [self.eos_id] if eos else ids

    def decode(self, ids) -> str:
        """ids -> text, dropping pad/eos/bos (as KerasHub's generate_postprocess)."""
        return self.sp.decode([int(i) for i in ids if int(i) not in self.special_ids])

    def save(self, directory: str) -> None:
        """Write `vocabulary.spm` into `directory` (a jaxlm folder's tokenizer/; local or URL)."""
        storage.makedirs(directory)
        storage.write_bytes(storage.join(directory, "vocabulary.spm"), self.proto)

    def save_keras_assets(self, preset_dir: str) -> None:
        """tokenizer.json + assets/tokenizer/vocabulary.spm, as KerasHub's GemmaTokenizer saves."""
        from jaxlm.convert.keras_preset import write_tokenizer_json
        self.save(storage.join(preset_dir, "assets", "tokenizer"))
        write_tokenizer_json(preset_dir, "keras_hub.src.models.gemma.gemma_tokenizer", "GemmaTokenizer",
                             "gemma_tokenizer", proto=None, sequence_length=None, add_bos=False,
                             add_eos=False)


PYDOC_PIECES = 4096  # pydoc_data.topics supports at most ~4,660 Unigram pieces


def default_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    """A Gemma-layout (pad 0, eos 1, bos 2, unk 3) Unigram vocabulary trained on pydoc_data.topics.

    Deterministic, trained once and cached under ~/.cache/jaxlm (a few seconds on a laptop).
    The corpus cannot give more than PYDOC_PIECES pieces, so a larger `vocab_size` (a built-in
    architecture such as gemma_2b_en, 256,000, run on random weights to plan memory and speed)
    gets PYDOC_PIECES trained pieces followed by `<unusedN>` pieces up to `vocab_size`: ids
    and embedding shapes are those of the real model, and text encodes to the trained ids.
    """
    text = pydoc_corpus()
    if vocab_size < 8:
        raise UserError(f"a vocabulary of {vocab_size} pieces is too small; use at least 8")
    digest = hashlib.sha1(f"{vocab_size}:{len(text)}".encode()).hexdigest()[:10]
    cache = os.path.join(os.environ.get("JAXLM_CACHE", os.path.expanduser("~/.cache/jaxlm")),
                         f"tokenizer-{vocab_size}-{digest}.spm")
    if not os.path.exists(cache):
        proto = train_gemma_layout(text.splitlines(), min(vocab_size, PYDOC_PIECES))
        if vocab_size > PYDOC_PIECES:
            proto = pad_vocabulary(proto, vocab_size)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = cache + f".{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(proto)
        os.replace(tmp, cache)  # atomic: concurrent test workers never read half a file
    with open(cache, "rb") as f:
        return Tokenizer(f.read())


def train_gemma_layout(lines: list[str], vocab_size: int) -> bytes:
    """Train a sentencepiece model with Gemma's special ids; returns the serialized proto."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([l for l in lines if l.strip()]), model_writer=out,
        vocab_size=vocab_size, model_type="unigram", pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        byte_fallback=True, character_coverage=1.0, num_threads=1, minloglevel=2,
        shuffle_input_sentence=False)
    return out.getvalue()


def pad_vocabulary(proto: bytes, vocab_size: int) -> bytes:
    """A sentencepiece model with `<unusedN>` pieces appended up to `vocab_size` pieces; UNUSED
    pieces are never produced by encoding, so the trained pieces keep their ids."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    model = pb.ModelProto()
    model.ParseFromString(proto)
    for i in range(vocab_size - len(model.pieces)):
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = f"<unused{i}>", 0.0, pb.ModelProto.SentencePiece.UNUSED
    model.trainer_spec.vocab_size = vocab_size
    return model.SerializeToString()


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxlm.tokenizer train ...`: see jaxlm/tokenizer_train.py."""
    import sys
    from jaxlm.errors import cli
    argv = sys.argv[1:] if argv is None else argv

    @cli
    def run(argv):
        if not argv or argv[0] != "train":
            got = f"unknown command {argv[0]!r}" if argv else "no command"
            raise UserError(f"{got}; use: python -m jaxlm.tokenizer train --input FILES "
                            "--vocab_size N --out DIR")
        from jaxlm import tokenizer_train
        return tokenizer_train.main(argv[1:])
    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
