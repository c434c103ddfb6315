"""What CPython's objects and containers take in memory: what the memory tier and its eviction policies charge.

Figures for 64-bit CPython 3.11+ (measured with ``tracemalloc`` and ``sys.getsizeof``; ``tests/kvstore/
test_memory_tier_overhead.py`` checks them against ``tracemalloc``):

* a ``bytes`` object of ``n`` bytes: a 33-byte header + ``n``, rounded up as the allocator rounds it (pymalloc,
  objects of 512 bytes or less: 16 bytes; malloc: 8 bytes of chunk header, 16-byte alignment);
* an ``int`` above 256 (the small ones are shared): 28 or 32 bytes (pymalloc: 32);
* one entry of a ``dict`` (not counting its key and value objects): 24 bytes of entry slot and 4 of index per
  slot of the table. A table is rebuilt for 3x the live entries when its entry slots run out (2/3 of its index
  slots, a power of two), so under churn (inserts and deletes) it holds at most 4 entry slots and 6 index slots
  per live entry: 120 bytes (60 when it only grows);
* one entry of an ``OrderedDict``: its dict's 120, 8 bytes of node pointer per index slot (6) and a 32-byte node:
  200 bytes.

These per-entry figures are upper bounds, the charge a tier reserves per entry before storing it; what a
container really holds now is ``sys.getsizeof`` (constant time for ``dict``, ``set`` and ``OrderedDict``: it
counts the table and, for an ``OrderedDict``, its nodes). A table does not shrink when entries are deleted; it
is rebuilt smaller at the next insert that finds it full.
"""

from __future__ import annotations

import sys
from collections.abc import Sized

#: the header of a ``bytes`` object (33 bytes on 64-bit CPython)
BYTES_HEADER = sys.getsizeof(b"")
#: an ``int`` object too large to be one of the shared small ints, as pymalloc allocates it
INT_BYTES = 32
#: one entry of a ``dict`` at most (its key and value objects not counted; see the module docstring)
DICT_ENTRY_BYTES = 120
#: one entry of an ``OrderedDict`` at most (its key and value objects not counted)
ODICT_ENTRY_BYTES = 200

_PYMALLOC_MAX = 512


def bytes_object(n: int) -> int:
    """Memory of a ``bytes`` object of ``n`` bytes, as the allocator hands it out."""
    size = BYTES_HEADER + n
    if size <= _PYMALLOC_MAX:
        return (size + 15) & ~15
    return (size + 8 + 15) & ~15


def containers(*held: Sized) -> int:
    """What the containers ``held`` (dicts, sets, OrderedDicts) take now, their keys' and values' objects not
    counted (``sys.getsizeof``: constant time)."""
    return sum(map(sys.getsizeof, held))
