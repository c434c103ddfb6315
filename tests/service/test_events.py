"""KV events (``SubscribeEvents``, service/events.py) on a real server on loopback over real stores."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis_servers
from helpers import FINGERPRINT, key_of, make_block
from service_helpers import TOKENS, ServeProcess, put_with_lineage, write_tokens

from kvshelf.kvstore import MemoryTier, RedisTier, TieredStore, open_embedded_store
from kvshelf.kvstore.errors import ConfigError, TierUnavailableError
from kvshelf.kvstore.keys import PARENT_EXTRA
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.auth import TokenTable
from kvshelf.service.client import EventSubscription, RemoteStore, RemoteStoreError
from kvshelf.service.server import RunningServer, ServerLimits, start_server

TOKEN_A, TOKEN_B = list(TOKENS)
maxmemory_redis = redis_servers.maxmemory_redis  # a real redis-server of one test, --maxmemory 4mb allkeys-lru
WAIT_S = 30.0  # generous: only a broken server makes a reader wait this long


class Reader:
    """Reads a subscription in a thread: its messages and events, and how it ended."""

    def __init__(self, subscription: EventSubscription) -> None:
        self.subscription = subscription
        self.messages: queue.Queue[pb.SubscribeEventsResponse] = queue.Queue()
        self.events: list[pb.KVEvent] = []
        self.error: Exception | None = None
        self.done = threading.Event()
        self._changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for message in self.subscription:
                with self._changed:
                    self.events.extend(message.events)
                    self.messages.put(message)
                    self._changed.notify_all()
        except Exception as exc:  # noqa: BLE001 - kept for the test to assert on
            self.error = exc
        finally:
            self.done.set()
            with self._changed:
                self._changed.notify_all()

    def wait_for(self, predicate: Callable[[list[pb.KVEvent]], bool]) -> list[pb.KVEvent]:
        with self._changed:
            assert self._changed.wait_for(lambda: predicate(self.events) or self.done.is_set(), timeout=WAIT_S), \
                f"no such events after {WAIT_S} s; got {len(self.events)}"
            assert predicate(self.events), f"the stream ended ({self.error!r}) with {len(self.events)} events"
            return list(self.events)

    def started(self) -> pb.SubscribeEventsResponse:
        message = self.messages.get(timeout=WAIT_S)
        assert message.HasField("started")
        return message

    def stop(self) -> None:
        self.subscription.cancel()
        self.thread.join(WAIT_S)


def _kind(event: pb.KVEvent) -> tuple[str, str]:
    kind = event.WhichOneof("event")
    body = getattr(event, kind)
    return kind, body.medium


def _key(event: pb.KVEvent) -> bytes:
    kind = event.WhichOneof("event")
    return getattr(event, kind).block_hashes[0] if kind != "cleared" else b""


def _blocks(namespace: str, n: int, base: int = 0) -> list:
    return [make_block([base + i, 7, 7], namespace=namespace) for i in range(n)]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


def _serve(data_dir: Path, **limits: object) -> tuple[RunningServer, TieredStore]:
    store = open_embedded_store(data_dir)
    running = start_server(store, limits=ServerLimits(**limits), events_dir=data_dir / "events")
    return running, store


@pytest.fixture
def server(data_dir):
    running, store = _serve(data_dir)
    yield running
    running.stop(0)
    store.close()


def _remote(server: RunningServer, namespace: str, token: str | None = None) -> RemoteStore:
    return RemoteStore(f"127.0.0.1:{server.port}", namespace=namespace, token=token, shared_memory=False)


def _put_lineage(server: RunningServer, namespace: str, entries: list, lineage: list) -> int:
    return put_with_lineage(server.port, namespace, entries, lineage)


def test_subscriber_sees_its_namespace_in_order(server):
    a, b = _remote(server, "team-a"), _remote(server, "team-b")
    reader = Reader(a.subscribe_events())  # live events only
    started = reader.started()
    assert started.started.namespace == "team-a" and started.started.next_seq == 1
    blocks_a, blocks_b = _blocks("team-a", 3), _blocks("team-b", 2, base=100)
    keys_a = [key_of(x) for x in blocks_a]
    parent = key_of(make_block([9, 9], namespace="team-a"))
    assert _put_lineage(server, "team-a", [(keys_a[0], blocks_a[0])], [(parent, [11, 12, 13])]) == 1
    assert b.put_many([(key_of(x), x) for x in blocks_b]) == 2
    assert a.put_many([(k, x) for k, x in zip(keys_a[1:], blocks_a[1:], strict=True)]) == 2
    assert a.delete([keys_a[1]]) == 1
    b.delete([key_of(blocks_b[0])])
    assert a.clear() == 2
    events = reader.wait_for(lambda ev: any(e.HasField("cleared") for e in ev))
    reader.stop()

    # every event of team-a, in order, none of team-b's; each put stored in both tiers (memory, disk)
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs))
    expected = [(("stored", "memory"), keys_a[0]), (("stored", "disk"), keys_a[0])]
    expected += [(("stored", tier), key) for tier in ("memory", "disk") for key in keys_a[1:]]  # tier by tier
    expected += [(("removed", "memory"), keys_a[1]), (("removed", "disk"), keys_a[1]), (("cleared", ""), b"")]
    assert [(_kind(e), _key(e)) for e in events] == expected
    assert not {key_of(x) for x in blocks_b} & {_key(e) for e in events}

    first = events[0].stored
    assert first.parent_block_hash == parent and list(first.token_ids) == [11, 12, 13] and first.block_size == 3
    assert first.model == FINGERPRINT and first.codec == "raw" and first.nbytes > 0
    second = events[2].stored  # no lineage sent: no parent, the header's tokens
    assert second.parent_block_hash == b"" and list(second.token_ids) == [1, 7, 7]
    assert events[6].removed.reason == "deleted" and events[6].removed.block_hashes == [keys_a[1]]
    # team-b's events were sequenced too (one counter per server): team-a's seqs have gaps
    assert seqs[-1] - seqs[0] + 1 > len(seqs)
    a.close()
    b.close()


def test_a_parent_key_that_is_not_a_key_is_refused(server):
    block = make_block([3, 4])
    with pytest.raises(grpc.RpcError) as exc:
        _put_lineage(server, "default", [(key_of(block), block)], [(b"short", None)])
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parent_key" in exc.value.details()


def test_evictions_are_removals_per_tier(tmp_path):
    memory = MemoryTier(capacity_bytes=3000, policy="lru")
    store = TieredStore([memory])
    running = start_server(store)
    try:
        remote = _remote(running, "default")
        reader = Reader(remote.subscribe_events())
        reader.started()
        blocks = _blocks("default", 6)
        for block in blocks:
            remote.put_many([(key_of(block), block)])
        events = reader.wait_for(lambda ev: any(e.HasField("removed") for e in ev))
        evicted = [e.removed for e in events if e.HasField("removed")]
        assert evicted[0].reason == "evicted" and evicted[0].medium == memory.name
        assert evicted[0].block_hashes[0] == key_of(blocks[0])  # the oldest went first
        reader.stop()
        remote.close()
    finally:
        running.stop(0)


def test_redis_evictions_reach_the_router(maxmemory_redis):
    """Redis evicting on its own (maxmemory, allkeys-lru): every eviction the Redis tier finds (a read, the reconcile
    pass) is a BlockRemoved(medium=redis, evicted), and a router replaying the events never misses a block Redis
    holds. (Values whose usage-registry entry Redis evicted too are found only by a recount: until then a router
    believes them held, as the tier's own usage does.)"""
    tier = RedisTier.from_url(maxmemory_redis.url)
    store = TieredStore([tier])
    running = start_server(store)
    try:
        remote = _remote(running, "default")
        blocks = [make_block(64, start_pos=64 * i) for i in range(400)]  # ~16 KiB each: ~6 MiB into 4 MiB
        keys = [key_of(b) for b in blocks]
        for start in range(0, len(blocks), 20):
            remote.put_many(list(zip(keys[start : start + 20], blocks[start : start + 20], strict=True)))
        tier.reconcile()
        remote.get_encoded_many(keys)  # a read finds evicted values too
        held = {k for k, h in zip(keys, remote.held(keys), strict=True) if h}
        found_evicted = sum(t["evictions"] for t in store.stats()["tiers"] if t["name"] == tier.name)
        reader = Reader(remote.subscribe_events(1))
        next_seq = reader.started().started.next_seq
        events = reader.wait_for(lambda ev: bool(ev) and ev[-1].seq == next_seq - 1)
        reader.stop()
        remote.close()
    finally:
        running.stop(0)
        store.close()
    router: set[bytes] = set()
    removed = 0
    for event in events:
        if event.HasField("stored"):
            router.add(event.stored.block_hashes[0])
        else:
            assert (event.removed.medium, event.removed.reason) == (tier.name, "evicted")
            router.discard(event.removed.block_hashes[0])
            removed += 1
    assert 0 < len(held) < len(blocks)
    # how many the tier finds varies from run to run (Redis's sampled LRU also evicts the registry): all reach
    assert removed == found_evicted and held <= router


def test_tokens_bad_or_missing_is_unauthenticated(tmp_path):
    store = open_embedded_store(tmp_path / "data")
    running = start_server(store, tokens=TokenTable.from_file(write_tokens(tmp_path / "tokens.toml")))
    address = f"127.0.0.1:{running.port}"
    try:
        for token in (None, "not-a-token-of-anyone"):
            with RemoteStore(address, token=token, namespace="tenant-a", shared_memory=False) as remote:
                with pytest.raises(RemoteStoreError) as exc:
                    next(iter(remote.subscribe_events()))
                assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        with RemoteStore(address, token=TOKEN_A, namespace="tenant-b", shared_memory=False) as remote:
            with pytest.raises(RemoteStoreError) as exc:
                next(iter(remote.subscribe_events()))
            assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
        a = RemoteStore(address, token=TOKEN_A, namespace="tenant-a", shared_memory=False)
        b = RemoteStore(address, token=TOKEN_B, namespace="tenant-b", shared_memory=False)
        reader = Reader(a.subscribe_events())
        assert reader.started().started.namespace == "tenant-a"
        block_b, block_a = make_block([5], namespace="tenant-b"), make_block([6], namespace="tenant-a")
        b.put_many([(key_of(block_b), block_b)])
        a.put_many([(key_of(block_a), block_a)])
        events = reader.wait_for(lambda ev: len(ev) >= 2)
        assert {_key(e) for e in events} == {key_of(block_a)}
        reader.stop()
        a.close()
        b.close()
    finally:
        running.stop(0)
        store.close()


def test_replay_across_restart_has_no_gap_and_no_duplicate(data_dir):
    running, store = _serve(data_dir)
    remote = _remote(running, "default")
    reader = Reader(remote.subscribe_events())
    reader.started()
    blocks = _blocks("default", 6)
    remote.put_many([(key_of(x), x) for x in blocks[:2]])
    seen = reader.wait_for(lambda ev: len(ev) >= 4)
    reader.stop()
    last_seen = seen[-1].seq
    remote.put_many([(key_of(x), x) for x in blocks[2:4]])  # missed: nobody subscribed
    remote.delete([key_of(blocks[0])])
    # a subscriber still connected when the server stops is told to come back
    late = Reader(remote.subscribe_events(last_seen + 1))
    late.wait_for(lambda ev: len(ev) >= 6)
    running.stop(1)
    store.close()
    late.done.wait(WAIT_S)
    assert isinstance(late.error, TierUnavailableError) and "shutting down" in str(late.error)
    remote.close()

    running, store = _serve(data_dir)  # same data dir: a new process would do the same
    try:
        remote = _remote(running, "default")
        remote.put_many([(key_of(x), x) for x in blocks[4:5]])  # missed: after the restart, before reconnecting
        reader = Reader(remote.subscribe_events(last_seen + 1))
        started = reader.started()
        assert started.started.oldest_seq == 1
        remote.put_many([(key_of(x), x) for x in blocks[5:]])  # live, after reconnecting
        events = reader.wait_for(lambda ev: len(ev) >= 11)
        reader.stop()
        remote.close()
    finally:
        running.stop(0)
        store.close()
    seqs = [e.seq for e in events]
    assert seqs == list(range(last_seen + 1, last_seen + 1 + len(events)))  # exactly the missed ones, in order
    keys = [key_of(x) for x in blocks]
    assert [(_kind(e), _key(e)) for e in events] == [
        (("stored", "memory"), keys[2]), (("stored", "memory"), keys[3]),  # one put of two blocks: tier by tier
        (("stored", "disk"), keys[2]), (("stored", "disk"), keys[3]),
        (("removed", "memory"), keys[0]), (("removed", "disk"), keys[0]),
        (("cleared", "memory"), b""),  # the restart: what the memory tier held is gone
        (("stored", "memory"), keys[4]), (("stored", "disk"), keys[4]),
        (("stored", "memory"), keys[5]), (("stored", "disk"), keys[5]),
    ]
    assert len(events) == 11


def test_a_promotion_after_a_restart_names_tokens_and_parent(data_dir):
    """A read that promotes a block from disk to memory (the memory tier is empty after a restart) is a BlockStored in
    memory with the block's tokens and parent, from its header."""
    parent = key_of(make_block([1, 1]))
    block = make_block([5, 6, 7], extra={PARENT_EXTRA: parent.hex()})
    running, store = _serve(data_dir)
    with _remote(running, "default") as remote:
        remote.put_many([(key_of(block), block)])
    running.stop(0)
    store.close()
    running, store = _serve(data_dir)
    try:
        with _remote(running, "default") as remote:
            reader = Reader(remote.subscribe_events())
            reader.started()
            assert remote.get_many([key_of(block)], fingerprint=FINGERPRINT)[0] is not None
            (promoted,) = reader.wait_for(lambda ev: len(ev) >= 1)
            reader.stop()
    finally:
        running.stop(0)
        store.close()
    assert promoted.stored.medium == "memory" and promoted.stored.block_hashes == [key_of(block)]
    assert list(promoted.stored.token_ids) == [5, 6, 7] and promoted.stored.parent_block_hash == parent


def test_from_seq_older_than_the_log_keeps_says_lost(data_dir):
    running, store = _serve(data_dir, events_log_bytes=8192)
    try:
        remote = _remote(running, "default")
        blocks = _blocks("default", 40)
        for block in blocks:  # ~270 bytes per event with 64 tokens: the log rotates and drops old segments
            _put_lineage(running, "default", [(key_of(block), block)], [(None, list(range(64)))])
        reader = Reader(remote.subscribe_events(1))
        started = reader.started()
        oldest = started.started.oldest_seq
        assert 1 < oldest < started.started.next_seq
        lost = reader.messages.get(timeout=WAIT_S)
        assert lost.HasField("lost") and (lost.lost.from_seq, lost.lost.to_seq) == (1, oldest)
        assert "older than the event log keeps" in lost.lost.reason
        events = reader.wait_for(lambda ev: bool(ev) and ev[-1].seq == started.started.next_seq - 1)
        assert [e.seq for e in events] == list(range(oldest, started.started.next_seq))
        reader.stop()
        # a sequence past the log's end (a data dir reset under a router) is a loss too
        future = Reader(remote.subscribe_events(10_000))
        future.started()
        lost = future.messages.get(timeout=WAIT_S)
        assert lost.HasField("lost") and "past this server's last event" in lost.lost.reason
        next_seq = started.started.next_seq
        assert (lost.lost.from_seq, lost.lost.to_seq, lost.next_seq) == (next_seq, 10_000, next_seq)
        future.stop()
        # the largest from_seq a client can send: a sane range too (from <= to), never an inverted one
        farthest = Reader(remote.subscribe_events((1 << 64) - 1))
        farthest.started()
        lost = farthest.messages.get(timeout=WAIT_S)
        assert (lost.lost.from_seq, lost.lost.to_seq) == (next_seq, (1 << 64) - 1)
        farthest.stop()
        remote.close()
    finally:
        running.stop(0)
        store.close()
    segments = list((data_dir / "events").glob("*.events"))
    assert sum(p.stat().st_size for p in segments) <= 8192 + 8192  # the bound, plus the segment being written


def test_a_damaged_record_in_the_log_is_announced_as_lost(data_dir):
    running, store = _serve(data_dir, events_log_bytes=64 << 10)  # segments of 8 KiB
    try:
        remote = _remote(running, "default")
        for block in _blocks("default", 40):  # ~180 bytes per event: two segments
            _put_lineage(running, "default", [(key_of(block), block)], [(None, list(range(64)))])
        segments = sorted((data_dir / "events").glob("*.events"))
        assert len(segments) >= 2
        second = int(segments[1].stem)
        with open(segments[0], "r+b") as fh:  # one flipped byte in the middle of the first segment
            fh.seek(segments[0].stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0xFF]))
        reader = Reader(remote.subscribe_events(1))
        next_seq = reader.started().started.next_seq
        events = reader.wait_for(lambda ev: bool(ev) and ev[-1].seq == next_seq - 1)
        lost = [m.lost for m in list(reader.messages.queue) if m.HasField("lost")]
        reader.stop()
        remote.close()
    finally:
        running.stop(0)
        store.close()
    (gap,) = lost
    assert "damaged event log record" in gap.reason and gap.to_seq == second
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, gap.from_seq)) + list(range(second, next_seq))


