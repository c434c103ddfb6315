"""KV events for routers: the ``SubscribeEvents`` stream, its persistent event log and the fan-out to subscribers.

What a subscriber sees (vLLM's KV events, per namespace): ``BlockStored`` when a tier stores a block (a put, a
promotion on a read, a write-down), ``BlockRemoved`` when a block leaves a tier (``Delete``, a damaged value
dropped, an eviction: reason ``deleted`` / ``evicted``), and ``AllBlocksCleared`` for ``Clear`` (which emits no
per-block removals of its own). Events are per tier, the tier being vLLM's ``medium``: a router that wants "does
this server hold the block" keeps, per block, the set of media that stored it and forgets the block when that set
is empty (a block evicted from memory but still on disk is still held). A restarted server's first event is an
``AllBlocksCleared`` with ``medium`` "memory" for every namespace (what memory tiers held did not survive).

Sequence numbers: one counter per server data dir (every namespace shares it, so a subscriber sees gaps), kept in
the log, so they keep growing across restarts. Every event is appended to the log (``FileEventLog``: segment
files ``DATA_DIR/events/<first seq>.events``; a record is ``<payload length u32><crc32 u32><seq u64><8-byte namespace
tag><KVEvent>``) with one ``write`` to the page cache, so a killed server loses none (a power loss may lose the
unsynced tail: no fsync). The log is bounded (``max_bytes``): the oldest segment goes when the total passes it.
A damaged or torn record found at start is cut off with a warning; one met while replaying is announced as lost.

Replay: a subscriber asking ``from_seq`` N gets every kept event of its namespace from N on, then the live ones,
with no gap or duplicate (it is registered for live events before the log is read up to that point). Events older
than the log keeps, a sequence past the log's end (a reset data dir), or damaged records become one
``EventsLost`` message: the router drops what it knows of this server and resyncs.

Slow subscribers never slow puts: events reach a subscriber through a bounded queue (``queue_events``); one that
falls that far behind is ended with RESOURCE_EXHAUSTED and resumes from the ``next_seq`` of the last message it
read. Subscriptions are long-lived, so they are outside the stream gate (``service/fairness.py``): no idle
timeout; a server-wide cap (``max_subscriptions``, which the server adds to its worker threads) and a per-tenant
cap (``tenant_subscriptions``) keep them from taking the threads of puts and gets.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import SCOPE_BYTES, is_scoped, parent_of, scope_tag, split_scoped
from kvshelf.kvstore.memory_tier import MemoryTier
from kvshelf.kvstore.stats import UNKNOWN, StoreEvent
from kvshelf.kvstore.store import TieredStore
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.errors import StreamRefusedError
from kvshelf.service.fairness import end_call
from kvshelf.service.status import fail
from kvshelf.service.wire import varint

log = logging.getLogger(__name__)

RECORD_HEADER = struct.Struct("<IIQ")  # payload length, crc32 of (seq, tag, payload), seq
MAX_RECORD_PAYLOAD = 16 << 20  # larger is damage
SEGMENT_SUFFIX = ".events"
MESSAGE_BYTES = 512 << 10  # events per SubscribeEventsResponse: at most this many bytes (well under the gRPC limit)
MESSAGE_EVENTS = 512
QUEUE_BYTES = 32 << 20  # events waiting for one subscriber: at most this many bytes too (token lists can be long)
REMOVAL_REASONS = {"removed": "deleted", "evicted": "evicted"}
#: the namespace tag of events for every namespace (a restart's AllBlocksCleared of the memory tier)
BROADCAST = b"\x00" * SCOPE_BYTES


@dataclass(frozen=True)
class Lost:
    """Events ``[from_seq, to_seq)`` cannot be delivered (``reason`` says why)."""

    from_seq: int
    to_seq: int
    reason: str


Record = tuple[int, bytes, bytes]  # (seq, namespace tag, serialized KVEvent)


def _crc(seq: int, tag: bytes, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(tag, zlib.crc32(seq.to_bytes(8, "little"))))


def encode_record(seq: int, tag: bytes, payload: bytes) -> bytes:
    return RECORD_HEADER.pack(len(payload), _crc(seq, tag, payload), seq) + tag + payload


class MemoryEventLog:
    """The event log of a server without a data dir: the newest events in memory (gone with the process)."""

    persistent = False

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.next_seq = 1  # the sequence of the first event when opened
        self._records: deque[Record] = deque()
        self._bytes = 0
        self._lock = threading.Lock()

    def append(self, seq: int, tag: bytes, payload: bytes) -> None:
        with self._lock:
            self._records.append((seq, tag, payload))
            self._bytes += len(payload) + RECORD_HEADER.size + SCOPE_BYTES
            while self._bytes > self.max_bytes and len(self._records) > 1:
                _, _, old = self._records.popleft()
                self._bytes -= len(old) + RECORD_HEADER.size + SCOPE_BYTES

    def oldest_seq(self, next_seq: int) -> int:
        with self._lock:
            return self._records[0][0] if self._records else next_seq

    def read(self, from_seq: int, stop_seq: int, tag: bytes) -> Iterator[Record | Lost]:
        with self._lock:
            records = [r for r in self._records if from_seq <= r[0] < stop_seq and r[1] in (tag, BROADCAST)]
        yield from records

    def close(self) -> None:
        pass


class FileEventLog:
    """The persistent event log: segment files in ``directory`` (see the module doc), at most ``max_bytes``."""

    persistent = True

    def __init__(self, directory: str | Path, max_bytes: int = 64 << 20, segment_bytes: int | None = None) -> None:
        if max_bytes < 4096:
            raise ConfigError(f"the event log needs at least 4096 bytes, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(4096, max_bytes // 8)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd: int | None = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot create the event log directory {self.directory}: {exc}") from exc
        try:  # one writer: two servers on one data dir would interleave their sequences
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"the event log {self.directory} is in use by another kvshelf server (one server per "
                              "data dir)") from None
        self._lock = threading.Lock()
        self._segments: list[tuple[int, Path]] = sorted(self._list_segments())
        self._sizes = {first: path.stat().st_size for first, path in self._segments}
        self.next_seq = 1
        if self._segments:
            first, path = self._segments[-1]
            last, good_bytes, damage = _scan(path, first)
            if damage is not None:
                log.warning("event log %s: %s after %d good bytes; cut off there (events after seq %d are lost)",
                            path, damage, good_bytes, last if last is not None else first - 1)
                with open(path, "r+b") as fh:
                    fh.truncate(good_bytes)
                self._sizes[first] = good_bytes
            self.next_seq = last + 1 if last is not None else first
        self._file: Any = None

    def _list_segments(self) -> Iterable[tuple[int, Path]]:
        for path in self.directory.iterdir():
            if path.suffix == SEGMENT_SUFFIX and path.stem.isdigit():
                yield int(path.stem), path

    def _open_segment(self, first: int) -> None:
        path = self.directory / f"{first:020d}{SEGMENT_SUFFIX}"
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - kept open until the next rotation
        if not self._segments or self._segments[-1][0] != first:
            self._segments.append((first, path))
            self._sizes[first] = 0

    def append(self, seq: int, tag: bytes, payload: bytes) -> None:
        record = encode_record(seq, tag, payload)
        with self._lock:
            full = not self._segments or self._sizes[self._segments[-1][0]] >= self.segment_bytes
            if self._file is None or full:
                if self._file is not None:
                    self._file.close()
                self._open_segment(seq if full else self._segments[-1][0])
                self._trim()
            self._file.write(record)  # one write: in the page cache (survives a killed process) once it returns
            self._sizes[self._segments[-1][0]] += len(record)

    def _trim(self) -> None:
        while len(self._segments) > 1 and sum(self._sizes.values()) > self.max_bytes:
            first, path = self._segments.pop(0)
            self._sizes.pop(first, None)
            try:
                path.unlink()
            except OSError as exc:
                log.warning("event log: cannot remove old segment %s: %s", path, exc)

    def oldest_seq(self, next_seq: int) -> int:
        with self._lock:
            return self._segments[0][0] if self._segments else next_seq

    def read(self, from_seq: int, stop_seq: int, tag: bytes) -> Iterator[Record | Lost]:
        """``tag``'s records of sequences ``[from_seq, stop_seq)``, and ``Lost`` for what cannot be read."""
        with self._lock:
            segments = list(self._segments)
        if not segments or from_seq >= stop_seq:
            return
        expected = from_seq
        start = max((i for i, (first, _) in enumerate(segments) if first <= from_seq), default=0)
        for i in range(start, len(segments)):
            first, path = segments[i]
            if first >= stop_seq:
                return
            end = segments[i + 1][0] if i + 1 < len(segments) else stop_seq
            if first > expected:
                yield Lost(expected, first, "older than the event log keeps (--events-log)")
            expected = max(expected, first)
            try:
                fh = open(path, "rb")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                yield Lost(expected, min(end, stop_seq), "dropped from the event log while it was read")
                expected = max(expected, end)
                continue
            with fh:
                for item in _records(fh, first):
                    if isinstance(item, str):
                        if expected < min(end, stop_seq):
                            yield Lost(expected, min(end, stop_seq), f"damaged event log record in {path.name}: "
                                                                     f"{item}")
                        expected = max(expected, end)
                        break
                    seq, rec_tag, payload = item
                    if seq >= stop_seq:
                        return
                    if seq < expected:
                        continue
                    expected = seq + 1
                    if rec_tag in (tag, BROADCAST):
                        yield item

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None


