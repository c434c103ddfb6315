"""Redis keeps its own ``maxmemory`` policy: kvshelf never evicts from Redis, and the Redis tier's
usage counters, the per-namespace usage and quota of the gRPC service, and ``stats`` stay right while Redis evicts
(``allkeys-lru``) or refuses writes (``noeviction``). Real ``redis-server`` processes (standalone with
``--maxmemory 4mb``, and a local 3-node Cluster with a memory limit per node) and a real gRPC server on loopback.

"What Redis really holds" is read behind the tier's back with a raw client: every manifest of the tier's prefix
(on every primary), its header, and, for a chunked value, whether all of its chunks exist."""

from __future__ import annotations

import os
import struct
from typing import Any

import grpc
import pytest
import redis
import redis_servers
from helpers import assert_same_block, key_of, make_block
from redis_servers import MAXMEMORY_BYTES

from kvshelf.kvstore import MemoryTier, RedisTier, TieredStore, TierUsage
from kvshelf.service.auth import scope_tag
from kvshelf.service.client import RemoteStore
from kvshelf.service.server import ServerLimits, start_server

maxmemory_redis = redis_servers.maxmemory_redis
restartable_redis = redis_servers.restartable_redis
restartable_cluster = redis_servers.restartable_cluster

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB
#: the manifest header of the tier's layout: magic, kind (0 inline, 1 chunked), generation, chunk count, total
HEADER = struct.Struct("<4sB8sIQ")


@pytest.fixture
def prefix() -> str:
    return f"m{os.urandom(6).hex()}:"


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def node_clients(servers: Any) -> list[redis.Redis]:
    """A plain client on each primary (a standalone server: itself)."""
    return [node.client() for node in getattr(servers, "nodes", [servers])]


def held_in_redis(servers: Any, prefix: str) -> dict[bytes, int]:
    """``key -> size`` of every value of ``prefix`` that Redis really holds whole: a manifest of ours and, for a
    chunked value, every chunk of its generation."""
    out: dict[bytes, int] = {}
    start = 1 + len(prefix)
    for client in node_clients(servers):
        with client:
            for name in client.scan_iter(match="{" + prefix + "*}:m", count=1000):
                raw = client.getrange(name, 0, HEADER.size - 1)
                if len(raw) < HEADER.size:
                    continue  # evicted since the SCAN saw it
                magic, kind, generation, chunks, total = HEADER.unpack(raw)
                assert magic == b"kvR1"
                tag = name[:-2].decode()
                if kind == 1 and client.exists(*(f"{tag}:{generation.hex()}:{i}" for i in range(chunks))) != chunks:
                    continue  # a chunk is gone: the value reads as a miss
                out[bytes.fromhex(name[start:-3].decode())] = total
    return out


def set_memory(servers: Any, limit: int | None, policy: str = "allkeys-lru") -> None:
    """Every primary's ``maxmemory``: ``limit`` bytes above what it uses now (``None``: unlimited)."""
    for client in node_clients(servers):
        with client:
            client.config_set("maxmemory-policy", policy)
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", 0 if limit is None else used + limit)


def evicted_keys(servers: Any) -> int:
    total = 0
    for client in node_clients(servers):
        with client:
            total += int(client.info("stats")["evicted_keys"])
    return total


def fill(tier: RedisTier, count: int) -> dict[bytes, bytes]:
    """Put ``count`` values, a third of them chunked (3 chunks and a bit), the rest inline, 8 per call."""
    items = {k(i): os.urandom(3 * CHUNK + 13 * i if i % 3 == 0 else 20 * KiB + 97 * i) for i in range(count)}
    pairs = list(items.items())
    for start in range(0, len(pairs), 8):
        tier.put_many(pairs[start:start + 8])
    return items


# ------------------------------------------------------------------------------------------------------------
# the tier's own counters
# ------------------------------------------------------------------------------------------------------------


