"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from kvshelf.kvstore.eviction.base import EvictionPolicy
from kvshelf.kvstore.footprint import ODICT_ENTRY_BYTES, containers


class LRUPolicy(EvictionPolicy):
    """Evict the key read or written longest ago (the classic LRU stack algorithm: Mattson et al., "Evaluation
    techniques for storage hierarchies", IBM Systems Journal 9(2), 1970). O(1) per call."""

    name = "lru"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._order: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def on_insert(self, key: bytes, size: int) -> None:
        self._order[key] = None

    def on_hit(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: Set[bytes]) -> bytes | None:
        for _ in range(len(self._order)):
            key = next(iter(self._order))
            if key not in pinned:
                return key
            self._order.move_to_end(key)  # a pinned key waits at the young end: later calls do not walk past it
        return None

    def entry_bytes(self, key_len: int) -> int:
        return ODICT_ENTRY_BYTES  # the key's place in the order (the key object is the tier's)

    def memory_bytes(self) -> int:
        return containers(self._order)
