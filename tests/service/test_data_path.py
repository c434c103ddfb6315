"""The bulk data path (``service/bulk/``) on a real server (127.0.0.1, free ports) over a real LMDB store in tmp_path.

``RemoteStore`` uses it by default (gets then return ``bytearray`` values, received straight into their buffers;
the gRPC path returns ``bytes``: the type tells which path served a get). Bad inputs come from raw sockets and a raw
gRPC channel: each is refused with a clear status, on the data connection and on the control call, the server keeps
serving and nothing half-written is stored.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest
from helpers import FINGERPRINT, assert_same_block, key_of, make_block
from service_helpers import TOKENS, data_path_call, self_signed_cert, write_tokens

from kvshelf.kvstore import encode_block, open_embedded_store
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.auth import TokenTable
from kvshelf.service.bulk.framing import (
    DONE,
    END_MARK,
    HELLO_HEAD,
    REFUSED,
    REPLY_HEAD,
    STATUS,
    VALUE,
    Entry,
    encode_hello,
    parse_reply_head,
    status_code,
    trailer_checksum,
)
from kvshelf.service.bulk.ticket import OP_GET, OP_PUT
from kvshelf.service.client import RemoteStore, RemoteStoreError
from kvshelf.service.server import ServerLimits, start_server

TOKEN_A, TOKEN_B = list(TOKENS)
IDLE_S = 1.0  # the servers' idle timeout: tickets and hellos wait half of it


@pytest.fixture
def server(tmp_path):
    store = open_embedded_store(tmp_path / "data")
    running = start_server(store, limits=ServerLimits(idle_timeout_s=IDLE_S, data_handshakes=4))
    yield running
    running.stop(0)
    store.close()


@pytest.fixture
def tenant_server(tmp_path):
    store = open_embedded_store(tmp_path / "data")
    tokens = TokenTable.from_file(write_tokens(tmp_path / "tokens.toml"))
    running = start_server(store, tokens=tokens,
                           limits=ServerLimits(quota_bytes=200_000, idle_timeout_s=IDLE_S, tenant_streams=2))
    yield running
    running.stop(0)
    store.close()


def remote(server, **options) -> RemoteStore:
    return RemoteStore(f"127.0.0.1:{server.port}", shared_memory=False, **options)


def encoded(tokens, namespace="default", **shape) -> tuple[bytes, bytes]:
    block = make_block(tokens, namespace=namespace, **shape)
    return key_of(block), encode_block(block, key_of(block))


def open_data_path(server) -> tuple[grpc.Channel, grpc.UnaryStreamMultiCallable]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return channel, data_path_call(channel)


class Control:
    """A raw ``OpenDataPath`` call: its ticket, then its outcome."""

    def __init__(self, server, op: int, items, *, token: str | None = None, namespace: str = "default") -> None:
        self.channel, stream = open_data_path(server)
        sizes = [len(v) for _, v in items] if op == OP_PUT else []
        request = pb.DataPathRequest(namespace=namespace if token is None else "", op=op, keys=[k for k, _ in items],
                                     sizes=sizes)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.call = stream(request, timeout=30, metadata=metadata)
        first = next(self.call)
        self.ticket, self.port = first.ticket.ticket, first.ticket.port

    def outcome(self) -> grpc.StatusCode:
        """The call's final status (OK after its result message)."""
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as exc:
            return exc.code()
        finally:
            self.channel.close()
        return grpc.StatusCode.OK

    def details(self) -> str:
        return self.call.details() or ""


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def put_hello(ticket: bytes, items, namespace: str = "default") -> bytes:
    return encode_hello(OP_PUT, ticket, namespace, [Entry(k, len(v), trailer_checksum(v)) for k, v in items])


