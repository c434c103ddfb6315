"""Admission and watchdog of streaming calls (``PutBlocks``, ``GetBlocks``): one tenant cannot lock out others.

A sync gRPC server runs each call on one of its ``max_workers`` threads for the whole call, and a streaming
call holds its thread while it waits on its client. Without limits, a tenant opening ``max_workers`` idle
streams takes every thread and every other tenant's calls end in ``DEADLINE_EXCEEDED``. ``StreamGate``:

* **Stream slots.** Streams together may hold at most ``slots`` threads: ``max_workers`` less a reserve
  (``reserved_workers``) that only unary calls (Contains, LookupPrefix, Stats...) can use, so those always
  find a thread. A stream over the slots is refused at once (``StreamRefusedError`` -> RESOURCE_EXHAUSTED).
* **Per-tenant cap.** A namespace may have at most ``tenant_streams`` streams admitted at once (and never
  more than the slots); one more is refused at once naming the cap. A ``PutBlocks`` names its namespace on
  its first message in dev mode: until then it holds a slot, not yet a tenant's share, and the idle timeout
  below ends it if that message never comes.
* **Watchdog.** One daemon thread per gate ends (``DEADLINE_EXCEEDED`` with a message saying why) a stream
  that has waited on its client for ``idle_timeout_s`` (no message received for a put; no message taken by
  the client for a get), and a put whose average rate since its start is below ``min_rate_bytes`` per second
  once it is ``idle_timeout_s`` old (slowloris). Ending the call wakes its handler thread, which returns.

Time the server spends working (reading or writing the store) never counts as idle: only time waiting on the
client does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from kvshelf.kvstore.errors import KVShelfError

log = logging.getLogger(__name__)


class StreamRefusedError(KVShelfError):
    """A streaming call refused at admission: its tenant is at its cap, or every stream slot is taken."""


def reserved_workers(max_workers: int) -> int:
    """Worker threads kept for unary calls: a quarter of them, at least one (none with a single worker)."""
    return 0 if max_workers <= 1 else max(1, max_workers // 4)


def end_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End ``context``'s call from any thread with ``code`` and ``details`` (the client sees both).

    ``ServicerContext.abort`` works only on the handler's thread and ``cancel()`` sends a bare CANCELLED: the
    sync server's call object can cancel with a status. Falls back to ``cancel()`` where it is missing.
    """
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is not None:
        try:
            call.cancel(code.value[0], details)
            return
        except (TypeError, ValueError, AttributeError):
            pass
    context.cancel()


