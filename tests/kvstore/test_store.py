"""TieredStore: read-through and promotion, write-through/back, pins, events, counters, the embedded store."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest
import torch
from helpers import FINGERPRINT, assert_same_block, key_of, make_block

from kvshelf.kvstore import (
    CodecParamError,
    ConfigError,
    LMDBTier,
    MemoryTier,
    StoreEvent,
    StoreFullError,
    TieredStore,
    TierSpec,
    UnknownCodecError,
    encode_block,
    open_embedded_store,
    parse_size,
    prefix_block_keys,
)

MiB = 1 << 20
FP = FINGERPRINT
BLOCK_BYTES = len(encode_block(make_block(4), key_of(make_block(4))))  # ~1.3 KB encoded


def tier_stats(store: TieredStore, name: str) -> dict:
    (row,) = [t for t in store.stats()["tiers"] if t["name"] == name]
    return row


def blocks(n: int, namespace: str = "default", tokens: int = 4) -> list:
    """``n`` distinct blocks and their keys."""
    out = []
    for i in range(n):
        block = make_block([1000 * i + j for j in range(tokens)], namespace=namespace)
        out.append((key_of(block), block))
    return out


@pytest.fixture
def make_store(data_dir: Path):
    """Build a memory-over-LMDB TieredStore in the test's data dir; closed at teardown."""
    made: list[TieredStore] = []

    def factory(memory_bytes: int = 64 * 1024, write_policy: str = "through", **lmdb_kwargs) -> TieredStore:
        lmdb_kwargs.setdefault("initial_map_bytes", MiB)
        lmdb_kwargs.setdefault("durable", False)
        # capacities here are counted in blocks' bytes (charge_overhead=False): a memory tier of 2.5 blocks holds 2
        memory = MemoryTier(memory_bytes, name="memory", charge_overhead=False)
        store = TieredStore(
            [memory, LMDBTier(data_dir / f"lmdb{len(made)}", **lmdb_kwargs)],
            write_policy=write_policy,
        )
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


@pytest.fixture
def store(make_store) -> TieredStore:
    return make_store()


def mem(store: TieredStore):
    return store.specs[0].tier


def disk(store: TieredStore):
    return store.specs[1].tier


# ------------------------------------------------------------------------------------------------------------
# writes and reads
# ------------------------------------------------------------------------------------------------------------


def test_write_through_reaches_every_tier(store):
    entries = blocks(3)
    assert store.put_many(entries) == 3
    keys = [key for key, _ in entries]
    assert mem(store).prefix_run_length(keys) == 3
    assert disk(store).prefix_run_length(keys) == 3
    for name in ("memory", "disk"):
        row = tier_stats(store, name)
        assert row["blocks"] == 3
        assert row["bytes_written"] == row["bytes"] == sum(len(encode_block(b, k)) for k, b in entries)
    out = store.get_many(keys, fingerprint=FP)
    for got, (_, block) in zip(out, entries, strict=True):
        assert_same_block(got, block)
    assert store.put_many([]) == 0


def test_read_through_promotes_into_memory(store):
    (key, block), (key2, block2) = blocks(2)
    store.put_many([(key, block), (key2, block2)])
    mem(store).delete([key])  # now only on disk
    assert mem(store).prefix_run_length([key]) == 0

    got = store.get_many([key], fingerprint=FP)[0]
    assert_same_block(got, block)
    m, d = tier_stats(store, "memory"), tier_stats(store, "disk")
    assert (m["hits"], m["misses"], m["bytes_read"]) == (0, 1, 0)
    assert (d["hits"], d["misses"], d["bytes_read"]) == (1, 0, len(encode_block(block, key)))
    assert mem(store).prefix_run_length([key]) == 1  # promoted
    size, size2 = len(encode_block(block, key)), len(encode_block(block2, key2))
    assert m["bytes_written"] == size + size2 + size  # the two puts, then the promotion
    assert d["bytes_written"] == size + size2

    got = store.get_many([key], fingerprint=FP)[0]  # second read is served by memory
    assert_same_block(got, block)
    m, d = tier_stats(store, "memory"), tier_stats(store, "disk")
    assert (m["hits"], m["misses"]) == (1, 1)
    assert (d["hits"], d["misses"]) == (1, 0)
    assert m["bytes_read"] == len(encode_block(block, key))


