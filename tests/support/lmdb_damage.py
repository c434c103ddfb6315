"""Damaging real LMDB files on disk, the way a bad disk, a full filesystem or a stray ``dd`` would: pages are
found by walking the file's page headers (``pgno u64, pad u16, flags u16, lower u16, upper u16``; flags 0x01
branch, 0x02 leaf, 0x04 overflow, 0x08 meta), then bytes are overwritten in place."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from helpers import key_of, make_block

from kvshelf.kvstore import LMDBTier, TieredStore
from kvshelf.kvstore.block import KVBlock

HEADER = struct.Struct("<QHHHH")
BRANCH, LEAF, OVERFLOW, META = 0x01, 0x02, 0x04, 0x08
MiB = 1 << 20
DAMAGES = ["truncated", "garbage_branch_header", "branch_child", "leaf_header", "leaf_node_size"]


def fill(path: Path, count: int = 300) -> dict[bytes, KVBlock]:
    """An LMDB tier at ``path`` holding ``count`` blocks (values on overflow pages; a branch page over several
    leaves); returns them by key. Closed when it returns."""
    blocks = {}
    for i in range(count):
        block = make_block(list(range(i * 16, i * 16 + 16)), namespace="ns", seed=i)
        blocks[key_of(block)] = block
    with TieredStore([LMDBTier(path, initial_map_bytes=MiB, durable=True)]) as store:
        store.put_many(list(blocks.items()))
    return blocks


def page_size(path: Path) -> int:
    """The page size the first meta page names (its FREE db record's first field)."""
    raw = (path / "data.mdb").read_bytes()[: 16 + 24 + 4]
    return struct.unpack_from("<I", raw, 16 + 24)[0]


def pages(path: Path, kind: int) -> list[int]:
    """Page numbers of the pages of ``kind`` whose header names their own position (overflow data skipped)."""
    data = (path / "data.mdb").read_bytes()
    size = page_size(path)
    found, pgno = [], 0
    while (pgno + 1) * size <= len(data):
        number, _, flags, lower, _ = HEADER.unpack_from(data, pgno * size)
        if number == pgno and flags & OVERFLOW:
            if kind == OVERFLOW:
                found.append(pgno)
            pgno += max(1, struct.unpack_from("<I", data, pgno * size + 12)[0])
            continue
        if number == pgno and flags & kind:
            found.append(pgno)
        pgno += 1
    return found


def blocks_root(path: Path) -> int:
    """The root page of the ``blocks`` database now: the newest meta page (higher txnid, at offset 16 + 128 of a
    meta page) names the main tree's root (offset 16 + 24 + 48 + 40); its leaf holds the ``blocks`` record."""
    data = (path / "data.mdb").read_bytes()
    size = page_size(path)
    _, newest = max((struct.unpack_from("<Q", data, i * size + 16 + 128)[0], i) for i in (0, 1))
    main_root = struct.unpack_from("<Q", data, newest * size + 16 + 24 + 48 + 40)[0]
    page = data[main_root * size : (main_root + 1) * size]
    _, _, _, lower, _ = HEADER.unpack_from(page)
    for i in range((lower - 16) // 2):
        node = struct.unpack_from("<H", page, 16 + 2 * i)[0]
        ksize = struct.unpack_from("<H", page, node + 6)[0]
        if page[node + 8 : node + 8 + ksize] == b"blocks":
            return struct.unpack_from("<Q", page, node + 8 + ksize + 40)[0]
    raise AssertionError("no blocks database")


def block_leaves(path: Path) -> list[int]:
    """Leaf pages of the ``blocks`` database (their keys are 16 bytes; the other databases' are not)."""
    data = (path / "data.mdb").read_bytes()
    size = page_size(path)
    out = []
    for pgno in pages(path, LEAF):
        page = data[pgno * size : (pgno + 1) * size]
        first = struct.unpack_from("<H", page, 16)[0]
        if struct.unpack_from("<H", page, first + 6)[0] == 16:
            out.append(pgno)
    return out


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` of ``data.mdb`` in place (a running process's map sees it)."""
    fd = os.open(path / "data.mdb", os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def damage(path: Path, how: str) -> None:
    """Damage the environment at ``path`` (see ``DAMAGES``)."""
    size = page_size(path)
    data = path / "data.mdb"
    if how == "truncated":
        os.truncate(data, data.stat().st_size // 2)
        return
    branch = blocks_root(path)
    assert branch in pages(path, BRANCH), "the blocks tree has no branch page: fill it with more blocks"
    raw = data.read_bytes()[branch * size : (branch + 1) * size]
    if how == "garbage_branch_header":
        overwrite(path, branch * size, bytes(range(7, 23)))
    elif how == "branch_child":  # the first child pointer of the root points far past the file
        node = struct.unpack_from("<H", raw, 16)[0]
        overwrite(path, branch * size + node, struct.pack("<HH", 0xFFFF, 0x00FF))
    elif how == "leaf_header":  # flags and lower/upper of a leaf of blocks
        overwrite(path, block_leaves(path)[0] * size + 10, b"\x00\x00\xff\xff")
    elif how == "leaf_node_size":  # a value's size in its leaf node: 256 MiB, past the file's end
        leaf = block_leaves(path)[0]
        page = data.read_bytes()[leaf * size : (leaf + 1) * size]
        node = struct.unpack_from("<H", page, 16)[0]
        overwrite(path, leaf * size + node, struct.pack("<HH", 0xFFFF, 0x0FFF))
    else:  # pragma: no cover
        raise AssertionError(how)


def keys_under_leaf(path: Path, leaf: int) -> list[bytes]:
    """The 16-byte keys held by leaf page ``leaf`` (read before damaging it)."""
    size = page_size(path)
    page = (path / "data.mdb").read_bytes()[leaf * size : (leaf + 1) * size]
    _, _, _, lower, _ = HEADER.unpack_from(page)
    keys = []
    for i in range((lower - 16) // 2):
        node = struct.unpack_from("<H", page, 16 + 2 * i)[0]
        ksize = struct.unpack_from("<H", page, node + 6)[0]
        keys.append(page[node + 8 : node + 8 + ksize])
    return keys