def use_policy(servers: Any, policy: str) -> None:
    for client in node_clients(servers):
        with client:
            client.config_set("maxmemory-policy", policy)


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu"])
@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_usage_matches_what_redis_holds_after_its_evictions(request: pytest.FixtureRequest, kind: str, policy: str,
                                                            prefix: str) -> None:
    """Under allkeys-lru the test's burst of writes (every key younger than Redis's one-second LRU clock) also
    evicts the counters' hash now and then: usage() then rebuilds it, and is still exact."""
    servers = request.getfixturevalue("maxmemory_redis" if kind == "standalone" else "restartable_cluster")
    if kind == "cluster":
        set_memory(servers, 3 * MiB)
    use_policy(servers, policy)
    tier = RedisTier.from_url(servers.url, prefix=prefix, chunk_bytes=CHUNK)
    items = fill(tier, 150)  # ~12 MiB into ~3 MiB (per node)
    assert evicted_keys(servers) > 0
    set_memory(servers, None)  # no more evictions from here: what Redis holds now is what usage() must say
    held = held_in_redis(servers, prefix)
    assert 0 < len(held) < len(items)
    assert all(size == len(items[key]) for key, size in held.items())
    assert tier.usage() == TierUsage(blocks=len(held), bytes=sum(held.values()), capacity_bytes=None)
    # the values Redis kept read back whole; the others are misses
    got = tier.get_many(list(items))
    assert {key for key, value in zip(items, got, strict=True) if value is not None} == set(held)
    assert all(value is None or value == items[key] for key, value in zip(items, got, strict=True))
    # deleting everything brings the counters to zero (an evicted value is not counted out twice)
    assert tier.delete(list(items)) == len(held)
    assert tier.usage() == TierUsage(blocks=0, bytes=0, capacity_bytes=None)
    assert held_in_redis(servers, prefix) == {}


def test_counters_of_two_tiers_on_one_redis_both_stay_right(maxmemory_redis: Any, prefix: str) -> None:
    """Two processes' tiers share one Redis and one set of counters: each sees the same right figures, and an
    eviction found by both is counted out once."""
    first = RedisTier.from_url(maxmemory_redis.url, prefix=prefix, chunk_bytes=CHUNK)
    second = RedisTier.from_url(maxmemory_redis.url, prefix=prefix, chunk_bytes=CHUNK)
    fill(first, 90)
    set_memory(maxmemory_redis, None)
    held = held_in_redis(maxmemory_redis, prefix)
    expected = TierUsage(blocks=len(held), bytes=sum(held.values()), capacity_bytes=None)
    assert second.usage() == expected
    assert first.usage() == expected
    assert first.reconcile() == 0 and second.usage() == expected  # nothing left to find


def test_partly_evicted_chunked_values_are_counted_misses(maxmemory_redis: Any, prefix: str) -> None:
    """Large chunked values under maxmemory: every read is the right block or a counted miss, never a wrong block,
    a corrupt count or an exception; a value whose chunks are partly gone is removed and counted out."""
    tier = RedisTier.from_url(maxmemory_redis.url, prefix=prefix, chunk_bytes=CHUNK)
    blocks = [make_block(96 + i, layers=2, heads=2, head_dim=64) for i in range(32)]  # ~200 KiB: 4 chunks each
    keys = [key_of(block) for block in blocks]
    filled, damaged = range(30), (30, 31)
    with TieredStore([tier]) as store:
        # 30 values into 4 MiB: Redis's sampled LRU evicts manifests and chunks as it likes
        for start in range(0, len(filled), 3):
            store.put_many([(keys[i], blocks[i]) for i in filled[start:start + 3]])
        # Redis evicts no more; two more values are written whole, then damaged as Redis's sampled LRU may leave a
        # value: one with its manifest gone (its chunks stay behind), one whose manifest stayed while a chunk went
        set_memory(maxmemory_redis, None)
        store.put_many([(keys[i], blocks[i]) for i in damaged])
        assert tier.prefix_run_length([keys[i] for i in damaged]) == len(damaged)
        raw = maxmemory_redis.client()
        for i, drop in zip(damaged, ("manifest", "chunk"), strict=True):
            tag = f"{{{prefix}{keys[i].hex()}}}"
            names = sorted(n for n in raw.scan_iter(match=tag.replace("{", "\\{").replace("}", "\\}") + ":*"))
            manifest = f"{tag}:m".encode()
            chunks = [n for n in names if n != manifest]
            assert len(chunks) >= 2
            raw.delete(manifest if drop == "manifest" else chunks[1])
        held = held_in_redis(maxmemory_redis, prefix)
        assert not {keys[i] for i in damaged} & held.keys()
        assert len(held) < len(filled)  # ~6 MiB went into 4 MiB: Redis evicted some
        for i, block in enumerate(blocks):
            out = store.get_many([keys[i]], fingerprint=block.fingerprint)[0]
            if keys[i] in held:
                assert_same_block(out, block)
            else:
                assert out is None
        redis_stats = store.stats()["tiers"][0]
        assert redis_stats["hits"] == len(held) and redis_stats["misses"] == len(blocks) - len(held)
        assert redis_stats["corrupt"] == 0
        assert store.stats()["tiers"][0]["blocks"] == len(held)
        assert tier.usage() == TierUsage(blocks=len(held), bytes=sum(held.values()), capacity_bytes=None)
        # no manifest of a value that is not whole is left behind (chunks whose manifest Redis evicted are left for
        # Redis to evict in turn: nothing reads them, so they are the idlest keys)
        manifests = [n for n in raw.scan_iter(match="*" + prefix + "*") if n.endswith(b":m")]
        assert len(manifests) == len(held)
        raw.close()


