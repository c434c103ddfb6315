"""Counters, events and outage logging: the metrics layer of a store (the shape of llm-d's instrumented index, a
metrics decorator around any backend). The layers of ``kvstore.store.TieredStore`` report what they did here;
this layer counts it per tier, namespace and model (``kvstore.stats.Counters``), tells subscribers of each
stored, removed and evicted block (``StoreEvent``), and logs an unreachable tier at most once per interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvshelf.kvstore.encoding import read_header
from kvshelf.kvstore.errors import KVShelfError, TierDamagedError, TierUnavailableError
from kvshelf.kvstore.stats import ALL_TIERS, UNKNOWN, Counters, Metric, StoreEvent
from kvshelf.kvstore.tiered.codecs import header_of

log = logging.getLogger(__name__)
UNAVAILABLE_LOG_INTERVAL_S = 30.0  # an unreachable tier is logged at most this often
Listener = Callable[[StoreEvent], None]


class StoreMeter:
    """Counters and event subscribers of one store. Thread-safe; a listener that raises is logged, never felt."""

    def __init__(self) -> None:
        self.counters = Counters()
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._damaged_logged: set[str] = set()
        self._unavailable_log: dict[str, tuple[float, int]] = {}  # tier -> (last warning, failures unlogged since)

    # -- events ---------------------------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` for every stored/removed/evicted event; returns a function that unsubscribes."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def emit(self, event: StoreEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a listener must never break the store
                log.exception("store event listener failed")

    # -- what the layers report ---------------------------------------------------------------------------

    def count(self, tier: str, namespace: str, model: str, metric: Metric, n: int = 1) -> None:
        self.counters.add(tier, namespace, model, metric, n)

    def stored(self, tier: str, key: bytes, value: bytes, namespace: str, model: str) -> None:
        """``tier`` stored the encoded ``value`` of ``key``: counted as written, announced as ``stored``."""
        self.counters.add(tier, namespace, model, Metric.BLOCKS_WRITTEN)
        self.counters.add(tier, namespace, model, Metric.BYTES_WRITTEN, len(value))
        header = header_of(value)
        self.emit(StoreEvent("stored", tier, key, len(value), namespace, model, header.codec if header else "",
                             header))

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.emit(StoreEvent("removed", tier, key, 0))

    def evicted(self, tier: str, key: bytes, value: bytes) -> None:
        """``tier`` evicted ``value`` (empty: the medium dropped it on its own and it is gone)."""
        codec = ""
        try:
            header = read_header(value)
            namespace, model, codec = header.namespace, header.fingerprint, header.codec
        except KVShelfError:
            namespace = model = UNKNOWN
        self.counters.add(tier, namespace, model, Metric.EVICTIONS)
        self.emit(StoreEvent("evicted", tier, key, len(value), namespace, model, codec))

    def lookup(self, namespace: str, model: str, asked: int, found: int, tokens: Sequence[int] | None) -> None:
        """A prefix lookup of ``asked`` keys found the first ``found`` (``tokens``: tokens per key)."""
        self.counters.add(ALL_TIERS, namespace, model, Metric.LOOKUP_BLOCKS, asked)
        self.counters.add(ALL_TIERS, namespace, model, Metric.LOOKUP_HIT_BLOCKS, found)
        if tokens is not None:
            self.counters.add(ALL_TIERS, namespace, model, Metric.LOOKUP_TOKENS, sum(tokens))
            self.counters.add(ALL_TIERS, namespace, model, Metric.LOOKUP_HIT_TOKENS, sum(tokens[:found]))

    def retrieved(self, namespace: str, model: str, results: Sequence[object | None],
                  tokens: Sequence[int] | None) -> None:
        """A read answered ``results`` (``None``: a miss); ``tokens``: tokens per key, when known."""
        self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_BLOCKS, len(results))
        self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_HIT_BLOCKS,
                          sum(r is not None for r in results))
        if tokens is not None:
            self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_TOKENS, sum(tokens))
            missed = sum(tokens[j] for j, r in enumerate(results) if r is None)
            self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_HIT_TOKENS, sum(tokens) - missed)

    def hit_rate(self, hit: Metric, asked: Metric) -> float | None:
        n = self.counters.total(asked, tier=ALL_TIERS)
        return self.counters.total(hit, tier=ALL_TIERS) / n if n else None

    # -- outages ----------------------------------------------------------------------------------------

    def unavailable(self, tier: str, exc: TierUnavailableError) -> None:
        """An unreachable or damaged tier is skipped by the store (reads miss, writes go to the other tiers):
        counted as ``unavailable``; a damaged one is logged once (every later call fails fast with the same
        error), an unreachable one once per ``UNAVAILABLE_LOG_INTERVAL_S``."""
        if not isinstance(exc, TierDamagedError):
            self._log_unavailable(tier, exc)
        elif tier not in self._damaged_logged:
            self._damaged_logged.add(tier)
            log.error("tier %s is damaged, skipped until repaired (the other tiers serve): %s", tier, exc)
        self.counters.add(tier, UNKNOWN, UNKNOWN, Metric.UNAVAILABLE)

    def _log_unavailable(self, name: str, exc: TierUnavailableError) -> None:
        """One warning per tier every ``UNAVAILABLE_LOG_INTERVAL_S`` while it stays unreachable (a dead Redis under
        load otherwise logs a line per call), naming how many failures went unlogged in between."""
        now = time.monotonic()
        with self._lock:
            last, unlogged = self._unavailable_log.get(name, (-UNAVAILABLE_LOG_INTERVAL_S, 0))
            if now - last < UNAVAILABLE_LOG_INTERVAL_S:
                self._unavailable_log[name] = (last, unlogged + 1)
                return
            self._unavailable_log[name] = (now, 0)
        more = f" ({unlogged} more failures since the last message)" if unlogged else ""
        log.warning("tier %s unavailable: %s%s", name, exc, more)