def test_get_many_keeps_order_and_counts_per_tier(store):
    (k_mem, b_mem), (k_disk, b_disk), (k_none, _) = blocks(3)
    store.put_many([(k_mem, b_mem), (k_disk, b_disk)])
    mem(store).delete([k_disk])
    out = store.get_many([k_disk, k_none, k_mem], fingerprint=FP)
    assert_same_block(out[0], b_disk)
    assert out[1] is None
    assert_same_block(out[2], b_mem)
    m, d = tier_stats(store, "memory"), tier_stats(store, "disk")
    assert (m["hits"], m["misses"]) == (1, 2)
    assert (d["hits"], d["misses"]) == (1, 1)
    assert store.stats()["retrieve_hit_rate"] == pytest.approx(2 / 3)
    assert store.get_many([], fingerprint=FP) == []


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_get_many_copy_false(store, where):
    entries = blocks(4) + [(key_of(b), b) for b in [make_block(5, dtype=torch.bfloat16, start_pos=3)]]
    store.put_many(entries)
    if where == "disk":
        mem(store).delete([k for k, _ in entries])
    out = store.get_many([k for k, _ in entries], fingerprint=FP, copy=False)
    for got, (_, block) in zip(out, entries, strict=True):
        assert_same_block(got, block)
    again = store.get_many([k for k, _ in entries], fingerprint=FP, copy=True)
    for got, (_, block) in zip(again, entries, strict=True):
        assert_same_block(got, block)


def test_write_back_moves_evicted_values_down(make_store):
    store = make_store(memory_bytes=int(3.5 * BLOCK_BYTES), write_policy="back")
    events: list[StoreEvent] = []
    store.subscribe(events.append)
    entries = blocks(6)
    for key, block in entries:
        assert store.put_many([(key, block)]) == 1
    keys = [k for k, _ in entries]
    # only the memory tier was written; the three oldest were evicted into the disk tier
    assert sorted(mem(store).keys()) == sorted(keys[3:])
    assert sorted(disk(store).keys()) == sorted(keys[:3])
    assert [e.key for e in events if e.kind == "evicted"] == keys[:3]
    assert all(e.tier == "memory" for e in events if e.kind == "evicted")
    assert [e.key for e in events if e.kind == "stored" and e.tier == "memory"] == keys
    assert [e.key for e in events if e.kind == "stored" and e.tier == "disk"] == keys[:3]  # written down
    assert tier_stats(store, "disk")["bytes_written"] > 0
    assert tier_stats(store, "memory")["evictions"] == 3
    assert tier_stats(store, "disk")["evictions"] == 0
    out = store.get_many(keys, fingerprint=FP)
    for got, (_, block) in zip(out, entries, strict=True):
        assert_same_block(got, block)


def test_write_through_eviction_is_counted_but_block_stays_on_disk(make_store):
    store = make_store(memory_bytes=int(2.5 * BLOCK_BYTES))
    entries = blocks(5)
    store.put_many(entries)
    assert mem(store).usage().blocks == 2
    assert disk(store).usage().blocks == 5
    assert tier_stats(store, "memory")["evictions"] == 3
    out = store.get_many([k for k, _ in entries], fingerprint=FP)
    for got, (_, block) in zip(out, entries, strict=True):
        assert_same_block(got, block)


