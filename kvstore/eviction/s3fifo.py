"""S3-FIFO: three FIFO queues, quick demotion of one-hit keys, lazy promotion of reused ones.

Yang, Zhang, Qiu, Yue, Rashmi, "FIFO queues are all you need for cache eviction", SOSP 2023. Most keys of a
cache are used once; S3-FIFO gives a new key a short probation in a small FIFO (10% of the capacity) and keeps
for long only those read again while there (moved to the main FIFO, 90%). The main FIFO is a CLOCK with a 2-bit
counter per key: a key at its head that was read since its last pass goes back to its tail with the counter
decremented (lazy promotion: no reordering on a hit). A ghost FIFO remembers keys recently evicted from the
small queue (keys only, no values); such a key that comes back is inserted straight into main.

Adapted to a tier that owns the capacity (``kvstore.eviction.base``): sizes are bytes (from ``on_insert``), the
small queue's share is 10% of ``capacity_bytes``; ``victim`` names one key per call, taking from the small queue
when it holds at least its share (as the paper's ``evict``), else from main, and moving the small queue's reused
keys to main on the way (their counters cleared, the paper's ``move_to_main_threshold`` of 1, as libCacheSim).
The ghost FIFO is bounded as the paper's: by the bytes main may hold (90% of the capacity, counted with the
sizes the keys had), oldest dropped first. Only a key the policy itself named and the tier then removed enters
the ghost list; a deleted key is simply forgotten. Under a tier that counts its memory (``extra_limit``,
``kvstore.eviction.base``) the ghost FIFO's memory (keys, sizes, its table) also stays under that limit, oldest
dropped first.

Pins: a pinned key met at the head of a queue goes to the tail of the same queue (its counter kept) and is
never named; ``victim`` returns ``None`` only when every held key is pinned. Every call is O(1) amortized: a
key is passed over at most once per read it had (the counter) plus once per pass in which it is pinned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set
from sys import getsizeof

from kvshelf.kvstore.eviction.base import EvictionPolicy
from kvshelf.kvstore.footprint import DICT_ENTRY_BYTES, INT_BYTES, ODICT_ENTRY_BYTES, bytes_object, containers

#: the small FIFO's share of the capacity (the paper's 10%)
SMALL_FRACTION = 0.1
#: the access counter saturates here (2 bits)
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP 2023) over byte sizes; see the module docstring for the adaptation."""

    name = "s3fifo"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.small_target = max(1, int(capacity_bytes * SMALL_FRACTION))
        self.ghost_limit = max(1, capacity_bytes - self.small_target)
        self._small: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, int] = OrderedDict()  # key -> its size when evicted
        self._size: dict[bytes, int] = {}
        self._freq: dict[bytes, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0
        self._ghost_bytes = 0
        self._ghost_objects = 0  # memory of the ghosts' keys and sizes (the tier no longer holds those keys)
        self._named: bytes | None = None  # the last victim named, which enters the ghost list when removed

    # -- the tier's calls --------------------------------------------------------------------------------

    def on_insert(self, key: bytes, size: int) -> None:
        if key in self._size:  # not expected (the tier inserts only keys it does not hold): treat as a re-put
            self.on_hit(key)
            return
        self._size[key] = size
        self._freq[key] = 0
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._ghost_objects -= _ghost_objects(key)
            self._main[key] = None
            self._main_bytes += size
        else:
            self._small[key] = None
            self._small_bytes += size

    def on_hit(self, key: bytes) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < MAX_FREQ:
            self._freq[key] = freq + 1

    def on_remove(self, key: bytes) -> None:
        size = self._size.pop(key, None)
        if size is None:
            return
        del self._freq[key]
        named, self._named = self._named == key, None
        if key in self._small:
            del self._small[key]
            self._small_bytes -= size
            if named:
                self._ghost[key] = size
                self._ghost_bytes += size
                self._ghost_objects += _ghost_objects(key)
                while self._ghost_bytes > self.ghost_limit and self._ghost:
                    self._drop_oldest_ghost()
                self._keep_extra_limit()
        else:
            del self._main[key]
            self._main_bytes -= size

    def victim(self, pinned: Set[bytes]) -> bytes | None:
        if self._small_bytes >= self.small_target or not self._main:
            key = self._evict_small(pinned)
            if key is None:
                key = self._evict_main(pinned)
        else:
            key = self._evict_main(pinned)
            if key is None:
                key = self._evict_small(pinned)
        self._named = key
        return key

    # -- the two FIFOs -----------------------------------------------------------------------------------

    def _evict_small(self, pinned: Set[bytes]) -> bytes | None:
        """The small FIFO's first unpinned key never read while there; read ones move to main on the way."""
        for _ in range(len(self._small)):
            key = next(iter(self._small))
            if key in pinned:
                self._small.move_to_end(key)
            elif self._freq[key] > 0:
                del self._small[key]
                size = self._size[key]
                self._small_bytes -= size
                self._main[key] = None
                self._main_bytes += size
                self._freq[key] = 0
            else:
                return key
        return None

    def _evict_main(self, pinned: Set[bytes]) -> bytes | None:
        """The main FIFO's first unpinned key with a zero counter; others go to the tail, counter decremented.

        An unpinned key is a victim at its (counter + 1)-th visit, so MAX_FREQ + 1 passes find one if any is
        unpinned."""
        for _ in range((MAX_FREQ + 1) * len(self._main)):
            key = next(iter(self._main))
            if key in pinned:
                self._main.move_to_end(key)
                continue
            freq = self._freq[key]
            if freq == 0:
                return key
            self._freq[key] = freq - 1
            self._main.move_to_end(key)
        return None

    def _drop_oldest_ghost(self) -> int:
        key, size = self._ghost.popitem(last=False)
        self._ghost_bytes -= size
        freed = _ghost_objects(key)
        self._ghost_objects -= freed
        return freed

    # -- memory (``kvstore.eviction.base``) ---------------------------------------------------------------

    def entry_bytes(self, key_len: int) -> int:
        # a place in the small or main FIFO, the size (an entry and its int) and the counter (a small int)
        return ODICT_ENTRY_BYTES + 2 * DICT_ENTRY_BYTES + INT_BYTES

    def memory_bytes(self) -> int:
        return (containers(self._small, self._main, self._size, self._freq) + INT_BYTES * len(self._size)
                + self.extra_bytes())

    def extra_bytes(self) -> int:
        return getsizeof(self._ghost) + self._ghost_objects

    def _shed(self, over: int) -> int:
        while over > 0 and self._ghost:
            over -= self._drop_oldest_ghost()
        return over

    # -- introspection (tests, stats) --------------------------------------------------------------------

    def where(self, key: bytes) -> str | None:
        """Which queue holds ``key``: "small", "main", "ghost", or None."""
        if key in self._small:
            return "small"
        if key in self._main:
            return "main"
        if key in self._ghost:
            return "ghost"
        return None

    def held_bytes(self) -> int:
        return self._small_bytes + self._main_bytes

    def ghost_bytes(self) -> int:
        return self._ghost_bytes


def _ghost_objects(key: bytes) -> int:
    """What a ghost keeps alive: its key and its size."""
    return bytes_object(len(key)) + INT_BYTES
