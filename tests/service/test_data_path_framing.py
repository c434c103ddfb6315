"""The bulk data path's tickets and framing (``service/bulk/ticket.py``, ``service/bulk/framing.py``), alone.

Property tests (hypothesis, derandomized): random hellos round trip; random and mutated bytes are read or refused
with our own errors only (``tests/support/fuzz_bulk.py``, also an atheris target); no mutation of a ticket passes.
"""

from __future__ import annotations

import random

import grpc
import pytest
import xxhash
from fuzz_bulk import SEEDS, SIGNER, TICKET, check_hello, check_ticket, fuzz_one
from fuzz_driver import mutate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshelf.service.bulk.framing import (
    HELLO_HEAD,
    MAX_VALUES,
    MISS,
    REPLY_HEAD,
    STATUS,
    VALUE,
    Entry,
    check_end,
    check_value,
    encode_hello,
    encode_status,
    encode_value_head,
    parse_hello,
    parse_reply_head,
    trailer_checksum,
)
from kvshelf.service.bulk.ticket import OP_GET, OP_PUT, ReplayGuard, TicketSigner
from kvshelf.service.errors import FramingError, TicketError
from kvshelf.service.server import MAX_KEYS_PER_CALL

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

keys = st.binary(min_size=16, max_size=16)


@st.composite
def hellos(draw: st.DrawFn) -> tuple[int, bytes, str, list[Entry]]:
    op = draw(st.sampled_from([OP_GET, OP_PUT]))
    ticket = draw(st.binary(min_size=1, max_size=120))
    namespace = draw(st.text(max_size=40))
    if op == OP_PUT:
        entries = draw(st.lists(st.builds(Entry, keys, st.integers(8, 1 << 40), st.binary(min_size=8, max_size=8)),
                                max_size=5))
    else:
        entries = draw(st.lists(st.builds(Entry, keys), max_size=5))
    return op, ticket, namespace, entries


@FUZZ
@given(hellos())
def test_hellos_round_trip(case):
    op, ticket, namespace, entries = case
    raw = encode_hello(op, ticket, namespace, entries)
    hello = parse_hello(raw)
    assert (hello.op, hello.ticket, hello.namespace, list(hello.entries)) == (op, ticket, namespace, entries)
    check_hello(raw)


@FUZZ
@given(st.binary(max_size=120))
def test_random_bytes_are_read_or_refused_with_our_errors(raw):
    fuzz_one(raw)


@FUZZ
@given(st.sampled_from(SEEDS), st.randoms(use_true_random=False))
def test_mutated_frames_are_read_or_refused_with_our_errors(seed, rng: random.Random):
    fuzz_one(mutate(seed, rng))


@FUZZ
@given(st.integers(0, len(TICKET) - 1), st.integers(1, 255))
def test_no_changed_byte_of_a_ticket_passes(position, flip):
    forged = bytearray(TICKET)
    forged[position] ^= flip
    with pytest.raises(TicketError, match="forged|malformed|version"):
        SIGNER.verify(bytes(forged), now=0)
    check_ticket(bytes(forged))


def test_fuzz_fallback_loop_runs():
    rng = random.Random(1)
    for _ in range(300):
        fuzz_one(mutate(rng.choice(SEEDS), rng))


@pytest.mark.parametrize(("raw", "code", "match"), [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", grpc.StatusCode.UNAUTHENTICATED, "not a kvshelf data connection"),
    (b"KVBD\x02" + bytes(9), grpc.StatusCode.UNAUTHENTICATED, "version 2"),
    (b"KVBD\x01\x03" + bytes(8), grpc.StatusCode.UNAUTHENTICATED, "unknown data-path op 3"),
    (b"KVBD\x01\x01\x00\x00" + bytes(6), grpc.StatusCode.UNAUTHENTICATED, "ticket of 0 bytes"),
    (HELLO_HEAD.pack(b"KVBD", 1, 1, 8, 0, MAX_VALUES + 1), grpc.StatusCode.DATA_LOSS, "100001 values"),
    (HELLO_HEAD.pack(b"KVBD", 1, 1, 8, 5000, 0), grpc.StatusCode.DATA_LOSS, "namespace of 5000 bytes"),
    (HELLO_HEAD.pack(b"KVBD", 1, 1, 2, 1, 0) + b"tt\xff", grpc.StatusCode.DATA_LOSS, "not UTF-8"),
    (HELLO_HEAD.pack(b"KVBD", 1, 2, 1, 0, 1) + b"t" + bytes(16) + (3).to_bytes(8, "little") + bytes(8),
     grpc.StatusCode.DATA_LOSS, "too short to carry its checksum"),
    (HELLO_HEAD.pack(b"KVBD", 1, 1, 1, 0, 2) + b"t" + bytes(16), grpc.StatusCode.DATA_LOSS, "2 entries take 32"),
])
def test_bad_hellos_are_refused_naming_what_is_wrong(raw, code, match):
    with pytest.raises(FramingError, match=match) as excinfo:
        parse_hello(raw)
    assert excinfo.value.code == code


