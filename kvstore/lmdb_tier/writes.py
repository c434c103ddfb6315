"""The write side: ``put_many`` (unbounded: one transaction, the map grown as needed; bounded: split into
transactions of at most ``txn_bytes``, each evicting in itself, ``kvstore.lmdb_tier.bounded``) and ``delete``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import lmdb

from kvshelf.kvstore.errors import StoreFullError
from kvshelf.kvstore.lmdb_tier.layout import _CHARGED, _TOTAL, _U64
from kvshelf.kvstore.lmdb_tier.txn import _Full


class Writes:
    """``put_many`` and ``delete`` (a mixin of ``LMDBTier``)."""

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0
        if self.capacity_bytes is None:
            return self._write(lambda txn: self._put_unbounded(txn, items), needed=sum(len(v) for _, v in items))
        stored, chunk, size = 0, [], 0
        for key, value in items:
            charge = self._charge(len(key), len(value))
            if chunk and size + charge > self._txn_bytes:
                stored += self._put_chunk(chunk, size)
                chunk, size = [], 0
            chunk.append((key, value))
            size += charge
        return stored + self._put_chunk(chunk, size)

    def _put_unbounded(self, txn: lmdb.Transaction, items: Sequence[tuple[bytes, bytes]]) -> int:
        total = self._total(txn)
        for key, value in items:
            old = txn.get(key)
            if old is not None:
                total -= len(old)
            txn.put(key, value)
            total += len(value)
        txn.put(_TOTAL, _U64.pack(total), db=self._meta)
        self._index_stale(txn)
        return len(items)

    def _index_stale(self, txn: lmdb.Transaction) -> None:
        """Unbounded writes keep no key index (the layout stays as it always was): dropping the charges counter
        marks the index stale, and the next bounded open rebuilds it."""
        if txn.get(_CHARGED, db=self._meta) is not None:
            txn.delete(_CHARGED, db=self._meta)

    def delete(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)

        def fn(txn: lmdb.Transaction) -> list[bytes]:
            counters = [self._total(txn), self._counter(txn, _CHARGED)]
            removed = []
            for key in keys:
                old = txn.get(key)
                if old is not None:
                    self._remove_in(txn, key, len(old), counters)
                    removed.append(key)
            if self.capacity_bytes is None:
                txn.put(_TOTAL, _U64.pack(max(counters[0], 0)), db=self._meta)
                self._index_stale(txn)
            else:
                self._save_counters(txn, counters)
            return removed

        while True:
            try:
                removed = self._write(fn)
                break
            except _Full:  # bounded and full to the last page: free some room first (deleting needs new pages)
                if not self._evict_round(self._page_size, reason="a delete found the map full"):
                    raise StoreFullError(f"LMDB tier {self.path} is full to its last page and nothing unpinned "
                                         "is left to evict; the delete was not done") from None
                self._tick()
        if self.policy is not None:
            with self._plock:
                for key in removed:
                    if self._known.pop(key, None) is not None:
                        self.policy.on_remove(key)
        return len(removed)
