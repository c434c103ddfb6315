"""The bulk wire path: hand-serialised PutBlocks requests (one copy of the data) and client-sized GetBlocks chunks.

Checked against the generated protobuf classes (what any other client sends and reads) and end to end through a
real server on loopback: values of one and of many chunks, old clients' 4 MiB chunks, malformed put messages.
"""

from __future__ import annotations

import os

import grpc
import pytest
import torch
from helpers import key_of, make_block

from kvshelf.kvstore import encode_block, open_embedded_store
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.proto import kvshelf_pb2_grpc as pb_grpc
from kvshelf.service.client import FIRST_MESSAGE_DATA_BYTES, RemoteStore, put_requests
from kvshelf.service.errors import WireLimitError
from kvshelf.service.server import CHUNK_BYTES, MAX_CHUNK_BYTES, ServerLimits, start_server
from kvshelf.service.wire import WireError, decode_put_request, decode_response, encode_put_request

MiB = 1 << 20


@pytest.mark.parametrize("size", [0, 1, 5000])
@pytest.mark.parametrize("key", [b"", bytes(range(200, 216))])
@pytest.mark.parametrize("head", [None, pb.PutBlocksRequest(namespace="team-a", pin=True)])
@pytest.mark.parametrize("lineage", [False, True])
def test_put_request_parses_as_protobuf(size, key, head, lineage):
    data = os.urandom(size)
    meta = pb.Chunk(key=key, last=True, total_size=size)
    if lineage:
        meta.parent_key, meta.token_ids[:] = os.urandom(16), [1, 2, 70000]
    raw = encode_put_request(memoryview(data), meta, head)
    parsed = pb.PutBlocksRequest.FromString(raw)  # what the generated class reads from our bytes
    expected = pb.PutBlocksRequest()
    if head is not None:
        expected.CopyFrom(head)
    expected.chunk.CopyFrom(meta)
    expected.chunk.data = data
    assert parsed == expected
    message, view = decode_put_request(raw)  # and our reader, from our bytes and from protobuf's
    assert bytes(view) == data and message.chunk.data == b""
    message.chunk.data = data
    assert message == expected
    message, view = decode_put_request(expected.SerializeToString())
    assert bytes(view) == data


def test_put_request_refuses_data_in_the_metadata():
    with pytest.raises(WireError):
        encode_put_request(b"x", pb.Chunk(data=b"y"))


@pytest.mark.parametrize("raw", [
    b"\x1a\x05\x12\x10abc",  # chunk.data longer than its chunk
    b"\x1a\x80",  # truncated length varint
    b"\x0a\x02\xff\xfe",  # a namespace that is not UTF-8
    b"\x1a\x02\x12\x02",  # a data field whose value is cut off
    b"\x3e",  # wire type 6
    b"\x3c",  # the end of a group never started
    b"\x1a\x03\x3b\x3c\x3c",  # ... inside the chunk
    b"\x00\x01",  # field number 0
    b"\x3b" * 101 + b"\x3c" * 101,  # groups nested deeper than protobuf's limit of 100
])
def test_malformed_put_requests_are_a_wire_error(raw):
    with pytest.raises(WireError):
        decode_put_request(raw)


@pytest.mark.parametrize("raw", [
    b"\x1a\x08\x12\x01a\x12\x01b\x18\x01",  # data twice in one chunk: protobuf keeps the last
    b"\x1a\x03\x12\x01a\x1a\x02\x12\x00",  # ... over two chunk occurrences, the last one empty
    b"\x1a\x00\x1a\x00",  # the chunk field twice
    b"\x1a\x03\x12\x01a\x10\x01\x1a\x02\x18\x01",  # the chunk split in two, the namespace between
    b"\x1d\x00\x00\x00\x00",  # field 3 as fixed32: an unknown field
    b"\x1a\x0c\x12\x01a\x19" + bytes(8),  # a fixed64 field in the chunk
    b"\x3b\x08\x01\x43\x12\x01x\x44\x3c\x1a\x03\x12\x01a",  # an unknown group, nested, with a "data" inside
    b"\x3b" * 100 + b"\x3c" * 100,  # groups nested as deep as protobuf allows
])
def test_valid_put_requests_read_as_protobuf_does(raw):
    expected = pb.PutBlocksRequest.FromString(raw)
    message, view = decode_put_request(raw)
    assert bytes(view) == expected.chunk.data and view.obj is raw
    if expected.HasField("chunk"):
        expected.chunk.ClearField("data")
    assert message == expected