def test_block_larger_than_memory_is_rejected_there_but_kept_on_disk(make_store):
    store = make_store(memory_bytes=BLOCK_BYTES // 2)
    (key, block), = blocks(1)
    assert store.put_many([(key, block)]) == 0  # the first tier did not take it
    assert tier_stats(store, "memory")["rejected"] == 1
    assert tier_stats(store, "disk")["blocks"] == 1
    assert_same_block(store.get_many([key], fingerprint=FP)[0], block)


def test_store_full_on_disk_still_writes_memory_and_loses_nothing(make_store):
    store = make_store(memory_bytes=8 * MiB, initial_map_bytes=MiB, max_map_bytes=MiB)
    small = blocks(3)
    store.put_many(small)
    big = make_block(1100, head_dim=64)  # ~2.3 MB encoded: more than the whole disk map
    with pytest.raises(StoreFullError, match="max_map_bytes"):
        store.put_many([(key_of(big), big)])
    assert mem(store).prefix_run_length([key_of(big)]) == 1
    assert disk(store).prefix_run_length([key_of(big)]) == 0
    assert disk(store).prefix_run_length([k for k, _ in small]) == 3
    mem(store).delete([k for k, _ in small])
    out = store.get_many([k for k, _ in small] + [key_of(big)], fingerprint=FP)
    for got, (_, block) in zip(out, small + [(key_of(big), big)], strict=True):
        assert_same_block(got, block)


def test_damaged_memory_value_falls_through_to_disk(store):
    (key, block), = blocks(1)
    store.put_many([(key, block)])
    good = mem(store).get_many([key])[0]
    damaged = bytearray(good)
    damaged[-20] ^= 0x10
    mem(store).put_many([(key, bytes(damaged))])
    assert_same_block(store.get_many([key], fingerprint=FP)[0], block)
    assert tier_stats(store, "memory")["corrupt"] == 1
    assert tier_stats(store, "disk")["hits"] == 1
    assert mem(store).get_many([key]) == [good]  # replaced by the promoted good copy


# ------------------------------------------------------------------------------------------------------------
# pins, deletes, events
# ------------------------------------------------------------------------------------------------------------


def test_pinned_block_is_never_evicted(make_store):
    store = make_store(memory_bytes=int(3.5 * BLOCK_BYTES))
    (pk, pinned), *others = blocks(12)
    store.put_many([(pk, pinned)], pin=True)
    assert store.is_pinned(pk) and store.stats()["pinned"] == 1
    for key, block in others:
        store.put_many([(key, block)])
        store.get_many([key], fingerprint=FP)
    assert mem(store).prefix_run_length([pk]) == 1
    assert tier_stats(store, "memory")["evictions"] == len(others) - 2

    assert store.unpin([pk, pk]) == 1
    assert store.unpin([pk]) == 0
    assert not store.is_pinned(pk) and store.stats()["pinned"] == 0
    for key, block in others[:3]:
        store.put_many([(key, block)])
    assert mem(store).prefix_run_length([pk]) == 0  # evicted from memory once unpinned
    assert_same_block(store.get_many([pk], fingerprint=FP)[0], pinned)  # still on disk


def test_pin_pins_held_blocks_only(make_store):
    store = make_store(memory_bytes=int(2.5 * BLOCK_BYTES))
    entries = blocks(6)
    k0, k1 = entries[0][0], entries[1][0]
    assert store.pin([k0]) == 0  # absent: not pinned (put_many(..., pin=True) pins as it writes)
    assert not store.is_pinned(k0)
    store.put_many(entries[:1])
    assert store.pin([k0, k0, k1]) == 1  # distinct held keys
    assert store.is_pinned(k0) and not store.is_pinned(k1)
    for key, block in entries[1:]:
        store.put_many([(key, block)])
    assert mem(store).prefix_run_length([k0]) == 1
    assert tier_stats(store, "memory")["evictions"] == 4  # six blocks, two held, k0 never evicted


def test_delete_removes_from_every_tier_and_unpins(store):
    entries = blocks(3)
    (k0, _), (k1, b1), (k2, _) = entries
    store.put_many(entries, pin=True)
    assert store.delete([k0, k2, k2]) == 2  # two distinct keys, each removed from both tiers
    assert not store.is_pinned(k0) and store.is_pinned(k1)
    assert store.get_many([k0, k1, k2], fingerprint=FP)[0] is None
    assert_same_block(store.get_many([k1], fingerprint=FP)[0], b1)
    assert mem(store).usage().blocks == disk(store).usage().blocks == 1
    assert store.delete([k0]) == 0


def test_subscribe_and_unsubscribe(store):
    events: list[StoreEvent] = []
    unsubscribe = store.subscribe(events.append)
    (k0, b0), (k1, b1) = blocks(2, namespace="ns-e")
    store.put_many([(k0, b0)])
    size = len(encode_block(b0, k0))
    assert events == [
        StoreEvent("stored", "memory", k0, size, "ns-e", FP),
        StoreEvent("stored", "disk", k0, size, "ns-e", FP),
    ]
    events.clear()
    store.delete([k0])
    removed = sorted((e.kind, e.tier, e.key) for e in events)
    assert removed == [("removed", "disk", k0), ("removed", "memory", k0)]
    unsubscribe()
    events.clear()
    store.put_many([(k1, b1)])
    store.delete([k1])
    assert events == []
    unsubscribe()  # a second call is harmless


def test_removed_events_only_for_values_that_were_there(store):
    events: list[StoreEvent] = []
    store.subscribe(events.append)
    (k0, b0), (k1, b1), (k2, _) = blocks(3)
    store.put_many([(k0, b0), (k1, b1)])
    mem(store).delete([k1])  # k1 now only on disk; k2 nowhere
    events.clear()
    assert store.delete([k0, k1, k2]) == 2  # k0 and k1 were held (k1 in one tier only)
    assert sorted((e.tier, e.key) for e in events if e.kind == "removed") == sorted(
        [("memory", k0), ("disk", k0), ("disk", k1)]
    )


def test_eviction_events(make_store):
    store = make_store(memory_bytes=int(2.5 * BLOCK_BYTES))
    events: list[StoreEvent] = []
    store.subscribe(events.append)
    entries = blocks(4, namespace="ns-v")
    for key, block in entries:
        store.put_many([(key, block)])
    evicted = [e for e in events if e.kind == "evicted"]
    assert [e.key for e in evicted] == [entries[0][0], entries[1][0]]
    assert all(e.tier == "memory" and e.namespace == "ns-v" and e.model == FP for e in evicted)
    assert all(e.nbytes > 0 for e in evicted)


def test_listener_that_raises_does_not_break_the_store(store, caplog):
    seen: list[StoreEvent] = []

    def bad(event: StoreEvent) -> None:
        raise RuntimeError("listener bug")

    store.subscribe(bad)
    store.subscribe(seen.append)
    (key, block), = blocks(1)
    assert store.put_many([(key, block)]) == 1
    assert_same_block(store.get_many([key], fingerprint=FP)[0], block)
    assert store.delete([key]) == 1
    assert [e.kind for e in seen] == ["stored", "stored", "removed", "removed"]
    assert "listener" in caplog.text


# ------------------------------------------------------------------------------------------------------------
# tenants and models
# ------------------------------------------------------------------------------------------------------------


def test_other_namespace_is_never_served(store):
    (key, block), = blocks(1, namespace="alice")
    store.put_many([(key, block)])
    assert store.get_many([key], fingerprint=FP, namespace="bob") == [None]
    assert store.get_many([key], fingerprint=FP) == [None]  # the "default" namespace is another tenant too
    assert tier_stats(store, "memory")["foreign"] == 2
    assert tier_stats(store, "disk")["foreign"] == 2
    assert store.stats()["retrieve_hit_rate"] == 0.0
    # not deleted: its owner still gets it
    assert_same_block(store.get_many([key], fingerprint=FP, namespace="alice")[0], block)


def test_other_model_is_never_served(store):
    (key, block), = blocks(1)
    store.put_many([(key, block)])
    assert store.get_many([key], fingerprint="another-model") == [None]
    assert tier_stats(store, "memory")["foreign"] == 1
    assert tier_stats(store, "disk")["foreign"] == 1
    assert tier_stats(store, "memory")["hits"] == 0
    assert_same_block(store.get_many([key], fingerprint=FP)[0], block)


def test_value_under_the_wrong_key_is_foreign(store):
    (k0, b0), (k1, _) = blocks(2)
    disk(store).put_many([(k1, encode_block(b0, k0))])  # a valid block of k0 stored under k1
    assert store.get_many([k1], fingerprint=FP) == [None]
    assert tier_stats(store, "disk")["foreign"] == 1
    assert mem(store).prefix_run_length([k1]) == 0  # and not promoted


def test_counters_are_split_by_namespace_and_model(store):
    (ka, ba), = blocks(1, namespace="alice")
    (kb, bb), = blocks(1, namespace="bob")
    store.put_many([(ka, ba), (kb, bb)])
    store.get_many([ka], fingerprint=FP, namespace="alice")
    store.get_many([kb, kb], fingerprint=FP, namespace="bob")
    rows = {(r["tier"], r["namespace"], r["model"]): r for r in store.stats()["rows"]}
    assert rows[("memory", "alice", FP)]["hits"] == 1
    assert rows[("memory", "bob", FP)]["hits"] == 2
    assert rows[("disk", "alice", FP)]["blocks_written"] == 1
    assert rows[("*", "bob", FP)]["retrieve_blocks"] == 2


# ------------------------------------------------------------------------------------------------------------
# prefix lookup and stats
# ------------------------------------------------------------------------------------------------------------


def _prefix_blocks(n_blocks: int, block_size: int = 4) -> list:
    tokens = list(range(500, 500 + n_blocks * block_size))
    keys = prefix_block_keys(FP, "default", tokens, block_size)
    return [
        (key, make_block(tokens[i * block_size : (i + 1) * block_size], start_pos=i * block_size))
        for i, key in enumerate(keys)
    ]


def test_lookup_prefix_across_tiers(store):
    entries = _prefix_blocks(5)
    keys = [k for k, _ in entries]
    encoded = [(k, encode_block(b, k)) for k, b in entries]
    mem(store).put_many([encoded[0], encoded[2]])  # the prefix is split across the tiers
    disk(store).put_many([encoded[1], encoded[3]])  # and block 4 is nowhere
    assert store.lookup_prefix(keys) == 4
    assert store.lookup_prefix(keys[:4]) == 4
    assert store.lookup_prefix(keys[1:4]) == 3
    assert store.lookup_prefix([keys[4], *keys[:4]]) == 0
    assert store.lookup_prefix([]) == 0
    mem(store).delete([keys[2]])
    assert store.lookup_prefix(keys) == 2
    # lookups: 5+4+3+5+0+5 = 22 blocks asked, 4+4+3+0+0+2 = 13 found
    assert store.stats()["lookup_hit_rate"] == pytest.approx(13 / 22)

    out = store.get_many(keys, fingerprint=FP)
    for got, (_, block) in zip(out[:2], entries[:2], strict=True):
        assert_same_block(got, block)
    assert out[2] is None and out[4] is None
    assert_same_block(out[3], entries[3][1])
    assert store.lookup_prefix(keys) == 2


def test_stats_shape(store):
    s = store.stats()
    assert set(s) == {"tiers", "lookup_hit_rate", "retrieve_hit_rate", "rows", "pinned"}
    assert s["lookup_hit_rate"] is None and s["retrieve_hit_rate"] is None
    assert s["rows"] == [] and s["pinned"] == 0
    assert [t["name"] for t in s["tiers"]] == ["memory", "disk"]
    expected_fields = {"name", "codec", "available", "unavailable", "blocks", "bytes", "capacity_bytes", "hits",
                       "misses", "bytes_read", "bytes_written", "evictions", "corrupt", "foreign", "rejected",
                       "damaged"}
    for tier in s["tiers"]:
        assert set(tier) == expected_fields
        assert tier["codec"] == "raw"
        assert tier["available"] is True and tier["damaged"] is False
        assert all(tier[m] == 0 for m in expected_fields - {"name", "codec", "capacity_bytes", "available", "damaged"})
    assert s["tiers"][0]["capacity_bytes"] == 64 * 1024

    entries = blocks(3)
    store.put_many(entries[:2])
    store.get_many([k for k, _ in entries], fingerprint=FP)  # 2 of 3 found
    store.get_many([entries[0][0]], fingerprint=FP)  # 1 of 1
    store.lookup_prefix([entries[0][0], entries[2][0]])  # 1 of 2
    s = store.stats()
    assert s["retrieve_hit_rate"] == pytest.approx(3 / 4)
    assert s["lookup_hit_rate"] == pytest.approx(1 / 2)
    assert s["tiers"][0]["blocks"] == 2 and s["tiers"][0]["hits"] == 3 and s["tiers"][0]["misses"] == 1
    assert s["tiers"][1]["hits"] == 0 and s["tiers"][1]["misses"] == 1
    assert json.loads(json.dumps(s)) == s  # JSON-ready


# ------------------------------------------------------------------------------------------------------------
# configuration and the embedded store
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * MiB),
        ("2G", 2 << 30),
        ("2GiB", 2 << 30),
        ("2GB", 2 * 1000**3),
        ("1000000", 1_000_000),
        (" 3 mb ", 3_000_000),
        ("1.5KiB", 1536),
        ("10b", 10),
        ("1T", 1 << 40),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "MiB", "12 parsecs", "1e3", "5 5", "0x10", "1.2.3M", "2 GiBs"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


