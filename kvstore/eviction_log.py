"""``EvictionLog``: the keys a store evicted most recently, for telling an evicted block from one never stored.

A listener of a store's events (``TieredStore.subscribe``): an ``evicted`` event records its key with the tier
it left, a ``stored`` or ``removed`` event of that key forgets it (it is back, or deleted on purpose). It keeps at
most ``capacity`` keys, dropping the oldest first: O(1) per event, about 0.2 KB per key kept. It knows only the
evictions it heard, from its subscription on, in this process; a block evicted before, or by another process
sharing the tier, is not in it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.stats import StoreEvent

DEFAULT_CAPACITY = 4096


class EvictionLog:
    """The last ``capacity`` keys evicted from a store's tiers, each with the tier it was evicted from last.

    Thread-safe: a store calls it from whichever thread evicts.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ConfigError(f"an eviction log's capacity must be a positive number of keys, got {capacity!r}")
        self.capacity = capacity
        self._evicted: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, event: StoreEvent) -> None:
        """Hear one store event (the listener ``subscribe`` is given)."""
        with self._lock:
            if event.kind == "evicted":
                self._evicted.pop(event.key, None)
                self._evicted[event.key] = event.tier
                while len(self._evicted) > self.capacity:
                    self._evicted.popitem(last=False)
            else:
                self._evicted.pop(event.key, None)

    def tier_of(self, key: bytes) -> str | None:
        """The tier ``key`` was last evicted from, or ``None`` when this log holds no eviction of it."""
        with self._lock:
            return self._evicted.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._evicted)

    def watch(self, store: object) -> Callable[[], None] | None:
        """Subscribe to ``store``'s events; returns the function that unsubscribes, or ``None`` when the store
        has no events to listen to (a ``RemoteStore``: its evictions are the server's)."""
        subscribe = getattr(store, "subscribe", None)
        if not callable(subscribe):
            return None
        return subscribe(self)
