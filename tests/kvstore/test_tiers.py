"""What only the memory and LMDB tiers do (eviction, map growth, reopening), and LMDB damage seen through a
TieredStore. What every tier does is ``test_tier_contract.py``."""

from __future__ import annotations

import hashlib
import os
import random
import sys
import threading
from pathlib import Path

import lmdb
import pytest
from helpers import assert_same_block, key_of, make_block, run_python

from kvshelf.kvstore import (
    ConfigError,
    LMDBTier,
    MemoryTier,
    StoreFullError,
    TieredStore,
    TierUsage,
    encode_block,
)
from kvshelf.kvstore.stats import StoreEvent

MiB = 1 << 20


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def v(i: int, size: int) -> bytes:
    return bytes([i % 256]) * size


# ------------------------------------------------------------------------------------------------------------
# MemoryTier (the eviction tests below count values' bytes: charge_overhead=False; what the capacity bounds by
# default, the tier's memory, is test_memory_tier_overhead.py)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, -1, -(1 << 30), 1.5, 100.0, "100", None])
def test_memory_capacity_must_be_positive_int(capacity):
    with pytest.raises(ConfigError, match="capacity"):
        MemoryTier(capacity)


def test_memory_lru_eviction_by_bytes_get_refreshes():
    tier = MemoryTier(300, charge_overhead=False)
    evicted: list[tuple[bytes, bytes]] = []
    tier.set_eviction_callback(lambda key, value: evicted.append((key, value)))
    tier.put_many([(k(1), v(1, 100)), (k(2), v(2, 100)), (k(3), v(3, 100))])
    assert evicted == []
    assert tier.get_many([k(1)]) == [v(1, 100)]  # 1 is now the most recently used; 2 is the LRU
    tier.put_many([(k(4), v(4, 100))])
    assert evicted == [(k(2), v(2, 100))]
    assert tier.get_many([k(1), k(2), k(3), k(4)]) == [v(1, 100), None, v(3, 100), v(4, 100)]
    # order of use now: 1, 3, 4 (the get above touched them in that order) -> 1 is next out
    tier.put_many([(k(5), v(5, 100))])
    assert evicted[-1] == (k(1), v(1, 100))
    assert tier.usage().bytes == 300 and tier.usage().blocks == 3


def test_memory_evicts_only_as_many_bytes_as_needed():
    tier = MemoryTier(1000, charge_overhead=False)
    evicted: list[bytes] = []
    tier.set_eviction_callback(lambda key, value: evicted.append(key))
    tier.put_many([(k(i), v(i, 100)) for i in range(10)])
    assert tier.usage().bytes == 1000
    tier.put_many([(k(99), v(99, 250))])  # needs 250 bytes: the three oldest (300 bytes) go
    assert evicted == [k(0), k(1), k(2)]
    assert tier.usage() == TierUsage(blocks=8, bytes=950, capacity_bytes=1000)


def test_memory_overwrite_does_not_double_count():
    tier = MemoryTier(1000, charge_overhead=False)
    tier.put_many([(k(1), v(1, 400))])
    tier.put_many([(k(1), v(7, 300))])
    assert tier.usage() == TierUsage(blocks=1, bytes=300, capacity_bytes=1000)
    assert tier.get_many([k(1)]) == [v(7, 300)]
    tier.put_many([(k(1), v(8, 1000))])  # replacing with a value of exactly the capacity fits
    assert tier.usage().bytes == 1000


def test_memory_value_larger_than_capacity_is_not_stored():
    tier = MemoryTier(500, charge_overhead=False)
    evicted: list[bytes] = []
    tier.set_eviction_callback(lambda key, value: evicted.append(key))
    tier.put_many([(k(1), v(1, 200)), (k(2), v(2, 200))])
    assert tier.put_many([(k(3), v(3, 501))]) == 0
    assert tier.get_many([k(3)]) == [None]
    assert evicted == []  # nothing was evicted for a value that cannot fit anyway
    assert tier.usage() == TierUsage(blocks=2, bytes=400, capacity_bytes=500)
    assert tier.put_many([(k(4), v(4, 500))]) == 1  # exactly the capacity: everything else goes
    assert sorted(evicted) == [k(1), k(2)]
    assert tier.usage() == TierUsage(blocks=1, bytes=500, capacity_bytes=500)


