"""What only the Redis tier does (chunk layout, slots, damage, sharing, outages, Redis's own memory limit) against a
real standalone ``redis-server`` and a real local 3-node Redis Cluster. What every tier does is
``test_tier_contract.py``."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import redis.cluster
import redis_servers
from helpers import assert_same_block, key_of, make_block, run_workers
from redis_servers import free_port

from kvshelf.kvstore import (
    ConfigError,
    MemoryTier,
    RedisTier,
    TieredStore,
    TierUnavailableError,
    TierUsage,
    encode_block,
)
from kvshelf.kvstore.block import KVBlock

# the real servers (session-scoped standalone and cluster; a per-test standalone that may be stopped)
redis_server = redis_servers.redis_server
redis_cluster = redis_servers.redis_cluster
restartable_redis = redis_servers.restartable_redis
restartable_cluster = redis_servers.restartable_cluster
tls_files = redis_servers.tls_files
tls_redis_server = redis_servers.tls_redis_server

KiB = 1 << 10
CHUNK = 64 * KiB


@dataclass
class Backend:
    """One Redis deployment under test: its URL and a raw redis-py client to look behind the tier's back."""

    kind: str
    url: str
    raw: Any  # redis.Redis | redis.cluster.RedisCluster

    def tier(self, prefix: str, **kwargs: Any) -> RedisTier:
        return RedisTier.from_url(self.url, prefix=prefix, chunk_bytes=kwargs.pop("chunk_bytes", CHUNK), **kwargs)

    def raw_keys(self, prefix: str) -> list[bytes]:
        pattern = "*" + prefix + "*"
        if self.kind == "cluster":
            return list(self.raw.scan_iter(match=pattern, target_nodes=redis.cluster.RedisCluster.PRIMARIES))
        return list(self.raw.scan_iter(match=pattern))


@pytest.fixture(params=["standalone", "cluster"])
def backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "standalone":
        server = request.getfixturevalue("redis_server")
        raw = server.client()
        url = server.url
    else:
        cluster = request.getfixturevalue("redis_cluster")
        raw = cluster.client()
        url = cluster.url
    yield Backend(request.param, url, raw)
    raw.close()


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test alone: tests share the session's servers without seeing each other."""
    return f"t{os.urandom(6).hex()}:"


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def v(i: int, size: int) -> bytes:
    return bytes([i % 251]) * size if size < 1000 else os.urandom(size)


def big_block(tokens: int = 128, namespace: str = "default") -> KVBlock:
    """A block whose encoded value (~260 KiB) spans several 64 KiB chunks."""
    return make_block(tokens, layers=2, heads=2, head_dim=64, namespace=namespace)


# ------------------------------------------------------------------------------------------------------------
# the tier on its own
# ------------------------------------------------------------------------------------------------------------


def test_overwrite_replaces_value_and_drops_old_chunks(backend: Backend, prefix: str) -> None:
    tier = backend.tier(prefix)
    tier.put_many([(k(1), v(1, 6 * CHUNK))])
    first_keys = len(backend.raw_keys(prefix))
    assert first_keys >= 7  # manifest + 6 chunks (+ the usage hash)
    tier.put_many([(k(1), v(2, 3 * CHUNK))])
    assert tier.get_many([k(1)])[0] is not None and len(tier.get_many([k(1)])[0]) == 3 * CHUNK
    second = v(3, 10)
    tier.put_many([(k(1), second)])  # chunked -> inline
    assert tier.get_many([k(1)]) == [second]
    names = backend.raw_keys(prefix)
    assert len(names) == 2, names  # the manifest and the usage hash: no chunk of an old generation is left
    assert tier.usage().blocks == 1 and tier.usage().bytes == 10


def test_delete_leaves_no_chunk_behind(backend: Backend, prefix: str) -> None:
    tier = backend.tier(prefix)
    tier.put_many([(k(i), v(i, 4 * CHUNK if i == 1 else 30)) for i in range(3)])
    assert tier.delete([k(0), k(1), k(9)]) == 2
    assert len(backend.raw_keys(prefix)) == 2  # k(2)'s manifest and the usage hash: no chunk left behind


