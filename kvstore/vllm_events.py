"""KV events in vLLM's format over ZeroMQ: the stream that KV-aware routers read (llm-d's KV-cache indexer, NVIDIA
Dynamo's KV router), published by a ``TieredStore`` (embedded) or ``kvshelf serve``.

The wire follows ``vllm/distributed/kv_events.py`` at ``VLLM_VERSION`` (``ZmqEventPublisher``):

* a PUB socket sends three frames per batch: ``(topic, sequence number as 8 bytes big-endian, payload)``, the
  payload a msgspec-msgpack ``KVEventBatch(ts, events, data_parallel_rank)`` (an array) whose events are
  ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (maps tagged ``"type"``, default fields omitted);
* an optional ROUTER socket (the replay endpoint, always bound) answers a request ``(8-byte start sequence)`` from a
  DEALER client with every buffered batch from that sequence on, one ``(seq, payload)`` message each, then
  ``(-1 as 8 signed bytes, b"")``. A start older than the buffer gets what is left, then the end marker. (A REQ
  socket takes one reply per request: it reads the first message only.)
* endpoints: ``tcp://*:PORT`` (or any with ``::``, ``ipc://``, ``inproc://``) binds, ``tcp://HOST:PORT`` connects;
  a bracketed IPv6 host (``tcp://[::1]:PORT``) turns on ``ZMQ_IPV6``.

What kvshelf maps onto it: a batch holds the events of one namespace, its topic is ``topic + namespace``, and each
topic has its own sequence (from 0), so that a subscriber of one namespace sees no gaps. A replay request names its
topic in a second frame (kvshelf's extension; only that topic's batches are sent); without it, the topic is the
only namespace of ``namespaces``, else the only topic published so far; with several, the request is ambiguous and
gets the end marker alone (counted as malformed). Block hashes are kvshelf's block keys, as the low 64 bits of the
16-byte key read big-endian (vLLM's default int form) or, with ``block_hashes="bytes"``, the 16 bytes;
``parent_block_hash`` is the chain's previous key (None for the first block); ``token_ids`` are the block's tokens
and ``block_size`` their count; ``medium`` names the tier (``MEDIA``). ``group_idx`` is 0: a kvshelf block holds
every layer.

Puts are never slowed: the sockets live in a process of their own (``kvstore.vllm_events_worker``); the store's
listener only sends it one small record per event, without blocking (``max_queue_size`` records may wait: past
it the event is dropped and counted). Records go in messages of up to ``FEED_BATCH``, a partial one after
``FEED_WINDOW_S``: a Python thread that wakes often costs the puts' thread far more than its own work (measured:
waking every 2 ms added ~40 µs per put on this project's 2-core test machine). That process reads, filters, encodes
and sends them, on its own interpreter lock. The PUB socket is an XPUB with ``XPUB_NODROP``: a batch that a
subscriber's high-water mark refuses is counted (``hwm_drops``) and sent to the others as PUB would. A subscriber
sees a gap in the sequence numbers and asks the replay endpoint. What peers can make that process hold is bounded
(frames, subscriptions, the buffer in batches and bytes, replays per peer and at once): ``vllm_events_worker``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import zmq

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import key_low64
from kvshelf.kvstore.stats import StoreEvent

log = logging.getLogger(__name__)

#: the vLLM release whose ``kv_events.py`` this wire follows
VLLM_VERSION = "0.28.0"
#: the replay stream's end marker (vLLM's ``END_SEQ``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: tier type name -> ``medium`` (the names vLLM's GPU cache and offloading connectors use, DISK and REMOTE beside)
MEDIA = {"MemoryTier": "CPU", "GPUTier": "GPU", "LMDBTier": "DISK", "RedisTier": "REMOTE"}
#: events encoded into one batch at most
MAX_BATCH_EVENTS = 1024
#: records sent to the publisher process in one message at most (a partial batch waits ``FEED_WINDOW_S``)
FEED_BATCH = 256
#: how long a partial batch of records waits before the feed thread sends it
FEED_WINDOW_S = 0.05
#: default byte bound of the replay buffer (``buffer_bytes``)
BUFFER_BYTES = 64 << 20
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


def is_ipv6(endpoint: str) -> bool:
    """Whether ``endpoint`` names a bracketed IPv6 host (``tcp://[::1]:PORT``): its socket needs ``ZMQ_IPV6``."""
    return endpoint.startswith("tcp://[")


@dataclass(frozen=True)
class KVEventsSettings:
    """Where and how vLLM-format KV events are published (vLLM's ``KVEventsConfig`` fields, kvshelf's beside).

    ``namespaces``: only these namespaces' events are published (None: every namespace): with one namespace per
    endpoint, another tenant's events never reach its subscribers. ``buffer_bytes``: payload bytes kept for replay
    (beside ``buffer_steps`` batches; also the bound of payloads out of the buffer still queued for a peer).
    ``handshake_s``: a peer that has not finished the ZeroMQ handshake by then is dropped."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    block_hashes: Literal["int", "bytes"] = "int"
    namespaces: frozenset[str] | None = None
    data_parallel_rank: int = 0
    buffer_bytes: int = BUFFER_BYTES
    handshake_s: float = 3.0

    def check(self) -> None:
        parse_endpoint(self.endpoint, "kv_events_endpoint")
        if self.replay_endpoint:
            _, binds = parse_endpoint(self.replay_endpoint, "kv_events_replay_endpoint")
            if not binds and not self.replay_endpoint.startswith("tcp://"):
                raise ConfigError(f"kv_events_replay_endpoint: {self.replay_endpoint!r} must be one to bind")
        for name in ("buffer_steps", "buffer_bytes", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv_events_{name}: must be >= 1, got {getattr(self, name)}")
        if not self.handshake_s > 0:
            raise ConfigError(f"kv_events_handshake_s: must be > 0, got {self.handshake_s}")
        if self.block_hashes not in ("int", "bytes"):
            raise ConfigError(f"kv_events_block_hashes: {self.block_hashes!r} is not 'int' or 'bytes'")


# -- the publisher -------------------------------------------------------------------------------------------------


def block_hasher(form: Literal["int", "bytes"]) -> Callable[[bytes], int | bytes]:
    """How a block key becomes vLLM's ``ExternalBlockHash``: its low 64 bits big-endian (``int``) or its bytes."""
    return key_low64 if form == "int" else bytes


def medium_of(tier: Any) -> str:
    """The ``medium`` of a tier (``MEDIA`` by its type; else its name upper-cased)."""
    for cls in type(tier).__mro__:
        if cls.__name__ in MEDIA:
            return MEDIA[cls.__name__]
    return str(getattr(tier, "name", "?")).upper()


class VLLMEventPublisher:
    """Publishes a store's block events in vLLM's ZeroMQ format (module doc); ``close`` stops it.

    The sockets live in a process of their own (``kvstore.vllm_events_worker``), started here: this process only
    sends it one small record per event (``_feed``), so encoding and sending never compete with the puts for
    this interpreter's lock. An endpoint that cannot be opened is a ``ConfigError`` before this returns.

    Feed it with ``attach(store)`` (every tier's stored/removed/evicted events) or by hand: ``stored``,
    ``removed``, ``cleared``. Counters: ``published_events``, ``published_batches``, ``queue_drops``,
    ``hwm_drops``, ``replays``, ``bad_replay_requests``, ``replays_refused``, ``socket_resets``, ``guard_drops``; gauges
    ``buffer_bytes``, ``pinned_bytes``."""

    def __init__(self, settings: KVEventsSettings, *, context: zmq.Context | None = None) -> None:
        from kvshelf.kvstore import vllm_events_worker as worker

        settings.check()
        self.settings = settings
        self._worker = worker
        self._folder = Path(tempfile.mkdtemp(prefix="kvshelf-events-"))
        (self._folder / "counters").write_bytes(bytes(8 * worker.COUNTERS))
        self._counters = worker.counters_at(self._folder)
        self._lock = threading.Lock()
        self._sent = 0  # records handed to the feed
        self._batch: list[tuple[Any, ...]] = []  # records not yet sent (one message per FEED_BATCH, or window)
        self._due = threading.Event()
        self.queue_drops = 0
        self._unsubscribe: list[Any] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvshelf.kvstore.vllm_events_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        try:
            self._start(worker)
            self._push = (context or zmq.Context.instance()).socket(zmq.PUSH)
            self._push.setsockopt(zmq.SNDHWM, max(1, settings.max_queue_size // FEED_BATCH))  # messages of records
            self._push.setsockopt(zmq.LINGER, 2000)
            self._push.connect(worker.feed_endpoint(self._folder))
        except BaseException:
            self._stop_process()
            raise
        self._running = True
        self._flusher = threading.Thread(target=self._flush_loop, name="kvshelf-vllm-events-feed", daemon=True)
        self._flusher.start()

    def _start(self, worker: Any) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        settings = dataclasses.asdict(self.settings)
        settings["namespaces"] = sorted(settings["namespaces"]) if settings["namespaces"] is not None else None
        self._proc.stdin.write(json.dumps({"settings": settings, "folder": str(self._folder)}) + "\n")
        self._proc.stdin.close()
        answer = self._proc.stdout.readline().strip()
        if answer == "ready":
            return
        if answer.startswith("error "):
            raise ConfigError(answer.removeprefix("error "))
        raise ConfigError(f"the KV events publisher process did not start (exit code {self._proc.wait(10)}): "
                          f"{answer or 'no answer'}")

    # -- feeding ----------------------------------------------------------------------------------------------

    def attach(self, store: Any) -> VLLMEventPublisher:
        """Publish ``store``'s events (a ``TieredStore``): its tiers' media are read now."""
        media = {spec.tier.name: medium_of(spec.tier) for spec in store.specs}
        self._feed((self._worker.RECORD_MEDIA, time.time(), media))
        default = getattr(store, "namespace", "default")
        self._unsubscribe.append(store.subscribe(lambda event: self._store_event(event, default)))
        return self

    def _store_event(self, event: StoreEvent, default: str) -> None:
        """The put path's whole share: one record into the feed (the other process reads and encodes it)."""
        header = event.header
        self._feed((self._worker.RECORD_STORE, time.time(), event.kind, event.tier, event.key, event.namespace,
                    default, header.token_ids if header is not None else None,
                    header.extra if header is not None and header.extra else None))

    def stored(self, namespace: str, key: bytes, parent: bytes, tokens: tuple[int, ...], medium: str) -> None:
        """A block of ``namespace`` was stored in ``medium`` (``parent``: b"" for a chain's first block)."""
        self._feed((self._worker.RECORD_STORED, time.time(), namespace, bytes(key), bytes(parent), tokens, medium))

    def removed(self, namespace: str, key: bytes, medium: str) -> None:
        self._feed((self._worker.RECORD_REMOVED, time.time(), namespace, bytes(key), medium))

    def cleared(self, namespace: str) -> None:
        """Every block of ``namespace`` is gone (``AllBlocksCleared``)."""
        self._feed((self._worker.RECORD_CLEARED, time.time(), namespace))

    def _feed(self, record: tuple[Any, ...]) -> None:
        """Add one record to the batch; a full batch is sent at once, a partial one by the feed thread within
        ``FEED_WINDOW_S``."""
        with self._lock:
            if not self._running:
                return
            self._batch.append(record)
            if len(self._batch) >= FEED_BATCH:
                self._send_batch()
            elif len(self._batch) == 1:
                self._due.set()

    def _send_batch(self) -> None:
        """Send the batch as one message, one msgpack array of records, without blocking (the lock held: ZeroMQ
        sockets are not thread-safe); a full feed (``max_queue_size`` records waiting) drops them and counts them.
        (Copied, not zero-copy: pyzmq's zero-copy sends cost more than copying messages this small.)"""
        batch, self._batch = self._batch, []
        if not batch:
            return
        try:
            self._push.send(self._encoder.encode(batch), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.queue_drops += len(batch)
            return
        self._sent += len(batch)

    def _flush_loop(self) -> None:
        """Send a partial batch ``FEED_WINDOW_S`` after its first record (the feed's only other work)."""
        while True:
            self._due.wait()
            self._due.clear()
            time.sleep(FEED_WINDOW_S)
            with self._lock:
                self._send_batch()
                if not self._running:
                    return

    # -- state ----------------------------------------------------------------------------------------------------

    def _counter(self, index: int) -> int:
        return int(self._counters[index])

    @property
    def next_seq(self) -> int:
        """Batches published so far, every topic (with one topic: its next sequence number)."""
        return self._counter(self._worker.COUNTER_NEXT_SEQ)

    @property
    def pid(self) -> int:
        """The publisher process's id (its memory is the sockets' and the replay buffer's)."""
        return self._proc.pid

    @property
    def published_events(self) -> int:
        return self._counter(self._worker.COUNTER_EVENTS)

    @property
    def thread_cpu_s(self) -> float:
        """CPU time of the publisher process (reading, encoding, sending), in seconds."""
        return self._counter(self._worker.COUNTER_CPU_NS) / 1e9

    def stats(self) -> dict[str, int]:
        w = self._worker
        return {"published_events": self._counter(w.COUNTER_EVENTS),
                "published_batches": self._counter(w.COUNTER_BATCHES), "queue_drops": self.queue_drops,
                "hwm_drops": self._counter(w.COUNTER_HWM_DROPS), "replays": self._counter(w.COUNTER_REPLAYS),
                "bad_replay_requests": self._counter(w.COUNTER_BAD_REPLAYS),
                "replays_refused": self._counter(w.COUNTER_REPLAYS_REFUSED),
                "socket_resets": self._counter(w.COUNTER_RESETS),
                "buffer_bytes": self._counter(w.COUNTER_BUFFER_BYTES),
                "pinned_bytes": self._counter(w.COUNTER_PINNED_BYTES),
                "guard_drops": self._counter(w.COUNTER_GUARD_DROPS),
                "queued": max(0, self._sent - self._counter(w.COUNTER_RECORDS))}

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record fed so far is published (True) or ``timeout_s`` passes (False)."""
        with self._lock:
            self._send_batch()
        deadline = time.monotonic() + timeout_s
        while self._counter(self._worker.COUNTER_RECORDS) < self._sent:
            if time.monotonic() >= deadline or self._proc.poll() is not None:
                return False
            time.sleep(0.002)
        return True

    def close(self) -> None:
        """Stop listening, let the publisher process send what is queued (up to 2 s), stop it."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        with self._lock:
            if not self._running:
                return
            self._send_batch()
            with contextlib.suppress(zmq.Again):
                self._push.send(self._encoder.encode([(self._worker.RECORD_STOP,)]), flags=zmq.NOBLOCK)
            self._running = False
        self._due.set()
        self._flusher.join(timeout=2.0)
        self._stop_process()

    def _stop_process(self) -> None:
        try:
            self._proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        push = getattr(self, "_push", None)
        if push is not None:
            push.close(linger=0)
        del self._counters
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> VLLMEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_socket(socket: zmq.Socket, endpoint: str, setting: str, *, bind: bool | None = None) -> None:
    """Bind or connect ``socket`` to ``endpoint`` by vLLM's convention (``bind``: always bind); ``ConfigError``
    naming ``setting`` when it cannot."""
    _, binds = parse_endpoint(endpoint, setting)
    if is_ipv6(endpoint):
        socket.setsockopt(zmq.IPV6, 1)
    try:
        if binds or bind:
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        reason = "address already in use" if exc.errno == zmq.EADDRINUSE else str(exc)
        raise ConfigError(f"{setting}: cannot {'bind' if binds or bind else 'connect'} {endpoint!r}: "
                          f"{reason}") from None
