"""``service/wire.py``'s hand-written readers read every valid encoding exactly as protobuf's own parser does.

Property tests (hypothesis, derandomized: the same examples on every run): random ``PutBlocksRequest`` messages,
serialised and then re-encoded in ways protobuf allows (the chunk split over several occurrences, unknown fields of
every wire type at the top and inside the chunk, groups nested in groups, known fields under a foreign wire type,
earlier data fields, fields reordered, token ids packed, unpacked or in several packed runs, overlong varints),
compared with ``pb.PutBlocksRequest.FromString``; random and mutated bytes: both refuse or both read the same
(``tests/support/fuzz_wire.py``, also an atheris target). The same for ``GetBlocksResponse`` and
``decode_response``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from fuzz_driver import mutate
from fuzz_wire import check_put_request, check_response
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.errors import WireError, WireLimitError
from kvshelf.service.wire import decode_put_request, decode_response, varint

VARINT, FIXED64, LEN, START_GROUP, END_GROUP, FIXED32 = range(6)
U64 = (1 << 64) - 1
MAX_DATA = 300

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

#: field number -> its own wire type, per message (a field under another wire type is unknown to protobuf)
PUT_FIELDS = {1: LEN, 2: VARINT, 3: LEN}
RESPONSE_FIELDS = {1: VARINT, 2: LEN, 3: VARINT}
CHUNK_FIELDS = {1: LEN, 2: LEN, 3: VARINT, 4: VARINT, 5: VARINT, 6: VARINT, 7: LEN, 8: LEN}


@dataclass(frozen=True)
class Piece:
    """One encoded field; pieces of the same ``order`` class keep their relative order when fields are shuffled
    (data fields: the last one wins; token id runs: they concatenate; chunk occurrences: they merge in order)."""

    raw: bytes
    order: str = ""


def encode_varint(draw: st.DrawFn, value: int, max_bytes: int) -> bytes:
    """``value`` as a varint, sometimes overlong (padded with continuation bytes, up to ``max_bytes``); a 10-byte
    value sometimes carries bits past the 64th (protobuf drops them)."""
    if max_bytes == 10 and draw(st.integers(0, 9)) == 0:
        return varint(value | draw(st.integers(1, 63)) << 64)
    plain = varint(value)
    extra = draw(st.integers(0, max_bytes - len(plain))) if draw(st.integers(0, 5)) == 0 else 0
    if not extra:
        return plain
    return plain[:-1] + bytes([plain[-1] | 0x80]) + b"\x80" * (extra - 1) + b"\x00"


def tag(draw: st.DrawFn, number: int, wire_type: int) -> bytes:
    """A tag, sometimes overlong (protobuf takes tags of up to 5 bytes)."""
    return encode_varint(draw, number << 3 | wire_type, 5)


def length_delimited(draw: st.DrawFn, number: int, payload: bytes) -> bytes:
    """A length-delimited field (its length sometimes overlong)."""
    return tag(draw, number, LEN) + encode_varint(draw, len(payload), 5) + payload


def value_of(draw: st.DrawFn, number: int, wire_type: int, depth: int) -> bytes:
    """A random field ``number`` of ``wire_type`` (a group holds random fields, nested up to ``depth`` more)."""
    if wire_type == VARINT:
        return tag(draw, number, VARINT) + encode_varint(draw, draw(st.integers(0, U64)), 10)
    if wire_type == FIXED64:
        return tag(draw, number, FIXED64) + draw(st.binary(min_size=8, max_size=8))
    if wire_type == FIXED32:
        return tag(draw, number, FIXED32) + draw(st.binary(min_size=4, max_size=4))
    if wire_type == LEN:
        return length_delimited(draw, number, draw(st.binary(max_size=24)))
    # field number 0 passes inside a group (protobuf skips group content with fewer checks)
    inner = draw(st.lists(st.tuples(st.integers(0, 40), wire_types(depth)), max_size=3 if depth else 0))
    body = b"".join(value_of(draw, n, w, depth - 1) for n, w in inner)
    return tag(draw, number, START_GROUP) + body + tag(draw, number, END_GROUP)


def wire_types(depth: int) -> st.SearchStrategy[int]:
    """Any valid wire type to start a field with (groups while ``depth`` allows)."""
    return st.sampled_from([VARINT, FIXED64, LEN, FIXED32, START_GROUP] if depth else [VARINT, FIXED64, LEN, FIXED32])


def foreign_fields(draw: st.DrawFn, known: dict[int, int]) -> list[Piece]:
    """Fields protobuf keeps as unknown in a message with ``known`` fields: unused numbers of any wire type, and
    known numbers under another wire type (a repeated uint32 also takes varints: left out)."""
    pieces = []
    unused = st.one_of(st.integers(max(known) + 1, 40), st.integers(max(known) + 1, (1 << 29) - 1))
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            number, wire_type = draw(unused), draw(wire_types(3))
        else:
            number = draw(st.sampled_from(sorted(known)))
            own = {known[number], VARINT} if known is CHUNK_FIELDS and number == 8 else {known[number]}
            wire_type = draw(wire_types(3).filter(lambda w, own=own: w not in own))
        pieces.append(Piece(value_of(draw, number, wire_type, 3)))
    return pieces


def shuffled(draw: st.DrawFn, pieces: list[Piece]) -> list[Piece]:
    """``pieces`` in a random order that keeps each ``order`` class's relative order."""
    out = [pieces[i] for i in draw(st.permutations(range(len(pieces))))]
    for order in {p.order for p in pieces if p.order}:
        slots = [i for i, p in enumerate(out) if p.order == order]
        for slot, piece in zip(slots, [p for p in pieces if p.order == order], strict=True):
            out[slot] = piece
    return out


