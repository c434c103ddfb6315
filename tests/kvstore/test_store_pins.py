"""Pins of keys the store no longer holds: every path that removes a pinned key from the last
tier holding it drops its pin, so the pinned set never grows without bound and ``stats()["pinned"]`` counts held
blocks. Real tiers: a memory tier, an LMDB environment damaged on disk, a ``redis-server`` that evicts on its own,
and a gRPC server's ``Clear``.

(kvshelf sets no TTL and has no expiry: no path of that kind exists to test.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import redis_servers
from helpers import key_of, make_block

from kvshelf.kvstore import LMDBTier, MemoryTier, RedisTier, TieredStore, encode_block
from kvshelf.service.auth import scope_tag
from kvshelf.service.client import RemoteStore
from kvshelf.service.server import start_server

redis_server = redis_servers.redis_server
maxmemory_redis = redis_servers.maxmemory_redis

KiB, MiB = 1 << 10, 1 << 20


def pinned(store: TieredStore) -> int:
    return int(store.stats()["pinned"])


def test_pinned_key_a_tier_drops_for_an_overwrite_it_cannot_hold_loses_its_pin() -> None:
    """A memory tier cannot hold a new value of a pinned key (larger than the tier): it drops the old one, and no
    tier holds the key any more. A put of a new value that the tier does hold keeps the pin."""
    store = TieredStore([MemoryTier(64 * KiB)])
    small = make_block(4, seed=1)
    key = key_of(small)
    assert store.put_many([(key, small)], pin=True) == 1
    assert store.put_many([(key, make_block(4, seed=2))]) == 1  # an overwrite it holds: still pinned
    assert store.is_pinned(key) and pinned(store) == 1
    huge = make_block(4, heads=8, head_dim=1024, seed=3)  # ~256 KiB: over the tier's 64 KiB
    assert store.put_many([(key, huge)]) == 0
    assert store.held([key]) == [False]
    assert not store.is_pinned(key) and pinned(store) == 0


def test_pinned_put_that_no_tier_takes_is_not_left_pinned() -> None:
    store = TieredStore([MemoryTier(64 * KiB)])
    huge = make_block(4, heads=8, head_dim=1024, seed=3)
    assert store.put_many([(key_of(huge), huge)], pin=True) == 0
    assert pinned(store) == 0 and store.pinned_keys() == []


def test_pinned_values_redis_evicts_lose_their_pins(maxmemory_redis: Any) -> None:
    """Redis (allkeys-lru, 4 MiB) knows nothing of pins: it evicts pinned values like any other. Once the tier
    finds them gone (``usage()``'s reconciliation, a read) their pins go; the pins of values Redis kept stay."""
    tier = RedisTier.from_url(maxmemory_redis.url, prefix=f"p{os.urandom(4).hex()}:", chunk_bytes=64 * KiB,
                              reconcile_interval_s=0)
    store = TieredStore([tier])
    try:
        blocks = [make_block(48 + i, layers=2, heads=2, head_dim=64) for i in range(80)]  # ~100 KiB each
        for block in blocks:
            assert store.put_many([(key_of(block), block)], pin=True) == 1
        with maxmemory_redis.client() as client:
            client.config_set("maxmemory", str(256 * MiB))
        store.stats()  # usage(): a reconciliation, Redis's evictions reported (puts found some already)
        held = sum(store.held([key_of(b) for b in blocks]))
        assert 0 < held < 80
        assert pinned(store) == held
        assert all(store.is_pinned(key_of(b)) == h for b, h in zip(
            blocks, store.held([key_of(b) for b in blocks]), strict=True))
    finally:
        store.close()


def test_damaged_lmdb_value_dropped_on_read_loses_its_pin(tmp_path: Path) -> None:
    """A pinned value damaged on disk (bytes overwritten in the real data.mdb) is dropped by the read that finds
    it: no tier holds it, so its pin goes."""
    path = tmp_path / "lmdb"
    store = TieredStore([LMDBTier(path, initial_map_bytes=4 * MiB)])
    try:
        block = make_block(16, heads=2, head_dim=64, seed=5)  # ~16 KiB: on overflow pages
        key = key_of(block)
        assert store.put_many([(key, block)], pin=True) == 1
        encoded = encode_block(block, key)
        piece = encoded[len(encoded) // 2:len(encoded) // 2 + 64]
        data = (path / "data.mdb").read_bytes()
        at = data.find(piece)
        assert at >= 0 and data.find(piece, at + 1) < 0
        fd = os.open(path / "data.mdb", os.O_WRONLY)
        try:
            os.pwrite(fd, bytes(b ^ 0xFF for b in piece), at)
        finally:
            os.close(fd)
        assert store.get_many([key], fingerprint=block.fingerprint) == [None]
        assert store.counters.total("corrupt") == 1
        assert store.held([key]) == [False]
        assert pinned(store) == 0
    finally:
        store.close()


@pytest.mark.parametrize("evicted", [3])
def test_server_clear_drops_every_pin_of_the_namespace(redis_server: Any, evicted: int) -> None:
    """``Clear`` drops the pins of the namespace's blocks that no tier holds any more (here Redis lost them behind
    the store's back, as an eviction nobody has noticed yet does), not only those of blocks it found; another
    namespace's pins stay."""
    prefix = f"q{os.urandom(4).hex()}:"
    tier = RedisTier.from_url(redis_server.url, prefix=prefix, reconcile_interval_s=3600)
    store = TieredStore([tier])
    running = start_server(store)
    try:
        address = f"127.0.0.1:{running.port}"
        with RemoteStore(address, namespace="a") as a, RemoteStore(address, namespace="b") as b:
            mine = [make_block(4, namespace="a", start_pos=4 * i) for i in range(10)]
            theirs = [make_block(4, namespace="b", start_pos=4 * i) for i in range(5)]
            assert a.put_many([(key_of(x), x) for x in mine], pin=True) == 10
            assert b.put_many([(key_of(x), x) for x in theirs], pin=True) == 5
            with redis_server.client() as raw:  # gone from Redis: an eviction not yet found
                for block in mine[:evicted]:
                    assert raw.delete("{" + prefix + (scope_tag("a") + key_of(block)).hex() + "}:m") == 1
            assert a.stats()["pinned"] == 10
            assert a.clear() == 10 - evicted
            assert a.stats()["pinned"] == 0
            assert b.stats()["pinned"] == 5
            assert pinned(store) == 5
    finally:
        running.stop(0)
        store.close()