def test_racing_puts_and_deletes_leave_no_orphan_chunks(backend: Backend, prefix: str) -> None:
    """A delete racing a put of the same key removes one whole value: no chunk of the other is left behind."""
    tier = backend.tier(prefix)
    values = {i: os.urandom(3 * CHUNK) for i in range(4)}  # a manifest and three chunks each

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(80):
            i = rng.randrange(4)
            if rng.random() < 0.5:
                tier.put_many([(k(i), values[i])])
            else:
                tier.delete([k(i)])

    run_workers(worker, 4)
    held = tier.keys()
    assert len(backend.raw_keys(prefix)) == 4 * len(held) + 1  # their manifests and chunks, and the usage hash
    assert tier.usage() == TierUsage(blocks=len(held), bytes=3 * CHUNK * len(held), capacity_bytes=None)


def test_prefixes_separate_tiers_and_recount(backend: Backend, prefix: str) -> None:
    tier = backend.tier(prefix)
    assert tier.usage().capacity_bytes is None  # no maxmemory on the test servers
    sizes = {k(i): 100 + 37 * i + (3 * CHUNK if i % 3 == 0 else 0) for i in range(10)}
    tier.put_many([(key, v(1, size)) for key, size in sizes.items()])
    tier.delete([k(1), k(2)])
    expected = sum(sizes.values()) - sizes[k(1)] - sizes[k(2)]
    assert tier.usage() == TierUsage(blocks=8, bytes=expected, capacity_bytes=None)
    # another tier on the same Redis with another prefix sees none of it
    other = backend.tier(prefix + "other:")
    assert other.keys() == [] and other.usage().blocks == 0
    # recount rebuilds the counters from what Redis holds (here: the same figures)
    assert tier.recount() == TierUsage(blocks=8, bytes=expected, capacity_bytes=None)


def test_values_spread_over_slots_and_nodes(backend: Backend, prefix: str) -> None:
    tier = backend.tier(prefix)
    items = [(k(i), v(i, 2 * CHUNK + 1 + i)) for i in range(24)]
    tier.put_many(items)
    assert tier.get_many([key for key, _ in items]) == [value for _, value in items]
    names = [n for n in backend.raw_keys(prefix) if not n.endswith(b"#usage}")]
    assert len(names) == 24 * 4  # a manifest and three chunks each
    by_value: dict[bytes, set[int]] = {}
    for name in names:
        tag = name[: name.index(b"}") + 1]
        by_value.setdefault(tag, set()).add(redis.cluster.key_slot(name))
    assert len(by_value) == 24
    assert all(len(slots) == 1 for slots in by_value.values())  # every key of a value: one slot
    assert len({next(iter(slots)) for slots in by_value.values()}) > 12  # values: many slots
    if backend.kind == "cluster":
        holders = set()
        for node in backend.raw.get_primaries():
            with redis.Redis(host=node.host, port=node.port) as client:
                if any(True for _ in client.scan_iter(match=f"*{prefix}*")):
                    holders.add(node.port)
        assert len(holders) == 3  # 24 random slots over 3 primaries