# ------------------------------------------------------------------------------------------------------------
# stats: capacity and Redis's evictions
# ------------------------------------------------------------------------------------------------------------


def test_stats_show_maxmemory_and_the_values_redis_evicted(maxmemory_redis: Any, prefix: str) -> None:
    """Every value Redis evicted is one eviction of the tier. allkeys-lfu (recommended): Redis keeps the counters'
    hash, which every write touches (under allkeys-lru a burst like this one may evict it too: the counters are then
    rebuilt exactly, but the values evicted meanwhile are not reported one by one)."""
    use_policy(maxmemory_redis, "allkeys-lfu")
    tier = RedisTier.from_url(maxmemory_redis.url, prefix=prefix, chunk_bytes=CHUNK)
    with TieredStore([MemoryTier(1 * MiB), tier]) as store:
        assert store.stats()["tiers"][1]["capacity_bytes"] == MAXMEMORY_BYTES
        assert store.stats()["tiers"][1]["evictions"] == 0
        blocks = [make_block(40 + i, layers=2, heads=2, head_dim=64) for i in range(60)]  # ~80 KiB each
        for block in blocks:
            store.put_many([(key_of(block), block)])
        set_memory(maxmemory_redis, 64 * MiB)
        held = held_in_redis(maxmemory_redis, prefix)
        redis_stats = store.stats()["tiers"][1]
        assert redis_stats["capacity_bytes"] is not None and redis_stats["capacity_bytes"] > MAXMEMORY_BYTES
        assert redis_stats["blocks"] == len(held) and redis_stats["bytes"] == sum(held.values())
        # every value of this tier that Redis evicted is one eviction of the tier (the memory tier's are its own)
        assert redis_stats["evictions"] == len(blocks) - len(held) > 0
        assert tier.usage().capacity_bytes == redis_stats["capacity_bytes"]


def test_cluster_capacity_is_the_sum_of_primaries_or_none(restartable_cluster: Any, prefix: str) -> None:
    tier = RedisTier.from_url(restartable_cluster.url, prefix=prefix, chunk_bytes=CHUNK)
    clients = node_clients(restartable_cluster)
    try:
        for client in clients:
            client.config_set("maxmemory", 64 * MiB)
        assert tier.usage().capacity_bytes == 3 * 64 * MiB
        clients[1].config_set("maxmemory", 0)  # one primary unlimited: so is the whole
        assert tier.usage().capacity_bytes is None
    finally:
        for client in clients:
            client.close()


def test_usage_without_permission_for_info(restartable_redis: Any, prefix: str) -> None:
    """A managed Redis may refuse INFO (and CONFIG): usage() still answers, capacity unknown (None)."""
    with restartable_redis.client() as admin:
        admin.execute_command("ACL", "SETUSER", "kv", "on", ">secret", "~*", "&*", "+@all", "-info", "-config")
        admin.config_set("maxmemory", 64 * MiB)
    url = f"redis://kv:secret@127.0.0.1:{restartable_redis.port}/0"
    tier = RedisTier.from_url(url, prefix=prefix, chunk_bytes=CHUNK)
    tier.put_many([(k(1), b"x" * 100), (k(2), os.urandom(2 * CHUNK + 1))])
    assert tier.usage() == TierUsage(blocks=2, bytes=100 + 2 * CHUNK + 1, capacity_bytes=None)
    assert tier.reconcile() == 0