def token_pieces(draw: st.DrawFn, token_ids: list[int]) -> list[Piece]:
    """``token_ids`` (field 8) packed, unpacked, or as several packed runs, mixed."""
    pieces, rest = [], list(token_ids)
    while rest:
        run = rest[:draw(st.integers(1, len(rest)))]
        rest = rest[len(run):]
        if draw(st.booleans()):
            pieces.append(Piece(length_delimited(draw, 8, b"".join(varint(t) for t in run)), "tokens"))
        else:
            pieces += [Piece(tag(draw, 8, VARINT) + encode_varint(draw, t, 10), "tokens") for t in run]
    return pieces


def chunk_pieces(draw: st.DrawFn, chunk: pb.Chunk) -> list[Piece]:
    """``chunk``'s fields re-encoded: scalars sometimes written at their default, earlier data fields before the
    real one (which is then always written, even empty), unknown fields, any order."""
    pieces = []
    for number, name in [(1, "key"), (7, "parent_key")]:
        value = getattr(chunk, name)
        if value or draw(st.integers(0, 4)) == 0:
            pieces.append(Piece(length_delimited(draw, number, value)))
    for number, name in [(3, "last"), (4, "total_size"), (5, "in_arena"), (6, "arena_offset")]:
        value = int(getattr(chunk, name))
        if value or draw(st.integers(0, 4)) == 0:
            pieces.append(Piece(tag(draw, number, VARINT) + encode_varint(draw, value, 10)))
    decoys = draw(st.lists(st.binary(max_size=40), max_size=2))
    pieces += [Piece(length_delimited(draw, 2, d), "data") for d in decoys]
    if chunk.data or decoys or draw(st.booleans()):
        pieces.append(Piece(length_delimited(draw, 2, chunk.data), "data"))
    pieces += token_pieces(draw, list(chunk.token_ids)) + foreign_fields(draw, CHUNK_FIELDS)
    return shuffled(draw, pieces)


