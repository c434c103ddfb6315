"""Hand-rolled protobuf wire format of the two messages that carry bulk data, ``GetBlocksResponse`` and
``PutBlocksRequest``.

The generated classes copy a chunk's bytes three times on each side (slice, message field, serialisation);
these functions build and read exactly the bytes protobuf would (same field numbers, proto3 defaults
omitted; a test checks them against the generated classes) with one copy, and read into zero-copy views.
A ``PutBlocksRequest`` is read by cutting its ``chunk.data`` out as a view and parsing the small rest with the
generated class, so every other field (present or added later) keeps its protobuf meaning.
Any other client may still use the generated classes: the bytes on the wire are the same.

The readers take every encoding protobuf's own parser takes, and read it the same way: unknown fields of every wire
type (groups nested up to protobuf's depth limit, skipped without recursion), fields in any order, a message field
in several occurrences (merged), a field repeated (the last value kept); what protobuf refuses raises ``WireError``
(``tests/service/test_wire_protobuf.py`` checks this against the generated classes; ``tests/support/fuzz_wire.py``
is a fuzz target). The walk over the fields runs in Python, 0.15 to 0.7 us per field skipped (1 MiB of the
cheapest padding: 80 to 300 ms): the cost of a message padded with small fields grows with ``decode_put_request``'s
``max_rest_bytes``, where the walk stops.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from google.protobuf.message import DecodeError

from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.errors import WireError, WireLimitError

_VARINT, _FIXED64, _LEN, _START_GROUP, _END_GROUP, _FIXED32 = range(6)  # protobuf's wire types (6, 7: invalid)
_PUT_CHUNK, _CHUNK_DATA = 3, 2  # PutBlocksRequest.chunk, Chunk.data
_MAX_DEPTH = 100  # protobuf's recursion limit: messages and groups nested at most this deep below the top message
_MASK32, _MASK64 = (1 << 32) - 1, (1 << 64) - 1
# the fields decode_put_request looks at; the same number under another wire type is an unknown field to protobuf
_CHUNK_FIELD, _DATA_FIELD = frozenset({(_PUT_CHUNK, _LEN)}), frozenset({(_CHUNK_DATA, _LEN)})


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


class _Field(NamedTuple):
    """One field of a message as ``_walk`` finds it: ``buf[start:end]`` is the whole field (tag included),
    ``buf[value_start:end]`` its value; ``value`` is the integer of a varint (64 bits, as protobuf reads it) and
    None for every other wire type."""

    number: int
    wire_type: int
    start: int
    value: int | None
    value_start: int
    end: int


@dataclass
class _Budget:
    """The bytes of a ``PutBlocksRequest`` besides its kept data, counted while it is walked: past ``limit`` the walk
    stops with ``WireLimitError``. ``kept`` is the payload size of the last data field seen so far (the one
    protobuf keeps if no later one comes), so ``position - kept`` never exceeds the final count."""

    limit: int | None
    kept: int = 0

    def stop(self, end: int) -> int:
        """The position past which the walk is over the limit (``end`` when there is none: never passed)."""
        return end if self.limit is None else self.limit + self.kept

    def refuse(self, pos: int) -> WireLimitError:
        """The error for a walk that reached ``pos`` past ``stop``."""
        return WireLimitError(pos - self.kept, self.limit or 0, exact=False)


def _read_varint(buf: memoryview, pos: int, end: int, max_bytes: int = 10, what: str = "varint") -> tuple[int, int]:
    """The varint at ``buf[pos:end]`` and the position after it. Like protobuf: at most ``max_bytes`` bytes (10 for
    values, 5 for tags and lengths), the value cut to 64 bits."""
    result, shift, limit = 0, 0, min(end, pos + max_bytes)
    start = pos
    while pos < limit:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, pos
        shift += 7
    if limit == end and pos - start < max_bytes:
        raise WireError(f"truncated {what} at byte {start}")
    raise WireError(f"{what} at byte {start} is longer than {max_bytes} bytes")


def _read_tag(buf: memoryview, pos: int, end: int, where: str, in_group: bool = False) -> tuple[int, int, int]:
    """``(field number, wire type, position after the tag)`` of the tag at ``buf[pos:end]``; tags protobuf refuses
    (over 5 bytes or 32 bits, field number 0, wire type 6 or 7) raise ``WireError``. Like protobuf (upb), field
    number 0 passes ``in_group`` (inside an unknown group, whose content it skips with fewer checks)."""
    tag = buf[pos]
    if 8 <= tag < 0x80 and tag & 7 <= _FIXED32:  # the common case: one byte, fields 1 to 15
        return tag >> 3, tag & 7, pos + 1
    tag, after = _read_varint(buf, pos, end, 5, f"tag in {where}")
    number, wire_type = tag >> 3, tag & 7
    if tag > _MASK32:
        raise WireError(f"tag at byte {pos} of {where} exceeds 32 bits")
    if number == 0 and not in_group:
        raise WireError(f"field number 0 at byte {pos} of {where}")
    if wire_type > _FIXED32:
        raise WireError(f"invalid wire type {wire_type} at byte {pos} of {where} (field {number})")
    return number, wire_type, after


def _skip_value(buf: memoryview, pos: int, end: int, wire_type: int, where: str) -> tuple[int | None, int, int]:
    """``(varint value or None, value start, value end)`` of a value of ``wire_type`` (not a group) whose tag ends at
    ``pos``; a length-delimited value starts after its length."""
    if wire_type == _VARINT:
        if pos < end and buf[pos] < 0x80:  # the common case: one byte
            return buf[pos], pos, pos + 1
        value, after = _read_varint(buf, pos, end, 10, f"varint in {where}")
        return value, pos, after
    if wire_type == _LEN:
        if pos < end and buf[pos] < 0x80:
            size, pos = buf[pos], pos + 1
        else:
            size, pos = _read_varint(buf, pos, end, 5, f"length in {where}")
    elif wire_type == _FIXED64:
        size = 8
    elif wire_type == _FIXED32:
        size = 4
    else:
        raise WireError(f"end of a group that was not started, at byte {pos} of {where}")
    if size > end - pos:
        raise WireError(f"field at byte {pos} runs past the end of its {where}")
    return None, pos, pos + size


def _skip_group(buf: memoryview, pos: int, end: int, number: int, depth: int, where: str,
                budget: _Budget | None) -> int:
    """The position after the group of field ``number`` whose content starts at ``pos`` (its start tag read), nested
    groups included, without recursion. ``depth``: how many messages and groups enclose the group's start tag; like
    protobuf, more than ``_MAX_DEPTH`` in all is refused."""
    open_groups = [number]
    if depth + 1 > _MAX_DEPTH:
        raise WireError(f"groups in {where} nest deeper than {_MAX_DEPTH}")
    stop = end if budget is None else budget.stop(end)
    while open_groups:
        if pos > stop and budget is not None:
            raise budget.refuse(pos)
        if pos >= end:
            raise WireError(f"group of field {open_groups[-1]} in {where} has no end")
        tag_at = pos
        inner, wire_type, pos = _read_tag(buf, pos, end, where, in_group=True)
        if wire_type == _END_GROUP:
            if inner != open_groups[-1]:
                raise WireError(f"end of group {inner} at byte {tag_at} of {where} closes group {open_groups[-1]}")
            open_groups.pop()
        elif wire_type == _START_GROUP:
            open_groups.append(inner)
            if depth + len(open_groups) > _MAX_DEPTH:
                raise WireError(f"groups in {where} nest deeper than {_MAX_DEPTH}")
        else:
            pos = _skip_value(buf, pos, end, wire_type, where)[2]
    return pos


def _walk(buf: memoryview, start: int, end: int, where: str = "message", depth: int = 0,
          budget: _Budget | None = None, select: frozenset[tuple[int, int]] | None = None) -> Iterator[_Field]:
    """The fields of the message at ``buf[start:end]``, in order: every one, or those whose ``(number, wire type)``
    is in ``select`` (the others are checked and skipped at less cost). Every wire type is read, a group as one
    field (its content checked and skipped). ``depth``: how many messages enclose this one (0: the top). Malformed
    bytes raise ``WireError`` naming ``where``; past ``budget``'s limit, ``WireLimitError``."""
    pos = start
    stop = end if budget is None else budget.stop(end)
    while pos < end:
        if pos > stop and budget is not None:
            raise budget.refuse(pos)
        field_start = pos
        tag = buf[pos]
        if 8 <= tag < 0x80 and tag & 7 == _VARINT and pos + 1 < end and buf[pos + 1] < 0x80:
            pos += 2  # the common case, inline: a one-byte tag and a one-byte varint (padding's cheapest field too)
            if select is None or (tag >> 3, _VARINT) in select:
                yield _Field(tag >> 3, _VARINT, field_start, buf[pos - 1], pos - 1, pos)
                stop = end if budget is None else budget.stop(end)
            continue
        number, wire_type, pos = _read_tag(buf, pos, end, where)
        if wire_type == _START_GROUP:
            value, value_start, pos = None, pos, _skip_group(buf, pos, end, number, depth, where, budget)
        else:
            value, value_start, pos = _skip_value(buf, pos, end, wire_type, where)
        if select is None or (number, wire_type) in select:
            yield _Field(number, wire_type, field_start, value, value_start, pos)
            stop = end if budget is None else budget.stop(end)  # the caller may have counted a data field


