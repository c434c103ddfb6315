"""The values of one ``PutBlocks`` stream put together from its chunks as they arrive, each holding budget and
quota (``service.core.admission``) before its data is kept."""

from __future__ import annotations

import grpc

from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.core.admission import PutReservation
from kvshelf.service.core.tenancy import check_keys
from kvshelf.service.status import fail

#: A received message whose data is a view keeps the whole message alive. When the message carries more than this
#: besides its data, the data is copied out and the message freed, so a call holds its data, not its padding.
KEEP_VIEW_OVERHEAD_BYTES = 64 << 10


class PutStream:
    """The chunks of one ``PutBlocks`` call, put together into ``(key, value)`` pairs.

    Memory is counted by what the call holds, not by data bytes: a chunk kept as a view of its received message
    holds the whole message (a message padded with other fields is copied out instead, see
    ``KEEP_VIEW_OVERHEAD_BYTES``), and the lineage a value's first chunk names (parent key, token ids) is held until
    the call ends. A value holds budget and quota for its declared ``total_size`` (already bounded by the max block
    size) from its first chunk, before its data is buffered, and for more if its messages hold more; values without
    a declared size take them chunk by chunk.
    """

    def __init__(self, call: PutReservation) -> None:
        self.call, self.limits = call, call.limits
        self._done: list[tuple[bytes, bytes]] = []
        self._key: bytes | None = None
        self._parts: list[memoryview] = []  # the current value's chunks (views of the received messages, or copies)
        self._parts_held = 0  # bytes those parts keep alive (whole messages for views)
        self._filled = 0
        self._declared = 0  # the current value's total_size (0: not declared)

    def add(self, chunk: pb.Chunk, data: memoryview, message_bytes: int) -> tuple[bytes, bytes] | None:
        """Take one chunk (``data``: its bytes, apart from the message; ``message_bytes``: the size of the received
        message it came in); return ``(key, value)`` when it completes a value, else None."""
        if chunk.in_arena:
            fail(grpc.StatusCode.INVALID_ARGUMENT, "PutBlocks chunks carry their data: in_arena is GetBlocks-only")
        if self._key is None:
            self._first_chunk(chunk, data)
        else:
            self._later_chunk(chunk)
        assert self._key is not None
        end = self._filled + len(data)
        if self._declared and end > self._declared:
            fail(grpc.StatusCode.INVALID_ARGUMENT,
                 f"value of key {self._key.hex()} is longer than its declared total_size of {self._declared} bytes")
        if end > self.limits.max_block_bytes:
            fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                 f"block {self._key.hex()} exceeds the max block size of {self.limits.max_block_bytes} bytes")
        if len(data):
            self._keep(data, message_bytes)
        self._filled = end
        return self._finish() if chunk.last else None

    def _first_chunk(self, chunk: pb.Chunk, data: memoryview) -> None:
        if not chunk.key:
            fail(grpc.StatusCode.INVALID_ARGUMENT, "the first chunk of a value must carry its key")
        check_keys([chunk.key])
        if chunk.total_size > self.limits.max_block_bytes:
            fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                 f"a block of {chunk.total_size} bytes exceeds the max block size {self.limits.max_block_bytes}")
        self._key, self._declared, self._filled = chunk.key, chunk.total_size, 0
        self._parts_held = 0
        self.call.start_value(chunk.key)
        self.call.keep_lineage(chunk.key, chunk.parent_key, chunk.token_ids)
        self.call.hold_value(self._declared or len(data))

    def _later_chunk(self, chunk: pb.Chunk) -> None:
        assert self._key is not None
        if chunk.key and chunk.key != self._key:
            fail(grpc.StatusCode.INVALID_ARGUMENT,
                 f"chunk for key {chunk.key.hex()} before the value of {self._key.hex()} ended (no last=true)")
        if chunk.parent_key or chunk.token_ids or chunk.total_size:
            fail(grpc.StatusCode.INVALID_ARGUMENT,
                 f"parent_key, token_ids and total_size belong on the first chunk of a value; a later chunk of "
                 f"key {self._key.hex()} carries them")

    def _keep(self, data: memoryview, message_bytes: int) -> None:
        """Keep a chunk's data once the value holds budget and quota for what it keeps alive (at least its declared
        size)."""
        if message_bytes - len(data) > KEEP_VIEW_OVERHEAD_BYTES:
            data, holds = memoryview(bytes(data)), len(data)  # frees the padded message: hold the data only
        else:
            holds = max(message_bytes, len(data))  # the view keeps the whole message alive
        self.call.hold_value(max(self._declared, self._parts_held + holds))
        self._parts.append(data)
        self._parts_held += holds

    def _finish(self) -> tuple[bytes, bytes]:
        assert self._key is not None
        if self._declared and self._filled != self._declared:
            fail(grpc.StatusCode.INVALID_ARGUMENT,
                 f"value of key {self._key.hex()} ended after {self._filled} bytes; its declared total_size "
                 f"is {self._declared}")
        value = b"".join(self._parts)  # one copy
        self._parts, self._parts_held = [], 0
        done = (self._key, value)
        self._done.append(done)
        self._key = None
        return done

    def values(self) -> list[tuple[bytes, bytes]]:
        """Every value of the call (INVALID_ARGUMENT when the stream ended inside one)."""
        if self._key is not None:
            fail(grpc.StatusCode.INVALID_ARGUMENT,
                 f"the stream ended inside the value of key {self._key.hex()} (no chunk with last=true); "
                 "nothing stored")
        return self._done
