"""The server's write path against a hostile tenant: decompression bombs, payloads that disagree with
their shape, deeply nested headers, quota bypass by overwrites, limits checked before a put is buffered, and the
in-flight put budget. Real gRPC server on loopback over a real LMDB store in tmp_path."""

from __future__ import annotations

import json
import struct
import threading
import time

import grpc
import pytest
import xxhash
from helpers import FINGERPRINT, key_of, make_block

from kvshelf.kvstore import encode_block, open_embedded_store
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.proto import kvshelf_pb2_grpc as pb_grpc
from kvshelf.service.auth import scope_tag
from kvshelf.service.client import RemoteStore, RemoteStoreError
from kvshelf.service.server import CHUNK_BYTES, ServerLimits, start_server

MiB = 1 << 20


@pytest.fixture
def serve(tmp_path):
    """``serve(**limits)``: a real server over an embedded store (memory raw over LMDB raw) with those limits."""
    started = []

    def start(**limits):
        store = open_embedded_store(tmp_path / f"data{len(started)}")
        running = start_server(store, limits=ServerLimits(**limits))
        started.append((running, store))
        return running, store

    yield start
    for running, store in started:
        running.stop(0)
        store.close()


def _stub(port: int) -> tuple[grpc.Channel, pb_grpc.KVShelfStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 * MiB)])
    return channel, pb_grpc.KVShelfStub(channel)


def _rewrite(value: bytes, *, header: bytes | None = None, payload: bytes | None = None, **changes: object) -> bytes:
    """``value`` with header fields changed (or the header replaced by raw bytes) and/or another payload, with a
    *valid* checksum: a well-formed forged block."""
    magic, version, header_len = struct.unpack_from("<4sHI", value)
    old_payload = value[10 + header_len : -8]
    payload = old_payload if payload is None else payload
    if header is None:
        fields = json.loads(value[10 : 10 + header_len])
        fields.update(changes)
        fields["payload_len"] = len(payload) if "payload_len" not in changes else changes["payload_len"]
        header = json.dumps(fields, separators=(",", ":")).encode()
    body = struct.pack("<4sHI", magic, version, len(header)) + header + payload
    return body + xxhash.xxh3_64_digest(body)


def _put_raw(stub: pb_grpc.KVShelfStub, key: bytes, value: bytes, namespace: str = "default") -> pb.PutBlocksResponse:
    def requests():
        for n, start in enumerate(range(0, max(len(value), 1), CHUNK_BYTES)):
            data = value[start : start + CHUNK_BYTES]
            chunk = pb.Chunk(data=data, last=start + CHUNK_BYTES >= len(value))
            if n == 0:
                chunk.key, chunk.total_size = key, len(value)
            yield pb.PutBlocksRequest(namespace=namespace if n == 0 else "", chunk=chunk)

    return stub.PutBlocks(requests(), timeout=60)


BOMB_SHAPE = (32, 64, 1, 4096)


def _bomb() -> tuple[bytes, bytes]:
    """A ~350-byte ``sparse`` block with 0 kept tokens, ``fill: "zero"`` and declared shape (32, 64, 1, 4096)
    (within the header limits, ``kvstore.limits``): 64 MiB once decoded, 128 MiB to decode (``decode_cost_bytes``:
    the inner codec may decode every token)."""
    block = make_block([5], layers=1, heads=1, head_dim=8)
    small = encode_block(block.__class__(block.keys * float("nan"), block.values * float("nan"), block.token_ids,
                                         block.start_pos, block.fingerprint, block.namespace, {}),
                         key_of(block), "sparse", {"fill": "zero"})
    return key_of(block), _rewrite(small, shape=list(BOMB_SHAPE))


def _held(store) -> int:
    return sum(t["bytes"] or 0 for t in store.stats()["tiers"])


# -- decompression bomb -------------------------------------------------------------------------------


def test_decompression_bomb_is_refused_by_the_max_block(serve):
    running, store = serve(max_block_bytes=MiB)
    key, bomb = _bomb()
    assert len(bomb) < 1000
    channel, stub = _stub(running.port)
    with pytest.raises(grpc.RpcError) as excinfo:
        _put_raw(stub, key, bomb)
    assert excinfo.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(list(BOMB_SHAPE)) in excinfo.value.details() and str(MiB) in excinfo.value.details()
    assert _held(store) == 0
    channel.close()
    with (RemoteStore(f"127.0.0.1:{running.port}", namespace="default", shared_memory=False) as remote,
          pytest.raises(RemoteStoreError) as over_data_path):  # the same rule on the bulk data path
        remote.put_encoded_many([(key, bomb)])
    assert over_data_path.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(list(BOMB_SHAPE)) in str(over_data_path.value)
    assert _held(store) == 0


