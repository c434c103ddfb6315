"""``Clear(namespace)`` on a large Redis: ``TieredStore.clear_prefix`` (what the server's ``Clear``
calls) removes exactly the namespace's values -- none of another namespace's, however many -- on a standalone Redis
and a local Redis Cluster, after Redis evicted some of the namespace's values on its own, with chunked values, and
without a round trip per key of the whole keyspace (the old ``Clear`` listed every value of every namespace and then
asked each tier about each key).

"What Redis holds" is read behind the tier's back with raw clients (every primary)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import redis
import redis_servers
from helpers import key_of, make_block
from service_helpers import kvshelf_cli

from kvshelf.kvstore import MemoryTier, RedisTier, TieredStore
from kvshelf.kvstore.redis_tier import CLEAR_SCAN_COUNT
from kvshelf.kvstore.stats import StoreEvent
from kvshelf.service.auth import scope_tag
from kvshelf.service.client import RemoteStore
from kvshelf.service.server import start_server

redis_server = redis_servers.redis_server
redis_cluster = redis_servers.redis_cluster
maxmemory_redis = redis_servers.maxmemory_redis

KiB, MiB = 1 << 10, 1 << 20
TAG, OTHER = b"\x01ns-gone", b"\x02ns-kept"  # two 8-byte namespace tags
SCOPED = 24  # tag + 16-byte key


def nodes(servers: Any) -> list[redis.Redis]:
    return [node.client() for node in getattr(servers, "nodes", [servers])]


def names_of(servers: Any, prefix: str, tag: bytes = b"") -> list[bytes]:
    """Every Redis key (manifests and chunks) of the tier's ``prefix`` whose hash tag starts with ``tag``."""
    out: list[bytes] = []
    for client in nodes(servers):
        with client:
            out += list(client.scan_iter(match="{" + prefix + tag.hex() + "*", count=1000))
    return out


def command_calls(servers: Any) -> dict[str, int]:
    """Redis's ``INFO commandstats`` calls per command, summed over primaries."""
    out: dict[str, int] = {}
    for client in nodes(servers):
        with client:
            for name, row in client.info("commandstats").items():
                out[name] = out.get(name, 0) + int(row["calls"])
    return out


def scan_bound(servers: Any) -> int:
    """The most SCAN calls one pass over every primary may take at the tier's COUNT hint (a hash table has at most
    twice as many buckets as keys)."""
    total = 0
    for client in nodes(servers):
        with client:
            total += 2 * int(client.dbsize()) // CLEAR_SCAN_COUNT + 2
    return total


def reset_stats(servers: Any) -> None:
    for client in nodes(servers):
        with client:
            client.config_resetstat()


def key(tag: bytes, i: int) -> bytes:
    return tag + i.to_bytes(16, "big")


@pytest.fixture
def prefix() -> str:
    return f"c{os.urandom(6).hex()}:"


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_clear_removes_exactly_the_namespace_and_scans_by_its_tag(request: pytest.FixtureRequest, kind: str,
                                                                  prefix: str) -> None:
    servers = request.getfixturevalue("redis_server" if kind == "standalone" else "redis_cluster")
    url = servers.url
    tier = RedisTier.from_url(url, prefix=prefix, chunk_bytes=1 * KiB, socket_timeout=10)
    store = TieredStore([MemoryTier(64 * MiB), tier])
    events: list[StoreEvent] = []
    store.subscribe(events.append)
    try:
        small, large = b"s" * 100, os.urandom(3 * KiB + 7)  # large: 4 chunks
        count = 6000 if kind == "standalone" else 2000  # a Cluster's cross-slot pipelines are slower to fill
        others = [(key(OTHER, i), small) for i in range(count)]
        # 16-byte keys that happen to start with the cleared tag: not scoped keys of its namespace
        lookalikes = [(TAG + b"\xff" * 4 + i.to_bytes(4, "big"), small) for i in range(20)]
        gone = [(key(TAG, i), large if i % 3 == 0 else small) for i in range(300)]
        for batch in range(0, len(others), 1000):
            assert tier.put_many(others[batch:batch + 1000]) == len(others[batch:batch + 1000])
        assert tier.put_many(lookalikes) == 20
        assert tier.put_many(gone) == 300
        for k_, v in gone[:50]:  # the memory tier holds some of them too
            store.specs[0].tier.put_many([(k_, v)])
        kept_names = sorted(names_of(servers, prefix, OTHER))
        assert sorted(tier.keys_with_prefix(OTHER, SCOPED)) == sorted(k_ for k_, _ in others)
        assert sorted(tier.keys_with_prefix(TAG, SCOPED)) == sorted(k_ for k_, _ in gone)
        tier.usage()  # the first look at a new tier's counters recounts: not part of the clear
        reset_stats(servers)

        assert store.clear_prefix(TAG, SCOPED) == 300

        # found by one SCAN pass matching the tag, no per-key header read of each value (the old Clear: a SCAN
        # returning all 6,320 values, then a GETRANGE of each of the namespace's)
        calls = command_calls(servers)
        assert calls.get("cmdstat_getrange", 0) == 0
        assert calls["cmdstat_scan"] <= scan_bound(servers)

        assert names_of(servers, prefix, TAG + b"\x00" * 8) == []  # nothing of the namespace: manifests, chunks
        assert tier.get_many([k_ for k_, _ in gone]) == [None] * 300
        assert sorted(names_of(servers, prefix, OTHER)) == kept_names
        assert tier.get_many([k_ for k_, _ in lookalikes]) == [small] * 20
        assert store.specs[0].tier.usage().blocks == 0
        usage = tier.usage()
        assert (usage.blocks, usage.bytes) == (count + 20, (count + 20) * len(small))
        removed = [e for e in events if e.kind == "removed"]
        assert sorted((e.tier, e.key) for e in removed) == sorted(
            [("redis", k_) for k_, _ in gone] + [("memory", k_) for k_, _ in gone[:50]])
    finally:
        store.close()


