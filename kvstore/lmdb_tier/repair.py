"""Salvaging a damaged LMDB tier: every readable block that verifies is copied into a new environment and the
damaged one is moved aside (never deleted). Used by ``kvshelf repair`` and ``kvshelf serve --reset-disk``.

Recovery from a damaged disk tier (the server refuses to start with ``error: LMDB environment ... is
damaged``, or its health reports the disk tier damaged):

1. stop the server (``repair`` refuses an environment another process has open);
2. ``kvshelf repair --data-dir DIR --dry-run`` to see what would be kept, then ``kvshelf repair --data-dir DIR``:
   the blocks still readable are kept byte for byte, the damaged ones dropped (the store recomputes them on the
   next miss), and the old environment is kept as ``DIR/lmdb.damaged-<UTC time>`` for inspection;
3. or, to start empty at once: ``kvshelf serve --reset-disk`` (moves the environment aside the same way).

The damaged file is read with bounds-checked plain reads (``kvstore.lmdb_tier.file``), never mapped: a file cut
short or a garbage page cannot crash the repair. The tree is walked from the newest meta page (the older one
when the newest cannot be read); when the walk cannot reach every page (a damaged branch or leaf page, a file
cut short, garbage meta pages), every leaf page left in the file is scanned for the blocks it missed. A scan may
bring back a block deleted shortly before the damage (a freed page still holding it): it is still a valid block
of its key (every kept block passes ``verify_block`` against its key), never another key's data.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvshelf.kvstore.encoding import verify_block
from kvshelf.kvstore.errors import KVShelfError
from kvshelf.kvstore.keys import TIER_KEY_LENGTHS
from kvshelf.kvstore.lmdb_tier.file import (
    F_BIGDATA,
    F_SUBDATA,
    DBRecord,
    FileCheck,
    Meta,
    PageReader,
    WalkReport,
    _FileDamage,
    check_file,
    scan_leaf_pages,
    walk_db,
)
from kvshelf.kvstore.lmdb_tier.tier import LMDBTier
from kvshelf.kvstore.tiered.codecs import header_key

_BATCH_BYTES = 64 << 20
_DB_RECORD_BYTES = 48


@dataclass
class RepairReport:
    """What a repair found and did."""

    path: Path
    kept: int = 0  # blocks readable and verified (copied, or would be with a dry run)
    kept_bytes: int = 0
    scanned: int = 0  # of the kept: found by scanning the file's leaf pages, out of the damaged tree's reach
    damaged: int = 0  # blocks read that failed verification, or whose overflow pages are unreadable
    unreadable_pages: dict[int, str] = field(default_factory=dict)  # branch/leaf pages lost with what is under them
    file_problems: list[str] = field(default_factory=list)  # meta pages, file size
    meta_txn: int | None = None  # the transaction whose tree was read
    moved_to: Path | None = None
    dry_run: bool = False

    @property
    def clean(self) -> bool:
        """Nothing wrong was found (nothing to repair)."""
        return not (self.damaged or self.unreadable_pages or self.file_problems)

    def summary(self) -> str:
        lines = [f"LMDB environment {self.path}" + (f" (transaction {self.meta_txn})" if self.meta_txn else ""),
                 f"  blocks kept: {self.kept} ({self.kept_bytes} bytes)",
                 f"  of which found by scanning pages the damaged tree no longer reaches: {self.scanned}",
                 f"  blocks damaged (dropped): {self.damaged}",
                 f"  unreadable pages: {len(self.unreadable_pages)} (the blocks under them are lost)"]
        lines += [f"  file: {problem}" for problem in self.file_problems]
        lines += [f"  page {pgno}: {why}" for pgno, why in list(self.unreadable_pages.items())[:5]]
        if self.clean:
            lines.append("  no damage found: nothing changed")
        elif self.dry_run:
            lines.append("  dry run: nothing changed")
        elif self.moved_to is not None:
            lines.append(f"  the damaged environment was moved to {self.moved_to}; {self.path} holds the kept blocks")
        return "\n".join(lines)


def utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def move_aside(path: Path) -> Path:
    """Rename the environment ``path`` to ``<path>.damaged-<UTC time>`` (never deleted); return the new path."""
    target = path.with_name(f"{path.name}.damaged-{utc_stamp()}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{utc_stamp()}-{n}")
    path.rename(target)
    return target


def in_use(path: Path) -> bool:
    """Whether another process has the environment open (it holds a lock on ``lock.mdb``)."""
    lock = path / "lock.mdb"
    if not lock.exists():
        return False
    with open(lock, "r+b") as f:
        try:
            fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        except OSError:
            return True
        fcntl.lockf(f.fileno(), fcntl.LOCK_UN, 1, 0)
        return False


def _blocks_root(reader: PageReader, meta: Meta, report: WalkReport) -> DBRecord | None:
    """The ``blocks`` database's record in the main tree of ``meta`` (None: not readable)."""
    for key, flags, raw, (lo, hi, _, at) in walk_db(reader, meta.main_db.root, report):
        if key == b"blocks" and flags & F_SUBDATA and (lo | hi << 16) == _DB_RECORD_BYTES:
            return DBRecord.parse(raw[at : at + _DB_RECORD_BYTES])
    return None