def test_decompression_bomb_is_refused_by_the_quota(serve):
    """Max block at its default (256 MiB): the bomb decodes to 64 MiB, counted against the 1 MiB quota."""
    running, store = serve(quota_bytes=MiB)
    key, bomb = _bomb()
    channel, stub = _stub(running.port)
    with pytest.raises(grpc.RpcError) as excinfo:
        _put_raw(stub, key, bomb)
    assert excinfo.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota" in excinfo.value.details()
    assert _held(store) == 0
    channel.close()


def test_a_sparse_block_within_the_limits_is_still_stored(serve):
    running, store = serve(max_block_bytes=MiB, quota_bytes=MiB)
    block = make_block(8, namespace="default")
    with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", codec="sparse") as remote:
        assert remote.put_many([(key_of(block), block)]) == 1
        assert remote.get_many([key_of(block)], fingerprint=FINGERPRINT)[0] is not None


# -- payload size, nested headers ---------------------------------------------------------------------


def test_raw_payload_that_does_not_match_its_shape_is_data_loss(serve):
    running, store = serve()
    block = make_block(4)
    key = key_of(block)
    value = encode_block(block, key)
    short = _rewrite(value, payload=encode_block(make_block(2), key)[-8 - 2 * 2 * 2 * 2 * 8 * 4 : -8])
    channel, stub = _stub(running.port)
    with pytest.raises(grpc.RpcError) as excinfo:
        _put_raw(stub, key, short)
    assert excinfo.value.code() == grpc.StatusCode.DATA_LOSS
    assert "payload" in excinfo.value.details()
    assert _held(store) == 0
    # a damaged value already stored is caught on reads too: a counted corrupt miss, never served
    store.specs[1].tier.put_many([(scope_tag("default") + key, short)])
    with RemoteStore(f"127.0.0.1:{running.port}", namespace="default") as remote:
        assert remote.get_many([key], fingerprint=FINGERPRINT) == [None]
    assert store.stats()["tiers"][1]["corrupt"] == 1
    channel.close()


@pytest.mark.parametrize("codec", ["fp16", "int8", "zstd"])
def test_compressed_payload_longer_than_its_shape_allows_is_data_loss(serve, codec):
    running, _ = serve()
    block = make_block(4)
    key = key_of(block)
    value = encode_block(block, key, codec)
    padded = _rewrite(value, payload=value[10 + struct.unpack_from("<I", value, 6)[0] : -8] + bytes(4096))
    channel, stub = _stub(running.port)
    with pytest.raises(grpc.RpcError) as excinfo:
        _put_raw(stub, key, padded)
    assert excinfo.value.code() == grpc.StatusCode.DATA_LOSS
    channel.close()


def test_deeply_nested_json_header_is_data_loss_not_internal(serve):
    running, store = serve()
    block = make_block(4)
    key = key_of(block)
    nested = _rewrite(encode_block(block, key), header=b"[" * 100_000 + b"]" * 100_000)
    channel, stub = _stub(running.port)
    with pytest.raises(grpc.RpcError) as excinfo:
        _put_raw(stub, key, nested)
    assert excinfo.value.code() == grpc.StatusCode.DATA_LOSS
    assert "header" in excinfo.value.details()
    # and stored in a tier, it is a corrupt miss on reads
    store.specs[1].tier.put_many([(scope_tag("default") + key, nested)])
    with RemoteStore(f"127.0.0.1:{running.port}", namespace="default") as remote:
        assert remote.get_many([key], fingerprint=FINGERPRINT) == [None]
    channel.close()


# -- quota ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data_path", [True, False])  # the bulk data path, and gRPC
def test_overwrites_with_growing_values_never_exceed_the_quota(serve, data_path):
    """Overwriting held keys used to count 0 bytes: a 1 MiB quota ended with 5.9 MB held."""
    running, store = serve(quota_bytes=MiB)
    tokens = [[i, i + 1, i + 2, i + 3] for i in range(0, 40, 4)]
    refused = 0
    with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", data_path=data_path) as remote:
        for head_dim in (64, 128, 256, 512, 1024):
            pairs = [(key_of(b), b) for b in (make_block(t, head_dim=head_dim) for t in tokens)]
            for pair in pairs:
                try:
                    remote.put_many([pair])
                except RemoteStoreError as exc:
                    assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                    refused += 1
                usage = remote.stats()["usage"]
                assert usage["bytes"] <= MiB, f"{usage['bytes']} bytes held under a quota of {MiB}"
        assert refused > 0
    assert max(t["bytes"] for t in store.stats()["tiers"]) <= MiB