def test_reply_heads():
    value = encode_value_head(1234, b"c" * 8)
    assert parse_reply_head(value, 1 << 20).kind == VALUE
    assert parse_reply_head(value, 1 << 20).size == 1234
    with pytest.raises(FramingError, match="exceeds this client's limit of 1000"):
        parse_reply_head(value, 1000)
    status = encode_status(grpc.StatusCode.PERMISSION_DENIED, "x" * 10_000)
    head = parse_reply_head(status[: REPLY_HEAD.size], 1 << 20)
    assert (head.kind, head.code, head.message_bytes) == (STATUS, 7, 4096)  # the message is cut to 4 KiB
    assert parse_reply_head(REPLY_HEAD.pack(b"M", 0, bytes(8)), 1).kind == MISS
    with pytest.raises(FramingError, match="unknown code 99"):
        parse_reply_head(REPLY_HEAD.pack(b"S", 99, bytes(8)), 1)
    with pytest.raises(FramingError, match="unknown reply frame"):
        parse_reply_head(REPLY_HEAD.pack(b"Z", 0, bytes(8)), 1)


def test_value_checksums():
    body = b"an encoded block's bytes"
    value = body + xxhash.xxh3_64_digest(body)
    assert trailer_checksum(value) == value[-8:]
    check_value(b"k" * 16, bytearray(value), trailer_checksum(value))
    damaged = bytearray(value)
    damaged[3] ^= 1
    with pytest.raises(FramingError, match="fails its checksum") as excinfo:
        check_value(b"k" * 16, damaged, trailer_checksum(value))
    assert excinfo.value.code == grpc.StatusCode.DATA_LOSS
    with pytest.raises(FramingError, match="does not end with its announced checksum"):
        check_value(b"k" * 16, value, b"x" * 8)
    with pytest.raises(FramingError, match="not the sizes announced"):
        check_end(b"KVBX")


def test_tickets_bind_op_namespace_keys_and_expire():
    signer = TicketSigner()
    ticket, claims = signer.issue(OP_GET, "team-a", [b"a" * 16, b"b" * 16], ttl_s=5, now=1000)
    got = signer.verify(ticket, now=1004)
    assert (got.op, got.nonce, got.digest) == (OP_GET, claims.nonce, claims.digest)
    assert got.for_namespace("team-a") and not got.for_namespace("team-b")
    assert signer.issue(OP_GET, "team-a", [b"b" * 16, b"a" * 16], 5)[1].digest != claims.digest  # order counts
    with pytest.raises(TicketError, match="expired ticket: it expired 1.0 s ago") as excinfo:
        signer.verify(ticket, now=1006)
    assert excinfo.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(TicketError, match="forged"):  # another server's secret
        TicketSigner().verify(ticket, now=1000)
    with pytest.raises(TicketError, match="malformed ticket: 3 bytes"):
        signer.verify(b"abc")


def test_replay_guard_admits_a_ticket_once():
    signer, guard = TicketSigner(), ReplayGuard()
    _, claims = signer.issue(OP_PUT, "ns", [b"a" * 16], ttl_s=5, now=0)
    guard.use(claims, now=0)
    with pytest.raises(TicketError, match="replayed ticket"):
        guard.use(claims, now=0)
    assert len(guard) == 1
    _, later = signer.issue(OP_PUT, "ns", [b"a" * 16], ttl_s=5, now=1e9)
    guard.use(later, now=1e9)  # the first ticket has expired (and is refused as such): the guard forgets it
    assert len(guard) == 1


def test_framing_limit_is_the_servers_key_limit():
    assert MAX_VALUES == MAX_KEYS_PER_CALL


def test_receive_buffers_are_bytearrays_of_their_size():
    from kvshelf.service.bulk.transport import receive_buffer

    for size in (0, 1, 17, 8 << 20):
        buf = receive_buffer(size)
        assert type(buf) is bytearray and len(buf) == size
        buf[-1:] = b"x" if size else b""  # writable, resizable as any bytearray
