"""The bytes of a data connection (``service/bulk/``): a tiny length-prefixed framing with hard limits.

Client to server, all integers little-endian::

    hello:   magic b"KVBD" | version u8 (1) | op u8 (1 get, 2 put) | ticket length u16 | namespace length u16
             | count u32 | ticket | namespace (UTF-8) | count entries
    entry:   get: key (16)            put: key (16) | size u64 | checksum (8)
    put:     the values, back to back, in entry order, then b"KVBE" (ends the values: a value longer or shorter than
             its entry puts other bytes where the end mark should be)

Server to client, every reply head 17 bytes, ``kind (1) | a u64 | b (8)``::

    b"V" size | checksum       a value follows (get: one per entry, in order)
    b"M" 0    | 0              a miss (get)
    b"D" count | stored (u64)  the transfer ended well: its values (all of the hello's entries), and of them those
                               stored (put) or found (get); the last frame (the call's result says the same: a client
                               need not wait for it)
    b"S" code | message length the transfer failed: its status (a gRPC status code) and a UTF-8 message; the last frame
    b"R" code | message length a connection refused before its hello was read (the port is busy: its ticket is
                               unused, the client may use gRPC for that call); the only frame

A value's checksum is the xxh3-64 of its bytes before its last 8, which a kvshelf encoded block carries as those last
8 bytes (``kvstore/encoding.py``): the sender has it for free, the receiver checks both (``check_value``).

The parsers are pure functions over bytes: anything malformed raises ``FramingError`` (DATA_LOSS, or
UNAUTHENTICATED for a hello that is not one), never another exception (``tests/support/fuzz_bulk.py`` fuzzes them).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import xxhash

from kvshelf.kvstore.keys import KEY_BYTES
from kvshelf.service.auth import MAX_NAMESPACE_CHARS
from kvshelf.service.bulk.ticket import OP_GET, OP_NAMES, OP_PUT
from kvshelf.service.errors import FramingError

HELLO_MAGIC = b"KVBD"
END_MARK = b"KVBE"
VERSION = 1
HELLO_HEAD = struct.Struct("<4sBBHHI")
PUT_ENTRY = struct.Struct(f"<{KEY_BYTES}sQ8s")
GET_ENTRY = struct.Struct(f"<{KEY_BYTES}s")
CHECKSUM_BYTES = 8
MAX_TICKET_BYTES = 1024
MAX_NAMESPACE_BYTES = 4 * MAX_NAMESPACE_CHARS  # UTF-8
MAX_VALUES = 100_000  # = service.server.MAX_KEYS_PER_CALL (a test checks)
MAX_VALUE_BYTES = 1 << 40  # a size past this is garbage, whatever the server's limits (which are lower)
MAX_STATUS_MESSAGE_BYTES = 4096
REPLY_HEAD = struct.Struct("<cQ8s")
VALUE, MISS, DONE, STATUS, REFUSED = b"V", b"M", b"D", b"S", b"R"
#: trailing metadata of an ``OpenDataPath`` call that ended because no data connection presented its ticket (the
#: data port took no hello from its client): the client then stops waiting on its data connection and uses gRPC
UNANSWERED_METADATA = "kvshelf-data-unanswered"


@dataclass(frozen=True)
class HelloHead:
    """The fixed part of a hello: what the rest of it holds."""

    op: int
    ticket_bytes: int
    namespace_bytes: int
    count: int

    @property
    def body_bytes(self) -> int:
        """Bytes of ticket and namespace after the head."""
        return self.ticket_bytes + self.namespace_bytes

    @property
    def entries_bytes(self) -> int:
        return self.count * (PUT_ENTRY.size if self.op == OP_PUT else KEY_BYTES)


@dataclass(frozen=True)
class Entry:
    """One value of a transfer: its key, and for a put its size and checksum."""

    key: bytes
    size: int = 0
    checksum: bytes = b""


@dataclass(frozen=True)
class Hello:
    op: int
    ticket: bytes
    namespace: str
    entries: tuple[Entry, ...]


def parse_hello_head(data: bytes | memoryview) -> HelloHead:
    """The head of a hello (``HELLO_HEAD.size`` bytes); ``FramingError`` (UNAUTHENTICATED: not a hello, so no
    ticket) when it is not one, or a field is over its limit."""
    if len(data) != HELLO_HEAD.size:
        raise FramingError(f"a hello head is {HELLO_HEAD.size} bytes, got {len(data)}",
                           grpc.StatusCode.UNAUTHENTICATED)
    magic, version, op, ticket_bytes, namespace_bytes, count = HELLO_HEAD.unpack(data)
    if magic != HELLO_MAGIC:
        raise FramingError(f"not a kvshelf data connection: it starts with {bytes(magic)!r}, not {HELLO_MAGIC!r}",
                           grpc.StatusCode.UNAUTHENTICATED)
    if version != VERSION:
        raise FramingError(f"data-path framing version {version}; this server speaks {VERSION}",
                           grpc.StatusCode.UNAUTHENTICATED)
    if op not in OP_NAMES:
        raise FramingError(f"unknown data-path op {op} (1: get, 2: put)", grpc.StatusCode.UNAUTHENTICATED)
    if not 0 < ticket_bytes <= MAX_TICKET_BYTES:
        raise FramingError(f"ticket of {ticket_bytes} bytes (1 to {MAX_TICKET_BYTES})", grpc.StatusCode.UNAUTHENTICATED)
    if namespace_bytes > MAX_NAMESPACE_BYTES:
        raise FramingError(f"namespace of {namespace_bytes} bytes (at most {MAX_NAMESPACE_BYTES})")
    if count > MAX_VALUES:
        raise FramingError(f"{count} values in one transfer (at most {MAX_VALUES})")
    return HelloHead(op, ticket_bytes, namespace_bytes, count)


def parse_hello_body(head: HelloHead, data: bytes | memoryview) -> tuple[bytes, str]:
    """``(ticket, namespace)`` from the ``head.body_bytes`` after the head."""
    if len(data) != head.body_bytes:
        raise FramingError(f"hello body of {len(data)} bytes; its head announced {head.body_bytes}")
    ticket = bytes(data[: head.ticket_bytes])
    try:
        namespace = bytes(data[head.ticket_bytes :]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FramingError(f"namespace is not UTF-8: {exc}") from None
    return ticket, namespace


def parse_entries(head: HelloHead, data: bytes | memoryview) -> tuple[Entry, ...]:
    """The ``head.count`` entries of a hello."""
    if len(data) != head.entries_bytes:
        raise FramingError(f"hello entries of {len(data)} bytes; {head.count} entries take {head.entries_bytes}")
    view = memoryview(data)
    if head.op == OP_GET:
        return tuple(Entry(key) for (key,) in GET_ENTRY.iter_unpack(view))
    entries = []
    for key, size, checksum in PUT_ENTRY.iter_unpack(view):
        if size > MAX_VALUE_BYTES:
            raise FramingError(f"value of key {key.hex()} announced as {size} bytes")
        if size < CHECKSUM_BYTES:
            raise FramingError(f"value of key {key.hex()} announced as {size} bytes: too short to carry its checksum")
        entries.append(Entry(key, size, checksum))
    return tuple(entries)


def parse_hello(data: bytes | memoryview) -> Hello:
    """A whole hello (exactly its bytes): head, body and entries."""
    view = memoryview(data)
    if len(view) < HELLO_HEAD.size:
        raise FramingError(f"hello of {len(view)} bytes is shorter than its {HELLO_HEAD.size}-byte head",
                           grpc.StatusCode.UNAUTHENTICATED)
    head = parse_hello_head(view[: HELLO_HEAD.size])
    body_end = HELLO_HEAD.size + head.body_bytes
    ticket, namespace = parse_hello_body(head, view[HELLO_HEAD.size : body_end])
    entries = parse_entries(head, view[body_end:])
    return Hello(head.op, ticket, namespace, entries)


def encode_hello(op: int, ticket: bytes, namespace: str, entries: Sequence[Entry]) -> bytes:
    """The hello a client sends (``parse_hello`` reads it back)."""
    name = namespace.encode("utf-8")
    head = HELLO_HEAD.pack(HELLO_MAGIC, VERSION, op, len(ticket), len(name), len(entries))
    if op == OP_PUT:
        body = b"".join(PUT_ENTRY.pack(e.key, e.size, e.checksum) for e in entries)
    else:
        body = b"".join(e.key for e in entries)
    return b"".join([head, ticket, name, body])


def check_end(data: bytes | memoryview) -> None:
    """The end mark after a put's values; anything else means the values were not the sizes announced."""
    if bytes(data) != END_MARK:
        raise FramingError(f"expected the end mark {END_MARK!r} after the announced values, got {bytes(data)!r}: "
                           "the values sent are not the sizes announced")


