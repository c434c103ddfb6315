"""``HotPrefixes``: a bounded count of the most reused cached prefixes, for the admin dashboard and ``Stats``.

A reused prefix is named by the key of its deepest block (keys chain, so that key stands for every token before it
too): a ``LookupPrefix`` that found ``n`` blocks reused the prefix ending at its ``n``-th key, a ``GetBlocks``
whose first ``n`` keys were served reused the prefix ending at the ``n``-th. Counted per ``(namespace, key)`` with
a batched Space-Saving scheme (after Metwally et al., 2005): at most ``capacity`` entries; a new key in a full table
first drops the least counted quarter of the table, whose highest count becomes the ``floor``, and a key that enters
starts at ``floor + 1`` with ``error = floor``. A count never understates a key's reuses and overstates them by at
most its ``error``; a key reused more often than every dropped one stays in the table. Dropping a quarter at once
keeps a new key's cost amortized to about a microsecond (one scan per ``capacity / 4`` new keys).
"""

from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass

DEFAULT_CAPACITY = 512


@dataclass
class _Entry:
    count: int
    error: int  # the count inherited from the entry it replaced (an upper bound of the overstatement)
    blocks: int  # the prefix's depth in blocks
    tokens: int | None  # its length in tokens, when the call named the blocks' token counts
    last_seen: float


class HotPrefixes:
    """Thread-safe, bounded: ``hit`` costs one dict update (and, once per ``capacity / 4`` new keys in a full
    table, a partial sort of the table)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, bytes], _Entry] = {}
        self._floor = 0  # the highest count dropped so far: what a key entering the table may have had before
        self.total = 0

    def hit(self, namespace: str, key: bytes, blocks: int, tokens: int | None = None) -> None:
        """Count one reuse of the prefix of ``blocks`` blocks (``tokens`` tokens) that ends at ``key``."""
        now = time.time()
        with self._lock:
            self.total += 1
            entry = self._entries.get((namespace, key))
            if entry is not None:
                entry.count += 1
                entry.blocks, entry.last_seen = blocks, now
                entry.tokens = tokens if tokens is not None else entry.tokens
                return
            if len(self._entries) >= self.capacity:
                self._drop(max(1, self.capacity // 4))
            self._entries[(namespace, key)] = _Entry(self._floor + 1, self._floor, blocks, tokens, now)

    def _drop(self, n: int) -> None:
        """Drop the ``n`` least counted entries (the lock held); the floor rises to the highest count dropped."""
        victims = heapq.nsmallest(n, self._entries.items(), key=lambda item: item[1].count)
        for name, entry in victims:
            del self._entries[name]
            self._floor = max(self._floor, entry.count)

    def top(self, limit: int = 10, namespaces: frozenset[str] | None = None) -> list[dict[str, object]]:
        """The ``limit`` most reused prefixes (of ``namespaces`` only, when given), most first, JSON-ready:
        ``namespace``, ``key`` (hex), ``hits``, ``error``, ``blocks``, ``tokens``, ``last_seen`` (Unix time)."""
        with self._lock:
            entries = self._entries.items()
            if namespaces is not None:
                entries = [item for item in entries if item[0][0] in namespaces]  # type: ignore[assignment]
            best = heapq.nlargest(limit, entries, key=lambda item: item[1].count)
            items = [(ns, key, e.count, e.error, e.blocks, e.tokens, e.last_seen) for (ns, key), e in best]
        items.sort(key=lambda item: (-item[2], item[0], item[1]))  # ties in a stable order
        return [{"namespace": ns, "key": key.hex(), "hits": count, "error": error, "blocks": blocks,
                 "tokens": tokens, "last_seen": seen}
                for ns, key, count, error, blocks, tokens, seen in items]

    def forget(self, namespace: str) -> None:
        """Drop a namespace's entries (its blocks were cleared)."""
        with self._lock:
            for name in [k for k in self._entries if k[0] == namespace]:
                del self._entries[name]
