"""KV events in vLLM's format over ZeroMQ: the stream that KV-aware routers read (llm-d's KV-cache indexer, NVIDIA
Dynamo's KV router), published by a ``TieredStore`` (embedded) or ``kvshelf serve``.

The wire follows ``vllm/distributed/kv_events.py`` at ``VLLM_VERSION`` (``ZmqEventPublisher``):

* a PUB socket sends three frames per batch: ``(topic, sequence number as 8 bytes big-endian, payload)``, the
  payload a msgspec-msgpack ``KVEventBatch(ts, events, data_parallel_rank)`` (an array) whose events are
  ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (maps tagged ``"type"``, default fields omitted);
* an optional ROUTER socket (the replay endpoint, always bound) answers a request ``(8-byte start sequence)`` from a
  REQ or DEALER client with every buffered batch from that sequence on, one ``(seq, payload)`` message each, then
  ``(-1 as 8 signed bytes, b"")``. A start older than the buffer gets what is left, then the end marker.
  kvshelf extension: a second request frame is a topic prefix; only batches whose topic starts with it are sent.
* endpoints: ``tcp://*:PORT`` (or ``::``, ``ipc://``, ``inproc://``) binds, ``tcp://HOST:PORT`` connects.

What kvshelf maps onto it: a batch holds the events of one namespace, its topic is ``topic + namespace``; block
hashes are kvshelf's block keys, as the low 64 bits of the 16-byte key read big-endian (vLLM's default int form)
or, with ``block_hashes="bytes"``, the 16 bytes; ``parent_block_hash`` is the chain's previous key (None for the
first block); ``token_ids`` are the block's tokens and ``block_size`` their count; ``medium`` names the tier
(``MEDIA``). ``group_idx`` is 0: a kvshelf block holds every layer.

Puts are never slowed: the store's listener only appends the event to a bounded queue (``max_queue_size``: past it
the event is dropped and counted); a thread lets a burst gather (``BATCH_WINDOW_S``), then reads, filters, encodes
and sends it. The PUB socket is an XPUB with ``XPUB_NODROP``: a batch that a subscriber's high-water mark refuses is
counted (``hwm_drops``) and sent to the others as PUB would. A subscriber sees a gap in the sequence numbers and
asks the replay endpoint.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import block_key_of, is_scoped, key_low64, parent_of, scope_of
from kvshelf.kvstore.stats import UNKNOWN, StoreEvent

log = logging.getLogger(__name__)

#: the vLLM release whose ``kv_events.py`` this wire follows
VLLM_VERSION = "0.28.0"
#: the replay stream's end marker (vLLM's ``END_SEQ``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: tier type name -> ``medium`` (the names vLLM's GPU cache and offloading connectors use, DISK and REMOTE beside)
MEDIA = {"MemoryTier": "CPU", "GPUTier": "GPU", "LMDBTier": "DISK", "RedisTier": "REMOTE"}
#: events encoded into one batch at most
MAX_BATCH_EVENTS = 1024
#: how long the thread lets events gather after the first one before it encodes them (one batch per burst: fewer
#: wake-ups of the thread, so less time taken from the puts' threads)
BATCH_WINDOW_S = 0.002
_ENDPOINT = re.compile(r"(tcp)://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})|(ipc|inproc)://.+")


# -- the wire: vLLM's structs, declared from its field list ---------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One KV cache event (a map tagged ``"type"``: the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- settings ------------------------------------------------------------------------------------------------------


def parse_endpoint(endpoint: str, setting: str) -> tuple[str, bool]:
    """``(endpoint, binds)`` for a ZeroMQ endpoint, by vLLM's convention; ``ConfigError`` naming ``setting``."""
    match = _ENDPOINT.fullmatch(endpoint)
    if not match or (match.group(3) is not None and not 0 < int(match.group(3)) < 65536):
        raise ConfigError(f"{setting}: cannot read endpoint {endpoint!r}; use tcp://*:PORT (bind), "
                          "tcp://HOST:PORT (connect), ipc://PATH or inproc://NAME")
    binds = match.group(4) is not None or match.group(2) == "*" or "::" in (match.group(2) or "")
    return endpoint, binds


