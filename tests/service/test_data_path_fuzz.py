"""The bulk data path's listener fuzzed over real sockets (hypothesis, derandomized): random and mutated hellos, with
forged tickets and with real ones (an ``OpenDataPath`` call of a real server on 127.0.0.1 per example), are each
answered by one well-formed status frame (never INTERNAL or UNKNOWN) or a closed connection, within the handshake
deadline; the listener lives on, holds nothing afterwards, and transfers still work. The parsers alone are fuzzed in
``test_data_path_framing.py`` (``tests/support/fuzz_bulk.py``)."""

from __future__ import annotations

import random
import socket

import grpc
import pytest
from fuzz_bulk import SEEDS
from fuzz_driver import mutate
from helpers import key_of, make_block
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_helpers import data_path_call

from kvshelf.kvstore import encode_block, open_embedded_store
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.bulk.framing import (
    DONE,
    MAX_STATUS_MESSAGE_BYTES,
    REFUSED,
    REPLY_HEAD,
    STATUS,
    VALUE,
    Entry,
    encode_hello,
    parse_reply_head,
    status_code,
)
from kvshelf.service.bulk.ticket import OP_GET, OP_PUT
from kvshelf.service.client import RemoteStore
from kvshelf.service.server import ServerLimits, start_server

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
#: what a refused hello may be answered with (a client's fault, a deadline, a busy port)
ALLOWED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.DATA_LOSS,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = open_embedded_store(tmp_path_factory.mktemp("fuzz") / "data")
    running = start_server(store, limits=ServerLimits(idle_timeout_s=1.0, strike_burst=0))
    block = make_block([1, 2, 3])
    with RemoteStore(f"127.0.0.1:{running.port}", shared_memory=False) as client:
        assert client.put_encoded_many([(key_of(block), encode_block(block, key_of(block)))]) == 1
    running.stored_key = key_of(block)
    yield running
    running.stop(0)
    store.close()


def recv_all(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            break
        data += more
    return data


def answer(server, raw: bytes) -> tuple[bytes, grpc.StatusCode | None]:
    """Send ``raw`` as a data connection's first bytes (then end the sending side); the kind of the last frame that
    came back and its status (OK for an end frame), or ``(b"", None)`` for a connection closed without one. Frames
    before the last must be values or misses (a hello that happens to be a real get)."""
    with socket.create_connection(("127.0.0.1", server.data_port), timeout=10) as sock:
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # refused before all was sent: its frame may still be there
            pass
        while True:
            head = recv_all(sock, REPLY_HEAD.size)
            if not head:
                return b"", None
            assert len(head) == REPLY_HEAD.size, f"a cut reply head {head!r}"
            reply = parse_reply_head(head, 1 << 30)
            if reply.kind == DONE:
                return DONE, grpc.StatusCode.OK
            if reply.kind in (STATUS, REFUSED):
                assert reply.message_bytes <= MAX_STATUS_MESSAGE_BYTES
                message = recv_all(sock, reply.message_bytes)
                assert len(message) == reply.message_bytes
                message.decode("utf-8")
                return reply.kind, status_code(reply.code)
            if reply.kind == VALUE:
                assert len(recv_all(sock, reply.size)) == reply.size


def check_listener(server) -> None:
    listener = server.servicer.data_path.listener
    assert listener.alive()


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_on_the_data_port(server, raw):
    kind, code = answer(server, raw)
    assert kind in (b"", STATUS, REFUSED) and (code is None or code in ALLOWED), (kind, code)
    check_listener(server)


@FUZZ
@given(st.sampled_from(SEEDS), st.randoms(use_true_random=False))
def test_mutated_hellos_with_forged_tickets(server, seed, rng: random.Random):
    kind, code = answer(server, mutate(seed, rng))
    assert kind in (b"", STATUS, REFUSED) and (code is None or code in ALLOWED), (kind, code)
    check_listener(server)


@FUZZ
@given(st.sampled_from([OP_GET, OP_PUT]), st.randoms(use_true_random=False), st.booleans())
def test_mutated_hellos_with_real_tickets(server, op, rng: random.Random, mutated):
    """A real ticket of a real call, its hello mutated past the ticket (namespace, count, entries) or sent as is;
    the call ends with the status its data connection got (a client's fault or a deadline, never INTERNAL)."""
    key_ = server.stored_key
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        open_call = data_path_call(channel)
        sizes = [64] if op == OP_PUT else []
        call = open_call(pb.DataPathRequest(op=op, keys=[key_], sizes=sizes), timeout=10)
        ticket = next(call).ticket.ticket
        entry = Entry(key_, 64, bytes(8)) if op == OP_PUT else Entry(key_)
        hello = encode_hello(op, ticket, "default", [entry])
        cut = 14 + len(ticket)  # the head and the ticket stay as issued
        raw = hello[:cut] + mutate(hello[cut:], rng) if mutated else hello
        kind, code = answer(server, raw)
        if kind in (STATUS, REFUSED):
            assert code in ALLOWED, code
        try:
            for _ in call:
                pass
            outcome = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            outcome = exc.code()
        assert outcome not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), outcome
        if not mutated and op == OP_GET:
            assert (kind, outcome) == (DONE, grpc.StatusCode.OK)
    finally:
        channel.close()
    check_listener(server)


def test_the_listener_serves_after_the_fuzzing(server):
    listener = server.servicer.data_path.listener
    with RemoteStore(f"127.0.0.1:{server.port}", shared_memory=False) as client:
        got = client.get_encoded_many([server.stored_key])
        assert isinstance(got[0], bytearray)
    assert listener.alive()