def test_rest_of_a_put_request_is_bounded():
    """``max_rest_bytes`` bounds what a message carries besides its data (padding: unknown fields, token ids, a
    data field repeated) before protobuf parses it; the data itself does not count."""
    data = os.urandom(1000)
    raw = encode_put_request(data, pb.Chunk(key=b"k" * 16, last=True), pb.PutBlocksRequest(namespace="ns"))
    _, view = decode_put_request(raw, max_rest_bytes=len(raw) - len(data))
    assert bytes(view) == data
    padded = [  # (message, whether the walk stops early: soon after the limit, not at the end of the padding)
        (b"\x3a\x90\x4e" + bytes(10000) + raw, False),  # one unknown field of 10 kB
        (b"\x38\x01" * 5000 + raw, True),  # 5000 small unknown fields
        (b"\x3b" + b"\x08\x01" * 5000 + b"\x3c" + raw, True),  # ... in a group
        (b"\x1a\x90\x4e" + b"\x40\x01" * 5000, True),  # 5000 token ids, unpacked
        (raw + raw, False),  # the chunk twice: the first data field is dropped by protobuf, so it counts
    ]
    for message, early in padded:
        with pytest.raises(WireLimitError) as exc:
            decode_put_request(message, max_rest_bytes=100)
        assert exc.value.limit == 100 and exc.value.size > 100 and "100" in str(exc.value)
        assert isinstance(exc.value, WireError)
        assert (exc.value.size < 110) == early
        decode_put_request(message)  # valid all the same


@pytest.fixture
def server(tmp_path):
    store = open_embedded_store(tmp_path / "data")
    running = start_server(store, limits=ServerLimits(max_block_bytes=64 << 20, quota_bytes=None))
    yield running
    running.stop(0)
    store.close()


def _big_value() -> tuple[bytes, bytes]:
    block = make_block(list(range(1050)), layers=4, heads=4, head_dim=64, seed=3)  # ~8.6 MB float32
    key = key_of(block)
    return key, encode_block(block, key)


def test_values_of_many_chunks_round_trip(server):
    """A value cut into 1 MiB chunks by the client is assembled by the server; read back in 1 MiB chunks."""
    key, value = _big_value()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    put = channel.stream_unary("/kvshelf.v1.KVShelf/PutBlocks", request_serializer=None,
                               response_deserializer=pb.PutBlocksResponse.FromString)
    assert put(put_requests([(key, value)], "default", chunk_bytes=MiB), timeout=30).stored == 1
    get = channel.unary_stream("/kvshelf.v1.KVShelf/GetBlocks", request_serializer=None, response_deserializer=None)
    request = pb.GetBlocksRequest(namespace="default", keys=[key], max_chunk_bytes=MiB)
    chunks = [decode_response(raw) for raw in get(request.SerializeToString(), timeout=30)]
    assert len(chunks) == -(-len(value) // MiB) and all(len(c.data) <= MiB for c in chunks)
    assert b"".join(bytes(c.data) for c in chunks) == value
    channel.close()


@pytest.mark.parametrize(("asked", "expected"), [(0, CHUNK_BYTES), (1, 64 << 10), (MAX_CHUNK_BYTES, MAX_CHUNK_BYTES),
                                                 (1 << 31, MAX_CHUNK_BYTES)])
def test_get_chunk_size_is_the_clients_within_bounds(server, asked, expected):
    """No max_chunk_bytes (an older client): 4 MiB chunks; a tiny one is raised to 64 KiB, a huge one capped."""
    key, value = _big_value()
    with RemoteStore(f"127.0.0.1:{server.port}", shared_memory=False) as remote:
        remote.put_encoded_many([(key, value)])
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}",
                                    options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = pb_grpc.KVShelfStub(channel)
    responses = list(stub.GetBlocks(pb.GetBlocksRequest(namespace="default", keys=[key], max_chunk_bytes=asked),
                                    timeout=30))
    assert max(len(r.chunk.data) for r in responses) == min(expected, len(value))
    assert b"".join(r.chunk.data for r in responses) == value
    channel.close()


