"""The environment's records (byte counters, the key index's formats) and what a value costs on disk: its charge
(``value_charge``), the write transaction's size (``txn_bytes``) and the slack a bounded file may grow by
(``lmdb_slack_bytes``; each term is derived in docs/storage.md, "LMDB tier").
"""

from __future__ import annotations

import struct

from kvshelf.kvstore.errors import ConfigError

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
    """How far past ``capacity_bytes`` a bounded tier's file may grow (docs/storage.md, "LMDB tier", derives each term):
    ``3 R + 4 txn_bytes + capacity / 256 + 256 KiB``, rounded up to whole pages."""
    allowance, txn = page_allowance(capacity_bytes), txn_bytes(capacity_bytes)
    slack = allowance + 2 * (txn + allowance) + 2 * txn + capacity_bytes // 256 + _FIXED_SLACK
    return -(-slack // page_size) * page_size


def _check_capacity(capacity_bytes: object) -> int:
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
        raise ConfigError(f"LMDB tier capacity must be a whole number of bytes of at least 1 (LMDB's own pages "
                          f"come on top, in the slack), got {capacity_bytes!r}")
    return capacity_bytes
