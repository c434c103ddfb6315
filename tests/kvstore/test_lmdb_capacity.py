"""The bounded LMDB tier (``LMDBTier(capacity_bytes=...)``): eviction through the policy interface, the file
bound (capacity + slack, space reused), pins, eviction callbacks seen by the ``TieredStore``, crash safety under
SIGKILL, untorn reads while evicting, restarts (the policy learns the held keys) and processes sharing one
environment. Every test runs on a real LMDB environment; the crash and sharing tests on real processes."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import REPO_ROOT, key_of, make_block

from kvshelf.bench.lmdb_capacity import make_value, value_version
from kvshelf.kvstore import ConfigError, LMDBTier, MemoryTier, TieredStore, open_embedded_store
from kvshelf.kvstore.lmdb_tier import bounded as lmdb_bounded
from kvshelf.kvstore.lmdb_tier import lmdb_slack_bytes
from kvshelf.kvstore.stats import StoreEvent

KiB, MiB = 1 << 10, 1 << 20


def key(i: int | str) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def file_size(tier: LMDBTier) -> int:
    return os.path.getsize(tier.path / "data.mdb")


def bounded(path: Path, capacity: int, **kwargs) -> LMDBTier:
    return LMDBTier(path, capacity_bytes=capacity, durable=False, **kwargs)


def check_held(tier: LMDBTier) -> dict[bytes, int]:
    """Every held value verifies against its key; the byte counter is their sum; the index is consistent.
    Returns key -> version."""
    keys = tier.keys()
    values = tier.get_many(keys)
    versions = {}
    for k, value in zip(keys, values, strict=True):
        assert value is not None
        version = value_version(k, value)
        assert version is not None, f"block {k.hex()} is damaged or belongs to another key"
        versions[k] = version
    usage = tier.usage()
    assert usage.blocks == len(keys) and usage.bytes == sum(map(len, values))
    assert tier.audit() == []
    return versions


# ------------------------------------------------------------------------------------------------------------
# bad inputs


@pytest.mark.parametrize("capacity", [0, -1, -MiB, True, False, 1.5, "16MiB"])
def test_bad_capacity_is_a_config_error_naming_it(tmp_path, capacity):
    with pytest.raises(ConfigError, match="capacity") as info:
        LMDBTier(tmp_path / "lmdb", capacity_bytes=capacity)
    assert repr(capacity) in str(info.value) and "at least 1" in str(info.value)
    assert not (tmp_path / "lmdb" / "data.mdb").exists()


def test_bad_slack_and_too_small_disk_capacity(tmp_path):
    with pytest.raises(ConfigError, match=r"slack_bytes.*at least 262144.*got 1000"):
        LMDBTier(tmp_path / "lmdb", capacity_bytes=MiB, slack_bytes=1000)
    with pytest.raises(ConfigError, match=r"max_disk_bytes: '64KiB' is below the minimum disk capacity of 1048576"):
        open_embedded_store(tmp_path / "data", max_disk_bytes="64KiB")


def test_unknown_policy_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown eviction policy 'belady'; known policies: .*lru"):
        LMDBTier(tmp_path / "lmdb", capacity_bytes=MiB, policy="belady")


def test_value_larger_than_capacity_is_not_stored_and_counted_rejected(tmp_path):
    tier = bounded(tmp_path / "lmdb", 256 * KiB)
    store = TieredStore([tier])
    small = make_block(list(range(8)))
    store.put_many([(key_of(small), small)])
    big = make_block(list(range(100, 108)), head_dim=4096)  # 2 x 2 x 2 x 8 x 4096 x 4 bytes: 1 MiB of payload
    assert store.put_many([(key_of(big), big)]) == 0
    counters = store.stats()["tiers"][0]
    assert counters["rejected"] == 1 and counters["evictions"] == 0
    assert tier.keys() == [key_of(small)] and tier.audit() == []
    store.close()


# ------------------------------------------------------------------------------------------------------------
# capacity, file bound, space reused


def test_stays_under_capacity_and_the_file_under_capacity_plus_slack(tmp_path):
    capacity = 4 * MiB
    tier = bounded(tmp_path / "lmdb", capacity)
    assert tier.slack_bytes == lmdb_slack_bytes(capacity) and tier.map_size == capacity + tier.slack_bytes
    evicted: list[tuple[bytes, bytes]] = []
    tier.set_eviction_callback(lambda k, v: evicted.append((k, v)))
    rng = random.Random(5)
    written = 0
    for i in range(400):  # ~40 MiB through a 4 MiB tier: without reuse the file would be 10x the capacity
        value = make_value(key(i), i, rng.randint(16 * KiB, 256 * KiB))
        assert tier.put_many([(key(i), value)]) == 1
        written += len(value)
        assert tier.usage().bytes <= capacity
        assert file_size(tier) <= capacity + tier.slack_bytes
    assert written > 5 * (capacity + tier.slack_bytes)
    held = check_held(tier)
    assert tier.usage().bytes > capacity - 256 * KiB  # full, not emptied
    assert len(evicted) == len({k for k, _ in evicted}) == 400 - len(held)
    assert all(value_version(k, v) is not None for k, v in evicted), "an eviction reported a wrong value"
    assert set(held) | {k for k, _ in evicted} == {key(i) for i in range(400)}


def test_lru_evicts_the_oldest_and_a_read_refreshes(tmp_path):
    tier = bounded(tmp_path / "lmdb", 100 * KiB, policy="lru")
    for i in range(10):
        tier.put_many([(key(i), make_value(key(i), 0, 10 * KiB))])
    tier.get_many([key(0)])
    tier.put_many([(key(10), make_value(key(10), 0, 10 * KiB))])
    assert set(tier.keys()) == {key(i) for i in (0, *range(2, 11))}  # key 1 went, key 0 was read


def test_a_batch_larger_than_one_transaction_is_split_and_fully_accounted(tmp_path):
    capacity = 2 * MiB  # txn_bytes: 64 KiB
    tier = bounded(tmp_path / "lmdb", capacity, policy="lru")
    batch = [(key(i), make_value(key(i), 1, 40 * KiB)) for i in range(80)]  # 3.2 MiB in one call
    assert tier.put_many(batch) == 80  # each stored, the early ones evicted by the later ones
    assert tier.usage().bytes <= capacity
    assert set(check_held(tier)) == {key(i) for i in range(80 - len(tier.keys()), 80)}


def test_a_full_map_is_met_by_evicting_more_never_by_growing(tmp_path):
    # the smallest slack: fragmentation and the pages freed by the last two commits often leave no room for a
    # put; the tier then evicts more in a transaction of its own and retries
    capacity = 2 * MiB
    tier = bounded(tmp_path / "lmdb", capacity, slack_bytes=256 * KiB)
    rng = random.Random(9)
    for i in range(300):
        k = key(rng.randrange(40))
        assert tier.put_many([(k, make_value(k, i, rng.randint(8 * KiB, 200 * KiB)))]) == 1
        assert file_size(tier) <= tier.map_size == capacity + 256 * KiB
    assert tier.map_full_retries > 0, "the test did not reach a full map"
    check_held(tier)
    assert set(tier._known) == set(tier.keys()), "the policy's keys differ from the held keys"


def test_a_reader_holding_an_old_snapshot_makes_puts_fail_soft_not_the_file_grow(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_bounded, "_READER_WAIT_S", 0.05)  # how long a put waits for the reader to end
    capacity = MiB
    tier = bounded(tmp_path / "lmdb", capacity, slack_bytes=256 * KiB)
    for i in range(8):
        tier.put_many([(key(i), make_value(key(i), 0, 100 * KiB))])
    reader = subprocess.Popen(
        [sys.executable, "-P", "-c", _HOLD_READER, str(tier.path)], cwd=REPO_ROOT, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert reader.stdout.readline().strip() == "reading", reader.stderr.read()
        before = set(tier.keys())
        results = [tier.put_many([(key(f"r{i}"), make_value(key(f"r{i}"), 0, 120 * KiB))]) for i in range(12)]
        assert results[-3:] == [0, 0, 0]  # not stored: the pages the reader holds cannot be reused
        assert file_size(tier) <= tier.map_size
        assert 0 < len(before - set(tier.keys())) <= sum(results)  # refused puts evicted nothing
    finally:
        reader.stdin.close()
        reader.wait(timeout=30)
    for i in range(30):  # the reader gone: every put is stored again
        assert tier.put_many([(key(f"s{i}"), make_value(key(f"s{i}"), 0, 120 * KiB))]) == 1
    check_held(tier)


_HOLD_READER = """
import sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=8, map_size=1 << 30)
txn = env.begin()
txn.get(b"x")
print("reading", flush=True)
sys.stdin.read()
txn.abort()
"""


# ------------------------------------------------------------------------------------------------------------
# pins, callbacks, the store's counters and events


def test_pinned_keys_are_never_evicted_and_a_put_needing_them_is_refused(tmp_path):
    tier = bounded(tmp_path / "lmdb", 100 * KiB)
    evicted: list[bytes] = []
    tier.set_eviction_callback(lambda k, v: evicted.append(k))
    for i in range(5):
        tier.put_many([(key(i), make_value(key(i), 0, 20 * KiB))])
    tier.pin([key(0), key(1), key(2), key(3)])
    for i in range(5, 25):  # churn: only key 4 and the new ones may go
        assert tier.put_many([(key(i), make_value(key(i), 0, 20 * KiB))]) == 1
    assert not {key(0), key(1), key(2), key(3)} & set(evicted)
    assert tier.put_many([(key("big"), make_value(key("big"), 0, 30 * KiB))]) == 0  # 80 KiB pinned + 30 > 100
    assert key(24) in set(tier.keys()), "a refused put evicted an unpinned key"
    tier.unpin([key(0), key(1), key(2), key(3)])
    assert tier.put_many([(key("big"), make_value(key("big"), 0, 30 * KiB))]) == 1
    check_held(tier)


def test_store_counts_evictions_emits_events_and_pins_hold(tmp_path):
    tier = LMDBTier(tmp_path / "lmdb", capacity_bytes=128 * KiB, durable=False)
    store = TieredStore([tier])
    events: list[StoreEvent] = []
    store.subscribe(events.append)
    blocks = [make_block(list(range(100 * i, 100 * i + 16)), head_dim=64) for i in range(20)]  # ~32 KiB each
    pinned = key_of(blocks[0])
    store.put_many([(pinned, blocks[0])], pin=True)
    for block in blocks[1:]:
        assert store.put_many([(key_of(block), block)]) == 1
    evicted = [e for e in events if e.kind == "evicted"]
    assert len(evicted) >= 15 and all(e.tier == "disk" and e.nbytes > 0 for e in evicted)
    assert pinned not in {e.key for e in evicted} and pinned in set(tier.keys())
    row = store.stats()["tiers"][0]
    assert row["evictions"] == len(evicted) and row["capacity_bytes"] == 128 * KiB
    assert row["bytes"] <= 128 * KiB
    store.close()


def test_write_back_moves_what_the_disk_tier_evicts_one_tier_down(tmp_path):
    disk = LMDBTier(tmp_path / "lmdb", capacity_bytes=64 * KiB, durable=False)
    below = MemoryTier(16 * MiB, name="below")
    store = TieredStore([disk, below], write_policy="back")
    blocks = [make_block(list(range(100 * i, 100 * i + 16)), head_dim=64) for i in range(10)]
    for block in blocks:
        store.put_many([(key_of(block), block)])
    gone = {key_of(b) for b in blocks} - set(disk.keys())
    assert gone and gone <= set(below.keys())
    got = store.get_many([key_of(b) for b in blocks], fingerprint=blocks[0].fingerprint)
    assert all(g is not None for g in got)
    store.close()


# ------------------------------------------------------------------------------------------------------------
# reads are never torn


def test_a_reader_thread_never_sees_a_torn_block_while_the_writer_evicts(tmp_path):
    tier = bounded(tmp_path / "lmdb", 2 * MiB)
    pool = [key(i) for i in range(60)]
    stop = threading.Event()
    seen = {"reads": 0, "hits": 0, "wrong": 0}
    failures: list[BaseException] = []

    def read() -> None:
        rng = random.Random(1)
        try:
            while not stop.is_set():
                keys = rng.sample(pool, 4)
                for k, value in zip(keys, tier.get_many(keys), strict=True):
                    seen["reads"] += 1
                    if value is not None:
                        seen["hits"] += 1
                        if value_version(k, value) is None:
                            seen["wrong"] += 1
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    rng = random.Random(2)
    try:
        for i in range(400):  # each put evicts: ~20x the capacity written
            k = rng.choice(pool)
            tier.put_many([(k, make_value(k, i, rng.randint(16 * KiB, 200 * KiB)))])
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert not failures, failures
    assert seen["hits"] > 100 and seen["wrong"] == 0, seen
    assert file_size(tier) <= tier.map_size
    check_held(tier)


# ------------------------------------------------------------------------------------------------------------
# crashes


_CRASH_WRITER = """
import hashlib, random, sys
from kvshelf.bench.lmdb_capacity import make_value
from kvshelf.kvstore.lmdb_tier import LMDBTier
tier = LMDBTier(sys.argv[1], capacity_bytes=1 << 20, durable=False)
rng = random.Random(int(sys.argv[2]))
i = 0
while True:
    batch = []
    for _ in range(rng.randint(1, 3)):
        k = hashlib.blake2b(str(rng.randrange(50)).encode(), digest_size=16).digest()
        batch.append((k, make_value(k, i, rng.randint(4 << 10, 160 << 10))))
        i += 1
    tier.put_many(batch)
    if i % 20 < 3:
        tier.delete([batch[0][0]])
    print(i, flush=True)
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_while_evicting_loses_nothing_but_the_transactions_victims(tmp_path, seed):
    path = tmp_path / "lmdb"
    proc = subprocess.Popen([sys.executable, "-P", "-c", _CRASH_WRITER, str(path), str(seed)], cwd=REPO_ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stop_at = 150 + 97 * seed  # well past the capacity: every put evicts
        for line in proc.stdout:
            if int(line) >= stop_at:
                break
        assert proc.poll() is None, proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    tier = bounded(path, MiB, policy="lru")  # the same capacity: opening checks the file and evicts nothing
    held = check_held(tier)
    assert held and tier.usage().bytes <= MiB
    # the tier goes on: the policy knows every held key (evicting them, oldest write first)
    for i in range(40):
        tier.put_many([(key(f"after{i}"), make_value(key(f"after{i}"), 0, 100 * KiB))])
    assert not set(held) & set(tier.keys())
    check_held(tier)


# ------------------------------------------------------------------------------------------------------------
# restarts and several processes


def test_after_a_restart_the_policy_evicts_the_old_keys_oldest_write_first(tmp_path):
    path = tmp_path / "lmdb"
    tier = bounded(path, 100 * KiB, policy="lru")
    for i in range(10):
        tier.put_many([(key(i), make_value(key(i), 0, 10 * KiB))])
    tier.put_many([(key(3), make_value(key(3), 1, 10 * KiB))])  # rewritten: now the newest write
    tier.close()
    tier = bounded(path, 100 * KiB, policy="lru")
    assert set(tier._known) == {key(i) for i in range(10)}
    evicted: list[bytes] = []
    tier.set_eviction_callback(lambda k, v: evicted.append(k))
    for i in range(10, 13):
        tier.put_many([(key(i), make_value(key(i), 0, 10 * KiB))])
    assert evicted == [key(0), key(1), key(2)]
    for i in range(13, 20):
        tier.put_many([(key(i), make_value(key(i), 0, 10 * KiB))])
    assert evicted[3:] == [key(4), key(5), key(6), key(7), key(8), key(9), key(3)]
    check_held(tier)


def test_reopening_with_a_smaller_capacity_evicts_down_to_it(tmp_path):
    path = tmp_path / "lmdb"
    tier = bounded(path, MiB)
    for i in range(20):
        tier.put_many([(key(i), make_value(key(i), 0, 50 * KiB))])
    tier.close()
    tier = bounded(path, 300 * KiB, policy="lru")
    assert tier.usage().bytes <= 300 * KiB and set(tier.keys()) == {key(i) for i in range(14, 20)}
    check_held(tier)


def test_an_environment_written_unbounded_is_indexed_when_opened_bounded(tmp_path):
    path = tmp_path / "lmdb"
    tier = LMDBTier(path, durable=False)  # unbounded: writes keep no index
    tier.put_many([(key(i), make_value(key(i), 0, 30 * KiB)) for i in range(10)])
    tier.delete([key(0)])
    tier.close()
    tier = bounded(path, 400 * KiB)
    assert tier.audit() == [] and tier.usage().bytes == 9 * 30 * KiB
    tier.put_many([(key(99), make_value(key(99), 0, 200 * KiB))])
    assert tier.usage().bytes <= 400 * KiB and key(99) in set(tier.keys())
    check_held(tier)
    tier.close()
    tier = LMDBTier(path, durable=False)  # an unbounded reader (kvshelf stats --data-dir) sees the capacity
    assert tier.usage().capacity_bytes == 400 * KiB


_OTHER_PROCESS = """
import hashlib, sys
from kvshelf.bench.lmdb_capacity import make_value
from kvshelf.kvstore.lmdb_tier import LMDBTier
tier = LMDBTier(sys.argv[1], capacity_bytes=int(sys.argv[2]), durable=False)
key = lambda i: hashlib.blake2b(str(i).encode(), digest_size=16).digest()
if sys.argv[3] == "fill":
    for i in range(10):
        tier.put_many([(key(f"other{i}"), make_value(key(f"other{i}"), 0, 10 << 10))])
else:
    print(tier.delete([key(i) for i in sys.argv[4].split(",")]))
tier.close()
"""


def _other(path: Path, capacity: int, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-P", "-c", _OTHER_PROCESS, str(path), str(capacity), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_processes_sharing_one_environment(tmp_path):
    path, capacity = tmp_path / "lmdb", 100 * KiB
    tier = bounded(path, capacity, policy="lru")
    evicted: list[bytes] = []
    tier.set_eviction_callback(lambda k, v: evicted.append(k))
    # another process fills the environment with keys this process's policy never saw
    _other(path, capacity, "fill")
    assert tier.usage().bytes == capacity and tier._known == {}
    # this process has nothing of its own to evict: the oldest persisted writes go
    tier.put_many([(key(0), make_value(key(0), 0, 20 * KiB))])
    assert evicted == [key("other0"), key("other1")]
    # the other process deletes the key this process's policy holds (and would evict first)
    _other(path, capacity, "delete", "0")
    evicted.clear()
    tier.put_many([(key(1), make_value(key(1), 0, 30 * KiB))])
    assert evicted == [key("other2")], "the removed key was not skipped, or the oldest write did not go"
    assert set(tier._known) == {key(1)}
    assert tier.usage().bytes <= capacity
    check_held(tier)
