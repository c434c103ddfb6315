"""Local-disk tier on LMDB: memory-mapped, crash-safe, shared by the processes of one machine.

Writes of a batch are one transaction (all or nothing). The map starts small and doubles when full, up to
``max_map_bytes``; past that a put raises ``StoreFullError`` and nothing already stored is lost.

Damage: LMDB trusts its file (a file cut short is a SIGBUS, a garbage leaf an assertion abort), so before
``mdb_env_open`` the file is judged with plain reads (``kvstore.lmdb_file``: both meta pages, the file size
against the last page they name, then every branch and leaf page of every tree) and a damaged environment
raises ``TierDamagedError`` naming the path and the recovery (``kvshelf repair --data-dir DIR`` or
``kvshelf serve --reset-disk``). Damage found later (any ``lmdb.Error`` but a full or resized map) marks the
tier damaged: that call and every later one raise the same ``TierDamagedError`` without touching the file,
and the ``TieredStore`` skips the tier as it does an unreachable one.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import lmdb

from kvshelf.kvstore.errors import (
    ConfigError,
    KVShelfError,
    StoreFullError,
    TierDamagedError,
    TierUnavailableError,
)
from kvshelf.kvstore.lmdb_file import check_file, db_keys, verify_tree
from kvshelf.kvstore.rwlock import RWLock
from kvshelf.kvstore.tier import Tier, TierUsage

T = TypeVar("T")
_TOTAL = b"total_bytes"
_U64 = struct.Struct("<Q")
MiB = 1 << 20
GiB = 1 << 30
MIN_MAP_BYTES = MiB  # LMDB's own pages (2 meta, the trees' roots) take a few; below 1 MiB no KV block fits
_RESIZE_RETRIES = 100
# errors of the moment, not of the file: the call fails (the tier counts as unavailable) and the next may work
_TRANSIENT = (lmdb.ReadersFullError, lmdb.DiskError, lmdb.MemoryError, lmdb.TlsFullError)


def recovery_hint(path: Path) -> str:
    """How to recover from a damaged environment at ``path`` (the ``lmdb`` folder of a data directory)."""
    return (f"recover with `kvshelf repair --data-dir {path.parent}` (keeps every readable block), or start "
            f"with `kvshelf serve --reset-disk` (moves it aside to {path.name}.damaged-<time>, starts empty)")


def damaged_error(path: Path, what: str) -> TierDamagedError:
    return TierDamagedError(f"LMDB environment {path} is damaged: {what}; {recovery_hint(path)}")


def check_file_fits(path: Path) -> None:
    """Raise ``TierDamagedError`` if ``path/data.mdb`` is not a file LMDB can safely open: bad meta pages, or a
    file cut short before the roots of its trees (using it would SIGBUS). Reads the file, never maps it."""
    data = path / "data.mdb"
    if not data.exists():
        return
    try:
        check = check_file(data)
        for pause in (0.02, 0.05, 0.1):  # a file being created or grown by another process this instant
            if not check.problems:
                break
            time.sleep(pause)
            check = check_file(data)
    except OSError as exc:
        raise ConfigError(f"cannot read LMDB tier file {data}: {exc}") from exc
    if check.problems:
        raise damaged_error(path, "; ".join(check.problems))


def check_trees(path: Path, env: lmdb.Environment) -> None:
    """Raise ``TierDamagedError`` if a branch or leaf page of the environment's current trees is damaged (or a
    value's overflow pages lie past the file), read from the file (never through the map) under a read
    transaction, so that no writer of another process reuses the pages being read."""
    data = path / "data.mdb"
    for _ in range(5):
        with env.begin() as txn, open(data, "rb") as f:
            check = check_file(data)
            meta = next((m for m in check.metas if m.txnid == txn.id()), None)
            if meta is None:  # the meta page of this snapshot was already rewritten by later commits
                continue
            problems = verify_tree(f.fileno(), meta)
            if problems:
                raise damaged_error(path, "; ".join(problems))
            return


class LMDBTier(Tier):
    """Encoded blocks in an LMDB environment under ``path`` (a directory, created if missing).

    ``verify``: judge the file before opening it and its trees before using them (``check_file_fits``,
    ``check_trees``; on by default: reads every branch and leaf page once, not the values).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        initial_map_bytes: int = 256 * MiB,
        max_map_bytes: int = 1024 * GiB,
        durable: bool = True,
        name: str = "disk",
        verify: bool = True,
    ) -> None:
        if initial_map_bytes <= 0 or max_map_bytes <= 0:
            raise ConfigError(
                f"LMDB map sizes must be positive (initial={initial_map_bytes}, max={max_map_bytes})"
            )
        if max_map_bytes < MIN_MAP_BYTES:
            raise ConfigError(f"the LMDB size limit {max_map_bytes} bytes is below the minimum of {MIN_MAP_BYTES} "
                              f"bytes (1MiB) LMDB needs for its own pages and one block")
        if initial_map_bytes > max_map_bytes:
            raise ConfigError(f"initial_map_bytes {initial_map_bytes} exceeds max_map_bytes {max_map_bytes}")
        self.name = name
        self.path = Path(path)
        self.max_map_bytes = max_map_bytes
        self._damaged: TierDamagedError | None = None
        self._closed = False
        self._lock = RWLock()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot open LMDB tier at {self.path}: {exc}") from exc
        if verify:
            check_file_fits(self.path)
        try:
            self._env = self._open_env(max(initial_map_bytes, MIN_MAP_BYTES), durable)
        except (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError, lmdb.PageNotFoundError) as exc:
            raise damaged_error(self.path, f"{type(exc).__name__}: {exc}") from exc
        except (OSError, lmdb.Error) as exc:
            raise ConfigError(f"cannot open LMDB tier at {self.path}: {exc}") from exc
        try:
            if verify:
                self._check_trees()
            self._blocks, self._meta = self._open_dbs(initial_map_bytes)
        except BaseException:
            self._env.close()
            raise

    def _open_env(self, map_size: int, durable: bool) -> lmdb.Environment:
        """``lmdb.open`` (it begins a transaction: another process growing the map meanwhile is retried)."""
        for attempt in range(_RESIZE_RETRIES):
            try:
                return lmdb.open(
                    str(self.path),
                    map_size=map_size,
                    max_dbs=4,
                    readahead=True,  # values are large runs of overflow pages: a cold read wants the kernel's readahead
                    sync=durable,
                    metasync=durable,
                    max_readers=512,
                )
            except lmdb.MapResizedError:
                if attempt == _RESIZE_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _check_trees(self) -> None:
        for _ in range(_RESIZE_RETRIES):
            try:
                return check_trees(self.path, self._env)
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)
            except OSError as exc:
                raise ConfigError(f"cannot read LMDB tier file {self.path / 'data.mdb'}: {exc}") from exc

    def _open_dbs(self, initial_map_bytes: int) -> tuple[lmdb._Database, lmdb._Database]:
        """The two named databases; another process growing the map meanwhile is waited out (retried)."""
        for _ in range(_RESIZE_RETRIES):
            try:
                if self._env.info()["map_size"] < initial_map_bytes:  # another process opened it smaller
                    self._env.set_mapsize(initial_map_bytes)
                return self._env.open_db(b"blocks"), self._env.open_db(b"meta")
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)  # take the size another process set
            except lmdb.MapFullError as exc:
                raise ConfigError(f"LMDB tier {self.path}: the map of {self._env.info()['map_size']} bytes cannot "
                                  f"hold LMDB's own pages; raise the size limit") from exc
            except _TRANSIENT as exc:
                raise ConfigError(f"cannot open LMDB tier at {self.path}: {exc}") from exc
            except lmdb.Error as exc:
                raise damaged_error(self.path, f"{type(exc).__name__}: {exc}") from exc
        raise ConfigError(f"cannot open LMDB tier at {self.path}: its map was resized {_RESIZE_RETRIES} times "
                          "while opening it")

    # -- transaction plumbing -------------------------------------------------------------------------

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
        while True:
            self._check_usable()
            try:
                with self._lock.read(), self._env.begin(db=self._blocks, write=True, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                self._grow(needed)
            except lmdb.MapResizedError:
                self._adopt_resize()
            except lmdb.Error as exc:
                raise self._fail(exc) from exc

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
        """Every key, read from the file (never the map) under a read transaction: a page damaged while the
        environment is open would abort the process inside LMDB's cursor (an assertion); here it is reported."""

        def from_file(txn: lmdb.Transaction) -> list[bytes] | None:
            try:
                with open(self.path / "data.mdb", "rb") as f:
                    meta = next((m for m in check_file(self.path / "data.mdb").metas if m.txnid == txn.id()), None)
                    if meta is None:  # another process committed twice since this snapshot: its meta page is gone
                        return None
                    keys, problems = db_keys(f.fileno(), meta, b"blocks")
            except OSError:
                return None
            if problems:
                if self._damaged is None:
                    self._damaged = damaged_error(self.path, "; ".join(problems[:4]))
                raise self._damaged
            return keys

        for _ in range(5):
            found = self._read(from_file)
            if found is not None:
                return found
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
            self._closed = True
            self._env.close()
