"""What the admin dashboard's data endpoint returns: one JSON-ready snapshot of cumulative counts.

A snapshot holds the time, the lookup and retrieve counts (blocks asked and found) per namespace and model, each
tier's usage, evictions, hits and misses, the server's KV event count (its next sequence number), and the most
reused prefixes (``service.hot_prefixes``). The counts are cumulative: the page keeps the snapshots it polled and
draws rates from their differences, so the endpoint does no bookkeeping of its own.

Two sources give the same shape: ``local_snapshot`` reads a store in this process (``kvshelf serve
--admin-port``) and ``remote_snapshot`` turns a server's ``Stats`` answer into it (``kvshelf dashboard
--target``). ``CachedSource`` answers repeated polls within a short age from one snapshot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from kvshelf.kvstore.errors import TierUnavailableError
from kvshelf.kvstore.stats import ALL_TIERS, BLOCK_COUNTS, Metric

Snapshot = dict[str, Any]
TOP_PREFIXES = 10
_SERIES_COUNTS = tuple(m.value for m in BLOCK_COUNTS)
_TIER_COUNTS = frozenset((Metric.EVICTIONS.value, Metric.HITS.value, Metric.MISSES.value))


def _series(rows: Iterable[Mapping[str, Any]], namespaces: Collection[str] | None) -> list[dict[str, Any]]:
    """The lookup/retrieve block counts of each ``(namespace, model)`` (rows of tier ``*``)."""
    out = []
    for row in rows:
        if row["tier"] != ALL_TIERS or (namespaces is not None and row["namespace"] not in namespaces):
            continue
        counts = {name: int(row.get(name, 0)) for name in _SERIES_COUNTS}
        if any(counts.values()):
            out.append({"namespace": row["namespace"], "model": row["model"], **counts})
    return out


def _tier(name: str, available: bool, blocks: int | None, nbytes: int | None, capacity: int | None,
          counts: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": name, "available": available, "blocks": blocks, "bytes": nbytes, "capacity_bytes": capacity,
            "evictions": int(counts.get("evictions", 0)), "hits": int(counts.get("hits", 0)),
            "misses": int(counts.get("misses", 0))}


def local_snapshot(store: Any, *, events_seq: Callable[[], int] | None = None, hot: Any = None,
                   namespaces: Collection[str] | None = None) -> Snapshot:
    """A snapshot of ``store`` (a ``TieredStore``) in this process. ``events_seq``: the KV event count;
    ``hot``: a ``HotPrefixes``; ``namespaces``: only these namespaces' rows, tier counters and prefixes (tier usage,
    which names no namespace, is the tier's whole). One pass over the store's counts (``Counters.snapshot``)."""
    scope = frozenset(namespaces) if namespaces is not None else None
    series: dict[tuple[str, str], dict[str, int]] = {}
    sums: dict[str, dict[str, int]] = {}
    for (tier, ns, model, metric), value in store.counters.snapshot().items():
        if scope is not None and ns not in scope:
            continue
        if tier == ALL_TIERS:
            if metric in _SERIES_COUNTS:
                series.setdefault((ns, model), dict.fromkeys(_SERIES_COUNTS, 0))[str(metric)] = value
        elif metric in _TIER_COUNTS:
            counts = sums.setdefault(tier, {})
            counts[str(metric)] = counts.get(str(metric), 0) + value
    tiers = []
    for spec in store.specs:
        try:
            usage = spec.tier.usage()
        except TierUnavailableError:
            usage = None
        tiers.append(_tier(spec.tier.name, usage is not None, usage.blocks if usage else None,
                           usage.bytes if usage else None, usage.capacity_bytes if usage else None,
                           sums.get(spec.tier.name, {})))
    return {
        "t": time.time(),
        "scope": "every namespace" if scope is None else "namespaces " + ", ".join(sorted(scope)),
        "series": [{"namespace": ns, "model": model, **counts} for (ns, model), counts in sorted(series.items())],
        "tiers": tiers,
        "events": events_seq() if events_seq is not None else None,
        "top_prefixes": hot.top(TOP_PREFIXES, scope) if hot is not None else [],
    }


def remote_snapshot(stats: Mapping[str, Any]) -> Snapshot:
    """A snapshot from a server's ``Stats`` JSON (``RemoteStore.stats()``): the whole store in dev mode (its
    ``"store"`` part), else the caller's namespace (its rows, and its share of each tier)."""
    whole = stats.get("store")
    source = whole if whole is not None else stats
    tiers = [_tier(t["name"], bool(t.get("available", True)), t.get("blocks"), t.get("bytes"),
                   t.get("capacity_bytes"), t) for t in source.get("tiers", [])]
    events = stats.get("events") or {}
    return {
        "t": time.time(),
        "scope": "every namespace" if whole is not None else f"namespace {stats.get('namespace', '?')}",
        "series": _series(source.get("rows", []), None),
        "tiers": tiers,
        "events": events.get("next_seq"),
        "top_prefixes": list(stats.get("top_prefixes", []))[:TOP_PREFIXES],
    }


class CachedSource:
    """``source()`` at most once per ``max_age_s``: several open pages polling cost one snapshot."""

    def __init__(self, source: Callable[[], Snapshot], max_age_s: float = 0.5) -> None:
        self.source = source
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._value: Snapshot | None = None

    def __call__(self) -> Snapshot:
        with self._lock:
            now = time.monotonic()
            if self._value is None or now - self._at >= self.max_age_s:
                self._value = self.source()
                self._at = now
            return self._value
