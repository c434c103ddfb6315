"""Raw HTTP over real sockets for the tests of the admin surfaces (``/metrics``, the dashboard): one request as
bytes, its answer's status; silent connections opened without blocking; a process's threads and fds."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable


def raw_request(port: int, head: bytes, *, timeout: float = 10.0,
                close_write: bool = False) -> tuple[int | None, bytes]:
    """Send ``head`` to ``127.0.0.1:port`` and read until the server closes: ``(status, whole answer)``; status
    ``None`` when the server closed without an HTTP answer (a clean close or a reset). ``close_write`` ends the
    sending side after ``head``, so a request cut short is answered at once instead of at the read deadline."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        # the server may answer and close before the whole request is sent: then read what it said
        with contextlib.suppress(OSError):
            sock.sendall(head)
            if close_write:
                sock.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    answer = b"".join(chunks)
    if not answer.startswith(b"HTTP/1."):
        return None, answer
    return int(answer.split(b" ", 2)[1]), answer


def get(port: int, path: str, *, host: str | None = None, headers: dict[str, str] | None = None,
        timeout: float = 10.0) -> tuple[int | None, bytes]:
    """A ``GET path`` with ``Host: host`` (default ``127.0.0.1:port``) and ``headers``."""
    lines = [f"GET {path} HTTP/1.1", f"Host: {host or f'127.0.0.1:{port}'}",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return raw_request(port, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), timeout=timeout)


def open_silent(port: int, n: int) -> list[socket.socket]:
    """``n`` connections to ``127.0.0.1:port`` that never send a byte (connected without blocking)."""
    socks = []
    for _ in range(n):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
    return socks


def threads_and_fds(pid: int) -> tuple[int, int]:
    """How many threads and open fds the process ``pid`` has now."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def wait_for(condition: Callable[[], bool], timeout: float, step: float = 0.2) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (a liveness bound, polled)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(step)
    return condition()
