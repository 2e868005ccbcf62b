"""Tokenizer files of Hugging Face folders, both ways, encoding exactly as jaxlm's tokenizers.

    Gemma (sentencepiece)   tokenizer.model + tokenizer_config.json (GemmaTokenizer); a
                            non-Gemma-style model (Unigram) also gets an equivalent tokenizer.json
    RoBERTa (byte-level BPE) vocab.json + merges.txt + tokenizer_config.json (RobertaTokenizer)

Reading also takes the lone tokenizer.json that transformers 5 saves for either.
"""
from __future__ import annotations

import json
import re

from jaxlm import storage
from jaxlm.bpe import BPETokenizer
from jaxlm.errors import UserError
from jaxlm.tokenizer import Tokenizer

SPM_FILE = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"


def write_tokenizer(out_dir: str, tokenizer) -> list[str]:
    """The files `AutoTokenizer.from_pretrained(out_dir)` needs to encode as `tokenizer` does."""
    storage.makedirs(out_dir)
    if isinstance(tokenizer, Tokenizer):
        sp = tokenizer.sp
        storage.write_bytes(storage.join(out_dir, SPM_FILE), tokenizer.proto)
        files = [SPM_FILE]
        tok_config = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": tokenizer.add_bos,
                      "add_eos_token": False, "bos_token": sp.id_to_piece(tokenizer.bos_id),
                      "eos_token": sp.id_to_piece(tokenizer.eos_id),
                      "pad_token": sp.id_to_piece(tokenizer.pad_id), "unk_token": sp.id_to_piece(sp.unk_id()),
                      "padding_side": "left"}
        converted = _tokenizer_json(tokenizer)
        if converted is not None:  # not Gemma's own kind of vocabulary: transformers runs the JSON
            storage.write_text(storage.join(out_dir, "tokenizer.json"), converted)
            files.append("tokenizer.json")
            tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    else:  # RoBERTa's byte-level BPE (jaxlm.bpe.BPETokenizer)
        storage.write_text(storage.join(out_dir, "vocab.json"),
                           json.dumps(tokenizer.vocabulary, ensure_ascii=False))
        storage.write_text(storage.join(out_dir, "merges.txt"),
                           "#version: 0.2\n" + "\n".join(tokenizer.merges) + "\n")
        specials = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>",
                    "pad_token": "<pad>", "mask_token": "<mask>"}
        if tokenizer.unk_id >= 0:
            specials["unk_token"] = "<unk>"
        tok_config = {"tokenizer_class": "RobertaTokenizer", "add_prefix_space": False, **specials}
        files = ["vocab.json", "merges.txt"]
    storage.write_text(storage.join(out_dir, TOKENIZER_CONFIG), json.dumps(tok_config, indent=2))
    return files + [TOKENIZER_CONFIG]


def _tokenizer_json(tokenizer) -> str | None:
    """None for a Gemma-style sentencepiece model (BPE, no normalization, no dummy prefix), which
    transformers' GemmaTokenizer rebuilds from tokenizer.model exactly. Otherwise (a Unigram
    model such as `python -m jaxlm.tokenizer train` writes) the equivalent `tokenizers`
    pipeline as tokenizer.json: the model's own normalization table, whitespace handling,
    Unigram scores and byte fallback. Its Viterbi can break exact score ties differently from
    sentencepiece (seen on long runs of one character, e.g. ASCII-art rules).
    """
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
    m = pb.ModelProto()
    m.ParseFromString(tokenizer.proto)
    ns, ts = m.normalizer_spec, m.trainer_spec
    if (ts.model_type == pb.TrainerSpec.BPE and ns.name == "identity" and not ns.add_dummy_prefix
            and not ns.remove_extra_whitespaces):
        return None
    if ts.model_type != pb.TrainerSpec.UNIGRAM:
        raise UserError("only Gemma-style BPE and Unigram sentencepiece models can be exported "
                        "for transformers")
    tok = HFTokenizer(models.Unigram([(p.piece, p.score) for p in m.pieces], unk_id=ts.unk_id,
                                     byte_fallback=ts.byte_fallback))
    steps = [normalizers.Precompiled(ns.precompiled_charsmap)] if ns.precompiled_charsmap else []
    if ns.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    tok.normalizer = normalizers.Sequence(steps)
    prepend = "always" if ns.add_dummy_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend,
                                                 split=ts.split_by_whitespace)
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="\u2581", prepend_scheme=prepend),
                                     decoders.ByteFallback(), decoders.Fuse()])
    piece = pb.ModelProto.SentencePiece
    tok.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                            for p in m.pieces if p.type == piece.CONTROL])
    tok.add_tokens([AddedToken(p.piece, normalized=False) for p in m.pieces if p.type == piece.USER_DEFINED])
    if tokenizer.add_bos:
        bos = tokenizer.sp.id_to_piece(tokenizer.bos_id)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_id)])
    return tok.to_str()


