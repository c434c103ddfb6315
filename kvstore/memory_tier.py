"""CPU memory tier: an LRU dictionary of encoded blocks bounded by a byte capacity."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.tier import EvictionCallback, Tier, TierUsage


class MemoryTier(Tier):
    """Least-recently-used eviction by bytes; pinned keys are never evicted.

    A value larger than the capacity, or one that fits only by evicting pinned values, is not stored.
    """

    def __init__(self, capacity_bytes: int, name: str = "memory") -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"memory tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._pinned: set[bytes] = set()
        self._lock = threading.Lock()
        self._on_evict: EvictionCallback | None = None

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        self._on_evict = callback

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                value = self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                out.append(value)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        evicted: list[tuple[bytes, bytes]] = []
        stored = 0
        with self._lock:
            for key, value in items:
                old = self._data.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                if not self._make_room(len(value), evicted):
                    continue
                self._data[key] = value
                self._bytes += len(value)
                stored += 1
        if self._on_evict is not None:
            for key, value in evicted:
                self._on_evict(key, value)
        return stored

    def _make_room(self, size: int, evicted: list[tuple[bytes, bytes]]) -> bool:
        if size > self.capacity_bytes:
            return False
        if self._bytes + size <= self.capacity_bytes:
            return True
        candidates = [k for k in self._data if k not in self._pinned]  # oldest first
        freeable = sum(len(self._data[k]) for k in candidates)
        if self._bytes - freeable + size > self.capacity_bytes:
            return False
        for key in candidates:
            if self._bytes + size <= self.capacity_bytes:
                break
            value = self._data.pop(key)
            self._bytes -= len(value)
            evicted.append((key, value))
        return True

    def contains_many(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._data:
                    return i
        return len(keys)

    def delete(self, keys: Iterable[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                value = self._data.pop(key, None)
                if value is not None:
                    self._bytes -= len(value)
                    removed += 1
        return removed

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._data)

    def pin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._pinned.update(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._pinned.difference_update(keys)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(blocks=len(self._data), bytes=self._bytes, capacity_bytes=self.capacity_bytes)