def occurrences(draw: st.DrawFn, number: int, pieces: list[Piece]) -> list[Piece]:
    """``pieces`` as the content of 1 to 3 occurrences of the message field ``number`` (protobuf merges them)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(pieces)), max_size=2)))
    bounds = [0, *cuts, len(pieces)]
    return [Piece(length_delimited(draw, number, b"".join(p.raw for p in pieces[a:b])), "chunk")
            for a, b in zip(bounds, bounds[1:], strict=False)]


def chunks() -> st.SearchStrategy[pb.Chunk]:
    """Random ``Chunk`` messages (every field)."""
    return st.builds(
        pb.Chunk, key=st.binary(max_size=20), last=st.booleans(),
        data=st.one_of(st.binary(max_size=16), st.binary(min_size=100, max_size=MAX_DATA)),
        total_size=st.integers(0, U64), in_arena=st.booleans(), arena_offset=st.integers(0, U64),
        parent_key=st.binary(max_size=20), token_ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=12))


@st.composite
def put_requests(draw: st.DrawFn) -> tuple[pb.PutBlocksRequest, bytes]:
    """A random ``PutBlocksRequest`` and a random valid encoding of it."""
    message = pb.PutBlocksRequest(namespace=draw(st.text(max_size=12)), pin=draw(st.booleans()))
    if draw(st.integers(0, 4)):
        message.chunk.CopyFrom(draw(chunks()))
    if draw(st.integers(0, 5)) == 0:
        return message, message.SerializeToString()  # protobuf's own encoding
    pieces = foreign_fields(draw, PUT_FIELDS)
    if message.namespace or draw(st.booleans()):
        pieces.append(Piece(length_delimited(draw, 1, message.namespace.encode())))
    if message.pin or draw(st.booleans()):
        pieces.append(Piece(tag(draw, 2, VARINT) + encode_varint(draw, int(message.pin), 10)))
    if message.HasField("chunk"):
        pieces += occurrences(draw, 3, chunk_pieces(draw, message.chunk))
    return message, b"".join(p.raw for p in shuffled(draw, pieces))


@st.composite
def responses(draw: st.DrawFn) -> tuple[pb.GetBlocksResponse, bytes]:
    """A random ``GetBlocksResponse`` (a chunk or a miss) and a random valid encoding of it."""
    message = pb.GetBlocksResponse(index=draw(st.integers(0, (1 << 32) - 1)))
    if draw(st.booleans()):
        message.chunk.CopyFrom(draw(chunks()))
    else:
        message.miss = draw(st.booleans())
    pieces = foreign_fields(draw, RESPONSE_FIELDS)
    if message.index or draw(st.booleans()):
        pieces.append(Piece(tag(draw, 1, VARINT) + encode_varint(draw, message.index, 10)))
    if message.HasField("chunk"):
        pieces += occurrences(draw, 2, chunk_pieces(draw, message.chunk))
    else:
        pieces.append(Piece(tag(draw, 3, VARINT) + encode_varint(draw, int(message.miss), 10), "chunk"))
    return message, b"".join(p.raw for p in shuffled(draw, pieces))


@PROPERTY
@given(put_requests())
def test_every_valid_encoding_reads_as_protobuf_reads_it(case):
    message, raw = case
    check_put_request(raw)  # the same as protobuf, field by field, the data a view of raw
    read = pb.PutBlocksRequest.FromString(raw)
    read.DiscardUnknownFields()
    assert read == message  # the re-encoding kept the message's meaning (a check of the generator)
    got, data = decode_put_request(raw)
    assert bytes(data) == message.chunk.data


@PROPERTY
@given(put_requests())
def test_rest_bytes_limit_is_exact(case):
    """``len(raw) - len(data)`` is what ``max_rest_bytes`` bounds: that limit passes, one byte less refuses (the
    early refusal while walking never fires below the final count)."""
    _, raw = case
    _, data = decode_put_request(raw)
    rest = len(raw) - len(data)
    decode_put_request(raw, max_rest_bytes=rest)
    if rest:
        with pytest.raises(WireLimitError) as exc:
            decode_put_request(raw, max_rest_bytes=rest - 1)
        assert exc.value.limit == rest - 1 and rest - 1 < exc.value.size <= rest


@PROPERTY
@given(responses())
def test_every_valid_response_encoding_reads_as_protobuf_reads_it(case):
    message, raw = case
    check_response(raw)
    got = decode_response(raw)
    assert (got.index, got.miss, bytes(got.data), got.key) == \
        (message.index, message.WhichOneof("item") == "miss" and message.miss, message.chunk.data, message.chunk.key)


@FUZZ
@given(st.binary(max_size=80))
def test_random_bytes_both_refuse_or_both_read_the_same(raw):
    check_put_request(raw)
    check_response(raw)


@FUZZ
@given(st.one_of(put_requests(), responses()), st.randoms(use_true_random=False))
def test_mutated_messages_both_refuse_or_both_read_the_same(case, rng: random.Random):
    raw = mutate(case[1], rng)
    check_put_request(raw)
    check_response(raw)


@pytest.mark.parametrize(("prefix", "depth", "valid"), [
    (b"", 100, True), (b"", 101, False), (b"chunk", 99, True), (b"chunk", 100, False), (b"", 100_000, False),
])
def test_nesting_is_bounded_as_protobufs(prefix, depth, valid):
    """Groups nest as deep as protobuf allows (100 levels of messages and groups), no deeper, and never recurse."""
    body = b"\x3b" * depth + b"\x3c" * depth
    raw = b"\x1a" + varint(len(body)) + body if prefix else body
    check_put_request(raw)
    if valid:
        decode_put_request(raw)
    else:
        with pytest.raises(WireError, match="nest deeper"):
            decode_put_request(raw)
