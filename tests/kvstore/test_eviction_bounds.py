"""The oracle bounds of `kvshelf bench eviction-bounds` (bench/eviction_bounds.py) on small generated traces."""

from __future__ import annotations

import random

from kvshelf.bench.eviction_bounds import bounds, gdf_hits, lru_hits, used_again
from kvshelf.kvstore.replay import opt_hits
from kvshelf.kvstore.trace import Trace, TraceRequest


def chains(seed: int, requests: int = 300) -> list[list[int]]:
    """Chains that share a head block and extend earlier chains now and then."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    next_id = 1
    for _ in range(requests):
        base = list(rng.choice(out)) if out and rng.random() < 0.4 else [0]
        added = rng.randint(1, 6)
        out.append(base + list(range(next_id, next_id + added)))
        next_id += added
    return out


def test_used_again_names_exactly_the_blocks_a_later_request_uses() -> None:
    assert used_again([[0, 1], [0, 2], [3]]) == [{0}, set(), set()]


def test_an_unbounded_cache_hits_every_reuse_whatever_the_policy() -> None:
    trace = chains(1)
    everything = sum(len(c) for c in trace)
    best = opt_hits(trace, everything)
    assert best > 0
    for hits in (lru_hits(trace, everything), gdf_hits(trace, everything),
                 lru_hits(trace, everything, used_again(trace)), gdf_hits(trace, everything, used_again(trace))):
        assert hits == best


def test_the_death_oracle_never_hurts_lru_and_bounds_are_reported_against_opt() -> None:
    trace = chains(2)
    distinct = len({i for c in trace for i in c})
    for capacity in (5, 20, 60):
        assert lru_hits(trace, capacity, used_again(trace)) >= lru_hits(trace, capacity)
    report = bounds(Trace("generated", tuple(TraceRequest(tuple(c)) for c in trace)), [0.05, 0.2])
    assert [row["capacity_blocks"] for row in report["results"]] == [int(0.05 * distinct), int(0.2 * distinct)]
    for row in report["results"]:
        assert row["lru_vs_opt"] == row["lru"] / row["opt"]
        assert row["dead_lru"] >= row["lru"]
