"""What the admin dashboard's data endpoints return: one JSON-ready snapshot of cumulative counts, and the
server's kept history in the same shape.

A snapshot holds the time, the lookup and retrieve counts (blocks asked and found) in all (``totals``) and per
namespace and model (the ``MAX_SERIES`` busiest), with the model's name where one is known (``ModelNames``), each
tier's usage, health (``TierHealth``), evictions, hits and misses, the server's KV event count (its next sequence
number), the request latency histogram of each gRPC method (``latency_snapshot``: cumulative bucket counts of
``kvshelf_request_seconds``) and the most reused prefixes (``service.hot_prefixes``). The counts are
cumulative: the page keeps the snapshots it polled and draws rates and latency quantiles from their differences
over a window, so the endpoint does no bookkeeping of its own. The history (``history_points``: the server's
``StatsHistory``, the points ``kvshelf stats --plot`` draws) fills the charts when the page opens.

Two sources give the same shape: ``local_snapshot`` reads a store in this process (``kvshelf serve
--admin-port``) and ``remote_snapshot`` turns a server's ``Stats`` answer into it (``kvshelf dashboard
--target``: no latency, no model names; the history only from a dev-mode server). ``CachedSource`` answers
repeated polls within a short age from one snapshot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from kvshelf.kvstore.errors import TierUnavailableError
from kvshelf.kvstore.keys import MODEL_NAME_EXTRA
from kvshelf.kvstore.stats import ALL_TIERS, BLOCK_COUNTS, Metric, StoreEvent

Snapshot = dict[str, Any]
TOP_PREFIXES = 10
#: the most active ``(namespace, model)`` rows a snapshot carries (by blocks asked); ``series_total`` counts all
MAX_SERIES = 200
#: fingerprints ``ModelNames`` keeps (later ones stay unnamed), and the characters kept of a name
MAX_MODEL_NAMES = 1024
MAX_NAME_CHARS = 80
#: a reachable tier with failures (unreachable calls, damaged values) counted this recently is ``degraded``
DEGRADED_WINDOW_S = 60.0
_SERIES_COUNTS = tuple(m.value for m in BLOCK_COUNTS)
_TIER_COUNTS = frozenset((Metric.EVICTIONS.value, Metric.HITS.value, Metric.MISSES.value, Metric.CORRUPT.value))
_FAILURES = (Metric.UNAVAILABLE.value, Metric.CORRUPT.value)
_UNAVAILABLE = Metric.UNAVAILABLE.value  # a plain str: compared once per counter, an enum's .value costs more


def _clean_name(name: str | None) -> str | None:
    """A model name as shown: printable, at most ``MAX_NAME_CHARS`` characters; ``None`` for none."""
    if not name:
        return None
    text = "".join(c for c in name[:4 * MAX_NAME_CHARS] if c.isprintable()).strip()
    return text[:MAX_NAME_CHARS] or None


def _geometry(header: Any) -> str:
    """What a stored header says of its model: ``"30 layers, 3 KV heads x 64, float32"``."""
    layers, heads, _, head_dim = header.shape
    return f"{layers} layers, {heads} KV heads x {head_dim}, {str(header.dtype).removeprefix('torch.')}"


class ModelNames:
    """What is known of each model fingerprint: the name its blocks carry (the ``MODEL_NAME_EXTRA`` entry of a
    stored block's header, as a client sets it) and the geometry its headers declare. Learned from the store's
    ``stored`` events (``attach``) or given (``learn``); at most ``capacity`` fingerprints (a later one stays
    unknown: made-up fingerprints cannot grow it); one dict look-up per stored block once a fingerprint is known."""

    def __init__(self, capacity: int = MAX_MODEL_NAMES) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._known: dict[str, tuple[str | None, str | None]] = {}

    def attach(self, store: Any) -> Callable[[], None]:
        """Learn from ``store``'s events from now on; returns the function that stops it."""
        return store.subscribe(self.observe)

    def observe(self, event: StoreEvent) -> None:
        """A store event: a ``stored`` one with a header teaches its fingerprint's name and geometry."""
        header = event.header
        if event.kind != "stored" or header is None:
            return
        extra = header.extra or {}
        known = self._known.get(header.fingerprint)
        if known is not None and (MODEL_NAME_EXTRA not in extra or known[0] == _clean_name(extra[MODEL_NAME_EXTRA])):
            return
        self._set(header.fingerprint, _clean_name(extra.get(MODEL_NAME_EXTRA)), _geometry(header))

    def learn(self, fingerprint: str, name: str) -> None:
        """Name ``fingerprint`` (a name given by the operator or a caller)."""
        self._set(fingerprint, _clean_name(name), None)

    def _set(self, fingerprint: str, name: str | None, shape: str | None) -> None:
        with self._lock:
            old = self._known.get(fingerprint)
            if old is None and len(self._known) >= self.capacity:
                return
            self._known[fingerprint] = (name or (old[0] if old else None), shape or (old[1] if old else None))

    def label(self, fingerprint: str) -> dict[str, str | None]:
        """``{"model_name": ..., "model_shape": ...}`` of ``fingerprint`` (``None`` where unknown)."""
        name, shape = self._known.get(fingerprint, (None, None))
        return {"model_name": name, "model_shape": shape}


class TierHealth:
    """When each tier's failure count (calls it could not answer, damaged values) last rose, as seen by the
    snapshots: a reachable tier whose count rose within ``window_s`` is ``degraded``."""

    def __init__(self, window_s: float = DEGRADED_WINDOW_S) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, float | None]] = {}  # tier -> (failures, when they last rose)

    def state(self, name: str, available: bool, damaged: bool, failures: int, now: float) -> str:
        """``up``, ``degraded``, ``unreachable`` or ``damaged``; records ``failures`` (the tier's cumulative
        count) at ``now``. The first sight of a tier with failures marks no rise (their time is not known)."""
        with self._lock:
            count, rose = self._seen.get(name, (failures, None))
            if failures > count:
                rose = now
            self._seen[name] = (failures, rose)
        if damaged:
            return "damaged"
        if not available:
            return "unreachable"
        return "degraded" if rose is not None and now - rose <= self.window_s else "up"


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


