"""The Redis tier against a hung server and a damaged or hostile Redis, with a real
``redis-server``: frozen with SIGSTOP (it accepts connections and never answers), and keys of the wrong type,
contradictory manifests and damaged usage counters written behind the tier's back."""

from __future__ import annotations

import logging
import os
import signal
import struct
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis_servers
from helpers import assert_same_block, key_of, make_block
from redis_servers import PausableRedis

from kvshelf.kvstore import MemoryTier, RedisTier, TieredStore, TierUnavailableError, TierUsage, encode_block
from kvshelf.kvstore.block import KVBlock

redis_server = redis_servers.redis_server
pausable_redis = redis_servers.pausable_redis
restartable_cluster = redis_servers.restartable_cluster

KiB = 1 << 10
CHUNK = 64 * KiB
#: the manifest header of the tier's layout: magic, kind (0 inline, 1 chunked), generation, chunk count, total
HEADER = struct.Struct("<4sB8sIQ")


@pytest.fixture
def prefix() -> str:
    return f"h{os.urandom(6).hex()}:"


@pytest.fixture
def raw(redis_server: Any) -> Any:
    client = redis_server.client()
    yield client
    client.close()


def manifest_name(prefix: str, key: bytes) -> str:
    return f"{{{prefix}{key.hex()}}}:m"


def chunk_names(raw: Any, prefix: str, key: bytes) -> list[bytes]:
    tag = f"{{{prefix}{key.hex()}}}:".encode()
    names = [n for n in raw.scan_iter(match=f"*{prefix}{key.hex()}*") if n.startswith(tag) and not n.endswith(b":m")]
    return sorted(names, key=lambda n: int(n.rsplit(b":", 1)[1]))


def big_block(tokens: int = 128) -> KVBlock:
    """A block whose encoded value (~260 KiB) spans several 64 KiB chunks."""
    return make_block(tokens, layers=2, heads=2, head_dim=64)


POISONS: dict[str, Callable[[Any, str], None]] = {
    "list": lambda r, name: r.rpush(name, b"x"),
    "hash": lambda r, name: r.hset(name, "f", b"v"),
    "set": lambda r, name: r.sadd(name, b"x"),
    "zset": lambda r, name: r.zadd(name, {b"x": 1.0}),
}


def poison(raw: Any, name: str | bytes, kind: str) -> None:
    raw.delete(name)
    POISONS[kind](raw, name)


