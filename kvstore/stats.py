"""Counters of a store: hits, misses, bytes and evictions per tier, namespace and model; their names (``Metric``)
and the typed snapshots a store and a write-behind writer report (``StoreStats``, ``TierStats``, ``CounterRow``,
``WriterStats``: frozen dataclasses, each with ``as_dict()``, the JSON-ready shape ``stats()`` returns)."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kvshelf.kvstore.encoding import BlockHeader

class Metric(StrEnum):
    """The name of every counter a store keeps (``Counters``): in stats rows, ``kvshelf stats``, the Prometheus
    families (``kvshelf_tier_<name>``, ``kvshelf_<name>``) and the history. A ``str``: it equals, hashes and prints
    as its name, so a row read back from JSON is looked up with it too."""

    # per tier
    HITS = "hits"
    MISSES = "misses"
    BYTES_READ = "bytes_read"
    BYTES_WRITTEN = "bytes_written"
    BLOCKS_WRITTEN = "blocks_written"
    EVICTIONS = "evictions"
    CORRUPT = "corrupt"
    FOREIGN = "foreign"
    REJECTED = "rejected"
    UNAVAILABLE = "unavailable"
    # store-wide, counted under tier "*"
    LOOKUP_BLOCKS = "lookup_blocks"
    LOOKUP_HIT_BLOCKS = "lookup_hit_blocks"
    RETRIEVE_BLOCKS = "retrieve_blocks"
    RETRIEVE_HIT_BLOCKS = "retrieve_hit_blocks"
    LOOKUP_TOKENS = "lookup_tokens"
    LOOKUP_HIT_TOKENS = "lookup_hit_tokens"
    RETRIEVE_TOKENS = "retrieve_tokens"
    RETRIEVE_HIT_TOKENS = "retrieve_hit_tokens"


#: Per-tier metrics, counted per tier, namespace and model.
TIER_METRICS = (
    Metric.HITS, Metric.MISSES, Metric.BYTES_READ, Metric.BYTES_WRITTEN, Metric.BLOCKS_WRITTEN, Metric.EVICTIONS,
    Metric.CORRUPT, Metric.FOREIGN, Metric.REJECTED, Metric.UNAVAILABLE,
)
#: Store-wide metrics, counted under tier "*": blocks (and tokens) asked for and found by lookups and retrievals.
STORE_METRICS = (
    Metric.LOOKUP_BLOCKS, Metric.LOOKUP_HIT_BLOCKS, Metric.RETRIEVE_BLOCKS, Metric.RETRIEVE_HIT_BLOCKS,
    Metric.LOOKUP_TOKENS, Metric.LOOKUP_HIT_TOKENS, Metric.RETRIEVE_TOKENS, Metric.RETRIEVE_HIT_TOKENS,
)
#: the lookup and retrieval counts, in blocks (the hit rates, the history, the admin tool's top lists)
BLOCK_COUNTS = (Metric.LOOKUP_BLOCKS, Metric.LOOKUP_HIT_BLOCKS, Metric.RETRIEVE_BLOCKS, Metric.RETRIEVE_HIT_BLOCKS)
#: the counters each tier of a store's stats shows (``TierStats``), in their order there
TIER_STATS_METRICS = (
    Metric.HITS, Metric.MISSES, Metric.BYTES_READ, Metric.BYTES_WRITTEN, Metric.EVICTIONS, Metric.CORRUPT,
    Metric.FOREIGN, Metric.REJECTED, Metric.UNAVAILABLE,
)
ALL_TIERS = "*"
UNKNOWN = "?"
#: the longest model label a count keeps: a longer name is cut and ends in ``~`` and 16 hex digits of its hash
MAX_LABEL_CHARS = 128
#: the distinct model labels counted per namespace: the first this many a namespace names keep their own label,
#: later ones are counted under ``OTHER_MODELS`` (a Prometheus counter never moves to another label)
MAX_MODELS_PER_NAMESPACE = 64
OTHER_MODELS = "(other)"


def bounded_label(value: str, limit: int = MAX_LABEL_CHARS) -> str:
    """``value`` when at most ``limit`` characters; else its first ``limit - 17`` characters, ``~`` and 16 hex
    digits of its BLAKE2b hash (distinct long names stay distinct, each label at most ``limit`` characters)."""
    if len(value) <= limit:
        return value
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{value[: limit - 17]}~{digest}"


@dataclass(frozen=True)
class TierStats:
    """One tier of a store: its usage (``None`` while unreachable) and its counters summed over namespaces and
    models (``TIER_STATS_METRICS``)."""

    name: str
    codec: str
    available: bool
    damaged: bool
    blocks: int | None
    bytes: int | None
    capacity_bytes: int | None
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    corrupt: int = 0
    foreign: int = 0
    rejected: int = 0
    unavailable: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The JSON-ready entry of ``stats()["tiers"]`` (the fields in order)."""
        return asdict(self)