def test_memory_pinned_never_evicted():
    tier = MemoryTier(300, charge_overhead=False)
    evicted: list[bytes] = []
    tier.set_eviction_callback(lambda key, value: evicted.append(key))
    tier.pin([k(1)])
    tier.put_many([(k(1), v(1, 100)), (k(2), v(2, 100)), (k(3), v(3, 100))])
    for i in range(4, 20):  # k(1) is the oldest and never touched again
        assert tier.put_many([(k(i), v(i, 100))]) == 1
    assert k(1) not in evicted
    assert tier.get_many([k(1)]) == [v(1, 100)]
    assert tier.usage().bytes == 300


def test_memory_full_of_pins_rejects_without_evicting():
    tier = MemoryTier(300, policy="lru", charge_overhead=False)  # the order of evictions below is LRU's
    evicted: list[bytes] = []
    tier.set_eviction_callback(lambda key, value: evicted.append(key))
    tier.pin([k(1), k(2)])
    tier.put_many([(k(1), v(1, 100)), (k(2), v(2, 100)), (k(3), v(3, 100))])
    assert tier.put_many([(k(4), v(4, 200))]) == 0  # would need to evict a pin
    assert evicted == []
    assert tier.get_many([k(1), k(2), k(3), k(4)]) == [v(1, 100), v(2, 100), v(3, 100), None]
    assert tier.put_many([(k(5), v(5, 100))]) == 1  # this one fits by evicting the unpinned k(3)
    assert evicted == [k(3)]
    tier.unpin([k(1)])
    assert tier.put_many([(k(6), v(6, 100))]) == 1
    assert evicted == [k(3), k(1)]
    assert tier.get_many([k(2)]) == [v(2, 100)]


# ------------------------------------------------------------------------------------------------------------
# LMDBTier
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def lmdb_path(data_dir: Path) -> Path:
    return data_dir / "lmdb"


@pytest.mark.parametrize(("initial", "maximum"), [(0, MiB), (-1, MiB), (MiB, 0), (2 * MiB, MiB)])
def test_lmdb_bad_sizes(lmdb_path, initial, maximum):
    with pytest.raises(ConfigError):
        LMDBTier(lmdb_path, initial_map_bytes=initial, max_map_bytes=maximum)


def test_lmdb_path_that_is_a_file_is_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(ConfigError, match="cannot open LMDB"):
        LMDBTier(blocker / "lmdb")


def test_lmdb_map_grows_and_keeps_everything(lmdb_path):
    tier = LMDBTier(lmdb_path, initial_map_bytes=MiB, max_map_bytes=256 * MiB, durable=False)
    try:
        assert tier.map_size == MiB
        rng = random.Random(7)
        written = {}
        for batch in range(6):  # 6 batches x 4 x 300 KB ~ 7 MB, several times the initial map
            items = [(k(batch * 10 + j), rng.randbytes(300_000)) for j in range(4)]
            assert tier.put_many(items) == 4
            written.update(items)
        tier.put_many([(k(999), rng.randbytes(3 * MiB))])  # one value larger than the whole initial map
        written[k(999)] = tier.get_many([k(999)])[0]
        assert tier.map_size > 8 * MiB
        keys = list(written)
        assert tier.get_many(keys) == [written[key] for key in keys]
        assert tier.usage().blocks == len(written)
        assert tier.usage().bytes == sum(len(x) for x in written.values())
    finally:
        tier.close()


