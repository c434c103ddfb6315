"""Prefix-aware eviction for chained KV blocks: ARC's adaptive split, a long key-only memory, chains cut tail first.

kvshelf's own design, built on ARC (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
FAST 2003) from three facts of prefix-cache traffic (measured with ``kvshelf replay`` on the Mooncake traces,
Qin et al., "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving", FAST 2025):

1. **A conversation's blocks return at its next turn, long after they were stored.** The median gap between a
   conversation's turns is ~380 requests on the conversation trace, about twice the time a 5%-of-blocks LRU
   cache keeps a block, and ~70% of first-turn blocks never return. A block seen twice is worth keeping and a
   block seen once mostly is not: ARC's T1 (seen once) / T2 (seen again) split, steered by its ghost lists,
   learns how much room the once-seen deserve. The ghosts must remember a conversation across its turn gap, so
   they span ``ghost_factor`` (8) times the paper's directory: a ghost is a key (16-24 bytes) and a size, a
   held value is a KV block (KBs to MBs), so 8x the capacity's worth of ghosts costs < 0.1% of it.
2. **A chain's later blocks are useless without its earlier ones** (a prefix hit stops at the first missing
   block). Chains are learned from prefix lookups (``on_lookup``: each key's parent is the key before it).
   When ARC names a block that still has a held descendant, the chain's deepest held descendant goes instead:
   a chain is shortened from its tail, never cut in the middle.
3. **An orphan is dead weight**: a held block whose parent left cannot be a prefix hit until the parent comes
   back (and the request that brings it back stores the whole rest of the chain again), so orphans are evicted
   before anything ARC would pick.

Admission: every block is admitted (T1 is where ARC lets a once-seen block prove itself). O(1) amortized per
call, plus the walk to a chain's tail (at most the chain's held length) per eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence, Set

from kvshelf.kvstore.eviction.arc import ARCPolicy

#: ghost directory in multiples of ARC's (see the module docstring, point 1)
GHOST_FACTOR = 8.0
#: parents of keys looked up but not stored yet, remembered for the puts that follow (per pending key)
_PENDING_PARENTS = 1 << 16


class PrefixAwarePolicy(ARCPolicy):
    """ARC with an 8x ghost directory, chains evicted tail first and orphans first (see the module docstring)."""

    name = "prefix"

    def __init__(self, capacity_bytes: int, *, ghost_factor: float = GHOST_FACTOR) -> None:
        super().__init__(capacity_bytes, ghost_factor=ghost_factor)
        self._parent: dict[bytes, bytes] = {}  # held key -> its chain parent (held or not)
        self._children: dict[bytes, dict[bytes, None]] = {}  # held key -> its held children (insertion order)
        self._pending: OrderedDict[bytes, bytes] = OrderedDict()  # looked-up, not held key -> parent
        self._orphans: OrderedDict[bytes, None] = OrderedDict()  # held keys whose parent left
        self._walked: OrderedDict[bytes, bytes] = OrderedDict()  # chain head -> where its last tail walk ended

    # -- chains --------------------------------------------------------------------------------------------

    def on_lookup(self, keys: Sequence[bytes], held: int) -> None:
        for i in range(1, len(keys)):
            child, parent = keys[i], keys[i - 1]
            if i < held:
                self._link(child, parent)
            else:
                self._pending[child] = parent
                self._pending.move_to_end(child)
        while len(self._pending) > _PENDING_PARENTS:
            self._pending.popitem(last=False)

    def _held(self, key: bytes) -> bool:
        return key in self._t1 or key in self._t2

    def _link(self, child: bytes, parent: bytes) -> None:
        """Record ``child``'s parent (both held, or the parent gone: then ``child`` is an orphan)."""
        old = self._parent.get(child)
        if old == parent:
            return
        if old is not None:
            self._children.get(old, {}).pop(child, None)
        self._parent[child] = parent
        if self._held(parent):
            self._children.setdefault(parent, {})[child] = None
            self._orphans.pop(child, None)
        else:
            self._orphans[child] = None

    def on_insert(self, key: bytes, size: int) -> None:
        super().on_insert(key, size)
        parent = self._pending.pop(key, None)
        if parent is not None:
            self._link(key, parent)

    def on_remove(self, key: bytes) -> None:
        super().on_remove(key)
        if self._held(key):
            return
        self._orphans.pop(key, None)
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.pop(key, None)
                if not siblings:
                    del self._children[parent]
        for child in self._children.pop(key, {}):
            self._orphans[child] = None

    # -- eviction ------------------------------------------------------------------------------------------

    def victim(self, pinned: Set[bytes]) -> bytes | None:
        for _ in range(len(self._orphans)):  # oldest first, without copying the list on every eviction
            orphan = next(iter(self._orphans))
            if not self._held(orphan):
                del self._orphans[orphan]
            elif orphan not in pinned:
                self._named = self._chain_tail(orphan, pinned)
                return self._named
            else:
                self._orphans.move_to_end(orphan)  # a pinned orphan waits at the young end
        key = super().victim(pinned)
        if key is None:
            return None
        key = self._chain_tail(key, pinned)
        self._named = key
        return key

    def _chain_tail(self, key: bytes, pinned: Set[bytes]) -> bytes:
        """The deepest unpinned held descendant of ``key`` (``key`` itself when it has none).

        The walk resumes where the last walk from ``key`` ended (a chain evicted tail first is walked once, not
        once per block)."""
        head, resume = key, self._walked.get(key)
        if resume is not None and self._held(resume) and resume not in pinned:
            key = resume
        seen = {head, key}
        while True:
            children = self._children.get(key)
            child = next((c for c in children if c not in pinned and c not in seen), None) if children else None
            if child is None:
                break
            seen.add(child)  # a cycle (two lookups ordering the same keys differently) cannot loop forever
            key = child
        parent = self._parent.get(key)
        if key != head and parent is not None:
            self._walked[head] = parent  # where the next walk from head starts, once key is gone
            while len(self._walked) > _PENDING_PARENTS:
                self._walked.popitem(last=False)
        return key
