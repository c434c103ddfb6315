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
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvshelf.kvstore.codec import describe_shape, get_codec
from kvshelf.kvstore.encoding import DTYPE_NAMES, BlockHeader, decode_cost_bytes, verify_block
from kvshelf.kvstore.errors import (
    ConfigError,
    CorruptBlockError,
    ForeignBlockError,
)
from kvshelf.kvstore.keys import KEY_BYTES, SCOPED_KEY_BYTES, BlockKey, ScopedKey, scope, scope_tag, unscope
from kvshelf.kvstore.limits import MAX_FINGERPRINT_CHARS
from kvshelf.kvstore.stats import ALL_TIERS, TIER_METRICS, Metric
from kvshelf.kvstore.store import TieredStore, TierSpec
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
from kvshelf.service.reflection import enable_reflection
from kvshelf.service.status import abort_call, client_fault, fail
from kvshelf.service.strikes import TenantStrikes
from kvshelf.service.usage import InflightBudget, NamespaceUsage, TierBytes, add_tier_bytes
from kvshelf.service.wire import (
    decode_put_request,
    encode_arena_response,
    encode_chunk_response,
    encode_miss_response,
)

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
#: A received message whose data is a view keeps the whole message alive. When the message carries more than this
#: besides its data, the data is copied out and the message freed, so a call holds its data, not its padding.
KEEP_VIEW_OVERHEAD_BYTES = 64 << 10
MAX_KEYS_PER_CALL = 100_000
#: What a get reads ahead of what it has sent: its first read is one value; each later one as many keys as fit this
#: many bytes, judged by the values read so far (at most ``READ_BATCH_KEYS``), so a get holds about this much plus
#: one value, however large its values (``KVShelfServicer.served``).
READ_AHEAD_BYTES = 32 << 20
READ_BATCH_KEYS = 16
#: A value a get names again later is kept for it (read once) while the values kept add up to at most this many
#: bytes, and always the first one; past that it is read again where it is named again.
REPEAT_KEEP_BYTES = 16 << 20


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


@dataclass(frozen=True)
class ServerLimits:
    """Size limits and quotas of one server."""

    max_block_bytes: int = 256 << 20  # one encoded value, and what one may decode to (server or client)
    max_call_bytes: int = 1 << 30  # one PutBlocks call (held until it ends); also one tenant's puts in flight together
    quota_bytes: int | None = None  # per namespace, in each tier (overwrites count what they add); None: unlimited
    shared_memory: bool = True  # same-host GetBlocks through client arenas in /dev/shm (service/arena.py)
    tenant_streams: int = 8  # streaming calls one tenant may have open at once
    idle_timeout_s: float = 10.0  # a stream making no progress this long is cancelled
    min_rate_bytes: int = 1 << 20  # slowest accepted upload (bytes/s), checked once a put is idle_timeout_s old
    max_inflight_bytes: int | None = None  # put bytes buffered at once, all tenants; None: 2 x max_call_bytes
    strike_burst: int = 20  # failed calls (client's fault) at which a tenant's streams are refused; 0: never
    strike_leak_per_s: float = 5.0  # failed calls per second a tenant is forgiven (service/strikes.py)
    max_subscriptions: int = 8  # SubscribeEvents streams open at once, all tenants (extra worker threads)
    tenant_subscriptions: int = 2  # SubscribeEvents streams one tenant may have open at once
    subscriber_queue: int = 10_000  # events waiting for one subscriber before it is cut off as too slow
    events_log_bytes: int = 64 << 20  # the persistent event log's bound (replay reaches back this far)
    data_path: bool = True  # the bulk data path beside gRPC (service/bulk/): values over a raw TCP (or TLS) port
    data_port: int = 0  # its port on the listen host (0: any free one; clients learn it from each ticket)
    data_handshakes: int = 64  # data connections in their handshake at once (half that from one peer host)

    @property
    def inflight_bytes(self) -> int:
        """Put bytes buffered at once, all tenants together (``max_inflight_bytes``, else 2 x ``max_call_bytes``)."""
        return self.max_inflight_bytes or 2 * self.max_call_bytes

    def __post_init__(self) -> None:
        if self.max_block_bytes <= 0 or self.max_call_bytes <= 0:
            raise ConfigError("max block and call sizes must be > 0")
        if self.quota_bytes is not None and self.quota_bytes <= 0:
            raise ConfigError(f"the namespace quota must be > 0 bytes, got {self.quota_bytes}")
        if not 0 <= self.data_port < 65536 or self.data_handshakes < 1:
            raise ConfigError(f"data_port must be in [0, 65535] and data_handshakes >= 1, got {self.data_port}, "
                              f"{self.data_handshakes}")
        if self.strike_burst < 0 or self.strike_leak_per_s <= 0:
            raise ConfigError(f"strike_burst must be >= 0 and strike_leak_per_s > 0, got {self.strike_burst}, "
                              f"{self.strike_leak_per_s}")


