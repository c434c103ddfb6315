"""Fuzz target of the hand-written protobuf readers in ``service/wire.py``, checked against protobuf's own parser.

``check_put_request(raw)``: ``decode_put_request`` reads ``raw`` exactly as ``pb.PutBlocksRequest.FromString``
does (same message, the chunk's data as a zero-copy view of ``raw``), or both refuse it (ours with ``WireError``,
never another exception). ``check_response(raw)``: whatever protobuf reads as a ``GetBlocksResponse``,
``decode_response`` reads the same (it may accept more: it skips the chunk fields a client does not use unchecked).

The test suite runs these through hypothesis (``tests/service/test_wire_protobuf.py``); for a long run with
coverage guidance::

    pip install atheris
    python tests/support/fuzz_wire.py -max_total_time=600

Without atheris the script runs a seeded random mutation loop instead (``python tests/support/fuzz_wire.py
[rounds]``).
"""

from __future__ import annotations

from fuzz_driver import fuzz_main
from google.protobuf.message import DecodeError

from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service import wire
from kvshelf.service.wire import WireError, decode_put_request, decode_response

#: valid messages the fallback loop mutates (the atheris run starts from nothing and finds its own)
SEEDS: tuple[bytes, ...] = (
    pb.PutBlocksRequest(namespace="team-ä", pin=True, chunk=pb.Chunk(
        key=b"k" * 16, data=b"payload", last=True, total_size=7, parent_key=b"p" * 16,
        token_ids=[1, 300, 70000])).SerializeToString(),
    # the chunk in two occurrences, the data twice, an unknown fixed64 and a group with a fixed32 inside
    b"\x1a\x05\x12\x01a\x18\x01" + b"\x39" + bytes(8) + b"\x1a\x03\x12\x01b" + b"\x3b\x08\x01\x45" + bytes(4) + b"\x3c",
    pb.GetBlocksResponse(index=3, chunk=pb.Chunk(key=b"k", data=b"xyz", last=True)).SerializeToString(),
)


def _parse_put(raw: bytes) -> pb.PutBlocksRequest | None:
    """``raw`` read by protobuf's own parser, or None when it refuses it."""
    try:
        return pb.PutBlocksRequest.FromString(raw)
    except DecodeError:
        return None


def check_put_request(raw: bytes) -> None:
    """Assert that ``decode_put_request(raw)`` agrees with protobuf on ``raw`` (see the module docstring)."""
    expected = _parse_put(raw)
    try:
        message, data = decode_put_request(raw)
    except WireError as exc:
        assert expected is None, f"decode_put_request refuses what protobuf reads: {exc} ({raw.hex()})"
        return
    assert expected is not None, f"decode_put_request reads what protobuf refuses ({raw.hex()})"
    assert data.obj is raw, "the data is not a view of the message"
    assert bytes(data) == expected.chunk.data
    assert message.chunk.data == b""
    assert message.HasField("chunk") == expected.HasField("chunk")
    if expected.HasField("chunk"):
        expected.chunk.ClearField("data")
    assert (message.namespace, message.pin) == (expected.namespace, expected.pin)
    got, want = message.chunk, expected.chunk
    assert (got.key, got.last, got.total_size, got.in_arena, got.arena_offset, got.parent_key) == \
        (want.key, want.last, want.total_size, want.in_arena, want.arena_offset, want.parent_key)
    assert list(got.token_ids) == list(want.token_ids)
    assert message == expected
    assert message.SerializeToString() == expected.SerializeToString()  # unknown fields kept alike, in order


def check_response(raw: bytes) -> None:
    """Assert that ``decode_response(raw)`` reads what protobuf reads in ``raw`` (see the module docstring)."""
    try:
        expected = pb.GetBlocksResponse.FromString(raw)
    except DecodeError:
        expected = None
    try:
        got = decode_response(raw)
    except WireError as exc:
        assert expected is None, f"decode_response refuses what protobuf reads: {exc} ({raw.hex()})"
        return
    if expected is None:
        return  # lenient on the chunk fields it skips
    chunk = expected.chunk
    assert (got.index, got.miss) == (expected.index, expected.WhichOneof("item") == "miss" and expected.miss)
    assert (got.key, bytes(got.data), got.last, got.total_size, got.in_arena, got.arena_offset) == \
        (chunk.key, chunk.data, chunk.last, chunk.total_size, chunk.in_arena, chunk.arena_offset)


def fuzz_one(raw: bytes) -> None:
    """The fuzz target: both readers against protobuf on one input."""
    check_put_request(raw)
    check_response(raw)


def main() -> None:
    """Run atheris on ``fuzz_one`` when it is installed, else the seeded fallback loop."""
    fuzz_main(fuzz_one, SEEDS, wire, "fuzz_wire: {rounds} mutated inputs agree with protobuf (install atheris for a "
              "guided run)")


if __name__ == "__main__":
    main()
