"""Reading an LMDB ``data.mdb`` file directly, with bounds checks, never through a memory map.

LMDB trusts its file: ``mdb_env_open`` maps it and follows page numbers wherever they point, so a file cut
short kills the process with SIGBUS and a garbage page gives a raw error or wrong answers. This module reads
the file with plain ``pread`` calls, so a damaged file can be judged before LMDB touches it (``check_file``)
and the readable part of it salvaged without LMDB (``walk_db``, used by ``kvstore.lmdb_tier.repair``).

The layout (LMDB 0.9, 64-bit): every page starts with a 16-byte header: ``pgno u64, pad u16, flags u16,
lower u16, upper u16`` (an overflow page holds its page count, u32, where lower/upper are). Pages 0 and 1 are
meta pages; their body (at offset 16) is ``magic u32, version u32, address u64, mapsize u64, dbs[2] (FREE,
MAIN: 48 bytes each), last_pgno u64, txnid u64``. A ``MDB_db`` record is ``pad u32 (the page size, in the FREE
db of a meta page), flags u16, depth u16, branch_pages u64, leaf_pages u64, overflow_pages u64, entries u64,
root u64``. A branch or leaf page holds ``(lower - 16) / 2`` u16 node offsets; a node is ``lo u16, hi u16,
flags u16, ksize u16`` then the key then, on a leaf, the data (or, with ``F_BIGDATA``, the u64 number of the
first overflow page holding it); on a branch, ``lo | hi << 16 | flags << 32`` is the child's page number.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PAGE_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
PAGE_HEADER_BYTES = PAGE_HEADER.size
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch_pages, leaf_pages, overflow_pages, entries, root
_TAIL = struct.Struct("<QQ")  # last_pgno, txnid
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
P_INVALID = (1 << 64) - 1
_MAX_DEPTH = 64


class _FileDamage(Exception):  # noqa: N818 - caught inside kvstore (lmdb_tier.file, lmdb_tier.repair), never raised to a caller
    """The file cannot be an LMDB environment as it stands (the message says what is wrong)."""


@dataclass(frozen=True)
class DBRecord:
    """One ``MDB_db`` record: where a (sub-)database's tree starts, and how big LMDB says it is."""

    pad: int
    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int

    @classmethod
    def parse(cls, raw: bytes) -> DBRecord:
        return cls(*_DB.unpack_from(raw))


@dataclass(frozen=True)
class Meta:
    """One of the two meta pages; LMDB uses the one with the higher ``txnid``."""

    index: int
    page_size: int
    mapsize: int
    free_db: DBRecord
    main_db: DBRecord
    last_pgno: int
    txnid: int


def _read(fd: int, offset: int, size: int) -> bytes:
    return os.pread(fd, size, offset)


def read_meta(fd: int, index: int, page_size: int | None = None) -> Meta:
    """Meta page ``index`` (0 or 1); raises ``_FileDamage`` naming what is wrong with it."""
    offset = 0 if index == 0 else page_size
    if offset is None:
        raise _FileDamage("the page size is unknown")
    raw = _read(fd, offset, PAGE_HEADER_BYTES + _META.size + 2 * _DB.size + _TAIL.size)
    if len(raw) < PAGE_HEADER_BYTES + _META.size + 2 * _DB.size + _TAIL.size:
        raise _FileDamage(f"meta page {index} is cut off (the file ends at byte {offset + len(raw)})")
    pgno, _, flags, _, _ = PAGE_HEADER.unpack_from(raw)
    if not flags & P_META or pgno != index:
        raise _FileDamage(f"meta page {index} has a bad page header (pgno {pgno}, flags {flags:#x})")
    magic, version, _, mapsize = _META.unpack_from(raw, PAGE_HEADER_BYTES)
    if magic != MDB_MAGIC:
        raise _FileDamage(f"meta page {index} has a bad magic number ({magic:#x})")
    if version != MDB_DATA_VERSION:
        raise _FileDamage(f"meta page {index} has LMDB data version {version}, expected {MDB_DATA_VERSION}")
    at = PAGE_HEADER_BYTES + _META.size
    free_db = DBRecord.parse(raw[at : at + _DB.size])
    main_db = DBRecord.parse(raw[at + _DB.size : at + 2 * _DB.size])
    last_pgno, txnid = _TAIL.unpack_from(raw, at + 2 * _DB.size)
    size = free_db.pad
    if size < 512 or size > 1 << 16 or size & (size - 1):
        raise _FileDamage(f"meta page {index} names an impossible page size {size}")
    if page_size is not None and size != page_size:
        raise _FileDamage(f"meta page {index} names page size {size}, meta page 0 names {page_size}")
    return Meta(index, size, mapsize, free_db, main_db, last_pgno, txnid)


