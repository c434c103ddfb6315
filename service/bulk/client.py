"""The client side of the bulk data path (``RemoteStore``'s default for gets and puts; see ``service/bulk/``).

One transfer per call: ``OpenDataPath`` over the authenticated channel returns a ticket and the data port; the client
connects to the host it reaches the server at (TLS when the ticket says so, trusting the channel's CA), sends the
hello (and for a put the values, scatter-gather, then the end mark), and reads the replies: each value with
``recv_into`` straight into a buffer of its size, checked against its checksum before it is handed on; the status
frame; then the call's result.

``DataPathUnavailable`` means the path itself is refused (a server without it, or with it off; a data port that
cannot be reached, that takes no hello (the control call ends saying that no data connection presented its ticket,
after the ticket's lifetime: the client stops waiting then) or a connection cut before any reply, as a middlebox
does): the caller falls back to gRPC. Every other failure is the transfer's: ``RemoteStoreError`` with the status
both sides report.
"""

from __future__ import annotations

import contextlib
import select
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc

from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.bulk.framing import (
    CHECKSUM_BYTES,
    DONE,
    END_MARK,
    MISS,
    REFUSED,
    REPLY_HEAD,
    STATUS,
    UNANSWERED_METADATA,
    Entry,
    ReplyHead,
    check_value,
    encode_hello,
    parse_reply_head,
    status_code,
    trailer_checksum,
    value_hasher,
)
from kvshelf.service.bulk.ticket import OP_GET, OP_PUT
from kvshelf.service.bulk.transport import (
    connect,
    receive_buffer,
    recv_bytes,
    recv_exact,
    send_parts,
    shutdown,
)
from kvshelf.service.errors import DataPathError, DataPathUnavailable, RemoteStoreError

#: statuses of ``OpenDataPath`` that mean "no data path here": an older server, or one with it off
_PATH_REFUSED = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION})

T = TypeVar("T")

#: ``open_call(request)``: the ``OpenDataPath`` call (retried while the server asks for it) and its first response
OpenCall = Callable[[pb.DataPathRequest], tuple[Any, pb.DataPathResponse]]