def _response_item(buf: memoryview) -> tuple[int, bool, list[_Field]]:
    """``(index, miss, chunk occurrences)`` of a ``GetBlocksResponse`` as protobuf reads them: ``index`` cut to 32
    bits; the ``item`` oneof is its last member: a ``miss`` drops the chunk occurrences before it (``miss`` counts
    only when no chunk follows it), consecutive chunk occurrences merge. A field under a foreign wire type is
    unknown."""
    index, miss, chunks = 0, False, []
    for field in _walk(buf, 0, len(buf), "GetBlocksResponse"):
        if field.number == 1 and field.value is not None:
            index = field.value & _MASK32
        elif field.number == 2 and field.wire_type == _LEN:
            chunks.append(field)
        elif field.number == 3 and field.value is not None:
            miss, chunks = field.value != 0, []
    return index, miss, chunks


def decode_response(raw: bytes) -> ChunkResponse:
    """Parse a serialised ``GetBlocksResponse``; ``data`` is a view of ``raw`` (no copy). Read as protobuf reads it:
    unknown fields of every wire type skipped, chunk occurrences merged, a field's last value kept. The chunk fields
    this client does not use (``parent_key``, ``token_ids``) are skipped unchecked. Malformed bytes raise
    ``WireError``."""
    buf = memoryview(raw)
    index, miss, chunks = _response_item(buf)
    if not chunks:
        return ChunkResponse(index=index, miss=miss)
    key, data, last, total, in_arena, arena_offset = b"", buf[0:0], False, 0, False, 0
    for chunk in chunks:
        for field in _walk(buf, chunk.value_start, chunk.end, "chunk", 1):
            number, value = field.number, field.value
            if field.wire_type == _LEN and number == 1:
                key = bytes(buf[field.value_start:field.end])
            elif field.wire_type == _LEN and number == 2:
                data = buf[field.value_start:field.end]
            elif value is not None and number == 3:
                last = value != 0
            elif value is not None and number == 4:
                total = value
            elif value is not None and number == 5:
                in_arena = value != 0
            elif value is not None and number == 6:
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