@dataclass(frozen=True)
class KVEventsSettings:
    """Where and how vLLM-format KV events are published (vLLM's ``KVEventsConfig`` fields, kvshelf's beside).

    ``namespaces``: only these namespaces' events are published (None: every namespace): with one namespace per
    endpoint, another tenant's events never reach its subscribers."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    block_hashes: Literal["int", "bytes"] = "int"
    namespaces: frozenset[str] | None = None
    data_parallel_rank: int = 0

    def check(self) -> None:
        parse_endpoint(self.endpoint, "kv_events_endpoint")
        if self.replay_endpoint:
            _, binds = parse_endpoint(self.replay_endpoint, "kv_events_replay_endpoint")
            if not binds and not self.replay_endpoint.startswith("tcp://"):
                raise ConfigError(f"kv_events_replay_endpoint: {self.replay_endpoint!r} must be one to bind")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv_events_{name}: must be >= 1, got {getattr(self, name)}")
        if self.block_hashes not in ("int", "bytes"):
            raise ConfigError(f"kv_events_block_hashes: {self.block_hashes!r} is not 'int' or 'bytes'")


# -- the publisher -------------------------------------------------------------------------------------------------


def block_hash(key: bytes, form: Literal["int", "bytes"]) -> int | bytes:
    """A block key as vLLM's ``ExternalBlockHash``: the low 64 bits big-endian (``int``) or its bytes."""
    return key_low64(key) if form == "int" else bytes(key)


def medium_of(tier: Any) -> str:
    """The ``medium`` of a tier (``MEDIA`` by its type; else its name upper-cased)."""
    for cls in type(tier).__mro__:
        if cls.__name__ in MEDIA:
            return MEDIA[cls.__name__]
    return str(getattr(tier, "name", "?")).upper()


@dataclass(frozen=True)
class _Stored:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    medium: str


@dataclass(frozen=True)
class _Removed:
    key: bytes
    medium: str


class _Cleared:
    pass


_CLEARED = _Cleared()


