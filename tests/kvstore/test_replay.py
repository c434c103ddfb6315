"""Trace replay (kvstore.replay): the real tier classes and policies driven by a trace, Belady's OPT, capacities.

The small traces are made here; only the calibration test reads ../shared/data/traces (skipped without it)."""

from __future__ import annotations

import hashlib
import inspect
import json
import random
import time
from collections import OrderedDict
from collections.abc import Sequence, Set
from pathlib import Path

import pytest

from kvshelf.kvstore import eviction
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.eviction.base import EvictionPolicy
from kvshelf.kvstore.lmdb_tier import LMDBTier
from kvshelf.kvstore.replay import (
    DEFAULT_BLOCK_BYTES,
    CapacitySpec,
    block_key,
    check_block_bytes,
    check_policies,
    opt_hits,
    parse_capacities,
    replay,
    resolve_capacity,
)
from kvshelf.kvstore.trace import Trace, TraceRequest, read_trace

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"


def make_trace(chains: Sequence[Sequence[int]], path: str = "test") -> Trace:
    return Trace(path, tuple(TraceRequest(tuple(c)) for c in chains))


def random_chains(seed: int, requests: int = 300) -> list[list[int]]:
    """Conversations that grow turn by turn (a turn repeats its history and adds blocks), plus a shared head."""
    rng = random.Random(seed)
    next_id, chats, chains = 1, [], []
    for _ in range(requests):
        if not chats or rng.random() < 0.3:
            chats.append([0] if rng.random() < 0.5 else [])
        chat = rng.choice(chats)
        for _ in range(rng.randint(1, 4)):
            chat.append(next_id)
            next_id += 1
        chains.append(list(chat))
    return chains


def naive_opt(chains: Sequence[Sequence[int]], capacity: int) -> int:
    """Belady by the book, O(n x capacity): on each insertion past capacity evict the held id used furthest ahead."""
    flat = [i for c in chains for i in c]
    held: set[int] = set()
    hits = pos = 0
    for chain in chains:
        for block in chain:
            if block not in held:
                break
            hits += 1
        for block in chain:
            pos += 1
            held.add(block)
            while len(held) > capacity:
                def next_use(b: int, start: int = pos) -> int:
                    return next((p for p in range(start, len(flat)) if flat[p] == b), len(flat) + b)
                held.remove(max(held, key=next_use))
    return hits


def unbounded_hits(chains: Sequence[Sequence[int]]) -> int:
    seen: set[int] = set()
    hits = 0
    for chain in chains:
        for block in chain:
            if block not in seen:
                break
            hits += 1
        seen.update(chain)
    return hits


def test_block_keys_are_16_byte_blake2b_digests_of_the_id() -> None:
    assert block_key(46) == hashlib.blake2b(b"46", digest_size=16).digest()
    assert len({block_key(i) for i in range(10_000)}) == 10_000
    assert all(len(block_key(i)) == 16 for i in (0, 1, 2**63))


def test_default_block_bytes_is_one_512_token_smollm2_fp16_block() -> None:
    assert DEFAULT_BLOCK_BYTES == 11_796_480


def test_opt_keeps_the_block_used_soonest() -> None:
    # capacity 2: after [1, 2], block 3 is never used again, so OPT drops it at once and [1, 2] hits;
    # LRU drops 1 for 3 and then misses the whole chain [1, 2]
    chains = [[1, 2], [3], [1, 2]]
    assert opt_hits(chains, 2) == 2
    report = replay(make_trace(chains), policies=["lru"], capacities="1", block_bytes=1)
    assert (report.rows[0].run.hits, report.rows[0].opt_hits) == (2, 2)  # capacity 1 = 3 blocks: all fit
    report = replay(make_trace(chains), policies=["lru"], capacities="2B", block_bytes=1)
    assert (report.rows[0].run.hits, report.rows[0].opt_hits) == (0, 2)


@pytest.mark.parametrize("seed", range(6))
def test_opt_matches_belady_by_the_book(seed: int) -> None:
    chains = random_chains(seed, requests=120)
    distinct = len({i for c in chains for i in c})
    for capacity in (1, 3, distinct // 10, distinct // 3, distinct):
        assert opt_hits(chains, max(1, capacity)) == naive_opt(chains, max(1, capacity)), capacity


def test_at_full_capacity_opt_and_every_policy_reach_the_unbounded_hit_count() -> None:
    chains = random_chains(1)
    report = replay(make_trace(chains), capacities="1", block_bytes=64)
    assert {row.run.policy for row in report.rows} == set(eviction.POLICIES)
    for row in report.rows:
        assert row.run.hits == row.opt_hits == row.lru_hits == unbounded_hits(chains)
        assert row.run.evictions == 0


def test_lru_through_the_memory_tier_counts_prefix_hits() -> None:
    # capacity 3 blocks; LRU order after each request is shown oldest first
    chains = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5], [1, 5]]
    # r1: 0 hits, holds 1 2 3; r2: 2 hits (1 2), 4 evicts 3 -> 1 2 4; r3: 2 hits, 3 evicts 4 -> 1 2 3;
    # r4: 0 hits, 5 evicts 1 -> 2 3 5; r5: 0 hits (1 missing), 1 re-put evicts 2, 5 re-put (a hit) -> 3 1 5
    report = replay(make_trace(chains), policies=["lru"], capacities="3KiB", block_bytes=1024)
    (row,) = report.rows
    assert (row.run.hits, row.run.blocks, row.run.evictions) == (4, 12, 4)
    assert row.lru_hits == 4
    assert row.run.capacity.blocks == 3


