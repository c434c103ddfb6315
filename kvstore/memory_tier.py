"""CPU memory tier: a dictionary of encoded blocks bounded by a byte capacity, evicting by a pluggable policy."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from kvshelf.kvstore.tier import EvictionCallback, Tier, TierUsage


class MemoryTier(Tier):
    """Encoded blocks in process memory, at most ``capacity_bytes`` of them; ``policy`` (a name of
    ``kvstore.eviction.POLICIES`` or an instance) picks what to evict. Pinned keys are never evicted.

    A value larger than the capacity, one the policy does not admit, or one that fits only by evicting pinned
    values, is not stored (``put_many`` counts only what it stored).
    """

    def __init__(self, capacity_bytes: int, name: str = "memory", *,
                 policy: str | EvictionPolicy = DEFAULT_POLICY) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"memory tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.policy = make_policy(policy, capacity_bytes) if isinstance(policy, str) else policy
        self._data: dict[bytes, bytes] = {}
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
                    self.policy.on_hit(key)
                out.append(value)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        evicted: list[tuple[bytes, bytes]] = []
        stored = 0
        with self._lock:
            for key, value in items:
                old = self._data.get(key)
                if old is None and not self.policy.admit(key, len(value)):
                    continue
                held_bytes = self._bytes - (len(old) if old is not None else 0)
                if not self._make_room(held_bytes, len(value), key, evicted):
                    if old is not None:  # the new value cannot take the old one's place: the key is gone
                        self._remove(key)
                    continue
                self._bytes += len(value) - (len(old) if old is not None else 0)
                self._data[key] = value
                if old is None:
                    self.policy.on_insert(key, len(value))
                else:
                    self.policy.on_hit(key)
                stored += 1
        if self._on_evict is not None:
            for key, value in evicted:
                self._on_evict(key, value)
        return stored

    def _make_room(self, held_bytes: int, size: int, key: bytes, evicted: list[tuple[bytes, bytes]]) -> bool:
        """Evict until ``size`` more bytes fit next to ``held_bytes`` (``key`` itself is never evicted for its
        own new value); False, evicting nothing, when only pinned values stand in the way."""
        if size > self.capacity_bytes:
            return False
        if held_bytes + size <= self.capacity_bytes:
            return True
        keep = self._pinned | {key}
        unpinned_bytes = held_bytes - sum(len(self._data[k]) for k in keep if k in self._data and k != key)
        if held_bytes - unpinned_bytes + size > self.capacity_bytes:
            return False
        while held_bytes + size > self.capacity_bytes:
            victim = self.policy.victim(keep)
            if victim is None or victim not in self._data:
                raise AssertionError(f"eviction policy {self.policy.name} named {victim!r}, which is not held")
            value = self._remove(victim)
            held_bytes -= len(value)
            evicted.append((victim, value))
        return True

    def _remove(self, key: bytes) -> bytes:
        value = self._data.pop(key)
        self._bytes -= len(value)
        self.policy.on_remove(key)
        return value

    def contains_many(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            held = len(keys)
            for i, key in enumerate(keys):
                if key not in self._data:
                    held = i
                    break
            if len(keys) > 1:
                self.policy.on_lookup(keys, held)
        return held

    def delete(self, keys: Iterable[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                if key in self._data:
                    self._remove(key)
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