def test_lmdb_full_raises_and_loses_nothing(lmdb_path):
    tier = LMDBTier(lmdb_path, initial_map_bytes=MiB, max_map_bytes=2 * MiB, durable=False)
    try:
        written: dict[bytes, bytes] = {}
        with pytest.raises(StoreFullError) as exc_info:
            for i in range(100):
                tier.put_many([(k(i), os.urandom(150_000))])
                written[k(i)] = tier.get_many([k(i)])[0]
        message = str(exc_info.value)
        assert "full" in message and "max_map_bytes" in message and str(2 * MiB) in message
        assert len(written) >= 5  # the map did grow from 1 MiB before filling up
        assert tier.map_size == 2 * MiB
        keys = list(written)
        assert tier.get_many(keys) == [written[key] for key in keys]
        assert tier.usage().blocks == len(written)
        assert tier.usage().bytes == sum(len(x) for x in written.values())

        # a batch that does not fit is all-or-nothing: its small first value is not stored either
        with pytest.raises(StoreFullError):
            tier.put_many([(k(500), b"small"), (k(501), os.urandom(3 * MiB))])
        assert tier.get_many([k(500), k(501)]) == [None, None]
        assert tier.get_many(keys) == [written[key] for key in keys]
        assert tier.usage().blocks == len(written)
    finally:
        tier.close()


def test_lmdb_value_larger_than_max_map(lmdb_path):
    tier = LMDBTier(lmdb_path, initial_map_bytes=MiB, max_map_bytes=2 * MiB, durable=False)
    try:
        tier.put_many([(k(1), b"keep me")])
        with pytest.raises(StoreFullError):
            tier.put_many([(k(2), os.urandom(3 * MiB))])
        assert tier.get_many([k(1), k(2)]) == [b"keep me", None]
        assert tier.usage() == TierUsage(blocks=1, bytes=7, capacity_bytes=2 * MiB)
    finally:
        tier.close()


_REOPEN_SNIPPET = """
import hashlib, json, sys
from kvshelf.kvstore import LMDBTier
tier = LMDBTier(sys.argv[1], initial_map_bytes=1 << 20, durable=False)
usage = tier.usage()
values = {key.hex(): hashlib.sha256(value).hexdigest() for key, value in zip(
    tier.keys(), tier.get_many(tier.keys()), strict=True)}
# write enough from this process that the map must grow past the other process's map size
for i in range(12):
    tier.put_many([(bytes([0xEE]) * 15 + bytes([i]), bytes([i]) * 400_000)])
tier.close()
print(json.dumps({"blocks": usage.blocks, "bytes": usage.bytes, "values": values}))
"""


def test_lmdb_reopened_in_a_new_process(lmdb_path):
    tier = LMDBTier(lmdb_path, initial_map_bytes=MiB, durable=False)
    try:
        items = [(k(i), os.urandom(1000 + 37 * i)) for i in range(20)]
        tier.put_many(items)
        tier.delete([k(3)])
        expected = {key.hex(): hashlib.sha256(value).hexdigest() for key, value in items if key != k(3)}

        # the parent keeps its environment open: LMDB tiers are shared by the processes of one machine
        seen = run_python(_REOPEN_SNIPPET, str(lmdb_path))
        assert seen["values"] == expected
        assert seen["blocks"] == 19
        assert seen["bytes"] == sum(len(value) for key, value in items if key != k(3))

        # and this process sees what the other one wrote, although the map grew under it
        new_keys = [bytes([0xEE]) * 15 + bytes([i]) for i in range(12)]
        assert tier.get_many(new_keys) == [bytes([i]) * 400_000 for i in range(12)]
        assert tier.usage().blocks == 19 + 12
        assert tier.usage().bytes == seen["bytes"] + 12 * 400_000
        tier.put_many([(k(100), b"after")])  # and can still write
        assert tier.get_many([k(100)]) == [b"after"]
    finally:
        tier.close()


def test_lmdb_reopened_in_a_new_process_after_close(lmdb_path):
    tier = LMDBTier(lmdb_path, initial_map_bytes=MiB)  # durable (the default)
    items = [(k(i), os.urandom(5000)) for i in range(8)]
    tier.put_many(items)
    tier.close()
    seen = run_python(_REOPEN_SNIPPET, str(lmdb_path))
    assert seen["blocks"] == 8 and seen["bytes"] == 8 * 5000
    assert seen["values"] == {key.hex(): hashlib.sha256(value).hexdigest() for key, value in items}


# ------------------------------------------------------------------------------------------------------------
# damage inside the LMDB file, seen through a TieredStore
# ------------------------------------------------------------------------------------------------------------