class VLLMEventPublisher:
    """Publishes a store's block events in vLLM's ZeroMQ format (module doc); ``close`` stops it.

    Feed it with ``attach(store)`` (every tier's stored/removed/evicted events) or by hand: ``stored``,
    ``removed``, ``cleared``. Counters: ``published_events``, ``published_batches``, ``queue_drops``,
    ``hwm_drops``, ``replays``, ``bad_replay_requests``."""

    def __init__(self, settings: KVEventsSettings, *, context: zmq.Context | None = None) -> None:
        settings.check()
        self.settings = settings
        self._ctx = context or zmq.Context.instance()
        self._pending: deque[tuple[Any, Any]] = deque()
        self._wake = threading.Event()
        self._busy = False
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=settings.buffer_steps)
        self._media: dict[str, str] = {}
        self._names: dict[bytes, str] = {}
        self.published_events = self.published_batches = self.queue_drops = self.hwm_drops = 0
        self.replays = self.bad_replay_requests = 0
        self._seq = 0
        self.thread_cpu_s = 0.0  # CPU time of the publisher thread encoding and sending
        self._lock = threading.Lock()
        self._unsubscribe: list[Any] = []
        self._pub = self._ctx.socket(zmq.XPUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, settings.hwm)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            self._pub.setsockopt(zmq.LINGER, 0)
            _open(self._pub, settings.endpoint, "kv_events_endpoint")
            if settings.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 0)
                _open(self._replay, settings.replay_endpoint, "kv_events_replay_endpoint", bind=True)
        except BaseException:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvshelf-vllm-events", daemon=True)
        self._thread.start()

    # -- feeding ----------------------------------------------------------------------------------------------

    def attach(self, store: Any) -> VLLMEventPublisher:
        """Publish ``store``'s events (a ``TieredStore``): its tiers' media are read now."""
        self._media.update({spec.tier.name: medium_of(spec.tier) for spec in store.specs})
        default = getattr(store, "namespace", "default")
        self._unsubscribe.append(store.subscribe(lambda event: self._enqueue((event, default))))
        return self

    def stored(self, namespace: str, key: bytes, parent: bytes, tokens: tuple[int, ...], medium: str) -> None:
        """A block of ``namespace`` was stored in ``medium`` (``parent``: b"" for a chain's first block)."""
        self._enqueue((namespace, _Stored(key, parent, tokens, medium)))

    def removed(self, namespace: str, key: bytes, medium: str) -> None:
        self._enqueue((namespace, _Removed(key, medium)))

    def cleared(self, namespace: str) -> None:
        """Every block of ``namespace`` is gone (``AllBlocksCleared``)."""
        self._enqueue((namespace, _CLEARED))

    def _enqueue(self, item: tuple[Any, Any]) -> None:
        """The put path's whole share: a bounded append (the thread reads, filters and encodes it)."""
        pending = self._pending
        if len(pending) >= self.settings.max_queue_size:
            with self._lock:
                self.queue_drops += 1
            return
        was_empty = not pending
        pending.append(item)
        if was_empty:
            self._wake.set()

    def _resolve(self, item: tuple[Any, Any]) -> tuple[str, object] | None:
        """``(namespace, event)`` of a queued item (a store's event is read here), None when filtered out."""
        first, second = item
        if isinstance(first, StoreEvent):
            namespace, event = self._from_store(first, second)
        else:
            namespace, event = first, second
        allowed = self.settings.namespaces
        return None if allowed is not None and namespace not in allowed else (namespace, event)

    def _from_store(self, event: StoreEvent, default_namespace: str) -> tuple[str, object]:
        namespace = event.namespace
        if is_scoped(event.key):
            tag = scope_of(event.key)
            if namespace != UNKNOWN:
                self._names[tag] = namespace
            else:
                namespace = self._names.get(tag, tag.hex())
        elif namespace == UNKNOWN:
            namespace = default_namespace
        medium = self._media.get(event.tier, event.tier.upper())
        key = block_key_of(event.key)
        if event.kind != "stored":
            return namespace, _Removed(key, medium)
        header = event.header
        tokens = tuple(header.token_ids) if header is not None else ()
        parent = parent_of(header.extra) if header is not None else b""
        return namespace, _Stored(key, parent, tokens, medium)

    # -- the thread ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        pending = self._pending
        while True:
            self._serve_replays()
            self._drain_subscriptions()
            if not pending:
                if not self._running:
                    break
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self._busy = True
            time.sleep(BATCH_WINDOW_S)  # let a burst gather: one batch, one wake-up of this thread
            started = time.thread_time()
            items = []
            while pending and len(items) < MAX_BATCH_EVENTS:
                resolved = self._resolve(pending.popleft())
                if resolved is not None:
                    items.append(resolved)
            try:
                if items:
                    self._send(encoder, items)
            except Exception:  # never let one bad batch stop the stream
                log.exception("publishing vLLM KV events failed")
            self.thread_cpu_s += time.thread_time() - started
            self._busy = False
        self._serve_replays()

    def _send(self, encoder: msgspec.msgpack.Encoder, items: list[tuple[str, object]]) -> None:
        groups: dict[str, list[Any]] = {}
        for namespace, event in items:
            groups.setdefault(namespace, []).append(self._wire(event))
        for namespace, events in groups.items():
            batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.settings.data_parallel_rank)
            payload = encoder.encode(batch)
            topic = (self.settings.topic + namespace).encode()
            seq = self._seq
            self._seq += 1
            frames = (topic, seq.to_bytes(8, "big"), payload)
            try:
                self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # a subscriber is at its high-water mark: it loses this batch, the others get it
                self.hwm_drops += 1
                self._pub.setsockopt(zmq.XPUB_NODROP, 0)
                try:
                    self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
                finally:
                    self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            self._buffer.append((seq, topic, payload))
            self.published_batches += 1
            self.published_events += len(events)

    def _wire(self, event: object) -> KVCacheEvent:
        form = self.settings.block_hashes
        if isinstance(event, _Stored):
            parent = block_hash(event.parent, form) if event.parent else None
            return BlockStored(block_hashes=[block_hash(event.key, form)], parent_block_hash=parent,
                               token_ids=list(event.tokens), block_size=len(event.tokens), lora_id=None,
                               medium=event.medium, lora_name=None, group_idx=0)
        if isinstance(event, _Removed):
            return BlockRemoved(block_hashes=[block_hash(event.key, form)], medium=event.medium, group_idx=0)
        return AllBlocksCleared()

    def _drain_subscriptions(self) -> None:
        """Read the XPUB's subscription messages (they would queue up otherwise)."""
        while True:
            try:
                self._pub.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return

    def _serve_replays(self) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            identity, rest = frames[0], frames[1:]
            if rest and rest[0] == b"":
                rest = rest[1:]  # a REQ client's delimiter
            if not 1 <= len(rest) <= 2 or len(rest[0]) != 8:  # malformed: the end marker alone, so no client hangs
                self.bad_replay_requests += 1
                self._replay.send_multipart((identity, b"", END_SEQ, b""))
                continue
            start = int.from_bytes(rest[0], "big")
            prefix = rest[1] if len(rest) == 2 else b""
            self.replays += 1
            for seq, topic, payload in list(self._buffer):
                if seq >= start and topic.startswith(prefix):
                    self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", END_SEQ, b""))

    # -- state ----------------------------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self._seq

    def stats(self) -> dict[str, int]:
        return {"published_events": self.published_events, "published_batches": self.published_batches,
                "queue_drops": self.queue_drops, "hwm_drops": self.hwm_drops, "replays": self.replays,
                "bad_replay_requests": self.bad_replay_requests, "queued": len(self._pending)}

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued event is sent (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self._pending or self._busy:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.002)
        return True

    def close(self) -> None:
        """Stop listening, send what is queued (up to 1 s), close the sockets."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        if not self._running and not self._thread.is_alive():
            return
        self._running = False
        self._wake.set()
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> VLLMEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open(socket: zmq.Socket, endpoint: str, setting: str, *, bind: bool | None = None) -> None:
    _, binds = parse_endpoint(endpoint, setting)
    try:
        if binds or bind:
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        reason = "address already in use" if exc.errno == zmq.EADDRINUSE else str(exc)
        raise ConfigError(f"{setting}: cannot {'bind' if binds or bind else 'connect'} {endpoint!r}: "
                          f"{reason}") from None
