"""``StatsHistory``: a bounded time series of a store's cumulative counters, sampled in the background.

The server keeps one and returns it with ``Stats``, so ``kvshelf stats --plot`` can draw hit rate and usage
over time. Points hold cumulative counts; rates per interval are differences of consecutive points.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from kvshelf.kvstore.stats import ALL_TIERS, BLOCK_COUNTS


def sample(store: Any) -> dict[str, Any]:
    """One point: time, cumulative lookup/retrieve counts, and bytes, blocks and evictions per tier."""
    stats = store.typed_stats()
    counters = store.counters
    return {
        "t": time.time(),
        **{m.value: counters.total(m, tier=ALL_TIERS) for m in BLOCK_COUNTS},
        "tiers": {t.name: {"bytes": t.bytes, "blocks": t.blocks, "evictions": t.evictions} for t in stats.tiers},
    }


class StatsHistory:
    """Samples ``store`` every ``interval_s`` seconds, keeping the last ``max_points`` points."""

    def __init__(self, store: Any, interval_s: float = 5.0, max_points: int = 720) -> None:
        self.store = store
        self.interval_s = interval_s
        self._points: deque[dict[str, Any]] = deque(maxlen=max_points)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self) -> None:
        point = sample(self.store)
        with self._lock:
            self._points.append(point)

    def points(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._points)

    def start(self) -> StatsHistory:
        self.record()
        self._thread = threading.Thread(target=self._run, name="kvshelf-stats-history", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.record()
            except Exception:  # a failed sample (a tier going away) must not end the history
                continue

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)