def read_status(sock: socket.socket) -> tuple[grpc.StatusCode, str]:
    """The last frame of a data connection: a refusal's status, or OK for an end frame (skipping any values)."""
    buf = b""
    while True:
        while len(buf) < REPLY_HEAD.size:
            more = sock.recv(1 << 16)
            assert more, f"the connection closed without a status frame ({buf!r})"
            buf += more
        head = parse_reply_head(buf[: REPLY_HEAD.size], 1 << 30)
        buf = buf[REPLY_HEAD.size :]
        if head.kind == DONE:
            return grpc.StatusCode.OK, f"{head.count} values, {head.stored} stored"
        need = head.size if head.kind == VALUE else head.message_bytes if head.kind in (STATUS, REFUSED) else 0
        while len(buf) < need:
            more = sock.recv(1 << 16)
            assert more, "the connection closed inside a frame"
            buf += more
        if head.kind in (STATUS, REFUSED):
            return status_code(head.code), buf[:need].decode()
        buf = buf[need:]


def held(server, keys, token: str | None = None, namespace: str = "default") -> list[bool]:
    with RemoteStore(f"127.0.0.1:{server.port}", token=token, namespace=namespace) as store:
        return store.held(keys)


def still_serving(server, token: str | None = None, namespace: str = "default") -> None:
    with remote(server, token=token, namespace=namespace) as store:
        block = make_block([7, 7, 7], namespace=namespace)
        assert store.put_many([(key_of(block), block)]) == 1
        got = store.get_encoded_many([key_of(block)])
        assert isinstance(got[0], bytearray)  # through the data path
        assert_same_block(store.get_many([key_of(block)], fingerprint=FINGERPRINT)[0], block)
        assert store.stats()["streams"]["open"] == 0


# -- round trips ------------------------------------------------------------------------------------------------


def test_remote_store_moves_values_over_the_data_path(server):
    big = make_block(300, layers=4, heads=8, head_dim=128)  # ~9.8 MB: larger than a gRPC chunk
    small = make_block([1, 2, 3])
    with remote(server) as store:
        assert store.put_many([(key_of(big), big), (key_of(small), small)]) == 2
        values = store.get_encoded_many([key_of(big), b"\x00" * 16, key_of(small)])
        assert [type(v) for v in values] == [bytearray, type(None), bytearray]
        assert bytes(values[0]) == encode_block(big, key_of(big))
        got = store.get_many([key_of(big), key_of(small)], fingerprint=FINGERPRINT)
        assert_same_block(got[0], big)
        assert_same_block(got[1], small)
        prepared = store.get_prepared_many([key_of(big), key_of(small)], fingerprint=FINGERPRINT)
        assert all(p is not None for p in prepared)
        assert store.put_many([(key_of(small), small)], pin=True) == 1
        assert store.stats()["pinned"] == 1
    with RemoteStore(f"127.0.0.1:{server.port}", data_path=False, shared_memory=False) as grpc_only:
        assert type(grpc_only.get_encoded_many([key_of(small)])[0]) is bytes  # the option turns it off


def test_data_connections_are_kept_between_transfers(server):
    listener = server.servicer.data_path.listener
    items = [encoded([i, i + 1]) for i in range(4)]
    with remote(server) as store:
        for item in items:
            assert store.put_encoded_many([item]) == 1
            assert store.get_encoded_many([item[0]]) == [item[1]]
        assert listener.accepted == 1  # eight transfers, one connection
        listener.keepalive_s = 0.05  # the server now drops a kept connection soon; the client does not know
        store.put_encoded_many([items[0]])
        time.sleep(0.5)
        got = store.get_encoded_many([items[0][0]])  # on its kept, now closed, connection: then on a fresh one
        assert isinstance(got[0], bytearray) and got == [items[0][1]]
        assert listener.accepted == 2
    assert server.servicer.streams.open_streams() == 0


