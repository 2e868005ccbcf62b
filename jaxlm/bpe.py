"""RoBERTa's byte-level BPE (`vocabulary.json` + `merges.txt`) through HF `tokenizers`.

KerasHub's `RobertaTokenizer` is GPT-2 byte-level BPE without a prefix space, with `<s>`,
`</s>`, `<pad>` and `<mask>` matched whole in raw text. `tokenizers.ByteLevel` with the GPT-2
split regex and those four as added special tokens gives the same ids (tests check live).

`encode` wraps a text as `<s> … </s>` by default, as RoBERTa expects a single segment;
`bos=False` / `eos=False` leave either out.
"""
from __future__ import annotations

import json

from jaxlm import storage
from jaxlm.errors import UserError

ASSETS = "assets/tokenizer"
SPECIALS = ("<s>", "<pad>", "</s>", "<mask>")  # KerasHub's unsplittable tokens


class BPETokenizer:
    def __init__(self, vocabulary: dict[str, int], merges: list[str], *, add_bos: bool = True,
                 add_eos: bool = True):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        missing = [t for t in SPECIALS if t not in vocabulary]
        if missing:
            raise UserError(f"the BPE vocabulary lacks special tokens {missing}; "
                            "a RoBERTa vocabulary.json needs <s>, <pad>, </s> and <mask>")
        pairs = []
        for n, line in enumerate(merges, 1):
            parts = line.split()
            if len(parts) != 2:
                raise UserError(f"merges.txt line {n} is {line!r}; each line must be two tokens")
            pairs.append((parts[0], parts[1]))
        self.vocabulary = dict(vocabulary)
        self.merges = [" ".join(p) for p in pairs]
        unk = "<unk>" if "<unk>" in vocabulary else None
        tok = Tokenizer(models.BPE(vocab=self.vocabulary, merges=pairs, unk_token=unk))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(SPECIALS))
        self.hf = tok
        self.add_bos, self.add_eos = add_bos, add_eos
        self.bos_id = vocabulary["<s>"]
        self.eos_id = vocabulary["</s>"]
        self.pad_id = vocabulary["<pad>"]
        self.mask_id = vocabulary["<mask>"]
        self.unk_id = vocabulary.get("<unk>", -1)
        self.special_ids = frozenset((self.bos_id, self.eos_id, self.pad_id, self.mask_id))

    @property
    def vocab_size(self) -> int:
        return max(self.vocabulary.values()) + 1

    def encode(self, text: str, *, bos: bool | None = None, eos: bool | None = None) -> list[int]:
        """text -> ids, `<s>` first and `</s>` last unless told otherwise."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if self.add_bos if bos is None else bos:
            ids = [self.bos_id] + ids
        if self.add_eos if eos is None else eos:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids) -> str:
        """ids -> text, dropping `<s>`, `</s>`, `<pad>` (and keeping `<mask>` visible)."""
        drop = (self.bos_id, self.eos_id, self.pad_id)
        return self.hf.decode([int(i) for i in ids if int(i) not in drop], skip_special_tokens=False)

    def save(self, directory: str) -> None:
        """vocabulary.json + merges.txt into `directory` (a jaxlm folder's tokenizer/)."""
        storage.makedirs(directory)
        storage.write_text(storage.join(directory, "vocabulary.json"),
                           json.dumps(self.vocabulary, ensure_ascii=False))
        storage.write_text(storage.join(directory, "merges.txt"), "\n".join(self.merges) + "\n")

    def save_keras_assets(self, preset_dir: str) -> None:
        """tokenizer.json + assets/tokenizer/{vocabulary.json,merges.txt}, as RobertaTokenizer saves."""
        self.save(storage.join(preset_dir, ASSETS))
        from jaxlm.convert.keras_preset import write_tokenizer_json
        write_tokenizer_json(preset_dir, "keras_hub.src.models.roberta.roberta_tokenizer",
                             "RobertaTokenizer", "roberta_tokenizer", sequence_length=None,
                             add_prefix_space=False,
                             unsplittable_tokens=["</s>", "<pad>", "<s>", "<mask>"])


def load_bpe(path: str) -> BPETokenizer | None:
    """The BPE tokenizer in `path` (itself, its assets/tokenizer/ or tokenizer/), or None."""
    for sub in ("", ASSETS, "tokenizer"):
        d = storage.join(path, sub) if sub else path
        vocab, merges = storage.join(d, "vocabulary.json"), storage.join(d, "merges.txt")
        if storage.exists(vocab) and storage.exists(merges):
            try:
                vocabulary = json.loads(storage.read_text(vocab))
            except json.JSONDecodeError as e:
                raise UserError(f"{vocab} is not valid JSON ({e})") from None
            # GPT-2's merges.txt may start with a "#version" line; blank lines carry nothing.
            lines = [l for l in storage.read_text(merges).splitlines()
                     if l.strip() and not l.startswith("#version")]
            return BPETokenizer(vocabulary, lines)
    return None