def test_open_embedded_store_round_trip_and_reopen(data_dir):
    entries = blocks(3)
    with open_embedded_store(data_dir, memory_bytes="1MiB", max_disk_bytes="64MiB", durable=False) as store:
        assert [s.tier.name for s in store.specs] == ["memory", "disk"]
        assert isinstance(store.specs[0].tier, MemoryTier) and store.specs[0].tier.capacity_bytes == MiB
        assert isinstance(store.specs[1].tier, LMDBTier)
        assert store.specs[1].tier.capacity_bytes == 64 * MiB  # max_disk_bytes: the disk tier's capacity
        store.put_many(entries)
    assert (data_dir / "lmdb").is_dir()
    with open_embedded_store(data_dir, memory_bytes=None, max_disk_bytes=64 * MiB) as store:
        assert [s.tier.name for s in store.specs] == ["disk"]
        out = store.get_many([k for k, _ in entries], fingerprint=FP)
        for got, (_, block) in zip(out, entries, strict=True):
            assert_same_block(got, block)


def test_open_embedded_store_default_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSHELF_DATA_DIR", str(tmp_path / "from-env"))
    with open_embedded_store(memory_bytes="1MiB", max_disk_bytes="16MiB", durable=False) as store:
        store.put_many(blocks(1))
    assert (tmp_path / "from-env" / "lmdb").is_dir()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"memory_bytes": "0"},
        {"memory_bytes": 0},
        {"memory_bytes": "-1MiB"},
        {"memory_bytes": "lots"},
        {"max_disk_bytes": "bogus"},
        {"max_disk_bytes": 0},
        {"write_policy": "around"},
    ],
)
def test_open_embedded_store_config_errors(data_dir, kwargs):
    with pytest.raises(ConfigError):
        open_embedded_store(data_dir, **kwargs)


