"""Fuzz target of the bulk data path's parsers (``service/bulk/framing.py``, ``service/bulk/ticket.py``).

``check_hello(raw)``: ``parse_hello`` reads ``raw`` as a hello or refuses it with ``FramingError``, never another
exception; what it reads re-encodes to ``raw`` exactly (the framing has one encoding). ``check_reply_head(raw)``: the
same for a reply head. ``check_ticket(raw)``: ``TicketSigner.verify`` refuses anything it did not issue with
``TicketError`` (a signature cannot be guessed: every mutation of a real ticket is refused).

The test suite runs these through hypothesis (``tests/service/test_data_path_framing.py``); for a long run with
coverage guidance::

    pip install atheris
    python tests/support/fuzz_bulk.py -max_total_time=600

Without atheris the script runs a seeded random mutation loop instead (``python tests/support/fuzz_bulk.py
[rounds]``).
"""

from __future__ import annotations

import grpc
from fuzz_driver import fuzz_main

from kvshelf.service.bulk import framing
from kvshelf.service.bulk.framing import (
    REFUSED,
    REPLY_HEAD,
    Entry,
    encode_done,
    encode_hello,
    encode_status,
    encode_value_head,
    parse_hello,
    parse_reply_head,
)
from kvshelf.service.bulk.ticket import OP_GET, OP_PUT, TicketSigner
from kvshelf.service.errors import FramingError, TicketError

SIGNER = TicketSigner(b"s" * 32)
TICKET, _ = SIGNER.issue(OP_PUT, "team-a", [b"k" * 16], ttl_s=1e9, now=0)

#: valid inputs the fallback loop mutates (the atheris run starts from nothing and finds its own)
SEEDS: tuple[bytes, ...] = (
    encode_hello(OP_PUT, TICKET, "team-ä", [Entry(b"k" * 16, 1 << 20, b"c" * 8), Entry(b"j" * 16, 8, b"d" * 8)]),
    encode_hello(OP_GET, TICKET, "default", [Entry(b"k" * 16), Entry(b"j" * 16)]),
    encode_hello(OP_GET, b"t", "", []),
    encode_value_head(1 << 20, b"c" * 8),
    encode_status(grpc.StatusCode.DATA_LOSS, "value 3 fails its checksum"),
    encode_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", REFUSED),
    encode_done(3, 2),
    TICKET,
)


def check_hello(raw: bytes) -> None:
    """``parse_hello`` reads ``raw`` (re-encoding to it) or refuses it with ``FramingError`` only."""
    try:
        hello = parse_hello(raw)
    except FramingError:
        return
    assert encode_hello(hello.op, hello.ticket, hello.namespace, hello.entries) == raw, raw.hex()


def check_reply_head(raw: bytes) -> None:
    """``parse_reply_head`` reads the first ``REPLY_HEAD.size`` bytes of ``raw`` or refuses them with ``FramingError``
    only; a value it reads is within the limit it was given."""
    try:
        head = parse_reply_head(raw[: REPLY_HEAD.size], max_value_bytes=1 << 30)
    except FramingError:
        return
    assert head.size <= 1 << 30


def check_ticket(raw: bytes) -> None:
    """``verify`` accepts the ticket it issued and refuses every other input with ``TicketError`` only."""
    try:
        claims = SIGNER.verify(raw, now=0)
    except TicketError:
        assert raw != TICKET
        return
    assert raw == TICKET, f"a ticket this signer never issued was accepted: {raw.hex()}"
    assert claims.for_namespace("team-a")


def fuzz_one(raw: bytes) -> None:
    """The fuzz target: every parser of the data path on one input."""
    check_hello(raw)
    check_reply_head(raw)
    check_ticket(raw)


def main() -> None:
    """Run atheris on ``fuzz_one`` when it is installed, else the seeded fallback loop."""
    fuzz_main(fuzz_one, SEEDS, framing, "fuzz_bulk: {rounds} mutated inputs read or refused cleanly (install atheris "
              "for a guided run)")


if __name__ == "__main__":
    main()
