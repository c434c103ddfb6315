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
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.stats import StoreEvent
from kvshelf.kvstore.vllm_event_wire import (  # noqa: F401  (the wire's names, importable from here as before)
    BUFFER_BYTES,
    END_SEQ,
    FEED_BATCH,
    FEED_WINDOW_S,
    MAX_BATCH_EVENTS,
    MEDIA,
    VLLM_VERSION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEventBatch,
    KVEventsSettings,
    block_hasher,
    is_ipv6,
    medium_of,
    open_socket,
    parse_endpoint,
)

log = logging.getLogger(__name__)

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