def read_tokenizer(folder: str):
    """The tokenizer of an HF folder, or None when it has none: tokenizer.model (Gemma's
    sentencepiece), vocab.json + merges.txt (RoBERTa), or only a tokenizer.json (what
    transformers 5 saves for either)."""
    if storage.exists(storage.join(folder, SPM_FILE)):
        return Tokenizer(storage.read_bytes(storage.join(folder, SPM_FILE)))
    vocab, merges = storage.join(folder, "vocab.json"), storage.join(folder, "merges.txt")
    if storage.exists(vocab) and storage.exists(merges):
        try:
            vocabulary = json.loads(storage.read_text(vocab))
        except json.JSONDecodeError as e:
            raise UserError(f"{vocab} is not valid JSON ({e})") from None
        lines = [l for l in storage.read_text(merges).splitlines() if l.strip() and not l.startswith("#version")]
        return BPETokenizer(vocabulary, lines)
    path = storage.join(folder, "tokenizer.json")
    if storage.exists(path):
        try:
            spec = json.loads(storage.read_text(path))
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON ({e})") from None
        model = spec.get("model") if isinstance(spec, dict) else None
        if not isinstance(model, dict):
            return None  # e.g. a Keras preset's tokenizer.json (a KerasHub class config)
        if model.get("type") != "BPE" or not model.get("vocab"):
            raise UserError(f"{path} holds a {model.get('type')} tokenizer; jaxlm reads Gemma's "
                            "sentencepiece BPE or RoBERTa's byte-level BPE")
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        if "ByteLevel" in json.dumps(spec.get("pre_tokenizer")):
            return BPETokenizer(model["vocab"], merges)
        return Tokenizer(_spm_from_tokenizer_json(spec, merges, path))
    return None


def _spm_from_tokenizer_json(spec: dict, merges: list[str], path: str) -> bytes:
    """Gemma's sentencepiece model from the tokenizer.json transformers 5 saves in its place.

    sentencepiece's BPE merges the adjacent pair whose merged piece scores highest; a
    tokenizer.json lists the merges in priority order. Scoring each piece by minus the rank of
    its first merge gives sentencepiece the same order (checked against the original model).
    """
    from sentencepiece import sentencepiece_model_pb2 as pb
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    if spec.get("normalizer") != replace:
        raise UserError(f"{path}: only Gemma's sentencepiece-style BPE (spaces as \u2581, no other "
                        "normalization) can be rebuilt; add the tokenizer.model next to it")
    model = spec["model"]
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    ids = {**model["vocab"], **{c: t["id"] for c, t in added.items()}}
    if sorted(ids.values()) != list(range(len(ids))):
        raise UserError(f"{path}: token ids are not 0..{len(ids) - 1}; the file is damaged")
    rank = {}
    for i, merge in enumerate(merges):
        rank.setdefault(merge.replace(" ", "", 1), i)
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(ids)
    m.trainer_spec.byte_fallback = bool(model.get("byte_fallback"))
    kind = pb.ModelProto.SentencePiece
    for piece, _ in sorted(ids.items(), key=lambda kv: kv[1]):
        p = m.pieces.add()
        p.piece = piece
        if piece == model.get("unk_token"):
            p.type = kind.UNKNOWN
        elif piece in added:
            p.type = kind.CONTROL if added[piece].get("special") else kind.USER_DEFINED
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
            p.type = kind.BYTE
        else:
            p.type, p.score = kind.NORMAL, -float(rank.get(piece, len(merges)))
    for field, piece in (("unk", "<unk>"), ("bos", "<bos>"), ("eos", "<eos>"), ("pad", "<pad>")):
        setattr(m.trainer_spec, f"{field}_id", ids.get(piece, -1))
        setattr(m.trainer_spec, f"{field}_piece", piece)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    return m.SerializeToString()
