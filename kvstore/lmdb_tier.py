"""Local-disk tier on LMDB: memory-mapped, crash-safe, shared by the processes of one machine.

Writes of a batch are one transaction (all or nothing). The map starts small and doubles when full, up to
``max_map_bytes``; past that a put raises ``StoreFullError`` and nothing already stored is lost.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import lmdb

from kvshelf.kvstore.errors import ConfigError, StoreFullError
from kvshelf.kvstore.rwlock import RWLock
from kvshelf.kvstore.tier import Tier, TierUsage

T = TypeVar("T")
_TOTAL = b"total_bytes"
_U64 = struct.Struct("<Q")
MiB = 1 << 20
GiB = 1 << 30


class LMDBTier(Tier):
    """Encoded blocks in an LMDB environment under ``path`` (a directory, created if missing)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        initial_map_bytes: int = 256 * MiB,
        max_map_bytes: int = 1024 * GiB,
        durable: bool = True,
        name: str = "disk",
    ) -> None:
        if initial_map_bytes <= 0 or max_map_bytes <= 0:
            raise ConfigError(
                f"LMDB map sizes must be positive (initial={initial_map_bytes}, max={max_map_bytes})"
            )
        if initial_map_bytes > max_map_bytes:
            raise ConfigError(f"initial_map_bytes {initial_map_bytes} exceeds max_map_bytes {max_map_bytes}")
        self.name = name
        self.path = Path(path)
        self.max_map_bytes = max_map_bytes
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._env = lmdb.open(
                str(self.path),
                map_size=initial_map_bytes,
                max_dbs=4,
                readahead=True,  # values are large runs of overflow pages: a cold read wants the kernel's readahead
                sync=durable,
                metasync=durable,
                max_readers=512,
            )
        except (OSError, lmdb.Error) as exc:
            raise ConfigError(f"cannot open LMDB tier at {self.path}: {exc}") from exc
        if self._env.info()["map_size"] < initial_map_bytes:  # another process opened it smaller
            self._env.set_mapsize(initial_map_bytes)
        self._blocks = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")
        self._lock = RWLock()

    # -- transaction plumbing -------------------------------------------------------------------------

    def _read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        while True:
            try:
                with self._lock.read(), self._env.begin(db=self._blocks, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self._adopt_resize()

    def _write(self, fn: Callable[[lmdb.Transaction], T], needed: int = 0) -> T:
        while True:
            try:
                with self._lock.read(), self._env.begin(db=self._blocks, write=True, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                self._grow(needed)
            except lmdb.MapResizedError:
                self._adopt_resize()

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

    def _total(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_TOTAL, db=self._meta)
        return _U64.unpack(bytes(raw))[0] if raw is not None else 0

    # -- Tier -----------------------------------------------------------------------------------------

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        def fn(txn: lmdb.Transaction) -> list[bytes | None]:
            out: list[bytes | None] = []
            for key in keys:
                buf = txn.get(key)
                out.append(bytes(buf) if buf is not None else None)
            return out

        return self._read(fn)

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0

        def fn(txn: lmdb.Transaction) -> int:
            total = self._total(txn)
            for key, value in items:
                old = txn.get(key)
                if old is not None:
                    total -= len(old)
                txn.put(key, value)
                total += len(value)
            txn.put(_TOTAL, _U64.pack(total), db=self._meta)
            return len(items)

        return self._write(fn, needed=sum(len(v) for _, v in items))

    def contains_many(self, keys: Sequence[bytes]) -> int:
        def fn(txn: lmdb.Transaction) -> int:
            for i, key in enumerate(keys):
                if txn.get(key) is None:
                    return i
            return len(keys)

        return self._read(fn)

    def delete(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)

        def fn(txn: lmdb.Transaction) -> int:
            total, removed = self._total(txn), 0
            for key in keys:
                old = txn.get(key)
                if old is not None:
                    total -= len(old)
                    txn.delete(key)
                    removed += 1
            txn.put(_TOTAL, _U64.pack(max(total, 0)), db=self._meta)
            return removed

        return self._write(fn)

    def keys(self) -> list[bytes]:
        return self._read(lambda txn: [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)])

    def usage(self) -> TierUsage:
        def fn(txn: lmdb.Transaction) -> TierUsage:
            return TierUsage(
                blocks=txn.stat(self._blocks)["entries"], bytes=self._total(txn), capacity_bytes=self.max_map_bytes
            )

        return self._read(fn)

    @property
    def map_size(self) -> int:
        return int(self._env.info()["map_size"])

    def close(self) -> None:
        with self._lock.write():
            self._env.close()
