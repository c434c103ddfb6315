"""Per-tenant fairness of the gRPC service on a real server (127.0.0.1, free port, real LMDB store, two tenants
with tokens): the per-tenant stream cap, the idle and slow-stream watchdog, and quiet ends of cancelled calls.

Every test here failed before ``service/fairness.py``: 16 idle ``PutBlocks`` streams of one tenant held all
16 worker threads, so every call of another tenant ended in DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from helpers import FINGERPRINT, assert_same_block, key_of, make_block
from service_helpers import TOKENS, write_tokens

from kvshelf.kvstore import encode_block, open_embedded_store
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.proto import kvshelf_pb2_grpc as pb_grpc
from kvshelf.service.auth import TokenTable
from kvshelf.service.client import RemoteStore
from kvshelf.service.errors import RemoteStoreError
from kvshelf.service.server import ServerLimits, start_server

TOKEN_A, TOKEN_B = list(TOKENS)
WAIT_S = 5.0  # generous: the bugs made these calls hang forever (or until a 30 s+ deadline)


@pytest.fixture
def serve(tmp_path):
    """``serve(workers, **limits)``: a started server with the two tenants' tokens, stopped after the test."""
    started = []

    def make(workers: int = 16, **limits: object):
        store = open_embedded_store(tmp_path / f"data{len(started)}")
        tokens = TokenTable.from_file(write_tokens(tmp_path / "tokens.toml"))
        running = start_server(store, tokens=tokens, limits=ServerLimits(**limits), max_workers=workers)
        started.append((running, store))
        return running

    yield make
    for running, store in started:
        running.stop(0)
        store.close()


def _auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _stub(server) -> tuple[grpc.Channel, pb_grpc.KVShelfStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[("grpc.max_receive_message_length", 8 << 20)])
    return channel, pb_grpc.KVShelfStub(channel)


def _open_streams(server) -> int | None:
    gate = getattr(server.servicer, "streams", None)
    return None if gate is None else gate.open_streams()


def _wait_for(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _idle_put(stub, token: str, release: threading.Event, first: pb.PutBlocksRequest | None = None):
    """A PutBlocks that sends ``first`` (if any) and then nothing until ``release`` is set."""

    def requests() -> Iterator[pb.PutBlocksRequest]:
        if first is not None:
            yield first
        release.wait()

    return stub.PutBlocks.future(requests(), metadata=_auth(token))


def _first_chunk(namespace: str = "") -> pb.PutBlocksRequest:
    block = make_block([1, 2, 3])
    value = encode_block(block, key_of(block))
    return pb.PutBlocksRequest(namespace=namespace, chunk=pb.Chunk(key=key_of(block), data=value[:10],
                                                                   total_size=len(value)))


def _code_within(future, timeout_s: float = WAIT_S) -> grpc.StatusCode:
    """The status code the call ended with (fails if it is still open after ``timeout_s``)."""
    try:
        future.exception(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        pytest.fail(f"the call was still open after {timeout_s} s")
    return future.code()


_honest_rounds = iter(range(1 << 30))


def _honest_calls(server, namespace: str = "tenant-b") -> None:
    """Tenant B's Contains, Put, Get and LookupPrefix (of a new block each time), each within a 5 s deadline."""
    with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_B, namespace=namespace, timeout_s=WAIT_S,
                     shared_memory=False) as store:
        block = make_block([9, 8, next(_honest_rounds)], namespace=namespace)
        assert store.contains([key_of(block)]) == [False]
        assert store.put_many([(key_of(block), block)]) == 1
        assert_same_block(store.get_many([key_of(block)], fingerprint=FINGERPRINT)[0], block)
        assert store.lookup_prefix([key_of(block)]) == 1


# -- (a) one tenant cannot take the worker threads ----------------------------------------------------


def test_idle_streams_of_one_tenant_leave_the_others_served(serve):
    server = serve(workers=16, tenant_streams=4, idle_timeout_s=60)
    channel, stub = _stub(server)
    release = threading.Event()
    try:
        held = [_idle_put(stub, TOKEN_A, release) for _ in range(4)]
        assert _wait_for(lambda: _open_streams(server) in (4, None))
        fifth = _idle_put(stub, TOKEN_A, release)
        assert _code_within(fifth) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant-a" in fifth.details() and "cap is 4" in fifth.details()
        more = [_idle_put(stub, TOKEN_A, release) for _ in range(11)]  # 16 in all, as in the report
        assert [_code_within(f) for f in more] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 11
        assert not any(f.done() for f in held)
        _honest_calls(server)
        # tenant B may open streams of its own while A holds its 4
        b_held = [_idle_put(stub, TOKEN_B, release) for _ in range(2)]
        _honest_calls(server)
    finally:
        release.set()
    for future in held + b_held:
        assert future.result(timeout=WAIT_S).received == 0
    channel.close()


def test_streams_never_take_the_threads_reserved_for_unary_calls(serve):
    # 3 tenants x 4 streams would be 12 of 4 workers: streams get at most 3 of them, whoever asks
    server = serve(workers=4, tenant_streams=4, idle_timeout_s=60)
    channel, stub = _stub(server)
    release = threading.Event()
    try:
        futures = [_idle_put(stub, TOKEN_A, release) for _ in range(2)] + \
                  [_idle_put(stub, TOKEN_B, release) for _ in range(2)]
        assert _wait_for(lambda: sum(f.done() for f in futures) == 1)
        refused = [f for f in futures if f.done()]
        assert refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stream slots" in refused[0].details()
        with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_B, namespace="tenant-b", timeout_s=WAIT_S) as store:
            assert store.contains([b"\x01" * 16]) == [False]
            assert store.stats()["namespace"] == "tenant-b"
    finally:
        release.set()
    channel.close()