@pytest.mark.parametrize("damage", ["one-chunk", "last-chunk", "manifest", "truncated-chunk"])
def test_half_written_value_is_a_miss(backend: Backend, prefix: str, damage: str) -> None:
    tier = backend.tier(prefix)
    block, other = big_block(), big_block(96)
    key, other_key = key_of(block), key_of(other)
    tier.put_many([(key, encode_block(block, key)), (other_key, encode_block(other, other_key))])
    tag = f"{{{prefix}{key.hex()}}}".encode()
    names = sorted(n for n in backend.raw_keys(prefix) if n.startswith(tag))
    manifest = tag + b":m"
    chunks = sorted((n for n in names if n != manifest), key=lambda n: int(n.rsplit(b":", 1)[1]))
    assert len(chunks) >= 4
    if damage == "one-chunk":
        backend.raw.delete(chunks[1])
    elif damage == "last-chunk":
        backend.raw.delete(chunks[-1])
    elif damage == "manifest":
        backend.raw.delete(manifest)
    else:
        backend.raw.set(chunks[2], backend.raw.get(chunks[2])[:-1])
    # a miss (None); a truncated chunk is damage: b"" (the store counts it corrupt) and removed
    assert tier.get_many([key, other_key])[0] == (b"" if damage == "truncated-chunk" else None)
    assert tier.prefix_run_length([key, other_key]) == 0
    assert tier.prefix_run_length([other_key, key]) == 1

    with TieredStore([MemoryTier(1 << 24), tier]) as store:
        out = store.get_many([key, other_key], fingerprint=block.fingerprint)
        assert out[0] is None  # a miss, never wrong data
        assert_same_block(out[1], other)
        redis_stats = store.stats()["tiers"][1]
        assert redis_stats["misses"] == 1 and redis_stats["hits"] == 1 and redis_stats["corrupt"] == 0
        assert store.lookup_prefix([key]) == 0
        # writing the block again repairs it
        store.put_many([(key, block)])
        assert tier.prefix_run_length([key]) == 1
        store.specs[0].tier.delete([key])
        assert_same_block(store.get_many([key], fingerprint=block.fingerprint)[0], block)


def test_two_stores_share_one_redis(backend: Backend, prefix: str) -> None:
    small, large = make_block(8, namespace="ns"), big_block(namespace="ns")
    keys = [key_of(small), key_of(large)]
    store_a = TieredStore([MemoryTier(1 << 24), backend.tier(prefix)])
    store_b = TieredStore([MemoryTier(1 << 24), backend.tier(prefix)])
    with store_a, store_b:
        assert store_b.lookup_prefix(keys) == 0
        store_a.put_many([(keys[0], small), (keys[1], large)])
        assert store_b.lookup_prefix(keys) == 2
        out = store_b.get_many(keys, fingerprint=small.fingerprint, namespace="ns")
        assert_same_block(out[0], small)
        assert_same_block(out[1], large)
        tiers_b = {t["name"]: t for t in store_b.stats()["tiers"]}
        assert tiers_b["redis"]["hits"] == 2 and tiers_b["memory"]["misses"] == 2
        assert store_b.specs[0].tier.prefix_run_length(keys) == 2  # promoted into B's memory
        # a delete through B is seen by A's Redis tier
        store_b.delete([keys[0]])
        assert store_a.specs[1].tier.prefix_run_length(keys) == 0
        assert store_a.specs[1].tier.prefix_run_length(keys[1:]) == 1


def test_redis_unreachable_at_construction(backend: Backend, prefix: str) -> None:
    scheme = "redis" if backend.kind == "standalone" else "redis+cluster"
    tier = RedisTier.from_url(f"{scheme}://127.0.0.1:{free_port()}", prefix=prefix, socket_timeout=1.0)
    assert tier.healthy() is False
    with pytest.raises(TierUnavailableError, match="unavailable"):
        tier.get_many([k(1)])
    with pytest.raises(TierUnavailableError):
        tier.usage()
    block = make_block(6)
    key = key_of(block)
    with TieredStore([MemoryTier(1 << 24), tier]) as store:
        assert store.put_many([(key, block)]) == 1
        assert_same_block(store.get_many([key], fingerprint=block.fingerprint)[0], block)
        assert store.get_many([k(5)], fingerprint=block.fingerprint) == [None]
        assert store.lookup_prefix([key, k(5)]) == 1
        redis_stats = store.stats()["tiers"][1]
        assert redis_stats["available"] is False and redis_stats["blocks"] is None
        assert redis_stats["unavailable"] >= 3  # the put, the miss's read, the lookup


