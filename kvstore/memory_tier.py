"""CPU memory tier: a dictionary of encoded blocks bounded by a byte capacity, evicting by a pluggable policy."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence, Set
from sys import getsizeof

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from kvshelf.kvstore.footprint import DICT_ENTRY_BYTES, bytes_object, containers
from kvshelf.kvstore.tier import EvictionCallback, Tier, TierUsage

#: the policy's memory of keys not held (ghost lists, learnt chain links) may take up to 1/EXTRA_SHARE of the
#: capacity (it counts against the capacity as the held entries do)
EXTRA_SHARE = 8


class MemoryTier(Tier):
    """Encoded blocks in process memory within ``capacity_bytes``; ``policy`` (a name of
    ``kvstore.eviction.POLICIES`` or an instance) picks what to evict. Pinned keys are never evicted.

    What the capacity bounds (``charge_overhead=True``, the default): the process memory the tier holds, not only
    its values' bytes. Each entry is *charged* its value plus its overhead (``entry_charge``): the key and value
    objects (33-byte headers, allocator rounding), its dict entry, and the policy's structures for the key
    (``EvictionPolicy.entry_bytes``), at most: ~0.45 KB besides the value with LRU, ~0.55 KB with ARC, ~0.7 KB
    with S3-FIFO, ~1.3 KB with the prefix policy (40-byte keys; ``kvstore.footprint``). The charge is the size the
    policy is told and what a put makes room for; what is then held is measured (``memory_bytes``). The policy's
    memory of keys not held (ghost lists, learnt chain links) counts too, and is kept under ``capacity /
    EXTRA_SHARE`` by the policy itself (oldest first). After every call, ``memory_bytes()`` (the key and value
    objects, the tier's and the policy's containers as ``sys.getsizeof`` measures them, the policy's objects) is
    at most the capacity: a put evicts until the new entry's charge fits, then evicts more if a table grew on the
    insert; a read, a lookup or a pin that makes the structures grow past the capacity evicts too (outside its
    keys), shedding the policy's memory of keys not held only when nothing unpinned is left to evict. The
    eviction callback hears of every value evicted, whatever the call.

    ``usage().bytes`` is the values' bytes (what the LMDB and Redis tiers count, what the store's stats and the
    service's usage report), so a full tier shows ``usage().bytes`` below ``capacity_bytes`` by the overhead;
    ``memory_bytes()`` is what the capacity bounds. ``charge_overhead=False`` (trace replay, where every value is
    one shared placeholder): the capacity bounds the values' bytes only, the policy is told value lengths, and
    ``memory_bytes()`` is reported but not bounded.

    Not stored (``put_many`` counts only what it stored): a value whose charge is larger than the capacity (with
    the overhead: a value that fits by its bytes alone but not with its overhead is refused as a larger one is,
    evicting nothing), one the policy does not admit, one that fits only by evicting pinned values. (Rarely,
    emptied tables or the policy's state about keys not held stand in the way after the unpinned values were
    evicted: the value is refused then too.) A value that replaces a held one and cannot be stored leaves the key
    absent.
    """

    holds_checked_copies = True  # values are immutable bytes (``_own_copy``) that the store checked

    def __init__(self, capacity_bytes: int, name: str = "memory", *,
                 policy: str | EvictionPolicy = DEFAULT_POLICY, charge_overhead: bool = True) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"memory tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.charge_overhead = charge_overhead
        self.policy = make_policy(policy, capacity_bytes) if isinstance(policy, str) else policy
        self._data: dict[bytes, bytes] = {}
        self._bytes = 0  # the values' bytes
        self._objects = 0  # the memory of the held key and value objects
        self._pinned: set[bytes] = set()
        self._pinned_objects = 0
        self._lock = threading.Lock()
        self._on_evict: EvictionCallback | None = None
        if charge_overhead:
            self.policy.extra_limit = capacity_bytes // EXTRA_SHARE
        self._policy_floor = self.policy.memory_bytes()  # what the policy holds with no key at all
        self._key_overheads: dict[int, int] = {}  # key length -> what an entry costs besides its value object

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        self._on_evict = callback

    # -- charges -------------------------------------------------------------------------------------------

    def entry_charge(self, key_len: int, value_len: int) -> int:
        """What an entry of a ``key_len``-byte key and a ``value_len``-byte value is charged against the capacity
        (``value_len`` with ``charge_overhead=False``)."""
        if not self.charge_overhead:
            return value_len
        overhead = self._key_overheads.get(key_len)
        if overhead is None:  # keys come in a few lengths
            overhead = bytes_object(key_len) + DICT_ENTRY_BYTES + self.policy.entry_bytes(key_len)
            self._key_overheads[key_len] = overhead
        return bytes_object(value_len) + overhead

    def memory_bytes(self) -> int:
        """The memory the tier holds now: its key and value objects, its containers and its policy's state."""
        with self._lock:
            return self._memory()

    def _memory(self) -> int:
        return (self._objects + self._pinned_objects + getsizeof(self._data) + getsizeof(self._pinned)
                + self.policy.memory_bytes())

    def _used(self) -> int:
        """What the capacity bounds: the memory held, or the values' bytes with ``charge_overhead=False``."""
        return self._memory() if self.charge_overhead else self._bytes

    def _value_cost(self, value_len: int) -> int:
        return bytes_object(value_len) if self.charge_overhead else value_len

    # -- the tier's calls ----------------------------------------------------------------------------------

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        evicted: list[tuple[bytes, bytes]] = []
        with self._lock:
            for key in keys:
                value = self._data.get(key)
                if value is not None:
                    self.policy.on_hit(key)
                out.append(value)
            self._settle(keys, evicted)  # a hit may move a key to a list whose table grows
        self._report(evicted)
        return out

    def _own_copy(self, value: bytes | bytearray | memoryview) -> bytes:
        """What the tier holds for ``value``: the same object when it is ``bytes`` (immutable), else a ``bytes`` copy
        (a caller's buffer may change after the put; the tier's values never do: ``holds_checked_copies``)."""
        return value if type(value) is bytes else bytes(value)

    def peek_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys``, the policy told nothing (no hit, no recency)."""
        with self._lock:
            return [self._data.get(key) for key in keys]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        items = [(key, self._own_copy(value)) for key, value in items]  # before the lock: a copy takes time
        evicted: list[tuple[bytes, bytes]] = []
        stored = 0
        with self._lock:
            for key, value in items:
                old = self._data.get(key)
                charge = self.entry_charge(len(key), len(value))
                if old is None and not self.policy.admit(key, charge):
                    continue
                # a re-put keeps the key, its dict entry and the policy's structures: only the value object changes
                growth = charge if old is None else self._value_cost(len(value)) - self._value_cost(len(old))
                if not self._make_room(charge, growth, key, evicted):
                    if old is not None:  # the new value cannot take the old one's place: the key is gone
                        self._remove(key)
                    continue
                self._data[key] = value
                self._bytes += len(value)
                self._objects += bytes_object(len(value))
                if old is None:
                    self._objects += bytes_object(len(key))
                    self.policy.on_insert(key, charge)
                else:
                    self._bytes -= len(old)
                    self._objects -= bytes_object(len(old))
                    self.policy.on_hit(key)
                if not self._settle((key,), evicted):  # a table grew past what is left: the key cannot stay
                    self._remove(key)
                    continue
                stored += 1
        self._report(evicted)
        return stored

    def _make_room(self, charge: int, growth: int, key: bytes, evicted: list[tuple[bytes, bytes]]) -> bool:
        """Evict until ``growth`` more bytes fit (``charge``: the whole entry's, for ``key``, which is never evicted
        for its own new value); False, evicting nothing, when only pinned values stand in the way."""
        capacity = self.capacity_bytes
        if charge > capacity:
            return False
        if self._used() + growth <= capacity:
            return True
        keep = self._pinned | {key}
        kept = sum(self.entry_charge(len(k), len(self._data[k])) for k in keep if k in self._data and k != key)
        if self._floor() + kept + charge > capacity:
            return False
        return self._evict(growth, keep, evicted)

    def _floor(self) -> int:
        """The least memory the tier would hold with no unpinned entry (its tables do not shrink on eviction)."""
        if not self.charge_overhead:
            return 0
        return containers(self._data, self._pinned) + self._pinned_objects + self._policy_floor

    def _settle(self, protected: Sequence[bytes], evicted: list[tuple[bytes, bytes]]) -> bool:
        """With ``charge_overhead``: evict (never a pinned key or one of ``protected``) until the memory held is
        within the capacity; False if it still is not."""
        if not self.charge_overhead or self._memory() <= self.capacity_bytes:
            return True
        return self._evict(0, self._pinned.union(protected), evicted)

    def _evict(self, growth: int, keep: Set[bytes], evicted: list[tuple[bytes, bytes]]) -> bool:
        """Evict the victims the policy names (never one in ``keep``) until ``growth`` more bytes fit; when none is
        left, shed the policy's memory of keys not held. False if they still do not fit."""
        over = self._used() + growth - self.capacity_bytes
        while over > 0:
            victim = self.policy.victim(keep)
            if victim is None and self.charge_overhead:  # only the policy's memory of keys not held is left
                self._shed_extra(self._used() + growth - self.capacity_bytes)
                return self._used() + growth <= self.capacity_bytes
            if victim is None or victim not in self._data:
                raise AssertionError(f"eviction policy {self.policy.name} named {victim!r}, which is not held")
            value = self._remove(victim)
            evicted.append((victim, value))
            over -= self._value_cost(len(value))  # at least the value object is freed...
            if over <= 0:  # ... and what else was (or a table that grew) is in the exact count
                over = self._used() + growth - self.capacity_bytes
        return True

    def _shed_extra(self, over: int) -> None:
        self.policy.trim_extra(max(0, self.policy.extra_bytes() - over))

    def _remove(self, key: bytes) -> bytes:
        value = self._data.pop(key)
        self._bytes -= len(value)
        self._objects -= bytes_object(len(key)) + bytes_object(len(value))
        self.policy.on_remove(key)
        return value

    def _report(self, evicted: list[tuple[bytes, bytes]]) -> None:
        if self._on_evict is not None:
            for key, value in evicted:
                self._on_evict(key, value)

    def prefix_run_length(self, keys: Sequence[bytes]) -> int:
        evicted: list[tuple[bytes, bytes]] = []
        with self._lock:
            held = len(keys)
            for i, key in enumerate(keys):
                if key not in self._data:
                    held = i
                    break
            if len(keys) > 1:
                self.policy.on_lookup(keys, held)
                self._settle(keys[:held], evicted)  # the policy learnt links: its structures may have grown
        self._report(evicted)
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
        evicted: list[tuple[bytes, bytes]] = []
        with self._lock:
            for key in keys:
                if key not in self._pinned:
                    self._pinned.add(key)
                    self._pinned_objects += bytes_object(len(key))
            self._settle((), evicted)  # the pins' own memory (their set and keys) counts too
        self._report(evicted)

    def unpin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                if key in self._pinned:
                    self._pinned.discard(key)
                    self._pinned_objects -= bytes_object(len(key))

    def usage(self) -> TierUsage:
        """``bytes``: the values' bytes (``memory_bytes()`` is what the capacity bounds; see the class docstring)."""
        with self._lock:
            return TierUsage(blocks=len(self._data), bytes=self._bytes, capacity_bytes=self.capacity_bytes)