# -- (b) idle streams are ended and their threads freed -----------------------------------------------


@pytest.mark.parametrize("first", [None, "chunk"], ids=["no-message", "after-first-chunk"])
def test_an_idle_put_is_ended_and_its_thread_freed(serve, first, caplog):
    server = serve(workers=2, idle_timeout_s=0.5, min_rate_bytes=1)  # the idle check alone
    channel, stub = _stub(server)
    release = threading.Event()
    try:
        idle = _idle_put(stub, TOKEN_A, release, _first_chunk() if first else None)
        assert _code_within(idle) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no message received" in idle.details() and "idle timeout" in idle.details()
        assert _wait_for(lambda: _open_streams(server) == 0)
        # the thread is free: with 2 workers, streams and unary calls of both tenants work
        _honest_calls(server)
        _honest_calls(server)
    finally:
        release.set()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    channel.close()


def test_a_dev_mode_put_that_never_names_its_namespace_is_ended(tmp_path):
    store = open_embedded_store(tmp_path / "data")
    server = start_server(store, limits=ServerLimits(idle_timeout_s=0.5), max_workers=2)
    channel, stub = _stub(server)
    release = threading.Event()
    try:
        idle = _idle_put(stub, "unused", release)
        assert _code_within(idle) == grpc.StatusCode.DEADLINE_EXCEEDED
        with RemoteStore(f"127.0.0.1:{server.port}", namespace="other", timeout_s=WAIT_S) as remote:
            block = make_block([4, 5], namespace="other")
            assert remote.put_many([(key_of(block), block)]) == 1
    finally:
        release.set()
        channel.close()
        server.stop(0)
        store.close()


# -- (c) a client that stops reading a large GetBlocks ------------------------------------------------


def test_a_client_that_stops_reading_a_get_is_ended(serve):
    server = serve(workers=2, idle_timeout_s=0.5)
    blocks = [make_block(128, layers=8, heads=8, head_dim=64, start_pos=128 * i, namespace="tenant-a")
              for i in range(16)]  # 16 x 4 MiB: far more than the flow-control windows
    with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_A, namespace="tenant-a") as store:
        assert store.put_many([(key_of(b), b) for b in blocks]) == 16
    channel, stub = _stub(server)
    call = stub.GetBlocks(pb.GetBlocksRequest(keys=[key_of(b) for b in blocks], fingerprint=FINGERPRINT),
                          metadata=_auth(TOKEN_A))
    assert next(call).HasField("chunk")  # take one message, then stop reading
    assert _wait_for(lambda: _open_streams(server) == 0), "the server kept the stalled GetBlocks open"
    _honest_calls(server)  # its thread is free (2 workers)
    # the client, reading again, finds a few buffered messages and then the server's reason
    with pytest.raises(grpc.RpcError) as excinfo:
        for _ in call:
            pass
    assert excinfo.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "took no message" in excinfo.value.details()
    channel.close()


# -- (d) slowloris --------------------------------------------------------------------------------------


