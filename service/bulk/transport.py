"""Socket I/O of the data path: exact reads with ``recv_into`` into the caller's buffer, scatter-gather sends, TLS.

Both sides use these. A read that gets nothing for the socket's timeout (or past a deadline) is DEADLINE_EXCEEDED
(``DataPathError``); a peer that closes early is a ``ConnectionError`` naming how far it got, and like every other
socket error an ``OSError``.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvshelf.service.errors import DataPathError

#: buffers one ``sendmsg`` takes at most (Linux's IOV_MAX is 1024)
_IOV_MAX = 1024


def _uninitialized_bytearray() -> Callable[[int], bytearray] | None:
    """CPython's ``PyByteArray_FromStringAndSize(NULL, n)``: a bytearray of ``n`` bytes left as the allocator gave
    them (``bytearray(n)`` zeroes them: 0.35 ms for 8 MiB, 10% of a transfer); None where ctypes cannot reach it."""
    try:
        import ctypes

        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
        make.restype = ctypes.py_object
        make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    except (ImportError, AttributeError, OSError):
        return None
    return lambda size: make(None, size)


_UNINITIALIZED = _uninitialized_bytearray()


def receive_buffer(size: int) -> bytearray:
    """A buffer a value is received into. Not zeroed: the caller fills every byte (``recv_exact``) or drops it, so
    its first contents are never seen."""
    return _UNINITIALIZED(size) if _UNINITIALIZED is not None else bytearray(size)


def _unfilled_bytes() -> Callable[[int], tuple[bytes, memoryview]] | None:
    """CPython's ``PyBytes_FromStringAndSize(NULL, n)``: a ``bytes`` of ``n`` bytes not filled yet, and a writable
    view of its bytes (through ctypes) to fill it with before it is shared; None where ctypes cannot reach them."""
    try:
        import ctypes

        make = ctypes.pythonapi.PyBytes_FromStringAndSize
        make.restype = ctypes.py_object
        make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
        address = ctypes.pythonapi.PyBytes_AsString
        address.restype = ctypes.c_void_p
        address.argtypes = (ctypes.py_object,)
    except (ImportError, AttributeError, OSError):
        return None

    def unfilled(size: int) -> tuple[bytes, memoryview]:
        value = make(None, size)
        if size == 0:  # the shared empty bytes: nothing to fill
            return value, memoryview(bytearray(0))
        return value, memoryview((ctypes.c_ubyte * size).from_address(address(value))).cast("B")

    return unfilled


_UNFILLED_BYTES = _unfilled_bytes()


def receive_value(size: int) -> tuple[bytes | bytearray, memoryview]:
    """A value of ``size`` bytes to receive, and the writable view to receive it through. Where CPython allows it,
    the value is a ``bytes`` filled in place: the caller fills every byte through the view (``recv_exact``) or
    drops both, keeps the value alive while it holds the view, and never writes to it once filled, so the value is
    immutable from then on and a store's memory tier keeps it as it is (no copy of the whole value per put).
    Elsewhere a bytearray (``receive_buffer``)."""
    if _UNFILLED_BYTES is not None:
        return _UNFILLED_BYTES(size)
    buffer = receive_buffer(size)
    return buffer, memoryview(buffer)


def recv_exact(sock: socket.socket, view: memoryview, what: str, *, deadline: float | None = None,
               progress: Callable[[int], None] | None = None, hasher: Any = None, hash_end: int = 0) -> None:
    """Fill ``view`` from ``sock`` (straight into it: no intermediate buffer). ``deadline`` (``time.monotonic``):
    the whole read must end by then; ``progress(n)`` after each piece; ``hasher`` (an ``xxhash`` hasher) is
    updated with each piece below ``hash_end`` as it lands, while it is in the cache and the peer sends the next."""
    got, size = 0, len(view)
    while got < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _late(got, size, what)
            sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if deadline is not None:
                raise _late(got, size, what) from None
            raise DataPathError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the data connection stalled after {got} of the {size} bytes of {what} "
                                f"(nothing for {sock.gettimeout():g} s)") from None
        if n == 0:
            raise ConnectionError(f"the data connection closed after {got} of the {size} bytes of {what}")
        if hasher is not None and got < hash_end:
            hasher.update(view[got : min(got + n, hash_end)])
        got += n
        if progress is not None:
            progress(n)


def _late(got: int, size: int, what: str) -> DataPathError:
    return DataPathError(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"the data connection sent only {got} of the {size} bytes of {what} in time")


def recv_bytes(sock: socket.socket, size: int, what: str, *, deadline: float | None = None) -> bytearray:
    """``size`` bytes from ``sock`` (``recv_exact`` into a new buffer)."""
    buf = bytearray(size)
    recv_exact(sock, memoryview(buf), what, deadline=deadline)
    return buf


def send_parts(sock: socket.socket, parts: Sequence[bytes | bytearray | memoryview],
               progress: Callable[[int], None] | None = None,
               stalled: tuple[float, Callable[[], None]] | None = None) -> None:
    """Send ``parts`` in order without joining them: ``sendmsg`` (scatter-gather) on a plain socket, ``sendall``
    per part on TLS (which has no ``sendmsg``). A peer that stops reading for the socket's timeout is
    DEADLINE_EXCEEDED. ``stalled``: ``(seconds, callback)``: the callback runs (once) when the peer takes nothing
    for that long, and the send goes on."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]

    def check_stall() -> None:
        nonlocal stalled
        if stalled is not None and not _writable(sock, stalled[0]):
            stalled[1]()
            stalled = None

    try:
        if isinstance(sock, ssl.SSLSocket):
            for view in views:
                check_stall()
                sock.sendall(view)
                if progress is not None:
                    progress(len(view))
            return
        first = 0
        while first < len(views):
            check_stall()
            sent = sock.sendmsg(views[first : first + _IOV_MAX])
            if progress is not None:
                progress(sent)
            while first < len(views) and sent >= len(views[first]):
                sent -= len(views[first])
                first += 1
            if sent:
                views[first] = views[first][sent:]
    except TimeoutError:
        raise DataPathError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the peer of the data connection took nothing for {sock.gettimeout():g} s") from None


