"""Counters of a store: hits, misses, bytes and evictions per tier, namespace and model."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from kvshelf.kvstore.encoding import BlockHeader

TIER_METRICS = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "blocks_written",
    "evictions",
    "corrupt",
    "foreign",
    "rejected",
    "unavailable",
)
#: Store-wide metrics, counted under tier "*": blocks (and tokens) asked for and found by lookups and retrievals.
STORE_METRICS = (
    "lookup_blocks", "lookup_hit_blocks", "retrieve_blocks", "retrieve_hit_blocks",
    "lookup_tokens", "lookup_hit_tokens", "retrieve_tokens", "retrieve_hit_tokens",
)
ALL_TIERS = "*"
UNKNOWN = "?"


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
    """Thread-safe counters keyed by ``(tier, namespace, model, metric)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str, str, str]] = Counter()

    def add(self, tier: str, namespace: str, model: str, metric: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[(tier, namespace, model, metric)] += n

    def rows(self) -> list[dict[str, str | int]]:
        """One row per ``(tier, namespace, model)`` with every metric that was counted."""
        with self._lock:
            items = list(self._counts.items())
        rows: dict[tuple[str, str, str], dict[str, str | int]] = {}
        for (tier, ns, model, metric), value in sorted(items):
            row = rows.setdefault((tier, ns, model), {"tier": tier, "namespace": ns, "model": model})
            row[metric] = value
        return list(rows.values())

    def total(self, metric: str, tier: str | None = None, namespace: str | None = None) -> int:
        with self._lock:
            return sum(
                v
                for (t, ns, _m, name), v in self._counts.items()
                if name == metric and (tier is None or t == tier) and (namespace is None or ns == namespace)
            )
