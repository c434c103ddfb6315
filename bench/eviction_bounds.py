"""How far could any eviction policy go on a trace? Upper bounds from oracles that know part of the future.

``kvshelf replay`` compares policies with Belady's OPT, which knows *when* every block returns. These bounds
tell apart the two things OPT knows: **whether** a block returns at all (a death oracle) and **when**. Each
bound is a simulation over block ids with the replay's prefix-hit counting (``kvstore.replay``: per request,
the leading held blocks are hits, then every block of the request is stored), at a capacity in blocks:

* ``opt``: Belady's furthest next use (``kvstore.replay.opt_hits``).
* ``lru``: plain LRU, the baseline.
* ``dead_lru``: LRU told, at each access, whether the block will ever be accessed again: a block that will not
  is dropped at once (never stored, or evicted right after its last use). Everything else is LRU.
* ``dead_gdf``: the same oracle over GreedyDual-frequency (LFU with dynamic aging: priority = L + accesses, L
  the priority of the last eviction; Cao & Irani, USITS 1997; Arlitt et al., 2000), ties broken tail first.

If a target ratio to OPT is above ``dead_*``, no policy that only learns *which* blocks come back (the best
admission and death prediction possible) reaches it: it must also predict *when* they come back.
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from kvshelf.kvstore.replay import opt_hits
from kvshelf.kvstore.trace import Trace

Chains = Sequence[Sequence[int]]


def used_again(chains: Chains) -> list[set[int]]:
    """Per request, the ids of its blocks that some later request uses again."""
    later: set[int] = set()
    out: list[set[int]] = []
    for ids in reversed(chains):
        out.append({i for i in ids if i in later})
        later.update(ids)
    out.reverse()
    return out


def _prefix(ids: Sequence[int], held: object) -> int:
    hits = 0
    for i in ids:
        if i not in held:  # type: ignore[operator]
            break
        hits += 1
    return hits


def lru_hits(chains: Chains, capacity: int, oracle: list[set[int]] | None = None) -> int:
    """LRU prefix hits; with ``oracle`` (``used_again``), blocks never used again are dropped at once."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for n, ids in enumerate(chains):
        hits += _prefix(ids, cache)
        for i in ids:
            if oracle is not None and i not in oracle[n]:
                cache.pop(i, None)
                continue
            cache[i] = None
            cache.move_to_end(i)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def gdf_hits(chains: Chains, capacity: int, oracle: list[set[int]] | None = None) -> int:
    """GreedyDual-frequency prefix hits (see the module docstring), optionally with the death oracle."""
    priority: dict[int, float] = {}
    count: dict[int, int] = {}
    heap: list[tuple[float, int, int, int]] = []
    clock, seq, hits = 0.0, 0, 0
    for n, ids in enumerate(chains):
        hits += _prefix(ids, priority)
        for depth, i in enumerate(ids):
            count[i] = count.get(i, 0) + 1
            if oracle is not None and i not in oracle[n]:
                priority.pop(i, None)
                continue
            priority[i] = clock + count[i] - 1
            seq += 1
            heapq.heappush(heap, (priority[i], -depth, seq, i))
        while len(priority) > capacity:
            value, _, _, victim = heapq.heappop(heap)
            if priority.get(victim) == value:
                del priority[victim]
                clock = value
    return hits


def bounds(trace: Trace, fractions: Sequence[float]) -> dict[str, Any]:
    """Every bound at each capacity fraction of the trace's distinct blocks, as hit rates and ratios to OPT."""
    chains = [r.hash_ids for r in trace.requests]
    oracle = used_again(chains)
    total, distinct = trace.total_blocks, trace.distinct_blocks()
    rows = []
    for fraction in fractions:
        capacity = max(1, int(fraction * distinct))
        rates = {
            "opt": opt_hits(chains, capacity) / total,
            "lru": lru_hits(chains, capacity) / total,
            "dead_lru": lru_hits(chains, capacity, oracle) / total,
            "dead_gdf": gdf_hits(chains, capacity, oracle) / total,
        }
        rows.append({"capacity_fraction": fraction, "capacity_blocks": capacity, **rates,
                     **{f"{k}_vs_opt": v / rates["opt"] for k, v in rates.items() if k != "opt" and rates["opt"]}})
    return {"trace": trace.path, "results": rows}


def results_table(report: dict[str, Any]) -> Table:
    """The table of a report (``bounds``' result, as saved): ``kvshelf bench eviction-bounds``' printout;
    docs/benchmarks.md renders it."""
    table = Table(title=f"eviction bounds: {report['trace']}")
    for col in ("capacity", "OPT", "LRU", "oracle LRU", "oracle GDF", "LRU/OPT", "o.LRU/OPT", "o.GDF/OPT"):
        table.add_column(col, justify="right")
    for row in report["results"]:
        table.add_row(f"{row['capacity_fraction']:g}", *(f"{row[k]:.3f}" for k in (
            "opt", "lru", "dead_lru", "dead_gdf", "lru_vs_opt", "dead_lru_vs_opt", "dead_gdf_vs_opt")))
    return table


def write(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
