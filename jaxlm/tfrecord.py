"""TFRecord files of `tf.train.Example` protos, written and read without TensorFlow.

A record is `u64 length | u32 masked_crc32c(length bytes) | data | u32 masked_crc32c(data)`,
little-endian. An Example is `features { feature { key: "input_ids" value { int64_list {
value: [...] } } } ... }`; its protobuf wire format is small enough to encode by hand:

    Example.features = 1 (LEN) -> Features.feature = 1 (LEN, map entry: key = 1, value = 2)
    Feature: bytes_list = 1, float_list = 2, int64_list = 3 (LEN) -> Int64List.value = 1 (packed)

Varints are encoded and decoded with numpy (a 512-token record is ~1k varints), so the
only per-byte Python work left is crc32c, which uses `google_crc32c`/`crc32c` when installed.
"""
from __future__ import annotations

import struct
from typing import BinaryIO, Iterator

import numpy as np

from jaxlm.errors import UserError


def _table() -> list[int]:
    poly, table = 0x82F63B78, []  # Castagnoli, reflected
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _table()


def _crc32c_py(data: bytes) -> int:
    crc, table = 0xFFFFFFFF, _TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


try:  # optional C implementations: same values, ~100x faster
    from google_crc32c import value as crc32c  # type: ignore
except ImportError:
    try:
        from crc32c import crc32c  # type: ignore
    except ImportError:
        crc32c = _crc32c_py


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def write_record(f: BinaryIO, data: bytes) -> None:
    header = struct.pack("<Q", len(data))
    f.write(header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data)))


def read_records(f: BinaryIO, name: str = "shard", verify: bool = True) -> Iterator[bytes]:
    """Yield each record's payload; a truncated file or a bad checksum is a UserError."""
    while True:
        header = f.read(12)
        if not header:
            return
        if len(header) < 12:
            raise UserError(f"{name} is truncated (partial record header); write it again")
        (length,), (crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
        if verify and masked_crc(header[:8]) != crc:
            raise UserError(f"{name} is not a TFRecord file or is corrupt (bad length checksum)")
        data = f.read(length)
        footer = f.read(4)
        if len(data) < length or len(footer) < 4:
            raise UserError(f"{name} is truncated (partial record); write it again")
        if verify and masked_crc(data) != struct.unpack("<I", footer)[0]:
            raise UserError(f"{name} is corrupt (bad data checksum)")
        yield data


# --- protobuf wire format -------------------------------------------------------------------

def _varints(values: np.ndarray) -> bytes:
    """Encode int64 values as protobuf varints (negatives as 10-byte two's complement)."""
    v = np.asarray(values, np.int64).astype(np.uint64)
    nbytes = np.ones(v.shape, np.int64)
    rest = v >> np.uint64(7)
    while rest.any():
        nbytes += rest > 0
        rest >>= np.uint64(7)
    out = np.zeros(int(nbytes.sum()), np.uint8)
    offsets = np.cumsum(nbytes) - nbytes
    for k in range(int(nbytes.max(initial=0))):
        sel = nbytes > k
        byte = (v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (nbytes[sel] - 1 > k).astype(np.uint64) << np.uint64(7)
        out[offsets[sel] + k] = (byte | more).astype(np.uint8)
    return out.tobytes()


def _varint(n: int) -> bytes:
    return _varints(np.asarray([n]))


def _decode_varints(buf: bytes) -> np.ndarray:
    """All varints in `buf` -> int64 array (the inverse of `_varints`)."""
    b = np.frombuffer(buf, np.uint8)
    if b.size == 0:
        return np.zeros(0, np.int64)
    ends = b < 0x80
    if not ends[-1]:
        raise ValueError("truncated varint")
    group = np.concatenate([[0], np.cumsum(ends)[:-1]])
    starts = np.flatnonzero(np.concatenate([[True], ends[:-1]]))
    shift = (np.arange(b.size) - starts[group]) * 7
    if shift.max() > 63:
        raise ValueError("varint longer than 10 bytes")
    parts = (b & 0x7F).astype(np.uint64) << shift.astype(np.uint64)
    return np.bitwise_or.reduceat(parts, starts).astype(np.int64)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_example(features: dict[str, np.ndarray]) -> bytes:
    """{name: int array} -> a serialized tf.train.Example with one Int64List per name."""
    entries = b""
    for key in sorted(features):
        int64_list = _field(1, _varints(np.ravel(features[key])))  # packed repeated int64
        feature = _field(3, int64_list)
        entries += _field(1, _field(1, key.encode()) + _field(2, feature))
    return _field(1, entries)


def _fields(buf: bytes) -> Iterator[tuple[int, int, bytes | int]]:
    """(field number, wire type, payload) for each field of a message."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 2:
            length, i = _read_varint(buf, i)
            if i + length > n:
                raise ValueError("truncated field")
            yield number, wire, buf[i:i + length]
            i += length
        elif wire == 0:
            value, i = _read_varint(buf, i)
            yield number, wire, value
        elif wire == 5:
            yield number, wire, buf[i:i + 4]
            i += 4
        elif wire == 1:
            yield number, wire, buf[i:i + 8]
            i += 8
        else:
            raise ValueError(f"unsupported wire type {wire}")


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def decode_example(data: bytes) -> dict[str, np.ndarray]:
    """A serialized tf.train.Example -> {name: values}: int64 arrays, float32 arrays, or lists of bytes."""
    out: dict[str, np.ndarray] = {}
    try:
        for num, _, features in _fields(data):
            if num != 1:
                continue
            for fnum, _, entry in _fields(features):
                if fnum != 1:
                    continue
                key, value = "", b""
                for enum, _, payload in _fields(entry):
                    if enum == 1:
                        key = payload.decode()
                    elif enum == 2:
                        value = payload
                out[key] = _decode_feature(value)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"a record is not a tf.train.Example ({e})") from None
    return out


def _decode_feature(buf: bytes):
    for kind, _, lst in _fields(buf):
        if kind == 3:  # Int64List: packed (one LEN field) or not (one VARINT per value)
            chunks = []
            for _, wire, payload in _fields(lst):
                chunks.append(_decode_varints(payload) if wire == 2
                              else np.asarray([payload], np.uint64).astype(np.int64))
            return np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        if kind == 2:  # FloatList
            chunks = [np.frombuffer(p if w == 2 else p, "<f4") for _, w, p in _fields(lst)]
            return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        if kind == 1:  # BytesList
            return [p for _, _, p in _fields(lst)]
    return np.zeros(0, np.int64)
