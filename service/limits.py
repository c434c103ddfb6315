"""Message sizes the server and its clients share. Light on purpose (no grpc, no store, no torch): the client
(``service/client.py``) reads them without loading the server."""

from __future__ import annotations

MAX_CHUNK_BYTES = 16 << 20  # the most data one Chunk carries: PutBlocks, and GetBlocks when asked for
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (64 << 10)  # gRPC message limit: one full chunk plus framing
