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

from collections.abc import Iterator
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


_Field = tuple[int, int, int | None, int, int]  # number, field start, varint value or None, value start, field end


def _walk(buf: memoryview, start: int, end: int, where: str = "message") -> Iterator[_Field]:
    """Each field of the message at ``buf[start:end]``, in order: ``(number, field start, value, value start, field
    end)``, ``value`` the integer of a varint field and None for a length-delimited one (``buf[value start:field
    end]``). Malformed bytes raise ``WireError`` naming ``where``."""
    pos = start
    while pos < end:
        field_start = pos
        tag, pos = _read_varint(buf, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
            if pos > end:
                raise WireError(f"a varint runs past its {where}")
            yield number, field_start, value, pos, pos
        elif wire_type == _LEN:
            length, value_start = _read_varint(buf, pos)
            pos = value_start + length
            if pos > end:
                raise WireError(f"length-delimited field runs past its {where}")
            yield number, field_start, None, value_start, pos
        else:
            raise WireError(f"unexpected wire type {wire_type} for {where} field {number}")


def _fields(buf: memoryview) -> list[tuple[int, int | memoryview]]:
    """``(field number, value)`` pairs: an int for varints, a view for length-delimited fields."""
    return [(number, buf[value_start:end] if value is None else value)
            for number, _, value, value_start, end in _walk(buf, 0, len(buf))]


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
    chunk: tuple[int, int, int] | None = None  # (field start, value start, field end) of the chunk field
    for number, field_start, value, value_start, end in _walk(buf, 0, len(buf)):
        if number == _PUT_CHUNK and value is None:
            if chunk is not None:
                raise WireError("PutBlocksRequest carries its chunk field twice")
            chunk = (field_start, value_start, end)
    data = memoryview(b"")
    rest: bytes | memoryview = buf
    if chunk is not None:
        chunk_start, chunk_value_start, chunk_end = chunk
        data_fields = [(field_start, value_start, end)
                       for number, field_start, value, value_start, end in
                       _walk(buf, chunk_value_start, chunk_end, "chunk") if number == _CHUNK_DATA and value is None]
        if len(data_fields) > 1:  # protobuf would keep the last; we keep nothing ambiguous
            raise WireError("a chunk carries its data field twice")
        if data_fields:
            data_start, value_start, data_end = data_fields[0]
            data = buf[value_start:data_end]
            chunk_len = chunk_end - chunk_value_start - (data_end - data_start)
            rest = b"".join([buf[:chunk_start], _field(_PUT_CHUNK, _LEN), varint(chunk_len),
                             buf[chunk_value_start:data_start], buf[data_end:]])
    message = pb.PutBlocksRequest()
    try:
        message.ParseFromString(bytes(rest))
    except (DecodeError, RuntimeWarning) as exc:
        raise WireError(str(exc)) from None
    return message, data
