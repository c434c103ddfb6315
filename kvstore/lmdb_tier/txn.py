"""Transaction plumbing: read and write transactions through the process's locks, a full map grown (unbounded) or
reported (bounded), another process's resize adopted, LMDB errors sorted into full, transient and damaged, and the
byte counters read in a transaction.

The threads of one process write one at a time, and a write transaction that fails is aborted with this process's
readers held off for that instant (py-lmdb's abort otherwise waits for a moment when no thread is inside LMDB).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import lmdb

from kvshelf.kvstore.errors import KVShelfError, StoreFullError, TierDamagedError, TierUnavailableError
from kvshelf.kvstore.lmdb_tier.damage import damaged_error
from kvshelf.kvstore.lmdb_tier.layout import _CHARGED, _TOTAL, _U64, value_charge
from kvshelf.kvstore.periodic_sync import PeriodicSync
from kvshelf.kvstore.rwlock import RWLock

T = TypeVar("T")
_RESIZE_RETRIES = 100
# errors of the moment, not of the file: the call fails (the tier counts as unavailable) and the next may work
_TRANSIENT = (lmdb.ReadersFullError, lmdb.DiskError, lmdb.MemoryError, lmdb.TlsFullError)


class _Full(Exception):
    """A write transaction found the map full (its changes were rolled back)."""



class Transactions:
    """``LMDBTier``'s transactions and counters (a mixin)."""

    path: Path
    capacity_bytes: int | None
    max_map_bytes: int
    _env: lmdb.Environment
    _blocks: lmdb._Database
    _meta: lmdb._Database
    _page_size: int
    _allowance: int
    _damaged: TierDamagedError | None
    _closed: bool
    _syncer: PeriodicSync | None
    _lock: RWLock
    _wlock: threading.Lock

    @property
    def damaged(self) -> bool:
        """Whether a call found the environment damaged (every later call fails fast)."""
        return self._damaged is not None

    def _fail(self, exc: lmdb.Error) -> KVShelfError:
        """The error to raise for an LMDB error of a call; marks the tier damaged unless it is transient."""
        if isinstance(exc, lmdb.MapFullError):  # (a write grows the map first; any other full map is this)
            return StoreFullError(f"LMDB tier {self.path} is full: {exc}")
        if isinstance(exc, _TRANSIENT):
            return TierUnavailableError(f"LMDB tier {self.path}: {type(exc).__name__}: {exc}")
        if self._damaged is None:
            self._damaged = damaged_error(self.path, f"{type(exc).__name__}: {exc}")
        return self._damaged

    def _check_usable(self) -> None:
        if self._closed:
            raise KVShelfError(f"LMDB tier {self.path} is closed")
        if self._damaged is not None:
            raise self._damaged

    def _read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        while True:
            self._check_usable()
            try:
                with self._lock.read(), self._env.begin(db=self._blocks, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self._adopt_resize()
            except lmdb.Error as exc:
                raise self._fail(exc) from exc

    def _write(self, fn: Callable[[lmdb.Transaction], T], needed: int = 0) -> T:
        """One write transaction; a full map grows (unbounded) or raises ``_Full`` (bounded)."""
        while True:
            self._check_usable()
            try:
                with self._wlock:
                    return self._write_once(fn)
            except lmdb.MapFullError as exc:
                if self.capacity_bytes is not None:
                    raise _Full() from exc
                self._grow(needed)
            except lmdb.MapResizedError:
                self._adopt_resize()
            except lmdb.Error as exc:
                raise self._fail(exc) from exc

    def _write_once(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """``fn`` in a write transaction, committed; on any error the transaction is aborted with the readers of
        this process held off: py-lmdb's abort of a write transaction waits for a moment when no other thread is
        inside an LMDB call, which busy reader threads can postpone for minutes (measured: 50-500 s). The caller
        holds ``_wlock``: no thread of this process waits for LMDB's writer lock while holding ``_lock``."""
        with self._lock.read():
            txn = self._env.begin(db=self._blocks, write=True, buffers=True)
            try:
                result = fn(txn)
                txn.commit()
                if self._syncer is not None:
                    self._syncer.dirty()
                return result
            except BaseException as exc:
                error = exc
        with self._lock.write():
            txn.abort()
        raise error

    def _adopt_resize(self) -> None:
        with self._lock.write():
            self._env.set_mapsize(0)  # take the size another process set

    def _grow(self, needed: int) -> None:
        with self._lock.write():
            current = self._env.info()["map_size"]
            if current >= self.max_map_bytes:
                raise StoreFullError(
                    f"LMDB tier {self.path} is full at its max_map_bytes={self.max_map_bytes}; "
                    "raise max_map_bytes, or delete blocks (their pages are reused by later writes); "
                    "nothing stored was lost"
                )
            self._env.set_mapsize(min(self.max_map_bytes, max(current * 2, current + 2 * needed)))

    def _counter(self, txn: lmdb.Transaction, name: bytes) -> int:
        raw = txn.get(name, db=self._meta)
        return _U64.unpack(bytes(raw))[0] if raw is not None else 0

    def _total(self, txn: lmdb.Transaction) -> int:
        return self._counter(txn, _TOTAL)

    def _charge(self, key_len: int, value_len: int) -> int:
        return value_charge(key_len, value_len, self._page_size)

    def _over(self, txn: lmdb.Transaction) -> int:
        """How many bytes (of values, or of charges) the environment holds past its bounds."""
        assert self.capacity_bytes is not None
        return max(self._total(txn) - self.capacity_bytes,
                   self._counter(txn, _CHARGED) - self.capacity_bytes - self._allowance)
