"""The floor of any remote path on this machine: a bare Python socket key-value server with nothing of kvshelf in it.

``kvshelf bench store --backends socket-floor`` runs it beside the others, so every run carries its own limit:
what one Python thread on each side of a loopback TCP connection moves, values received with ``recv_into`` into a
preallocated buffer and sent with one scatter-gather ``sendmsg`` (header and value, no joined copy). No checks,
no tiers, no disk: the server keeps values in a dict.

Run as ``python -m kvshelf.bench.socket_floor``: prints the port it listens on, serves until killed (a thread
per connection). Framing, little-endian: a request is ``op (1 byte: b"P" put, b"G" get) | key (16 bytes) |
length (u64, puts only) | value``; a put is answered ``b"\\x00"``, a get ``length (u64) | value`` (length
``2**64 - 1``: absent).
"""

from __future__ import annotations

import socket
import struct
import threading

HEAD = struct.Struct("<c16sQ")
GET = struct.Struct("<c16s")
LENGTH = struct.Struct("<Q")
ABSENT = (1 << 64) - 1


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (``ConnectionError`` when the peer closes first)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _serve_connection(conn: socket.socket, values: dict[bytes, bytearray]) -> None:
    op = bytearray(1)
    with conn:
        try:
            while True:
                _recv_exact(conn, memoryview(op))
                if op == b"P":
                    rest = bytearray(HEAD.size - 1)
                    _recv_exact(conn, memoryview(rest))
                    key, length = bytes(rest[:16]), LENGTH.unpack_from(rest, 16)[0]
                    value = bytearray(length)
                    _recv_exact(conn, memoryview(value))
                    values[key] = value
                    conn.sendall(b"\x00")
                elif op == b"G":
                    key = bytearray(16)
                    _recv_exact(conn, memoryview(key))
                    held = values.get(bytes(key))
                    if held is None:
                        conn.sendall(LENGTH.pack(ABSENT))
                    else:
                        conn.sendmsg([LENGTH.pack(len(held)), held])
                else:
                    return
        except (ConnectionError, OSError):
            return


def serve() -> tuple[socket.socket, int]:
    """A listening socket on a free loopback port, accepting on a daemon thread; ``(socket, port)``."""
    values: dict[bytes, bytearray] = {}
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_serve_connection, args=(conn, values), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener, listener.getsockname()[1]


class SocketClient:
    """``put(key, value)`` / ``get(key)`` over one connection; a get lands in a buffer kept between calls (grown
    when a value is larger) and returns a view of it, valid until the next get."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = bytearray(0)

    def put(self, key: bytes, value: bytes) -> None:
        self.sock.sendmsg([HEAD.pack(b"P", key, len(value)), value])
        ack = bytearray(1)
        _recv_exact(self.sock, memoryview(ack))

    def get(self, key: bytes) -> memoryview | None:
        self.sock.sendall(GET.pack(b"G", key))
        head = bytearray(LENGTH.size)
        _recv_exact(self.sock, memoryview(head))
        length = LENGTH.unpack(head)[0]
        if length == ABSENT:
            return None
        if len(self.buffer) < length:
            self.buffer = bytearray(length)
        view = memoryview(self.buffer)[:length]
        _recv_exact(self.sock, view)
        return view

    def close(self) -> None:
        self.sock.close()


if __name__ == "__main__":
    _listener, port = serve()
    print(port, flush=True)
    threading.Event().wait()  # until killed