def test_tls_data_connection(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    store = open_embedded_store(tmp_path / "data")
    running = start_server(store, tls_cert=cert.read_bytes(), tls_key=key.read_bytes())
    try:
        with RemoteStore(f"localhost:{running.port}", tls_ca=cert, shared_memory=False) as secure:
            key_, value = encoded(300, layers=2, heads=2, head_dim=64)
            assert secure.put_encoded_many([(key_, value)]) == 1
            got = secure.get_encoded_many([key_])[0]
            assert isinstance(got, bytearray) and got == value
        with connect(running.data_port) as plain:  # plaintext to the TLS data port: no hello gets through
            plain.sendall(encode_hello(OP_GET, b"t" * 82, "default", []))
            try:
                reply = plain.recv(1 << 16)  # a TLS alert, or the connection closed
            except ConnectionResetError:
                reply = b""
            assert not reply.startswith(STATUS)
    finally:
        running.stop(0)
        store.close()


# -- fallback -----------------------------------------------------------------------------------------------------


def test_falls_back_to_grpc_when_the_server_has_no_data_path(tmp_path):
    store = open_embedded_store(tmp_path / "data")
    running = start_server(store, limits=ServerLimits(data_path=False))
    try:
        assert running.data_port is None
        with remote(running) as client:
            key_, value = encoded([1, 2, 3])
            assert client.put_encoded_many([(key_, value)]) == 1
            assert type(client.get_encoded_many([key_])[0]) is bytes
            assert client._data_path is None  # noqa: SLF001 - the server said it has none: not asked again
    finally:
        running.stop(0)
        store.close()


def test_falls_back_to_grpc_when_the_data_port_is_unreachable(server):
    server.servicer.data_path.listener.close()  # as a firewall between client and data port would: refused
    key_, value = encoded([4, 5, 6])
    with remote(server) as client:
        assert client.put_encoded_many([(key_, value)]) == 1
        assert type(client.get_encoded_many([key_])[0]) is bytes
    assert server.servicer.streams.open_streams() == 0


# -- limits before buffering ---------------------------------------------------------------------------------------


def test_quota_and_block_size_are_checked_before_any_byte_is_sent(tenant_server):
    key_, value = encoded(200, namespace="tenant-a", layers=2, heads=2, head_dim=64)  # > the 200_000 quota
    with remote(tenant_server, token=TOKEN_A, namespace="tenant-a") as store:
        with pytest.raises(RemoteStoreError, match="quota of 200000 bytes exceeded") as excinfo:
            store.put_encoded_many([(key_, value)])
        assert excinfo.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    channel, stream = open_data_path(tenant_server)
    huge = pb.DataPathRequest(op=OP_PUT, keys=[key_], sizes=[1 << 40])
    with pytest.raises(grpc.RpcError) as refused:
        next(stream(huge, timeout=10, metadata=(("authorization", f"Bearer {TOKEN_A}"),)))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds the max block size" in refused.value.details()
    channel.close()
    still_serving(tenant_server, TOKEN_A, "tenant-a")


def test_back_to_back_puts_up_to_the_quota_are_all_accepted(tenant_server):
    """A put's reservation is released before its end frame: the client's next put, started as soon as that frame
    arrives, must not find the previous put's bytes still counted as being written (4 blocks of ~41 KB fit the
    200,000-byte quota; a stale reservation would refuse the fourth)."""
    with remote(tenant_server, token=TOKEN_A, namespace="tenant-a") as store:
        for round_ in range(16):
            items = [encoded([round_ * 100 + i] * 20, namespace="tenant-a", layers=2, heads=2, head_dim=64)
                     for i in range(4)]
            assert sum(len(v) for _, v in items) < 200_000 < sum(len(v) for _, v in items) + len(items[0][1])
            for item in items:
                assert store.put_encoded_many([item]) == 1
            assert store.delete([k for k, _ in items]) == 4


# -- bad tickets ---------------------------------------------------------------------------------------------------


def test_forged_ticket_is_unauthenticated(server):
    items = [encoded([1, 2])]
    control = Control(server, OP_PUT, items)
    forged = bytearray(control.ticket)
    forged[-1] ^= 1
    with connect(control.port) as sock:
        sock.sendall(put_hello(bytes(forged), items))
        code, message = read_status(sock)
    assert (code, "forged ticket" in message) == (grpc.StatusCode.UNAUTHENTICATED, True)
    assert control.outcome() == grpc.StatusCode.DEADLINE_EXCEEDED  # its real ticket never came
    assert "no data connection presented the ticket" in control.details()
    assert held(server, [items[0][0]]) == [False]
    still_serving(server)


def test_replayed_ticket_is_unauthenticated(server):
    items = [encoded([1, 2])]
    control = Control(server, OP_PUT, items)
    with connect(control.port) as sock:
        sock.sendall(put_hello(control.ticket, items) + items[0][1] + END_MARK)
        assert read_status(sock)[0] == grpc.StatusCode.OK
    assert control.outcome() == grpc.StatusCode.OK
    with connect(control.port) as sock:
        sock.sendall(put_hello(control.ticket, items) + items[0][1] + END_MARK)
        code, message = read_status(sock)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "replayed ticket" in message
    assert held(server, [items[0][0]]) == [True]
    still_serving(server)


def test_expired_ticket_is_unauthenticated(server):
    items = [encoded([3])]
    control = Control(server, OP_GET, items)
    assert control.outcome() == grpc.StatusCode.DEADLINE_EXCEEDED  # the call waited its ticket's lifetime
    with connect(control.port) as sock:
        sock.sendall(encode_hello(OP_GET, control.ticket, "default", [Entry(items[0][0])]))
        code, message = read_status(sock)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "expired ticket" in message
    still_serving(server)


def test_ticket_of_another_namespace_is_permission_denied(tenant_server):
    key_b, value_b = encoded([9, 9], namespace="tenant-b")
    with remote(tenant_server, token=TOKEN_B, namespace="tenant-b") as b:
        assert b.put_encoded_many([(key_b, value_b)]) == 1
    control = Control(tenant_server, OP_GET, [(key_b, b"")], token=TOKEN_A)  # tenant A asks for B's key
    with connect(control.port) as sock:  # and names B's namespace on the data connection
        sock.sendall(encode_hello(OP_GET, control.ticket, "tenant-b", [Entry(key_b)]))
        code, message = read_status(sock)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "another namespace" in message
    assert control.outcome() == grpc.StatusCode.PERMISSION_DENIED
    control = Control(tenant_server, OP_GET, [(key_b, b"")], token=TOKEN_A)  # in its own namespace: a miss
    with connect(control.port) as sock:
        sock.sendall(encode_hello(OP_GET, control.ticket, "tenant-a", [Entry(key_b)]))
        assert sock.recv(REPLY_HEAD.size, socket.MSG_WAITALL)[:1] == b"M"  # never B's value
    assert control.outcome() == grpc.StatusCode.OK
    still_serving(tenant_server, TOKEN_A, "tenant-a")


def test_ticket_for_other_keys_or_op_is_permission_denied(server):
    items = [encoded([1]), encoded([2])]
    control = Control(server, OP_PUT, items)
    with connect(control.port) as sock:
        sock.sendall(put_hello(control.ticket, items[::-1]))
        code, message = read_status(sock)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "other keys" in message
    assert control.outcome() == grpc.StatusCode.PERMISSION_DENIED
    control = Control(server, OP_PUT, items)
    with connect(control.port) as sock:
        sock.sendall(encode_hello(OP_GET, control.ticket, "default", [Entry(k) for k, _ in items]))
        code, message = read_status(sock)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "the ticket is for a PUT" in message
    assert control.outcome() == grpc.StatusCode.PERMISSION_DENIED
    assert held(server, [k for k, _ in items]) == [False, False]


# -- bad data connections ------------------------------------------------------------------------------------------


def test_fewer_bytes_than_announced_is_data_loss(server):
    items = [encoded([1, 2, 3]), encoded([4, 5])]
    control = Control(server, OP_PUT, items)
    with connect(control.port) as sock:
        sock.sendall(put_hello(control.ticket, items) + items[0][1] + items[1][1][:-5])
        sock.shutdown(socket.SHUT_WR)
        code, message = read_status(sock)
    assert code == grpc.StatusCode.DATA_LOSS and "closed after" in message
    assert control.outcome() == grpc.StatusCode.DATA_LOSS
    assert held(server, [k for k, _ in items]) == [False, False]  # nothing half-written: not even the whole first
    still_serving(server)


def test_more_bytes_than_announced_is_data_loss(server):
    items = [encoded([1, 2, 3])]
    control = Control(server, OP_PUT, items)
    with connect(control.port) as sock:
        sock.sendall(put_hello(control.ticket, items) + items[0][1] + b"extra bytes" + END_MARK)
        code, message = read_status(sock)
    assert code == grpc.StatusCode.DATA_LOSS and "not the sizes announced" in message
    assert control.outcome() == grpc.StatusCode.DATA_LOSS
    assert held(server, [items[0][0]]) == [False]


def test_garbage_values_are_data_loss(server):
    key_, value = encoded([1, 2, 3])
    garbage = bytes(len(value) - 8) + trailer_checksum(value)  # the announced checksum, other bytes
    control = Control(server, OP_PUT, [(key_, garbage)])
    with connect(control.port) as sock:
        sock.sendall(encode_hello(OP_PUT, control.ticket, "default", [Entry(key_, len(garbage), value[-8:])])
                     + garbage + END_MARK)
        code, message = read_status(sock)
    assert code == grpc.StatusCode.DATA_LOSS and "damaged" in message
    assert control.outcome() == grpc.StatusCode.DATA_LOSS
    control = Control(server, OP_PUT, [(key_, value)])
    with connect(control.port) as sock:  # a checksum that is not the value's own
        sock.sendall(encode_hello(OP_PUT, control.ticket, "default", [Entry(key_, len(value), b"x" * 8)])
                     + value + END_MARK)
        code, message = read_status(sock)
    assert code == grpc.StatusCode.DATA_LOSS and "announced checksum" in message
    assert control.outcome() == grpc.StatusCode.DATA_LOSS
    with connect(server.data_port) as sock:  # garbage instead of a hello
        sock.sendall(b"\x16\x03\x01 not a hello at all")
        code, message = read_status(sock)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "not a kvshelf data connection" in message
    assert held(server, [key_]) == [False]
    still_serving(server)


def test_stalled_transfer_is_deadline_exceeded(server):
    items = [encoded(300, layers=2, heads=2, head_dim=64)]
    control = Control(server, OP_PUT, items)
    with connect(control.port) as sock:
        sock.sendall(put_hello(control.ticket, items) + items[0][1][:1000])  # then nothing
        assert control.outcome() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "below the minimum rate" in control.details() or "made no progress" in control.details()
    assert held(server, [items[0][0]]) == [False]
    still_serving(server)


def test_connection_that_never_sends_the_ticket_is_deadline_exceeded(server):
    items = [encoded([5])]
    control = Control(server, OP_GET, items)
    with connect(control.port) as sock:
        sock.sendall(b"KVBD")  # part of a head, never the ticket
        code, message = read_status(sock)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "bytes of the hello in time" in message
    assert control.outcome() == grpc.StatusCode.DEADLINE_EXCEEDED
    still_serving(server)


def test_many_data_connections_are_resource_exhausted(server):
    idle = [connect(server.data_port) for _ in range(2)]  # data_handshakes=4: 2 per peer host in their handshake
    try:
        time.sleep(0.1)  # let the listener take them (they are accepted in order)
        with connect(server.data_port) as extra:
            assert extra.recv(1, socket.MSG_PEEK) == REFUSED  # refused before anything was read
            code, message = read_status(extra)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in their handshake" in message
        key_, value = encoded([8, 8])
        with remote(server) as store:  # a client whose data connection is refused so: gRPC for that call
            assert store.put_encoded_many([(key_, value)]) == 1
            assert type(store.get_encoded_many([key_])[0]) is bytes
    finally:
        for sock in idle:
            sock.close()
    still_serving(server)  # then the data path again


def test_many_control_calls_of_one_tenant_are_resource_exhausted(tenant_server):
    key_, _ = encoded([1], namespace="tenant-a")
    held_calls = [Control(tenant_server, OP_GET, [(key_, b"")], token=TOKEN_A) for _ in range(2)]  # the cap
    channel, stream = open_data_path(tenant_server)
    with pytest.raises(grpc.RpcError) as refused:
        next(stream(pb.DataPathRequest(op=OP_GET, keys=[key_]), timeout=10,
                    metadata=(("authorization", f"Bearer {TOKEN_A}"),)))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "already has 2" in refused.value.details()
    channel.close()
    for control in held_calls:
        control.outcome()
    still_serving(tenant_server, TOKEN_B, "tenant-b")  # the other tenant was never held up


def test_get_client_that_stops_reading_is_ended(server):
    key_, value = encoded(2000, layers=4, heads=8, head_dim=128)  # ~65 MB: more than the socket buffers hold
    with remote(server) as store:
        assert store.put_encoded_many([(key_, value)]) == 1
    control = Control(server, OP_GET, [(key_, b"")] * 4)
    with connect(control.port) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        sock.sendall(encode_hello(OP_GET, control.ticket, "default", [Entry(key_)] * 4))
        assert control.outcome() == grpc.StatusCode.DEADLINE_EXCEEDED  # then reads nothing
    still_serving(server)


def test_hello_head_size_is_fixed():
    assert HELLO_HEAD.size == 14 and struct.calcsize("<cQ8s") == REPLY_HEAD.size == 17


# -- hardening: supervised listener, bounded reads, caps -----------------------------------------------------------


def failing_thread_starts(monkeypatch, name: str, count: int) -> list[int]:
    """Make the next ``count`` starts of threads named ``name`` fail as they do at the process's task limit (the
    real ``RuntimeError`` of ``Thread.start``); the list holds how many failures are left."""
    real_start = threading.Thread.start
    left = [count]

    def start(thread: threading.Thread) -> None:
        if thread.name == name and left[0] > 0:
            left[0] -= 1
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return left


def wait_for(condition, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``condition()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.01)


def test_accept_loop_survives_threads_that_cannot_start(server, monkeypatch):
    listener = server.servicer.data_path.listener
    left = failing_thread_starts(monkeypatch, "kvshelf-data-handshake", 3)
    for _ in range(3):  # each refused at once, naming why; the listener goes on
        with connect(server.data_port) as sock:
            sock.settimeout(10)
            assert sock.recv(1, socket.MSG_PEEK) == REFUSED
            code, message = read_status(sock)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "cannot start a thread" in message
    assert left == [0] and listener.thread_failures == 3 and listener.held() == 0
    assert listener.alive()
    still_serving(server)  # transfers on new data connections go on
    left = failing_thread_starts(monkeypatch, "kvshelf-data-kept", 1)  # a connection that cannot be kept is closed
    key_, value = encoded([6, 6])
    with remote(server) as store:
        assert store.put_encoded_many([(key_, value)]) == 1
        wait_for(lambda: left == [0])  # the server keeps a connection as its call ends, after the client has its end
        assert listener.held() == 0
        got = store.get_encoded_many([key_])  # its kept connection was closed: a fresh one
        assert isinstance(got[0], bytearray) and got == [value]
    assert listener.alive() and server.servicer.streams.open_streams() == 0


def test_remote_store_falls_back_when_the_data_port_takes_no_hello(server):
    """A data port that accepts connections (its kernel does) and reads nothing: the control call ends when its
    ticket expires, saying no data connection presented it, and the client uses gRPC instead of waiting on the data
    connection to its own deadline."""
    silent = socket.create_server(("127.0.0.1", 0), backlog=16)  # never accept()ed, never read
    server.servicer.data_path.listener.port = silent.getsockname()[1]
    try:
        key_, value = encoded(300, layers=4, heads=8, head_dim=128)  # ~9.8 MB: more than the socket buffers take
        with remote(server, timeout_s=20) as store:
            assert store.put_encoded_many([(key_, value)]) == 1  # stored over gRPC
            got = store.get_encoded_many([key_])
            assert type(got[0]) is bytes and got == [value]  # gRPC too (the data path rests a while)
    finally:
        silent.close()
    assert server.servicer.streams.open_streams() == 0


def kept_connection(server, key_: bytes) -> socket.socket:
    """A raw data connection whose get (a miss) ended cleanly: the server keeps it for its next hello."""
    control = Control(server, OP_GET, [(key_, b"")])
    sock = connect(control.port)
    sock.sendall(encode_hello(OP_GET, control.ticket, "default", [Entry(key_)]))
    assert read_status(sock) == (grpc.StatusCode.OK, "1 values, 0 stored")
    assert control.outcome() == grpc.StatusCode.OK  # the call is over, and its connection kept
    return sock


def test_kept_connections_count_against_the_per_host_cap(server):
    """data_handshakes=4: at most 2 connections of one host held, in their handshake or kept."""
    key_, _ = encoded([3, 1])
    kept = [kept_connection(server, key_) for _ in range(2)]
    try:
        with connect(server.data_port) as extra:
            extra.settimeout(10)
            assert extra.recv(1, socket.MSG_PEEK) == REFUSED  # refused at once, before any hello
            code, message = read_status(extra)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in their handshake or kept (at most 2)" in message
        control = Control(server, OP_GET, [(key_, b"")])  # a kept connection's next transfer holds its place
        kept[0].sendall(encode_hello(OP_GET, control.ticket, "default", [Entry(key_)]))
        assert read_status(kept[0])[0] == grpc.StatusCode.OK
        assert control.outcome() == grpc.StatusCode.OK
        assert server.servicer.data_path.listener.held("127.0.0.1") == 2
    finally:
        for sock in kept:
            sock.close()
    still_serving(server)


def retrieved_blocks(server) -> int:
    with RemoteStore(f"127.0.0.1:{server.port}") as store:
        rows = store.stats()["rows"]
    return sum(r.get("retrieve_blocks", 0) for r in rows if r["tier"] == "*")  # the keys the store was asked for


@pytest.mark.parametrize("data_path", [True, False])
def test_duplicate_keys_are_read_once_and_answered_in_order(server, data_path):
    a, b = encoded([1, 1]), encoded([2, 2])
    missing = b"\x07" * 16
    keys = [a[0]] * 16 + [b[0], missing, a[0], b[0], missing]
    with remote(server, data_path=data_path) as store:
        assert store.put_encoded_many([a, b]) == 2
        before = retrieved_blocks(server)
        got = store.get_encoded_many(keys)
        assert [bytes(v) if v is not None else None for v in got] == [a[1]] * 16 + [b[1], None, a[1], b[1], None]
        assert isinstance(got[0], bytearray if data_path else bytes)
    assert retrieved_blocks(server) - before == 3  # each distinct key read once


@pytest.mark.parametrize("data_path", [True, False])
def test_large_values_named_again_are_answered_in_order(server, data_path):
    """Values past what a get keeps for their later places (16 MiB in all, always the first) are read again there:
    every answer is still the right value, in order."""
    a, b = encoded(300, layers=4, heads=8, head_dim=128), encoded(301, layers=4, heads=8, head_dim=128)  # ~9.8 MB
    with remote(server, data_path=data_path) as store:
        assert store.put_encoded_many([a]) == 1 and store.put_encoded_many([b]) == 1
        before = retrieved_blocks(server)
        got = store.get_encoded_many([a[0], b[0], a[0], b[0], a[0]])
        assert [bytes(v) for v in got] == [a[1], b[1], a[1], b[1], a[1]]
    assert 2 <= retrieved_blocks(server) - before < 5  # the first value kept for its later places