# ------------------------------------------------------------------------------------------------------------
# through the gRPC service: per-namespace usage, quota, and a Redis that refuses writes
# ------------------------------------------------------------------------------------------------------------


def _redis_row(stats: dict[str, Any]) -> dict[str, Any]:
    return next(t for t in stats["tiers"] if t["name"] == "redis")


def test_service_namespace_usage_and_quota_follow_redis_evictions(maxmemory_redis: Any, prefix: str) -> None:
    """The quota counts what Redis holds: with Redis capped at 4 MiB, 8 MiB of puts never exceed a 6 MiB quota
    (the old code counted every value Redis evicted and refused puts once 6 MiB had been written). allkeys-lfu, the
    recommended policy (see the stats test)."""
    use_policy(maxmemory_redis, "allkeys-lfu")
    tier = RedisTier.from_url(maxmemory_redis.url, prefix=prefix, chunk_bytes=CHUNK, reconcile_interval_s=0)
    store = TieredStore([MemoryTier(1 * MiB), tier])
    running = start_server(store, limits=ServerLimits(max_block_bytes=4 * MiB, quota_bytes=6 * MiB))
    blocks = [make_block(48 + i, layers=2, heads=2, head_dim=64) for i in range(80)]  # ~100 KiB each, ~8 MiB
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", timeout_s=60) as remote:
            for block in blocks:
                assert remote.put_many([(key_of(block), block)]) == 1
            set_memory(maxmemory_redis, 64 * MiB)
            held = held_in_redis(maxmemory_redis, prefix)
            assert 0 < len(held) < len(blocks)
            tag = scope_tag("default")
            assert all(key.startswith(tag) for key in held)
            stats = remote.stats()
            row = _redis_row(stats)
            assert (row["blocks"], row["bytes"]) == (len(held), sum(held.values()))
            # the admin view (the whole store, as `kvshelf stats` shows it): the tier's figures and Redis's evictions
            # of its values (the tier cannot tell their namespace: they count under "unknown", not in `row`)
            whole = _redis_row(stats["store"])
            assert (whole["blocks"], whole["bytes"], whole["capacity_bytes"]) == (len(held), sum(held.values()),
                                                                                  tier.usage().capacity_bytes)
            assert whole["evictions"] == len(blocks) - len(held)
            assert stats["usage"]["bytes"] <= 6 * MiB
            # Clear removes what is left; the counters end at zero
            remote.clear()
            assert tier.usage().blocks == 0 and tier.usage().bytes == 0
            assert (_redis_row(remote.stats())["blocks"], _redis_row(remote.stats())["bytes"]) == (0, 0)
    finally:
        running.stop(0)
        store.close()


def test_service_put_into_a_full_noeviction_redis_is_not_an_error(maxmemory_redis: Any, prefix: str) -> None:
    """``noeviction``: Redis refuses writes once full (OOM). A put still succeeds (the memory tier holds it),
    the refusals are counted (``rejected``), deletes work, and the counters match what Redis holds."""
    set_memory(maxmemory_redis, 2 * MiB, "noeviction")
    tier = RedisTier.from_url(maxmemory_redis.url, prefix=prefix, chunk_bytes=CHUNK)
    store = TieredStore([MemoryTier(64 * MiB), tier])
    running = start_server(store, limits=ServerLimits(max_block_bytes=4 * MiB))
    blocks = [make_block(48 + i, layers=2, heads=2, head_dim=64) for i in range(40)]  # ~4 MiB into ~2 MiB
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", timeout_s=60) as remote:
            for block in blocks:
                assert remote.put_many([(key_of(block), block)]) == 1
            row = _redis_row(remote.stats())
            held = held_in_redis(maxmemory_redis, prefix)
            assert 0 < len(held) < len(blocks)
            assert row["rejected"] == len(blocks) - len(held)
            assert tier.usage() == TierUsage(blocks=len(held), bytes=sum(held.values()),
                                             capacity_bytes=tier.usage().capacity_bytes)
            for block in blocks:
                assert_same_block(remote.get_many([key_of(block)], fingerprint=block.fingerprint)[0], block)
            assert remote.delete([key_of(block) for block in blocks]) == len(blocks)
            assert held_in_redis(maxmemory_redis, prefix) == {}
            assert tier.usage().blocks == 0 and tier.usage().bytes == 0
    except grpc.RpcError as exc:  # pragma: no cover - the failure this test is about, shown readably
        pytest.fail(f"the service answered {exc.code()}: {exc.details()}")
    finally:
        running.stop(0)
        store.close()


