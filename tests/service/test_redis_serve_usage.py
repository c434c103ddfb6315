"""``kvshelf serve --redis`` over a Redis that evicts on its own (the usage counters of the Redis
tier, checked through the service as ``open_store`` builds it: memory, LMDB, Redis). ``Stats`` (the namespace's row
and the admin view of the whole store) shows what Redis really holds, Redis's evictions are counted, and ``Clear``
leaves the Redis counters at zero. A real ``redis-server`` (``--maxmemory 4mb``, allkeys-lfu), a real gRPC server."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import redis_servers
from helpers import key_of, make_block

from kvshelf.service.client import RemoteStore
from kvshelf.service.serve import ServeConfig, open_store
from kvshelf.service.server import start_server

maxmemory_redis = redis_servers.maxmemory_redis

MiB = 1 << 20
HEADER = struct.Struct("<4sB8sIQ")  # the Redis tier's manifest header: magic, kind, generation, chunks, total


def held_in_redis(server: Any, prefix: str = "kvshelf:") -> dict[bytes, int]:
    """``key -> size`` of the values Redis holds whole (manifest and, for a chunked one, every chunk)."""
    out: dict[bytes, int] = {}
    with server.client() as client:
        for name in client.scan_iter(match="{" + prefix + "*}:m", count=1000):
            raw = client.getrange(name, 0, HEADER.size - 1)
            if len(raw) < HEADER.size:
                continue
            _, kind, generation, chunks, total = HEADER.unpack(raw)
            tag = name[:-2].decode()
            if kind == 1 and client.exists(*(f"{tag}:{generation.hex()}:{i}" for i in range(chunks))) != chunks:
                continue
            out[bytes.fromhex(name[1 + len(prefix):-3].decode())] = total
    return out


def redis_row(stats: dict[str, Any]) -> dict[str, Any]:
    return next(t for t in stats["tiers"] if t["name"] == "redis")


def test_serve_with_redis_stats_follow_what_redis_holds(maxmemory_redis: Any, tmp_path: Path) -> None:
    """allkeys-lfu, the recommended policy: under allkeys-lru a 4 MiB Redis turning over within a second may evict
    the usage registry too, and the values evicted meanwhile are then counted out by a recount, not reported one by
    one (kvstore.redis_tier.usage)."""
    with maxmemory_redis.client() as client:
        client.config_set("maxmemory-policy", "allkeys-lfu")
    store = open_store(ServeConfig.from_settings(data_dir=str(tmp_path / "data"), memory="1MiB", max_disk="256MiB",
                                   redis=maxmemory_redis.url))
    running = start_server(store)
    blocks = [make_block(48 + i, layers=2, heads=2, head_dim=64) for i in range(80)]  # ~100 KiB each, ~8 MiB
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", timeout_s=60) as remote:
            for block in blocks:
                assert remote.put_many([(key_of(block), block)]) == 1
            with maxmemory_redis.client() as client:
                assert int(client.info("stats")["evicted_keys"]) > 0
                client.config_set("maxmemory", str(256 * MiB))  # no more evictions from here on
            held = held_in_redis(maxmemory_redis)
            assert 0 < len(held) < len(blocks)
            stats = remote.stats()
            row, whole = redis_row(stats), redis_row(stats["store"])
            assert (row["blocks"], row["bytes"]) == (len(held), sum(held.values()))
            assert (whole["blocks"], whole["bytes"]) == (len(held), sum(held.values()))
            assert whole["evictions"] == len(blocks) - len(held)
            # every block still served (LMDB holds them all)
            assert all(b is not None for b in remote.get_many([key_of(b) for b in blocks],
                                                              fingerprint=blocks[0].fingerprint))
            assert remote.clear() == len(blocks)
            assert held_in_redis(maxmemory_redis) == {}
            row = redis_row(remote.stats())
            assert (row["blocks"], row["bytes"]) == (0, 0)
            assert store.specs[-1].tier.usage().blocks == 0
    finally:
        running.stop(0)
        store.close()