def test_slow_subscriber_is_cut_off_without_blocking_puts():
    store = TieredStore([MemoryTier(capacity_bytes=1 << 30)])
    running = start_server(store, limits=ServerLimits(subscriber_queue=20))
    try:
        remote = _remote(running, "default")
        subscription = remote.subscribe_events()
        messages = iter(subscription)
        assert next(messages).HasField("started")  # ...and then it reads nothing for a while
        blocks = _blocks("default", 600)
        tokens = list(range(8000))  # ~16 KB per event, ~10 MB in all: more than HTTP/2 buffers for an unread stream
        for start in range(0, len(blocks), 50):
            batch = blocks[start : start + 50]
            assert _put_lineage(running, "default", [(key_of(x), x) for x in batch], [(None, tokens)] * 50) == 50
        seen: list[pb.KVEvent] = []
        with pytest.raises(RemoteStoreError) as exc:
            for message in messages:
                seen.extend(message.events)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "too slow" in str(exc.value)
        assert len(seen) < len(blocks)
        # it resumes where it stopped: every event exactly once
        reader = Reader(remote.subscribe_events(subscription.next_seq))
        rest = reader.wait_for(lambda ev: bool(ev) and ev[-1].seq == len(blocks))
        reader.stop()
        assert [e.seq for e in seen + rest] == list(range(1, len(blocks) + 1))
        events = remote.stats()["events"]
        assert events["server_ended_slow"] == 1 and events["next_seq"] == len(blocks) + 1
        remote.close()
    finally:
        running.stop(0)