# ------------------------------------------------------------------------------------------------------------
# Redis going away and coming back
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_redis_stopped_midway_then_restarted(request: pytest.FixtureRequest, kind: str, prefix: str) -> None:
    servers = request.getfixturevalue("restartable_redis" if kind == "standalone" else "restartable_cluster")
    tier = RedisTier.from_url(servers.url, prefix=prefix, chunk_bytes=CHUNK, socket_timeout=1.0)
    before, during, after = make_block(4), make_block(5), big_block()
    with TieredStore([MemoryTier(1 << 24), tier]) as store:
        store.put_many([(key_of(before), before)])
        assert tier.prefix_run_length([key_of(before)]) == 1 and tier.healthy()

        servers.stop()
        assert tier.healthy() is False
        store.specs[0].tier.delete([key_of(before)])  # only Redis had it: now a miss, not an error
        assert store.get_many([key_of(before)], fingerprint=before.fingerprint) == [None]
        assert store.put_many([(key_of(during), during)]) == 1  # the memory tier takes it
        assert_same_block(store.get_many([key_of(during)], fingerprint=during.fingerprint)[0], during)
        assert store.stats()["tiers"][1]["unavailable"] >= 2

        servers.start()  # same ports; no persistence: it comes back empty
        assert tier.healthy() is True
        assert tier.get_many([key_of(before)]) == [None]
        store.put_many([(key_of(after), after)])
        assert tier.prefix_run_length([key_of(after)]) == 1
        store.specs[0].tier.delete([key_of(after)])
        assert_same_block(store.get_many([key_of(after)], fingerprint=after.fingerprint)[0], after)
        assert tier.usage().blocks == 1


# ------------------------------------------------------------------------------------------------------------
# Redis's own memory limit: eviction (allkeys-lru) and refusal (noeviction)
# ------------------------------------------------------------------------------------------------------------


def _limit_memory(servers: Any, headroom: int, policy: str) -> None:
    """Set every node's ``maxmemory`` to what it uses now plus ``headroom`` bytes, with ``policy``."""
    nodes = servers.nodes if hasattr(servers, "nodes") else [servers]
    for node in nodes:
        with node.client() as client:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory-policy", policy)
            client.config_set("maxmemory", used + headroom)


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_redis_eviction_makes_misses_never_wrong_data(request: pytest.FixtureRequest, kind: str, prefix: str) -> None:
    servers = request.getfixturevalue("restartable_redis" if kind == "standalone" else "restartable_cluster")
    tier = RedisTier.from_url(servers.url, prefix=prefix, chunk_bytes=CHUNK)
    _limit_memory(servers, 2 << 20, "allkeys-lru")
    items = [(k(i), os.urandom(3 * CHUNK + 7 * i)) for i in range(80)]  # ~16 MiB into ~2 MiB per node
    for start in range(0, len(items), 8):
        tier.put_many(items[start:start + 8])
    assert tier.usage().capacity_bytes is not None
    # one by one, newest first: a reply is buffered in Redis's memory too, and a large one evicts more
    got = [tier.get_many([key])[0] for key, _ in reversed(items)][::-1]
    assert any(value is None for value in got)  # Redis evicted some
    assert any(value is not None for value in got)  # and kept others
    assert all(seen is None or seen == value for (_, value), seen in zip(items, got, strict=True))


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_redis_refusing_writes_stores_nothing_partial(request: pytest.FixtureRequest, kind: str, prefix: str) -> None:
    servers = request.getfixturevalue("restartable_redis" if kind == "standalone" else "restartable_cluster")
    tier = RedisTier.from_url(servers.url, prefix=prefix, chunk_bytes=CHUNK)
    _limit_memory(servers, 1 << 20, "noeviction")
    items = [(k(i), os.urandom(3 * CHUNK + 11 * i)) for i in range(40)]  # ~8 MiB into ~1 MiB per node
    stored = sum(tier.put_many([item]) for item in items)
    assert 0 < stored < len(items)
    got = tier.get_many([key for key, _ in items])
    assert sum(value is not None for value in got) == stored
    assert all(seen is None or seen == value for (_, value), seen in zip(items, got, strict=True))
    assert tier.usage().blocks == stored
    held = [key for (key, _), seen in zip(items, got, strict=True) if seen is not None]
    assert tier.prefix_run_length(held) == stored


