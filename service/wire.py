"""Hand-rolled protobuf wire format of ``GetBlocksResponse``, the one message that carries bulk data.

The generated classes copy a chunk's bytes three times on each side (slice, message field, serialisation);
these functions build and read exactly the bytes protobuf would (same field numbers, proto3 defaults
omitted; a test checks them against the generated classes) with one copy, and read into zero-copy views.
Any other client may still use the generated classes: the bytes on the wire are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshelf.service.errors import WireError

_VARINT, _LEN = 0, 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _field(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def encode_chunk_response(index: int, data: bytes | memoryview, *, key: bytes = b"", last: bool = False,
                          total_size: int = 0) -> bytes:
    """``GetBlocksResponse(index, chunk=Chunk(key, data, last, total_size))`` serialised (one copy of ``data``)."""
    head = bytearray()
    if key:
        head += _field(1, _LEN) + _varint(len(key)) + key
    data_head = _field(2, _LEN) + _varint(len(data)) if len(data) else b""
    tail = bytearray()
    if last:
        tail += _field(3, _VARINT) + b"\x01"
    if total_size:
        tail += _field(4, _VARINT) + _varint(total_size)
    chunk_len = len(head) + len(data_head) + len(data) + len(tail)
    prefix = (_field(1, _VARINT) + _varint(index) if index else b"") + _field(2, _LEN) + _varint(chunk_len)
    return b"".join([prefix, head, data_head, data if len(data) else b"", tail])


def encode_arena_response(index: int, key: bytes, offset: int, size: int) -> bytes:
    """``GetBlocksResponse(index, chunk=Chunk(key, last, total_size=size, in_arena, arena_offset=offset))``."""
    body = bytearray()
    if key:
        body += _field(1, _LEN) + _varint(len(key)) + key
    body += _field(3, _VARINT) + b"\x01"
    if size:
        body += _field(4, _VARINT) + _varint(size)
    body += _field(5, _VARINT) + b"\x01"
    if offset:
        body += _field(6, _VARINT) + _varint(offset)
    prefix = (_field(1, _VARINT) + _varint(index) if index else b"") + _field(2, _LEN) + _varint(len(body))
    return prefix + bytes(body)


def encode_miss_response(index: int) -> bytes:
    """``GetBlocksResponse(index, miss=True)`` serialised."""
    return (_field(1, _VARINT) + _varint(index) if index else b"") + _field(3, _VARINT) + b"\x01"


@dataclass(frozen=True)
class ChunkResponse:
    index: int
    miss: bool
    key: bytes = b""
    data: memoryview = memoryview(b"")
    last: bool = False
    total_size: int = 0
    in_arena: bool = False
    arena_offset: int = 0


def _fields(buf: memoryview) -> list[tuple[int, int | memoryview]]:
    """``(field number, value)`` pairs: an int for varints, a view for length-delimited fields."""
    out: list[tuple[int, int | memoryview]] = []
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
            out.append((number, value))
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise WireError("length-delimited field runs past the message")
            out.append((number, buf[pos : pos + length]))
            pos += length
        else:
            raise WireError(f"unexpected wire type {wire_type} for field {number}")
    return out


def decode_response(raw: bytes) -> ChunkResponse:
    """Parse a serialised ``GetBlocksResponse``; ``data`` is a view of ``raw`` (no copy)."""
    index, miss, chunk = 0, False, None
    for number, value in _fields(memoryview(raw)):
        if number == 1 and isinstance(value, int):
            index = value
        elif number == 2 and isinstance(value, memoryview):
            chunk = value
        elif number == 3 and isinstance(value, int):
            miss = bool(value)
    if chunk is None:
        return ChunkResponse(index=index, miss=miss)
    key, data, last, total, in_arena, arena_offset = b"", memoryview(b""), False, 0, False, 0
    for number, value in _fields(chunk):
        if number == 1 and isinstance(value, memoryview):
            key = bytes(value)
        elif number == 2 and isinstance(value, memoryview):
            data = value
        elif number == 3 and isinstance(value, int):
            last = bool(value)
        elif number == 4 and isinstance(value, int):
            total = value
        elif number == 5 and isinstance(value, int):
            in_arena = bool(value)
        elif number == 6 and isinstance(value, int):
            arena_offset = value
    return ChunkResponse(index=index, miss=False, key=key, data=data, last=last, total_size=total,
                         in_arena=in_arena, arena_offset=arena_offset)