# ------------------------------------------------------------------------------------------------------------
# the registry's own troubles: lost, leftovers of writers that died, Redis above another tier
# ------------------------------------------------------------------------------------------------------------


def test_counters_hash_evicted_is_rebuilt_exactly(restartable_redis: Any, prefix: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Redis may evict the counters' hash itself (it is a key like any other): the next write starts a new one
    marked stale, a removal it does not know counts nothing there, and the next usage() recounts exactly."""
    tier = RedisTier.from_url(restartable_redis.url, prefix=prefix, chunk_bytes=CHUNK)
    tier.put_many([(k(i), os.urandom(2 * CHUNK + i) if i % 2 else b"v" * (100 + i)) for i in range(6)])
    assert tier.usage().blocks == 6
    with restartable_redis.client() as raw:
        raw.delete(f"{{{prefix}#usage}}")  # as Redis's eviction does
        tier.put_many([(k(10), b"w" * 50)])
        assert tier.delete([k(0), k(1)]) == 2
        expected = TierUsage(blocks=5, bytes=sum(held_in_redis(restartable_redis, prefix).values()),
                             capacity_bytes=None)
        assert tier.usage() == expected
        assert raw.hget(f"{{{prefix}#usage}}", "stale") is None
        raw.delete(f"{{{prefix}#usage}}")
        with caplog.at_level("WARNING"):
            assert tier.usage() == expected  # found gone by usage() itself: rebuilt, with a warning
        assert "gone (evicted by Redis?)" in caplog.text


def test_leftovers_of_a_dead_writer_settle(restartable_redis: Any, prefix: str) -> None:
    """A ``-`` entry whose ``+`` never came (its writer died between its SET and its accounting) and an ``x`` entry
    whose ``-`` never came are settled once older than SETTLE_S; a planted field that is no entry counts nothing."""
    tier = RedisTier.from_url(restartable_redis.url, prefix=prefix, chunk_bytes=CHUNK)
    tier.put_many([(k(1), b"a" * 100), (k(2), os.urandom(3 * CHUNK))])
    expected = TierUsage(blocks=2, bytes=100 + 3 * CHUNK, capacity_bytes=None)
    usage_key = f"{{{prefix}#usage}}"
    with restartable_redis.client() as raw:
        raw.hset(usage_key, mapping={f"e:{k(7).hex()}:{'ab' * 8}": "-:500:0:0",  # time 0: long ago
                                     f"e:{k(8).hex()}:{'cd' * 8}": "x:70:0:0",
                                     f"e:{k(9).hex()}:{'ef' * 8}": "garbage"})
        raw.hincrby(usage_key, "blocks", -1)
        raw.hincrby(usage_key, "bytes", -500)
        assert tier.reconcile() == 0
        assert tier.usage() == expected
        entries = sorted(f.split(b":")[1] for f in raw.hkeys(usage_key) if f.startswith(b"e:"))
        assert entries == [k(1).hex().encode(), k(2).hex().encode()]  # the two values; the rest settled


def test_redis_above_another_tier_writes_nothing_down_for_its_evictions(maxmemory_redis: Any, prefix: str) -> None:
    """Write-back with Redis first: a value Redis evicted is gone (reported with an empty value), so nothing is
    written down for it; the tier below only ever holds whole blocks."""
    use_policy(maxmemory_redis, "allkeys-lfu")
    tier = RedisTier.from_url(maxmemory_redis.url, prefix=prefix, chunk_bytes=CHUNK, reconcile_interval_s=0)
    below = MemoryTier(64 * MiB)
    blocks = [make_block(40 + i, layers=2, heads=2, head_dim=64) for i in range(40)]
    with TieredStore([tier, below], write_policy="back") as store:
        for block in blocks:
            store.put_many([(key_of(block), block)])
        set_memory(maxmemory_redis, 64 * MiB)
        held = held_in_redis(maxmemory_redis, prefix)
        stats = store.stats()["tiers"]
        assert stats[0]["evictions"] == len(blocks) - len(held) > 0
        assert below.keys() == [] and stats[1]["blocks"] == 0
        for block in blocks:
            out = store.get_many([key_of(block)], fingerprint=block.fingerprint)[0]
            assert out is None or key_of(block) in held
