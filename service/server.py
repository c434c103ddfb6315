"""The kvshelf gRPC servicer over a ``TieredStore`` of encoded blocks.

The server verifies each value (checksum, key, namespace, codec, payload size) and stores the bytes with
``put_encoded_many`` / ``get_encoded_many``; ``GetBlocks`` returns the bytes as stored. ``kvshelf serve``'s tiers
keep blocks as sent, in any codec (``TierSpec.as_sent``: clients decode, xquant with their own model tables); it
decodes a block only to re-encode it for a tier of another codec (``--disk-codec``, an operator's choice), and only
when its declared shape decodes within the max block size and the namespace's quota. Puts take quota and
in-flight budget (server-wide, and a per-tenant share of ``max_call_bytes``) at each value's first chunk, so an
over-limit put is refused before it is buffered. Tenants are isolated by key scoping: a tier key is
``scope(scope_tag(namespace), key)`` (``kvstore.keys``), so one namespace can never read, test, pin, list or delete
another's blocks.
One tenant cannot take the worker threads (``service/fairness.py``): streams take slots (workers less a reserve
for unary calls) under a per-tenant cap, and a watchdog ends idle and too slow streams and calls whose request
message never comes.

Every bad input ends its call with a clear status code and message; the server keeps serving. A call its client
cancelled ends quietly (no traceback in the log).
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvshelf.kvstore.encoding import BlockHeader
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import SCOPED_KEY_BYTES, ScopedKey, scope_tag, unscope
from kvshelf.kvstore.stats import ALL_TIERS, TIER_METRICS, Metric
from kvshelf.kvstore.store import TieredStore
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.arena import ArenaWriter
from kvshelf.service.auth import (
    MAX_NAMESPACE_CHARS,
    BearerError,
    TokenTable,
    bearer_token,
)
from kvshelf.service.bulk.handler import DataPathHandler
from kvshelf.service.bulk.listener import DataListener
from kvshelf.service.bulk.transport import server_tls
from kvshelf.service.core.limits import MAX_KEYS_PER_CALL, ServerLimits
from kvshelf.service.core.service import ServiceCore
from kvshelf.service.errors import ArenaUnavailable, WireError, WireLimitError
from kvshelf.service.events import EventHub, open_event_log
from kvshelf.service.fairness import (
    RequestWatch,
    StreamGate,
    StreamTicket,
    reserved_workers,
)
from kvshelf.service.history import StatsHistory
from kvshelf.service.hot_prefixes import HotPrefixes
from kvshelf.service.limits import MAX_CHUNK_BYTES, MAX_MESSAGE_BYTES
from kvshelf.service.put_stream import PutStream
from kvshelf.service.reflection import enable_reflection
from kvshelf.service.status import abort_call, client_fault, fail
from kvshelf.service.strikes import TenantStrikes
from kvshelf.service.wire import (
    decode_put_request,
    encode_arena_response,
    encode_chunk_response,
    encode_miss_response,
)

__all__ = ["CHUNK_BYTES", "MAX_CHUNK_BYTES", "MAX_KEYS_PER_CALL", "MAX_PUT_METADATA_BYTES", "SERVICE_NAME",
           "TIERS_HEALTH_NAME", "KVShelfServicer", "RunningServer", "ServerLimits", "is_local_peer", "iter_chunks",
           "start_server"]

log = logging.getLogger(__name__)

SERVICE_NAME = "kvshelf.v1.KVShelf"
#: Health service name that is NOT_SERVING while some tier is unreachable (the server itself still serves).
TIERS_HEALTH_NAME = "kvshelf.v1.KVShelf/tiers"
#: Bytes of a ``GetBlocksResponse`` besides its chunk's data, at most: index, chunk, key, data, last and total_size
#: fields with their tags and lengths (< 64 bytes; rounded up).
RESPONSE_FRAMING_BYTES = 256
#: GetBlocks chunks for a client that asks for no size: each message, framing included, fits the 4 MiB receive limit
#: of stock gRPC clients (grpc-js, Python and Go with default channel options).
CHUNK_BYTES = (4 << 20) - RESPONSE_FRAMING_BYTES
MIN_CHUNK_BYTES = 64 << 10  # a smaller GetBlocksRequest.max_chunk_bytes is raised to this (documented in the proto)
#: Bytes one PutBlocksRequest may carry besides its chunk's data (namespace, key, parent key, token ids, and any
#: unknown fields): a block's token ids take ~1-5 bytes each, so this admits blocks of 50k+ tokens (blocks are 256
#: by default). A larger message is refused (RESOURCE_EXHAUSTED) before protobuf parses it, so padding can make a
#: call neither hold memory nor cost more than ~50-80 ms of CPU (the hand-written walk over tiny fields).
MAX_PUT_METADATA_BYTES = 256 << 10


def iter_chunks(value: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[memoryview, bool]]:
    """``(data, last)`` zero-copy pieces of ``value`` of at most ``chunk_bytes`` each (one empty piece for b"")."""
    view = memoryview(value)
    n = len(view)
    if n == 0:
        yield view, True
        return
    for start in range(0, n, chunk_bytes):
        end = min(start + chunk_bytes, n)
        yield view[start:end], end == n


def is_local_peer(peer: str) -> bool:
    """Whether a gRPC peer string (``ipv4:127.0.0.1:5555``, ``ipv6:[::1]:5555``, ``unix:...``) is this host."""
    if peer.startswith("unix:"):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].startswith("127.")
    if peer.startswith("ipv6:"):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
        return host == "::1" or host.startswith("::ffff:127.")
    return False


class TierHealthProbe:
    """The gRPC health statuses of one store's tiers: ``SERVICE_NAME`` serves while any tier does,
    ``TIERS_HEALTH_NAME`` is NOT_SERVING while a tier is unreachable or damaged."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.health = health.HealthServicer()
        self.damaged_tiers: list[str] = []
        self._down: list[str] = []
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None

    def refresh(self) -> list[str]:
        """Probe the tiers; set the health statuses; return the names of unreachable (or damaged) tiers."""
        tiers = self.store.typed_stats().tiers
        down = [t.name for t in tiers if not t.available]
        self.damaged_tiers = [t.name for t in tiers if t.damaged]
        serving = health_pb2.HealthCheckResponse.SERVING
        self.health.set("", serving)
        self.health.set(SERVICE_NAME, serving)  # the local tiers serve even when a shared tier is down
        self.health.set(TIERS_HEALTH_NAME, health_pb2.HealthCheckResponse.NOT_SERVING if down else serving)
        if down != self._down:
            if down:
                log.warning("degraded: unreachable or damaged tiers %s (the other tiers serve)", ", ".join(down))
            else:
                log.warning("all tiers reachable again")
            self._down = down
        return down

    def start(self, interval_s: float = 5.0) -> None:
        """Probe the tiers now and every ``interval_s`` seconds in a daemon thread."""
        self.refresh()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.refresh()
                except Exception:
                    log.exception("health probe failed")

        self._prober = threading.Thread(target=loop, name="kvshelf-health", daemon=True)
        self._prober.start()

    def stop(self) -> None:
        self._stop.set()
        self.health.enter_graceful_shutdown()


