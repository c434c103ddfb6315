"""The data listener: the TCP port beside the gRPC server where data connections present their tickets.

An accept thread takes each connection and hands it to a short-lived handshake thread, which (TLS handshake first
when the server has TLS) reads the hello (``framing.py``) under a deadline, verifies its ticket (``ticket.py``:
signature, expiry, single use), checks that the hello names the ticket's namespace, op and keys, and delivers the
connection to the control call waiting for it (``Pending``). A connection is refused with a status frame naming why
(and the control call of a valid ticket ends with the same status):

* more than ``max_handshakes`` connections held by the listener (in their handshake, or kept for their next hello,
  below), or half that from one peer host: RESOURCE_EXHAUSTED (a ``REFUSED`` frame: the client uses gRPC for that
  call);
* no thread can be started for it (the process is at its task limit): RESOURCE_EXHAUSTED the same way; the accept
  loop goes on (it is supervised: nothing one connection does or lacks ends it);
* no hello within the handshake timeout: DEADLINE_EXCEEDED (a kept connection, below, waits ``keepalive_s`` for its
  next hello's first byte, then the handshake timeout for the rest);
* not a hello, a forged, expired, replayed or unknown ticket: UNAUTHENTICATED;
* the ticket of another namespace, op or set of keys: PERMISSION_DENIED.

So the listener runs at most ``max_handshakes`` threads besides its accept thread, each ended by a deadline.
Tenants' data connections are bounded by their control calls, which hold stream slots (``service/fairness.py``).
A connection whose transfer ended cleanly is kept (``keep``, within the same caps) for the client's next transfer,
which presents a ticket of its own: no connect per call, and no socket left in TIME_WAIT per call.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvshelf.service.bulk.framing import (
    HELLO_HEAD,
    REFUSED,
    STATUS,
    Entry,
    encode_status,
    parse_entries,
    parse_hello_body,
    parse_hello_head,
)
from kvshelf.service.bulk.ticket import OP_NAMES, ReplayGuard, TicketClaims, TicketSigner, keys_digest
from kvshelf.service.bulk.transport import recv_bytes, shutdown
from kvshelf.service.errors import DataPathError, TicketError

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """A control call waiting for its data connection: ``wait`` returns it (with the hello's entries) once the
    listener delivers it, or raises the refusal; after ``close`` a late delivery is refused."""

    claims: TicketClaims
    namespace: str
    keys: Sequence[bytes]
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ready: threading.Event = field(default_factory=threading.Event)
    _conn: socket.socket | None = None
    _entries: tuple[Entry, ...] = ()
    _error: DataPathError | None = None
    _closed: bool = False
    peer: str = ""  # the host of the data connection, once delivered
    presented: bool = False  # a data connection presented the ticket (whatever became of it)
    finished: bool = False  # the transfer ended cleanly: its connection is kept for the client's next one

    def deliver(self, conn: socket.socket, entries: tuple[Entry, ...], peer: str) -> bool:
        with self._lock:
            if self._closed or self._ready.is_set():
                return False
            self._conn, self._entries, self.peer = conn, entries, peer
            self._ready.set()
            return True

    def refuse(self, error: DataPathError) -> None:
        with self._lock:
            if not self._ready.is_set():
                self._error = error
                self._ready.set()

    def close(self) -> None:
        """The call is over (ended, cancelled or timed out): wake its wait; a later delivery is refused."""
        with self._lock:
            self._closed = True
            self._ready.set()

    def wait(self, timeout_s: float) -> tuple[socket.socket, tuple[Entry, ...]]:
        self._ready.wait(timeout_s)
        with self._lock:
            if self._conn is not None:
                return self._conn, self._entries
            if self._error is not None:
                raise self._error
            self._closed = True
            if self._ready.is_set():
                raise DataPathError(grpc.StatusCode.CANCELLED, "the call ended before its data connection came")
            raise DataPathError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no data connection presented the ticket within {timeout_s:g} s")


class DataListener:
    """The data port of one server (see the module doc). ``expect`` registers a control call and returns its
    ticket; ``close`` stops accepting."""

    def __init__(self, host: str, port: int = 0, *, tls: ssl.SSLContext | None = None,
                 handshake_timeout_s: float = 5.0, ticket_ttl_s: float = 5.0, max_handshakes: int = 64,
                 keepalive_s: float = 30.0) -> None:
        self.tls = tls
        self.keepalive_s = keepalive_s
        self.handshake_timeout_s = handshake_timeout_s
        self.ticket_ttl_s = ticket_ttl_s
        self.max_handshakes = max(1, max_handshakes)
        self.max_per_peer = max(1, self.max_handshakes // 2)
        self.signer = TicketSigner()
        self.replays = ReplayGuard()
        self.accepted = 0  # connections accepted
        self.refused = 0  # connections refused (any reason)
        self.thread_failures = 0  # connections refused (or kept ones closed) because no thread could start
        self._pending: dict[bytes, Pending] = {}
        self._held: dict[str, int] = {}  # peer host -> its connections in their handshake or kept for their next
        self._kept_socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dualstack = host == "::" and socket.has_dualstack_ipv6()  # every address, as gRPC listens on "[::]:PORT"
        self._sock = socket.create_server((host, port), family=family, backlog=256, dualstack_ipv6=dualstack)
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="kvshelf-data-accept", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:
            self._sock.close()
            raise

    # -- control calls --------------------------------------------------------------------------------------------

    def expect(self, op: int, namespace: str, keys: Sequence[bytes]) -> tuple[bytes, Pending]:
        """A ticket for ``op`` on ``keys`` of ``namespace``, and the ``Pending`` its data connection will reach."""
        ticket, claims = self.signer.issue(op, namespace, keys, self.ticket_ttl_s)
        pending = Pending(claims, namespace, keys)
        with self._lock:
            self._pending[claims.nonce] = pending
        return ticket, pending

    def forget(self, pending: Pending) -> None:
        """The control call of ``pending`` is over."""
        pending.close()
        with self._lock:
            self._pending.pop(pending.claims.nonce, None)

    def keep(self, conn: socket.socket, peer: str) -> None:
        """Keep ``conn`` (its transfer ended cleanly) for its client's next hello, or close it when the listener
        holds too many connections (of that host, or in all)."""
        with self._lock:
            admitted = not self._closed and self._hold(peer) is None
            if admitted:
                self._kept_socks.add(conn)
        if not admitted:
            _close(conn)
            return
        if not self._start(self._next_hello, (conn, peer), "kvshelf-data-kept"):
            with self._lock:
                self._kept_socks.discard(conn)
            self._release(peer)
            _close(conn)

    def held(self, peer: str | None = None) -> int:
        """Connections in their handshake or kept for their next hello (of ``peer``, or in all)."""
        with self._lock:
            return self._held.get(peer, 0) if peer is not None else sum(self._held.values())

    def alive(self) -> bool:
        """Whether the accept loop runs."""
        return self._thread.is_alive()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending.values()), {}
            kept, self._kept_socks = list(self._kept_socks), set()
        shutdown(self._sock)
        self._sock.close()
        for p in pending:
            p.close()
        for conn in kept:
            shutdown(conn)
        self._thread.join(timeout=5)

    # -- admission ------------------------------------------------------------------------------------------------

    def _hold(self, peer: str) -> str | None:
        """Count one more connection of ``peer`` as held (the lock held); or the reason it cannot be."""
        total = sum(self._held.values())
        mine = self._held.get(peer, 0)
        if mine >= self.max_per_peer:
            return (f"{mine} data connections of {peer} are in their handshake or kept (at most "
                    f"{self.max_per_peer})")
        if total >= self.max_handshakes:
            return f"{total} data connections are in their handshake or kept (at most {self.max_handshakes})"
        self._held[peer] = mine + 1
        return None

    def _release(self, peer: str) -> None:
        """One held connection of ``peer`` is no longer held (its handshake ended, or it was closed)."""
        with self._lock:
            left = self._held.get(peer, 1) - 1
            if left > 0:
                self._held[peer] = left
            else:
                self._held.pop(peer, None)

    def _start(self, target: Callable[..., None], args: tuple[object, ...], name: str) -> bool:
        """Start a daemon thread running ``target(*args)``; False when none can start (the process is at its task
        limit: ``RuntimeError: can't start new thread``)."""
        try:
            threading.Thread(target=target, args=args, name=name, daemon=True).start()
        except RuntimeError as exc:
            self.thread_failures += 1
            log.warning("data path: cannot start a thread for a connection (%s); it is refused", exc)
            return False
        return True

    # -- connections ----------------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        """Accept until ``close``; a failure with one connection refuses that one and never ends the loop."""
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # EMFILE and the like: do not spin
                continue
            try:
                self._admit(conn, str(addr[0]))
            except Exception:  # supervision: the listener outlives whatever went wrong with one connection
                log.exception("data path: a connection failed at accept; the listener goes on")
                _close(conn)

    def _admit(self, conn: socket.socket, peer: str) -> None:
        """Hand an accepted connection to a handshake thread, or refuse it (too many held, no thread)."""
        self.accepted += 1
        with self._lock:
            why = self._hold(peer)
        if why is not None:
            self.refused += 1
            self._refuse(conn, DataPathError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{why}; retry later"), plain=True)
            return
        if not self._start(self._handshake, (conn, peer, True), "kvshelf-data-handshake"):
            self._release(peer)
            self.refused += 1
            self._refuse(conn, DataPathError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                             "the server cannot start a thread for this connection now; retry later"),
                         plain=True)

    def _next_hello(self, conn: socket.socket, peer: str) -> None:
        """A kept connection: wait for its next hello (``keepalive_s``), then its handshake (still held: it counts
        against the caps all along); closed quietly when its client closes it or sends nothing."""
        ready = False
        try:
            ready = _readable(conn, self.keepalive_s)
        finally:
            with self._lock:
                self._kept_socks.discard(conn)
            if not ready:
                self._release(peer)
                _close(conn)
        if ready:
            self._handshake(conn, peer, False)

    def _handshake(self, conn: socket.socket, peer: str, new: bool) -> None:
        """Read and check a hello, and deliver the connection (``new``: a fresh connection, TLS not started); the
        connection is no longer held once this ends."""
        pending: Pending | None = None
        try:
            deadline = time.monotonic() + self.handshake_timeout_s
            if new:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if new and self.tls is not None:
                conn.settimeout(self.handshake_timeout_s)
                conn = self.tls.wrap_socket(conn, server_side=True)
            head = parse_hello_head(recv_bytes(conn, HELLO_HEAD.size, "the hello", deadline=deadline))
            ticket, namespace = parse_hello_body(head, recv_bytes(conn, head.body_bytes, "the hello",
                                                                  deadline=deadline))
            claims = self.signer.verify(ticket)
            self.replays.use(claims)
            with self._lock:
                pending = self._pending.pop(claims.nonce, None)
            if pending is not None:
                pending.presented = True
            if pending is None:
                raise TicketError("ticket of a call that is over (it timed out, was cancelled or was answered)")
            _check_binding(head.op, namespace, head.count, claims, pending)
            entries = parse_entries(head, recv_bytes(conn, head.entries_bytes, "the hello", deadline=deadline))
            if keys_digest([e.key for e in entries]) != claims.digest:
                raise DataPathError(grpc.StatusCode.PERMISSION_DENIED,
                                    "the hello names other keys than the ticket was issued for")
            conn.settimeout(None)
            if not pending.deliver(conn, entries, peer):
                raise DataPathError(grpc.StatusCode.DEADLINE_EXCEEDED, "the call of this ticket is over")
        except DataPathError as exc:
            self.refused += 1
            log.debug("data connection of %s refused: %s", peer, exc)
            if pending is not None:
                pending.refuse(exc)
            self._refuse(conn, exc)
        except (OSError, ssl.SSLError) as exc:
            self.refused += 1
            log.debug("data connection of %s failed in its handshake: %s", peer, exc)
            if pending is not None:
                pending.refuse(DataPathError(grpc.StatusCode.DATA_LOSS, f"the data connection failed: {exc}"))
            conn.close()
        finally:
            self._release(peer)

    def _refuse(self, conn: socket.socket, error: DataPathError, *, plain: bool = False) -> None:
        """Send ``error``'s status frame (best effort: never blocks for long) and close ``conn``. ``plain``: refused
        at accept, before any TLS handshake (a ``REFUSED`` frame: the hello was not read; only on a plaintext
        listener)."""
        try:
            if not (plain and self.tls is not None):
                conn.settimeout(0.5)
                conn.sendall(encode_status(error.code, error.message, REFUSED if plain else STATUS))
            shutdown(conn)
        except (OSError, ValueError):
            pass
        finally:
            conn.close()


def _readable(conn: socket.socket, timeout_s: float) -> bool:
    """Whether ``conn`` has bytes to read within ``timeout_s`` (False: nothing came, or its peer closed it)."""
    if isinstance(conn, ssl.SSLSocket) and conn.pending():
        return True
    try:
        poller = select.poll()  # not select(): file descriptors past 1024 are common on a busy server
        poller.register(conn, select.POLLIN)
        if not poller.poll(timeout_s * 1000):
            return False
        if isinstance(conn, ssl.SSLSocket):
            return True  # a record came (an end of connection shows as such in the handshake)
        return conn.recv(1, socket.MSG_PEEK) != b""
    except (OSError, ValueError):
        return False


def _close(conn: socket.socket) -> None:
    shutdown(conn)
    conn.close()


def _check_binding(op: int, namespace: str, count: int, claims: TicketClaims, pending: Pending) -> None:
    """The hello's op, namespace and count are the ticket's (PERMISSION_DENIED naming what differs)."""
    if op != claims.op:
        raise DataPathError(grpc.StatusCode.PERMISSION_DENIED,
                            f"the hello asks for a {OP_NAMES[op]}; the ticket is for a {OP_NAMES[claims.op]}")
    if namespace != pending.namespace or not claims.for_namespace(namespace):
        raise DataPathError(grpc.StatusCode.PERMISSION_DENIED,
                            f"the hello names namespace {namespace[:256]!r}; the ticket is for another namespace")
    if count != len(pending.keys):
        raise DataPathError(grpc.StatusCode.PERMISSION_DENIED,
                            f"the hello names {count} keys; the ticket is for {len(pending.keys)}")