def test_unknown_codec_in_tier_spec():
    with pytest.raises(UnknownCodecError, match="no-such-codec"):
        TierSpec(MemoryTier(1000), codec="no-such-codec")
    with pytest.raises(CodecParamError, match="bits"):
        TierSpec(MemoryTier(1000), codec="raw", codec_params={"bits": 4})
    assert TierSpec(MemoryTier(1000)).codec == "raw"


@pytest.mark.parametrize("which", ["memory_codec", "disk_codec"])
def test_unknown_codec_in_embedded_store(data_dir, which):
    with pytest.raises(UnknownCodecError, match="zzz"):
        open_embedded_store(data_dir, memory_bytes="1MiB", max_disk_bytes="16MiB", **{which: "zzz"})


def test_store_config_errors():
    with pytest.raises(ConfigError, match="at least one tier"):
        TieredStore([])
    with pytest.raises(ConfigError, match="unique"):
        TieredStore([MemoryTier(1000), MemoryTier(2000)])
    with pytest.raises(ConfigError, match="unique"):
        TieredStore([MemoryTier(1000, name="a"), TierSpec(MemoryTier(2000, name="a"))])
    with pytest.raises(ConfigError, match="write_policy"):
        TieredStore([MemoryTier(1000)], write_policy="sideways")
    store = TieredStore([MemoryTier(1000, name="a"), MemoryTier(2000, name="b")])
    assert [s.tier.name for s in store.specs] == ["a", "b"]


