"""The bounded mode: the key index (write sequence per key, so the policy knows the held keys after a restart),
evictions inside the put's own write transaction (crash-safe: a crash leaves the state before or after it), the
policy put back when a transaction aborts, and the retries of a put that finds the map full (evict more, commit an
empty transaction so the freed pages become reusable, retry). See docs/storage.md ("LMDB tier").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import lmdb

from kvshelf.kvstore.eviction import EvictionPolicy
from kvshelf.kvstore.lmdb_tier.layout import _CHARGED, _KEYSEQ, _NEXT_SEQ, _SEQ, _TICK, _TOTAL, _U64
from kvshelf.kvstore.lmdb_tier.txn import _Full
from kvshelf.kvstore.tier import EvictionCallback

log = logging.getLogger(__package__)

T = TypeVar("T")
_FULL_RETRIES = 40  # evict-more rounds for one put (each frees twice as much: 40 covers any capacity)
_READER_WAIT_S = 0.5  # how long a put waits for readers holding a snapshot older than its evictions


@dataclass
class _Journal:
    """What one write transaction did to the policy, to undo if the transaction aborts."""

    inserted: list[bytes] = field(default_factory=list)
    removed: list[tuple[bytes, int]] = field(default_factory=list)
    evicted: list[tuple[bytes, bytes]] = field(default_factory=list)  # (key, value) for the callback


class Bounded:
    """``LMDBTier``'s key index, evictions and map-full retries (a mixin)."""

    policy: EvictionPolicy | None
    _keyseq: lmdb._Database
    _order: lmdb._Database
    _plock: threading.Lock
    _known: dict[bytes, int]
    _pinned: set[bytes]
    _on_evict: EvictionCallback | None
    _txn_bytes: int
    map_full_retries: int

    # -- the key index ----------------------------------------------------------------------------------

    def _index_put(self, txn: lmdb.Transaction, key: bytes, length: int, seq: int) -> None:
        old = txn.get(key, db=self._keyseq)
        if old is not None:
            txn.delete(bytes(old)[: _SEQ.size], db=self._order)
        txn.put(key, _KEYSEQ.pack(seq, length), db=self._keyseq)
        txn.put(_SEQ.pack(seq), key, db=self._order)

    def _index_delete(self, txn: lmdb.Transaction, key: bytes) -> None:
        old = txn.get(key, db=self._keyseq)
        if old is not None:
            txn.delete(bytes(old)[: _SEQ.size], db=self._order)
            txn.delete(key, db=self._keyseq)

    def _remove_in(self, txn: lmdb.Transaction, key: bytes, length: int, counters: list[int]) -> None:
        """Delete ``key`` (held, its value ``length`` bytes) with its index entries; ``counters``: [total,
        charged], updated."""
        txn.delete(key)
        self._index_delete(txn, key)
        counters[0] -= length
        counters[1] -= self._charge(len(key), length)

    def _save_counters(self, txn: lmdb.Transaction, counters: list[int], seq: int | None = None) -> None:
        txn.put(_TOTAL, _U64.pack(max(counters[0], 0)), db=self._meta)
        txn.put(_CHARGED, _U64.pack(max(counters[1], 0)), db=self._meta)
        if seq is not None:
            txn.put(_NEXT_SEQ, _U64.pack(seq), db=self._meta)

    # -- eviction -------------------------------------------------------------------------------------

    def _victim(self, txn: lmdb.Transaction, keep: set[bytes]) -> bytes | None:
        """The next key to evict: the policy's choice, else (the policy holds only kept keys) the held key of
        the oldest persisted write that is not kept (another process's); None when every held key is kept."""
        with self._plock:
            victim = self.policy.victim(keep) if self.policy is not None else None
        if victim is not None:
            return victim
        for _, key in txn.cursor(db=self._order).iternext():
            if bytes(key) not in keep:
                return bytes(key)
        return None

    def _evict_in(self, txn: lmdb.Transaction, keep: set[bytes], counters: list[int], journal: _Journal,
                  room: tuple[int, int]) -> bool:
        """Evict victims until ``counters`` (held bytes, charges) are at most ``room``; False when only kept keys
        are left."""
        while counters[0] > room[0] or counters[1] > room[1]:
            victim = self._victim(txn, keep)
            if victim is None:
                return False
            value = txn.get(victim)
            if value is None:  # another process removed it already
                with self._plock:
                    if self._known.pop(victim, None) is not None:
                        self.policy.on_remove(victim)  # type: ignore[union-attr]
                continue
            length = len(value)
            if self._on_evict is not None:
                journal.evicted.append((victim, bytes(value)))
            self._remove_in(txn, victim, length, counters)
            with self._plock:
                if self._known.pop(victim, None) is not None:
                    self.policy.on_remove(victim)  # type: ignore[union-attr]
                    journal.removed.append((victim, length))
        return True

    def _kept_held(self, txn: lmdb.Transaction, keep: set[bytes], key: bytes) -> tuple[int, int]:
        """Bytes and charges of the held keys in ``keep`` other than ``key``."""
        total = charged = 0
        for k in keep:
            if k != key:
                value = txn.get(k)
                if value is not None:
                    total += len(value)
                    charged += self._charge(len(k), len(value))
        return total, charged

    def _undo(self, journal: _Journal) -> None:
        """Put the policy back as it was before an aborted transaction."""
        with self._plock:
            for key in reversed(journal.inserted):
                if self._known.pop(key, None) is not None:
                    self.policy.on_remove(key)  # type: ignore[union-attr]
            inserted = set(journal.inserted)
            for key, length in journal.removed:
                if key not in inserted and key not in self._known:  # (one stored and evicted by it never was)
                    self._known[key] = length
                    self.policy.on_insert(key, length)  # type: ignore[union-attr]

    def _bounded_txn(self, fn: Callable[[lmdb.Transaction, _Journal], T]) -> tuple[T, _Journal]:
        """One write transaction of the bounded mode; the policy is put back if it does not commit."""
        journal = _Journal()
        try:
            return self._write(lambda txn: fn(txn, journal)), journal
        except BaseException:
            self._undo(journal)
            raise

    def _report(self, journal: _Journal) -> None:
        if self._on_evict is not None:
            for key, value in journal.evicted:
                self._on_evict(key, value)

    def _evict_round(self, amount: int, *, reason: str, extra: bool = True) -> int:
        """Commit a transaction evicting victims of at least ``amount`` bytes of charges past what is needed to
        be under the bounds (``extra=False``: of what is needed, at most ``amount``); return the charges freed. A
        full map here evicts one victim at a time."""
        for limit in (amount, 1):
            def fn(txn: lmdb.Transaction, journal: _Journal, limit: int = limit) -> int:
                counters = [self._total(txn), self._counter(txn, _CHARGED)]
                start, over = counters[1], max(self._over(txn), 0)
                target = min(start, over + limit if extra else min(over, limit))
                self._evict_in(txn, set(self._pinned_snapshot()), counters, journal, (counters[0], start - target))
                self._save_counters(txn, counters)
                return start - counters[1]

            try:
                freed, journal = self._bounded_txn(fn)
            except _Full:
                continue
            self._report(journal)
            if freed:
                log.debug("LMDB tier %s: evicted %d bytes of charges (%s)", self.path, freed, reason)
            return freed
        return 0

    def _tick(self) -> None:
        """An otherwise empty commit: the pages freed by the commit before it become reusable by the next one."""
        with contextlib.suppress(_Full):
            self._write(lambda txn: txn.put(_TICK, _U64.pack(self._counter(txn, _TICK) + 1), db=self._meta))

    def _old_reader(self, txnid: int) -> bool:
        """Whether a reader (of any process) holds a snapshot of transaction ``txnid`` or older (the pages freed
        after it cannot be reused while it lasts) for longer than ``_READER_WAIT_S``."""
        deadline = time.monotonic() + _READER_WAIT_S
        while True:
            held = []
            for line in self._env.readers().splitlines()[1:]:
                parts = line.split()
                if len(parts) == 3 and parts[2].isdigit():
                    held.append(int(parts[2]))
            if not any(t <= txnid for t in held):
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.005)

    def _put_chunk(self, chunk: list[tuple[bytes, bytes]], size: int) -> int:
        """Store ``chunk`` (one transaction, evicting in it); on a full map, evict more in transactions of their
        own and retry (docs/storage.md, "LMDB tier")."""
        amount, last_try = max(size, self._page_size), False
        for _ in range(_FULL_RETRIES):
            try:
                stored, journal = self._bounded_txn(lambda txn, journal: self._put_in(txn, chunk, journal))
            except _Full:
                self.map_full_retries += 1
                if last_try:
                    break
                if self._old_reader(int(self._env.info()["last_txnid"]) - 1):
                    log.warning("LMDB tier %s: the map is full and a reader holds an older snapshot (the pages freed "
                                "since cannot be reused until it ends); %d value(s) not stored rather than growing "
                                "the file past its bound", self.path, len(chunk))
                    return 0
                freed = self._evict_round(amount, reason="the map was full")
                self._tick()
                last_try = freed == 0  # nothing unpinned left: the tick made the last frees reusable, one more try
                amount *= 2
                continue
            self._report(journal)
            return stored
        log.warning("LMDB tier %s: the map stayed full after evicting everything unpinned; %d value(s) not stored",
                    self.path, len(chunk))
        return 0

    def _put_in(self, txn: lmdb.Transaction, chunk: list[tuple[bytes, bytes]], journal: _Journal) -> int:
        assert self.capacity_bytes is not None and self.policy is not None
        capacity, limit = self.capacity_bytes, self.capacity_bytes + self._allowance
        counters = [self._total(txn), self._counter(txn, _CHARGED)]
        seq = self._counter(txn, _NEXT_SEQ) or 1
        pinned = self._pinned_snapshot()
        stored = 0
        for key, value in chunk:
            length, charge = len(value), self._charge(len(key), len(value))
            if length > capacity or charge > limit:
                continue
            old = txn.get(key)
            old_len = len(old) if old is not None else 0
            old_charge = self._charge(len(key), old_len) if old is not None else 0
            if old is None:
                with self._plock:
                    if not self.policy.admit(key, length):
                        continue
            base = [counters[0] - old_len, counters[1] - old_charge]  # held, besides this key
            if base[0] + length > capacity or base[1] + charge > limit:
                keep = pinned | {key}
                kept = self._kept_held(txn, keep, key)
                if kept[0] + length > capacity or kept[1] + charge > limit:
                    continue  # fits only by evicting pins: evict nothing for it
                self._evict_in(txn, keep, counters, journal, (capacity - length + old_len, limit - charge + old_charge))
                if counters[0] - old_len + length > capacity or counters[1] - old_charge + charge > limit:
                    continue  # (another process's pins: the victims already evicted stay evicted)
            txn.put(key, value)
            self._index_put(txn, key, length, seq)
            seq += 1
            counters[0] += length - old_len
            counters[1] += charge - old_charge
            with self._plock:
                if key in self._known and old is not None:
                    self._known[key] = length
                    self.policy.on_hit(key)
                else:
                    if key in self._known:  # held by the policy but removed by another process: a new life
                        self.policy.on_remove(key)
                    self._known[key] = length
                    self.policy.on_insert(key, length)
                    journal.inserted.append(key)
            stored += 1
        self._save_counters(txn, counters, seq)
        return stored