# -- values and their checksums ------------------------------------------------------------------------------------


def trailer_checksum(value: bytes | bytearray | memoryview) -> bytes:
    """The checksum a sender announces for ``value``: its last 8 bytes (an encoded block's own xxh3-64)."""
    return bytes(memoryview(value)[-CHECKSUM_BYTES:]) if len(value) >= CHECKSUM_BYTES else b""


def check_trailer(key: bytes, value: bytes | bytearray | memoryview, checksum: bytes) -> None:
    """Cheap: the value ends with the announced checksum (a receiver that verifies the block next, as the server
    does, hashes it there)."""
    if len(value) < CHECKSUM_BYTES or bytes(memoryview(value)[-CHECKSUM_BYTES:]) != checksum:
        raise FramingError(f"value of key {key.hex()} does not end with its announced checksum")


def check_value(key: bytes, value: bytes | bytearray | memoryview, checksum: bytes,
                digest: bytes | None = None) -> None:
    """The value ends with ``checksum`` and it is the xxh3-64 of the bytes before it (``digest``: that hash, when
    the receiver computed it as the bytes arrived); else DATA_LOSS."""
    check_trailer(key, value, checksum)
    if digest is None:
        digest = xxhash.xxh3_64_digest(memoryview(value)[:-CHECKSUM_BYTES])
    if digest != checksum:
        raise FramingError(f"value of key {key.hex()} fails its checksum: damaged in transit")