def _totals(series: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The lookup/retrieve block counts summed over every row (those ``_busiest`` leaves out too)."""
    return {name: sum(int(r[name]) for r in series) for name in _SERIES_COUNTS}


def _busiest(series: list[dict[str, Any]], names: ModelNames | None) -> list[dict[str, Any]]:
    """The ``MAX_SERIES`` rows with the most blocks asked (in ``(namespace, model)`` order), each with its model's
    name and geometry."""
    if len(series) > MAX_SERIES:
        keep = sorted(series, key=lambda r: -(r["lookup_blocks"] + r["retrieve_blocks"]))[:MAX_SERIES]
        series = sorted(keep, key=lambda r: (r["namespace"], r["model"]))
    empty = {"model_name": None, "model_shape": None}
    return [{**r, **(names.label(r["model"]) if names is not None else empty)} for r in series]


def _tier(name: str, available: bool, blocks: int | None, nbytes: int | None, capacity: int | None,
          counts: Mapping[str, Any], *, damaged: bool = False, health: TierHealth | None = None,
          now: float = 0.0) -> dict[str, Any]:
    failures = sum(int(counts.get(m, 0)) for m in _FAILURES)
    if health is not None:
        state = health.state(name, available, damaged, failures, now)
    else:
        state = "damaged" if damaged else ("up" if available else "unreachable")
    return {"name": name, "available": available, "state": state, "blocks": blocks, "bytes": nbytes,
            "capacity_bytes": capacity,
            **{m: int(counts.get(m, 0)) for m in ("evictions", "hits", "misses", "unavailable", "corrupt")}}


def latency_snapshot(histogram: Any) -> list[dict[str, Any]]:
    """The cumulative ``kvshelf_request_seconds`` histogram (``service.metrics.LatencyInterceptor.histogram``) of
    each gRPC method: ``{"method", "count", "sum", "buckets": [[upper bound in s, cumulative count], ...]}`` (the
    last bound ``None``: +Inf), read from the histogram's own samples."""
    methods: dict[str, dict[str, Any]] = {}
    for family in histogram.collect():
        for sample in family.samples:
            method = sample.labels.get("method")
            if method is None:
                continue
            entry = methods.setdefault(method, {"method": method, "count": 0, "sum": 0.0, "buckets": []})
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                entry["buckets"].append([None if bound == float("inf") else bound, int(sample.value)])
            elif sample.name.endswith("_count"):
                entry["count"] = int(sample.value)
            elif sample.name.endswith("_sum"):
                entry["sum"] = float(sample.value)
    for entry in methods.values():
        entry["buckets"].sort(key=lambda b: float("inf") if b[0] is None else b[0])
    return [methods[m] for m in sorted(methods) if methods[m]["count"]]


def local_snapshot(store: Any, *, events_seq: Callable[[], int] | None = None, hot: Any = None,
                   namespaces: Collection[str] | None = None, names: ModelNames | None = None,
                   health: TierHealth | None = None, latency: Any = None) -> Snapshot:
    """A snapshot of ``store`` (a ``TieredStore``) in this process. ``events_seq``: the KV event count;
    ``hot``: a ``HotPrefixes``; ``namespaces``: only these namespaces' rows, tier counters and prefixes (tier usage
    and health, which name no namespace, are the tier's whole); ``names``: the models' names; ``health``: the
    tiers' failure history; ``latency``: the request latency histogram (``None``: the snapshot's ``latency`` is
    ``None``). One pass over the store's counts (``Counters.snapshot``)."""
    scope = frozenset(namespaces) if namespaces is not None else None
    now = time.time()
    series: dict[tuple[str, str], dict[str, int]] = {}
    sums: dict[str, dict[str, int]] = {}
    unavailable: dict[str, int] = {}
    for (tier, ns, model, metric), value in store.counters.snapshot().items():
        if metric == _UNAVAILABLE:  # counted under no namespace: the tier's health, every tenant's
            unavailable[tier] = unavailable.get(tier, 0) + value
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
        name = spec.tier.name
        counts = {**sums.get(name, {}), "unavailable": unavailable.get(name, 0)}
        tiers.append(_tier(name, usage is not None, usage.blocks if usage else None, usage.bytes if usage else None,
                           usage.capacity_bytes if usage else None, counts,
                           damaged=bool(getattr(spec.tier, "damaged", False)), health=health, now=now))
    rows = [{"namespace": ns, "model": model, **counts} for (ns, model), counts in sorted(series.items())]
    return {
        "t": now,
        "scope": "every namespace" if scope is None else "namespaces " + ", ".join(sorted(scope)),
        "totals": _totals(rows),
        "series": _busiest(rows, names),
        "series_total": len(rows),
        "tiers": tiers,
        "events": events_seq() if events_seq is not None else None,
        "latency": latency_snapshot(latency) if latency is not None else None,
        "top_prefixes": hot.top(TOP_PREFIXES, scope) if hot is not None else [],
    }


def remote_snapshot(stats: Mapping[str, Any], health: TierHealth | None = None) -> Snapshot:
    """A snapshot from a server's ``Stats`` JSON (``RemoteStore.stats()``): the whole store in dev mode (its
    ``"store"`` part), else the caller's namespace (its rows, and its share of each tier). No latency (the server's
    ``/metrics`` has it) and no model names."""
    whole = stats.get("store")
    source = whole if whole is not None else stats
    now = time.time()
    tiers = [_tier(t["name"], bool(t.get("available", True)), t.get("blocks"), t.get("bytes"),
                   t.get("capacity_bytes"), t, damaged=bool(t.get("damaged", False)), health=health, now=now)
             for t in source.get("tiers", [])]
    events = stats.get("events") or {}
    rows = _series(source.get("rows", []), None)
    return {
        "t": now,
        "scope": "every namespace" if whole is not None else f"namespace {stats.get('namespace', '?')}",
        "totals": _totals(rows),
        "series": _busiest(rows, None),
        "series_total": len(rows),
        "tiers": tiers,
        "events": events.get("next_seq"),
        "latency": None,
        "top_prefixes": list(stats.get("top_prefixes", []))[:TOP_PREFIXES],
    }


def history_points(points: Iterable[Mapping[str, Any]], namespaces: Collection[str] | None = None
                   ) -> list[dict[str, Any]]:
    """The server's kept history (``StatsHistory.points()``, the points ``kvshelf stats --plot`` draws) for the
    page: ``{"t", "totals": {lookup/retrieve block counts} | None, "tiers": {name: {"bytes", "blocks",
    "evictions"}}}`` per point, oldest first. A dashboard of some ``namespaces`` gets the tiers' usage only (the
    history's counts are every tenant's)."""
    out = []
    for point in points:
        tiers = {str(name): {"bytes": t.get("bytes"), "blocks": t.get("blocks"),
                             "evictions": None if namespaces is not None else t.get("evictions")}
                 for name, t in (point.get("tiers") or {}).items()}
        totals = None if namespaces is not None else {m: int(point.get(m, 0)) for m in _SERIES_COUNTS}
        out.append({"t": float(point["t"]), "totals": totals, "tiers": tiers})
    return out


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