def _records(fh: Any, first: int) -> Iterator[Record | str]:
    """The records of an open segment in order; a string (what is wrong) at the first damaged or torn one."""
    previous = first - 1
    while True:
        head = fh.read(RECORD_HEADER.size)
        if not head:
            return
        if len(head) < RECORD_HEADER.size:
            yield "torn record header"
            return
        length, crc, seq = RECORD_HEADER.unpack(head)
        if length > MAX_RECORD_PAYLOAD:
            yield f"record length {length} is not plausible"
            return
        tag, payload = fh.read(SCOPE_BYTES), fh.read(length)
        if len(tag) < SCOPE_BYTES or len(payload) < length:
            yield "torn record"
            return
        if _crc(seq, tag, payload) != crc:
            yield f"checksum mismatch at seq {seq}"
            return
        if seq <= previous:
            yield f"seq {seq} after {previous}"
            return
        previous = seq
        yield seq, tag, payload


def _scan(path: Path, first: int) -> tuple[int | None, int, str | None]:
    """The last good seq of a segment, the bytes of its good records, and the damage found after them."""
    last, good = None, 0
    with open(path, "rb") as fh:
        for item in _records(fh, first):
            if isinstance(item, str):
                return last, good, item
            last = item[0]
            good += RECORD_HEADER.size + SCOPE_BYTES + len(item[2])
    return last, good, None