def test_json_has_the_issue_fields_for_every_policy_and_capacity() -> None:
    report = replay(make_trace(random_chains(2)), capacities="0.05,0.2,1", block_bytes=4096)
    payload = json.loads(json.dumps(report.as_json()))
    assert set(payload) == {"trace", "results"}
    assert payload["trace"] == "test"
    assert len(payload["results"]) == 3 * len(eviction.POLICIES)
    lru = {r["capacity_fraction"]: r["hit_rate"] for r in payload["results"] if r["policy"] == "lru"}
    for result in payload["results"]:
        assert isinstance(result["policy"], str) and result["policy"] in eviction.POLICIES
        assert result["default"] is (result["policy"] == eviction.DEFAULT_POLICY)
        for name in ("capacity_fraction", "hit_rate", "opt_hit_rate", "lru_hit_rate"):
            assert isinstance(result[name], float) and 0 <= result[name] <= 1, name
        assert result["capacity_fraction"] in (0.05, 0.2, 1.0)
        assert result["lru_hit_rate"] == lru[result["capacity_fraction"]]
        assert result["capacity_bytes"] == result["capacity_blocks"] * 4096
    assert [r["default"] for r in payload["results"]].count(True) == 3


class FIFOPolicy(EvictionPolicy):
    """First in, first out (a reads-blind baseline; here only to replay a policy other than LRU)."""

    name = "test-fifo"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes, size: int) -> None:
        self._order[key] = None

    def on_hit(self, key: bytes) -> None:
        pass

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: Set[bytes]) -> bytes | None:
        return next((k for k in self._order if k not in pinned), None)


def test_lru_is_replayed_even_when_not_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(eviction.POLICIES, FIFOPolicy.name, FIFOPolicy)
    chains = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5], [1, 5]]
    report = replay(make_trace(chains), policies=["test-fifo"], capacities="3B", block_bytes=1)
    (row,) = report.rows
    assert row.run.policy == "test-fifo" and not row.default
    # FIFO: r2 evicts 1 for 4 (2 hits), r3 misses 1 -> 0 hits and refills: 2 + 0 + 0 + 0 = 2; LRU (above): 4
    assert (row.run.hits, row.lru_hits) == (2, 4)


def test_parallel_workers_give_the_same_figures() -> None:
    trace = make_trace(random_chains(3, requests=400))
    one = replay(trace, capacities="0.02,0.1", block_bytes=512, workers=1).as_json()
    two = replay(trace, capacities="0.02,0.1", block_bytes=512, workers=2).as_json()
    for result in one["results"] + two["results"]:
        result.pop("seconds")
    assert one == two


def test_progress_counts_every_replayed_block() -> None:
    trace = make_trace(random_chains(4))
    totals: list[int] = []
    done: list[int] = []
    replay(trace, policies=["lru"], capacities="0.1,0.5", block_bytes=8, total=totals.append, progress=done.append)
    assert totals == [2 * trace.total_blocks]
    assert sum(done) == 2 * trace.total_blocks


@pytest.mark.parametrize(("text", "expected"), [
    ("0.01,0.05, 0.1", [CapacitySpec("0.01", fraction=0.01), CapacitySpec("0.05", fraction=0.05),
                        CapacitySpec("0.1", fraction=0.1)]),
    ("1", [CapacitySpec("1", fraction=1.0)]),
    ("64GiB,4096B,0.5,0.5", [CapacitySpec("64GiB", bytes=64 << 30), CapacitySpec("4096B", bytes=4096),
                             CapacitySpec("0.5", fraction=0.5)]),
])
def test_capacities_are_fractions_or_sizes_with_a_unit(text: str, expected: list[CapacitySpec]) -> None:
    assert parse_capacities(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("0", "must be positive"),
    ("0.0", "must be positive"),
    ("-0.1", "must be positive"),
    ("0GiB", "is 0 bytes"),
    ("-1GiB", "negative"),
    ("1.5", "above 1"),
    ("1000000", "for bytes add a unit, e.g. 1000000B"),
    ("nan", "not a capacity"),
    ("inf", "not a capacity"),
    ("lots", "cannot read size 'lots'"),
    ("", "no capacity given"),
    ("0.1,,0.2", "empty entry"),
])
def test_bad_capacities_are_config_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_capacities(text)


