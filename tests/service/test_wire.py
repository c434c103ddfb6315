"""service.wire builds and reads exactly the bytes of the generated GetBlocksResponse class."""

from __future__ import annotations

import os

import pytest
from google.protobuf.message import DecodeError

from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.wire import (
    WireError,
    decode_response,
    encode_arena_response,
    encode_chunk_response,
    encode_miss_response,
)


@pytest.mark.parametrize("index", [0, 1, 300, 2**31])
@pytest.mark.parametrize("key", [b"", bytes(range(200, 216))])
@pytest.mark.parametrize("size", [0, 1, 5000])
@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("total", [0, 5, 10**12])
def test_chunk_response_matches_protobuf(index, key, size, last, total):
    data = os.urandom(size)
    message = pb.GetBlocksResponse(index=index, chunk=pb.Chunk(key=key, data=data, last=last, total_size=total))
    assert encode_chunk_response(index, memoryview(data), key=key, last=last, total_size=total) == \
        message.SerializeToString()
    parsed = decode_response(message.SerializeToString())
    assert (parsed.index, parsed.miss, parsed.key, bytes(parsed.data), parsed.last, parsed.total_size) == \
        (index, False, key, data, last, total)


@pytest.mark.parametrize("index", [0, 9, 2**31])
@pytest.mark.parametrize("key", [b"", bytes(range(200, 216))])
@pytest.mark.parametrize("offset", [0, 64, 3 << 30])
@pytest.mark.parametrize("size", [0, 1, 8 << 20])
def test_arena_response_matches_protobuf(index, key, offset, size):
    chunk = pb.Chunk(key=key, last=True, total_size=size, in_arena=True, arena_offset=offset)
    wire = pb.GetBlocksResponse(index=index, chunk=chunk).SerializeToString()
    assert encode_arena_response(index, key, offset, size) == wire
    parsed = decode_response(wire)
    assert (parsed.index, parsed.key, parsed.last, parsed.total_size, parsed.in_arena, parsed.arena_offset,
            bytes(parsed.data)) == (index, key, True, size, True, offset, b"")


@pytest.mark.parametrize("index", [0, 7, 2**20])
def test_miss_response_matches_protobuf(index):
    wire = pb.GetBlocksResponse(index=index, miss=True).SerializeToString()
    assert encode_miss_response(index) == wire
    assert decode_response(wire).miss and decode_response(wire).index == index


@pytest.mark.parametrize("raw", [b"\x12\x05abc", b"\x08", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                                 b"\x0d\x00\x00", b"\x0e", b"\x0c", b"\x3b\x08\x01", b"\x00\x01"])
def test_malformed_bytes_are_a_clear_error(raw):
    with pytest.raises(DecodeError):
        pb.GetBlocksResponse.FromString(raw)  # protobuf refuses them too
    with pytest.raises(WireError):
        decode_response(raw)


@pytest.mark.parametrize("raw", [
    b"\x0d\x00\x00\x00\x00" + encode_miss_response(4),  # field 1 as fixed32: an unknown field to protobuf
    b"\x3b\x08\x01\x43\x44\x3c" + encode_chunk_response(4, b"abc", key=b"k"),  # an unknown group, nested
    encode_chunk_response(4, b"abc", key=b"k") + b"\x12\x02\x18\x01",  # the chunk in two occurrences: merged
    encode_chunk_response(4, b"abc") + encode_miss_response(4),  # the oneof's last member wins
])
def test_valid_encodings_read_as_protobuf_does(raw):
    expected = pb.GetBlocksResponse.FromString(raw)
    parsed = decode_response(raw)
    assert (parsed.index, parsed.miss, parsed.key, bytes(parsed.data), parsed.last) == \
        (expected.index, expected.miss, expected.chunk.key, expected.chunk.data, expected.chunk.last)