EventLog = MemoryEventLog | FileEventLog


def open_event_log(directory: str | Path | None, max_bytes: int = 64 << 20) -> EventLog:
    """The persistent log under ``directory``, or an in-memory one when it is None."""
    return FileEventLog(directory, max_bytes) if directory is not None else MemoryEventLog(max_bytes)


class _Subscriber:
    def __init__(self, namespace: str, tag: bytes, context: grpc.ServicerContext, limit: int) -> None:
        self.namespace, self.tag, self.context, self.limit = namespace, tag, context, limit
        self.queue: deque[tuple[int, bytes]] = deque()
        self.queued_bytes = 0
        self.cond = threading.Condition(threading.Lock())
        self.overflowed = False
        self.ended: str | None = None  # "cancelled" (the client went) or "shutdown"
        self.sent_seq = 0  # every event of the namespace below this was handed to gRPC

    def offer(self, seq: int, payload: bytes) -> bool:
        """Queue one event (called with the hub's lock held: never blocks on the client); True when the queue
        just overflowed (the caller then ends the call, out of the locks)."""
        with self.cond:
            if self.overflowed or self.ended:
                return False
            if len(self.queue) >= self.limit or self.queued_bytes + len(payload) > QUEUE_BYTES:
                self.overflowed = True
                self.queue.clear()
                self.queued_bytes = 0
                self.cond.notify()
                return True
            self.queue.append((seq, payload))
            self.queued_bytes += len(payload)
            self.cond.notify()
            return False

    def overflow_message(self) -> str:
        return (f"subscriber too slow: more than {self.limit} events (or {QUEUE_BYTES >> 20} MiB) of namespace "
                f"{self.namespace!r} waited for it (--subscriber-queue); reconnect with from_seq = the next_seq of the "
                f"last message read (the server had sent everything below {self.sent_seq})")

    def end(self, why: str) -> None:
        with self.cond:
            if self.ended is None:
                self.ended = why
            self.cond.notify()


