"""Hand-rolled protobuf wire format of the two messages that carry bulk data, ``GetBlocksResponse`` and
``PutBlocksRequest``.

The generated classes copy a chunk's bytes three times on each side (slice, message field, serialisation);
these functions build and read exactly the bytes protobuf would (same field numbers, proto3 defaults
omitted; a test checks them against the generated classes) with one copy, and read into zero-copy views.
A ``PutBlocksRequest`` is read by cutting its ``chunk.data`` out as a view and parsing the small rest with the
generated class, so every other field (present or added later) keeps its protobuf meaning.
Any other client may still use the generated classes: the bytes on the wire are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.errors import WireError

_VARINT, _LEN = 0, 2
_PUT_CHUNK, _CHUNK_DATA = 3, 2  # PutBlocksRequest.chunk, Chunk.data


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf base-128 varint."""
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
    return varint(number << 3 | wire_type)


def encode_chunk_response(index: int, data: bytes | memoryview, *, key: bytes = b"", last: bool = False,
                          total_size: int = 0) -> bytes:
    """``GetBlocksResponse(index, chunk=Chunk(key, data, last, total_size))`` serialised (one copy of ``data``)."""
    head = bytearray()
    if key:
        head += _field(1, _LEN) + varint(len(key)) + key
    data_head = _field(2, _LEN) + varint(len(data)) if len(data) else b""
    tail = bytearray()
    if last:
        tail += _field(3, _VARINT) + b"\x01"
    if total_size:
        tail += _field(4, _VARINT) + varint(total_size)
    chunk_len = len(head) + len(data_head) + len(data) + len(tail)
    prefix = (_field(1, _VARINT) + varint(index) if index else b"") + _field(2, _LEN) + varint(chunk_len)
    return b"".join([prefix, head, data_head, data if len(data) else b"", tail])


def encode_arena_response(index: int, key: bytes, offset: int, size: int) -> bytes:
    """``GetBlocksResponse(index, chunk=Chunk(key, last, total_size=size, in_arena, arena_offset=offset))``."""
    body = bytearray()
    if key:
        body += _field(1, _LEN) + varint(len(key)) + key
    body += _field(3, _VARINT) + b"\x01"
    if size:
        body += _field(4, _VARINT) + varint(size)
    body += _field(5, _VARINT) + b"\x01"
    if offset:
        body += _field(6, _VARINT) + varint(offset)
    prefix = (_field(1, _VARINT) + varint(index) if index else b"") + _field(2, _LEN) + varint(len(body))
    return prefix + bytes(body)


def encode_miss_response(index: int) -> bytes:
    """``GetBlocksResponse(index, miss=True)`` serialised."""
    return (_field(1, _VARINT) + varint(index) if index else b"") + _field(3, _VARINT) + b"\x01"


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


def encode_put_request(data: bytes | memoryview, meta: pb.Chunk, head: pb.PutBlocksRequest | None = None) -> bytes:
    """``PutBlocksRequest`` ``head`` (namespace, pin; no chunk) with ``chunk`` = ``meta`` (every field but the data)
    plus ``data``, serialised with one copy of ``data``: the generated classes serialise the small parts, the data
    field is appended by hand (protobuf parsers take fields in any order)."""
    if meta.data:
        raise WireError("encode_put_request takes the chunk's data apart from its metadata")
    chunk_head = meta.SerializeToString()
    data_head = _field(_CHUNK_DATA, _LEN) + varint(len(data)) if len(data) else b""
    chunk_len = len(chunk_head) + len(data_head) + len(data)
    outer = (head.SerializeToString() if head is not None else b"") + _field(_PUT_CHUNK, _LEN) + varint(chunk_len)
    return b"".join([outer, chunk_head, data_head, data if len(data) else b""])


def decode_put_request(raw: bytes) -> tuple[pb.PutBlocksRequest, memoryview]:
    """Parse a serialised ``PutBlocksRequest``: the message without its chunk's data, and that data as a view of
    ``raw`` (no copy). Malformed bytes raise ``WireError``."""
    buf = memoryview(raw)
    cut: tuple[int, int] | None = None  # [start, end) of the chunk.data field (tag, length and bytes) in raw
    chunk_at: tuple[int, int] | None = None  # where the chunk field's length varint starts and the chunk ends
    pos = 0
    while pos < len(buf):
        tag, after_tag = _read_varint(buf, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            _, pos = _read_varint(buf, after_tag)
        elif wire_type == _LEN:
            length, start = _read_varint(buf, after_tag)
            if start + length > len(buf):
                raise WireError("length-delimited field runs past the message")
            if number == _PUT_CHUNK:
                if chunk_at is not None:
                    raise WireError("PutBlocksRequest carries its chunk field twice")
                chunk_at = (after_tag, start + length)
                cut = _data_field(buf, start, start + length)
            pos = start + length
        else:
            raise WireError(f"unexpected wire type {wire_type} for field {number}")
    data = memoryview(b"")
    rest: bytes | memoryview = buf
    if cut is not None and chunk_at is not None:
        data_start, data_end, value_start = cut
        data = buf[value_start:data_end]
        length_at, chunk_end = chunk_at
        _, chunk_start = _read_varint(buf, length_at)
        chunk_len = chunk_end - chunk_start - (data_end - data_start)
        rest = b"".join([buf[:length_at], varint(chunk_len), buf[chunk_start:data_start], buf[data_end:]])
    message = pb.PutBlocksRequest()
    try:
        message.ParseFromString(bytes(rest))
    except (DecodeError, RuntimeWarning) as exc:
        raise WireError(str(exc)) from None
    return message, data


def _data_field(buf: memoryview, start: int, end: int) -> tuple[int, int, int] | None:
    """In the ``Chunk`` at ``buf[start:end]``: ``(field start, field end, value start)`` of its ``data`` field
    (None without one). Data given twice is refused (protobuf would keep the last; we keep nothing ambiguous)."""
    found: tuple[int, int, int] | None = None
    pos = start
    while pos < end:
        field_start = pos
        tag, pos = _read_varint(buf, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            _, pos = _read_varint(buf, pos)
        elif wire_type == _LEN:
            length, value_start = _read_varint(buf, pos)
            pos = value_start + length
            if pos > end:
                raise WireError("length-delimited field runs past its chunk")
            if number == _CHUNK_DATA:
                if found is not None:
                    raise WireError("a chunk carries its data field twice")
                found = (field_start, pos, value_start)
        else:
            raise WireError(f"unexpected wire type {wire_type} for chunk field {number}")
        if pos > end:
            raise WireError("a varint runs past its chunk")
    return found
