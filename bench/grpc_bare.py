"""The floor of the gRPC wire path: a bare gRPC Python key-value server with nothing of kvshelf in it.

``kvshelf bench store --backends grpc-bare`` runs it as an anchor beside ``grpc-wire``: values are held in a dict
and moved as single raw messages (no protobuf, no checks, no tiers, no disk), with the same grpcio, the same
message size limit and the same allocator settings as ``kvshelf serve``. What ``grpc-wire`` costs above it is
kvshelf's; what it costs is gRPC Python's (its copies of every byte: measured with ``perf``, most of a transfer's
CPU time is ``memmove`` in the two processes and the kernel's socket copies).

Run as ``python -m kvshelf.bench.grpc_bare``: prints the port it listens on, serves until killed.
Put: a client stream of messages, the first carrying the 16-byte key before its data; Get: the key in, one
message of the whole value out (empty when absent).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from kvshelf.service.allocator import keep_large_buffers
from kvshelf.service.server import MAX_CHUNK_BYTES

SERVICE = "kvshelf.bench.Bare"
OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


def serve() -> tuple[grpc.Server, int]:
    values: dict[bytes, bytes] = {}

    def put(messages: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        parts = list(messages)
        if not parts or len(parts[0]) < 16:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message starts with a 16-byte key")
        first = memoryview(parts[0])
        values[bytes(first[:16])] = b"".join([first[16:], *parts[1:]])
        return b""

    def get(key: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield values.get(key, b"")

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Put": grpc.stream_unary_rpc_method_handler(put),
        "Get": grpc.unary_stream_rpc_method_handler(get),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


class BareClient:
    """``put(key, value)`` / ``get(key)`` against a bare server (values in one message each, up to the same
    16 MiB chunks as ``RemoteStore``)."""

    def __init__(self, address: str) -> None:
        import grpc.experimental

        self.channel = grpc.insecure_channel(address, OPTIONS + [
            (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)])
        self._put = self.channel.stream_unary(f"/{SERVICE}/Put")
        self._get = self.channel.unary_stream(f"/{SERVICE}/Get")

    def put(self, key: bytes, value: bytes) -> None:
        chunk, view = MAX_CHUNK_BYTES, memoryview(value)
        messages = [b"".join([key, view[:chunk]])]
        messages += [bytes(view[i : i + chunk]) for i in range(chunk, len(view), chunk)]
        self._put(iter(messages), timeout=60)

    def get(self, key: bytes) -> bytes | None:
        value = next(iter(self._get(key, timeout=60)), b"")
        return value or None

    def close(self) -> None:
        self.channel.close()


def main() -> int:
    keep_large_buffers()
    server, port = serve()
    print(port, flush=True)
    threading.Event().wait()
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