def test_memory_only_store(make_block):
    store = TieredStore([MemoryTier(MiB)])
    block = make_block(3)
    store.put_many([(key_of(block), block)])
    assert_same_block(store.get_many([key_of(block)], fingerprint=block.fingerprint)[0], block)


# ------------------------------------------------------------------------------------------------------------
# concurrency
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("write_policy", ["through", "back"])
def test_threads_reading_and_writing_one_store(data_dir, write_policy):
    universe = blocks(40)
    expected = dict(universe)
    keys = [k for k, _ in universe]
    n_threads, n_ops = 4, 200
    errors: list[BaseException] = []
    written: set[bytes] = set()
    written_lock = threading.Lock()
    barrier = threading.Barrier(n_threads)
    store = open_embedded_store(
        data_dir,
        memory_bytes=8 * BLOCK_BYTES,
        max_disk_bytes="64MiB",
        durable=False,
        write_policy=write_policy,
    )

    def check(got_keys, got) -> None:
        assert len(got) == len(got_keys)
        for key, block in zip(got_keys, got, strict=True):
            if block is not None:
                assert_same_block(block, expected[key])

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            barrier.wait(timeout=30)
            for _ in range(n_ops):
                op = rng.random()
                if op < 0.45:
                    batch = rng.sample(keys, rng.randint(1, 3))
                    store.put_many([(k, expected[k]) for k in batch])
                    with written_lock:
                        written.update(batch)
                    got = store.get_many(batch, fingerprint=FP)
                    check(batch, got)
                    if write_policy == "through":  # write-through: on disk before put_many returned
                        assert all(b is not None for b in got)
                elif op < 0.9:
                    batch = rng.sample(keys, rng.randint(1, 4))
                    check(batch, store.get_many(batch, fingerprint=FP, copy=rng.random() < 0.5))
                else:
                    assert 0 <= store.lookup_prefix(rng.sample(keys, 3)) <= 3
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a worker hung"
        if errors:
            raise errors[0]
        assert tier_stats(store, "memory")["evictions"] > 0  # the small memory tier really evicted
        assert store.specs[0].tier.usage().bytes <= 8 * BLOCK_BYTES
        # every block ever written is still there, intact
        final = sorted(written)
        out = store.get_many(final, fingerprint=FP)
        for key, block in zip(final, out, strict=True):
            assert_same_block(block, expected[key])
        if write_policy == "through":
            assert store.specs[1].tier.usage().blocks == len(written)
    finally:
        store.close()


