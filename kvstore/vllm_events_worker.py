"""The process that publishes vLLM-format KV events (``kvstore.vllm_events``): it owns the XPUB and replay sockets.

``VLLMEventPublisher`` starts it (``python -m kvshelf.kvstore.vllm_events_worker``) and hands it, on stdin, one
JSON line: the settings and a private folder. The folder holds the feed (``feed.sock``, an ``ipc://`` PULL socket
this process binds) and the counters (``counters``: ``COUNTERS`` int64, memory-mapped by both processes). It opens
its sockets and answers ``ready`` (or ``error MESSAGE``: an endpoint that cannot be opened) on stdout. From then
on the store's process only sends it records, one msgpack array per event (``RECORD_*``), in batches; everything
else happens here, on another interpreter lock: the records of a message are read, filtered by namespace, turned
into vLLM's events, encoded and sent, one batch per namespace, and kept for replay. The counters (``COUNTER_*``)
are written after every batch. The process ends on a stop record, or when the store's process is gone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import KEY_BYTES, SCOPED_KEY_BYTES, block_key_of, parent_of, scope_of
from kvshelf.kvstore.stats import UNKNOWN
from kvshelf.kvstore.vllm_events import (
    END_SEQ,
    MAX_BATCH_EVENTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsSettings,
    block_hasher,
    open_socket,
)

#: record kinds (the first item of each record): a store's event ``(kind, ts, store event kind, tier, key,
#: namespace, default namespace, tokens, extra)``; ``(kind, ts, namespace, key, parent, tokens, medium)``;
#: ``(kind, ts, namespace, key, medium)``; ``(kind, ts, namespace)``; ``(kind, ts, {tier: medium})``; ``(kind,)``
RECORD_STORE, RECORD_STORED, RECORD_REMOVED, RECORD_CLEARED, RECORD_MEDIA, RECORD_STOP = range(6)
#: the shared counters (int64 each): records read, events published, batches, high-water-mark drops, replays,
#: malformed replay requests, the next sequence number, this process's CPU time in ns
(COUNTER_RECORDS, COUNTER_EVENTS, COUNTER_BATCHES, COUNTER_HWM_DROPS, COUNTER_REPLAYS, COUNTER_BAD_REPLAYS,
 COUNTER_NEXT_SEQ, COUNTER_CPU_NS) = range(8)
COUNTERS = 8


def feed_endpoint(folder: Path) -> str:
    return f"ipc://{folder / 'feed.sock'}"


def counters_at(folder: Path) -> np.memmap:
    """The ``COUNTERS`` int64 counters in ``folder`` (created zeroed by the publisher), memory-mapped."""
    return np.memmap(folder / "counters", dtype=np.int64, mode="r+", shape=(COUNTERS,))


class _Worker:
    def __init__(self, settings: KVEventsSettings, feed: str, counters: np.ndarray) -> None:
        self.settings = settings
        self.counters = counters
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, settings.hwm)
        self.pub.setsockopt(zmq.XPUB_NODROP, 1)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay: zmq.Socket | None = None
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        open_socket(self.pub, settings.endpoint, "kv_events_endpoint")
        if settings.replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            open_socket(self.replay, settings.replay_endpoint, "kv_events_replay_endpoint", bind=True)
        self.pull.bind(feed)
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=settings.buffer_steps)
        self.decoder = msgspec.msgpack.Decoder()
        self.encoder = msgspec.msgpack.Encoder()
        self.media: dict[str, str] = {}
        self.names: dict[bytes, str] = {}
        self.seq = 0
        self.parent = os.getppid()
        self._hash = block_hasher(settings.block_hashes)
        self._warm_up()
        self.cpu_at_start = time.process_time_ns()  # CPU spent publishing: counted from here (start-up not)

    def _warm_up(self) -> None:
        """Build and encode one event of each type once: the encoders' one-time set-up belongs to the start."""
        events = [self._stored(bytes(KEY_BYTES), bytes(KEY_BYTES), [0], "CPU"),
                  BlockRemoved([self._hash(bytes(KEY_BYTES))], "CPU", 0), AllBlocksCleared()]
        self.encoder.encode(KVEventBatch(ts=0.0, events=events, data_parallel_rank=None))
        self.decoder.decode(self.encoder.encode([(RECORD_STOP,)]))

    def run(self) -> None:
        poller = zmq.Poller()
        for socket in (self.pull, self.pub, self.replay):
            if socket is not None:
                poller.register(socket, zmq.POLLIN)
        running = True
        while running:
            ready = dict(poller.poll(200))
            if self.replay is not None and self.replay in ready:
                self._serve_replays()
            if self.pub in ready:
                self._drain_subscriptions()
            if self.pull in ready:  # records come batched (the publisher's FEED_BATCH / FEED_WINDOW_S)
                running = self._read_and_send()
            elif os.getppid() != self.parent:  # the store's process is gone
                running = False
            self.counters[COUNTER_CPU_NS] = time.process_time_ns() - self.cpu_at_start

    def _read_and_send(self) -> bool:
        items: list[tuple[str, Any]] = []
        ts: float | None = None
        records = 0
        running = True
        allowed = self.settings.namespaces
        while running and len(items) < MAX_BATCH_EVENTS:
            try:
                batch = self.decoder.decode(self.pull.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                break
            for record in batch:  # one message: an array of records
                records += 1
                if record[0] == RECORD_STOP:
                    running = False
                    break
                if record[0] == RECORD_MEDIA:
                    self.media.update(record[2])
                    continue
                ts = record[1] if ts is None else ts
                resolved = self._resolve(record)
                if resolved is not None and (allowed is None or resolved[0] in allowed):
                    items.append(resolved)
        if items:
            self._send(items, ts if ts is not None else time.time())
        self.counters[COUNTER_RECORDS] += records
        return running

    def _resolve(self, record: list[Any]) -> tuple[str, Any] | None:
        kind = record[0]
        if kind == RECORD_STORE:
            _, _, event_kind, tier, key, namespace, default, tokens, extra = record
            if len(key) == SCOPED_KEY_BYTES:
                tag = scope_of(key)
                if namespace != UNKNOWN:
                    self.names[tag] = namespace
                else:
                    namespace = self.names.get(tag) or tag.hex()
                key = block_key_of(key)
            elif namespace == UNKNOWN:
                namespace = default
            medium = self.media.get(tier) or tier.upper()
            if event_kind != "stored":
                return namespace, BlockRemoved([self._hash(key)], medium, 0)
            return namespace, self._stored(key, parent_of(extra) if extra else b"", tokens or [], medium)
        if kind == RECORD_STORED:
            _, _, namespace, key, parent, tokens, medium = record
            return namespace, self._stored(key, parent, tokens, medium)
        if kind == RECORD_REMOVED:
            _, _, namespace, key, medium = record
            return namespace, BlockRemoved([self._hash(key)], medium, 0)
        if kind == RECORD_CLEARED:
            return record[2], AllBlocksCleared()
        return None

    def _stored(self, key: bytes, parent: bytes, tokens: list[int], medium: str) -> BlockStored:
        """vLLM's ``BlockStored`` (positional: ``block_hashes, parent_block_hash, token_ids, block_size, lora_id,
        medium, lora_name, extra_keys, group_idx``)."""
        return BlockStored([self._hash(key)], self._hash(parent) if parent else None, tokens, len(tokens), None,
                           medium, None, None, 0)

    def _send(self, items: list[tuple[str, Any]], ts: float) -> None:
        groups: dict[str, list[Any]] = {}
        for namespace, event in items:
            groups.setdefault(namespace, []).append(event)
        for namespace, events in groups.items():
            payload = self.encoder.encode(KVEventBatch(ts=ts, events=events,
                                                       data_parallel_rank=self.settings.data_parallel_rank))
            topic = (self.settings.topic + namespace).encode()
            seq = self.seq
            self.seq += 1
            frames = (topic, seq.to_bytes(8, "big"), payload)
            try:
                self.pub.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # a subscriber is at its high-water mark: it loses this batch, the others get it
                self.counters[COUNTER_HWM_DROPS] += 1
                self.pub.setsockopt(zmq.XPUB_NODROP, 0)
                try:
                    self.pub.send_multipart(frames, flags=zmq.NOBLOCK)
                finally:
                    self.pub.setsockopt(zmq.XPUB_NODROP, 1)
            self.buffer.append((seq, topic, payload))
            self.counters[COUNTER_BATCHES] += 1
            self.counters[COUNTER_EVENTS] += len(events)
        self.counters[COUNTER_NEXT_SEQ] = self.seq

    def _drain_subscriptions(self) -> None:
        """Read the XPUB's subscription messages (they would queue up otherwise)."""
        while True:
            try:
                self.pub.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return

    def _serve_replays(self) -> None:
        assert self.replay is not None
        while self.replay.poll(0):
            frames = self.replay.recv_multipart()
            identity, rest = frames[0], frames[1:]
            if rest and rest[0] == b"":
                rest = rest[1:]  # a REQ client's delimiter
            if not 1 <= len(rest) <= 2 or len(rest[0]) != 8:  # malformed: the end marker alone, so no client hangs
                self.counters[COUNTER_BAD_REPLAYS] += 1
                self.replay.send_multipart((identity, b"", END_SEQ, b""))
                continue
            start = int.from_bytes(rest[0], "big")
            prefix = rest[1] if len(rest) == 2 else b""
            self.counters[COUNTER_REPLAYS] += 1
            for seq, topic, payload in list(self.buffer):
                if seq >= start and topic.startswith(prefix):
                    self.replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((identity, b"", END_SEQ, b""))

    def close(self) -> None:
        for socket in (self.pull, self.pub, self.replay):
            if socket is not None:
                socket.close(linger=0)
        self.ctx.term()


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    raw = spec["settings"]
    namespaces = raw.pop("namespaces")
    settings = KVEventsSettings(**raw, namespaces=frozenset(namespaces) if namespaces is not None else None)
    folder = Path(spec["folder"])
    counters = counters_at(folder)
    try:
        worker = _Worker(settings, feed_endpoint(folder), counters)
    except ConfigError as exc:
        print(f"error {exc}", flush=True)
        sys.exit(2)
    print("ready", flush=True)
    try:
        worker.run()
    finally:
        worker.close()
        counters.flush()


if __name__ == "__main__":
    main()