def test_a_slowloris_put_is_ended(serve):
    server = serve(workers=2, idle_timeout_s=1.0, min_rate_bytes=1 << 20)  # 100 ms gaps: never idle for 1 s
    channel, stub = _stub(server)
    stop = threading.Event()
    block = make_block([1, 2, 3, 4])
    value = encode_block(block, key_of(block))

    def one_byte_per_100ms() -> Iterator[pb.PutBlocksRequest]:
        yield pb.PutBlocksRequest(chunk=pb.Chunk(key=key_of(block), data=value[:1], total_size=len(value)))
        for i in range(1, min(len(value), 200)):
            if stop.wait(0.1):
                return
            yield pb.PutBlocksRequest(chunk=pb.Chunk(data=value[i : i + 1]))

    slow = stub.PutBlocks.future(one_byte_per_100ms(), metadata=_auth(TOKEN_A))
    try:
        assert _code_within(slow) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "below the minimum rate" in slow.details()
        assert _wait_for(lambda: _open_streams(server) == 0)
        _honest_calls(server)
    finally:
        stop.set()
    channel.close()


def test_a_steady_put_and_a_long_get_are_not_ended(serve):
    # the watchdog counts only time spent waiting on the client: a normal large put and get pass
    server = serve(workers=2, idle_timeout_s=1.0, min_rate_bytes=1 << 20)
    blocks = [make_block(128, layers=8, heads=8, head_dim=64, start_pos=128 * i, namespace="tenant-a")
              for i in range(6)]
    with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_A, namespace="tenant-a", shared_memory=False) as store:
        assert store.put_many([(key_of(b), b) for b in blocks]) == 6
        got = store.get_many([key_of(b) for b in blocks], fingerprint=FINGERPRINT)
        for want, have in zip(blocks, got, strict=True):
            assert_same_block(have, want)


# -- (e) cancelled calls end quietly ------------------------------------------------------------------


def test_a_cancelled_put_logs_no_traceback(serve, caplog):
    server = serve(workers=16, idle_timeout_s=60)
    channel, stub = _stub(server)
    release = threading.Event()
    caplog.set_level(logging.DEBUG)
    # several puts: how the server's request iterator sees a cancellation is a race (an error, or an early end)
    puts = [_idle_put(stub, token, release, _first_chunk()) for token in (TOKEN_A, TOKEN_B) for _ in range(4)]
    try:
        assert _wait_for(lambda: _open_streams(server) in (8, None))
        time.sleep(0.3)  # the server is inside the calls, waiting for their next chunks
        for put in puts:
            put.cancel()
        # let the server's handlers see the cancellations and end (a server without the gate: give it 2 s)
        _wait_for(lambda: _open_streams(server) == 0, 2.0 if _open_streams(server) is None else WAIT_S)
        assert _open_streams(server) in (0, None)
        _honest_calls(server)
    finally:
        release.set()
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [r.getMessage() for r in noisy]
    channel.close()


def test_a_client_leaving_mid_get_logs_no_traceback(serve, caplog):
    server = serve(workers=4, idle_timeout_s=60)
    blocks = [make_block(128, layers=8, heads=8, head_dim=64, start_pos=128 * i, namespace="tenant-a")
              for i in range(8)]
    with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_A, namespace="tenant-a") as store:
        store.put_many([(key_of(b), b) for b in blocks])
    caplog.set_level(logging.DEBUG)
    channel, stub = _stub(server)
    call = stub.GetBlocks(pb.GetBlocksRequest(keys=[key_of(b) for b in blocks], fingerprint=FINGERPRINT),
                          metadata=_auth(TOKEN_A))
    next(call)
    call.cancel()
    channel.close()
    assert _wait_for(lambda: _open_streams(server) in (0, None))
    time.sleep(0.3)
    _honest_calls(server)
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [r.getMessage() for r in noisy]


# -- calls whose request message never comes (raw HTTP/2: headers, no data; no token needed) ---------------


