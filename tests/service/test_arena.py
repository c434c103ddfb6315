"""The same-host GetBlocks path (service/arena.py): values through a client-owned /dev/shm arena, and every
way the server must refuse an arena and fall back to the wire with the same bytes."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from helpers import FINGERPRINT, assert_same_block, key_of, make_block

from kvshelf.kvstore import encode_block, open_embedded_store
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.proto import kvshelf_pb2_grpc as pb_grpc
from kvshelf.service.arena import (
    ARENA_DIR,
    HEADER_BYTES,
    ArenaPool,
    ArenaUnavailable,
    ClientArena,
    shared_memory_supported,
)
from kvshelf.service.client import RemoteStore, is_local_address
from kvshelf.service.server import ServerLimits, is_local_peer, start_server
from kvshelf.service.wire import decode_response

pytestmark = pytest.mark.skipif(not shared_memory_supported(), reason="needs a writable /dev/shm (Linux)")


def _server(tmp_path, shared_memory: bool = True):
    store = open_embedded_store(tmp_path / "data")
    return store, start_server(store, limits=ServerLimits(max_block_bytes=64 << 20, shared_memory=shared_memory))


@pytest.fixture
def server(tmp_path):
    store, running = _server(tmp_path)
    yield running
    running.stop(0)
    store.close()


def _blocks() -> list:
    return [make_block(range(i * 1000, i * 1000 + 200), layers=4, heads=8, head_dim=128) for i in range(3)]  # ~6.5 MB


def _arena_bytes(remote: RemoteStore) -> bytes:
    """Everything the client's (single) arena holds after its header."""
    assert remote._arenas is not None
    (arena,) = remote._arenas._all
    with open(ARENA_DIR / arena.name, "rb") as f:
        f.seek(HEADER_BYTES)
        return f.read(arena.capacity - HEADER_BYTES).rstrip(b"\0")


def _raw_get(server, request: pb.GetBlocksRequest) -> list:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_stream("/kvshelf.v1.KVShelf/GetBlocks",
                                    request_serializer=pb.GetBlocksRequest.SerializeToString,
                                    response_deserializer=None)
        return [decode_response(raw) for raw in call(request, timeout=30)]


def test_values_travel_through_the_arena_and_equal_the_stored_ones(server):
    blocks = _blocks()
    with RemoteStore(f"127.0.0.1:{server.port}") as remote:
        assert remote._arenas is not None  # loopback: on by default
        remote.put_many([(key_of(b), b) for b in blocks])
        got = remote.get_many([key_of(blocks[0]), b"\x00" * 16, key_of(blocks[2])], fingerprint=FINGERPRINT)
        assert_same_block(got[0], blocks[0])
        assert got[1] is None
        assert_same_block(got[2], blocks[2])
        held = _arena_bytes(remote)  # the server wrote both values there, back to back
        assert held.startswith(encode_block(blocks[0], key_of(blocks[0])))
        names = [a.name for a in remote._arenas._all]
    assert not any((ARENA_DIR / n).exists() for n in names)  # close() removed the arena


def test_server_with_shared_memory_off_uses_the_wire(tmp_path):
    store, running = _server(tmp_path, shared_memory=False)
    try:
        block = _blocks()[0]
        with RemoteStore(f"127.0.0.1:{running.port}") as remote:
            remote.put_many([(key_of(block), block)])
            assert_same_block(remote.get_many([key_of(block)], fingerprint=FINGERPRINT)[0], block)
            assert _arena_bytes(remote) == b""
    finally:
        running.stop(0)
        store.close()


def test_values_that_do_not_fit_go_over_the_wire(server):
    blocks = _blocks()
    size = len(encode_block(blocks[0], key_of(blocks[0])))
    with RemoteStore(f"127.0.0.1:{server.port}", arena_bytes=HEADER_BYTES + size + 1000) as remote:
        remote.put_many([(key_of(b), b) for b in blocks])
        got = remote.get_many([key_of(b) for b in blocks], fingerprint=FINGERPRINT)
        for block, back in zip(blocks, got, strict=True):
            assert_same_block(back, block)
        assert len(_arena_bytes(remote)) <= size  # only the first fitted