def salvage(path: Path, report: RepairReport, *, total: Callable[[int], None] | None = None,
            advance: Callable[[int], None] | None = None) -> Iterator[tuple[bytes, bytes]]:
    """Every readable block of the environment at ``path`` that passes ``verify_block``: ``(key, value)``.

    The ``blocks`` tree of the newest readable meta page is walked; when that walk cannot reach everything (a
    damaged page, a file cut short, no readable meta page) every leaf page left in the file is scanned for the
    blocks the walk missed. Counts into ``report``; ``total(n)`` is told how many blocks the environment says
    it holds, ``advance(1)`` each block looked at.
    """
    data = path / "data.mdb"
    try:
        check = check_file(data)
    except OSError as exc:
        raise KVShelfError(f"cannot read {data}: {exc}") from exc
    report.file_problems = list(check.problems)
    seen: set[bytes] = set()
    with open(data, "rb") as f:
        fd = f.fileno()
        chosen = _newest_readable(check, fd)
        complete = chosen is not None and chosen[0] is check.parsed[0] and not check.problems
        if chosen is not None:
            yield from _walk_blocks(chosen, report, seen, total, advance)
            complete = complete and not report.unreadable_pages
        if not complete:
            page_size = check.parsed[0].page_size if check.parsed else os.sysconf("SC_PAGE_SIZE")
            yield from _scan_leaves(fd, page_size, report, seen)


_Chosen = tuple[Meta, PageReader, DBRecord, WalkReport]


def _newest_readable(check: FileCheck, fd: int) -> _Chosen | None:
    """The newest meta page whose ``blocks`` record is readable, with its reader (None: no such page)."""
    for meta in check.parsed:  # newest first; the file may be cut short: pages past its end are unreadable
        reader = PageReader(fd, meta.page_size, meta.last_pgno)
        main_report = WalkReport()
        record = _blocks_root(reader, meta, main_report)
        if record is not None:
            return meta, reader, record, main_report
    return None


def _walk_blocks(chosen: _Chosen, report: RepairReport, seen: set[bytes], total: Callable[[int], None] | None,
                 advance: Callable[[int], None] | None) -> Iterator[tuple[bytes, bytes]]:
    """The verified blocks of the ``blocks`` tree of the chosen meta page (``seen`` gets their keys)."""
    meta, reader, record, main_report = chosen
    report.meta_txn = meta.txnid
    report.unreadable_pages.update(main_report.unreadable)
    if total is not None:
        total(record.entries)
    walk = WalkReport()
    for key, _flags, raw, (lo, hi, nflags, at) in walk_db(reader, record.root, walk):
        if advance is not None:
            advance(1)
        value = _verified(reader, key, raw, lo, hi, nflags, at)
        if value is None:
            report.damaged += 1
            continue
        seen.add(key)
        report.kept += 1
        report.kept_bytes += len(value)
        yield key, value
    report.unreadable_pages.update(walk.unreadable)


def _scan_leaves(fd: int, page_size: int, report: RepairReport, seen: set[bytes]) -> Iterator[tuple[bytes, bytes]]:
    """The verified blocks of every leaf page left in the file that the walk did not reach (not in ``seen``)."""
    reader = PageReader(fd, page_size, max(2, os.fstat(fd).st_size // page_size - 1))
    for pgno, raw in scan_leaf_pages(fd, page_size):
        try:
            nodes = list(reader.nodes(pgno, raw))
        except _FileDamage:
            continue
        for lo, hi, nflags, key, at in nodes:
            if len(key) not in TIER_KEY_LENGTHS or key in seen:
                continue
            value = _verified(reader, key, raw, lo, hi, nflags, at)
            if value is None:
                continue
            seen.add(key)
            report.kept += 1
            report.kept_bytes += len(value)
            report.scanned += 1
            yield key, value


def _verified(reader: PageReader, key: bytes, raw: bytes, lo: int, hi: int, flags: int, at: int) -> bytes | None:
    """The value of a leaf node if it is readable and a valid block of ``key``, else None."""
    try:
        if flags & ~F_BIGDATA:
            raise _FileDamage(f"unexpected node flags {flags:#x}")
        value = reader.value(0, raw, lo, hi, flags, at)
        verify_block(value, expected_key=header_key(key))
    except (_FileDamage, KVShelfError):
        return None
    return value


def repair(path: str | os.PathLike[str], *, dry_run: bool = False, total: Callable[[int], None] | None = None,
           advance: Callable[[int], None] | None = None) -> RepairReport:
    """Repair the LMDB environment at ``path`` (a data directory's ``lmdb`` folder); see the module docstring.

    Raises ``KVShelfError`` when there is no environment or another process has it open.
    """
    path = Path(path)
    if not (path / "data.mdb").is_file():
        raise KVShelfError(f"no LMDB environment at {path} (expected {path / 'data.mdb'})")
    if in_use(path):
        raise KVShelfError(f"the LMDB environment {path} is open in another process (a running `kvshelf serve`?): "
                           "stop it first")
    report = RepairReport(path, dry_run=dry_run)
    if dry_run:
        for _ in salvage(path, report, total=total, advance=advance):
            pass
        return report
    fresh = path.with_name(f"{path.name}.repairing")
    if fresh.exists():  # left by an interrupted repair: only ever a partial copy
        shutil.rmtree(fresh)
    tier = LMDBTier(fresh, initial_map_bytes=64 << 20, verify=False)
    try:
        batch: list[tuple[bytes, bytes]] = []
        size = 0
        for key, value in salvage(path, report, total=total, advance=advance):
            batch.append((key, value))
            size += len(value)
            if size >= _BATCH_BYTES:
                tier.put_many(batch)
                batch, size = [], 0
        if batch:
            tier.put_many(batch)
    except BaseException:
        tier.close()
        shutil.rmtree(fresh)
        raise
    tier.close()
    if report.clean:
        shutil.rmtree(fresh)
        return report
    report.moved_to = move_aside(path)
    fresh.rename(path)
    LMDBTier(path, initial_map_bytes=1 << 20).close()  # the result opens and passes the checks
    return report