def test_subscriptions_are_capped_per_tenant(server):
    limits = server.servicer.events
    a = _remote(server, "team-a")
    readers = [Reader(a.subscribe_events()) for _ in range(limits.tenant_subscriptions)]
    for reader in readers:
        reader.started()
    with pytest.raises(RemoteStoreError) as exc:
        next(iter(a.subscribe_events()))
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--tenant-subscriptions" in str(exc.value)
    other = Reader(_remote(server, "team-b").subscribe_events())  # another tenant still subscribes
    assert other.started().started.namespace == "team-b"
    a.put_many([(key_of(b), b) for b in _blocks("team-a", 1)])  # and puts still work
    for reader in [*readers, other]:
        reader.stop()
    a.close()


def test_a_server_that_cannot_listen_releases_its_event_log(server, data_dir):
    other = open_embedded_store(data_dir.parent / "other")
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            start_server(other, f"127.0.0.1:{server.port}", events_dir=data_dir.parent / "other-events")
        again = start_server(other, events_dir=data_dir.parent / "other-events")  # the log is free again
        again.stop(0)
    finally:
        other.close()


def test_one_server_per_event_log(server, data_dir):
    other = open_embedded_store(data_dir.parent / "other")
    try:
        with pytest.raises(ConfigError, match="in use by another kvshelf server"):
            start_server(other, events_dir=data_dir / "events")
    finally:
        other.close()


