"""``LMDBTier``: its settings, opening an environment (judged first, indexed and evicted down to the capacity
when bounded), pins, and closing; the rest comes from the mixins of this package."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb

from kvshelf.kvstore.errors import ConfigError, StoreFullError, TierDamagedError
from kvshelf.kvstore.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from kvshelf.kvstore.lmdb_tier.bounded import Bounded
from kvshelf.kvstore.lmdb_tier.damage import check_file_fits, check_trees, damaged_error
from kvshelf.kvstore.lmdb_tier.layout import (
    _CAPACITY,
    _CHARGED,
    _FIXED_SLACK,
    _KEYSEQ,
    _NEXT_SEQ,
    _SEQ,
    _TOTAL,
    _U64,
    MIN_MAP_BYTES,
    GiB,
    MiB,
    _check_capacity,
    lmdb_slack_bytes,
    page_allowance,
    txn_bytes,
)
from kvshelf.kvstore.lmdb_tier.reads import Reads
from kvshelf.kvstore.lmdb_tier.txn import _RESIZE_RETRIES, _TRANSIENT, Transactions, _Full
from kvshelf.kvstore.lmdb_tier.writes import Writes
from kvshelf.kvstore.periodic_sync import PeriodicSync
from kvshelf.kvstore.rwlock import RWLock
from kvshelf.kvstore.tier import EvictionCallback, Tier

if TYPE_CHECKING:
    from kvshelf.kvstore.tier_registry import TierURL

log = logging.getLogger(__package__)


def _check_map_sizes(initial_map_bytes: int, max_map_bytes: int) -> None:
    if initial_map_bytes <= 0 or max_map_bytes <= 0:
        raise ConfigError(
            f"LMDB map sizes must be positive (initial={initial_map_bytes}, max={max_map_bytes})"
        )
    if max_map_bytes < MIN_MAP_BYTES:
        raise ConfigError(f"the LMDB size limit {max_map_bytes} bytes is below the minimum of {MIN_MAP_BYTES} "
                          f"bytes (1MiB) LMDB needs for its own pages and one block")
    if initial_map_bytes > max_map_bytes:
        raise ConfigError(f"initial_map_bytes {initial_map_bytes} exceeds max_map_bytes {max_map_bytes}")


def _check_slack(capacity_bytes: int, slack_bytes: int | None) -> int:
    """The slack over ``capacity_bytes`` the map may take: ``lmdb_slack_bytes`` unless given."""
    if slack_bytes is None:
        return lmdb_slack_bytes(capacity_bytes)
    if isinstance(slack_bytes, bool) or not isinstance(slack_bytes, int) or slack_bytes < _FIXED_SLACK:
        raise ConfigError(f"LMDB tier slack_bytes must be a number of bytes of at least {_FIXED_SLACK} "
                          f"(256 KiB: LMDB's meta pages and tree roots), got {slack_bytes!r}")
    return slack_bytes


class LMDBTier(Reads, Writes, Bounded, Transactions, Tier):
    """Encoded blocks in an LMDB environment under ``path`` (a directory, created if missing).

    ``capacity_bytes``: the most bytes of values held (evicting by ``policy``, a name of
    ``kvstore.eviction.POLICIES`` or an instance); the file stays under ``capacity_bytes + slack_bytes``
    (``lmdb_slack_bytes`` by default; docs/storage.md). ``None``: unbounded, the map grows up to
    ``max_map_bytes`` (``initial_map_bytes`` and ``max_map_bytes`` apply only then).

    ``verify``: judge the file before opening it and its trees before using them (``check_file_fits``,
    ``check_trees``; on by default: reads every branch and leaf page once, not the values).

    ``durable``: every commit is flushed to the disk (``fdatasync``) before the put returns. ``False``: commits
    go to the operating system (a crash of this process loses nothing; an OS crash or power cut may lose recent
    ones), flushed every ``sync_interval_s`` seconds when given (``kvstore.periodic_sync``), else when the OS
    writes them back.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity_bytes: int | None = None,
        policy: str | EvictionPolicy = DEFAULT_POLICY,
        slack_bytes: int | None = None,
        initial_map_bytes: int = 256 * MiB,
        max_map_bytes: int = 1024 * GiB,
        durable: bool = True,
        sync_interval_s: float | None = None,
        name: str = "disk",
        verify: bool = True,
    ) -> None:
        _check_map_sizes(initial_map_bytes, max_map_bytes)
        self.capacity_bytes = None if capacity_bytes is None else _check_capacity(capacity_bytes)
        self.policy: EvictionPolicy | None = None
        if self.capacity_bytes is not None:
            self.policy = make_policy(policy, self.capacity_bytes) if isinstance(policy, str) else policy
            slack_bytes = _check_slack(self.capacity_bytes, slack_bytes)
            initial_map_bytes = max_map_bytes = max(-(-(self.capacity_bytes + slack_bytes) // 4096) * 4096,
                                                    MIN_MAP_BYTES)
        if sync_interval_s is not None and (isinstance(sync_interval_s, bool) or not sync_interval_s > 0):
            raise ConfigError(f"LMDB tier sync_interval_s must be a number of seconds > 0, got {sync_interval_s!r}")
        self.slack_bytes = slack_bytes
        self.durable = durable
        self.name = name
        self.path = Path(path)
        self.max_map_bytes = max_map_bytes
        self._damaged: TierDamagedError | None = None
        self._closed = False
        self._syncer: PeriodicSync | None = None  # durable=False with sync_interval_s: flushes every few seconds
        self._lock = RWLock()
        self._wlock = threading.Lock()  # one write transaction of this process at a time (``_write_once``)
        self._plock = threading.Lock()  # the policy, ``_known`` and ``_pinned``
        self._known: dict[bytes, int] = {}  # keys the policy holds -> value length
        self._pinned: set[bytes] = set()
        self._on_evict: EvictionCallback | None = None
        #: puts that found the map full and evicted more in a transaction of their own (bounded mode)
        self.map_full_retries = 0
        self._open(initial_map_bytes, durable, verify)
        self._syncer = None if durable or sync_interval_s is None else PeriodicSync(self._sync, sync_interval_s)

    def _open(self, initial_map_bytes: int, durable: bool, verify: bool) -> None:
        """Open (or create) the environment and its databases; a damaged one is ``TierDamagedError``, one that cannot
        be opened ``ConfigError``."""
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
            self._page_size = int(self._env.stat()["psize"])
            self._blocks, self._meta, self._keyseq, self._order = self._open_dbs(initial_map_bytes)
            if self.capacity_bytes is not None:
                self._allowance = page_allowance(self.capacity_bytes)
                self._txn_bytes = txn_bytes(self.capacity_bytes)
                self._start_bounded()
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
                    max_dbs=8,
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

    def _open_dbs(self, initial_map_bytes: int) -> tuple[lmdb._Database, ...]:
        """The named databases; another process growing the map meanwhile is waited out (retried)."""
        for _ in range(_RESIZE_RETRIES):
            try:
                size = self._env.info()["map_size"]
                if size < initial_map_bytes or (self.capacity_bytes is not None and size != initial_map_bytes):
                    self._env.set_mapsize(initial_map_bytes)  # bounded: LMDB keeps it >= the file's last page
                return tuple(self._env.open_db(name) for name in (b"blocks", b"meta", b"keyseq", b"order"))
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

    def _start_bounded(self) -> None:
        """Index an environment written without the key index (or by a version before it), evict down to the
        capacity when it holds more, and feed the held keys to the policy, oldest write first."""

        def consistent(txn: lmdb.Transaction) -> bool:
            entries = txn.stat(self._blocks)["entries"]
            return (txn.get(_CHARGED, db=self._meta) is not None
                    and txn.stat(self._keyseq)["entries"] == entries == txn.stat(self._order)["entries"])

        if not self._read(consistent):
            self._rebuild_index()
        if self._read(lambda txn: self._counter(txn, _CAPACITY)) != self.capacity_bytes:
            with contextlib.suppress(_Full):  # only shown to a reader opening it unbounded (``kvshelf stats``)
                self._write(lambda txn: txn.put(_CAPACITY, _U64.pack(self.capacity_bytes), db=self._meta))
        while self._read(lambda txn: self._over(txn) > 0):  # opened with a smaller capacity than it was written
            if not self._evict_round(self._txn_bytes, reason="opened with a smaller capacity", extra=False):
                break

        def load(txn: lmdb.Transaction) -> list[tuple[bytes, int]]:
            out = []
            for _, key in txn.cursor(db=self._order).iternext():
                raw = txn.get(bytes(key), db=self._keyseq)
                if raw is not None:
                    out.append((bytes(key), _KEYSEQ.unpack(bytes(raw))[1]))
            return out

        with self._plock:
            for key, length in self._read(load):
                if key not in self._known:
                    self._known[key] = length
                    self.policy.on_insert(key, length)  # type: ignore[union-attr]

    def _rebuild_index(self) -> None:
        """Rewrite the key index and both byte counters from the values held (one transaction)."""

        def fn(txn: lmdb.Transaction) -> None:
            txn.drop(self._keyseq, delete=False)
            txn.drop(self._order, delete=False)
            total = charged = seq = 0
            for key, value in txn.cursor(db=self._blocks).iternext():
                key = bytes(key)
                seq += 1
                txn.put(key, _KEYSEQ.pack(seq, len(value)), db=self._keyseq)
                txn.put(_SEQ.pack(seq), key, db=self._order)
                total += len(value)
                charged += self._charge(len(key), len(value))
            txn.put(_TOTAL, _U64.pack(total), db=self._meta)
            txn.put(_CHARGED, _U64.pack(charged), db=self._meta)
            txn.put(_NEXT_SEQ, _U64.pack(seq + 1), db=self._meta)

        log.info("LMDB tier %s: indexing the keys of an environment written without the key index", self.path)
        for _ in range(_RESIZE_RETRIES):
            try:
                self._write(fn)
                break
            except (_Full, StoreFullError):  # a file written up to its map: one more step of map for the index
                with self._lock.write():
                    self._env.set_mapsize(self._env.info()["map_size"] + 16 * MiB)
        if self.capacity_bytes is not None and self.map_size > self.max_map_bytes:
            with self._lock.write():
                self._env.set_mapsize(self.max_map_bytes)  # back to the bound (LMDB keeps the file's last page)

    # -- Tier -----------------------------------------------------------------------------------------

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        self._on_evict = callback

    def pin(self, keys: Iterable[bytes]) -> None:
        with self._plock:
            self._pinned.update(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        with self._plock:
            self._pinned.difference_update(keys)

    def _pinned_snapshot(self) -> set[bytes]:
        with self._plock:
            return set(self._pinned)

    @property
    def map_size(self) -> int:
        return int(self._env.info()["map_size"])

    def _sync(self) -> None:
        """Flush the commits so far to the disk (``fdatasync``): what ``PeriodicSync`` calls."""
        with self._lock.read():
            if not self._closed:
                self._env.sync(True)

    def close(self) -> None:
        if self._syncer is not None:
            self._syncer.close()  # a last flush of what was committed
        with self._lock.write():
            self._closed = True
            self._env.close()


def open_url(url: TierURL, *, capacity_bytes: int | None = None, policy: str = DEFAULT_POLICY, durable: bool = True,
             sync_interval_s: float | None = None, **options: Any) -> LMDBTier:
    """``lmdb://PATH[?capacity=SIZE&policy=NAME&durable=BOOL&sync_interval=SECONDS]`` (kvstore/tier_registry.py):
    an ``LMDBTier`` in the directory PATH (``lmdb:///abs/dir`` or ``lmdb://relative/dir``)."""
    if not url.location:
        raise url.error("lmdb:// needs the directory of the environment (lmdb:///path/to/dir)")
    capacity = url.take_size("capacity", capacity_bytes)
    policy = url.take("policy", policy)
    durable = url.take_bool("durable", durable)
    sync_interval_s = url.take_float("sync_interval", sync_interval_s)
    url.done(("capacity", "policy", "durable", "sync_interval"))
    return LMDBTier(url.location, capacity_bytes=capacity, policy=policy, durable=durable,
                    sync_interval_s=sync_interval_s, **options)