class _PutCall:
    """The values of one PutBlocks call as they arrive, and the in-flight budget and quota they hold.

    Memory is counted by what the call holds, not by data bytes: a chunk kept as a view of its received message
    holds the whole message (a message padded with other fields is copied out instead, see
    ``KEEP_VIEW_OVERHEAD_BYTES``), and the lineage a value's first chunk names (parent key, token ids) is held until
    the call ends. A value holds budget and quota for its declared ``total_size`` (already bounded by the max block
    size) from its first chunk, before its data is buffered, and for more if its messages hold more; values without
    a declared size take them chunk by chunk. Everything is checked against the per-call limit, the in-flight budget
    and the quota before it is kept. ``close`` gives everything back.
    """

    def __init__(self, servicer: KVShelfServicer, namespace: str) -> None:
        self.servicer, self.limits = servicer, servicer.limits
        self.namespace, self.tag = namespace, scope_tag(namespace)
        self._done: list[tuple[bytes, bytes]] = []
        self._key: bytes | None = None
        self._parts: list[memoryview] = []  # the current value's chunks (views of the received messages, or copies)
        self._parts_held = 0  # bytes those parts keep alive (whole messages for views)
        self.lineage: dict[bytes, tuple[bytes, array]] = {}  # key -> (parent key, token ids) its first chunk named
        self._filled = 0
        self._declared = 0  # the current value's total_size (0: not declared)
        self._call_bytes = 0  # bytes of the finished values plus what the current one holds
        self._value_held = 0  # bytes the current value holds (its declared size, else what arrived)
        self._budget = 0  # in-flight budget taken
        self._quota: TierBytes = {}  # quota reserved (the finished values, then the current one)
        self._value_quota: TierBytes = {}

    def add(self, chunk: pb.Chunk, data: memoryview, message_bytes: int) -> tuple[bytes, bytes] | None:
        """Take one chunk (``data``: its bytes, apart from the message; ``message_bytes``: the size of the received
        message it came in); return ``(key, value)`` when it completes a value, else None."""
        limits = self.limits
        if chunk.in_arena:
            fail(grpc.StatusCode.INVALID_ARGUMENT, "PutBlocks chunks carry their data: in_arena is GetBlocks-only")
        if self._key is None:
            if not chunk.key:
                fail(grpc.StatusCode.INVALID_ARGUMENT, "the first chunk of a value must carry its key")
            self.servicer.check_keys([chunk.key])
            if chunk.total_size > limits.max_block_bytes:
                fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"a block of {chunk.total_size} bytes exceeds the max block size {limits.max_block_bytes}")
            self._key, self._declared, self._filled = chunk.key, chunk.total_size, 0
            self._value_quota, self._value_held, self._parts_held = {}, 0, 0
            self._take_lineage(chunk)
            self._hold(self._declared or len(data))
        else:
            if chunk.key and chunk.key != self._key:
                fail(grpc.StatusCode.INVALID_ARGUMENT,
                      f"chunk for key {chunk.key.hex()} before the value of {self._key.hex()} ended (no last=true)")
            if chunk.parent_key or chunk.token_ids or chunk.total_size:
                fail(grpc.StatusCode.INVALID_ARGUMENT,
                      f"parent_key, token_ids and total_size belong on the first chunk of a value; a later chunk of "
                      f"key {self._key.hex()} carries them")
        end = self._filled + len(data)
        if self._declared and end > self._declared:
            fail(grpc.StatusCode.INVALID_ARGUMENT,
                  f"value of key {self._key.hex()} is longer than its declared total_size of {self._declared} bytes")
        if end > limits.max_block_bytes:
            fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"block {self._key.hex()} exceeds the max block size of {limits.max_block_bytes} bytes")
        if len(data):
            if message_bytes - len(data) > KEEP_VIEW_OVERHEAD_BYTES:
                data, holds = memoryview(bytes(data)), len(data)  # frees the padded message: hold the data only
            else:
                holds = max(message_bytes, len(data))  # the view keeps the whole message alive
            # budget and quota for what the value holds (at least its declared size) before the chunk is kept
            self._hold(max(self._declared, self._parts_held + holds))
            self._parts.append(data)
            self._parts_held += holds
        self._filled = end
        if chunk.last:
            if self._declared and self._filled != self._declared:
                fail(grpc.StatusCode.INVALID_ARGUMENT,
                      f"value of key {self._key.hex()} ended after {self._filled} bytes; its declared total_size "
                      f"is {self._declared}")
            value = b"".join(self._parts)  # one copy
            self._parts, self._parts_held = [], 0
            done = (self._key, value)
            self._done.append(done)
            self._key = None
            return done
        return None

    def _take_lineage(self, chunk: pb.Chunk) -> None:
        """Keep the ``(parent key, token ids)`` a value's first chunk names for its BlockStored events, holding
        budget for them (4 bytes a token id) until the call ends."""
        if not (chunk.parent_key or chunk.token_ids):
            return
        parent, tokens = _lineage(chunk)
        self._take(len(parent) + tokens.itemsize * len(tokens) + LINEAGE_ENTRY_BYTES)
        assert self._key is not None
        self.lineage[self._key] = (parent, tokens)

    def _take(self, nbytes: int) -> None:
        """Hold ``nbytes`` of the call's own (not a value's) against the per-call limit and the in-flight budget."""
        self._check_call(nbytes)
        self.servicer.inflight.take(self.tag, self.namespace, nbytes)
        self._budget += nbytes
        self._call_bytes += nbytes

    def _check_call(self, grow: int) -> None:
        if self._call_bytes + grow > self.limits.max_call_bytes:
            fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"one PutBlocks call may hold at most {self.limits.max_call_bytes} bytes (its values, the messages "
                  f"that carry them, and their token ids); this one would hold {self._call_bytes + grow}: split it")

    def _hold(self, size: int) -> None:
        """Make the current value hold budget and quota for ``size`` bytes (its declared size, or what its
        received messages hold)."""
        grow = size - self._value_held
        if grow <= 0:
            return
        self._check_call(grow)
        if self.limits.quota_bytes is not None:
            assert self._key is not None
            usage = self.servicer.usage
            tier_key = scope(self.tag, BlockKey(self._key))
            new = usage.reserve(self.tag, self.namespace, [(tier_key, size)], self.limits.quota_bytes,
                                replacing=self._value_quota)
            add_tier_bytes(self._quota, new, self._value_quota)
            self._value_quota = new
        self.servicer.inflight.take(self.tag, self.namespace, grow)
        self._budget += grow
        self._call_bytes += grow
        self._value_held = size

    def reserve_declared(self, sizes: Sequence[tuple[bytes, int]]) -> None:
        """Hold budget and quota for values announced with their sizes (the bulk data path, ``service/bulk/``)
        before any of their bytes arrives: each within the max block size, all within the per-call limit, the
        in-flight budget and the namespace's quota (RESOURCE_EXHAUSTED naming which)."""
        limits = self.limits
        for key, size in sizes:
            if size > limits.max_block_bytes:
                fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"a block of {size} bytes (key {key.hex()}) exceeds the max block size {limits.max_block_bytes}")
        total = sum(size for _, size in sizes)
        self._check_call(total)
        if limits.quota_bytes is not None:
            reserved = self.servicer.usage.reserve(self.tag, self.namespace,
                                                   [(scope(self.tag, BlockKey(key)), size) for key, size in sizes],
                                                   limits.quota_bytes)
            add_tier_bytes(self._quota, reserved, {})
        self.servicer.inflight.take(self.tag, self.namespace, total)
        self._budget += total
        self._call_bytes += total

    def values(self) -> list[tuple[bytes, bytes]]:
        if self._key is not None:
            fail(grpc.StatusCode.INVALID_ARGUMENT,
                  f"the stream ended inside the value of key {self._key.hex()} (no chunk with last=true); "
                  "nothing stored")
        return self._done

    def hold_more(self, nbytes: int) -> None:
        """Take ``nbytes`` more in-flight budget (the copies a re-encode makes) until the call ends."""
        if nbytes > 0:
            self.servicer.inflight.take(self.tag, self.namespace, nbytes)
            self._budget += nbytes

    def reserve_exact(self, sizes: Sequence[tuple[bytes, int | TierBytes]]) -> None:
        """Replace the quota held since the first chunks by the exact sizes each tier will store."""
        if self.limits.quota_bytes is None:
            return
        self._quota = self.servicer.usage.reserve(self.tag, self.namespace, sizes, self.limits.quota_bytes,
                                                  replacing=self._quota)

    def close(self) -> None:
        if self._quota:
            self.servicer.usage.release(self.tag, self._quota)
            self._quota = {}
        if self._budget:
            self.servicer.inflight.give(self.tag, self._budget)
            self._budget = 0