def commands(raw: Any, name: str) -> int:
    """How many times Redis has run command ``name`` since it started."""
    return int(raw.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


# ------------------------------------------------------------------------------------------------------------
# item 6: a hung Redis fails fast, degrades like a dead one, and comes back
# ------------------------------------------------------------------------------------------------------------


def test_hung_redis_fails_fast_then_recovers(pausable_redis: PausableRedis, prefix: str) -> None:
    tier = RedisTier.from_url(pausable_redis.url, prefix=prefix, chunk_bytes=CHUNK)  # the default timeout: 1 s
    before, during = make_block(4), make_block(5)
    with TieredStore([MemoryTier(1 << 24), tier]) as store:
        store.put_many([(key_of(before), before)])
        assert tier.prefix_run_length([key_of(before)]) == 1

        pausable_redis.pause()
        started = time.monotonic()
        with pytest.raises(TierUnavailableError, match="unavailable"):
            tier.get_many([key_of(before)])
        first = time.monotonic() - started
        assert first < 5  # one socket timeout, no retries (it took 3 x 5 s)
        # the tier is now down for a backoff: every call fails at once without touching the socket
        started = time.monotonic()
        for call in (lambda: tier.put_many([(key_of(during), b"x" * 100)]), lambda: tier.prefix_run_length([b"k" * 16]),
                     tier.usage, lambda: tier.delete([key_of(before)]), tier.keys):
            with pytest.raises(TierUnavailableError, match="down"):
                call()
        assert time.monotonic() - started < 2  # five calls; each took 15 s
        assert tier.healthy() is False  # a probe tries (PING, one timeout)
        # the store serves from its other tier, in about one timeout per call at most
        started = time.monotonic()
        assert store.put_many([(key_of(during), during)]) == 1
        assert_same_block(store.get_many([key_of(during)], fingerprint=during.fingerprint)[0], during)
        assert store.stats()["tiers"][1]["available"] is False
        assert time.monotonic() - started < 5

        pausable_redis.resume()
        deadline = time.monotonic() + 30
        while not tier.healthy():
            assert time.monotonic() < deadline, "the tier did not come back after SIGCONT"
            time.sleep(0.2)
        assert store.stats()["tiers"][1]["available"] is True
        assert tier.get_many([key_of(before)]) == [encode_block(before, key_of(before))]


def test_dead_redis_breaker_opens_and_closes(pausable_redis: PausableRedis, prefix: str) -> None:
    """A refused connection trips the same breaker; the first call after the backoff tries again."""
    tier = RedisTier.from_url(pausable_redis.url, prefix=prefix, chunk_bytes=CHUNK)
    tier.put_many([(b"a" * 16, b"value")])
    pausable_redis.server.stop()
    with pytest.raises(TierUnavailableError, match="unavailable"):
        tier.get_many([b"a" * 16])
    with pytest.raises(TierUnavailableError, match="down"):
        tier.get_many([b"a" * 16])
    pausable_redis.server.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            assert tier.get_many([b"a" * 16]) == [None]  # back (empty: no persistence)
            break
        except TierUnavailableError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_hung_cluster_node_fails_fast(restartable_cluster: Any, prefix: str) -> None:
    """Redis Cluster: redis-py's cluster pipeline resends each command that timed out one by one (one timeout
    each); the tier stops after the first."""
    tier = RedisTier.from_url(restartable_cluster.url, prefix=prefix, chunk_bytes=CHUNK)
    keys = [i.to_bytes(16, "big") for i in range(48)]
    assert tier.put_many([(key, b"v" * 100) for key in keys]) == len(keys)
    node = restartable_cluster.nodes[1].proc
    os.kill(node.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TierUnavailableError, match="unavailable"):
            tier.get_many(keys)
        assert time.monotonic() - started < 8  # about 16 commands on the frozen node: it took 23 s and more
        with pytest.raises(TierUnavailableError, match="down"):
            tier.prefix_run_length(keys)
    finally:
        os.kill(node.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:
        try:
            assert tier.get_many(keys) == [b"v" * 100] * len(keys)
            break
        except TierUnavailableError:
            assert time.monotonic() < deadline, "the tier did not come back after SIGCONT"
            time.sleep(0.2)


# ------------------------------------------------------------------------------------------------------------
# item 7: keys of the wrong type are counted corrupt misses, removable, replaceable
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(POISONS))
def test_wrong_type_manifest_is_a_counted_corrupt_miss(redis_server: Any, raw: Any, prefix: str, kind: str) -> None:
    tier = RedisTier.from_url(redis_server.url, prefix=prefix, chunk_bytes=CHUNK)
    block, other = make_block(8), make_block(9)
    key, other_key = key_of(block), key_of(other)
    name = manifest_name(prefix, key)
    with TieredStore([tier]) as store:
        store.put_many([(key, block), (other_key, other)])

        poison(raw, name, kind)
        out = store.get_many([key, other_key], fingerprint=block.fingerprint)
        assert out[0] is None
        assert_same_block(out[1], other)
        assert store.stats()["tiers"][0]["corrupt"] == 1
        assert raw.exists(name) == 0  # the damaged key is gone

        poison(raw, name, kind)
        assert store.lookup_prefix([key, other_key]) == 0
        assert store.lookup_prefix([other_key, key]) == 1
        poison(raw, name, kind)
        store.delete([key])  # Delete removes it
        assert raw.exists(name) == 0

        poison(raw, name, kind)
        listed = tier.keys()
        assert key in listed  # Clear lists it ...
        store.delete(tier.keys())  # ... and removes it
        assert raw.exists(name) == 0 and tier.keys() == []

        poison(raw, name, kind)
        assert store.put_many([(key, block)]) == 1  # the next put replaces it
        assert_same_block(store.get_many([key], fingerprint=block.fingerprint)[0], block)
        assert tier.recount() == TierUsage(blocks=1, bytes=len(encode_block(block, key)), capacity_bytes=None)


@pytest.mark.parametrize("damage", ["wrong-type", "longer", "empty"])
def test_damaged_chunk_is_a_counted_corrupt_miss(redis_server: Any, raw: Any, prefix: str, damage: str) -> None:
    tier = RedisTier.from_url(redis_server.url, prefix=prefix, chunk_bytes=CHUNK)
    block = big_block()
    key = key_of(block)
    with TieredStore([tier]) as store:
        store.put_many([(key, block)])
        chunks = chunk_names(raw, prefix, key)
        assert len(chunks) >= 4
        if damage == "wrong-type":
            poison(raw, chunks[1], "hash")
        elif damage == "longer":
            raw.append(chunks[1], b"!")
        else:
            raw.set(chunks[1], b"")
        assert store.get_many([key], fingerprint=block.fingerprint) == [None]
        assert store.stats()["tiers"][0]["corrupt"] == 1
        assert tier.prefix_run_length([key]) == 0
        assert raw.exists(manifest_name(prefix, key), *chunks) == 0  # manifest and chunks removed
        assert tier.usage().blocks == 0 and tier.usage().bytes == 0  # and counted out
        store.put_many([(key, block)])
        assert_same_block(store.get_many([key], fingerprint=block.fingerprint)[0], block)


def test_damaged_chunk_seen_by_contains_first(redis_server: Any, raw: Any, prefix: str) -> None:
    tier = RedisTier.from_url(redis_server.url, prefix=prefix, chunk_bytes=CHUNK)
    key = b"c" * 16
    tier.put_many([(key, os.urandom(3 * CHUNK))])
    poison(raw, chunk_names(raw, prefix, key)[2], "list")
    assert tier.prefix_run_length([key]) == 0
    assert tier.get_many([key]) == [None]  # already removed
    assert tier.delete([key]) == 0


@pytest.mark.parametrize("damage", ["string", "list", "not-an-integer", "huge"])
def test_damaged_usage_counters_are_rebuilt(redis_server: Any, raw: Any, prefix: str, damage: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    tier = RedisTier.from_url(redis_server.url, prefix=prefix, chunk_bytes=CHUNK)
    tier.put_many([(b"a" * 16, b"x" * 100), (b"b" * 16, os.urandom(2 * CHUNK + 5))])
    usage_key = f"{{{prefix}#usage}}"
    expected = TierUsage(blocks=2, bytes=100 + 2 * CHUNK + 5, capacity_bytes=None)
    assert tier.usage() == expected

    def damage_counters() -> None:
        if damage == "string":
            raw.delete(usage_key)
            raw.set(usage_key, b"garbage")
        elif damage == "list":
            raw.delete(usage_key)
            raw.rpush(usage_key, b"1")
        elif damage == "not-an-integer":
            raw.hset(usage_key, "blocks", b"many")
        else:
            raw.hset(usage_key, "bytes", b"9" * 30)

    damage_counters()
    with caplog.at_level(logging.WARNING):
        assert tier.usage() == expected
    assert "usage counters" in caplog.text
    assert raw.type(usage_key) == b"hash"
    damage_counters()
    # puts and deletes keep working over damaged counters; the next usage() rebuilds them
    assert tier.put_many([(b"c" * 16, b"y" * 10)]) == 1
    assert tier.delete([b"a" * 16]) == 1
    assert tier.usage() == TierUsage(blocks=2, bytes=10 + 2 * CHUNK + 5, capacity_bytes=None)
    with TieredStore([MemoryTier(1 << 20), tier]) as store:
        damage_counters()
        assert store.stats()["tiers"][1]["available"] is True


# ------------------------------------------------------------------------------------------------------------
# item 9: a manifest is validated before any chunk is read
# ------------------------------------------------------------------------------------------------------------


def _forge(raw: Any, prefix: str, key: bytes, chunks: int, total: int, kind: int = 1) -> None:
    raw.set(manifest_name(prefix, key), HEADER.pack(b"kvR1", kind, os.urandom(8), chunks, total))


@pytest.mark.parametrize(
    ("chunks", "total"),
    [
        (400_000, 1000),  # more chunks than bytes
        (2**32 - 1, 5 * CHUNK),  # the field's maximum
        (3, 2**40),  # a TiB: over the value size limit
        (1, 5 * CHUNK),  # a chunked value of one chunk: never written (it would be inline)
        (2, 2 * (1 << 30)),  # chunks larger than Redis's largest string
        (0, 100),  # chunked, no chunks
    ],
)
def test_contradictory_manifest_is_a_corrupt_miss_read_no_further(
    redis_server: Any, raw: Any, prefix: str, chunks: int, total: int
) -> None:
    tier = RedisTier.from_url(redis_server.url, prefix=prefix, chunk_bytes=CHUNK)
    block = make_block(8)
    key = key_of(block)
    _forge(raw, prefix, key, chunks, total)
    gets, strlens = commands(raw, "get"), commands(raw, "strlen")
    with TieredStore([tier]) as store:
        assert store.get_many([key], fingerprint=block.fingerprint) == [None]
        assert store.stats()["tiers"][0]["corrupt"] == 1
    assert commands(raw, "get") - gets == 1  # the manifest; no chunk
    _forge(raw, prefix, key, chunks, total)
    assert tier.prefix_run_length([key]) == 0
    assert commands(raw, "strlen") == strlens
    _forge(raw, prefix, key, chunks, total)
    assert tier.delete([key]) == 1 and raw.exists(manifest_name(prefix, key)) == 0


def test_plausible_manifest_of_many_missing_chunks_costs_one_round(raw: Any, redis_server: Any, prefix: str) -> None:
    """400,000 chunks of 1 KiB (400 MB, consistent): the first missing chunk ends the read."""
    tier = RedisTier.from_url(redis_server.url, prefix=prefix, chunk_bytes=CHUNK)
    key = b"m" * 16
    _forge(raw, prefix, key, 400_000, 400_000 * KiB)
    gets, strlens = commands(raw, "get"), commands(raw, "strlen")
    assert tier.get_many([key]) == [None]  # a miss (chunks missing: as after an eviction), not corrupt
    assert tier.prefix_run_length([key]) == 0
    assert commands(raw, "get") - gets < 1000  # it sent 400,000 GETs (5 s, +210 MB)
    assert commands(raw, "strlen") - strlens < 1000
    # a value with missing chunks (as Redis's eviction leaves one) is removed by the read that finds it (so
    # the usage counters follow Redis's evictions), in one command: its chunks beyond the first missing one are not
    # looked for one by one
    assert raw.exists(manifest_name(prefix, key)) == 0
    assert tier.delete([key]) == 0


def test_inline_manifest_of_the_wrong_length_is_corrupt(redis_server: Any, raw: Any, prefix: str) -> None:
    tier = RedisTier.from_url(redis_server.url, prefix=prefix, chunk_bytes=CHUNK)
    key = b"i" * 16
    raw.set(manifest_name(prefix, key), HEADER.pack(b"kvR1", 0, os.urandom(8), 0, 50) + b"x" * 10)
    assert tier.get_many([key]) == [b""]  # present but damaged: the store's verification counts it corrupt
    assert raw.exists(manifest_name(prefix, key)) == 0


def test_value_over_the_limit_is_not_stored(redis_server: Any, prefix: str) -> None:
    tier = RedisTier.from_url(redis_server.url, prefix=prefix, chunk_bytes=CHUNK, max_value_bytes=4 * CHUNK)
    assert tier.put_many([(b"a" * 16, b"x" * (4 * CHUNK + 1)), (b"b" * 16, b"y" * 10)]) == 1
    assert tier.get_many([b"a" * 16, b"b" * 16]) == [None, b"y" * 10]

