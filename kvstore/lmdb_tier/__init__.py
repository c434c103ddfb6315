"""Local-disk tier on LMDB: memory-mapped, crash-safe, shared by the processes of one machine.

Bounded (``capacity_bytes=N``): at most ``N`` bytes of values, evicting through the pluggable policy in the put's
own write transaction, the file never past ``N + lmdb_slack_bytes(N)``. Unbounded: no eviction, the map doubles up
to ``max_map_bytes``. A damaged file is judged before LMDB maps it and raises ``TierDamagedError``; ``kvshelf
repair`` salvages it. The design (modes, transactions, slack, restarts, damage): docs/storage.md ("LMDB tier").

Modules: ``tier`` (``LMDBTier``, opening), ``txn`` (transactions, counters), ``bounded`` (key index, eviction,
map-full retries), ``reads``, ``writes``, ``layout`` (records, charges, slack), ``damage`` (judging the file),
``file`` (reading ``data.mdb`` without LMDB), ``repair`` (salvaging a damaged environment; not imported here).
"""

from kvshelf.kvstore.lmdb_tier.damage import check_file_fits, check_trees, damaged_error, recovery_hint
from kvshelf.kvstore.lmdb_tier.layout import (
    MAX_TXN_BYTES,
    MIN_MAP_BYTES,
    MIN_TXN_BYTES,
    lmdb_slack_bytes,
    page_allowance,
    txn_bytes,
    value_charge,
)
from kvshelf.kvstore.lmdb_tier.tier import LMDBTier

__all__ = [
    "MAX_TXN_BYTES",
    "MIN_MAP_BYTES",
    "MIN_TXN_BYTES",
    "LMDBTier",
    "check_file_fits",
    "check_trees",
    "damaged_error",
    "lmdb_slack_bytes",
    "page_allowance",
    "recovery_hint",
    "txn_bytes",
    "value_charge",
]
