"""ARC: adaptive replacement between recency (T1) and frequency (T2), steered by two ghost lists.

Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003. Held keys are in T1 (seen
once recently) or T2 (seen at least twice); B1 and B2 remember, without values, keys recently evicted from T1
and T2. A returning B1 key says T1 was too small: the target size ``p`` of T1 grows; a returning B2 key says T2
was too small: ``p`` shrinks. Eviction (ARC's REPLACE) takes T1's LRU key when T1 holds more than ``p`` (or
exactly ``p`` while the incoming key is a B2 ghost), else T2's LRU key. A key coming back from B1 or B2 enters
T2; a new key enters T1.

Adapted to a tier that owns the capacity (``kvstore.eviction.base``): everything is counted in BYTES, with the
sizes from ``on_insert`` (ghosts keep the size they had): c = ``capacity_bytes``, 0 <= p <= c, and the
directory is bounded as the paper's, |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (the oldest ghosts
go first). ARC's per-request adaptation of ``p`` happens when the tier asks ``admit`` for the returning key
(before it makes room, as in the paper; the key leaves its ghost list then, so the trims of that room-making
cannot drop it), or at ``on_insert`` for a tier that does not ask. The adaptation step
is the paper's delta (1, or the ratio of the other ghost list to this one) times the key's size. ``victim``
applies REPLACE; the tier evicts what it names; only keys the policy named enter B1/B2 (a deleted key is
forgotten). Under a tier that counts its memory (``extra_limit``, ``kvstore.eviction.base``) the ghosts' memory
(keys, sizes, the two lists' tables) also stays under that limit: the longer ghost list loses its oldest first.

Pins: a pinned key met at the LRU end of T1 or T2 moves to that list's MRU end and is never named; when the list
REPLACE picks holds only pinned keys the other list gives the victim; ``None`` only when every held key is
pinned. O(1) amortized per call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set
from sys import getsizeof

from kvshelf.kvstore.eviction.base import EvictionPolicy
from kvshelf.kvstore.footprint import INT_BYTES, ODICT_ENTRY_BYTES, bytes_object


class _List:
    """An LRU-ordered list of keys with their sizes and the byte total (oldest first).

    ``objects`` is the memory of the objects the list keeps alive: each size (an ``int``) and, for a list that
    may hold key objects other than the tier's (``owns_keys``: the ghost lists, and T2, which a hit fills with the
    reader's key object), each key."""

    __slots__ = ("bytes", "keys", "objects", "owns_keys")

    def __init__(self, owns_keys: bool = False) -> None:
        self.keys: OrderedDict[bytes, int] = OrderedDict()
        self.bytes = 0
        self.objects = 0
        self.owns_keys = owns_keys

    def _objects(self, key: bytes) -> int:
        return INT_BYTES + (bytes_object(len(key)) if self.owns_keys else 0)

    def add(self, key: bytes, size: int) -> None:
        self.keys[key] = size
        self.bytes += size
        self.objects += self._objects(key)

    def pop(self, key: bytes) -> int:
        size = self.keys.pop(key)
        self.bytes -= size
        self.objects -= self._objects(key)
        return size

    def pop_oldest(self) -> int:
        """Drop the oldest key; return the memory of the objects it freed."""
        key, size = self.keys.popitem(last=False)
        self.bytes -= size
        freed = self._objects(key)
        self.objects -= freed
        return freed

    def memory(self) -> int:
        return getsizeof(self.keys) + self.objects

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)