@dataclass
class FileCheck:
    """What ``check_file`` found: the meta pages that parse (``parsed``) and those whose pages all lie in the
    file (``metas``), newest first; and what is wrong."""

    size: int
    metas: list[Meta] = field(default_factory=list)
    parsed: list[Meta] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def newest(self) -> Meta | None:
        return self.metas[0] if self.metas else None


def _meta_problem(meta: Meta, file_size: int) -> str | None:
    """Why LMDB cannot safely use ``meta`` on a file of ``file_size`` bytes (None: it can).

    The file may legitimately end before ``last_pgno`` (pages a transaction allocated and freed again are
    never written), so what must lie in the file is what the trees reference: their roots here, every other
    page in ``verify_tree``.
    """
    file_pages = file_size // meta.page_size
    if meta.last_pgno < 1:
        return f"meta page {meta.index} (txn {meta.txnid}) names an impossible last page {meta.last_pgno}"
    for name, db in (("free", meta.free_db), ("main", meta.main_db)):
        if db.root == P_INVALID:
            continue
        if not 2 <= db.root <= meta.last_pgno:
            return f"meta page {meta.index} (txn {meta.txnid}): the {name} db's root page {db.root} is out of range"
        if db.root >= file_pages:
            return (f"meta page {meta.index} (txn {meta.txnid}): the {name} db's root page {db.root} lies past the "
                    f"end of the file ({file_size} bytes, {file_pages} pages, where its pages go up to "
                    f"{meta.last_pgno}): it was cut short")
    return None


def check_file(path: str | os.PathLike[str]) -> FileCheck:
    """Judge ``data.mdb`` at ``path`` without mapping it: both meta pages parsed, their trees' roots checked
    against the file size. ``FileCheck.problems`` empty: LMDB may open it (``verify_tree`` checks the rest)."""
    path = Path(path)
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        check = FileCheck(size)
        if size == 0:  # LMDB writes the meta pages of a new environment itself
            return check
        page_size = None
        candidates: list[Meta] = []
        for index in (0, 1):
            try:
                meta = read_meta(fd, index, page_size)
            except _FileDamage as exc:
                check.problems.append(str(exc))
                if index == 0:
                    page_size = _guess_page_size(fd, size)
                    if page_size is None:
                        break
                continue
            page_size = meta.page_size
            candidates.append(meta)
        # the size after the meta pages: a writer of another process writes a transaction's pages before the
        # meta page naming them, so a size read before the metas may miss pages a newer meta already names
        size = check.size = os.fstat(fd).st_size
        for meta in candidates:
            problem = _meta_problem(meta, size)
            if problem is None:
                check.metas.append(meta)
            else:
                check.problems.append(problem)
        check.metas.sort(key=lambda m: m.txnid, reverse=True)
        check.parsed = sorted(candidates, key=lambda m: m.txnid, reverse=True)
        return check


def _guess_page_size(fd: int, size: int) -> int | None:
    """The page size, found from meta page 1 when meta page 0 is unreadable."""
    for page_size in (4096, 8192, 16384, 65536, 2048, 1024, 512, 32768):
        if page_size * 2 > size:
            continue
        try:
            read_meta(fd, 1, page_size)
        except _FileDamage:
            continue
        return page_size
    return None


# -- walking a tree ---------------------------------------------------------------------------------------


@dataclass
class WalkReport:
    """What a tree walk found: ``unreadable`` page numbers (with why), and the pages it read."""

    unreadable: dict[int, str] = field(default_factory=dict)
    pages_read: int = 0


