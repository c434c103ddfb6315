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

* **Request messages.** The sync server reads a unary call's request message on a worker thread before any
  handler runs, so a client that sends a call's headers and never its message (raw HTTP/2; no token needed)
  would hold a thread forever. ``RequestWatch``, a server interceptor, serves every unary-request method
  (ours, health, reflection's are streams already) as a request-streaming one that reads the one message under
  the gate: a call still waiting for it after ``grace_s`` counts as a stream (slot and tenant cap, its bucket
  being its bearer token's namespace, or ``(anonymous)``; over them it is ended at once with
  RESOURCE_EXHAUSTED) and is ended after ``idle_timeout_s``. Honest calls carry their message with their
  headers and never wait that long. Stream-request methods of other services (reflection) take a slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvshelf.service.errors import StreamRefusedError
from kvshelf.service.strikes import TenantStrikes

log = logging.getLogger(__name__)


#: Trailing metadata of a stream refused for want of a slot: milliseconds after which a retry may succeed.
RETRY_AFTER_METADATA = "kvshelf-retry-after-ms"
RETRY_AFTER_MS = 20


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

    def __init__(self, gate: StreamGate, context: grpc.ServicerContext, method: str, check_rate: bool,
                 awaiting: str | None = None) -> None:
        self._gate = gate
        self.context = context
        self.method = method
        self.check_rate = check_rate
        self.awaiting = awaiting  # a unary call waiting for its request message: its bucket (tenant or anonymous)
        self.late_at = 0.0  # for those: when a request message still not read makes the call count as a stream
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

    def received(self, raws: Iterator[bytes], *, count_bytes: bool = True) -> Iterator[bytes]:
        """The messages of a request stream, each one counted as progress (with its size in bytes towards the
        min rate; ``count_bytes=False``: the caller counts what it deems progress with ``progress``)."""
        while True:
            self.waiting()
            try:
                raw = next(raws)
            except StopIteration:
                break
            finally:
                self.waiting_since = None
            self.progress(_size(raw) if count_bytes else 0)
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
                 tick_s: float | None = None, strikes: TenantStrikes | None = None) -> None:
        self.tenant_streams = max(1, tenant_streams)
        self.slots = max(1, slots)
        self.idle_timeout_s = idle_timeout_s
        self.min_rate_bytes = min_rate_bytes
        self.tick_s = tick_s if tick_s is not None else min(0.25, max(0.05, idle_timeout_s / 5))
        self.grace_s = min(0.5, idle_timeout_s / 2)  # how long a request message may be late before it counts
        self.short_grace_s = 0.02  # the same when its bucket already holds its cap (it has shown it stalls)
        self._lock = threading.Lock()
        self._open: set[StreamTicket] = set()
        self._awaiting: set[StreamTicket] = set()  # unary calls reading their request message
        self._by_namespace: dict[str, int] = {}
        self.refused = 0
        self.refused_strikes = 0  # of those, refused because the tenant had too many strikes
        self.strikes = strikes
        self.ended_idle = 0
        self.ended_slow = 0
        self._wake = threading.Condition(self._lock)
        self._stopped = False
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

    def read_request(self, context: grpc.ServicerContext, method: str, requests: Iterator[Any],
                     bucket: str | None) -> Any:
        """The request message of a unary call (None if the client sent none), read under the watchdog."""
        ticket = StreamTicket(self, context, method, False, awaiting=bucket or ANONYMOUS)
        with self._lock:
            self._awaiting.add(ticket)
            self._ensure_watchdog()
            if self._by_namespace.get(ticket.awaiting, 0) >= self.cap(ticket.awaiting) or \
                    len(self._open) >= self.slots:
                ticket.late_at = ticket.started + self.short_grace_s
                self._wake.notify()
            else:
                ticket.late_at = ticket.started + self.grace_s
        try:
            return next(requests, None)
        finally:
            ticket.close()

    def strike(self, namespace: str | None) -> None:
        """Count a call of ``namespace`` that failed through its client's fault (see ``service/strikes.py``)."""
        if self.strikes is not None and namespace is not None and namespace != ANONYMOUS:
            self.strikes.strike(namespace)

    def cap(self, bucket: str) -> int:
        """Streams (and late unary calls) one bucket may hold: ``tenant_streams``, never more than the slots; half
        that for anonymous calls (no token: health, reflection, stalled unauthenticated calls)."""
        cap = min(self.tenant_streams, self.slots)
        return max(1, cap // 2) if bucket == ANONYMOUS else cap

    def _admit(self, ticket: StreamTicket, namespace: str) -> None:
        if self.strikes is not None and namespace != ANONYMOUS:
            wait_s = self.strikes.blocked_for(namespace)
            if wait_s > 0:
                with self._lock:
                    self.refused += 1
                    self.refused_strikes += 1
                raise StreamRefusedError(
                    f"namespace {namespace!r} is refused for {wait_s:.1f} s: too many of its calls failed through its "
                    f"own fault (bad, oversized or over-quota puts, idle streams); fix them, then retry",
                    retry=False)
        with self._lock:
            if ticket.namespace is not None:
                return
            held = self._by_namespace.get(namespace, 0)
            cap = self.cap(namespace)
            if held >= cap:
                self.refused += 1
                raise StreamRefusedError(
                    f"namespace {namespace!r} already has {held} streaming calls open; the cap is {cap} per tenant "
                    f"(--tenant-streams)")
            self._by_namespace[namespace] = held + 1
            ticket.namespace = namespace

    def _release(self, ticket: StreamTicket) -> None:
        with self._lock:
            self._awaiting.discard(ticket)
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
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._watch, name="kvshelf-stream-watchdog", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while True:
            with self._wake:
                if self._stopped:
                    return
                now = time.monotonic()
                due = [t.late_at - now for t in self._awaiting if t.namespace is None and not t.ended]
                self._wake.wait(max(0.0, min([self.tick_s, *due])))
                if self._stopped:
                    return
            try:
                self.check(time.monotonic())
            except Exception:  # the watchdog must outlive any surprise
                log.exception("stream watchdog check failed")

    def check(self, now: float) -> list[tuple[StreamTicket, str]]:
        """End the streams idle or slow at ``now``; return them with the reason given to their clients."""
        ended = []
        for ticket, reason in self._late_requests(now):
            log.debug("refused a %s call of %s: %s", ticket.method, _who(ticket), reason)
            end_call(ticket.context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{ticket.method} refused: {reason}")
            ended.append((ticket, reason))
        with self._lock:
            tickets = list(self._open)
        for ticket in tickets:
            reason = self._verdict(ticket, now)
            if reason is None:
                continue
            ticket.ended = True
            log.warning("ended a %s call of %s: %s", ticket.method, _who(ticket), reason)
            self.strike(ticket.namespace)
            details = f"{ticket.method} ended by the server: {reason}"
            end_call(ticket.context, grpc.StatusCode.DEADLINE_EXCEEDED, details)
            ended.append((ticket, reason))
        return ended

    def _late_requests(self, now: float) -> list[tuple[StreamTicket, str]]:
        """Count unary calls whose request message is later than ``grace_s`` as streams; return those refused."""
        refused = []
        with self._lock:
            late = sorted((t for t in self._awaiting if t.namespace is None and not t.ended and now >= t.late_at),
                          key=lambda t: t.started)
            for ticket in late:
                bucket = ticket.awaiting or ANONYMOUS
                held = self._by_namespace.get(bucket, 0)
                cap = self.cap(bucket)
                if len(self._open) >= self.slots or held >= cap:
                    ticket.ended = True
                    self.refused += 1
                    why = (f"all {self.slots} stream slots are in use" if held < cap else
                           f"{bucket} already has {held} streams or late calls open (cap {cap}, --tenant-streams)")
                    refused.append((ticket, f"no request message after {now - ticket.started:.1f} s and {why}"))
                    continue
                self._open.add(ticket)
                self._by_namespace[bucket] = held + 1
                ticket.namespace = bucket
        return refused

    def _verdict(self, ticket: StreamTicket, now: float) -> str | None:
        if ticket.ended:
            return None
        since = ticket.waiting_since
        if since is not None and now - since > self.idle_timeout_s:
            self.ended_idle += 1
            what = ("no request message received" if ticket.awaiting is not None else
                    "no message received" if ticket.method == "PutBlocks" else
                    "the data connection made no progress" if ticket.method == "OpenDataPath" else
                    "the client took no message")
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
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _size(message: Any) -> int:
    """Bytes of a received message: raw bytes, or a parsed protobuf message (other services' methods)."""
    if isinstance(message, bytes | bytearray | memoryview):
        return len(message)
    byte_size = getattr(message, "ByteSize", None)
    return int(byte_size()) if callable(byte_size) else 0


ANONYMOUS = "(anonymous)"  # the bucket of calls whose tenant is not known before their first message


def _who(ticket: StreamTicket) -> str:
    if ticket.namespace is not None and ticket.namespace != ANONYMOUS:
        return f"namespace {ticket.namespace!r}"
    try:
        return f"peer {ticket.context.peer()}"
    except Exception:  # noqa: BLE001 - only for a log line
        return "an unknown peer"


class RequestWatch(grpc.ServerInterceptor):
    """Serves unary-request methods as request-streaming ones whose message is read under ``gate`` (see the
    module doc); other services' request-streaming methods (reflection) take a stream slot.

    ``tenant_of(metadata)``: the namespace a call's bearer token names, or None (no tokens, unknown token).
    ``own_service``: the service whose streams take their slots themselves (``KVShelfServicer``).
    """

    def __init__(self, gate: StreamGate, tenant_of: Callable[[Any], str | None], own_service: str) -> None:
        self.gate = gate
        self.tenant_of = tenant_of
        self.own_prefix = f"/{own_service}/"

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        full_method = handler_call_details.method
        method = full_method.rsplit("/", 1)[-1]
        gate = self.gate
        if handler.request_streaming:
            if full_method.startswith(self.own_prefix):
                return handler
            return _slotted(handler, gate, method)
        bucket = self.tenant_of(handler_call_details.invocation_metadata)
        deserializer = handler.request_deserializer
        options = dict(response_serializer=handler.response_serializer)  # requests parsed here: see _parsed

        def read(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            request = gate.read_request(context, method, requests, bucket)
            if request is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} requires exactly one request message")
            return _parsed(request, deserializer, method, context)

        if handler.unary_unary is not None:
            unary = handler.unary_unary
            return grpc.stream_unary_rpc_method_handler(lambda requests, context: unary(read(requests, context),
                                                                                        context), **options)
        stream = handler.unary_stream
        if getattr(stream, "experimental_non_blocking", False):  # health's Watch: answers through a callback
            def non_blocking(requests: Iterator[Any], context: grpc.ServicerContext, send: Callable) -> Any:
                return stream(read(requests, context), context, send)

            non_blocking.experimental_non_blocking = True  # type: ignore[attr-defined]
            return grpc.stream_stream_rpc_method_handler(non_blocking, **options)
        return grpc.stream_stream_rpc_method_handler(lambda requests, context: stream(read(requests, context),
                                                                                      context), **options)


def _parsed(raw: Any, deserializer: Callable[[bytes], Any] | None, method: str,
            context: grpc.ServicerContext) -> Any:
    """``raw`` parsed by the method's deserializer; malformed bytes end the call with INVALID_ARGUMENT (gRPC's own
    parsing would log a traceback per message and answer INTERNAL)."""
    if deserializer is None:
        return raw
    try:
        return deserializer(raw)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the client's
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method} request: {exc}")


def _slotted(handler: grpc.RpcMethodHandler, gate: StreamGate, method: str) -> grpc.RpcMethodHandler:
    """A request-streaming handler of another service that holds a stream slot (anonymous) while it runs."""
    deserializer = handler.request_deserializer
    options = dict(response_serializer=handler.response_serializer)  # requests parsed here: see _parsed

    def parsed(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        for raw in requests:
            yield _parsed(raw, deserializer, method, context)

    def admitted(context: grpc.ServicerContext) -> StreamTicket:
        try:
            ticket = gate.open(context, method)
            try:
                ticket.admit(ANONYMOUS)
            except StreamRefusedError:
                ticket.close()
                raise
        except StreamRefusedError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return ticket

    if handler.stream_unary is not None:
        inner_unary = handler.stream_unary

        def unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            with admitted(context) as ticket:
                return inner_unary(parsed(ticket.received(requests), context), context)

        return grpc.stream_unary_rpc_method_handler(unary, **options)
    inner_stream = handler.stream_stream

    def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        with admitted(context) as ticket:
            for response in inner_stream(parsed(ticket.received(requests), context), context):
                ticket.waiting_since = None
                yield response

    return grpc.stream_stream_rpc_method_handler(stream, **options)