def _damage(path: Path, key: bytes, how: str) -> int:
    """Rewrite the value of ``key`` in the tier's ``blocks`` sub-db with the lmdb module directly."""
    env = lmdb.open(str(path), max_dbs=4, map_size=64 * MiB)
    try:
        blocks = env.open_db(b"blocks", create=False)
        with env.begin(write=True, db=blocks) as txn:
            value = bytearray(txn.get(key))
            if how == "payload":
                value[len(value) - 100] ^= 0x40
            elif how == "header":
                value[30] ^= 0x01
            elif how == "checksum":
                value[-1] ^= 0xFF
            elif how == "truncated":
                value = value[: len(value) // 2]
            elif how == "garbage":
                value = bytearray(os.urandom(len(value)))
            elif how == "empty":
                value = bytearray()
            else:  # pragma: no cover
                raise AssertionError(how)
            txn.put(key, bytes(value))
        return len(value)
    finally:
        env.close()


@pytest.mark.parametrize("how", ["payload", "header", "checksum", "truncated", "garbage", "empty"])
def test_damaged_lmdb_value_is_a_counted_miss_and_removed(lmdb_path, how):
    good, bad = make_block(6, namespace="ns"), make_block(7, namespace="ns")
    gk, bk = key_of(good), key_of(bad)
    tier = LMDBTier(lmdb_path, initial_map_bytes=MiB, durable=False)
    with TieredStore([tier]) as store:
        store.put_many([(gk, good), (bk, bad)])
    good_len, bad_len = len(encode_block(good, gk)), len(encode_block(bad, bk))

    damaged_len = _damage(lmdb_path, bk, how)

    tier = LMDBTier(lmdb_path, initial_map_bytes=MiB, durable=False)
    with TieredStore([MemoryTier(1 << 20), tier]) as store:
        events: list[StoreEvent] = []
        store.subscribe(events.append)
        out = store.get_many([bk, gk], fingerprint=good.fingerprint, namespace="ns")
        assert out[0] is None  # never returned
        assert_same_block(out[1], good)
        disk = store.stats()["tiers"][1]
        assert disk["name"] == "disk" and disk["corrupt"] == 1
        assert disk["hits"] == 1 and disk["misses"] == 1
        # removed from the disk tier, and not promoted into memory
        assert tier.prefix_run_length([bk]) == 0
        assert store.specs[0].tier.prefix_run_length([bk]) == 0
        assert ("removed", "disk", bk) in [(e.kind, e.tier, e.key) for e in events]
        assert tier.usage().blocks == 1
        if damaged_len == bad_len:  # (a length change behind the tier's back also skews its byte count)
            assert tier.usage().bytes == good_len
        # asking again is a plain miss, not another corrupt read
        assert store.get_many([bk], fingerprint=good.fingerprint, namespace="ns") == [None]
        assert store.stats()["tiers"][1]["corrupt"] == 1
        # the damaged block can be stored again and then served
        store.put_many([(bk, bad)])
        assert_same_block(store.get_many([bk], fingerprint=bad.fingerprint, namespace="ns")[0], bad)


def test_memory_tier_accounting_under_threads():
    tier = MemoryTier(50_000)
    evicted_bytes = [0]
    count_lock = threading.Lock()

    def on_evict(key: bytes, value: bytes) -> None:
        with count_lock:
            evicted_bytes[0] += len(value)

    tier.set_eviction_callback(on_evict)
    tier.pin([k(0)])
    tier.put_many([(k(0), v(0, 1000))])
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1500):
                i = rng.randrange(1, 200)
                if rng.random() < 0.6:
                    tier.put_many([(k(i), v(i, 100 + 37 * i))])
                elif rng.random() < 0.8:
                    value = tier.get_many([k(i)])[0]
                    assert value is None or value == v(i, 100 + 37 * i)
                else:
                    tier.delete([k(i)])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave threads as often as possible
    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(old_interval)
    if errors:
        raise errors[0]
    held = tier.get_many(tier.keys())
    usage = tier.usage()
    assert usage.blocks == len(held)
    assert usage.bytes == sum(len(x) for x in held)  # the byte count never drifts
    assert usage.bytes <= 50_000
    assert tier.get_many([k(0)]) == [v(0, 1000)]
    assert evicted_bytes[0] > 0