@dataclass(frozen=True)
class CounterRow:
    """The counters of one ``(tier, namespace, model)``: every metric counted there (tier ``ALL_TIERS``: the
    store-wide ``STORE_METRICS``)."""

    tier: str
    namespace: str
    model: str
    counts: Mapping[str, int] = field(default_factory=dict)

    def get(self, metric: Metric) -> int:
        """The count of ``metric`` (0 when never counted)."""
        return self.counts.get(metric, 0)

    def as_dict(self) -> dict[str, str | int]:
        """The JSON-ready row: ``tier``, ``namespace``, ``model``, then each counted metric."""
        return {"tier": self.tier, "namespace": self.namespace, "model": self.model, **self.counts}


@dataclass(frozen=True)
class StoreStats:
    """A store's snapshot: its tiers, the hit rates of lookups and retrievals in blocks (``None`` before any), the
    counter rows per tier, namespace and model, and how many keys are pinned."""

    tiers: tuple[TierStats, ...]
    lookup_hit_rate: float | None
    retrieve_hit_rate: float | None
    rows: tuple[CounterRow, ...]
    pinned: int

    def tier(self, name: str) -> TierStats:
        """The tier called ``name`` (``KeyError`` when the store has none)."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        """The JSON-ready dict ``stats()`` returns (``kvshelf stats``, the server's Stats, bench JSON)."""
        return {
            "tiers": [t.as_dict() for t in self.tiers],
            "lookup_hit_rate": self.lookup_hit_rate,
            "retrieve_hit_rate": self.retrieve_hit_rate,
            "rows": [r.as_dict() for r in self.rows],
            "pinned": self.pinned,
        }


@dataclass(frozen=True)
class WriterStats:
    """A write-behind writer's counts (``kvstore.write_behind.WriteBehind``): blocks ``submitted``, ``written``,
    ``rejected`` (not accepted by the first tier: full), ``failed`` blocks and batches (the write raised),
    ``pending`` (queued or being written), the last error's text, and whether it is closed."""

    submitted_blocks: int = 0
    written_blocks: int = 0
    rejected_blocks: int = 0
    failed_blocks: int = 0
    failed_batches: int = 0
    pending_blocks: int = 0
    last_error: str | None = None
    closed: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The JSON-ready dict ``WriteBehind.stats()`` returns (the fields in order)."""
        return asdict(self)


def field_names(cls: type) -> frozenset[str]:
    """The field names of a stats dataclass (what its ``as_dict()`` has)."""
    return frozenset(f.name for f in fields(cls))


@dataclass(frozen=True)
class StoreEvent:
    """A block was ``stored`` in, ``removed`` from, or ``evicted`` from a tier."""

    kind: Literal["stored", "removed", "evicted"]
    tier: str
    key: bytes
    nbytes: int
    namespace: str = UNKNOWN
    model: str = UNKNOWN
    # details, not compared: the codec of the stored or evicted bytes ("" when not known: removals), and for
    # "stored" the stored value's header (its tokens, extra...)
    codec: str = field(default="", compare=False)
    header: BlockHeader | None = field(default=None, compare=False)


class Counters:
    """Thread-safe counters keyed by ``(tier, namespace, model, metric)``. Model labels are bounded: at most
    ``MAX_LABEL_CHARS`` characters (``bounded_label``) and ``max_models`` distinct ones per namespace, the rest
    counted under ``OTHER_MODELS``."""

    def __init__(self, max_models: int = MAX_MODELS_PER_NAMESPACE) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str, str, str]] = Counter()
        self.max_models = max_models
        self._models: dict[str, set[str]] = {}  # namespace -> its model labels

    def _model_label(self, namespace: str, model: str) -> str:
        """The label ``model`` is counted under in ``namespace`` (called with the lock held)."""
        label = bounded_label(model)
        labels = self._models.setdefault(namespace, set())
        if label in labels:
            return label
        if len(labels) < self.max_models:
            labels.add(label)
            return label
        return OTHER_MODELS

    def add(self, tier: str, namespace: str, model: str, metric: Metric, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[(tier, namespace, self._model_label(namespace, model), metric)] += n

    def counter_rows(self, namespaces: Collection[str] | None = None) -> list[CounterRow]:
        """One row per ``(tier, namespace, model)`` with every metric that was counted (sorted); ``namespaces``:
        only the rows of these (filtered before anything is sorted or built)."""
        with self._lock:
            if namespaces is None:
                items = list(self._counts.items())
            else:
                items = [item for item in self._counts.items() if item[0][1] in namespaces]
        counts: dict[tuple[str, str, str], dict[str, int]] = {}
        for (tier, ns, model, metric), value in sorted(items):
            counts.setdefault((tier, ns, model), {})[str(metric)] = value  # plain names, as JSON has them
        return [CounterRow(tier, ns, model, row) for (tier, ns, model), row in counts.items()]

    def snapshot(self) -> dict[tuple[str, str, str, str], int]:
        """A copy of every count by ``(tier, namespace, model, metric)``, unsorted (the cheapest full read)."""
        with self._lock:
            return dict(self._counts)

    def rows(self) -> list[dict[str, str | int]]:
        """``counter_rows()`` as JSON-ready dicts."""
        return [row.as_dict() for row in self.counter_rows()]

    def total(self, metric: Metric, tier: str | None = None, namespace: str | None = None) -> int:
        with self._lock:
            return sum(
                v
                for (t, ns, _m, name), v in self._counts.items()
                if name == metric and (tier is None or t == tier) and (namespace is None or ns == namespace)
            )