def test_damaged_log_tail_is_cut_off_at_start(data_dir):
    running, store = _serve(data_dir)
    remote = _remote(running, "default")
    blocks = _blocks("default", 3)
    remote.put_many([(key_of(x), x) for x in blocks[:2]])  # seqs 1-4
    remote.close()
    running.stop(0)
    store.close()
    (segment,) = (data_dir / "events").glob("*.events")
    size = segment.stat().st_size
    with open(segment, "r+b") as fh:  # a torn last record, as a crash mid-write leaves it
        fh.truncate(size - 5)
    running, store = _serve(data_dir)
    try:
        remote = _remote(running, "default")
        remote.put_many([(key_of(blocks[2]), blocks[2])])
        reader = Reader(remote.subscribe_events(1))
        started = reader.started()
        events = reader.wait_for(lambda ev: len(ev) >= 6)
        reader.stop()
        remote.close()
    finally:
        running.stop(0)
        store.close()
    # seq 4 (the torn record) is gone and reused; everything before it and after the restart is there, in order
    assert started.started.next_seq == 7
    assert [e.seq for e in events] == [1, 2, 3, 4, 5, 6]
    assert _kind(events[3]) == ("cleared", "memory")


def test_generate_adapter_blocks_name_their_parents(server):
    """A worker's ``CachedGenerator`` over ``RemoteStore``: each stored block's event names its chain parent and its
    tokens, as a router rebuilding vLLM-style prefix chains needs."""
    import torch

    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import tiny_llama
    from kvshelf.kvstore import prefix_block_spans

    remote = _remote(server, "default")
    reader = Reader(remote.subscribe_events())
    reader.started()
    gen = CachedGenerator(tiny_llama(seed=0), store=remote, block_size=16, write_behind=False)
    prompt = torch.randint(3, 500, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    gen.generate(prompt, max_new_tokens=2, eos_token_id=None)
    spans = prefix_block_spans(gen.fingerprint, "default", prompt, 16)
    events = reader.wait_for(lambda ev: len([e for e in ev if e.stored.medium == "disk"]) >= len(spans))
    reader.stop()
    remote.close()
    stored = [e.stored for e in events if e.stored.medium == "memory"][: len(spans)]
    assert [s.block_hashes[0] for s in stored] == [span.key for span in spans]
    assert [s.parent_block_hash for s in stored] == [b""] + [span.key for span in spans[:-1]]
    assert [list(s.token_ids) for s in stored] == [prompt[span.start : span.end] for span in spans]


def test_a_killed_server_loses_no_event(tmp_path):
    """`kvshelf serve` SIGKILLed right after acknowledged puts: every event is in the log after the restart (each is
    written to the page cache before the put returns), followed by the restart's memory-tier AllBlocksCleared."""
    args = ("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--memory", "64MiB")
    blocks = _blocks("default", 5)
    server = ServeProcess(*args)
    try:
        with RemoteStore(server.address, shared_memory=False) as remote:
            for block in blocks:
                assert remote.put_many([(key_of(block), block)]) == 1
    finally:
        server.stop()  # SIGKILL
    server = ServeProcess(*args)
    try:
        with RemoteStore(server.address, shared_memory=False) as remote:
            reader = Reader(remote.subscribe_events(1))
            assert reader.started().started.next_seq == 2 * len(blocks) + 2
            events = reader.wait_for(lambda ev: len(ev) >= 2 * len(blocks) + 1)
            reader.stop()
    finally:
        server.stop()
    assert [e.seq for e in events] == list(range(1, 2 * len(blocks) + 2))
    assert [(_kind(e), _key(e)) for e in events[:-1]] == [
        (("stored", tier), key_of(b)) for b in blocks for tier in ("memory", "disk")]
    assert _kind(events[-1]) == ("cleared", "memory")