def test_remote_store_moves_a_value_in_one_message(server):
    """RemoteStore puts an 8 MiB value in two messages (a small first one: a dev-mode server reads it before it
    admits the call) and gets it in one (fewer, larger messages: faster)."""
    key, value = _big_value()
    assert len(value) < MAX_CHUNK_BYTES
    messages = [pb.PutBlocksRequest.FromString(raw) for raw in put_requests([(key, value)], "default")]
    assert [len(m.chunk.data) for m in messages] == [FIRST_MESSAGE_DATA_BYTES, len(value) - FIRST_MESSAGE_DATA_BYTES]
    with RemoteStore(f"127.0.0.1:{server.port}", shared_memory=False, data_path=False) as remote:
        assert remote.put_encoded_many([(key, value)]) == 1
        assert remote.get_encoded_many([key]) == [value]


def test_malformed_put_message_is_invalid_argument(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    put = channel.stream_unary("/kvshelf.v1.KVShelf/PutBlocks", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as exc:
        put(iter([b"\x1a\x05\x12\x10abc"]), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed PutBlocksRequest" in exc.value.details()
    channel.close()
    with RemoteStore(f"127.0.0.1:{server.port}", shared_memory=False) as remote:  # still serving
        key, value = _big_value()
        assert remote.put_encoded_many([(key, value)]) == 1


@pytest.mark.parametrize("data_path", [True, False])  # values over the bulk data path, and over gRPC
def test_prepared_blocks_are_decoded_while_the_rest_arrive(server, data_path):
    """get_prepared_many reads each large fetched value on a decode thread as soon as it is whole (the decoding
    overlaps the transfer of the values after it), small ones in the caller's thread; the results are the same
    as fetching everything first, misses and damaged values included."""
    import threading

    from kvshelf.kvstore.encoding import prepare_block
    from kvshelf.service.client import STREAM_DECODE_MIN_BYTES

    big = [make_block(list(range(i * 1000, i * 1000 + 300)), layers=4, heads=4, head_dim=64, seed=i) for i in range(3)]
    small = make_block([1, 2, 3])
    blocks = [*big, small]
    keys = [key_of(b) for b in blocks]
    with RemoteStore(f"127.0.0.1:{server.port}", shared_memory=False, data_path=data_path) as remote:
        assert remote.put_encoded_many([(k, encode_block(b, k)) for k, b in zip(keys, blocks, strict=True)]) == 4
        values = remote.get_encoded_many(keys)
        assert all(len(v) >= STREAM_DECODE_MIN_BYTES for v in values[:3]) and len(values[3]) < STREAM_DECODE_MIN_BYTES
        threads: dict[bytes, str] = {}

        def read(key: bytes, value: bytes):
            threads[key] = threading.current_thread().name
            return prepare_block(value, expected_key=key)

        missing = b"\x07" * 16
        outcomes = remote._fetch_decoding([*keys, missing], "default", blocks[0].fingerprint, None, read)
    assert outcomes[-1] is None
    for block, outcome in zip(blocks, outcomes, strict=False):
        assert outcome.shape == tuple(block.keys.shape) and outcome.token_ids == block.token_ids
        got_k, got_v = torch.empty_like(block.keys), torch.empty_like(block.values)
        outcome.payload.write(got_k, got_v)
        assert torch.equal(got_k, block.keys) and torch.equal(got_v, block.values)
    assert all(threads[k].startswith("kvshelf-decode") for k in keys[:3])
    assert threads[keys[3]] == threading.current_thread().name


def test_a_stock_client_with_default_options_gets_a_large_value(server):
    """Plain generated stubs on a channel with default options (a 4 MiB receive limit, as grpc-js and Go have) get
    a value of over 8 MiB with the default chunk size: every message fits the limit, framing included. The old
    default sent messages of 4 MiB + 33 bytes, which such a client refuses (``Received message larger than max``)."""
    key, value = _big_value()
    assert len(value) > 2 * CHUNK_BYTES
    with RemoteStore(f"127.0.0.1:{server.port}", shared_memory=False) as remote:
        remote.put_encoded_many([(key, value)])
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")  # default options
    stub = pb_grpc.KVShelfStub(channel)
    responses = list(stub.GetBlocks(pb.GetBlocksRequest(namespace="default", keys=[key]), timeout=30))
    assert max(r.ByteSize() for r in responses) <= 4 << 20
    assert b"".join(r.chunk.data for r in responses) == value
    # a client asking for 4 MiB chunks gets data of 4 MiB per message (plus framing: it must accept that)
    asked = list(stub.GetBlocks(pb.GetBlocksRequest(namespace="default", keys=[key], max_chunk_bytes=CHUNK_BYTES),
                                timeout=30))
    assert max(r.ByteSize() for r in asked) <= 4 << 20
    channel.close()