def _writable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether ``sock`` takes bytes (or is closed: the send that follows says so) within ``timeout_s``."""
    poller = select.poll()  # not select(): file descriptors past 1024 are common
    try:
        poller.register(sock, select.POLLOUT)
    except (OSError, ValueError):
        return True
    return bool(poller.poll(timeout_s * 1000))


#: how long a client waits for a data connection to open (a firewall that drops the packets: fall back soon)
CONNECT_TIMEOUT_S = 5.0


def connect(host: str, port: int, timeout_s: float, tls: ssl.SSLContext | None) -> socket.socket:
    """A data connection to ``host:port`` (TLS with ``tls``, checking the server's name against ``host``), opened
    (TLS handshake included) within ``CONNECT_TIMEOUT_S`` (or ``timeout_s`` if shorter); its reads and writes time
    out after ``timeout_s``."""
    sock = socket.create_connection((host, port), timeout=min(timeout_s, CONNECT_TIMEOUT_S))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        sock.settimeout(timeout_s)
    except BaseException:
        sock.close()
        raise
    return sock


def client_tls(ca: bytes) -> ssl.SSLContext:
    """The client's TLS context: trusts the PEM ``ca`` (the one its gRPC channel trusts) only."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca.decode("ascii"))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def server_tls(cert: bytes, key: bytes) -> ssl.SSLContext:
    """The data listener's TLS context from the gRPC server's PEM certificate chain and key (``ssl`` loads them from
    files only: written to a private temporary file, read, and removed at once)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    fd, path = tempfile.mkstemp(prefix="kvshelf-tls-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key.rstrip(b"\n") + b"\n" + cert)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)
    return context


def shutdown(sock: socket.socket) -> None:
    """Wake any thread blocked on ``sock`` (both directions closed); never raises."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