class StreamTicket:
    """One open stream as the gate sees it; methods are called from the stream's handler thread."""

    def __init__(self, gate: StreamGate, context: grpc.ServicerContext, method: str, check_rate: bool) -> None:
        self._gate = gate
        self.context = context
        self.method = method
        self.check_rate = check_rate
        self.namespace: str | None = None
        self.started = time.monotonic()
        self.waiting_since: float | None = self.started  # waiting on the client since; None while working
        self.nbytes = 0
        self.receiving = True  # for puts: the request stream has not ended yet
        self.ended = False  # the watchdog ended this call
        self._closed = False

    def admit(self, namespace: str) -> None:
        """Count this stream against ``namespace``'s cap (raises ``StreamRefusedError`` when at the cap)."""
        self._gate._admit(self, namespace)

    def waiting(self) -> None:
        """From now on the stream waits on its client (idle time counts)."""
        self.waiting_since = time.monotonic()

    def progress(self, nbytes: int) -> None:
        """The client sent (put) or took (get) a message of ``nbytes``: the stream works again."""
        self.nbytes += nbytes
        self.waiting_since = None

    def received(self, raws: Iterator[bytes]) -> Iterator[bytes]:
        """The messages of a request stream, each one counted as progress."""
        while True:
            self.waiting()
            try:
                raw = next(raws)
            except StopIteration:
                break
            finally:
                self.waiting_since = None
            self.progress(len(raw))
            yield raw
        self.receiving = False

    def sent(self, messages: Iterator[bytes]) -> Iterator[bytes]:
        """``messages`` passed on to gRPC; the time until gRPC asks for the next one (it has handed the previous
        one to the client's flow-control window) counts as waiting on the client."""
        self.waiting_since = None  # the server works (reads the store) until its first message
        for message in messages:
            self.waiting()
            yield message
            self.progress(len(message))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._gate._release(self)

    def __enter__(self) -> StreamTicket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamGate:
    """Stream slots, per-tenant caps and the idle / slow-stream watchdog of one server (see the module doc)."""

    def __init__(self, *, tenant_streams: int, slots: int, idle_timeout_s: float, min_rate_bytes: int,
                 tick_s: float | None = None) -> None:
        self.tenant_streams = max(1, tenant_streams)
        self.slots = max(1, slots)
        self.idle_timeout_s = idle_timeout_s
        self.min_rate_bytes = min_rate_bytes
        self.tick_s = tick_s if tick_s is not None else min(1.0, max(0.05, idle_timeout_s / 5))
        self._lock = threading.Lock()
        self._open: set[StreamTicket] = set()
        self._by_namespace: dict[str, int] = {}
        self.refused = 0
        self.ended_idle = 0
        self.ended_slow = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- admission ------------------------------------------------------------------------------------

    def open(self, context: grpc.ServicerContext, method: str, *, check_rate: bool = False) -> StreamTicket:
        """Take a stream slot for a call (raises ``StreamRefusedError`` when none is left); watched from now."""
        ticket = StreamTicket(self, context, method, check_rate)
        with self._lock:
            if len(self._open) >= self.slots:
                self.refused += 1
                raise StreamRefusedError(
                    f"server busy: all {self.slots} stream slots are in use (worker threads less a reserve for "
                    f"unary calls); retry later")
            self._open.add(ticket)
            self._ensure_watchdog()
        return ticket

    def _admit(self, ticket: StreamTicket, namespace: str) -> None:
        with self._lock:
            if ticket.namespace is not None:
                return
            held = self._by_namespace.get(namespace, 0)
            cap = min(self.tenant_streams, self.slots)
            if held >= cap:
                self.refused += 1
                raise StreamRefusedError(
                    f"namespace {namespace!r} already has {held} streaming calls open; the cap is {cap} per tenant "
                    f"(--tenant-streams)")
            self._by_namespace[namespace] = held + 1
            ticket.namespace = namespace

    def _release(self, ticket: StreamTicket) -> None:
        with self._lock:
            self._open.discard(ticket)
            if ticket.namespace is not None:
                left = self._by_namespace.get(ticket.namespace, 1) - 1
                if left > 0:
                    self._by_namespace[ticket.namespace] = left
                else:
                    self._by_namespace.pop(ticket.namespace, None)

    def open_streams(self, namespace: str | None = None) -> int:
        """Streams holding a slot (of ``namespace`` only when given)."""
        with self._lock:
            if namespace is None:
                return len(self._open)
            return self._by_namespace.get(namespace, 0)

    # -- watchdog -------------------------------------------------------------------------------------

    def _ensure_watchdog(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._watch, name="kvshelf-stream-watchdog", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.check(time.monotonic())
            except Exception:  # the watchdog must outlive any surprise
                log.exception("stream watchdog check failed")

    def check(self, now: float) -> list[tuple[StreamTicket, str]]:
        """End the streams idle or slow at ``now``; return them with the reason given to their clients."""
        with self._lock:
            tickets = list(self._open)
        ended = []
        for ticket in tickets:
            reason = self._verdict(ticket, now)
            if reason is None:
                continue
            ticket.ended = True
            who = f"namespace {ticket.namespace!r}" if ticket.namespace is not None else f"peer {_peer(ticket)}"
            log.warning("ended a %s stream of %s: %s", ticket.method, who, reason)
            details = f"{ticket.method} ended by the server: {reason}"
            end_call(ticket.context, grpc.StatusCode.DEADLINE_EXCEEDED, details)
            ended.append((ticket, reason))
        return ended

    def _verdict(self, ticket: StreamTicket, now: float) -> str | None:
        if ticket.ended:
            return None
        since = ticket.waiting_since
        if since is not None and now - since > self.idle_timeout_s:
            self.ended_idle += 1
            what = "no message received" if ticket.method == "PutBlocks" else "the client took no message"
            return f"{what} for {now - since:.1f} s (idle timeout {self.idle_timeout_s:g} s, --idle-timeout)"
        age = now - ticket.started
        if ticket.check_rate and ticket.receiving and age > self.idle_timeout_s:
            rate = ticket.nbytes / age
            if rate < self.min_rate_bytes:
                self.ended_slow += 1
                return (f"{ticket.nbytes} bytes received in {age:.1f} s ({rate:.0f} bytes/s) is below the minimum "
                        f"rate of {self.min_rate_bytes} bytes/s (--min-rate)")
        return None

    def close(self) -> None:
        """Stop the watchdog (open streams are left to the server's shutdown)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _peer(ticket: StreamTicket) -> Any:
    try:
        return ticket.context.peer()
    except Exception:  # noqa: BLE001 - only for a log line
        return "?"
