"""A lean GGUF reader: the metadata as plain Python values, the tensors as views of a memmap.

    f = read("gemma-3-270m-q4_k_m.gguf")
    f.fields["general.architecture"]        # 'gemma3'
    f.fields["tokenizer.ggml.tokens"]       # list of 262,144 str
    t = f.tensors[0]                        # Tensor(name, tensor_type, data): data is raw
    gguf.quants.dequantize(t.data, t.tensor_type)   # llama.cpp's own dequantiser

llama.cpp's `gguf.GGUFReader` builds a numpy view for every part of every metadata value: on
Gemma's 262k-entry vocabulary (tokens, scores, types) that is ~5M memmap views, 7.4 s and
~0.5 GB of Python objects per open, and a run opens the file for its config, its tokenizer and
its tensors. This reader decodes the same layout (GGUF v2/v3, either byte order) with struct and
`np.frombuffer`: numeric arrays come back as one numpy array, string arrays as one list.
`data` has the shapes and dtypes GGUFReader gives, so `gguf.quants.dequantize` takes it as is:
F32/F16 and the integer types typed with the numpy shape (the reverse of GGUF's `ne`);
block formats (and BF16) as uint8 rows of bytes. Malformed or truncated files raise ValueError.
"""
from __future__ import annotations

import dataclasses
import functools
import struct

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct codes (8: string, 9: array are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml types that GGUFReader (and so `dequantize`) gives typed rather than as bytes.
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: object   # gguf.GGMLQuantizationType
    shape: tuple          # numpy order: the reverse of GGUF's ne
    data: np.ndarray      # a view of the file: typed [shape] or uint8 [rows, bytes per row]


@dataclasses.dataclass(frozen=True)
class File:
    version: int
    fields: dict          # key -> str | int | float | bool | list | numpy array
    tensors: list         # [Tensor] in file order


class _Cursor:
    """Reads the header from a memoryview of the file: a slice of the memmap itself is a new
    numpy view, and the 262k strings of Gemma's vocabulary took ~0.6 s a read that way, against
    ~0.12 s now (ad hoc); train.py reads the file five times (its config thrice, its tokenizer,
    its tensors)."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = memoryview(buf), order, 0
        self._length = struct.Struct(f"{order}Q")

    def take(self, code: str, count: int = 1):
        fmt = _struct(f"{self.order}{count}{code}")
        out = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return out if count != 1 else out[0]

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, n: int) -> list:
        buf, unpack, pos, end, out = self.buf, self._length.unpack_from, self.pos, len(self.buf), []
        for _ in range(n):
            (size,), pos = unpack(buf, pos), pos + 8
            if pos + size > end:
                raise ValueError("a string runs past the end of the file")
            out.append(str(buf[pos:pos + size], "utf-8", "replace"))
            pos += size
        self.pos = pos
        return out

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            sub, n = self.take("I"), self.take("Q")
            if sub == _STRING:
                return self.strings(n)
            if sub == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            code = _SCALARS[sub]
            dtype = np.dtype(code).newbyteorder(self.order)
            size = dtype.itemsize * n
            if self.pos + size > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            arr = np.frombuffer(self.buf, dtype, n, self.pos).astype(dtype.newbyteorder("="))
            self.pos += size
            return arr
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


@functools.lru_cache(maxsize=64)
def _struct(fmt: str) -> struct.Struct:
    return struct.Struct(fmt)


def read(path: str) -> File:
    """Parse `path`'s header, metadata and tensor table; tensor data stays on disk (memmap)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    buf = np.memmap(path, mode="r")
    if bytes(buf[:4]) != MAGIC:
        raise ValueError("GGUF magic invalid")
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
    cur = _Cursor(buf, order)
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_fields = cur.take("Q"), cur.take("Q")
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.take("Q", cur.take("I"))
        dims = dims if isinstance(dims, tuple) else (dims,)
        infos.append((name, dims, GGMLQuantizationType(cur.take("I")), cur.take("Q")))
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"invalid alignment {align}")
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, kind, offset in infos:
        shape = tuple(int(d) for d in reversed(dims))
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(shape, dtype=np.int64)) * size // block
        begin = start + offset
        if begin + n_bytes > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        raw = buf[begin:begin + n_bytes]
        if kind.name in _TYPED:
            data = raw.view(np.dtype(_TYPED[kind.name]).newbyteorder(order)).reshape(shape)
        else:  # bytes, [..., blocks per row * block bytes] (BF16 too, as GGUFReader gives it)
            data = raw.reshape(*shape[:-1], shape[-1] // block * size)
        tensors.append(Tensor(name, kind, shape, data))
    return File(version, fields, tensors)
