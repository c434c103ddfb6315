"""The process that publishes vLLM-format KV events (``kvstore.vllm_events``): it owns the XPUB and replay sockets.

``VLLMEventPublisher`` starts it (``python -m kvshelf.kvstore.vllm_events_worker``) and hands it, on stdin, one
JSON line: the settings and a private folder. The folder holds the feed (``feed.sock``, an ``ipc://`` PULL socket
this process binds) and the counters (``counters``: ``COUNTERS`` int64, memory-mapped by both processes). It opens
its sockets and answers ``ready`` (or ``error MESSAGE``: an endpoint that cannot be opened) on stdout. From then
on the store's process only sends it records, one msgpack array per event (``RECORD_*``), in batches; everything
else happens here, on another interpreter lock: the records of a message are read, filtered by namespace, turned
into vLLM's events, encoded and sent, one batch per namespace (each topic numbered on its own), and kept for replay.
The counters (``COUNTER_*``) are written after every loop. The process ends on a stop record, or when the store's
process is gone.

What a peer can make this process hold is bounded before it is stored (the limits below):

* frames: ``ZMQ_MAXMSGSIZE`` on the XPUB and the ROUTER (``MAX_FRAME_BYTES``): libzmq drops the connection of a peer
  that announces a larger frame before reading it; peers that do not finish the ZeroMQ handshake within
  ``handshake_s`` are dropped (``ZMQ_HANDSHAKE_IVL``);
* subscriptions: libzmq keeps a trie node per byte of each distinct subscription (~48 bytes each). The XPUB hands
  every new distinct subscription and every last unsubscription to this process, which keeps their count and
  bytes; past ``MAX_SUBSCRIPTIONS`` or ``MAX_SUBSCRIPTION_BYTES`` the XPUB is closed and opened again (every
  subscriber is dropped and reconnects; ZeroMQ's SUB sockets do that on their own) and the reset is counted;
* the replay buffer: ``buffer_steps`` batches and ``buffer_bytes`` of payload, whichever is reached first;
* payloads are sent zero-copy, the buffer's own bytes: a subscriber's or replay peer's queue shares them. A payload
  that left the buffer while still queued for a peer is "pinned"; past ``buffer_bytes`` of pinned payloads for
  ``PINNED_GRACE_S``, the replay socket (then the XPUB) is closed and opened again, which frees them;
* replays (``kvstore.vllm_events_replay``): one job per peer, ``REPLAY_JOBS`` at once (more are answered with the
  end marker alone and counted as refused), sent with ``ZMQ_ROUTER_MANDATORY`` and a send high-water mark of
  ``REPLAY_HWM`` messages: a peer that does not read stops its own job (given up after ``REPLAY_STALL_S``), never
  another's; ``REPLAY_ROUND`` replay messages at most per loop, between live batches, so live events are never
  behind a replay flood;
* and what libzmq does before this process can see it: a flood of subscriptions from several peers keeps libzmq
  adding them to its trie inside one call of this process's loop. A guard thread (``_Guard``) reads this process's
  resident memory every ``GUARD_INTERVAL_S``; past what it had at start, plus the payloads it holds (buffered and
  pinned, each bounded by ``buffer_bytes``), plus ``GUARD_MARGIN_BYTES``, it trims the C heap, then shuts down
  (``shutdown(2)``, outside libzmq) the TCP connections to the bound ports that have unread bytes waiting, or, when
  none has, every one (once a second at most); libzmq sees them closed and lets go of what they held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import socket as stdsocket
import sys
import threading
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
from kvshelf.kvstore.vllm_event_wire import (
    MAX_BATCH_EVENTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsSettings,
    block_hasher,
    open_socket,
)
from kvshelf.kvstore.vllm_events_replay import MAX_TOPIC_BYTES, Replays, TopicLog

#: record kinds (the first item of each record): a store's event ``(kind, ts, store event kind, tier, key,
#: namespace, default namespace, tokens, extra)``; ``(kind, ts, namespace, key, parent, tokens, medium)``;
#: ``(kind, ts, namespace, key, medium)``; ``(kind, ts, namespace)``; ``(kind, ts, {tier: medium})``; ``(kind,)``
RECORD_STORE, RECORD_STORED, RECORD_REMOVED, RECORD_CLEARED, RECORD_MEDIA, RECORD_STOP = range(6)
#: the shared counters (int64 each): records read, events published, batches, high-water-mark drops, replays,
#: malformed replay requests, batches published (all topics), this process's CPU time in ns, replays refused (too
#: many at once), socket resets (subscriptions or pinned payloads past their bounds), payload bytes buffered for
#: replay, payload bytes pinned (out of the buffer, still queued for a peer), connections the memory guard dropped
(COUNTER_RECORDS, COUNTER_EVENTS, COUNTER_BATCHES, COUNTER_HWM_DROPS, COUNTER_REPLAYS, COUNTER_BAD_REPLAYS,
 COUNTER_NEXT_SEQ, COUNTER_CPU_NS, COUNTER_REPLAYS_REFUSED, COUNTER_RESETS, COUNTER_BUFFER_BYTES,
 COUNTER_PINNED_BYTES, COUNTER_GUARD_DROPS) = range(13)
COUNTERS = 13

#: ``ZMQ_MAXMSGSIZE`` of the XPUB and the ROUTER: a subscription or a request frame (a topic and a few bytes)
MAX_FRAME_BYTES = MAX_TOPIC_BYTES + 64
#: distinct subscriptions held at once, and their bytes (libzmq's trie: ~48 bytes a byte, 2 KiB a fan-out)
MAX_SUBSCRIPTIONS = 1024
MAX_SUBSCRIPTION_BYTES = 64 << 10
#: inbound queue of each XPUB peer (subscriptions) and ROUTER peer (requests), in messages
INBOUND_HWM = 4
#: replay messages queued for one peer at most (``ZMQ_SNDHWM`` of the ROUTER; each shares a buffered payload)
REPLAY_HWM = 64
#: how often replay jobs whose peers' queues were full are tried again (ms)
STALLED_POLL_MS = 5
#: a batch's payload is split (by events) above this size
MAX_BATCH_BYTES = 1 << 20
#: how long pinned payloads may stay past their bound before a socket is reset (libzmq frees them asynchronously)
PINNED_GRACE_S = 0.1
#: the memory guard: how often it looks, and the memory it allows past the process's own at start and the payloads
#: it holds (buffered and pinned)
GUARD_INTERVAL_S = 0.02
GUARD_MARGIN_BYTES = 64 << 20
#: the guard drops every connection (when none has bytes waiting) and trims the heap at most once this often
GUARD_SETTLE_S = 1.0
_TCP_BIND = re.compile(r"tcp://(\*|\[[0-9a-fA-F:.]*::[0-9a-fA-F:.]*\]):(\d+)")


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
        self.pub: zmq.Socket = self._open_pub()
        self.replay: zmq.Socket | None = self._open_replay() if settings.replay_endpoint else None
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(feed)
        self.logs: dict[bytes, TopicLog] = {}
        self.replays = Replays(settings, self.logs)
        self.order: deque[bytes] = deque()  # the topic of each buffered batch, oldest first
        self.buffered_bytes = 0
        self.pinned: deque[tuple[Any, int]] = deque()  # (tracker, bytes) of payloads out of the buffer
        self.pinned_bytes = 0
        self.pinned_over_since: float | None = None
        self.replay_reset_at = 0.0
        self.subscriptions: set[bytes] = set()
        self.subscription_bytes = 0
        self.decoder = msgspec.msgpack.Decoder()
        self.encoder = msgspec.msgpack.Encoder()
        self.media: dict[str, str] = {}
        self.names: dict[bytes, str] = {}
        self.batches = 0
        self.parent = os.getppid()
        self._hash = block_hasher(settings.block_hashes)
        self._warm_up()
        self.guard = _Guard(bound_tcp_ports(settings), resident_bytes(), counters)
        if self.guard.ports and _STATM >= 0:
            self.guard.start()
        self.cpu_at_start = time.process_time_ns()  # CPU spent publishing: counted from here (start-up not)

    # -- sockets ----------------------------------------------------------------------------------------------

    def _guard(self, socket: zmq.Socket) -> None:
        """The options every socket a peer reaches gets: frame size, handshake deadline, no linger."""
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        socket.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(self.settings.handshake_s * 1000)))
        socket.setsockopt(zmq.RCVHWM, INBOUND_HWM)

    def _open_pub(self, *, retry: bool = False) -> zmq.Socket:
        pub = self.ctx.socket(zmq.XPUB)
        self._guard(pub)
        pub.setsockopt(zmq.SNDHWM, self.settings.hwm)
        pub.setsockopt(zmq.XPUB_NODROP, 1)
        _open_retrying(pub, self.settings.endpoint, "kv_events_endpoint", retry=retry)
        return pub

    def _open_replay(self, *, retry: bool = False) -> zmq.Socket:
        assert self.settings.replay_endpoint
        replay = self.ctx.socket(zmq.ROUTER)
        self._guard(replay)
        replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
        _open_retrying(replay, self.settings.replay_endpoint, "kv_events_replay_endpoint", bind=True,
                       retry=retry)
        return replay

    def _reset_pub(self) -> None:
        """Close the XPUB and open it again: every subscription and queued batch is freed; subscribers reconnect."""
        self.pub.close(linger=0)
        self.subscriptions.clear()
        self.subscription_bytes = 0
        self.counters[COUNTER_RESETS] += 1
        self.pub = self._open_pub(retry=True)
        _trim()

    def _reset_replay(self) -> None:
        """Close the replay ROUTER and open it again: every replay job and queued message is dropped."""
        assert self.replay is not None
        self.replay.close(linger=0)
        self.replays.jobs.clear()
        self.counters[COUNTER_RESETS] += 1
        self.replay_reset_at = time.monotonic()
        self.replay = self._open_replay(retry=True)
        _trim()

    def _warm_up(self) -> None:
        """Build and encode one event of each type once: the encoders' one-time set-up belongs to the start."""
        events = [self._stored(bytes(KEY_BYTES), bytes(KEY_BYTES), [0], "CPU"),
                  BlockRemoved([self._hash(bytes(KEY_BYTES))], "CPU", 0), AllBlocksCleared()]
        self.encoder.encode(KVEventBatch(ts=0.0, events=events, data_parallel_rank=None))
        self.decoder.decode(self.encoder.encode([(RECORD_STOP,)]))

    # -- the loop ---------------------------------------------------------------------------------------------

    def run(self) -> None:
        running = True
        poller, polled = zmq.Poller(), ()
        while running:
            if polled != (self.pub, self.replay):  # at start, and after a socket was opened again
                poller, polled = zmq.Poller(), (self.pub, self.replay)
                for socket in (self.pull, self.pub, self.replay):
                    if socket is not None:
                        poller.register(socket, zmq.POLLIN)
            jobs = self.replays.jobs
            ready = dict(poller.poll(0 if self.replays.busy else STALLED_POLL_MS if jobs else 200))
            if self.pull in ready:  # live first: records come batched (the publisher's FEED_BATCH / FEED_WINDOW_S)
                running = self._read_and_send()
            elif os.getppid() != self.parent:  # the store's process is gone
                running = False
            if self.pub in ready:
                self._read_subscriptions()
            if self.replay is not None and self.replay in ready:
                self._read_replay_requests()
            if self.replay is not None and self.replays.jobs:
                self.replays.round(self.replay)
            self._check_pinned()
            self.counters[COUNTER_CPU_NS] = time.process_time_ns() - self.cpu_at_start

    # -- live -------------------------------------------------------------------------------------------------

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

    def _encode(self, events: list[Any], ts: float) -> list[bytes]:
        """The payloads of ``events``: one batch, split in halves while it is over ``MAX_BATCH_BYTES``."""
        payload = self.encoder.encode(KVEventBatch(ts=ts, events=events,
                                                   data_parallel_rank=self.settings.data_parallel_rank))
        if len(payload) <= MAX_BATCH_BYTES or len(events) == 1:
            return [payload]
        half = len(events) // 2
        return self._encode(events[:half], ts) + self._encode(events[half:], ts)

    def _send(self, items: list[tuple[str, Any]], ts: float) -> None:
        groups: dict[str, list[Any]] = {}
        for namespace, event in items:
            groups.setdefault(namespace, []).append(event)
        for namespace, events in groups.items():
            topic = (self.settings.topic + namespace).encode()
            log = self.logs.get(topic)
            if log is None:
                log = self.logs[topic] = TopicLog()
            for payload in self._encode(events, ts):
                seq = log.next_seq
                log.next_seq += 1
                frame = zmq.Frame(payload, track=True, copy=False)  # zero-copy: queues share the buffer's bytes
                self._publish((topic, seq.to_bytes(8, "big"), frame))
                log.entries.append((seq, frame, len(payload)))
                self.order.append(topic)
                self.buffered_bytes += len(payload)
                self.batches += 1
                self.counters[COUNTER_BATCHES] += 1
            self.counters[COUNTER_EVENTS] += len(events)
        self._evict()
        self.counters[COUNTER_NEXT_SEQ] = self.batches

    def _publish(self, frames: tuple[bytes, bytes, zmq.Frame]) -> None:
        try:
            self.pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # a subscriber is at its high-water mark: it loses this batch, the others get it
            self.counters[COUNTER_HWM_DROPS] += 1
            self.pub.setsockopt(zmq.XPUB_NODROP, 0)
            try:
                self.pub.send_multipart(frames, flags=zmq.NOBLOCK)
            finally:
                self.pub.setsockopt(zmq.XPUB_NODROP, 1)

    def _evict(self) -> None:
        """Drop the oldest batches past ``buffer_steps`` or ``buffer_bytes``; a payload still queued for a peer is
        pinned (counted until libzmq lets it go)."""
        limit_steps, limit_bytes = self.settings.buffer_steps, self.settings.buffer_bytes
        while self.order and (len(self.order) > limit_steps or self.buffered_bytes > limit_bytes):
            log = self.logs[self.order.popleft()]
            _, frame, nbytes = log.entries.popleft()
            self.buffered_bytes -= nbytes
            self.pinned.append((frame.tracker, nbytes))  # done once this frame and every queued copy are freed
            self.pinned_bytes += nbytes
        self.counters[COUNTER_BUFFER_BYTES] = self.buffered_bytes

    def _check_pinned(self) -> None:
        """Forget pinned payloads libzmq has freed; past ``buffer_bytes`` for ``PINNED_GRACE_S``, reset the replay
        socket (its peers pin payloads by not reading) or, when that was just done, the XPUB."""
        if not self.pinned and self.pinned_over_since is None:
            return
        while self.pinned and self.pinned[0][0].done:
            self.pinned_bytes -= self.pinned.popleft()[1]
        if self.pinned_bytes > self.settings.buffer_bytes:
            kept = deque(item for item in self.pinned if not item[0].done)
            self.pinned, self.pinned_bytes = kept, sum(nbytes for _, nbytes in kept)
        now = time.monotonic()
        if self.pinned_bytes <= self.settings.buffer_bytes:
            self.pinned_over_since = None
        elif self.pinned_over_since is None:
            self.pinned_over_since = now
        elif now - self.pinned_over_since >= PINNED_GRACE_S:
            if self.replay is not None and now - self.replay_reset_at > 2 * PINNED_GRACE_S:
                self._reset_replay()
            else:
                self._reset_pub()
            self.pinned_over_since = now
        self.counters[COUNTER_PINNED_BYTES] = self.pinned_bytes

    def _read_subscriptions(self) -> None:
        """Read the XPUB's subscription messages (each new distinct subscription, each last unsubscription) and keep
        their count and bytes within ``MAX_SUBSCRIPTIONS`` and ``MAX_SUBSCRIPTION_BYTES`` (past them: reset)."""
        for _ in range(4 * MAX_SUBSCRIPTIONS):
            try:
                message = self.pub.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            topic = message[1:]
            if message[:1] == b"\x01" and topic not in self.subscriptions:
                self.subscriptions.add(topic)
                self.subscription_bytes += len(topic) + 1
            elif message[:1] == b"\x00" and topic in self.subscriptions:
                self.subscriptions.discard(topic)
                self.subscription_bytes -= len(topic) + 1
            if len(self.subscriptions) > MAX_SUBSCRIPTIONS or self.subscription_bytes > MAX_SUBSCRIPTION_BYTES:
                self._reset_pub()
                return

    # -- replay (``kvstore.vllm_events_replay``) ---------------------------------------------------------------

    def _read_replay_requests(self) -> None:
        assert self.replay is not None
        counts = self.replays.read_requests(self.replay)
        self.counters[COUNTER_BAD_REPLAYS] += counts.bad
        self.counters[COUNTER_REPLAYS_REFUSED] += counts.refused
        self.counters[COUNTER_REPLAYS] += counts.started

    def close(self) -> None:
        self.guard.stopped.set()
        for socket in (self.pull, self.pub, self.replay):
            if socket is not None:
                socket.close(linger=0)
        self.ctx.term()


