"""The GPU tier (``kvstore.device_tier``) and the store reading it first: run with ``device="cpu"`` (the same code
as on CUDA; a GPU machine runs ``kvshelf bench gpu``). What a CUDA device this machine lacks does is tested here
too: a ``ConfigError`` before anything is opened."""

from __future__ import annotations

import pytest
import torch
from helpers import FINGERPRINT, key_of, make_block

from kvshelf.kvstore import ConfigError, open_embedded_store
from kvshelf.kvstore.device_tier import GPU_TIER_NAME, DeviceTier
from kvshelf.kvstore.memory_tier import MemoryTier
from kvshelf.kvstore.store import TieredStore

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a machine without CUDA")


def _tier_stats(store: TieredStore, name: str) -> dict:
    return next(t for t in store.stats()["tiers"] if t["name"] == name)


def test_blocks_round_trip_as_owned_copies() -> None:
    tier = DeviceTier(1 << 20, "cpu")
    block = make_block(8, seed=1)
    assert tier.put_many([(key_of(block), block)]) == 1
    (held,) = tier.get_many([key_of(block)])
    assert torch.equal(held.keys, block.keys) and torch.equal(held.values, block.values)
    assert held.keys.data_ptr() != block.keys.data_ptr()  # the tier owns its tensors
    assert held.token_ids == block.token_ids and held.fingerprint == FINGERPRINT
    assert tier.usage().blocks == 1 and tier.usage().bytes == block.nbytes


def test_capacity_evicts_by_the_policy_and_refuses_a_larger_block() -> None:
    blocks = [make_block(8, seed=i, start_pos=8 * i) for i in range(4)]
    size = blocks[0].nbytes
    tier = DeviceTier(3 * size, "cpu", policy="lru")
    assert tier.put_many([(key_of(b), b) for b in blocks[:3]]) == 3
    tier.get_many([key_of(blocks[0])])  # recently used: the LRU victim is blocks[1]
    assert tier.put_many([(key_of(blocks[3]), blocks[3])]) == 1
    assert tier.holds([key_of(b) for b in blocks]) == [True, False, True, True]
    assert tier.usage().bytes <= 3 * size
    big = make_block(32, seed=9)
    assert tier.put_many([(key_of(big), big)]) == 0  # larger than the whole tier: not stored, nothing evicted
    assert tier.usage().blocks == 3


def test_delete_prefix_and_contains() -> None:
    tier = DeviceTier(1 << 20, "cpu")
    a, b = make_block(4, seed=1), make_block(4, seed=2, start_pos=4)
    tier.put_many([(key_of(a), a), (key_of(b), b)])
    assert tier.prefix_run_length([key_of(a), key_of(b)]) == 2
    assert tier.delete([key_of(a), b"\0" * 16]) == 1
    assert tier.prefix_run_length([key_of(a), key_of(b)]) == 0
    assert tier.delete_prefix(key_of(b)[:4]) == [key_of(b)]
    assert tier.usage().blocks == 0


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
def test_a_capacity_that_is_not_a_positive_int_is_refused(capacity: object) -> None:
    with pytest.raises(ConfigError, match="GPU tier capacity"):
        DeviceTier(capacity, "cpu")  # type: ignore[arg-type]


def test_a_device_that_is_not_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a torch device"):
        DeviceTier(1 << 20, "gpu0")


@no_cuda
def test_a_cuda_tier_without_cuda_is_refused_before_anything_is_opened(tmp_path) -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        open_embedded_store(tmp_path / "store", gpu_bytes="1GiB")
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())
    with pytest.raises(ConfigError, match="gpu_bytes"):
        open_embedded_store(tmp_path / "store", gpu_bytes="lots", device="cpu")


def test_the_store_writes_through_and_reads_the_device_tier_first(tmp_path) -> None:
    store = open_embedded_store(tmp_path, gpu_bytes="1MiB", device="cpu", durable=False)
    try:
        assert isinstance(store.device_tier, DeviceTier)
        blocks = [make_block(8, seed=i, start_pos=8 * i) for i in range(3)]
        store.put_many([(key_of(b), b) for b in blocks])
        keys = [key_of(b) for b in blocks]
        assert store.lookup_prefix(keys, model=FINGERPRINT) == 3
        prepared = store.get_prepared_many(keys, fingerprint=FINGERPRINT, tokens=[8, 8, 8])
        got = store.get_many(keys, fingerprint=FINGERPRINT)
        gpu = _tier_stats(store, GPU_TIER_NAME)
        assert gpu["hits"] == 6 and gpu["misses"] == 0 and gpu["blocks"] == 3
        assert _tier_stats(store, "memory")["hits"] == 0  # never asked: the device tier had them all
        for block, p, g in zip(blocks, prepared, got, strict=True):
            out_k, out_v = torch.empty_like(block.keys), torch.empty_like(block.values)
            p.payload.write(out_k, out_v)
            assert torch.equal(out_k, block.keys) and torch.equal(out_v, block.values)
            assert torch.equal(g.keys, block.keys) and g.start_pos == block.start_pos
        assert store.stats()["retrieve_hit_rate"] == 1.0
    finally:
        store.close()