class KVShelfServicer:
    """Handlers of ``kvshelf.v1.KVShelf``: the caller's tenant from its token, then the service core's rules
    (``service/core/``) over gRPC messages (requests are parsed by ``RpcHandlers``, so malformed bytes are
    INVALID_ARGUMENT)."""

    def __init__(self, store: TieredStore, *, tokens: TokenTable | None = None,
                 limits: ServerLimits | None = None, history: StatsHistory | None = None,
                 max_workers: int = 16, events_dir: str | Path | None = None) -> None:
        self.store = store
        self.history = history
        self.tokens = tokens
        self.limits = limits = limits or ServerLimits()
        self.streams = StreamGate(tenant_streams=limits.tenant_streams,
                                  slots=max_workers - reserved_workers(max_workers),
                                  idle_timeout_s=limits.idle_timeout_s, min_rate_bytes=limits.min_rate_bytes,
                                  strikes=TenantStrikes(limits.strike_burst, limits.strike_leak_per_s)
                                  if limits.strike_burst else None)
        if store.max_decoded_bytes is None or store.max_decoded_bytes > limits.max_block_bytes:
            store.max_decoded_bytes = limits.max_block_bytes  # bounds promotion and write-down re-encodes
        # KV events (service/events.py): persistent under events_dir, else in memory
        self.events = EventHub(store, open_event_log(events_dir, limits.events_log_bytes),
                               queue_events=limits.subscriber_queue, max_subscriptions=limits.max_subscriptions,
                               tenant_subscriptions=limits.tenant_subscriptions)
        #: called with the namespace after each Clear (the vLLM-format publisher's AllBlocksCleared)
        self.clear_listeners: list[Callable[[str], None]] = []
        #: the most reused prefixes (the deepest key of each reused run), per namespace (the admin dashboard)
        self.hot_prefixes = HotPrefixes()
        self.core = ServiceCore(store, limits, self.events, self.hot_prefixes)
        self.usage, self.inflight = self.core.usage, self.core.inflight
        self.probe = TierHealthProbe(store)
        self.health = self.probe.health
        #: the bulk data path (``service/bulk/``), set by ``start_server`` when on
        self.data_path: DataPathHandler | None = None

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return RpcHandlers(self).generic_handler()

    # -- tenancy --------------------------------------------------------------------------------------

    def tenant_of(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """The namespace a call's bearer token names (None: dev mode, no token or an unknown one)."""
        if self.tokens is None:
            return None
        try:
            return self.tokens.namespace_of(bearer_token(metadata))
        except BearerError:
            return None

    def namespace(self, context: grpc.ServicerContext, requested: str) -> str:
        """The caller's namespace: its token's (a differing ``requested`` is PERMISSION_DENIED), or in dev
        mode (no tokens file) ``requested`` or ``default``."""
        if self.tokens is None:
            namespace = requested or "default"
        else:
            try:
                token = bearer_token(context.invocation_metadata())
            except BearerError as exc:
                fail(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            namespace = self.tokens.namespace_of(token)
            if namespace is None:
                fail(grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token")
            if requested and requested != namespace:
                fail(grpc.StatusCode.PERMISSION_DENIED,
                     f"this token is for namespace {namespace!r}, the request names {requested!r}")
        if len(namespace) > MAX_NAMESPACE_CHARS:
            fail(grpc.StatusCode.INVALID_ARGUMENT, f"namespace longer than {MAX_NAMESPACE_CHARS} characters")
        return namespace

    def scoped(self, context: grpc.ServicerContext, requested: str,
               keys: Sequence[bytes]) -> tuple[str, list[ScopedKey]]:
        namespace = self.namespace(context, requested)
        return namespace, self.core.scope(namespace, keys)

    # -- health ---------------------------------------------------------------------------------------

    @property
    def damaged_tiers(self) -> list[str]:
        return self.probe.damaged_tiers

    def refresh_health(self) -> list[str]:
        """Probe the tiers; set the health statuses; return the names of unreachable (or damaged) tiers."""
        return self.probe.refresh()

    def start_health_probe(self, interval_s: float = 5.0) -> None:
        """Probe the tiers now and every ``interval_s`` seconds in a daemon thread."""
        self.probe.start(interval_s)

    def close(self) -> None:
        self.probe.stop()
        self.core.close()
        self.streams.close()
        self.events.end_subscriptions()  # events of calls still draining are logged until RunningServer.stop ends

    # -- RPCs -----------------------------------------------------------------------------------------

    def PutBlocks(self, requests: Iterable[tuple[pb.PutBlocksRequest, memoryview, int]],
                  context: grpc.ServicerContext) -> Message:
        """Buffer the call's values as they arrive (``PutStream``), holding in-flight budget and quota for them from
        each value's first chunk, so an over-quota or over-budget put is refused before its data is buffered, and
        verifying each value as soon as it is whole; then store them all (``ServiceCore.commit``)."""
        stream: PutStream | None = None
        headers: list[BlockHeader] = []
        try:
            for req, data, message_bytes in requests:  # data: the chunk's bytes, a view of the message (wire.py)
                if stream is None:
                    stream = PutStream(self.core.put_call(self.namespace(context, req.namespace)))
                    pin = req.pin
                elif req.namespace and req.namespace != stream.call.namespace:
                    fail(grpc.StatusCode.INVALID_ARGUMENT, "the namespace may only be set on the first message")
                if not req.HasField("chunk"):
                    fail(grpc.StatusCode.INVALID_ARGUMENT, "malformed PutBlocks message: no chunk")
                done = stream.add(req.chunk, data, message_bytes)
                if done is not None:  # checked as soon as it is whole: a damaged value ends the call before the rest
                    headers.append(self.core.verify(stream.call.namespace, *done))
            if stream is None:  # an empty stream: still authenticate
                self.namespace(context, "")
                return pb.PutBlocksResponse(received=0, stored=0)
            received, stored = self.core.commit(stream.call, stream.values(), headers, pin, context.is_active)
            return pb.PutBlocksResponse(received=received, stored=stored)
        finally:
            if stream is not None:
                stream.call.close()

    def _arena(self, req: pb.GetBlocksRequest, context: grpc.ServicerContext) -> ArenaWriter | None:
        """The request's shared-memory arena when allowed and usable (local peer, our file, right token)."""
        if not (req.HasField("arena") and self.limits.shared_memory and is_local_peer(context.peer())):
            return None
        try:
            return ArenaWriter.open(req.arena.name, req.arena.token)
        except ArenaUnavailable as exc:
            log.debug("arena not used: %s", exc)
            return None

    def GetBlocks(self, req: pb.GetBlocksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Serialised ``GetBlocksResponse`` messages (built by ``service.wire``: one copy of the data).

        With a usable shared-memory arena (same host), values that fit are written there and only their
        offsets are sent; the rest go over the wire in chunks.
        """
        self.core.check_model(req.fingerprint, "GetBlocksRequest.fingerprint")
        namespace, keys = self.scoped(context, req.namespace, list(req.keys))
        arena = self._arena(req, context)
        try:
            chunk_bytes = (min(max(req.max_chunk_bytes, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES) if req.max_chunk_bytes
                           else CHUNK_BYTES)
            for index, tier_key, value in self.core.served(keys, namespace, req.fingerprint or None, req.tokens):
                yield from _get_response(index, tier_key, value, arena, chunk_bytes)
        finally:
            if arena is not None:
                arena.close()

    def Contains(self, req: pb.KeysRequest, context: grpc.ServicerContext) -> Message:
        _, keys = self.scoped(context, req.namespace, list(req.keys))
        present = self.store.held(keys)
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        return pb.ContainsResponse(present=present, prefix=prefix)

    def LookupPrefix(self, req: pb.LookupPrefixRequest, context: grpc.ServicerContext) -> Message:
        self.core.check_model(req.model, "LookupPrefixRequest.model")
        namespace, keys = self.scoped(context, req.namespace, list(req.keys))
        tokens = list(req.tokens) if len(req.tokens) == len(keys) else None
        found = self.store.lookup_prefix(keys, namespace=namespace, model=req.model or "?", tokens=tokens)
        if found:
            self.core.count_prefix(namespace, keys, found, tokens)
        return pb.LookupPrefixResponse(found=found)

    def Delete(self, req: pb.KeysRequest, context: grpc.ServicerContext) -> Message:
        _, keys = self.scoped(context, req.namespace, list(req.keys))
        return pb.CountResponse(count=self.store.delete(keys))

    def Pin(self, req: pb.KeysRequest, context: grpc.ServicerContext) -> Message:
        _, keys = self.scoped(context, req.namespace, list(req.keys))
        # the store pins held blocks only: pins never name absent (or other tenants') keys
        return pb.CountResponse(count=self.store.pin(keys))

    def Unpin(self, req: pb.KeysRequest, context: grpc.ServicerContext) -> Message:
        _, keys = self.scoped(context, req.namespace, list(req.keys))
        return pb.CountResponse(count=self.store.unpin(keys))

    def Clear(self, req: pb.ClearRequest, context: grpc.ServicerContext) -> Message:
        namespace = self.namespace(context, req.namespace)
        # each tier finds the namespace's keys its own way (Redis: a SCAN matching the tag, no round trip per key);
        # every pin of the namespace goes too, held or not
        tag = scope_tag(namespace)
        with self.events.clearing(tag):  # one AllBlocksCleared event instead of a removal per block
            count = self.store.clear_prefix(tag, SCOPED_KEY_BYTES)
        self.events.cleared(tag)
        self.hot_prefixes.forget(namespace)
        for listener in self.clear_listeners:
            listener(namespace)
        return pb.CountResponse(count=count)

    def Stats(self, req: pb.StatsRequest, context: grpc.ServicerContext) -> Message:
        namespace = self.namespace(context, req.namespace)
        down = self.refresh_health()
        out = _stats(self, namespace, down)
        return pb.StatsResponse(json=json.dumps(out), degraded=bool(down))


def _get_response(index: int, tier_key: ScopedKey, value: bytes | None, arena: ArenaWriter | None,
                  chunk_bytes: int) -> Iterator[bytes]:
    """The serialised ``GetBlocksResponse`` messages of one served value: a miss, its place in the arena, or its
    chunks."""
    if value is None:
        yield encode_miss_response(index)
        return
    offset = arena.write(value) if arena is not None else None
    if offset is not None:
        yield encode_arena_response(index, unscope(tier_key), offset, len(value))
        return
    first = True
    for data, last in iter_chunks(value, chunk_bytes):
        if first:
            yield encode_chunk_response(index, data, key=unscope(tier_key), last=last, total_size=len(value))
            first = False
        else:
            yield encode_chunk_response(index, data, last=last)


def _stats(servicer: KVShelfServicer, namespace: str, down: list[str]) -> dict[str, Any]:
    """The JSON object of a ``Stats`` answer for ``namespace`` (``down``: the tiers unreachable now)."""
    store, streams = servicer.store, servicer.streams
    full = store.typed_stats()
    rows = [r for r in full.rows if r.namespace == namespace]
    tag = scope_tag(namespace)
    held = servicer.usage.usage(tag)
    tiers = []
    for t in full.tiers:
        blocks, nbytes = held.get(t.name, (0, 0))
        entry = {"name": t.name, "codec": t.codec, "available": t.available, "blocks": blocks,
                 "bytes": nbytes, "capacity_bytes": t.capacity_bytes}
        for metric in TIER_METRICS:
            entry[metric.value] = sum(r.get(metric) for r in rows if r.tier == t.name)
        tiers.append(entry)

    def rate(hit: Metric, total: Metric) -> float | None:
        n = sum(r.get(total) for r in rows if r.tier == ALL_TIERS)
        return sum(r.get(hit) for r in rows if r.tier == ALL_TIERS) / n if n else None

    out: dict[str, Any] = {
        "namespace": namespace,
        "tiers": tiers,
        "lookup_hit_rate": rate(Metric.LOOKUP_HIT_BLOCKS, Metric.LOOKUP_BLOCKS),
        "retrieve_hit_rate": rate(Metric.RETRIEVE_HIT_BLOCKS, Metric.RETRIEVE_BLOCKS),
        "rows": [r.as_dict() for r in rows],
        "pinned": sum(1 for key in store.pinned_keys() if key.startswith(tag)),
        "usage": {"bytes": max((b for _, b in held.values()), default=0), "quota_bytes": servicer.limits.quota_bytes},
        "health": {"status": "degraded" if down else "serving", "unavailable_tiers": down,
                   "damaged_tiers": servicer.damaged_tiers},
        "streams": {"open": streams.open_streams(namespace), "cap": streams.cap(namespace),
                    "server_refused": streams.refused, "server_refused_strikes": streams.refused_strikes,
                    "server_ended_idle": streams.ended_idle, "server_ended_slow": streams.ended_slow},
        "events": servicer.events.stats(namespace),
        "top_prefixes": servicer.hot_prefixes.top(10, None if servicer.tokens is None else frozenset((namespace,))),
    }
    if servicer.tokens is None:  # dev mode: the whole store (every namespace) and its history for the admin tool
        out["store"] = full.as_dict()
        if servicer.history is not None:
            out["history"] = servicer.history.points()
    return out


class RpcHandlers:
    """The gRPC method table of one servicer: each request parsed here (malformed bytes: INVALID_ARGUMENT), every
    failure a status, streams under the servicer's gate (``service/fairness.py``)."""

    def __init__(self, servicer: KVShelfServicer) -> None:
        self.servicer = servicer
        self.streams = servicer.streams

    def generic_handler(self) -> grpc.GenericRpcHandler:
        s = self.servicer
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "PutBlocks": grpc.stream_unary_rpc_method_handler(self.put_stream, response_serializer=_serialize),
            "GetBlocks": grpc.unary_stream_rpc_method_handler(self.get_stream, response_serializer=bytes),
            "Contains": self.unary(s.Contains, pb.KeysRequest),
            "LookupPrefix": self.unary(s.LookupPrefix, pb.LookupPrefixRequest),
            "Delete": self.unary(s.Delete, pb.KeysRequest),
            "Pin": self.unary(s.Pin, pb.KeysRequest),
            "Unpin": self.unary(s.Unpin, pb.KeysRequest),
            "Stats": self.unary(s.Stats, pb.StatsRequest),
            "Clear": self.unary(s.Clear, pb.ClearRequest),
            "SubscribeEvents": grpc.unary_stream_rpc_method_handler(self.events_stream, response_serializer=bytes),
            "OpenDataPath": grpc.unary_stream_rpc_method_handler(self.data_path_stream, response_serializer=bytes),
        })

    @staticmethod
    def unary(fn: Callable[[Any, grpc.ServicerContext], Message], req: type[Message]) -> grpc.RpcMethodHandler:
        def handler(raw: bytes, context: grpc.ServicerContext) -> Message:
            try:
                return fn(_parse(raw, req), context)
            except Exception as exc:  # every failure becomes a status; the server keeps serving
                abort_call(context, exc)

        return grpc.unary_unary_rpc_method_handler(handler, response_serializer=_serialize)

    @contextmanager
    def _strikes_client_faults(self, ticket: StreamTicket) -> Iterator[None]:
        """A stream's failure that its client caused (``status.client_fault``) strikes its tenant
        (``service/strikes.py``); the failure goes on as it was."""
        try:
            yield
        except Exception as exc:
            if client_fault(exc):
                self.streams.strike(ticket.namespace)
            raise

    # streams take a slot of the gate and count against their tenant's cap as soon as its namespace is known; the
    # watchdog ends them when idle or too slow

    def get_stream(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            req = _parse(raw, pb.GetBlocksRequest)
            with self.streams.open(context, "GetBlocks") as ticket:
                ticket.admit(self.servicer.namespace(context, req.namespace))
                with self._strikes_client_faults(ticket):
                    yield from ticket.sent(self.servicer.GetBlocks(req, context))
        except Exception as exc:
            abort_call(context, exc)

    def put_stream(self, raws: Iterator[bytes], context: grpc.ServicerContext) -> Message:
        try:
            first: tuple[pb.PutBlocksRequest, memoryview, int] | None = None
            if self.servicer.tokens is None:  # dev mode: the first message names the tenant; read it like a request
                raw = self.streams.read_request(context, "PutBlocks", raws, None)
                first = None if raw is None else _parse_put(raw)
                del raw  # the parsed message holds what it needs: the call counts what it keeps
            with self.streams.open(context, "PutBlocks", check_rate=True) as ticket:
                ticket.admit(self.servicer.namespace(context, "" if first is None else first[0].namespace))
                requests = _put_requests(first, raws, ticket)
                del first  # the generator holds it until it is taken, then drops it
                with self._strikes_client_faults(ticket):
                    return self.servicer.PutBlocks(requests, context)
        except Exception as exc:
            abort_call(context, exc)

    # the bulk data path (service/bulk/): a stream whose values move over a data connection, under the same gate
    def data_path_stream(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            req = _parse(raw, pb.DataPathRequest)
            self.servicer.core.check_model(req.fingerprint, "DataPathRequest.fingerprint")
            data_path = self.servicer.data_path
            if data_path is None:
                fail(grpc.StatusCode.FAILED_PRECONDITION,
                     "this server's data path is off (--no-data-path): use GetBlocks and PutBlocks")
            with self.streams.open(context, "OpenDataPath", check_rate=req.op == pb.DataPathRequest.PUT) as ticket:
                ticket.admit(self.servicer.namespace(context, req.namespace))
                with self._strikes_client_faults(ticket):
                    yield from data_path.serve(req, ticket.namespace or "", context, ticket)
        except Exception as exc:
            abort_call(context, exc)

    # long-lived: outside the stream gate (no idle timeout); capped by the event hub (service/events.py)
    def events_stream(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            req = _parse(raw, pb.SubscribeEventsRequest)
            namespace = self.servicer.namespace(context, req.namespace)
            yield from self.servicer.events.subscribe(namespace, req.from_seq, context)
        except Exception as exc:
            abort_call(context, exc)


def _put_requests(first: tuple[pb.PutBlocksRequest, memoryview, int] | None, raws: Iterator[bytes],
                  ticket: StreamTicket) -> Iterator[tuple[pb.PutBlocksRequest, memoryview, int]]:
    """The parsed messages of a put stream (``first``: the one already read in dev mode). The watchdog's min rate
    counts data bytes: padding (other fields) is no progress."""
    if first is not None:
        ticket.progress(len(first[1]))
        parsed, first = first, None
        yield parsed
    for raw in ticket.received(raws, count_bytes=False):
        parsed = _parse_put(raw)
        del raw
        ticket.progress(len(parsed[1]))
        yield parsed


def _parse(raw: bytes, cls: type[Message]) -> Any:
    message = cls()
    try:
        message.ParseFromString(raw)
    except (DecodeError, RuntimeWarning) as exc:
        fail(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.__name__}: {exc}")
    return message


def _parse_put(raw: bytes) -> tuple[pb.PutBlocksRequest, memoryview, int]:
    """A ``PutBlocksRequest``, its chunk's data as a view of ``raw`` (``service/wire.py``: no copy), and the size
    of ``raw``. A message carrying more than ``MAX_PUT_METADATA_BYTES`` besides its data is RESOURCE_EXHAUSTED,
    before protobuf parses it."""
    try:
        message, data = decode_put_request(raw, max_rest_bytes=MAX_PUT_METADATA_BYTES)
    except WireLimitError as exc:
        fail(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc} (a chunk's key, lineage and any other fields)")
    except WireError as exc:
        fail(grpc.StatusCode.INVALID_ARGUMENT, f"malformed PutBlocksRequest: {exc}")
    return message, data, len(raw)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


@dataclass
class RunningServer:
    """A started server: ``port`` is the bound port (useful with port 0)."""

    server: grpc.Server
    servicer: KVShelfServicer
    port: int
    data_port: int | None = None  # the bulk data path's port (None: off)

    def stop(self, grace_s: float | None = 5.0) -> None:
        """Stop accepting calls, let in-flight ones finish for up to ``grace_s`` seconds, then cancel them."""
        self.servicer.close()
        self.server.stop(grace_s).wait()
        if self.servicer.data_path is not None:
            self.servicer.data_path.listener.close()
        self.servicer.events.close()  # after the drained calls' events are logged


def start_server(
    store: TieredStore,
    listen: str = "127.0.0.1:0",
    *,
    tokens: TokenTable | None = None,
    limits: ServerLimits | None = None,
    tls_cert: bytes | None = None,
    tls_key: bytes | None = None,
    max_workers: int = 16,
    health_interval_s: float = 5.0,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    history: StatsHistory | None = None,
    events_dir: str | Path | None = None,
) -> RunningServer:
    """Serve ``store`` on ``listen`` (``host:port``; port 0 picks a free one). TLS when cert and key are given.
    ``events_dir``: where the KV event log persists (``service/events.py``); None: in memory only."""
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("TLS needs both a certificate and a key")
    servicer = KVShelfServicer(store, tokens=tokens, limits=limits, history=history, max_workers=max_workers,
                               events_dir=events_dir)
    server = grpc.server(
        # event subscriptions get threads of their own (capped by max_subscriptions): never the streams' or unary's
        futures.ThreadPoolExecutor(max_workers=max_workers + servicer.limits.max_subscriptions,
                                   thread_name_prefix="kvshelf-rpc"),
        # first (outermost): unary requests are read under the stream watchdog (service/fairness.py)
        interceptors=[RequestWatch(servicer.streams, servicer.tenant_of, SERVICE_NAME), *interceptors],
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0)],
    )
    server.add_generic_rpc_handlers((servicer.generic_handler(),))
    health_pb2_grpc.add_HealthServicer_to_server(servicer.health, server)
    enable_reflection(server, (pb.DESCRIPTOR.services_by_name["KVShelf"].full_name, health.SERVICE_NAME))
    try:
        if tls_cert is not None and tls_key is not None:
            port = server.add_secure_port(listen, grpc.ssl_server_credentials([(tls_key, tls_cert)]))
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        port = 0
    if port == 0:
        servicer.events.close()  # the event log's lock and the store listener go with the server that never ran
        raise ConfigError(f"cannot listen on {listen!r} (address in use or invalid)")
    try:
        data_port = _start_data_path(servicer, listen, tls_cert, tls_key)
    except BaseException:
        server.stop(0)
        servicer.events.close()
        raise
    servicer.start_health_probe(health_interval_s)
    server.start()
    return RunningServer(server, servicer, port, data_port)


def _start_data_path(servicer: KVShelfServicer, listen: str, tls_cert: bytes | None,
                     tls_key: bytes | None) -> int | None:
    """The bulk data path's listener on the gRPC listen host (``service/bulk/``), when on and ``listen`` is TCP;
    its port."""
    limits = servicer.limits
    if not limits.data_path or listen.startswith(("unix:", "unix-abstract:")):
        return None
    host = listen.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:").rsplit(":", 1)[0].strip("[]")
    tls = server_tls(tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
    timeout_s = limits.idle_timeout_s / 2  # a ticket (and a data connection's hello) waits at most this long
    try:
        listener = DataListener(host, limits.data_port, tls=tls, handshake_timeout_s=timeout_s, ticket_ttl_s=timeout_s,
                                max_handshakes=limits.data_handshakes)
    except OSError as exc:
        raise ConfigError(f"cannot listen for the data path on {host}:{limits.data_port}: {exc.strerror}") from None
    servicer.data_path = DataPathHandler(servicer.core, listener)
    return listener.port