class KVShelfServicer:
    """Handlers of ``kvshelf.v1.KVShelf`` (requests are parsed here, so malformed bytes are INVALID_ARGUMENT)."""

    def __init__(self, store: TieredStore, *, tokens: TokenTable | None = None,
                 limits: ServerLimits | None = None, history: StatsHistory | None = None,
                 max_workers: int = 16, events_dir: str | Path | None = None) -> None:
        self.store = store
        self.history = history
        self.tokens = tokens
        self.limits = limits or ServerLimits()
        self.usage = NamespaceUsage(store)
        self.streams = StreamGate(tenant_streams=self.limits.tenant_streams,
                                  slots=max_workers - reserved_workers(max_workers),
                                  idle_timeout_s=self.limits.idle_timeout_s, min_rate_bytes=self.limits.min_rate_bytes,
                                  strikes=TenantStrikes(self.limits.strike_burst, self.limits.strike_leak_per_s)
                                  if self.limits.strike_burst else None)
        self.inflight = InflightBudget(self.limits.inflight_bytes, self.limits.max_call_bytes)
        if store.max_decoded_bytes is None or store.max_decoded_bytes > self.limits.max_block_bytes:
            store.max_decoded_bytes = self.limits.max_block_bytes  # bounds promotion and write-down re-encodes
        # KV events (service/events.py): persistent under events_dir, else in memory
        self.events = EventHub(store, open_event_log(events_dir, self.limits.events_log_bytes),
                               queue_events=self.limits.subscriber_queue,
                               max_subscriptions=self.limits.max_subscriptions,
                               tenant_subscriptions=self.limits.tenant_subscriptions)
        #: called with the namespace after each Clear (the vLLM-format publisher's AllBlocksCleared)
        self.clear_listeners: list[Callable[[str], None]] = []
        #: the most reused prefixes (the deepest key of each reused run), per namespace (the admin dashboard)
        self.hot_prefixes = HotPrefixes()
        self.health = health.HealthServicer()
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self._down: list[str] = []
        self.damaged_tiers: list[str] = []
        #: the bulk data path (``service/bulk/``), set by ``start_server`` when on
        self.data_path: DataPathHandler | None = None

    # -- plumbing -------------------------------------------------------------------------------------

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

    def generic_handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[[Any, grpc.ServicerContext], Message], req: type[Message]) -> grpc.RpcMethodHandler:
            def handler(raw: bytes, context: grpc.ServicerContext) -> Message:
                try:
                    return fn(_parse(raw, req), context)
                except Exception as exc:  # every failure becomes a status; the server keeps serving
                    abort_call(context, exc)

            return grpc.unary_unary_rpc_method_handler(handler, response_serializer=_serialize)

        # streams take a slot of self.streams (service/fairness.py) and count against their tenant's cap as soon
        # as its namespace is known; the watchdog ends them when idle or too slow
        def get_stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            try:
                req = _parse(raw, pb.GetBlocksRequest)
                with self.streams.open(context, "GetBlocks") as ticket:
                    ticket.admit(self.namespace(context, req.namespace))
                    with self._strikes_client_faults(ticket):
                        yield from ticket.sent(self.GetBlocks(req, context))
            except Exception as exc:
                abort_call(context, exc)

        def put_stream(raws: Iterator[bytes], context: grpc.ServicerContext) -> Message:
            try:
                first: tuple[pb.PutBlocksRequest, memoryview, int] | None = None
                if self.tokens is None:  # dev mode: the first message names the tenant; read it like a unary request
                    raw = self.streams.read_request(context, "PutBlocks", raws, None)
                    first = None if raw is None else _parse_put(raw)
                    del raw  # the parsed message holds what it needs: the call counts what it keeps
                with self.streams.open(context, "PutBlocks", check_rate=True) as ticket:
                    ticket.admit(self.namespace(context, "" if first is None else first[0].namespace))

                    # the watchdog's min rate counts data bytes: padding (other fields) is no progress
                    def requests() -> Iterator[tuple[pb.PutBlocksRequest, memoryview, int]]:
                        nonlocal first
                        if first is not None:
                            ticket.progress(len(first[1]))
                            parsed, first = first, None
                            yield parsed
                        for raw in ticket.received(raws, count_bytes=False):
                            parsed = _parse_put(raw)
                            del raw
                            ticket.progress(len(parsed[1]))
                            yield parsed

                    with self._strikes_client_faults(ticket):
                        return self.PutBlocks(requests(), context)
            except Exception as exc:
                abort_call(context, exc)

        # the bulk data path (service/bulk/): a stream whose values move over a data connection, under the same gate
        def data_path_stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            try:
                req = _parse(raw, pb.DataPathRequest)
                self.check_model(req.fingerprint, "DataPathRequest.fingerprint")
                if self.data_path is None:
                    fail(grpc.StatusCode.FAILED_PRECONDITION,
                         "this server's data path is off (--no-data-path): use GetBlocks and PutBlocks")
                method = "OpenDataPath"
                with self.streams.open(context, method, check_rate=req.op == pb.DataPathRequest.PUT) as ticket:
                    ticket.admit(self.namespace(context, req.namespace))
                    with self._strikes_client_faults(ticket):
                        yield from self.data_path.serve(req, ticket.namespace or "", context, ticket)
            except Exception as exc:
                abort_call(context, exc)

        # long-lived: outside the stream gate (no idle timeout); capped by the event hub (service/events.py)
        def events_stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            try:
                req = _parse(raw, pb.SubscribeEventsRequest)
                yield from self.events.subscribe(self.namespace(context, req.namespace), req.from_seq, context)
            except Exception as exc:
                abort_call(context, exc)

        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "PutBlocks": grpc.stream_unary_rpc_method_handler(put_stream, response_serializer=_serialize),
            "GetBlocks": grpc.unary_stream_rpc_method_handler(get_stream, response_serializer=bytes),
            "Contains": unary(self.Contains, pb.KeysRequest),
            "LookupPrefix": unary(self.LookupPrefix, pb.LookupPrefixRequest),
            "Delete": unary(self.Delete, pb.KeysRequest),
            "Pin": unary(self.Pin, pb.KeysRequest),
            "Unpin": unary(self.Unpin, pb.KeysRequest),
            "Stats": unary(self.Stats, pb.StatsRequest),
            "Clear": unary(self.Clear, pb.ClearRequest),
            "SubscribeEvents": grpc.unary_stream_rpc_method_handler(events_stream, response_serializer=bytes),
            "OpenDataPath": grpc.unary_stream_rpc_method_handler(data_path_stream, response_serializer=bytes),
        })

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

    @staticmethod
    def check_model(model: str, field: str) -> None:
        """INVALID_ARGUMENT when a request's model fingerprint is longer than any block's can be."""
        if len(model) > MAX_FINGERPRINT_CHARS:
            fail(grpc.StatusCode.INVALID_ARGUMENT,
                 f"{field} of {len(model)} characters: a model fingerprint is at most {MAX_FINGERPRINT_CHARS}")

    @staticmethod
    def check_keys(keys: Sequence[bytes]) -> None:
        if len(keys) > MAX_KEYS_PER_CALL:
            fail(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys in one call; the limit is {MAX_KEYS_PER_CALL}")
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                fail(grpc.StatusCode.INVALID_ARGUMENT,
                      f"key {i} is {len(key)} bytes; block keys are {KEY_BYTES} bytes")

    def scoped(self, context: grpc.ServicerContext, requested: str,
               keys: Sequence[bytes]) -> tuple[str, list[ScopedKey]]:
        namespace = self.namespace(context, requested)
        self.check_keys(keys)
        tag = scope_tag(namespace)
        return namespace, [scope(tag, BlockKey(key)) for key in keys]

    # -- health ---------------------------------------------------------------------------------------

    def refresh_health(self) -> list[str]:
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

    def start_health_probe(self, interval_s: float = 5.0) -> None:
        """Probe the tiers now and every ``interval_s`` seconds in a daemon thread."""
        self.refresh_health()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.refresh_health()
                except Exception:
                    log.exception("health probe failed")

        self._prober = threading.Thread(target=loop, name="kvshelf-health", daemon=True)
        self._prober.start()

    def close(self) -> None:
        self._stop.set()
        self.health.enter_graceful_shutdown()
        self.usage.close()
        self.streams.close()
        self.events.end_subscriptions()  # events of calls still draining are logged until RunningServer.stop ends

    # -- RPCs -----------------------------------------------------------------------------------------

    def PutBlocks(self, requests: Iterable[tuple[pb.PutBlocksRequest, memoryview, int]],
                  context: grpc.ServicerContext) -> Message:
        """Buffer the call's values as they arrive (each into a buffer of its declared size), holding in-flight
        budget and quota for them from each value's first chunk, so an over-quota or over-budget put is refused
        before its data is buffered, and verifying each value as soon as it is whole; then bound the re-encodes,
        reserve the exact sizes, store."""
        call: _PutCall | None = None
        headers: list[BlockHeader] = []
        try:
            for req, data, message_bytes in requests:  # data: the chunk's bytes, a view of the message (wire.py)
                if call is None:
                    call = _PutCall(self, self.namespace(context, req.namespace))
                    pin = req.pin
                elif req.namespace and req.namespace != call.namespace:
                    fail(grpc.StatusCode.INVALID_ARGUMENT, "the namespace may only be set on the first message")
                if not req.HasField("chunk"):
                    fail(grpc.StatusCode.INVALID_ARGUMENT, "malformed PutBlocks message: no chunk")
                done = call.add(req.chunk, data, message_bytes)
                if done is not None:  # checked as soon as it is whole: a damaged value ends the call before the rest
                    headers.append(self.verify_value(call.namespace, *done))
            if call is None:  # an empty stream: still authenticate
                self.namespace(context, "")
                return pb.PutBlocksResponse(received=0, stored=0)
            received, stored = self.store_values(call, call.values(), headers, pin, context)
            return pb.PutBlocksResponse(received=received, stored=stored)
        finally:
            if call is not None:
                call.close()

    def put_call(self, namespace: str) -> _PutCall:
        """The budget and quota holder of one put of ``namespace`` (``close`` it when the call ends)."""
        return _PutCall(self, namespace)

    def store_values(self, call: _PutCall, values: Sequence[tuple[bytes, bytes | bytearray]],
                     headers: Sequence[BlockHeader], pin: bool, context: grpc.ServicerContext) -> tuple[int, int]:
        """Store a put's verified values (``headers``: their verified headers): bound the re-encodes, reserve the
        exact sizes, store; ``(received, stored)``. Nothing is stored when the call was cancelled."""
        targets = self.store.write_targets()
        items = [(scope(call.tag, BlockKey(key)), value) for key, value in values]
        sizes: list[tuple[bytes, int | TierBytes]] = []
        reencoded: TierBytes = {}  # per tier: the re-encoded copies it is handed at once
        for (key, value), header in zip(items, headers, strict=True):
            self._check_reencode(key, header, len(value), targets)
            sizes.append((key, {spec.tier.name: spec.stored_nbytes(header, len(value)) for spec in targets}))
            for spec in targets:
                if not spec.stores_as_is(header):
                    reencoded[spec.tier.name] = reencoded.get(spec.tier.name, 0) + sizes[-1][1][spec.tier.name]
        call.reserve_exact(sizes)
        call.hold_more(max(reencoded.values(), default=0))  # in-flight budget for the re-encoded copies
        if not context.is_active():
            fail(grpc.StatusCode.CANCELLED, "the call was cancelled; nothing stored")
        if call.lineage:  # the BlockStored events carry what the client sent, else what the headers say
            self.events.annotate(_annotations(items, values, call.lineage))
        # verified as they arrived (``headers``): not hashed again; re-encodes bounded by store.max_decoded_bytes
        stored = self.store.put_verified_many(items, headers, pin=pin)
        return len(items), stored

    def _check_reencode(self, tier_key: ScopedKey, header: BlockHeader, nbytes: int,
                        targets: Sequence[TierSpec]) -> None:
        """RESOURCE_EXHAUSTED when the block would decode to more than the max block size (a tier that re-encodes
        it decodes it; a tier that keeps it as sent hands it to clients that decode it), or a tier that re-encodes
        it would store more: from the declared shape and dtype, before anything is allocated."""
        reencoding = [spec for spec in targets if not spec.stores_as_is(header)]
        limit = self.limits.max_block_bytes
        decoded = decode_cost_bytes(header)
        stored = max((spec.stored_nbytes(header, nbytes) for spec in reencoding), default=0)
        if max(decoded, stored) <= limit:
            return
        why = (f"(up to {stored} stored) to be re-encoded from {header.codec} for tier(s) "
               f"{', '.join(s.tier.name for s in reencoding)}" if reencoding else f"from {header.codec} once fetched")
        fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
              f"block {unscope(tier_key).hex()} of declared shape {describe_shape(header.shape)} "
              f"{DTYPE_NAMES[header.dtype]} decodes to {decoded} bytes {why}: over the max block size of {limit} bytes")

    def verify_value(self, namespace: str, key: bytes, value: bytes | bytearray,
                     digest: bytes | None = None) -> BlockHeader:
        """The header of a received value once verified as a block of ``key`` in ``namespace`` with a known codec
        (DATA_LOSS, INVALID_ARGUMENT or PERMISSION_DENIED naming what is wrong); ``digest``: the xxh3-64 of its bytes
        before the checksum, when computed as they arrived (see ``verify_block``)."""
        try:
            header = verify_block(value, expected_key=key, digest=digest)
        except CorruptBlockError as exc:
            fail(grpc.StatusCode.DATA_LOSS, f"value of key {key.hex()} is damaged: {exc}")
        except ForeignBlockError as exc:
            fail(grpc.StatusCode.INVALID_ARGUMENT, f"value sent under key {key.hex()} is another key's: {exc}")
        if header.namespace != namespace:
            fail(grpc.StatusCode.PERMISSION_DENIED,
                  f"block {key.hex()} is encoded for namespace {header.namespace!r}, this call is in {namespace!r}")
        try:
            get_codec(header.codec, header.params)
        except ConfigError as exc:
            fail(grpc.StatusCode.INVALID_ARGUMENT, f"block {key.hex()}: {exc}")
        return header

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
        self.check_model(req.fingerprint, "GetBlocksRequest.fingerprint")
        namespace, keys = self.scoped(context, req.namespace, list(req.keys))
        fingerprint = req.fingerprint or None
        arena = self._arena(req, context)
        try:
            yield from self._get_blocks(keys, req, namespace, fingerprint, arena)
        finally:
            if arena is not None:
                arena.close()

    def _get_blocks(self, keys: list[bytes], req: pb.GetBlocksRequest, namespace: str, fingerprint: str | None,
                    arena: ArenaWriter | None) -> Iterator[bytes]:
        chunk_bytes = (min(max(req.max_chunk_bytes, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES) if req.max_chunk_bytes
                       else CHUNK_BYTES)
        for index, tier_key, value in self.served(keys, namespace, fingerprint, req.tokens):
            if value is None:
                yield encode_miss_response(index)
                continue
            offset = arena.write(value) if arena is not None else None
            if offset is not None:
                yield encode_arena_response(index, unscope(tier_key), offset, len(value))
                continue
            first = True
            for data, last in iter_chunks(value, chunk_bytes):
                if first:
                    yield encode_chunk_response(index, data, key=unscope(tier_key), last=last, total_size=len(value))
                    first = False
                else:
                    yield encode_chunk_response(index, data, last=last)

    def served(self, keys: list[bytes], namespace: str, fingerprint: str | None,
               tokens: Sequence[int]) -> Iterator[tuple[int, bytes, bytes | None]]:
        """``(index, tier key, value or None)`` of the scoped ``keys``, in order, checked by the store; the leading
        run of hits is counted as a reused prefix (``tokens``: tokens per key, when the client sent them).

        Memory is bounded whatever the request names: values are read a few at a time as they are sent (about
        ``READ_AHEAD_BYTES`` ahead), and a key named more than once is read once and its value kept for its later
        places (within ``REPEAT_KEEP_BYTES``), so naming one key many times costs neither reads nor copies."""
        last = {key: index for index, key in enumerate(keys)}  # the last place each key is named at
        per_key_tokens = len(tokens) == len(keys)
        kept: dict[bytes, bytes | None] = {}  # values named again later in this request
        kept_bytes = 0
        read_values, read_bytes = 0, 0  # hits read so far (what sizes the next read)
        run = 0  # the leading run of served keys: the reused prefix (counted in hot_prefixes when it ends)
        index, want = 0, 1
        while index < len(keys):
            batch: dict[bytes, int] = {}  # the keys read now (each once) -> its first place in this round
            end = index
            while end < len(keys) and (keys[end] in kept or keys[end] in batch or len(batch) < want):
                if keys[end] not in kept and keys[end] not in batch:
                    batch[keys[end]] = end
                end += 1
            values = self.store.get_encoded_many(
                list(batch), namespace=namespace, fingerprint=fingerprint,
                tokens=[tokens[i] for i in batch.values()] if per_key_tokens else None) if batch else []
            got = dict(zip(batch, values, strict=True))
            del values
            for value in got.values():
                if value is not None:
                    read_values, read_bytes = read_values + 1, read_bytes + len(value)
            for position in range(index, end):
                tier_key = keys[position]
                value = got[tier_key] if tier_key in got else kept[tier_key]
                if last[tier_key] == position:
                    if tier_key in kept:
                        kept_bytes -= len(kept.pop(tier_key) or b"")
                elif tier_key not in kept and (not kept_bytes or kept_bytes + len(value or b"") <= REPEAT_KEEP_BYTES):
                    kept[tier_key] = value
                    kept_bytes += len(value or b"")
                if run == position and value is not None:
                    run += 1
                elif run == position and run:  # the first miss ends the reused prefix
                    self._count_prefix(namespace, keys, run, tokens)
                yield position, tier_key, value
            del got, value
            index = end
            want = (READ_BATCH_KEYS if not read_values else
                    max(1, min(READ_BATCH_KEYS, READ_AHEAD_BYTES * read_values // max(read_bytes, 1))))
        if run == len(keys) and run:  # every key served: the whole request was a reused prefix
            self._count_prefix(namespace, keys, run, tokens)

    def Contains(self, req: pb.KeysRequest, context: grpc.ServicerContext) -> Message:
        _, keys = self.scoped(context, req.namespace, list(req.keys))
        present = self.store.held(keys)
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        return pb.ContainsResponse(present=present, prefix=prefix)

    def LookupPrefix(self, req: pb.LookupPrefixRequest, context: grpc.ServicerContext) -> Message:
        self.check_model(req.model, "LookupPrefixRequest.model")
        namespace, keys = self.scoped(context, req.namespace, list(req.keys))
        tokens = list(req.tokens) if len(req.tokens) == len(keys) else None
        found = self.store.lookup_prefix(keys, namespace=namespace, model=req.model or "?", tokens=tokens)
        if found:
            self._count_prefix(namespace, keys, found, tokens)
        return pb.LookupPrefixResponse(found=found)

    def _count_prefix(self, namespace: str, keys: Sequence[bytes], depth: int, tokens: Sequence[int] | None) -> None:
        """One reuse of the prefix of ``keys[:depth]`` (``tokens``: the request's tokens per key, if it sent them)."""
        length = sum(tokens[:depth]) if tokens is not None and len(tokens) == len(keys) else None
        self.hot_prefixes.hit(namespace, unscope(keys[depth - 1]), depth, length)

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
        full = self.store.typed_stats()
        rows = [r for r in full.rows if r.namespace == namespace]
        tag = scope_tag(namespace)
        held = self.usage.usage(tag)
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
            "pinned": sum(1 for key in self.store.pinned_keys() if key.startswith(tag)),
            "usage": {"bytes": max((b for _, b in held.values()), default=0), "quota_bytes": self.limits.quota_bytes},
            "health": {"status": "degraded" if down else "serving", "unavailable_tiers": down,
                       "damaged_tiers": self.damaged_tiers},
            "streams": {"open": self.streams.open_streams(namespace), "cap": self.streams.cap(namespace),
                        "server_refused": self.streams.refused, "server_refused_strikes": self.streams.refused_strikes,
                        "server_ended_idle": self.streams.ended_idle,
                        "server_ended_slow": self.streams.ended_slow},
            "events": self.events.stats(namespace),
            "top_prefixes": self.hot_prefixes.top(10, None if self.tokens is None else frozenset((namespace,))),
        }
        if self.tokens is None:  # dev mode: the whole store (every namespace) and its history for the admin tool
            out["store"] = full.as_dict()
            if self.history is not None:
                out["history"] = self.history.points()
        return pb.StatsResponse(json=json.dumps(out), degraded=bool(down))


def _annotations(items: Sequence[tuple[bytes, bytes]], values: Sequence[tuple[bytes, bytes]],
                 lineage: dict[bytes, tuple[bytes, array]]) -> Iterator[tuple[bytes, bytes, Sequence[int]]]:
    """``(tier key, parent key, token ids)`` of the stored values whose first chunk named them."""
    for (tier_key, _), (key, _) in zip(items, values, strict=True):
        if key in lineage:
            yield tier_key, *lineage[key]


LINEAGE_ENTRY_BYTES = 256  # a lineage entry's own objects (dict slot, tuple, key, array header), rounded up


def _lineage(chunk: pb.Chunk) -> tuple[bytes, array]:
    """The ``(parent key, token ids)`` a put's first chunk names for its block's events (token ids packed 4 bytes
    each)."""
    if chunk.parent_key and len(chunk.parent_key) != KEY_BYTES:
        fail(grpc.StatusCode.INVALID_ARGUMENT,
             f"parent_key of block {chunk.key.hex()} is {len(chunk.parent_key)} bytes; block keys are {KEY_BYTES}")
    return bytes(chunk.parent_key), array("I", chunk.token_ids)


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
    servicer.data_path = DataPathHandler(servicer, listener)
    return listener.port
