"""The server side of ``OpenDataPath``: issue the ticket, wait for the data connection, move the values over it.

Runs on the control call's worker thread, which holds a stream slot of its tenant (``service/fairness.py``) for the
whole transfer: the per-tenant cap bounds a tenant's data connections, and the watchdog ends a transfer that stalls or
crawls (each piece read or written counts as progress; ending the call shuts the data connection, which wakes the
thread). The rules of ``PutBlocks`` and ``GetBlocks`` hold, through the same service core (``service/core/``):

* put: the announced sizes are checked against the max block size, the per-call limit, the in-flight budget and the
  quota *before the ticket is issued* (``PutReservation.reserve_declared``); each value is read with ``recv_into``
  into a buffer of its announced size, checked against its checksum and verified as a block (key, namespace, codec)
  as soon as it is whole; the end mark must follow the last one; nothing is stored until all of them are, then they
  are stored as ``PutBlocks`` stores them (``ServiceCore.commit``); the status frame acknowledges them;
* get: once the data connection is delivered (nothing is read for a ticket never presented), the store reads and
  checks the values as for ``GetBlocks`` (``ServiceCore.served``: a few ahead of what is sent, a key named more
  than once read once); each goes out with one scatter-gather send of its head and its bytes as stored (no copy),
  its checksum the block's own.

A failure is sent as a status frame on the data connection (best effort) and ends the call with the same status.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.bulk.framing import (
    CHECKSUM_BYTES,
    END_MARK,
    MISS_HEAD,
    UNANSWERED_METADATA,
    Entry,
    check_end,
    check_trailer,
    encode_done,
    encode_status,
    encode_value_head,
    trailer_checksum,
    value_hasher,
)
from kvshelf.service.bulk.listener import DataListener, Pending
from kvshelf.service.bulk.ticket import OP_GET, OP_PUT
from kvshelf.service.bulk.transport import receive_value, recv_bytes, recv_exact, send_parts, shutdown
from kvshelf.service.errors import DataPathError, FramingError
from kvshelf.service.status import fail, status_of

if TYPE_CHECKING:
    from kvshelf.service.core.service import ServiceCore
    from kvshelf.service.fairness import StreamTicket


class DataPathHandler:
    """``OpenDataPath`` over one ``DataListener``, under the rules of one ``ServiceCore``."""

    def __init__(self, core: ServiceCore, listener: DataListener) -> None:
        self.core = core
        self.listener = listener
        self.idle_timeout_s = core.limits.idle_timeout_s

    def serve(self, req: pb.DataPathRequest, namespace: str, context: grpc.ServicerContext,
              ticket: StreamTicket) -> Iterator[bytes]:
        """The serialised ``DataPathResponse`` messages of one call (its ticket, then its result)."""
        keys = list(req.keys)
        self.core.check_keys(keys)
        if req.op == OP_PUT:
            yield from self._put(req, namespace, keys, context, ticket)
        elif req.op == OP_GET:
            yield from self._get(req, namespace, keys, context, ticket)
        else:
            fail(grpc.StatusCode.INVALID_ARGUMENT, f"DataPathRequest.op must be GET (1) or PUT (2), got {req.op}")

    def _ticket(self, op: int, namespace: str, keys: list[bytes]) -> tuple[bytes, Pending]:
        ticket, pending = self.listener.expect(op, namespace, keys)
        message = pb.DataPathResponse(ticket=pb.DataPathTicket(
            ticket=ticket, port=self.listener.port, tls=self.listener.tls is not None,
            expires_s=self.listener.ticket_ttl_s))
        return message.SerializeToString(), pending

    def _connection(self, pending: Pending, context: grpc.ServicerContext,
                    ticket: StreamTicket) -> tuple[socket.socket, tuple[Entry, ...]]:
        """The call's data connection once the listener delivers it; ending the call (its client, the watchdog)
        wakes the wait and later shuts the connection."""
        context.add_callback(pending.close)
        ticket.waiting()
        try:
            conn, entries = pending.wait(self.listener.ticket_ttl_s)
        except DataPathError:
            if not pending.presented:  # the data port never saw its client: tell it not to wait there any more
                context.set_trailing_metadata(((UNANSWERED_METADATA, "1"),))
            raise
        ticket.progress(0)

        def ended() -> None:  # the call is over: a transfer still running is cut (a finished one is kept)
            if not pending.finished:
                shutdown(conn)

        if not context.add_callback(ended):  # the call ended meanwhile
            shutdown(conn)
        conn.settimeout(self.idle_timeout_s)  # a stall ends the transfer even if the watchdog did not
        return conn, entries

    def _put(self, req: pb.DataPathRequest, namespace: str, keys: list[bytes], context: grpc.ServicerContext,
             ticket: StreamTicket) -> Iterator[bytes]:
        sizes = list(req.sizes)
        if len(sizes) != len(keys):
            fail(grpc.StatusCode.INVALID_ARGUMENT, f"a put names {len(keys)} keys and {len(sizes)} sizes")
        call = self.core.put_call(namespace)
        conn: socket.socket | None = None
        pending: Pending | None = None
        try:
            call.reserve_declared(list(zip(keys, sizes, strict=True)))  # before any byte is sent
            first, pending = self._ticket(OP_PUT, namespace, keys)
            yield first
            conn, entries = self._connection(pending, context, ticket)
            try:
                values, headers = [], []
                for index, (entry, size) in enumerate(zip(entries, sizes, strict=True)):
                    if entry.size != size:
                        raise FramingError(f"value {index} (key {entry.key.hex()}) is announced as {entry.size} "
                                           f"bytes on the data connection and {size} in the request")
                    # a bytes filled in place by recv_exact (or dropped): the memory tier keeps it without a copy
                    value, view = receive_value(size)
                    hasher = value_hasher()
                    ticket.waiting()
                    # hashed as it lands (in the cache, while the client sends the next piece): verified once
                    recv_exact(conn, view, f"value {index}", progress=ticket.progress, hasher=hasher,
                               hash_end=size - CHECKSUM_BYTES)
                    del view
                    check_trailer(entry.key, value, entry.checksum)
                    headers.append(self.core.verify(namespace, entry.key, value, hasher.digest()))
                    values.append((entry.key, value))
                ticket.waiting()
                check_end(recv_bytes(conn, len(END_MARK), "the end mark"))
                ticket.receiving = False
                ticket.progress(len(END_MARK))
                received, stored = self.core.commit(call, values, headers, req.pin, context.is_active)
                # stored, so counted as held: its reservations go before the end frame, after which the client may
                # start its next put at once (which must not find this one's bytes still "being written")
                call.close()
                _finish(conn, pending, ticket, encode_done(received, stored))
            except OSError as exc:  # the data connection broke (reset, closed): the client's side
                raise _broken(conn, exc, context) from None
            except Exception as exc:
                _send_failure(conn, exc)
                raise
            yield pb.DataPathResponse(result=pb.DataPathResult(received=received, stored=stored)).SerializeToString()
        finally:
            call.close()
            self._done(pending, conn)

    def _get(self, req: pb.DataPathRequest, namespace: str, keys: list[bytes], context: grpc.ServicerContext,
             ticket: StreamTicket) -> Iterator[bytes]:
        scoped = self.core.scope(namespace, keys)
        conn: socket.socket | None = None
        first, pending = self._ticket(OP_GET, namespace, keys)
        try:
            yield first
            conn, _ = self._connection(pending, context, ticket)
            # read only now that its client is connected (a ticket never presented costs no read), a few values
            # ahead of what is sent, each key once however often it is named (``ServiceCore.served``)
            served = self.core.served(scoped, namespace, req.fingerprint or None, list(req.tokens))
            found = 0
            try:
                for _, _, value in served:
                    ticket.waiting()  # a client that does not read blocks the send: idle
                    if value is None:
                        send_parts(conn, [MISS_HEAD], ticket.progress)
                        continue
                    send_parts(conn, [encode_value_head(len(value), trailer_checksum(value)), value], ticket.progress)
                    found += 1
                _finish(conn, pending, ticket, encode_done(len(keys), found))
            except OSError as exc:  # the data connection broke (reset, closed): the client's side
                raise _broken(conn, exc, context) from None
            except Exception as exc:
                _send_failure(conn, exc)
                raise
            yield pb.DataPathResponse(result=pb.DataPathResult(found=found)).SerializeToString()
        finally:
            self._done(pending, conn)

    def _done(self, pending: Pending | None, conn: socket.socket | None) -> None:
        if pending is not None:
            self.listener.forget(pending)
        if conn is None:
            return
        if pending is not None and pending.finished:
            conn.settimeout(None)
            self.listener.keep(conn, pending.peer)
        else:
            shutdown(conn)
            conn.close()


def _finish(conn: socket.socket, pending: Pending, ticket: StreamTicket, done: bytes) -> None:
    """Send the end frame of a transfer that went well. Its client may start its next call (or cancel this one) as
    soon as it has the frame, so first: the stream slot is given back (the transfer is over; what is left of the call
    is its result message), and the transfer marked finished (the call's end must then not cut the connection, which
    is kept)."""
    ticket.close()
    pending.finished = True
    try:
        send_parts(conn, [done])
    except BaseException:
        pending.finished = False
        raise


#: after a failure, what the server still reads (and drops) of a put the client keeps sending, so that the status
#: frame reaches it instead of a reset (closing a socket with unread data resets it)
DRAIN_S = 0.25
DRAIN_BYTES = 64 << 20


def _broken(conn: socket.socket, exc: OSError, context: grpc.ServicerContext) -> DataPathError:
    """The error of a data connection that broke: DATA_LOSS, or CANCELLED when the call had ended first (its client
    left, or the watchdog ended it: the connection was shut because of that)."""
    if not context.is_active():
        return DataPathError(grpc.StatusCode.CANCELLED, "the call ended during its transfer")
    error = DataPathError(grpc.StatusCode.DATA_LOSS, f"the data connection broke: {exc.strerror or exc}")
    _send_failure(conn, error)
    return error


def _send_failure(conn: socket.socket, exc: Exception) -> None:
    """Tell the data connection's client why its transfer failed (best effort: the control call says it too), then
    read what it still sends for a moment, so that the frame is not lost to a reset."""
    code, message = (exc.code, exc.message) if isinstance(exc, DataPathError) else status_of(exc)
    try:
        conn.settimeout(DRAIN_S)
        send_parts(conn, [encode_status(code, message)])
        conn.shutdown(socket.SHUT_WR)
        deadline, drained, sink = time.monotonic() + DRAIN_S, 0, bytearray(1 << 20)
        while drained < DRAIN_BYTES and time.monotonic() < deadline:
            n = conn.recv_into(sink)
            if n == 0:
                break
            drained += n
    except (OSError, DataPathError):
        pass
