"""What a PutBlocks call holds, counted as held: whole received messages (not data bytes), the lineage its first
chunks name, and padding that is never progress. Real ``kvshelf serve`` subprocesses on loopback (their memory is
read from /proc), and a real in-process server for the accounting cases."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
from helpers import key_of, make_block
from service_helpers import ServeProcess, write_tokens

from kvshelf.bench.common import PeakRss
from kvshelf.kvstore import encode_block, open_embedded_store
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.client import RemoteStore, RemoteStoreError
from kvshelf.service.server import MAX_PUT_METADATA_BYTES, SERVICE_NAME, ServerLimits, start_server
from kvshelf.service.wire import varint

MiB = 1 << 20
UNKNOWN_FIELD = 15  # a field number PutBlocksRequest does not define (what a newer or hostile client may send)


def _padding(nbytes: int, field: int = UNKNOWN_FIELD) -> bytes:
    """An unknown length-delimited field of ``nbytes`` zeros, serialised."""
    return varint(field << 3 | 2) + varint(nbytes) + bytes(nbytes)


def _token_padding(count: int) -> bytes:
    """``Chunk.token_ids`` (field 8, packed) of ``count`` token ids of 3 bytes each, serialised."""
    body = varint(100_000) * count
    return varint(8 << 3 | 2) + varint(len(body)) + body


def _message(chunk: pb.Chunk, *, namespace: str = "", chunk_extra: bytes = b"", extra: bytes = b"") -> bytes:
    """A serialised PutBlocksRequest with raw fields appended to its chunk (``chunk_extra``) and to itself."""
    body = chunk.SerializeToString() + chunk_extra
    head = pb.PutBlocksRequest(namespace=namespace).SerializeToString()
    return head + varint(3 << 3 | 2) + varint(len(body)) + body + extra


def _raw_put(address: str, token: str | None = None):
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    method = channel.stream_unary(f"/{SERVICE_NAME}/PutBlocks", request_serializer=None,
                                  response_deserializer=pb.PutBlocksResponse.FromString)
    return channel, lambda messages, timeout=60: method(iter(messages), timeout=timeout, metadata=metadata)


@pytest.fixture
def h1_server(tmp_path):
    """The outsider's H1 setting: ``kvshelf serve --max-call 16MiB --max-inflight 32MiB --quota 8MiB``, two
    tenants."""
    tokens = write_tokens(tmp_path / "tokens.toml")
    proc = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--tokens-file",
                        str(tokens), "--max-call", "16MiB", "--max-inflight", "32MiB", "--quota", "8MiB",
                        "--memory", "64MiB", "--grace", "1")
    yield proc
    proc.stop()


def _honest_block(namespace: str, seed: int = 7):
    block = make_block(list(range(seed, seed + 16)), namespace=namespace)
    key = key_of(block)
    return key, block, encode_block(block, key)


@pytest.mark.parametrize("padding", ["unknown_field", "token_ids"])
def test_h1_padded_messages_are_refused_before_they_are_held(h1_server, padding):
    """The outsider's H1 call: 60 messages of 8 MiB padding with empty data, then one small value. On the old
    server it was accepted while the server held +611 MiB; now the first padded message is RESOURCE_EXHAUSTED
    before protobuf parses it, the server's memory grows by <= 128 MiB, and the other tenant's block is intact."""
    honest = RemoteStore(h1_server.address, token="token-of-tenant-b", namespace="tenant-b")
    key_b, block_b, value_b = _honest_block("tenant-b")
    assert honest.put_encoded_many([(key_b, value_b)]) == 1

    key, block, value = _honest_block("tenant-a", seed=100)

    def messages():
        for n in range(60):
            chunk = pb.Chunk(key=key if n == 0 else b"", data=b"", total_size=len(value) if n == 0 else 0)
            if padding == "unknown_field":
                yield _message(chunk, extra=_padding(8 * MiB))
            else:
                yield _message(chunk, chunk_extra=_token_padding(8 * MiB // 3))
        yield _message(pb.Chunk(data=value, last=True))

    channel, put = _raw_put(h1_server.address, "token-of-tenant-a")
    with PeakRss(h1_server.proc.pid) as peak, pytest.raises(grpc.RpcError) as info:
        put(messages())
    channel.close()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert "besides its data" in info.value.details()
    assert peak.growth <= 128 * MiB, f"server grew by {peak.growth / MiB:.0f} MiB"
    assert honest.get_encoded_many([key_b])[0] == value_b
    honest.close()


def test_padding_under_the_metadata_cap_holds_nothing(h1_server):
    """60 messages each padded just under the cap on what a message carries besides its data, with empty data, then
    the value: accepted, the value stored as sent, and the padding never held."""
    key, block, value = _honest_block("tenant-a", seed=200)
    pad = MAX_PUT_METADATA_BYTES - 4096

    def messages():
        yield _message(pb.Chunk(key=key, data=b"", total_size=len(value)), extra=_padding(pad))
        for _ in range(59):
            yield _message(pb.Chunk(data=b""), extra=_padding(pad))
        yield _message(pb.Chunk(data=value, last=True), extra=_padding(pad))

    channel, put = _raw_put(h1_server.address, "token-of-tenant-a")
    with PeakRss(h1_server.proc.pid) as peak:
        assert put(messages()).stored == 1
    channel.close()
    assert peak.growth <= 48 * MiB, f"server grew by {peak.growth / MiB:.0f} MiB"
    store = RemoteStore(h1_server.address, token="token-of-tenant-a", namespace="tenant-a")
    assert store.get_encoded_many([key])[0] == value
    store.close()


@pytest.fixture
def server(tmp_path):
    started = []

    def start(**limits):
        store = open_embedded_store(tmp_path / f"data{len(started)}")
        running = start_server(store, limits=ServerLimits(**limits))
        started.append((running, store))
        return running

    yield start
    for running, store in started:
        running.stop(0)
        store.close()


def test_a_chunk_kept_as_a_view_holds_its_whole_message(server):
    """Chunks of 1 byte of data in messages of 60 KiB (kept as views: the whole message stays alive) count 60 KiB
    each against the per-call limit: a value whose messages would hold more than the limit is refused. The old
    server counted 1 byte each and held ~17 MiB under a 4 MiB limit."""
    running = server(max_call_bytes=4 * MiB)
    key = b"k" * 16
    pad = 60 << 10

    def messages():
        for n in range(300):
            chunk = pb.Chunk(key=key if n == 0 else b"", data=b"x")
            yield _message(chunk, namespace="default" if n == 0 else "", extra=_padding(pad))

    channel, put = _raw_put(f"127.0.0.1:{running.port}")
    with pytest.raises(grpc.RpcError) as info:
        put(messages())
    channel.close()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "may hold at most" in info.value.details()
    assert running.servicer.inflight.used() == 0  # everything given back


def test_padded_chunks_are_copied_out_and_the_value_is_stored_exactly(server):
    """Data chunks in messages padded past 64 KiB (here 200 KiB) are copied out of their message (the message is
    freed): such a value is accepted under a per-call limit that the whole messages would exceed, stored exactly."""
    running = server(max_call_bytes=MiB)
    block = make_block(list(range(32)))
    key = key_of(block)
    value = encode_block(block, key)
    piece = 1024

    def messages():
        for n, start in enumerate(range(0, len(value), piece)):
            chunk = pb.Chunk(key=key if n == 0 else b"", data=value[start : start + piece],
                             total_size=len(value) if n == 0 else 0, last=start + piece >= len(value))
            yield _message(chunk, namespace="default" if n == 0 else "", extra=_padding(200 << 10))

    assert len(value) // piece * (200 << 10) > MiB  # the whole messages would not fit the limit
    channel, put = _raw_put(f"127.0.0.1:{running.port}")
    assert put(messages()).stored == 1
    channel.close()
    store = RemoteStore(f"127.0.0.1:{running.port}")
    assert store.get_encoded_many([key])[0] == value
    store.close()


def test_lineage_token_ids_count_against_the_call(server):
    """Token ids a value's first chunk names are kept until the call ends: they count (4 bytes each) against the
    per-call limit. 40 tiny values naming 60,000 token ids each (~9 MiB of ids held) under a 4 MiB limit: refused."""
    running = server(max_call_bytes=4 * MiB)
    tokens = list(range(100_000, 160_000))

    def messages():
        for n in range(40):
            block = make_block([n])
            key = key_of(block)
            value = encode_block(block, key)
            chunk = pb.Chunk(key=key, data=value, last=True, total_size=len(value), token_ids=tokens)
            yield _message(chunk, namespace="default" if n == 0 else "")

    channel, put = _raw_put(f"127.0.0.1:{running.port}")
    with pytest.raises(grpc.RpcError) as info:
        put(messages())
    channel.close()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "token ids" in info.value.details()


@pytest.mark.parametrize("field", ["token_ids", "parent_key", "total_size"])
def test_first_chunk_fields_on_a_later_chunk_are_invalid(server, field):
    running = server()
    block = make_block(list(range(8)))
    key = key_of(block)
    value = encode_block(block, key)
    later = pb.Chunk(data=value[10:], last=True)
    if field == "token_ids":
        later.token_ids.extend([1, 2, 3])
    elif field == "parent_key":
        later.parent_key = b"p" * 16
    else:
        later.total_size = len(value)
    messages = [_message(pb.Chunk(key=key, data=value[:10]), namespace="default"), _message(later)]
    channel, put = _raw_put(f"127.0.0.1:{running.port}")
    with pytest.raises(grpc.RpcError) as info:
        put(messages)
    channel.close()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first chunk" in info.value.details()


def test_padding_is_no_progress_for_the_min_rate(server):
    """A stream sending 200 KiB of padding every 20 ms (10 MiB/s of bytes, no data) is ended by the min-rate
    watchdog: padding is not progress. The old watchdog counted the padding and let it run."""
    running = server(idle_timeout_s=1.0, min_rate_bytes=64 << 10)
    stop = threading.Event()
    key = b"k" * 16

    def messages():
        yield _message(pb.Chunk(key=key, data=b""), namespace="default", extra=_padding(200 << 10))
        deadline = time.monotonic() + 15
        while not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
            yield _message(pb.Chunk(data=b""), extra=_padding(200 << 10))

    channel, put = _raw_put(f"127.0.0.1:{running.port}")
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        put(messages(), timeout=30)
    stop.set()
    channel.close()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
    assert "minimum rate" in info.value.details()
    assert time.monotonic() - started < 10


@pytest.fixture
def int8_server(tmp_path):
    """``kvshelf serve --disk-codec int8``: the server decodes every put to re-encode it for its disk tier."""
    proc = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--disk-codec", "int8",
                        "--memory", "64MiB", "--grace", "1")
    yield proc
    proc.stop()


def test_h2_hadamard_headers_stay_within_the_limits(int8_server):
    """The outsider's H2: a ~20 KB ``cachegen`` block whose header says ``rotate`` at head dim 8192 (a dense
    8192 x 8192 float64 matrix for the old decoder: +1.3 GB in a server that re-encodes) is DATA_LOSS (past the
    header's head-dim limit) with the server's memory flat; the largest rotated block the limits admit is stored
    (decoded and re-encoded by the server) and read back and decoded by a client, each within 128 MiB."""
    from kvshelf.bench.abuse_blocks import block_key, hadamard_block, largest_hadamard_block
    from kvshelf.kvstore import decode_block

    store = RemoteStore(int8_server.address, namespace="default", shared_memory=False)
    bomb_key = block_key("h2-bomb")
    with PeakRss(int8_server.proc.pid) as server_peak, pytest.raises(RemoteStoreError) as info:
        store.put_encoded_many([(bomb_key, hadamard_block(bomb_key, "default"))])
    assert info.value.code == grpc.StatusCode.DATA_LOSS and "head_dim 8192" in str(info.value)
    assert server_peak.growth <= 128 * MiB

    key = block_key("h2-largest")
    value = largest_hadamard_block(key, "default")
    with PeakRss(int8_server.proc.pid) as server_peak:
        assert store.put_encoded_many([(key, value)]) == 1
    assert server_peak.growth <= 128 * MiB, f"server grew by {server_peak.growth / MiB:.0f} MiB"
    fetched = store.get_encoded_many([key])[0]
    assert fetched == value  # the memory tier keeps it as sent
    with PeakRss(os.getpid()) as client_peak:
        block = decode_block(fetched, expected_key=key)
    assert block.keys.shape[-1] == 4096
    assert client_peak.growth <= 128 * MiB, f"client grew by {client_peak.growth / MiB:.0f} MiB"
    store.close()


def test_padded_requests_of_the_other_streaming_calls(h1_server):
    """GetBlocks and SubscribeEvents requests padded with 8 MiB of an unknown field (a valid encoding: protobuf
    skips it) are answered as the unpadded ones, the server's memory bounded by the message limit."""
    key, block, value = _honest_block("tenant-a", seed=300)
    store = RemoteStore(h1_server.address, token="token-of-tenant-a", namespace="tenant-a", shared_memory=False)
    assert store.put_encoded_many([(key, value)]) == 1
    channel = grpc.insecure_channel(h1_server.address, options=[("grpc.max_send_message_length", -1)])
    metadata = (("authorization", "Bearer token-of-tenant-a"),)
    get = channel.unary_stream(f"/{SERVICE_NAME}/GetBlocks", request_serializer=None,
                               response_deserializer=pb.GetBlocksResponse.FromString)
    subscribe = channel.unary_stream(f"/{SERVICE_NAME}/SubscribeEvents", request_serializer=None,
                                     response_deserializer=pb.SubscribeEventsResponse.FromString)
    request = pb.GetBlocksRequest(namespace="tenant-a", keys=[key]).SerializeToString() + _padding(8 * MiB)
    with PeakRss(h1_server.proc.pid) as peak:
        responses = list(get(request, timeout=30, metadata=metadata))
        events = subscribe(pb.SubscribeEventsRequest(namespace="tenant-a").SerializeToString() + _padding(8 * MiB),
                           timeout=30, metadata=metadata)
        assert next(events).HasField("started")
        events.cancel()
    assert b"".join(r.chunk.data for r in responses) == value
    assert peak.growth <= 128 * MiB, f"server grew by {peak.growth / MiB:.0f} MiB"
    channel.close()
    store.close()