def value_hasher() -> Any:
    """A hasher of the checksum ``check_value`` checks (fed the bytes before a value's last 8)."""
    return xxhash.xxh3_64()


# -- replies -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplyHead:
    """A reply head: a value (``size``, ``checksum``), a miss, the end of a transfer (``count``, ``stored``) or a
    failure's status (``code``, ``message_bytes``)."""

    kind: bytes
    size: int = 0
    checksum: bytes = b""
    code: int = 0
    message_bytes: int = 0
    count: int = 0
    stored: int = 0


def encode_value_head(size: int, checksum: bytes) -> bytes:
    return REPLY_HEAD.pack(VALUE, size, checksum)


MISS_HEAD = REPLY_HEAD.pack(MISS, 0, bytes(8))


def encode_done(count: int, stored: int = 0) -> bytes:
    """The frame that ends a transfer that went well."""
    return REPLY_HEAD.pack(DONE, count, struct.pack("<Q", stored))


def encode_status(code: grpc.StatusCode, message: str = "", kind: bytes = STATUS) -> bytes:
    """The status frame (``kind``: ``STATUS``, or ``REFUSED``): head and message (cut to
    ``MAX_STATUS_MESSAGE_BYTES``)."""
    text = message.encode("utf-8")[:MAX_STATUS_MESSAGE_BYTES]
    return REPLY_HEAD.pack(kind, code.value[0], struct.pack("<Q", len(text))) + text


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` of a status frame's code; ``FramingError`` for a number that is none."""
    try:
        return _CODES[number]
    except KeyError:
        raise FramingError(f"status frame with unknown code {number}") from None


def parse_reply_head(data: bytes | memoryview, max_value_bytes: int) -> ReplyHead:
    """A reply head (``REPLY_HEAD.size`` bytes); a value over ``max_value_bytes`` (the receiver's limit) is refused
    before anything is allocated for it."""
    if len(data) != REPLY_HEAD.size:
        raise FramingError(f"a reply head is {REPLY_HEAD.size} bytes, got {len(data)}")
    kind, a, b = REPLY_HEAD.unpack(data)
    if kind == VALUE:
        if a > max_value_bytes:
            raise FramingError(f"value of {a} bytes exceeds this client's limit of {max_value_bytes}")
        if a < CHECKSUM_BYTES:
            raise FramingError(f"value of {a} bytes is too short to carry its checksum")
        return ReplyHead(VALUE, size=a, checksum=b)
    if kind == MISS:
        return ReplyHead(MISS)
    if kind == DONE:
        stored = struct.unpack("<Q", b)[0]
        if a > MAX_VALUES or stored > a:
            raise FramingError(f"end frame counting {a} values, {stored} of them stored or found")
        return ReplyHead(DONE, count=a, stored=stored)
    if kind in (STATUS, REFUSED):
        status_code(a)
        length = struct.unpack("<Q", b)[0]
        if length > MAX_STATUS_MESSAGE_BYTES:
            raise FramingError(f"status message of {length} bytes (at most {MAX_STATUS_MESSAGE_BYTES})")
        return ReplyHead(kind, code=a, message_bytes=length)
    raise FramingError(f"unknown reply frame {bytes(kind)!r}")
