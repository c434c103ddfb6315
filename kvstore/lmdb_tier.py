"""Local-disk tier on LMDB: memory-mapped, crash-safe, shared by the processes of one machine.

Two modes:

* **Bounded** (``capacity_bytes=N``, what ``open_embedded_store(max_disk_bytes=...)`` and ``kvshelf serve
  --max-disk`` use): the tier holds at most ``N`` bytes of values (``usage().bytes``, as the memory tier counts
  them) and evicts, through the same pluggable policy as the memory tier (``kvstore.eviction``), to stay under
  it. The file never grows past ``N + slack`` (see *Slack*). Pinned keys are never evicted: a put that fits
  only by evicting pins, a value larger than ``N``, or one the policy does not admit is not stored (``put_many``
  counts only what it stored). Every evicted value goes to the eviction callback (the ``TieredStore`` counts
  it, emits an ``evicted`` event, and with ``write_policy="back"`` writes it one tier down).
* **Unbounded** (``capacity_bytes=None``): no eviction; the map starts small and doubles when full, up to
  ``max_map_bytes``; past that a put raises ``StoreFullError`` and nothing already stored is lost.

Transactions. In the bounded mode the evictions that make room for a put happen in the put's own write
transaction, with the byte counters and the key index (below): a crash at any instant (SIGKILL, power loss
with ``durable=True``) leaves either the state before the transaction or after it, so it loses nothing but the
values that transaction was evicting. A batch is one transaction when its values take at most ``txn_bytes``
(``capacity / 32``, 64 KiB to 256 MiB), else it is split into transactions of at most that much. Unbounded,
a batch is always one transaction (all or nothing). The threads of one process write one at a time, and a
write transaction that fails is aborted with this process's readers held off for that instant (py-lmdb's
abort otherwise waits for a moment when no other thread is inside LMDB, which busy readers put off for
minutes).

Reads. A read copies each value out under a read transaction: LMDB's MVCC keeps every page of that snapshot
untouched until the transaction ends, so a value being evicted or overwritten meanwhile is never torn.

Slack (bounded mode). LMDB never writes past its map, and the map is fixed at ``capacity + slack`` (``slack``:
``lmdb_slack_bytes``), so the file cannot pass it. What the slack holds, from LMDB's mechanics (4 KiB pages):

* ``R = max(1 MiB, capacity / 128)``, LMDB's pages around the values: a value larger than ~2 KiB lies in its
  own run of overflow pages (its length + 16 bytes, rounded up to whole pages), and each key takes a node in
  a leaf page of three trees (the values, and the key index: key -> write sequence, sequence -> key), pages
  being at least half full. Each value is *charged* that footprint; the tier also evicts to keep the charges
  under ``capacity + R`` (binding only for values of a few KiB or less, where pages cost more than bytes).
* ``2 x (txn_bytes + R)``: pages freed by a commit are reused only two commits later (a reader may be starting
  on the previous snapshot), so at any instant the file also holds what the previous and the current write
  transaction wrote, plus their copy-on-write copies of tree pages (at most every tree page once: <= R).
* ``2 x txn_bytes``: fragmentation: a value needs one contiguous run of free pages, and freed runs of other
  lengths leave pieces too small (measured: with 1-8 MiB values in 256 MiB, an unbounded map settles ~5
  largest values past the capacity after 1,500 puts and creeps on; the bound turns the creep into retries).
* ``capacity / 256``: the free list itself (8 bytes per free page, in pages of its own), and 256 KiB for the
  two meta pages and the trees' roots.

For a 256 MiB capacity that is 2 + 2 x (8 + 2) + 16 + 1 + 0.25 = 39.25 MiB; for 16 MiB, 5.3 MiB. When a put
still finds the map full (the free pages too fragmented, or a reader holding an old snapshot), the tier
commits a transaction evicting more (twice as much each time), then an empty one so the freed pages become
reusable, and retries (``map_full_retries`` counts these). If a reader holds a snapshot older than the last
commit for more than 0.5 s (a long read in another process: the pages freed since cannot be reused until it
ends, so evicting would not help), or nothing unpinned is left to evict, the put is not stored (logged) rather
than the file growing. An environment whose file is already larger (written unbounded, or with a larger capacity)
is evicted down to the capacity when opened, but its file keeps its size: LMDB files never shrink
(``lmdb.Environment.copy(path, compact=True)`` writes a compact copy).

Policy state and restarts. The policy lives in the process. So that it knows the held keys after a restart,
every bounded write also records a sequence number per key (databases ``keyseq``: key -> sequence and length,
and ``order``: sequence -> key, written in the same transaction); at open the keys are fed to the policy oldest
write first (reads are not recorded: after a restart recency is by last write). Unbounded writes keep no index
(they mark it stale); a bounded open of an environment without a valid index (written unbounded, repaired, or
by an older kvshelf) rebuilds it first, in key order. Several processes may share one environment, each
with its own policy and pins (all must open it with the same capacity): a victim that
another process already removed is skipped; when this process's policy has nothing left to evict (it holds
only pinned keys) but the shared byte counters are over capacity (other processes' keys), the tier evicts by
the oldest persisted sequence number. A put that a transaction aborts (a full map, an error) puts the policy
back as it was (the victims it named are re-inserted, without their recency).

Damage: LMDB trusts its file (a file cut short is a SIGBUS, a garbage leaf an assertion abort), so before
``mdb_env_open`` the file is judged with plain reads (``kvstore.lmdb_file``: both meta pages, the file size
against the last page they name, then every branch and leaf page of every tree) and a damaged environment
raises ``TierDamagedError`` naming the path and the recovery (``kvshelf repair --data-dir DIR`` or
``kvshelf serve --reset-disk``). Damage found later (any ``lmdb.Error`` but a full or resized map) marks the
tier damaged: that call and every later one raise the same ``TierDamagedError`` without touching the file,
and the ``TieredStore`` skips the tier as it does an unreachable one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
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
from kvshelf.kvstore.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from kvshelf.kvstore.lmdb_file import check_file, db_keys, verify_tree
from kvshelf.kvstore.periodic_sync import PeriodicSync
from kvshelf.kvstore.rwlock import RWLock
from kvshelf.kvstore.tier import EvictionCallback, Tier, TierUsage

log = logging.getLogger(__name__)

T = TypeVar("T")
_TOTAL = b"total_bytes"  # sum of the held values' lengths
_CHARGED = b"charged_bytes"  # sum of their charges (footprints in pages, ``charge``)
_NEXT_SEQ = b"next_seq"
_TICK = b"tick"  # bumped by the empty commit that makes freed pages reusable
_CAPACITY = b"capacity_bytes"  # the capacity the environment was last opened with (for ``kvshelf stats``)
_U64 = struct.Struct("<Q")
_SEQ = struct.Struct(">Q")  # big-endian: the order database sorts by it
_KEYSEQ = struct.Struct(">QQ")  # (sequence, value length)
KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
MIN_MAP_BYTES = MiB  # LMDB's own pages (2 meta, the trees' roots) take a few; below 1 MiB no KV block fits
_RESIZE_RETRIES = 100
_FULL_RETRIES = 40  # evict-more rounds for one put (each frees twice as much: 40 covers any capacity)
_READER_WAIT_S = 0.5  # how long a put waits for readers holding a snapshot older than its evictions
# errors of the moment, not of the file: the call fails (the tier counts as unavailable) and the next may work
_TRANSIENT = (lmdb.ReadersFullError, lmdb.DiskError, lmdb.MemoryError, lmdb.TlsFullError)

# LMDB's layout (mdb.c, 0.9.x): page header 16 bytes, node header 8 bytes, a 2-byte index slot per node; a leaf
# node larger than ``nodemax`` keeps its value in overflow pages and an 8-byte page number in the node
_PAGE_HEADER = 16
_NODE_HEADER = 8
_TREE_FILL = 2  # tree pages are at least half full (LMDB splits full pages in halves, merges below a quarter)
MIN_TXN_BYTES = 64 * KiB
MAX_TXN_BYTES = 256 * MiB
_FIXED_SLACK = 256 * KiB


def _even(n: int) -> int:
    return n + (n & 1)


def value_charge(key_len: int, value_len: int, page_size: int = 4096) -> int:
    """Bytes of file a value of ``value_len`` under a key of ``key_len`` takes in a bounded LMDB tier: its
    overflow pages (or its share of a leaf page when small) plus its nodes in the three trees (values, key ->
    sequence, sequence -> key), tree pages counted half full."""
    nodemax = (((page_size - _PAGE_HEADER) // 2) & ~1) - 2
    node = _NODE_HEADER + key_len + value_len
    pages = 0
    if node > nodemax:
        pages = (value_len + _PAGE_HEADER + page_size - 1) // page_size
        node = _NODE_HEADER + key_len + 8
    index = (_even(_NODE_HEADER + key_len + _KEYSEQ.size) + 2) + (_even(_NODE_HEADER + _SEQ.size + key_len) + 2)
    return pages * page_size + _TREE_FILL * (_even(node) + 2 + index)


def txn_bytes(capacity_bytes: int) -> int:
    """The most a write transaction of a bounded tier writes (a batch is split beyond it): capacity / 32,
    within [64 KiB, 256 MiB]."""
    return min(max(capacity_bytes // 32, MIN_TXN_BYTES), MAX_TXN_BYTES)


def page_allowance(capacity_bytes: int) -> int:
    """``R``: how far the charges of the held values may pass their lengths: max(1 MiB, capacity / 128)."""
    return max(MiB, capacity_bytes // 128)


def lmdb_slack_bytes(capacity_bytes: int, page_size: int = 4096) -> int:
    """How far past ``capacity_bytes`` a bounded tier's file may grow (the module docstring derives each term):
    ``3 R + 4 txn_bytes + capacity / 256 + 256 KiB``, rounded up to whole pages."""
    allowance, txn = page_allowance(capacity_bytes), txn_bytes(capacity_bytes)
    slack = allowance + 2 * (txn + allowance) + 2 * txn + capacity_bytes // 256 + _FIXED_SLACK
    return -(-slack // page_size) * page_size


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


class _Full(Exception):
    """A write transaction found the map full (its changes were rolled back)."""


@dataclass
class _Journal:
    """What one write transaction did to the policy, to undo if the transaction aborts."""

    inserted: list[bytes] = field(default_factory=list)
    removed: list[tuple[bytes, int]] = field(default_factory=list)
    evicted: list[tuple[bytes, bytes]] = field(default_factory=list)  # (key, value) for the callback


def _check_capacity(capacity_bytes: object) -> int:
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
        raise ConfigError(f"LMDB tier capacity must be a whole number of bytes of at least 1 (LMDB's own pages "
                          f"come on top, in the slack), got {capacity_bytes!r}")
    return capacity_bytes


class LMDBTier(Tier):
    """Encoded blocks in an LMDB environment under ``path`` (a directory, created if missing).

    ``capacity_bytes``: the most bytes of values held (evicting by ``policy``, a name of
    ``kvstore.eviction.POLICIES`` or an instance); the file stays under ``capacity_bytes + slack_bytes``
    (``lmdb_slack_bytes`` by default; the module docstring). ``None``: unbounded, the map grows up to
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
        if initial_map_bytes <= 0 or max_map_bytes <= 0:
            raise ConfigError(
                f"LMDB map sizes must be positive (initial={initial_map_bytes}, max={max_map_bytes})"
            )
        if max_map_bytes < MIN_MAP_BYTES:
            raise ConfigError(f"the LMDB size limit {max_map_bytes} bytes is below the minimum of {MIN_MAP_BYTES} "
                              f"bytes (1MiB) LMDB needs for its own pages and one block")
        if initial_map_bytes > max_map_bytes:
            raise ConfigError(f"initial_map_bytes {initial_map_bytes} exceeds max_map_bytes {max_map_bytes}")
        self.capacity_bytes = None if capacity_bytes is None else _check_capacity(capacity_bytes)
        self.policy: EvictionPolicy | None = None
        if self.capacity_bytes is not None:
            self.policy = make_policy(policy, self.capacity_bytes) if isinstance(policy, str) else policy
            if slack_bytes is None:
                slack_bytes = lmdb_slack_bytes(self.capacity_bytes)
            elif isinstance(slack_bytes, bool) or not isinstance(slack_bytes, int) or slack_bytes < _FIXED_SLACK:
                raise ConfigError(f"LMDB tier slack_bytes must be a number of bytes of at least {_FIXED_SLACK} "
                                  f"(256 KiB: LMDB's meta pages and tree roots), got {slack_bytes!r}")
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
        self._syncer = None if durable or sync_interval_s is None else PeriodicSync(self._sync, sync_interval_s)

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

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        def fn(txn: lmdb.Transaction) -> list[bytes | None]:
            out: list[bytes | None] = []
            for key in keys:
                buf = txn.get(key)
                out.append(bytes(buf) if buf is not None else None)
            return out

        out = self._read(fn)
        if self.policy is not None:
            with self._plock:
                for key, value in zip(keys, out, strict=True):
                    if value is not None and key in self._known:
                        self.policy.on_hit(key)
        return out

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

    def _put_chunk(self, chunk: list[tuple[bytes, bytes]], size: int) -> int:
        """Store ``chunk`` (one transaction, evicting in it); on a full map, evict more in transactions of their
        own and retry (module docstring)."""
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

    def contains_many(self, keys: Sequence[bytes]) -> int:
        def fn(txn: lmdb.Transaction) -> int:
            for i, key in enumerate(keys):
                if txn.get(key) is None:
                    return i
            return len(keys)

        held = self._read(fn)
        if self.policy is not None and len(keys) > 1:
            with self._plock:
                self.policy.on_lookup(keys, held)
        return held

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
            # unbounded: the capacity a bounded opener recorded (a server, seen by ``kvshelf stats --data-dir``)
            capacity = self.capacity_bytes or self._counter(txn, _CAPACITY) or self.max_map_bytes
            return TierUsage(blocks=txn.stat(self._blocks)["entries"], bytes=self._total(txn),
                             capacity_bytes=capacity)

        return self._read(fn)

    def audit(self) -> list[str]:
        """Problems of the bookkeeping (empty: none): the byte counters against the values held, and the key
        index against the keys. Reads every key (through the map), for tests and admin tools."""

        def fn(txn: lmdb.Transaction) -> list[str]:
            problems: list[str] = []
            total = charged = 0
            for key, value in txn.cursor(db=self._blocks).iternext():
                key = bytes(key)
                total += len(value)
                charged += self._charge(len(key), len(value))
                raw = txn.get(key, db=self._keyseq)
                if raw is None:
                    problems.append(f"key {key.hex()} has no sequence number")
                    continue
                seq, length = _KEYSEQ.unpack(bytes(raw))
                if length != len(value):
                    problems.append(f"key {key.hex()}: index says {length} bytes, the value has {len(value)}")
                back = txn.get(_SEQ.pack(seq), db=self._order)
                if back is None or bytes(back) != key:
                    problems.append(f"key {key.hex()}: sequence {seq} does not lead back to it")
            entries = txn.stat(self._blocks)["entries"]
            for db, name in ((self._keyseq, "keyseq"), (self._order, "order")):
                if txn.stat(db)["entries"] != entries:
                    problems.append(f"{name} has {txn.stat(db)['entries']} entries for {entries} keys")
            for name, counted, actual in (("total_bytes", self._total(txn), total),
                                          ("charged_bytes", self._counter(txn, _CHARGED), charged)):
                if counted != actual:
                    problems.append(f"{name} counter is {counted}, the values held make {actual}")
            return problems

        return self._read(fn)

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