def test_clear_after_redis_evicted_some_of_the_namespace(maxmemory_redis: Any, prefix: str) -> None:
    """Redis (allkeys-lru, 4 MiB) evicted part of both namespaces, chunks of some values included: the clear still
    leaves nothing of the namespace in Redis, keeps every value of the other that Redis kept, and the usage
    counters end equal to what Redis holds."""
    tier = RedisTier.from_url(maxmemory_redis.url, prefix=prefix, chunk_bytes=16 * KiB, reconcile_interval_s=0)
    store = TieredStore([tier])
    try:
        values = [(key(TAG if i % 2 else OTHER, i), os.urandom(40 * KiB)) for i in range(200)]  # 8 MiB in 4
        for item in values:
            tier.put_many([item])
        with maxmemory_redis.client() as client:
            assert int(client.info("stats")["evicted_keys"]) > 0
            client.config_set("maxmemory", str(256 * MiB))  # no more evictions from here on
        present = [k_ for (k_, _), v in zip(values, tier.get_many([k_ for k_, _ in values]), strict=True)
                   if v is not None]
        assert any(k_.startswith(TAG) for k_ in present) and len(present) < len(values)
        kept = {k_ for k_ in present if k_.startswith(OTHER)}

        cleared = store.clear_prefix(TAG, SCOPED)

        assert cleared == len(present) - len(kept)
        assert names_of(maxmemory_redis, prefix, TAG) == []
        assert {k_ for (k_, _), v in zip(values, tier.get_many([k_ for k_, _ in values]), strict=True)
                if v is not None} == kept
        usage = tier.usage()
        assert (usage.blocks, usage.bytes) == (len(kept), 40 * KiB * len(kept))
    finally:
        store.close()


def test_server_clear_finds_the_namespace_by_its_tag_not_key_by_key(redis_server: Any, prefix: str) -> None:
    """The gRPC ``Clear`` over a Redis tier with 5,000 values of another namespace: exactly the namespace's blocks
    go (the count it answers, what Redis holds after), the other's stay, and Redis served it with a few SCANs and
    no per-key header reads (the old ``Clear`` listed all 5,040 values through a SCAN of the tier's prefix, then
    asked each tier about each of the namespace's keys: a GETRANGE each)."""
    tier = RedisTier.from_url(redis_server.url, prefix=prefix, socket_timeout=10)
    store = TieredStore([tier])
    running = start_server(store)
    try:
        other = scope_tag("b")
        for batch in range(0, 5000, 1000):
            assert tier.put_many([(key(other, i), b"v" * 64) for i in range(batch, batch + 1000)]) == 1000
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="a") as remote:
            blocks = [make_block(4, namespace="a", start_pos=4 * i) for i in range(40)]
            assert remote.put_many([(key_of(b), b) for b in blocks]) == 40
            tier.usage()  # the first look at a new tier's counters recounts: not part of the clear
            reset_stats(redis_server)
            assert remote.clear() == 40
            calls = command_calls(redis_server)
            assert calls.get("cmdstat_getrange", 0) == 0
            assert calls["cmdstat_scan"] <= scan_bound(redis_server)
            assert names_of(redis_server, prefix, scope_tag("a")) == []
            assert len(names_of(redis_server, prefix, other)) == 5000
            assert remote.get_many([key_of(b) for b in blocks], fingerprint=blocks[0].fingerprint) == [None] * 40
    finally:
        running.stop(0)
        store.close()


def test_bench_clear_command_writes_its_json(tmp_path: Path) -> None:
    """``kvshelf bench clear`` (small): both paths clear every key of the namespace and say what Redis did."""
    out = tmp_path / "clear.json"
    done = kvshelf_cli("bench", "clear", "--other", "2000", "--ns-keys", "50", "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert [row["path"] for row in result["rows"]] == ["old", "new"]
    for row in result["rows"]:
        assert row["keys_cleared"] == 50 and row["scan_calls"] >= 1 and row["keys_left"] == row["keys_in_redis"] - 50
    bad = kvshelf_cli("bench", "clear", "--paths", "fast")
    assert bad.returncode != 0 and "error: --paths takes old and/or new" in bad.stderr + bad.stdout