# ------------------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "memcached://h:1", "redis-cluster://h:1", "h:6379"])
def test_unknown_url_scheme_is_config_error(url: str) -> None:
    scheme = url.split("://")[0] if "://" in url else "h"
    with pytest.raises(ConfigError, match=f"unknown Redis URL scheme '{scheme}'"):
        RedisTier.from_url(url)


@pytest.mark.parametrize(
    ("url", "kwargs", "match"),
    [
        ("redis://h:1/x", {}, "database"),
        ("redis+cluster://h:1/3", {}, "database 0"),
        ("redis://h:1", {"chunk_bytes": 0}, "chunk_bytes"),
        ("redis://h:1", {"prefix": "a{b"}, "prefix"),
    ],
)
def test_bad_settings_are_config_errors(url: str, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RedisTier.from_url(url, **kwargs)


def test_tls_query_parameters_reach_the_connection() -> None:
    """A ``rediss://`` URL's TLS parameters go to redis-py's TLS connection (nothing connects here)."""
    tier = RedisTier.from_url("rediss://h:1/0?ssl_ca_certs=/etc/ca%20dir/ca.pem&ssl_cert_reqs=required"
                              "&ssl_check_hostname=false")
    client = tier._connect()
    kwargs = client.connection_pool.connection_kwargs
    assert client.connection_pool.connection_class is redis.SSLConnection
    assert (kwargs["ssl_ca_certs"], kwargs["ssl_cert_reqs"], kwargs["ssl_check_hostname"]) == (
        "/etc/ca dir/ca.pem", "required", False)
    client.close()


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("redis://h:1/0?ssl_ca_certs=/ca.pem", "needs TLS: use rediss://"),
        ("rediss://h:1/0?ssl_ca_cert=/ca.pem", "unknown parameter 'ssl_ca_cert'"),
        ("rediss+cluster://h:1?ssl_cert_reqs=maybe", "ssl_cert_reqs must be none, optional or required"),
        ("rediss://h:1/0?ssl_check_hostname=perhaps", "ssl_check_hostname must be true or false"),
    ],
)
def test_bad_tls_query_parameters_are_config_errors(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RedisTier.from_url(url)


def test_tls_server_round_trip(tls_redis_server: redis_servers.TLSRedisProcess) -> None:
    """``rediss://...?ssl_ca_certs=CA`` reaches a TLS-only server, verifying its certificate."""
    tier = RedisTier.from_url(tls_redis_server.url, prefix=f"t{os.urandom(6).hex()}:", chunk_bytes=CHUNK)
    try:
        assert tier.put_many([(b"k" * 16, b"v" * (2 * CHUNK + 1))]) == 1
        assert tier.get_many([b"k" * 16]) == [b"v" * (2 * CHUNK + 1)]
        assert tier.healthy()
    finally:
        tier.close()


def test_tls_server_with_an_unknown_ca_is_unavailable(tls_redis_server: redis_servers.TLSRedisProcess) -> None:
    """Without the CA (the system's CAs only) the certificate fails verification: unavailable, not a hang."""
    tier = RedisTier.from_url(tls_redis_server.url.split("?")[0], socket_timeout=0.5)
    try:
        with pytest.raises(TierUnavailableError, match="is unavailable"):
            tier.get_many([b"k" * 16])
    finally:
        tier.close()


def test_plain_client_on_the_tls_port_is_unavailable_not_a_hang(
        tls_redis_server: redis_servers.TLSRedisProcess) -> None:
    """A ``redis://`` (no TLS) tier pointed at the TLS port fails within its socket timeout with the tier's
    unavailable error, then fails at once while its breaker is open."""
    tier = RedisTier.from_url(tls_redis_server.plain_url, socket_timeout=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(TierUnavailableError,
                           match=r"Redis tier 'redis' at redis://127\.0\.0\.1:\d+/0 is unavailable"):
            tier.get_many([b"k" * 16])
        assert time.monotonic() - started < 3
        started = time.monotonic()
        with pytest.raises(TierUnavailableError, match="down for another"):
            tier.get_many([b"k" * 16])
        assert time.monotonic() - started < 0.1
    finally:
        tier.close()