class DataPathClient:
    """Gets and puts of one ``RemoteStore`` over the data path of the server at ``host``.

    Data connections are kept for the next transfer once one ends cleanly (at most ``max_idle``; each transfer
    still presents a ticket of its own): a transfer saves the connect, and a busy client does not leave a socket in
    TIME_WAIT per call. A kept connection the server has closed meanwhile is replaced by a fresh one at once.
    """

    def __init__(self, host: str, open_call: OpenCall, *, timeout_s: float, tls: ssl.SSLContext | None,
                 max_value_bytes: int, max_idle: int = 4) -> None:
        self.host = host
        self._open_call = open_call
        self.timeout_s = timeout_s
        self.tls = tls
        self.max_value_bytes = max_value_bytes
        self.max_idle = max_idle
        self._idle: list[tuple[int, bool, Any]] = []  # (port, tls, socket) of kept connections
        self._lock = threading.Lock()

    def get(self, namespace: str, keys: Sequence[bytes], *, fingerprint: str = "", tokens: Sequence[int] = (),
            arrived: Callable[[int, bytearray], None] | None = None) -> list[bytearray | None]:
        """The values of ``keys`` (None: a miss), each in a buffer of its own, checked against its checksum."""
        request = pb.DataPathRequest(namespace=namespace, op=pb.DataPathRequest.GET, keys=keys,
                                     fingerprint=fingerprint, tokens=tokens)
        head = bytearray(REPLY_HEAD.size)

        def exchange(sock: Any, call: _Transfer, replied: list[bool]) -> tuple[list[bytearray | None], ReplyHead]:
            out: list[bytearray | None] = [None] * len(keys)
            send_parts(sock, [encode_hello(OP_GET, call.ticket, namespace, [Entry(k) for k in keys])])
            call.await_reply(sock)
            for index, key in enumerate(keys):
                reply = self._head(sock, head)
                replied[0] = True
                if reply.kind in (STATUS, DONE):
                    self._failed(sock, reply)
                if reply.kind == MISS:
                    continue
                value, hasher = receive_buffer(reply.size), value_hasher()
                recv_exact(sock, memoryview(value), f"the value of key {key.hex()}", hasher=hasher,
                           hash_end=reply.size - CHECKSUM_BYTES)
                check_value(key, value, reply.checksum, hasher.digest())
                out[index] = value
                if arrived is not None:
                    arrived(index, value)
            return out, self._ended(sock, self._head(sock, head))

        return self._transfer(request, exchange)

    def put(self, namespace: str, items: Sequence[tuple[bytes, bytes | bytearray | memoryview]], *,
            pin: bool = False) -> int:
        """Send ``items`` (``(key, encoded value)``); how many the server's first tier accepted."""
        request = pb.DataPathRequest(namespace=namespace, op=pb.DataPathRequest.PUT, keys=[k for k, _ in items],
                                     sizes=[len(value) for _, value in items], pin=pin)
        entries = [Entry(key, len(value), trailer_checksum(value)) for key, value in items]

        def exchange(sock: Any, call: _Transfer, replied: list[bool]) -> tuple[int, ReplyHead]:
            hello = encode_hello(OP_PUT, call.ticket, namespace, entries)
            with contextlib.suppress(OSError):  # the server may have refused the put midway: its status frame says why
                send_parts(sock, [hello, *(value for _, value in items), END_MARK],
                           stalled=(call.expires_s + REPLY_GRACE_S, lambda: call.watch(sock)))
            call.await_reply(sock)
            reply = self._head(sock, bytearray(REPLY_HEAD.size))
            replied[0] = True
            done = self._ended(sock, reply)
            return done.stored, done

        return self._transfer(request, exchange)

    def close(self) -> None:
        """Close the kept connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for _, _, sock in idle:
            _close(sock)

    # -- plumbing -------------------------------------------------------------------------------------------------

    def _transfer(self, request: pb.DataPathRequest,
                  exchange: Callable[[Any, _Transfer, list[bool]], tuple[T, ReplyHead]]) -> T:
        """Open the call, run ``exchange(sock, call, replied)`` on a data connection (a kept one when there is
        one; a fresh one if it turns out closed), keep the connection when the transfer ended well; the exchange's
        outcome. The end frame says how it went, so the call is then cancelled rather than read to its end (its
        result says the same; reading it costs a round of the channel); a failure is read from the call."""
        call = self._open(request)
        sock = self._take(call.port, call.tls)
        kept = sock is not None
        if sock is None:
            sock = self._connect(call)
        while True:
            replied = [False]
            try:
                out, done = exchange(sock, call, replied)
            except (OSError, DataPathError) as exc:
                _close(sock)  # first: a server still sending or reading is woken
                call.settle()
                if call.unanswered:  # the server never saw this connection: its data port is not answering
                    raise DataPathUnavailable(f"the data port {self.host}:{call.port} took no hello (the server saw "
                                              "no data connection within the ticket's lifetime)") from None
                if kept and not replied[0] and not isinstance(exc, DataPathError):  # the server closed it meanwhile
                    sock, kept = self._connect(call), False
                    continue
                call.fail(exc, replied[0])
            except DataPathUnavailable:  # refused before its hello was read (the port is busy): gRPC for this call
                _close(sock)
                call.stream.cancel()
                call.settle()
                raise
            break
        call.stream.cancel()
        call.settle()
        if done.count != len(request.keys):
            _close(sock)
            raise RemoteStoreError(grpc.StatusCode.DATA_LOSS,
                                   f"the server ended a transfer of {len(request.keys)} values after {done.count}")
        self._keep(call.port, call.tls, sock)
        return out

    def _open(self, request: pb.DataPathRequest) -> _Transfer:
        """The control call with its ticket (``DataPathUnavailable`` when the server has no data path)."""
        try:
            stream, first = self._open_call(request)
        except grpc.RpcError as exc:
            if hasattr(exc, "code") and exc.code() in _PATH_REFUSED:
                raise DataPathUnavailable(f"the server has no data path: {exc.code().name}: {exc.details()}",
                                          None) from None
            raise
        if first is None or not first.HasField("ticket"):
            stream.cancel()
            raise DataPathUnavailable("the server has no data path: it answered OpenDataPath without a ticket", None)
        if first.ticket.tls and self.tls is None:
            stream.cancel()
            raise DataPathUnavailable("the data port is TLS and this client has no CA to check it with", None)
        return _Transfer(stream, first.ticket)

    def _connect(self, call: _Transfer) -> Any:
        try:
            return connect(self.host, call.port, self.timeout_s, self.tls if call.tls else None)
        except OSError as exc:
            call.stream.cancel()
            raise DataPathUnavailable(f"cannot reach the data port {self.host}:{call.port}: {exc}") from None

    def _take(self, port: int, tls: bool) -> Any:
        with self._lock:
            for i, (p, t, sock) in enumerate(self._idle):
                if (p, t) == (port, tls):
                    del self._idle[i]
                    return sock
        return None

    def _keep(self, port: int, tls: bool, sock: Any) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append((port, tls, sock))
                return
        _close(sock)

    def _head(self, sock: Any, buf: bytearray) -> ReplyHead:
        recv_exact(sock, memoryview(buf), "a reply head")
        reply = parse_reply_head(buf, self.max_value_bytes)
        if reply.kind == REFUSED:
            message = recv_bytes(sock, reply.message_bytes, "a status message").decode("utf-8", "replace")
            raise DataPathUnavailable(f"the data port is busy: {message}", 0.0)
        return reply

    def _failed(self, sock: Any, reply: ReplyHead) -> NoReturn:
        """Raise the failure a status frame reports (an end frame before the last value: DATA_LOSS)."""
        message = recv_bytes(sock, reply.message_bytes, "a status message").decode("utf-8", "replace")
        code = status_code(reply.code)
        if code != grpc.StatusCode.OK:
            raise DataPathError(code, message)
        raise DataPathError(grpc.StatusCode.DATA_LOSS, "the server ended the transfer before every value was sent")

    def _ended(self, sock: Any, reply: ReplyHead) -> ReplyHead:
        """The transfer's last frame: its end (returned), or raise its failure."""
        if reply.kind == DONE:
            return reply
        if reply.kind != STATUS:
            raise DataPathError(grpc.StatusCode.DATA_LOSS, "the server sent more values than keys asked for")
        self._failed(sock, reply)