def test_write_back_sends_what_memory_rejects_to_disk(make_store):
    store = make_store(memory_bytes=BLOCK_BYTES // 2, write_policy="back")  # no block fits in memory
    entries = blocks(2)
    store.put_many(entries)
    keys = [k for k, _ in entries]
    assert mem(store).keys() == []
    assert sorted(disk(store).keys()) == sorted(keys)
    assert tier_stats(store, "memory")["rejected"] == 2
    for got, (_, block) in zip(store.get_many(keys, fingerprint=FP), entries, strict=True):
        assert_same_block(got, block)


def test_encoded_round_trip_without_decoding(store):
    entries = blocks(3, namespace="tenant-a")
    encoded = [(k, encode_block(b, k)) for k, b in entries]
    assert store.put_encoded_many(encoded) == 3
    mem(store).delete([k for k, _ in entries])  # force a read from disk, then promotion
    got = store.get_encoded_many([k for k, _ in entries], namespace="tenant-a")
    assert got == [v for _, v in encoded]
    assert sorted(mem(store).keys()) == sorted(k for k, _ in entries)
    assert store.get_encoded_many([entries[0][0]], namespace="tenant-b") == [None]  # another tenant: a miss
    assert tier_stats(store, "memory")["foreign"] == 1


def test_put_encoded_refuses_damaged_or_misfiled_values_and_stores_nothing(store):
    from kvshelf.kvstore import CorruptBlockError, ForeignBlockError

    (k0, b0), (k1, b1) = blocks(2)
    good = encode_block(b0, k0)
    damaged = bytearray(encode_block(b1, k1))
    damaged[-20] ^= 1
    with pytest.raises(CorruptBlockError):
        store.put_encoded_many([(k0, good), (k1, bytes(damaged))])
    with pytest.raises(ForeignBlockError):
        store.put_encoded_many([(k1, good)])  # encoded for k0, offered under k1
    assert mem(store).keys() == [] and disk(store).keys() == []


def test_a_digest_computed_as_the_bytes_arrived_stands_for_the_checksum(store):
    """``verify_block(digest=...)`` compares the caller's hash (the service's, taken as a value arrived) with the
    block's checksum instead of hashing again; ``put_verified_many`` stores what was so verified."""
    import xxhash

    from kvshelf.kvstore import CorruptBlockError
    from kvshelf.kvstore.encoding import verify_block

    (k0, b0), (k1, b1) = blocks(2)
    good, other = encode_block(b0, k0), encode_block(b1, k1)
    digest = xxhash.xxh3_64_digest(good[:-8])
    header = verify_block(good, expected_key=k0, digest=digest)
    with pytest.raises(CorruptBlockError, match="checksum"):  # a digest of other bytes: damage in transit
        verify_block(good, expected_key=k0, digest=xxhash.xxh3_64_digest(other[:-8]))
    with pytest.raises(ValueError, match="2 values and 1 headers"):
        store.put_verified_many([(k0, good), (k1, other)], [header])
    assert mem(store).keys() == [] and disk(store).keys() == []
    assert store.put_verified_many([(k0, good)], [header]) == 1
    assert store.get_encoded_many([k0]) == [good]


class _DownTier(MemoryTier):
    """A tier whose backing service is unreachable (stands in for a stopped Redis in this unit test;
    the Redis tests stop a real redis-server)."""

    def _down(self, *args, **kwargs):
        from kvshelf.kvstore import TierUnavailableError

        raise TierUnavailableError("connection refused")

    get_many = put_many = prefix_run_length = delete = usage = _down


def test_unreachable_tier_is_skipped_and_counted(data_dir):
    store = TieredStore([MemoryTier(MiB, name="memory"), _DownTier(MiB, name="shared")])
    entries = blocks(2)
    assert store.put_many(entries) == 2
    keys = [k for k, _ in entries]
    assert store.lookup_prefix(keys) == 2
    store.specs[0].tier.delete(keys[1:])
    got = store.get_many(keys, fingerprint=FP)
    assert_same_block(got[0], entries[0][1]) and got[1] is None
    assert store.delete(keys) == 1
    shared = tier_stats(store, "shared")
    assert shared["available"] is False and shared["unavailable"] == 3  # put, get, delete


def test_scoped_tier_keys_name_the_unscoped_key_in_the_header(store):
    (key, block), = blocks(1, namespace="tenant-a")
    scoped = b"\x01" * 8 + key
    store.put_encoded_many([(scoped, encode_block(block, key))])
    assert store.get_encoded_many([key], namespace="tenant-a") == [None]
    assert store.get_encoded_many([scoped], namespace="tenant-a")[0] is not None
    assert_same_block(store.get_many([scoped], fingerprint=FP, namespace="tenant-a")[0], block)


def test_hit_rates_in_tokens(store):
    entries = blocks(3, tokens=4)
    store.put_many(entries[:2])
    keys = [k for k, _ in entries]
    assert store.lookup_prefix(keys, namespace="default", model=FP, tokens=[4, 4, 2]) == 2
    store.get_many(keys, fingerprint=FP, tokens=[4, 4, 2])
    c = store.counters
    assert (c.total("lookup_tokens"), c.total("lookup_hit_tokens")) == (10, 8)
    assert (c.total("retrieve_tokens"), c.total("retrieve_hit_tokens")) == (10, 8)


def test_an_unreachable_tier_is_logged_once_per_interval_not_per_call(caplog):
    """A dead shared tier under load logged a warning per call (a server's output pipe filled up with them)."""
    from service_helpers import UnreachableTier

    store = TieredStore([MemoryTier(1 << 20), UnreachableTier("shared")])
    block = make_block([1, 2, 3])
    with caplog.at_level("WARNING", logger="kvshelf.kvstore.store"):
        for _ in range(50):
            store.put_many([(key_of(block), block)])
            store.get_many([key_of(block)], fingerprint=FINGERPRINT)
    lines = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(lines) == 1
    assert store.stats()["tiers"][1]["unavailable"] >= 50  # every failure is still counted


def test_a_block_over_the_readers_decode_bound_is_a_kept_miss():
    """A block whose decoding may take more than the store's ``max_decode_bytes`` (its header is within the header
    limits: another writer or a shared tier holds it) is a miss counted as ``rejected`` on every read path, and
    stays in its tier for readers with a larger bound: never decoded, never dropped as damaged."""
    from kvshelf.kvstore import MemoryTier, TieredStore

    block = make_block(64, layers=4, heads=4, head_dim=64)  # 512 KiB of float32 keys and values
    key = key_of(block)
    small = TieredStore([MemoryTier(64 << 20, charge_overhead=False)], max_decode_bytes=256 << 10)
    small.put_many([(key, block)])
    assert small.get_many([key], fingerprint=FINGERPRINT) == [None]
    assert small.get_prepared_many([key], fingerprint=FINGERPRINT) == [None]
    tier = small.stats()["tiers"][0]
    assert (tier["rejected"], tier["corrupt"], tier["blocks"]) == (2, 0, 1)
    assert small.get_encoded_many([key])[0] is not None  # still held: the bytes are served undecoded
    small.max_decode_bytes = None
    assert_same_block(small.get_many([key], fingerprint=FINGERPRINT)[0], block)
    with pytest.raises(ConfigError):
        TieredStore([MemoryTier(1 << 20)], max_decode_bytes=0)


def test_typed_stats_are_the_source_of_stats(store):
    """``stats()`` is ``typed_stats().as_dict()``: frozen dataclasses with typed fields, rendered in the JSON shape
    (key order included) the gRPC Stats, ``kvshelf stats``, metrics and bench JSON have always had."""
    import dataclasses

    from kvshelf.kvstore.protocol import STATS_KEYS, TIER_STATS_KEYS
    from kvshelf.kvstore.stats import STORE_METRICS, TIER_METRICS, Metric

    items = blocks(3)
    store.put_many(items)
    store.lookup_prefix([k for k, _ in items], tokens=[4, 4, 4])
    store.get_many([k for k, _ in items] + [b"\x01" * 16], fingerprint=FP)
    typed = store.typed_stats()
    assert store.stats() == typed.as_dict() and set(typed.as_dict()) == STATS_KEYS
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.pinned = 1  # type: ignore[misc]
    memory = typed.tier("memory")
    assert memory.hits == 3 and memory.misses == 1 and memory.hits == tier_stats(store, "memory")["hits"]
    assert list(memory.as_dict()) == ["name", "codec", "available", "damaged", "blocks", "bytes", "capacity_bytes",
                                      "hits", "misses", "bytes_read", "bytes_written", "evictions", "corrupt",
                                      "foreign", "rejected", "unavailable"]
    assert set(memory.as_dict()) - {"damaged"} == TIER_STATS_KEYS
    (row,) = [r for r in typed.rows if r.tier == "*" and r.model == "?"]  # the lookups (the reads: the model's)
    assert row.get(Metric.LOOKUP_BLOCKS) == 3 and row.get(Metric.LOOKUP_HIT_BLOCKS) == 3
    assert typed.lookup_hit_rate == 1.0 and typed.retrieve_hit_rate == 3 / 4
    # counter names are plain strings in the JSON, and every name is one Metric
    text = json.dumps(store.stats())
    assert '"lookup_hit_blocks": 3' in text and "Metric" not in text
    assert {type(k) for r in store.stats()["rows"] for k in r} == {str}
    assert set(TIER_METRICS) | set(STORE_METRICS) == set(Metric) and Metric.HITS == "hits"


def test_write_behind_typed_stats(store):
    from kvshelf.kvstore.stats import WriterStats
    from kvshelf.kvstore.write_behind import WriteBehind

    writer = WriteBehind(store)
    writer.submit(blocks(2))
    assert writer.flush() == writer.typed_stats().as_dict()
    final = writer.close()
    assert list(final) == ["submitted_blocks", "written_blocks", "rejected_blocks", "failed_blocks",
                           "failed_batches", "pending_blocks", "last_error", "closed"]
    assert writer.typed_stats() == WriterStats(submitted_blocks=2, written_blocks=2, closed=True)