class EventHub:
    """Turns a store's events into sequenced ``KVEvent``s, logs them and streams them to subscribers."""

    def __init__(self, store: TieredStore, event_log: EventLog, *, queue_events: int = 10_000,
                 max_subscriptions: int = 8, tenant_subscriptions: int = 2, heartbeat_s: float = 5.0,
                 annotation_tokens: int = 1 << 20, annotation_blocks: int = 1 << 16) -> None:
        if queue_events < 1 or max_subscriptions < 1 or tenant_subscriptions < 1 or heartbeat_s <= 0:
            raise ConfigError("subscriber queue, subscription caps and heartbeat must be > 0")
        self.log = event_log
        self.queue_events = queue_events
        self.max_subscriptions = max_subscriptions
        self.tenant_subscriptions = min(tenant_subscriptions, max_subscriptions)
        self.heartbeat_s = heartbeat_s
        self.annotation_tokens = annotation_tokens
        self.annotation_blocks = annotation_blocks
        self.next_seq = event_log.next_seq
        self.refused = 0
        self.ended_slow = 0
        self._lock = threading.Lock()
        self._subs: dict[bytes, list[_Subscriber]] = {}
        self._count: dict[str, int] = {}
        self._annotations: OrderedDict[bytes, tuple[bytes, array]] = OrderedDict()
        self._annotated_tokens = 0
        self._local = threading.local()
        self._log_failed = False
        self._closed = False
        self._unsubscribe: Callable[[], None] | None = store.subscribe(self._on_store_event)
        if event_log.persistent and self.next_seq > 1:  # a restart: what memory tiers held is gone
            for spec in store.specs:
                if isinstance(spec.tier, MemoryTier):
                    self._publish(BROADCAST, pb.KVEvent(cleared=pb.AllBlocksCleared(medium=spec.tier.name)))

    # -- producing -----------------------------------------------------------------------------------

    def annotate(self, items: Iterable[tuple[bytes, bytes, Iterable[int]]]) -> None:
        """Remember ``(tier_key, parent_key, token_ids)`` a client sent with blocks about to be stored: their
        BlockStored events carry them, before what the blocks' headers say (the newest ``annotation_blocks``
        blocks, ``annotation_tokens`` tokens at most, are kept, for later promotions and write-downs too)."""
        with self._lock:
            for key, parent, tokens in items:
                packed = array("I", tokens)
                old = self._annotations.pop(key, None)
                if old is not None:
                    self._annotated_tokens -= len(old[1])
                self._annotations[key] = (parent, packed)
                self._annotated_tokens += len(packed)
            while self._annotations and (self._annotated_tokens > self.annotation_tokens
                                         or len(self._annotations) > self.annotation_blocks):
                _, (_, dropped) = self._annotations.popitem(last=False)
                self._annotated_tokens -= len(dropped)

    @contextmanager
    def clearing(self, tag: bytes) -> Iterator[None]:
        """While a Clear of ``tag``'s namespace deletes its blocks on this thread: no per-block removals (the
        ``cleared`` event after it stands for them)."""
        self._local.clearing = tag
        try:
            yield
        finally:
            self._local.clearing = None

    def cleared(self, tag: bytes) -> None:
        self._publish(tag, pb.KVEvent(cleared=pb.AllBlocksCleared()))

    def _on_store_event(self, event: StoreEvent) -> None:
        key = event.key
        if not is_scoped(key):
            return  # not a service (namespace-scoped) key
        tag, block = split_scoped(key)
        if event.kind == "stored":
            with self._lock:
                parent, tokens = self._annotations.get(key, (b"", array("I")))
            header = event.header
            if header is not None:  # what the client sent comes first, then what the block's header says
                tokens = tokens or header.token_ids
                parent = parent or parent_of(header.extra)
            model = "" if event.model == UNKNOWN else event.model
            stored = pb.BlockStored(block_hashes=[block], parent_block_hash=parent, token_ids=tokens,
                                    block_size=len(tokens), medium=event.tier, model=model, codec=event.codec,
                                    nbytes=event.nbytes)
            self._publish(tag, pb.KVEvent(stored=stored))
            return
        if event.kind == "removed" and getattr(self._local, "clearing", None) == tag:
            return
        removed = pb.BlockRemoved(block_hashes=[block], medium=event.tier, reason=REMOVAL_REASONS[event.kind])
        self._publish(tag, pb.KVEvent(removed=removed))

    def _publish(self, tag: bytes, event: pb.KVEvent) -> None:
        event.ts = time.time()
        with self._lock:
            if self._closed:
                return
            seq = event.seq = self.next_seq
            payload = event.SerializeToString()
            try:
                self.log.append(seq, tag, payload)
            except OSError as exc:  # a full or broken disk: live subscribers still get it; replay will not
                if not self._log_failed:
                    log.error("event log write failed (later events are not kept for replay until it works): %s",
                              exc)
                    self._log_failed = True
            else:
                self._log_failed = False
            self.next_seq = seq + 1
            subs = self._subs.get(tag, ()) if tag != BROADCAST else [s for g in self._subs.values() for s in g]
            overflowed = [sub for sub in subs if sub.offer(seq, payload)]
            self.ended_slow += len(overflowed)
        for sub in overflowed:  # its handler may be blocked sending to the client: end the call from here
            end_call(sub.context, grpc.StatusCode.RESOURCE_EXHAUSTED, sub.overflow_message())

    # -- subscribing ----------------------------------------------------------------------------------

    def subscribe(self, namespace: str, from_seq: int, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The serialized ``SubscribeEventsResponse`` messages of one subscription (see the module doc)."""
        tag = scope_tag(namespace)
        sub = _Subscriber(namespace, tag, context, self.queue_events)
        with self._lock:
            total = sum(self._count.values())
            held = self._count.get(namespace, 0)
            if self._closed:
                fail(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            if held >= self.tenant_subscriptions or total >= self.max_subscriptions:
                self.refused += 1
                raise StreamRefusedError(
                    f"namespace {namespace!r} already has {held} event subscriptions (cap "
                    f"{self.tenant_subscriptions}, --tenant-subscriptions)" if held >= self.tenant_subscriptions else
                    f"all {self.max_subscriptions} event subscriptions of the server are taken (--max-subscriptions)",
                    retry=False)
            self._count[namespace] = held + 1
            self._subs.setdefault(tag, []).append(sub)
            stop = self.next_seq
            oldest = self.log.oldest_seq(stop)
        try:
            context.add_callback(lambda: sub.end("cancelled"))
            yield pb.SubscribeEventsResponse(
                started=pb.SubscriptionStarted(namespace=namespace, next_seq=stop, oldest_seq=oldest),
                next_seq=from_seq if 0 < from_seq <= stop else stop).SerializeToString()
            if from_seq > stop:  # the events [stop, from_seq) the client counts on are not this server's
                yield _lost_message(Lost(stop, from_seq, f"from_seq {from_seq} is past this server's last event "
                                                         f"{stop - 1}: its event log was reset or lost its tail; "
                                                         f"resync, then resume from {stop}"),
                                    stop)
            elif from_seq:
                yield from self._replay(from_seq, stop, tag, oldest)
            sub.sent_seq = stop
            yield from self._live(sub)
        finally:
            sub.end("cancelled")
            with self._lock:
                subs = self._subs.get(tag, [])
                if sub in subs:
                    subs.remove(sub)
                if not subs:
                    self._subs.pop(tag, None)
                left = self._count.get(namespace, 1) - 1
                if left > 0:
                    self._count[namespace] = left
                else:
                    self._count.pop(namespace, None)

    def _replay(self, from_seq: int, stop: int, tag: bytes, oldest: int) -> Iterator[bytes]:
        batch: list[bytes] = []
        size = 0
        if from_seq < oldest:
            yield _lost_message(Lost(from_seq, oldest, "older than the event log keeps (--events-log)"), oldest)
            from_seq = oldest
        for item in self.log.read(from_seq, stop, tag):
            if isinstance(item, Lost):
                if batch:
                    yield _events_message(batch, item.from_seq)
                    batch, size = [], 0
                yield _lost_message(item, item.to_seq)
                continue
            batch.append(item[2])
            size += len(item[2])
            if len(batch) >= MESSAGE_EVENTS or size >= MESSAGE_BYTES:
                yield _events_message(batch, item[0] + 1)
                batch, size = [], 0
        if batch:
            yield _events_message(batch, stop)

    def _live(self, sub: _Subscriber) -> Iterator[bytes]:
        while True:
            with sub.cond:
                if not sub.queue and not sub.ended and not sub.overflowed:
                    sub.cond.wait(self.heartbeat_s)
                if sub.overflowed:
                    fail(grpc.StatusCode.RESOURCE_EXHAUSTED, sub.overflow_message())
                if sub.ended == "shutdown":
                    fail(grpc.StatusCode.UNAVAILABLE, f"the server is shutting down; reconnect with from_seq "
                                                      f"{sub.sent_seq} (or the next_seq of the last message read)")
                if sub.ended:
                    return
                batch: list[bytes] = []
                size, last = 0, 0
                while sub.queue and len(batch) < MESSAGE_EVENTS and size < MESSAGE_BYTES:
                    last, payload = sub.queue.popleft()
                    batch.append(payload)
                    size += len(payload)
                sub.queued_bytes -= size
            if batch:
                sub.sent_seq = last + 1
                yield _events_message(batch, last + 1)
                continue
            with self._lock, sub.cond:  # a heartbeat: nothing of the namespace is waiting below the hub's next seq
                if sub.queue:
                    continue
                sub.sent_seq = self.next_seq
            yield pb.SubscribeEventsResponse(next_seq=sub.sent_seq).SerializeToString()

    def subscriptions(self, namespace: str | None = None) -> int:
        with self._lock:
            return sum(self._count.values()) if namespace is None else self._count.get(namespace, 0)

    def stats(self, namespace: str) -> dict[str, Any]:
        """The ``events`` part of a namespace's Stats: sequences, its subscriptions and the server's cut-offs."""
        with self._lock:
            next_seq = self.next_seq
            return {"next_seq": next_seq, "oldest_seq": self.log.oldest_seq(next_seq),
                    "persistent": self.log.persistent, "subscriptions": self._count.get(namespace, 0),
                    "cap": self.tenant_subscriptions, "server_subscriptions": sum(self._count.values()),
                    "server_max_subscriptions": self.max_subscriptions, "server_refused": self.refused,
                    "server_ended_slow": self.ended_slow, "log_failing": self._log_failed}

    def end_subscriptions(self) -> None:
        """End every subscription (UNAVAILABLE: the server is stopping); events are still logged until ``close``."""
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            sub.end("shutdown")

    def close(self) -> None:
        """Stop listening to the store and close the log."""
        self.end_subscriptions()
        with self._lock:
            self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self.log.close()


def _events_message(payloads: list[bytes], next_seq: int) -> bytes:
    """A serialized ``SubscribeEventsResponse`` of already serialized ``KVEvent``s (no re-parsing)."""
    parts = [b"\x0a" + varint(len(p)) + p for p in payloads]  # field 1 (events), length-delimited
    parts.append(b"\x10" + varint(next_seq))  # field 2 (next_seq), varint
    return b"".join(parts)


def _lost_message(lost: Lost, next_seq: int) -> bytes:
    return pb.SubscribeEventsResponse(
        lost=pb.EventsLost(from_seq=lost.from_seq, to_seq=lost.to_seq, reason=lost.reason),
        next_seq=next_seq).SerializeToString()