_PutChunk = tuple[_Field, list[_Field]]  # a chunk occurrence and its data fields


def _put_chunks(buf: memoryview, budget: _Budget) -> list[_PutChunk]:
    """The chunk occurrences of the ``PutBlocksRequest`` in ``buf`` that carry data fields, with those fields, in
    order; the whole message is walked (malformed framing raises ``WireError``), ``budget`` checked as it goes."""
    found: list[_PutChunk] = []
    for field in _walk(buf, 0, len(buf), "PutBlocksRequest", 0, budget, _CHUNK_FIELD):
        data = []
        for inner in _walk(buf, field.value_start, field.end, "chunk", 1, budget, _DATA_FIELD):
            data.append(inner)
            budget.kept = inner.end - inner.value_start
        if data:
            found.append((field, data))
    return found


def _without_data(buf: memoryview, chunks: list[_PutChunk]) -> bytes:
    """The message in ``buf`` without the data fields of ``chunks`` (each chunk occurrence's length rewritten)."""
    parts: list[bytes | memoryview] = []
    pos = 0
    for chunk, data in chunks:
        body, inner = [], chunk.value_start
        for field in data:
            body.append(buf[inner:field.start])
            inner = field.end
        body.append(buf[inner:chunk.end])
        parts += [buf[pos:chunk.start], _field(_PUT_CHUNK, _LEN), varint(sum(len(b) for b in body)), *body]
        pos = chunk.end
    parts.append(buf[pos:])
    return b"".join(parts)


def decode_put_request(raw: bytes, *, max_rest_bytes: int | None = None) -> tuple[pb.PutBlocksRequest, memoryview]:
    """Parse a serialised ``PutBlocksRequest`` exactly as protobuf does: the message without its chunk's data, and
    that data as a view of ``raw`` (no copy).

    Every valid encoding is read: unknown fields of every wire type (groups too) at any level, fields in any order,
    the chunk in several occurrences (merged: the data is the last ``data`` field of all of them, even an empty
    one), the data field repeated. Every data field is cut out and the rest parsed by the generated class, so every
    other field keeps its protobuf meaning. Malformed bytes (anything protobuf refuses) raise ``WireError``.

    ``len(raw) - len(data)`` is what the message carries besides the data it delivers: every other field, the
    framing, and the data fields protobuf drops (all but the last). With ``max_rest_bytes``, a message where that
    exceeds the limit raises ``WireLimitError`` before protobuf parses anything (the walk stops as soon as it
    knows)."""
    buf = memoryview(raw)
    chunks = _put_chunks(buf, _Budget(max_rest_bytes))
    data = buf[0:0]
    if chunks:
        last = chunks[-1][1][-1]
        data = buf[last.value_start:last.end]
    rest_bytes = len(buf) - len(data)
    if max_rest_bytes is not None and rest_bytes > max_rest_bytes:
        raise WireLimitError(rest_bytes, max_rest_bytes)
    message = pb.PutBlocksRequest()
    try:
        message.ParseFromString(_without_data(buf, chunks) if chunks else raw)
    except (DecodeError, RuntimeWarning) as exc:
        raise WireError(str(exc)) from None
    return message, data