def bound_tcp_ports(settings: KVEventsSettings) -> set[int]:
    """The TCP ports this process listens on: the endpoint's when it binds, the replay endpoint's (always bound)."""
    ports = set()
    for endpoint, always in ((settings.endpoint, False), (settings.replay_endpoint, True)):
        if endpoint and endpoint.startswith("tcp://"):
            port = int(endpoint.rsplit(":", 1)[1])
            if always or _TCP_BIND.fullmatch(endpoint):
                ports.add(port)
    return ports


_PAGE = os.sysconf("SC_PAGE_SIZE")
_STATM = os.open("/proc/self/statm", os.O_RDONLY) if os.path.exists("/proc/self/statm") else -1  # -1: no guard


def resident_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``, kept open: the guard reads it 50 times a second)."""
    return int(os.pread(_STATM, 256, 0).split()[1]) * _PAGE


def inbound_connections(ports: set[int]) -> list[tuple[int, int]]:
    """``(socket inode, bytes waiting to be read)`` of the established TCP connections to ``ports`` (IPv4, IPv6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "01":  # 01: ESTABLISHED
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) in ports:
                found.append((int(fields[9]), int(fields[4].split(":")[1], 16)))
    return found


def shut_down_inodes(inodes: set[int]) -> int:
    """``shutdown(2)`` the sockets of this process whose inodes are ``inodes`` (libzmq sees them closed and closes
    them itself); how many."""
    done = 0
    for entry in os.scandir("/proc/self/fd"):
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue
        if not target.startswith("socket:[") or int(target[8:-1]) not in inodes:
            continue
        try:
            fd = os.dup(int(entry.name))
        except OSError:
            continue
        try:
            if os.fstat(fd).st_ino in inodes:  # still that socket (not a number reused since)
                with stdsocket.socket(fileno=fd) as sock:
                    fd = -1
                    sock.shutdown(stdsocket.SHUT_RDWR)
                    done += 1
        except OSError:
            pass
        finally:
            if fd >= 0:
                os.close(fd)
    return done