def test_a_capacity_below_one_block_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"capacity 0.01 of the trace's 50 distinct blocks is less than one block"):
        resolve_capacity(CapacitySpec("0.01", fraction=0.01), 50, 1024)
    with pytest.raises(ConfigError, match=r"capacity 1000B \(1000 bytes\) is smaller than one block"):
        resolve_capacity(CapacitySpec("1000B", bytes=1000), 50, 1024)
    assert resolve_capacity(CapacitySpec("0.02", fraction=0.02), 50, 1024).blocks == 1
    capacity = resolve_capacity(CapacitySpec("3000B", bytes=3000), 50, 1024)
    assert (capacity.blocks, capacity.bytes) == (2, 3000)
    assert capacity.fraction == pytest.approx(3000 / (50 * 1024))
    with pytest.raises(ConfigError, match="less than one block"):
        replay(make_trace([[1, 2, 3]]), capacities="0.1", block_bytes=8)


@pytest.mark.parametrize("value", [0, -1, "0", "-4KiB", "abc", "1.5", "2GiB", True])
def test_bad_block_bytes_are_config_errors(value: object) -> None:
    with pytest.raises(ConfigError, match="--block-bytes"):
        check_block_bytes(value)  # type: ignore[arg-type]


def test_block_bytes_take_sizes() -> None:
    assert check_block_bytes("11MiB") == 11 << 20
    assert check_block_bytes(4096) == 4096


def test_an_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        check_policies(["lru", "belady"])
    assert "'belady'" in str(info.value)
    for name in eviction.POLICIES:
        assert name in str(info.value)
    with pytest.raises(ConfigError, match="no policy given"):
        check_policies([])
    assert check_policies(None) == list(eviction.POLICIES)
    assert check_policies(["lru", "lru"]) == ["lru"]


def test_an_unknown_tier_or_worker_count_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown tier 'redis'"):
        replay(make_trace([[1]]), capacities="1", block_bytes=8, tier="redis")
    with pytest.raises(ConfigError, match="workers"):
        replay(make_trace([[1]]), capacities="1", block_bytes=8, workers=0)


LMDB_HAS_CAPACITY = "capacity_bytes" in inspect.signature(LMDBTier).parameters


@pytest.mark.skipif(not LMDB_HAS_CAPACITY, reason="LMDBTier has no capacity_bytes (bounded LMDB tier not landed)")
def test_the_lmdb_tier_replays_a_tiny_trace_as_the_memory_tier_does(tmp_path: Path) -> None:
    # the bounded LMDB tier counts value bytes and drives its policy as MemoryTier does: the same figures
    chains = random_chains(5, requests=60)
    memory = replay(make_trace(chains), capacities="0.2,1", block_bytes=65536)
    disk = replay(make_trace(chains), capacities="0.2,1", block_bytes=65536, tier="lmdb", workdir=str(tmp_path))
    assert len(disk.rows) == 2 * len(eviction.POLICIES)
    for on_disk, in_memory in zip(disk.rows, memory.rows, strict=True):
        assert (on_disk.run.policy, on_disk.run.capacity) == (in_memory.run.policy, in_memory.run.capacity)
        assert (on_disk.run.hits, on_disk.run.evictions) == (in_memory.run.hits, in_memory.run.evictions)
        assert on_disk.opt_hits == in_memory.opt_hits
        if on_disk.run.capacity.fraction == 1:
            assert on_disk.run.hits == unbounded_hits(chains) and on_disk.run.evictions == 0
        else:
            assert on_disk.run.hits > 0 and on_disk.run.evictions > 0
    assert disk.as_json()["results"][0]["tier"] == "lmdb"
    assert list(tmp_path.iterdir()) == []  # each run's environment is removed


CALIBRATION = {  # trace: {fraction: (OPT, LRU)}, the issue's figures
    "conversation_first_half.jsonl": {0.05: (0.322, 0.103), 0.1: (0.340, 0.196)},
    "synthetic_trace.jsonl": {0.05: (0.396, 0.155), 0.1: (0.506, 0.260)},
}


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"the real traces are not here ({TRACES}: a checkout without "
                                                "../shared)")
@pytest.mark.parametrize("name", sorted(CALIBRATION))
def test_real_traces_reproduce_the_issue_figures(name: str) -> None:
    started = time.monotonic()
    report = replay(read_trace(TRACES / name), policies=["lru"], capacities="0.05,0.1")
    for row in report.rows:
        opt, lru = CALIBRATION[name][row.run.capacity.fraction]
        assert round(row.opt_hits / row.run.blocks, 3) == opt
        assert round(row.run.hit_rate, 3) == lru
    assert time.monotonic() - started < 120, "far slower than it should be (about 1 s on the dev machine)"