@pytest.mark.parametrize("case", ["wrong token", "bad name", "missing file", "symlink"])
def test_a_refused_arena_falls_back_to_the_wire_and_writes_nothing(server, tmp_path, case):
    block = make_block(50)  # one chunk
    with RemoteStore(f"127.0.0.1:{server.port}", shared_memory=False) as remote:
        remote.put_many([(key_of(block), block)])
    arena = ClientArena(1 << 20)
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    name, token = arena.name, arena.token
    if case == "wrong token":
        token = bytes(16)
    elif case == "bad name":
        name = "../../tmp/x"
    elif case == "missing file":
        name = "kvshelf-arena-1-" + "0" * 32
    link = ARENA_DIR / f"kvshelf-arena-{os.getpid()}-{'ab' * 16}"
    if case == "symlink":
        link.symlink_to(victim)
        name = link.name
    try:
        request = pb.GetBlocksRequest(keys=[key_of(block)], arena=pb.SharedArena(name=name, token=token))
        (msg,) = _raw_get(server, request)
        assert not msg.in_arena and msg.last
        assert bytes(msg.data) == encode_block(block, key_of(block))
        assert arena.read(HEADER_BYTES, 16) == bytes(16)  # nothing written into the real arena
        assert victim.read_bytes() == b"untouched"
    finally:
        link.unlink(missing_ok=True)
        arena.close()


def test_put_chunks_may_not_claim_an_arena(server):
    block = _blocks()[0]
    value = encode_block(block, key_of(block))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.KVShelfStub(channel)
        chunk = pb.Chunk(key=key_of(block), last=True, total_size=len(value), in_arena=True, arena_offset=64)
        with pytest.raises(grpc.RpcError) as excinfo:
            stub.PutBlocks(iter([pb.PutBlocksRequest(chunk=chunk)]), timeout=10)
        assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "in_arena" in excinfo.value.details()


def test_arena_reads_outside_the_arena_are_refused():
    arena = ClientArena(4096)
    try:
        for offset, length in [(0, 10), (HEADER_BYTES, 5000), (HEADER_BYTES, -1)]:
            with pytest.raises(ArenaUnavailable):
                arena.read(offset, length)
    finally:
        arena.close()
    with pytest.raises(ValueError, match="capacity"):
        ClientArena(10)


def test_arenas_of_dead_processes_are_swept_and_pools_clean_up():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = ARENA_DIR / f"kvshelf-arena-{int(dead.stdout)}-{'cd' * 16}"
    stale.write_bytes(b"left behind")
    pool = ArenaPool(1 << 20)
    first = pool.acquire()
    assert not stale.exists()
    pool.release(first)
    assert pool.acquire() is first  # reused, not recreated
    pool.close()
    assert not (ARENA_DIR / first.name).exists()
    with pytest.raises(ArenaUnavailable):
        pool.acquire()


@pytest.mark.parametrize(("peer", "local"), [
    ("ipv4:127.0.0.1:5000", True), ("ipv6:[::1]:5000", True), ("unix:/tmp/s.sock", True),
    ("ipv6:[::ffff:127.0.0.1]:5000", True), ("ipv4:10.0.0.2:5000", False), ("ipv6:[2001:db8::1]:5000", False),
    ("", False),
])
def test_local_peers(peer, local):
    assert is_local_peer(peer) is local


@pytest.mark.parametrize(("address", "local"), [
    ("127.0.0.1:50051", True), ("localhost:1", True), ("[::1]:5", True), ("unix:/tmp/s", True),
    ("10.1.2.3:50051", False), ("kv.example.com:443", False),
])
def test_local_addresses(address, local):
    assert is_local_address(address) is local