class _Guard(threading.Thread):
    """Drops the connections to ``ports`` when this process holds more than ``base`` plus the payloads it keeps plus
    ``GUARD_MARGIN_BYTES`` (module doc)."""

    def __init__(self, ports: set[int], base: int, counters: np.ndarray) -> None:
        super().__init__(name="kvshelf-vllm-events-guard", daemon=True)
        self.ports = ports
        self.base = base
        self.counters = counters
        self.stopped = threading.Event()

    @property
    def ceiling(self) -> int:
        held = int(self.counters[COUNTER_BUFFER_BYTES]) + int(self.counters[COUNTER_PINNED_BYTES])
        return self.base + held + GUARD_MARGIN_BYTES

    def run(self) -> None:
        trimmed = dropped_all = 0.0
        while not self.stopped.wait(GUARD_INTERVAL_S):
            if resident_bytes() <= self.ceiling:
                continue
            now = time.monotonic()
            if now - trimmed >= GUARD_SETTLE_S:  # free memory the heap still holds first (once a second at most)
                trimmed = now
                _trim()
                if resident_bytes() <= self.ceiling:
                    continue
            connections = inbound_connections(self.ports)
            busy = {inode for inode, waiting in connections if waiting > 0}
            if busy:  # peers sending faster than libzmq takes it in
                dropped = shut_down_inodes(busy)
            elif now - dropped_all >= GUARD_SETTLE_S:  # none: every connection, once a second at most
                dropped_all = now
                dropped = shut_down_inodes({inode for inode, _ in connections})
            else:
                continue
            self.counters[COUNTER_GUARD_DROPS] += dropped
            trimmed = 0.0  # what the dropped connections held is freed: trim again when still over


def _trim() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``; nothing elsewhere): what a reset
    freed (libzmq's subscription trie, queued messages) is not kept as resident memory."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


def _open_retrying(socket: zmq.Socket, endpoint: str, setting: str, *, bind: bool = False,
                   retry: bool = False) -> None:
    """``open_socket``; with ``retry`` (a socket re-opened after a reset) retried for up to 5 s while the address is
    still held by the socket it replaces (libzmq closes a listener in its I/O thread, shortly after ``close``)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            open_socket(socket, endpoint, setting, bind=bind)
            return
        except ConfigError:
            if not retry or time.monotonic() >= deadline:
                socket.close(linger=0)
                raise
            time.sleep(0.02)


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