def _frame(ftype: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:  # HPACK literal header field, new name, no Huffman coding
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def _headers_only_calls(port: int, paths: list[str]) -> socket.socket:
    """One HTTP/2 connection opening a gRPC call per path with HEADERS only: the request message never comes."""
    sock = socket.create_connection(("127.0.0.1", port))
    out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"")  # preface + empty SETTINGS
    for i, path in enumerate(paths):
        block = b"".join(_literal(k, v) for k, v in [
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"), ("te", "trailers")])
        out += _frame(1, 0x4, 2 * i + 1, block)  # HEADERS, END_HEADERS, no END_STREAM
    sock.sendall(out)
    return sock


def test_calls_without_their_request_message_cannot_take_the_threads(serve, caplog):
    server = serve(workers=4, idle_timeout_s=30)
    paths = [f"/kvshelf.v1.KVShelf/{m}" for m in ("Contains", "GetBlocks", "Stats")] * 6 + \
            ["/grpc.health.v1.Health/Check"] * 6
    sock = _headers_only_calls(server.port, paths)
    try:
        time.sleep(1.0)
        _honest_calls(server)  # within 5 s each; before: every call of everyone hung behind the 24 stalled ones
        _honest_calls(server)
        gate = getattr(server.servicer, "streams", None)
        assert gate is not None and gate.open_streams() <= gate.slots
    finally:
        sock.close()
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [r.getMessage() for r in noisy]


def test_a_dev_mode_put_and_get_stream_work_in_many_namespaces_at_once(tmp_path):
    # dev mode: each put's first message names its namespace; 6 concurrent puts (2 per namespace) are admitted
    store = open_embedded_store(tmp_path / "data")
    server = start_server(store, limits=ServerLimits(idle_timeout_s=5), max_workers=16)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        namespace = f"ns{i % 3}"
        try:
            with RemoteStore(f"127.0.0.1:{server.port}", namespace=namespace, timeout_s=WAIT_S) as remote:
                block = make_block([i, 1, 2], namespace=namespace)
                assert remote.put_many([(key_of(block), block)]) == 1
                assert_same_block(remote.get_many([key_of(block)], fingerprint=FINGERPRINT)[0], block)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.stop(0)
    store.close()
    assert not errors, errors


def test_malformed_requests_to_health_and_reflection_are_invalid_argument_and_quiet(serve, caplog):
    server = serve(workers=4)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    garbage = b"\xff\xff\xff\xff"
    check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as excinfo:
        check(garbage, timeout=WAIT_S)
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # before: INTERNAL, and a traceback logged
    reflect = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                    request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as excinfo:
        list(reflect(iter([garbage]), timeout=WAIT_S))
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [r.getMessage() for r in noisy]
    channel.close()


# -- clients retry a refused stream ------------------------------------------------------------------


def _cap_held_by_an_idle_put(serve):
    """A server whose tenants may open one stream each, tenant A's taken by an idle put until ``release`` is set."""
    server = serve(workers=16, tenant_streams=1, idle_timeout_s=60)
    channel, stub = _stub(server)
    release = threading.Event()
    holder = _idle_put(stub, TOKEN_A, release)
    assert _wait_for(lambda: server.servicer.streams.open_streams("tenant-a") == 1)
    return server, channel, stub, release, holder


def test_remote_store_retries_a_stream_refused_at_the_tenant_cap(serve):
    """A tenant at its stream cap is refused with the retry trailer; ``RemoteStore`` waits and retries, so a busy
    tenant's workers queue for a slot instead of failing (before: RemoteStoreError RESOURCE_EXHAUSTED at once)."""
    server, channel, stub, release, holder = _cap_held_by_an_idle_put(serve)
    block = make_block([4, 5, 6], namespace="tenant-a")
    results: dict[str, object] = {}

    def put_and_get() -> None:
        with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_A, namespace="tenant-a", timeout_s=WAIT_S,
                         shared_memory=False) as store:
            results["stored"] = store.put_many([(key_of(block), block)])
            results["got"] = store.get_many([key_of(block)], fingerprint=FINGERPRINT)[0]

    worker = threading.Thread(target=put_and_get)
    worker.start()
    time.sleep(0.3)  # the put is refused (cap 1, held by the idle stream) and retried meanwhile
    assert worker.is_alive()
    release.set()
    assert holder.result(timeout=WAIT_S).stored == 0
    worker.join(WAIT_S)
    assert results.get("stored") == 1
    assert_same_block(results["got"], block)
    assert server.servicer.streams.refused >= 1
    channel.close()


def test_remote_store_gives_up_on_a_refused_stream_after_its_timeout(serve):
    server, channel, stub, release, holder = _cap_held_by_an_idle_put(serve)
    block = make_block([7, 7, 7], namespace="tenant-a")
    with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_A, namespace="tenant-a", timeout_s=0.5,
                     shared_memory=False) as store:
        with pytest.raises(RemoteStoreError) as refused:
            store.put_many([(key_of(block), block)])
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "cap" in str(refused.value)
    release.set()
    holder.result(timeout=WAIT_S)
    channel.close()


def test_stats_report_the_tenants_streams_and_the_servers_refusals(serve):
    server, channel, stub, release, holder = _cap_held_by_an_idle_put(serve)
    refused = _idle_put(stub, TOKEN_A, threading.Event())
    assert _code_within(refused) == grpc.StatusCode.RESOURCE_EXHAUSTED
    with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_A, namespace="tenant-a", shared_memory=False) as store:
        streams = store.stats()["streams"]
    assert streams["open"] == 1 and streams["cap"] == 1 and streams["server_refused"] >= 1
    release.set()
    holder.result(timeout=WAIT_S)
    channel.close()