class _Transfer:
    """The control call of one transfer: its ticket, its result, and how a failed transfer is reported."""

    def __init__(self, stream: Any, ticket: pb.DataPathTicket) -> None:
        self.stream = stream
        self.ticket = bytes(ticket.ticket)
        self.port = int(ticket.port)
        self.tls = bool(ticket.tls)
        self.expires_s = float(ticket.expires_s) or DEFAULT_TICKET_S
        self.unanswered = False  # the call ended saying that no data connection presented its ticket
        self._watcher: threading.Thread | None = None
        self._outcome: Any = None  # what the watcher read of the call: its next message, or its error

    def await_reply(self, sock: Any) -> None:
        """Return once ``sock`` has a reply to read, or its ticket's lifetime (and a grace) passed without one. Then
        the control call is watched too (a thread reads it): if it ends saying that no data connection presented
        the ticket (``UNANSWERED_METADATA``: the data port took no hello), ``sock`` is shut, so the read that follows
        ends at once and the transfer is ``DataPathUnavailable`` (``unanswered``). A transfer answered in time costs
        one poll. (A put's send that stalls as long starts the same watch.)"""
        if not _readable(sock, self.expires_s + REPLY_GRACE_S):
            self.watch(sock)

    def watch(self, sock: Any) -> None:
        """Watch the control call (a thread reads it, once; see ``await_reply``)."""
        if self._watcher is not None:
            return
        watcher = threading.Thread(target=self._watch, args=(sock,), name="kvshelf-data-watch", daemon=True)
        try:
            watcher.start()
        except RuntimeError:  # no thread to spare: the read that follows waits for the call's deadline
            return
        self._watcher = watcher

    def _watch(self, sock: Any) -> None:
        try:
            self._outcome = next(self.stream, None)
        except grpc.RpcError as exc:
            self._outcome = exc
            trailer = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
            if any(key == UNANSWERED_METADATA for key, _ in trailer or ()):
                self.unanswered = True
                shutdown(sock)

    def settle(self) -> None:
        """Wait for the watcher (``await_reply``), if one runs, to end (it ends with the call)."""
        if self._watcher is not None:
            self._watcher.join()

    def result(self) -> pb.DataPathResult:
        """The call's result message (its errors raise ``grpc.RpcError``, as any call's)."""
        if self._watcher is not None:  # the watcher read what came of the call
            self._watcher.join()
            if isinstance(self._outcome, grpc.RpcError):
                raise self._outcome
            message, self._watcher = self._outcome, None
        else:
            message = next(self.stream, None)
        if message is None or not message.HasField("result"):
            raise RemoteStoreError(grpc.StatusCode.DATA_LOSS, "OpenDataPath ended without a result")
        for _ in self.stream:  # the end of the stream (its status)
            pass
        return message.result

    def fail(self, exc: OSError | DataPathError, replied: bool) -> NoReturn:
        """Raise what a failed transfer means: the status frame's, else the control call's status; a connection cut
        before any reply (a middlebox refusing it) is ``DataPathUnavailable``."""
        if isinstance(exc, DataPathError) and exc.code != grpc.StatusCode.DATA_LOSS:
            self.stream.cancel()
            raise RemoteStoreError(exc.code, exc.message) from None
        if not replied and not isinstance(exc, DataPathError):
            self.stream.cancel()
            raise DataPathUnavailable(f"the data connection was cut before any reply: {exc}") from None
        try:  # the server's view (it ends the call with the transfer's status); else ours
            self.result()
        except grpc.RpcError:
            raise
        except RemoteStoreError:
            pass
        code = exc.code if isinstance(exc, DataPathError) else grpc.StatusCode.DATA_LOSS
        raise RemoteStoreError(code, exc.message if isinstance(exc, DataPathError) else str(exc)) from None


#: how long a client waits for a transfer's first reply past its ticket's lifetime before it watches the control
#: call (``_Transfer.await_reply``); and the lifetime it assumes for a ticket that gives none
REPLY_GRACE_S = 1.0
DEFAULT_TICKET_S = 5.0


def _readable(sock: Any, timeout_s: float) -> bool:
    """Whether ``sock`` has bytes to read (or is closed) within ``timeout_s``."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()  # not select(): file descriptors past 1024 are common
    try:
        poller.register(sock, select.POLLIN)
    except (OSError, ValueError):
        return True  # closed: the read that follows says so
    return bool(poller.poll(timeout_s * 1000))


def _close(sock: Any) -> None:
    shutdown(sock)
    sock.close()


def data_host(address: str) -> str | None:
    """The host of a gRPC target (``host:port``, ``dns:///host:port``, ``ipv4:...``, ``[::1]:port``) where its data
    port is reached; None for a Unix socket (no data path)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    target = address.removeprefix("dns:///").removeprefix("dns:").removeprefix("ipv4:").removeprefix("ipv6:")
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return host.strip("[]") or None