class PageReader:
    """Bounds-checked page reads of an open ``data.mdb`` (file descriptor ``fd``)."""

    def __init__(self, fd: int, page_size: int, last_pgno: int) -> None:
        self.fd = fd
        self.page_size = page_size
        self.last_pgno = last_pgno
        self.file_pages = os.fstat(fd).st_size // page_size

    def page(self, pgno: int, *kinds: int) -> bytes:
        """Page ``pgno``, its header checked (number, flags one of ``kinds``, lower/upper); raises
        ``_FileDamage``."""
        if not 2 <= pgno <= self.last_pgno:
            raise _FileDamage(f"page number {pgno} is out of range")
        if pgno >= self.file_pages:
            raise _FileDamage(f"page {pgno} lies past the end of the file ({self.file_pages} pages): "
                                "it was cut short")
        raw = _read(self.fd, pgno * self.page_size, self.page_size)
        if len(raw) < self.page_size:
            raise _FileDamage(f"page {pgno} is cut off")
        number, _, flags, lower, upper = PAGE_HEADER.unpack_from(raw)
        if number != pgno:
            raise _FileDamage(f"page {pgno} names itself page {number}")
        kind = flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2)
        if kind not in kinds:
            raise _FileDamage(f"page {pgno} has flags {flags:#x}, expected {' or '.join(f'{k:#x}' for k in kinds)}")
        if kind != P_OVERFLOW and not (PAGE_HEADER_BYTES <= lower <= upper <= self.page_size
                                               and (lower - PAGE_HEADER_BYTES) % 2 == 0):
            raise _FileDamage(f"page {pgno} has a bad lower/upper ({lower}/{upper})")
        return raw

    def nodes(self, pgno: int, raw: bytes) -> Iterator[tuple[int, int, int, bytes, int]]:
        """``(lo, hi, flags, key, data offset)`` of every node of a branch or leaf page."""
        _, _, _, lower, upper = PAGE_HEADER.unpack_from(raw)
        for i in range((lower - PAGE_HEADER_BYTES) // 2):
            (offset,) = struct.unpack_from("<H", raw, PAGE_HEADER_BYTES + 2 * i)
            if not upper <= offset <= self.page_size - _NODE.size:
                raise _FileDamage(f"page {pgno}: node {i} at a bad offset {offset}")
            lo, hi, flags, ksize = _NODE.unpack_from(raw, offset)
            start = offset + _NODE.size
            if start + ksize > self.page_size:
                raise _FileDamage(f"page {pgno}: node {i} has a key past the page end")
            yield lo, hi, flags, raw[start : start + ksize], start + ksize

    def value(self, pgno: int, raw: bytes, lo: int, hi: int, flags: int, at: int) -> bytes:
        """The data of a leaf node (inline, or on its overflow pages)."""
        size = lo | hi << 16
        if not flags & F_BIGDATA:
            if at + size > self.page_size:
                raise _FileDamage(f"page {pgno}: a value runs past the page end")
            return raw[at : at + size]
        (first,) = struct.unpack_from("<Q", raw, at)
        head = self.page(first, P_OVERFLOW)
        (count,) = struct.unpack_from("<I", head, 12)
        if count < 1 or first + count - 1 > self.last_pgno or PAGE_HEADER_BYTES + size > count * self.page_size:
            raise _FileDamage(f"overflow page {first}: its page count {count} does not fit a {size}-byte value")
        data = _read(self.fd, first * self.page_size + PAGE_HEADER_BYTES, size)
        if len(data) < size:
            raise _FileDamage(f"overflow page {first}: the value is cut off")
        return data


def walk_db(reader: PageReader, root: int, report: WalkReport) -> Iterator[tuple[bytes, int, bytes, tuple]]:
    """Every readable leaf node of the tree at ``root``: ``(key, flags, raw page, (lo, hi, flags, at))``.

    A page that fails its checks is recorded in ``report.unreadable`` and skipped with everything under it;
    the walk goes on with its siblings. Pages are never visited twice (a damaged tree may loop).
    """
    if root == P_INVALID:
        return
    seen: set[int] = set()
    stack: list[tuple[int, int]] = [(root, 0)]
    while stack:
        pgno, depth = stack.pop()
        if pgno in seen or depth > _MAX_DEPTH:
            report.unreadable.setdefault(pgno, "visited twice: the tree loops")
            continue
        seen.add(pgno)
        try:
            raw = reader.page(pgno, P_BRANCH, P_LEAF)
            report.pages_read += 1
            nodes = list(reader.nodes(pgno, raw))
        except _FileDamage as exc:
            report.unreadable[pgno] = str(exc)
            continue
        (flags,) = struct.unpack_from("<H", raw, 10)
        if flags & P_BRANCH:
            children = [lo | hi << 16 | nflags << 32 for lo, hi, nflags, _, _ in nodes]
            stack.extend((child, depth + 1) for child in reversed(children))
            continue
        for lo, hi, nflags, key, at in nodes:
            yield key, nflags, raw, (lo, hi, nflags, at)



def big_value_problem(reader: PageReader, lo: int, hi: int, at_page: bytes, at: int) -> str | None:
    """Why the overflow pages a ``F_BIGDATA`` node names cannot hold its value (None: they can), judged from
    the node alone (the overflow pages are not read)."""
    size = lo | hi << 16
    (first,) = struct.unpack_from("<Q", at_page, at)
    last = first + (PAGE_HEADER_BYTES + size + reader.page_size - 1) // reader.page_size - 1
    if not 2 <= first <= last <= reader.last_pgno or last >= reader.file_pages:
        return f"a {size}-byte value on overflow pages {first}..{last} past the last page {reader.last_pgno}"
    return None


def verify_tree(fd: int, meta: Meta, *, limit: int = 8) -> list[str]:
    """Structural problems of the environment ``meta`` describes (empty: none), at most ``limit`` of them.

    Walks the free and main trees and every named database's tree: each branch and leaf page's header and
    node bounds, and where every value's overflow pages lie (those pages are not read). Reads only branch and
    leaf pages, a small fraction of a store of large values.
    """
    reader = PageReader(fd, meta.page_size, meta.last_pgno)
    problems: list[str] = []
    roots = [("free", meta.free_db.root), ("main", meta.main_db.root)]
    while roots and len(problems) < limit:
        name, root = roots.pop(0)
        report = WalkReport()
        for key, flags, raw, (lo, hi, _, at) in walk_db(reader, root, report):
            if flags & F_SUBDATA and name == "main":
                if (lo | hi << 16) != _DB.size or at + _DB.size > reader.page_size:
                    problems.append(f"db {key!r}: a bad database record")
                    continue
                roots.append((key.decode(errors="replace"), DBRecord.parse(raw[at : at + _DB.size]).root))
            elif flags & F_BIGDATA:
                problem = big_value_problem(reader, lo, hi, raw, at)
                if problem:
                    problems.append(f"{name} db: {problem}")
            elif at + (lo | hi << 16) > reader.page_size:
                problems.append(f"{name} db: a value runs past the end of its page")
            if len(problems) >= limit:
                break
        problems.extend(f"{name} db: page {pgno}: {why}" for pgno, why in report.unreadable.items())
    return problems[:limit]


def scan_leaf_pages(fd: int, page_size: int, *, chunk_pages: int = 4096) -> Iterator[tuple[int, bytes]]:
    """Every page of the file that looks like a leaf page (its header names its own number, leaf flags, sane
    lower/upper), in file order, whatever tree (or free list) it belongs to: ``(pgno, raw page)``. For salvaging
    what a damaged tree no longer reaches; such pages may hold stale versions (freed by later transactions)."""
    file_pages = os.fstat(fd).st_size // page_size
    pgno = 2
    while pgno < file_pages:
        count = min(chunk_pages, file_pages - pgno)
        chunk = _read(fd, pgno * page_size, count * page_size)
        i = 0
        while i < len(chunk) // page_size:
            number, _, flags, lower, upper = PAGE_HEADER.unpack_from(chunk, i * page_size)
            if number == pgno + i and flags & P_OVERFLOW:  # skip its data pages (a garbage count: one page)
                (pages,) = struct.unpack_from("<I", chunk, i * page_size + 12)
                i += pages if 1 <= pages <= file_pages else 1
                continue
            if (number == pgno + i and flags & (P_LEAF | P_BRANCH | P_META | P_LEAF2) == P_LEAF
                    and PAGE_HEADER_BYTES <= lower <= upper <= page_size):
                yield pgno + i, chunk[i * page_size : (i + 1) * page_size]
            i += 1
        pgno += i


def db_keys(fd: int, meta: Meta, name: bytes) -> tuple[list[bytes], list[str]]:
    """The keys of the named database ``name`` in the trees of ``meta``, in order, and the problems met (a
    damaged page's keys are missing). Plain reads: a damaged page is reported, never followed."""
    reader = PageReader(fd, meta.page_size, meta.last_pgno)
    report = WalkReport()
    root = None
    for key, flags, raw, (lo, hi, _, at) in walk_db(reader, meta.main_db.root, report):
        if key == name and flags & F_SUBDATA and (lo | hi << 16) == _DB.size and at + _DB.size <= reader.page_size:
            root = DBRecord.parse(raw[at : at + _DB.size]).root
    keys = [key for key, *_ in walk_db(reader, root, report)] if root is not None else []
    return keys, [f"page {pgno}: {why}" for pgno, why in report.unreadable.items()]