@pytest.mark.parametrize("data_path", [True, False])  # the bulk data path, and gRPC
def test_an_overwrite_of_the_same_size_at_the_quota_is_accepted(serve, data_path):
    running, _ = serve(quota_bytes=200_000)
    blocks = [make_block([i, i + 1], head_dim=1024) for i in range(0, 12, 2)]  # ~33 KB each
    with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", data_path=data_path) as remote:
        stored = 0
        for b in blocks:
            try:
                stored += remote.put_many([(key_of(b), b)])
            except RemoteStoreError:
                break
        assert 0 < stored < len(blocks)
        assert remote.put_many([(key_of(blocks[0]), blocks[0])]) == 1  # adds nothing


# -- limits before buffering ---------------------------------------------------------------------------


def _counting_requests(key: bytes, total: int, pulled: list[int], namespace: str = "default",
                       gate: threading.Event | None = None, declare: bool = True):
    """A put of ``total`` junk bytes in full chunks, counting the chunks gRPC pulled; waits on ``gate`` (if
    given) after the first chunk."""
    for n, start in enumerate(range(0, total, CHUNK_BYTES)):
        if n == 1 and gate is not None:
            gate.wait(30)
        pulled.append(n)
        chunk = pb.Chunk(data=bytes(min(CHUNK_BYTES, total - start)), last=start + CHUNK_BYTES >= total)
        if n == 0:
            chunk.key, chunk.total_size = key, total if declare else 0
        yield pb.PutBlocksRequest(namespace=namespace if n == 0 else "", chunk=chunk)


@pytest.mark.parametrize("declare", [True, False])
def test_an_over_quota_tenant_is_refused_at_the_first_chunk(serve, declare):
    """A 64 MiB put by a tenant already at its quota: refused before the server buffers it (the old server
    consumed all 16 chunks, then refused)."""
    running, store = serve(quota_bytes=MiB, max_block_bytes=128 * MiB)
    filler = [make_block([i, i + 1], head_dim=2048) for i in range(0, 14, 2)]  # ~66 KB each
    with RemoteStore(f"127.0.0.1:{running.port}", namespace="default") as remote:
        for b in filler:
            remote.put_many([(key_of(b), b)])
    channel, stub = _stub(running.port)
    pulled: list[int] = []
    with pytest.raises(grpc.RpcError) as excinfo:
        stub.PutBlocks(_counting_requests(b"\x42" * 16, 64 * MiB, pulled, declare=declare), timeout=60)
    assert len(pulled) <= 8, f"the client sent {len(pulled)} of 16 chunks before the refusal"  # gRPC reads ahead
    assert excinfo.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota" in excinfo.value.details()
    assert running.servicer.inflight.used() == 0
    channel.close()


def _value_of_about(nbytes: int, namespace: str) -> tuple[bytes, bytes]:
    tokens = nbytes // (2 * 4 * 2048 * 4)
    block = make_block(list(range(tokens)), layers=1, heads=4, head_dim=2048, namespace=namespace)
    return key_of(block), encode_block(block, key_of(block))


def _wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _buffered(running, put: dict) -> int:
    """Put bytes the server holds in flight (a server without an in-flight budget: the put's first chunk was
    sent, then a moment for the server to take it)."""
    inflight = getattr(running.servicer, "inflight", None)
    if inflight is not None:
        return inflight.used()
    if put.get("waiting"):
        time.sleep(0.5)
        return 1 << 62
    return 0


def _held_put(port: int, key: bytes, value: bytes, namespace: str, gate: threading.Event, out: dict) -> None:
    """A put whose second chunk waits on ``gate``: it holds its value's budget meanwhile."""
    channel, stub = _stub(port)

    def requests():
        for n, start in enumerate(range(0, len(value), CHUNK_BYTES)):
            if n == 1:
                out["waiting"] = True
                gate.wait(30)
            chunk = pb.Chunk(data=value[start : start + CHUNK_BYTES], last=start + CHUNK_BYTES >= len(value))
            if n == 0:
                chunk.key, chunk.total_size = key, len(value)
            yield pb.PutBlocksRequest(namespace=namespace if n == 0 else "", chunk=chunk)

    try:
        out["stored"] = stub.PutBlocks(requests(), timeout=60).stored
    except grpc.RpcError as exc:
        out["error"] = exc.code()
    finally:
        channel.close()


def test_concurrent_puts_of_one_tenant_share_the_per_call_limit(serve):
    running, _ = serve(max_call_bytes=8 * MiB, max_block_bytes=8 * MiB, max_inflight_bytes=32 * MiB)
    key_a, value_a = _value_of_about(5 * MiB, "tenant-a")
    key_b, value_b = _value_of_about(5 * MiB + 65536, "tenant-a")
    assert len(value_a) > CHUNK_BYTES and len(value_a) + len(value_b) > 8 * MiB
    gate, first = threading.Event(), {}
    thread = threading.Thread(target=_held_put, args=(running.port, key_a, value_a, "tenant-a", gate, first))
    thread.start()
    try:
        _wait_until(lambda: _buffered(running, first) >= len(value_a))
        channel, stub = _stub(running.port)
        with pytest.raises(grpc.RpcError) as excinfo:
            _put_raw(stub, key_b, value_b, namespace="tenant-a")
        assert excinfo.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "in flight" in excinfo.value.details() and str(8 * MiB) in excinfo.value.details()
        # another tenant is not limited by tenant-a's share
        key_c, value_c = _value_of_about(5 * MiB, "tenant-c")
        assert _put_raw(stub, key_c, value_c, namespace="tenant-c").stored == 1
        channel.close()
    finally:
        gate.set()
        thread.join(60)
    assert first.get("stored") == 1
    assert running.servicer.inflight.used() == 0


