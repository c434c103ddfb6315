"""``Tier.peek_many`` reads values without the eviction policy hearing of it (what ``adapters.miss`` reads
headers with): after a peek, LRU still evicts the least recently *used* key; after a get, another one."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshelf.kvstore import Tier
from kvshelf.kvstore.lmdb_tier import LMDBTier
from kvshelf.kvstore.memory_tier import MemoryTier

KiB = 1 << 10
VALUE = 300 * KiB


def _memory(tmp_path: Path) -> Tier:
    return MemoryTier(1000 * KiB, policy="lru")


def _lmdb(tmp_path: Path) -> Tier:
    return LMDBTier(tmp_path / "lmdb", capacity_bytes=1 << 20, policy="lru", durable=False)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.mark.parametrize("make", [_memory, _lmdb], ids=["memory", "lmdb"])
@pytest.mark.parametrize("read", ["peek_many", "get_many"])
def test_a_peek_leaves_the_eviction_order_as_it_was(tmp_path: Path, make, read: str) -> None:  # noqa: ANN001
    tier = make(tmp_path)
    evicted: list[bytes] = []
    tier.set_eviction_callback(lambda key, value: evicted.append(key))
    tier.put_many([(_key(0), b"a" * VALUE), (_key(1), b"b" * VALUE), (_key(2), b"c" * VALUE)])
    assert evicted == []
    assert getattr(tier, read)([_key(0)]) == [b"a" * VALUE]
    tier.put_many([(_key(3), b"d" * VALUE)])  # room for three: one goes
    assert evicted == ([_key(0)] if read == "peek_many" else [_key(1)])
    tier.close()