class ARCPolicy(EvictionPolicy):
    """ARC (Megiddo & Modha, FAST 2003) in bytes; see the module docstring for the adaptation."""

    name = "arc"

    def __init__(self, capacity_bytes: int, *, ghost_factor: float = 1.0) -> None:
        super().__init__(capacity_bytes)
        #: the ghost directory's bound in multiples of the paper's: T1 + B1 <= factor x c, all four <= 2 x factor x c
        self.ghost_factor = ghost_factor
        self.p = 0.0  # target bytes of T1
        # T2 may hold the caller's key object of a hit (a copy of the tier's); B1 and B2 the keys the tier let go
        self._t1, self._t2 = _List(), _List(owns_keys=True)
        self._b1, self._b2 = _List(owns_keys=True), _List(owns_keys=True)
        self._returning: bytes | None = None  # the ghost admit() just took back (it enters T2 when inserted)
        self._incoming_in_b2 = False
        self._named: bytes | None = None

    # -- the tier's calls --------------------------------------------------------------------------------

    def admit(self, key: bytes, size: int) -> bool:
        self._incoming_in_b2 = key in self._b2
        self._returning = None
        if key in self._b1 or key in self._b2:  # a ghost hit: adapt p now, before the tier makes room
            self._adapt(key, size)
            (self._b1 if key in self._b1 else self._b2).pop(key)  # out of reach of the trims REPLACE causes
            self._returning = key
        return True

    def on_insert(self, key: bytes, size: int) -> None:
        if key in self._t1 or key in self._t2:  # not expected (the tier inserts only keys it does not hold)
            self.on_hit(key)
            return
        returning = key == self._returning
        if key in self._b1 or key in self._b2:  # a tier that did not ask admit()
            self._adapt(key, size)
            (self._b1 if key in self._b1 else self._b2).pop(key)
            returning = True
        self._returning = None
        self._incoming_in_b2 = False
        if returning:  # seen twice recently
            self._t2.add(key, size)
        else:
            self._t1.add(key, size)
            # ARC case IV: the L1 directory (T1 + B1) holds at most c
            self._trim_b1()
        self._trim_directory()

    def on_hit(self, key: bytes) -> None:
        if key in self._t1:
            self._t2.add(key, self._t1.pop(key))
        elif key in self._t2:
            self._t2.keys.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        named, self._named = self._named == key, None
        if key in self._t1:
            size = self._t1.pop(key)
            if named:
                self._b1.add(key, size)
                self._trim_b1()
        elif key in self._t2:
            size = self._t2.pop(key)
            if named:
                self._b2.add(key, size)
        else:
            return
        self._trim_directory()
        self._keep_extra_limit()

    def victim(self, pinned: Set[bytes]) -> bytes | None:
        t1 = self._t1.bytes
        from_t1 = bool(self._t1) and (t1 > self.p or (self._incoming_in_b2 and t1 >= self.p))
        first, second = (self._t1, self._t2) if from_t1 else (self._t2, self._t1)
        key = self._lru_unpinned(first, pinned)
        if key is None:
            key = self._lru_unpinned(second, pinned)
        self._named = key
        return key

    # -- ARC's rules ---------------------------------------------------------------------------------------

    def _adapt(self, key: bytes, size: int) -> None:
        """Move the target ``p`` on a ghost hit (the paper's cases II and III)."""
        b1, b2 = self._b1.bytes, self._b2.bytes
        if key in self._b1:
            delta = max(1.0, b2 / b1) if b1 else 1.0
            self.p = min(float(self.capacity_bytes), self.p + delta * size)
        elif key in self._b2:
            delta = max(1.0, b1 / b2) if b2 else 1.0
            self.p = max(0.0, self.p - delta * size)

    def _trim_b1(self) -> None:
        """ARC case IV: the L1 directory (T1 + B1) holds at most c (times ``ghost_factor``)."""
        limit = self.ghost_factor * self.capacity_bytes
        while self._b1 and self._t1.bytes + self._b1.bytes > limit:
            self._b1.pop_oldest()

    def _trim_directory(self) -> None:
        """The whole directory (T1 + T2 + B1 + B2) holds at most 2c (times ``ghost_factor``): drop the oldest
        ghosts, B2's first."""
        limit = 2 * self.ghost_factor * self.capacity_bytes
        total = self._t1.bytes + self._t2.bytes + self._b1.bytes + self._b2.bytes
        while total > limit and (self._b1 or self._b2):
            ghosts = self._b2 if self._b2 else self._b1
            before = ghosts.bytes
            ghosts.pop_oldest()
            total -= before - ghosts.bytes

    @staticmethod
    def _lru_unpinned(lst: _List, pinned: Set[bytes]) -> bytes | None:
        for _ in range(len(lst)):
            key = next(iter(lst.keys))
            if key not in pinned:
                return key
            lst.keys.move_to_end(key)  # a pinned key waits at the MRU end: later calls do not walk past it
        return None

    # -- memory (``kvstore.eviction.base``) ---------------------------------------------------------------

    def entry_bytes(self, key_len: int) -> int:
        return ODICT_ENTRY_BYTES + INT_BYTES + bytes_object(key_len)  # a place in T1 or T2, its size, a key copy

    def memory_bytes(self) -> int:
        t1, t2 = self._t1, self._t2
        return getsizeof(t1.keys) + getsizeof(t2.keys) + t1.objects + t2.objects + self.extra_bytes()

    def extra_bytes(self) -> int:
        b1, b2 = self._b1, self._b2
        return getsizeof(b1.keys) + getsizeof(b2.keys) + b1.objects + b2.objects

    def _shed(self, over: int) -> int:
        """The oldest ghosts of the longer ghost list first (both lists keep their share of the memory)."""
        b1, b2 = self._b1, self._b2
        while over > 0 and (b1 or b2):
            over -= (b1 if len(b1) >= len(b2) else b2).pop_oldest()
        return over

    # -- introspection (tests, stats) --------------------------------------------------------------------

    def where(self, key: bytes) -> str | None:
        """Which list holds ``key``: "T1", "T2", "B1", "B2", or None."""
        for label, lst in (("T1", self._t1), ("T2", self._t2), ("B1", self._b1), ("B2", self._b2)):
            if key in lst:
                return label
        return None

    def list_bytes(self) -> dict[str, int]:
        return {"T1": self._t1.bytes, "T2": self._t2.bytes, "B1": self._b1.bytes, "B2": self._b2.bytes}