def test_the_server_wide_inflight_budget_refuses_at_once(serve):
    running, _ = serve(max_call_bytes=8 * MiB, max_block_bytes=8 * MiB, max_inflight_bytes=8 * MiB)
    key_a, value_a = _value_of_about(5 * MiB, "tenant-a")
    key_b, value_b = _value_of_about(5 * MiB, "tenant-b")
    gate, first = threading.Event(), {}
    thread = threading.Thread(target=_held_put, args=(running.port, key_a, value_a, "tenant-a", gate, first))
    thread.start()
    try:
        _wait_until(lambda: _buffered(running, first) >= len(value_a))
        channel, stub = _stub(running.port)
        with pytest.raises(grpc.RpcError) as excinfo:
            _put_raw(stub, key_b, value_b, namespace="tenant-b")
        assert excinfo.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "in-flight put budget" in excinfo.value.details()
        channel.close()
    finally:
        gate.set()
        thread.join(60)
    assert first.get("stored") == 1


def test_a_value_longer_than_its_declared_size_is_refused(serve):
    running, store = serve()
    block = make_block(4)
    key, value = key_of(block), encode_block(block, key_of(block))
    channel, stub = _stub(running.port)

    def requests():
        yield pb.PutBlocksRequest(namespace="default", chunk=pb.Chunk(key=key, data=value[:100], total_size=100))
        yield pb.PutBlocksRequest(chunk=pb.Chunk(data=value[100:], last=True))

    with pytest.raises(grpc.RpcError) as excinfo:
        stub.PutBlocks(requests(), timeout=30)
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "declared total_size" in excinfo.value.details()
    # undeclared sizes still work, in several chunks
    def undeclared():
        yield pb.PutBlocksRequest(namespace="default", chunk=pb.Chunk(key=key, data=value[:100]))
        yield pb.PutBlocksRequest(chunk=pb.Chunk(data=value[100:], last=True))

    assert stub.PutBlocks(undeclared(), timeout=30).stored == 1
    assert running.servicer.inflight.used() == 0
    channel.close()


@pytest.mark.parametrize("data_path", [True, False])  # the bulk data path, and gRPC
def test_reencoded_copies_of_a_call_count_against_the_in_flight_budget(serve, data_path):
    """Small int2 blocks re-encoded to raw for the tiers: 16x what was sent. The copies a call's re-encode holds
    at once count against the tenant's share (max call), so a call cannot make the server allocate 16 x max call."""
    running, store = serve(max_call_bytes=MiB, max_block_bytes=MiB)
    blocks = [make_block(list(range(i * 16, i * 16 + 16)), head_dim=400) for i in range(8)]  # 200 KiB raw each
    items = [(key_of(b), encode_block(b, key_of(b), "int2")) for b in blocks]
    assert sum(len(v) for _, v in items) < MiB // 4
    with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", data_path=data_path) as remote:
        with pytest.raises(RemoteStoreError) as excinfo:
            remote.put_encoded_many(items)
        assert excinfo.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "in flight" in str(excinfo.value)
        assert _held(store) == 0
        assert remote.put_encoded_many(items[:2]) == 2  # within the share
    assert running.servicer.inflight.used() == 0


def test_a_damaged_value_ends_the_call_before_the_rest_is_buffered(serve):
    """Each value is verified as soon as its last chunk arrives: a call of 16 garbage values of 1 MiB ends with
    DATA_LOSS after the first (the server used to buffer the whole call, up to --max-call, then verify)."""
    running, _ = serve()
    channel, stub = _stub(running.port)
    pulled: list[int] = []

    def requests():
        for n in range(16):
            pulled.append(n)
            chunk = pb.Chunk(key=bytes([n]) * 16, data=b"\x00" * MiB, last=True, total_size=MiB)
            yield pb.PutBlocksRequest(namespace="default" if n == 0 else "", chunk=chunk)

    with pytest.raises(grpc.RpcError) as excinfo:
        stub.PutBlocks(requests(), timeout=60)
    assert excinfo.value.code() == grpc.StatusCode.DATA_LOSS
    assert len(pulled) <= 8, f"the client sent {len(pulled)} of 16 values before the refusal"
    channel.close()