def test_a_device_tier_miss_falls_through_and_a_foreign_block_is_never_served(tmp_path) -> None:
    device = DeviceTier(1 << 20, "cpu")
    store = TieredStore([MemoryTier(1 << 20)], device_tier=device)
    mine, theirs = make_block(8, seed=1), make_block(8, seed=2, start_pos=8)
    store.put_many([(key_of(mine), mine), (key_of(theirs), theirs)])
    # the device tier holds another tenant's block under this key (it can only come from a bug): a foreign miss
    other = make_block(8, seed=2, start_pos=8, namespace="other")
    device.put_many([(key_of(theirs), other)])
    device.delete([key_of(mine)])
    got = store.get_prepared_many([key_of(mine), key_of(theirs)], fingerprint=FINGERPRINT)
    assert got[0] is not None and got[1] is not None and got[1].namespace == "default"
    gpu = _tier_stats(store, GPU_TIER_NAME)
    assert gpu["foreign"] == 1 and gpu["misses"] == 2 and gpu["hits"] == 0
    assert _tier_stats(store, "memory")["hits"] == 2
    store.close()


def test_device_tier_evictions_are_counted(tmp_path) -> None:
    blocks = [make_block(8, seed=i, start_pos=8 * i) for i in range(3)]
    store = TieredStore([MemoryTier(1 << 20)], device_tier=DeviceTier(2 * blocks[0].nbytes, "cpu"))
    store.put_many([(key_of(b), b) for b in blocks])
    gpu = _tier_stats(store, GPU_TIER_NAME)
    assert gpu["evictions"] == 1 and gpu["blocks"] == 2
    assert _tier_stats(store, "memory")["blocks"] == 3  # the tiers below keep what the device tier drops
    store.close()


def test_delete_and_clear_reach_the_device_tier(tmp_path) -> None:
    store = open_embedded_store(tmp_path, gpu_bytes="1MiB", device="cpu", durable=False)
    try:
        a, b = make_block(4, seed=1), make_block(4, seed=2, start_pos=4)
        store.put_many([(key_of(a), a), (key_of(b), b)])
        assert store.delete([key_of(a)]) == 1
        assert store.device_tier.holds([key_of(a), key_of(b)]) == [False, True]
        assert store.held([key_of(b)]) == [True]
        store.clear_prefix(key_of(b)[:3])
        assert store.device_tier.usage().blocks == 0
    finally:
        store.close()


def test_offered_blocks_are_counted_writes_of_the_device_tier(tmp_path) -> None:
    store = TieredStore([MemoryTier(1 << 20)], device_tier=DeviceTier(1 << 20, "cpu"))
    block = make_block(8, seed=3)
    assert store.offer_device([(key_of(block), block)]) == 1
    assert _tier_stats(store, GPU_TIER_NAME)["bytes_written"] == block.nbytes
    assert _tier_stats(store, "memory")["blocks"] == 0  # offered to the device tier only
    assert TieredStore([MemoryTier(1 << 20)]).offer_device([(key_of(block), block)]) == 0
    store.close()


def test_device_cache_of_gives_the_device_layer_or_none() -> None:
    """What a load offers its blocks to, typed (``kvstore.protocol.DeviceCache``), without probing the store."""
    from kvshelf.kvstore.protocol import device_cache_of

    store = TieredStore([MemoryTier(1 << 20)], device_tier=DeviceTier(1 << 20, "cpu"))
    block = make_block(8, seed=4)
    cache = device_cache_of(store)
    assert cache is not None and cache is store.device_cache and cache.device == torch.device("cpu")
    assert cache.holds([key_of(block)]) == [False]
    assert cache.offer([(key_of(block), block)]) == 1 and cache.holds([key_of(block)]) == [True]
    assert _tier_stats(store, GPU_TIER_NAME)["bytes_written"] == block.nbytes
    assert device_cache_of(TieredStore([MemoryTier(1 << 20)])) is None
    assert device_cache_of(None) is None
    store.close()


def test_pinned_memory_is_the_default_only_with_a_cuda_gpu_tier(tmp_path) -> None:
    from kvshelf.kvstore.pinned_memory import PinnedMemoryTier

    plain = open_embedded_store(tmp_path / "a", gpu_bytes="1MiB", device="cpu", durable=False)
    pinned = open_embedded_store(tmp_path / "b", pin_memory=True, durable=False)
    try:
        assert type(plain.specs[0].tier) is MemoryTier
        assert isinstance(pinned.specs[0].tier, PinnedMemoryTier)
        block = make_block(8, seed=4)
        pinned.put_many([(key_of(block), block)])
        (value,) = pinned.specs[0].tier.get_many([key_of(block)])
        assert isinstance(value, memoryview)
        (back,) = pinned.get_many([key_of(block)], fingerprint=FINGERPRINT)
        assert torch.equal(back.keys, block.keys)
    finally:
        plain.close()
        pinned.close()
