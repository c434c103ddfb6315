"""A hung Redis degrades the server like a dead one: a real server with memory, LMDB and Redis
tiers, and a real ``redis-server`` frozen with SIGSTOP (it accepts connections and never answers). Puts and gets
finish in about the Redis timeout (the other tiers serve), Stats answers ``degraded`` and the ``tiers`` health
service says NOT_SERVING; after SIGCONT the server is SERVING again and reads hit Redis again."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import redis_servers
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import assert_same_block, key_of, make_block
from redis_servers import PausableRedis

from kvshelf.service.client import RemoteStore
from kvshelf.service.serve import ServeConfig, open_store
from kvshelf.service.server import TIERS_HEALTH_NAME, start_server

pausable_redis = redis_servers.pausable_redis

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: a generous bound on one call while Redis hangs: the Redis timeout is 1 s; the old code took 15 s
FAST_S = 5.0


def test_hung_redis_degrades_like_a_dead_one_and_recovers(pausable_redis: PausableRedis, tmp_path: Path) -> None:
    config = ServeConfig.from_settings(data_dir=str(tmp_path / "data"), memory="64MiB", max_disk="64MiB",
                                       redis=pausable_redis.url)
    assert config.store.redis_timeout == 1.0
    store = open_store(config)
    assert [spec.tier.name for spec in store.specs] == ["memory", "disk", "redis"]
    running = start_server(store, "127.0.0.1:0", health_interval_s=0.5)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    check = health_pb2_grpc.HealthStub(channel).Check

    def tiers_health() -> int:
        return check(health_pb2.HealthCheckRequest(service=TIERS_HEALTH_NAME), timeout=10).status

    blocks = [make_block(4 + i) for i in range(4)]
    keys = [key_of(block) for block in blocks]
    fingerprint = blocks[0].fingerprint
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", timeout_s=60) as remote:
            assert remote.put_many([(keys[0], blocks[0]), (keys[1], blocks[1])]) == 2
            assert tiers_health() == SERVING
            assert store.specs[2].tier.prefix_run_length([store.specs[0].tier.keys()[0]]) == 1  # in Redis too

            pausable_redis.pause()
            started = time.monotonic()
            assert remote.put_many([(keys[2], blocks[2])]) == 1  # memory and LMDB take it
            assert time.monotonic() - started < FAST_S
            started = time.monotonic()
            out = remote.get_many([keys[0], keys[2], keys[3]], fingerprint=fingerprint)  # keys[3]: a miss in all
            assert time.monotonic() - started < FAST_S
            assert_same_block(out[0], blocks[0])
            assert_same_block(out[1], blocks[2])
            assert out[2] is None
            started = time.monotonic()
            stats = remote.stats()
            assert time.monotonic() - started < FAST_S  # it hit its 30 s deadline
            assert stats["health"]["status"] == "degraded"
            assert stats["health"]["unavailable_tiers"] == ["redis"]
            assert tiers_health() == NOT_SERVING
            assert {t["name"]: t["available"] for t in stats["tiers"]} == {"memory": True, "disk": True,
                                                                           "redis": False}

            pausable_redis.resume()
            deadline = time.monotonic() + 60
            while tiers_health() != SERVING:
                assert time.monotonic() < deadline, "the tiers health service did not come back after SIGCONT"
                time.sleep(0.2)
            health = remote.stats()["health"]
            assert health["status"] == "serving" and health["unavailable_tiers"] == []
            # reads hit Redis again: drop the local copies of keys[1]
            held = store.specs[0].tier.keys()
            local = [k for k in held if k.endswith(keys[1])]
            assert len(local) == 1
            store.specs[0].tier.delete(local)
            store.specs[1].tier.delete(local)
            assert_same_block(remote.get_many([keys[1]], fingerprint=fingerprint)[0], blocks[1])
            redis_row = next(t for t in remote.stats()["tiers"] if t["name"] == "redis")
            assert redis_row["hits"] >= 1
    finally:
        channel.close()
        running.stop(0)
        store.close()


def test_poisoned_redis_keys_are_counted_misses_never_internal(pausable_redis: PausableRedis, tmp_path: Path) -> None:
    """Keys of the wrong type at a value's manifest and at the usage hash: the tenant's reads
    are counted corrupt misses, Stats answers, Delete removes the key and the next put replaces it."""
    store = open_store(ServeConfig.from_settings(data_dir=str(tmp_path / "data"), memory="64MiB", max_disk="64MiB",
                                   redis=pausable_redis.url))
    running = start_server(store, "127.0.0.1:0")
    raw = pausable_redis.client()
    blocks = [make_block(4 + i) for i in range(2)]
    keys = [key_of(block) for block in blocks]
    fingerprint = blocks[0].fingerprint
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", timeout_s=30) as remote:
            assert remote.put_many(list(zip(keys, blocks, strict=True))) == 2
            tier_keys = store.specs[0].tier.keys()
            manifests = sorted(raw.scan_iter(match="{kvshelf:*}:m"))
            assert len(manifests) == 2

            def poison() -> None:
                for spec in store.specs[:2]:  # only Redis holds them now
                    spec.tier.delete(tier_keys)
                for name, push in zip(manifests, (raw.rpush, raw.sadd), strict=True):
                    raw.delete(name)
                    push(name, b"x")
                raw.delete("{kvshelf:#usage}")
                raw.set("{kvshelf:#usage}", b"not a hash")

            poison()
            assert remote.get_many(keys, fingerprint=fingerprint) == [None, None]  # was INTERNAL
            assert remote.lookup_prefix(keys) == 0
            stats = remote.stats()  # was INTERNAL for every tenant
            redis_row = next(t for t in stats["tiers"] if t["name"] == "redis")
            assert redis_row["available"] is True and redis_row["corrupt"] == 2
            assert raw.exists(*manifests) == 0  # removed on sight

            poison()
            assert remote.delete(keys) == 0  # nothing readable was held ...
            assert raw.exists(*manifests) == 0  # ... and the poisoned keys are gone
            poison()
            assert remote.put_many(list(zip(keys, blocks, strict=True))) == 2  # a put replaces them
            for spec in store.specs[:2]:
                spec.tier.delete(tier_keys)
            out = remote.get_many(keys, fingerprint=fingerprint)
            assert_same_block(out[0], blocks[0])
            assert_same_block(out[1], blocks[1])
            assert store.specs[2].tier.usage().blocks == 2  # the usage hash rebuilt
    finally:
        raw.close()
        running.stop(0)
        store.close()
