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
   held value is a KV block (KBs to MBs), so 8x the capacity's worth of ghosts costs < 0.1% of it. Under a tier
   that counts its memory (``extra_limit``, ``kvstore.eviction.base``), the ghosts, the pending parents and the
   tail walks' bookmarks together stay under that limit (with values of a few hundred bytes, where a ghost costs
   about half a held entry, the directory is then shorter than 8x).
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
from sys import getsizeof

from kvshelf.kvstore.eviction.arc import ARCPolicy
from kvshelf.kvstore.footprint import BYTES_HEADER, DICT_ENTRY_BYTES, bytes_object

#: ghost directory in multiples of ARC's (see the module docstring, point 1)
GHOST_FACTOR = 8.0
#: parents of keys looked up but not stored yet, remembered for the puts that follow (per pending key)
_PENDING_PARENTS = 1 << 16
#: a dict of one child (a parent's children)
_SMALL_DICT_BYTES = getsizeof({b"": None})
_ABSENT = object()


def _key(key: bytes) -> int:
    """Memory of a key object kept alive by one of the chain structures (each counted as its own copy: lookups
    bring their own key objects): ``footprint.bytes_object``, inlined (keys are short)."""
    size = BYTES_HEADER + len(key)
    return (size + 15) & ~15 if size <= 512 else bytes_object(len(key))


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
        self._objects = 0  # memory of the keys and children's dicts that _parent, _children and _orphans keep alive
        self._extra_objects = 0  # ... and of the keys that _pending and _walked keep alive

    # -- chains --------------------------------------------------------------------------------------------

    def on_lookup(self, keys: Sequence[bytes], held: int) -> None:
        for i in range(1, len(keys)):
            child, parent = keys[i], keys[i - 1]
            if i < held:
                self._link(child, parent)
            else:
                self._set_link(self._pending, child, parent, touch=True)
        while len(self._pending) > _PENDING_PARENTS:
            self._drop_oldest(self._pending)
        self._keep_extra_limit()

    def _held(self, key: bytes) -> bool:
        return key in self._t1 or key in self._t2

    def _link(self, child: bytes, parent: bytes) -> None:
        """Record ``child``'s parent (both held, or the parent gone: then ``child`` is an orphan)."""
        old = self._parent.get(child)
        if old == parent:
            return
        if old is not None:
            self._drop_child(old, child)
        self._parent[child] = parent
        self._objects += _key(parent) - (_key(old) if old is not None else -_key(child))
        if self._held(parent):
            self._add_child(parent, child)
            self._unorphan(child)
        else:
            self._orphan(child)

    def on_insert(self, key: bytes, size: int) -> None:
        super().on_insert(key, size)
        parent = self._pending.pop(key, None)
        if parent is not None:
            self._extra_objects -= _key(key) + _key(parent)
            self._link(key, parent)

    def on_remove(self, key: bytes) -> None:
        super().on_remove(key)
        if self._held(key):
            return
        self._unorphan(key)
        parent = self._parent.pop(key, None)
        if parent is not None:
            self._objects -= _key(key) + _key(parent)
            siblings = self._children.get(parent)
            if siblings is not None:
                self._drop_child(parent, key)
                if not siblings:
                    self._drop_children(parent)
        for child in self._drop_children(key):
            self._orphan(child)

    # -- the structures' bookkeeping (what each entry keeps alive, for ``memory_bytes``) ---------------------

    def _add_child(self, parent: bytes, child: bytes) -> None:
        children = self._children.get(parent)
        if children is None:
            children = self._children[parent] = {}
            self._objects += _key(parent) + getsizeof(children)
        before, new = getsizeof(children), child not in children
        children[child] = None
        self._objects += getsizeof(children) - before + (_key(child) if new else 0)

    def _drop_child(self, parent: bytes, child: bytes) -> None:
        children = self._children.get(parent)
        if children is not None and children.pop(child, _ABSENT) is not _ABSENT:
            self._objects -= _key(child)

    def _drop_children(self, parent: bytes) -> dict[bytes, None]:
        """Forget ``parent``'s children; return them."""
        children = self._children.pop(parent, None)
        if children is None:
            return {}
        self._objects -= _key(parent) + getsizeof(children) + sum(_key(c) for c in children)
        return children

    def _orphan(self, key: bytes) -> None:
        if key not in self._orphans:
            self._orphans[key] = None
            self._objects += _key(key)

    def _unorphan(self, key: bytes) -> None:
        if self._orphans.pop(key, _ABSENT) is not _ABSENT:
            self._objects -= _key(key)

    def _set_link(self, table: OrderedDict[bytes, bytes], key: bytes, parent: bytes, *, touch: bool) -> None:
        """``table[key] = parent`` (``_pending`` or ``_walked``), counting the key objects it keeps alive; ``touch``
        makes it the newest entry."""
        old = table.get(key)
        table[key] = parent
        if touch:
            table.move_to_end(key)
        self._extra_objects += _key(parent) - (_key(old) if old is not None else -_key(key))

    def _drop_oldest(self, table: OrderedDict[bytes, bytes]) -> int:
        """Drop ``table``'s oldest entry; return the bytes of the key objects it freed."""
        key, parent = table.popitem(last=False)
        freed = _key(key) + _key(parent)
        self._extra_objects -= freed
        return freed

    # -- memory (``kvstore.eviction.base``) ---------------------------------------------------------------

    def entry_bytes(self, key_len: int) -> int:
        # ARC's place; the link to its parent (both keys); its own children's dict and its place in its parent's
        key = bytes_object(key_len)
        return super().entry_bytes(key_len) + 2 * (DICT_ENTRY_BYTES + 2 * key) + _SMALL_DICT_BYTES

    def memory_bytes(self) -> int:
        return (super().memory_bytes() + getsizeof(self._parent) + getsizeof(self._children)
                + getsizeof(self._orphans) + self._objects + getsizeof(self._pending) + getsizeof(self._walked)
                + self._extra_objects)

    def extra_bytes(self) -> int:
        return super().extra_bytes() + getsizeof(self._pending) + getsizeof(self._walked) + self._extra_objects

    def _shed(self, over: int) -> int:
        """The tail walks' bookmarks first, then the oldest pending parents, then ARC's ghosts."""
        while over > 0 and self._walked:
            over -= self._drop_oldest(self._walked)
        while over > 0 and self._pending:
            over -= self._drop_oldest(self._pending)
        return super()._shed(over)

    # -- eviction ------------------------------------------------------------------------------------------

    def victim(self, pinned: Set[bytes]) -> bytes | None:
        for _ in range(len(self._orphans)):  # oldest first, without copying the list on every eviction
            orphan = next(iter(self._orphans))
            if not self._held(orphan):
                self._unorphan(orphan)
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
            # where the next walk from head starts, once key is gone
            self._set_link(self._walked, head, parent, touch=False)
            while len(self._walked) > _PENDING_PARENTS:
                self._drop_oldest(self._walked)
        return key
