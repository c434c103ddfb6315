"""The read side: values copied out under a read transaction (LMDB's MVCC keeps the snapshot's pages untouched
until it ends, so a value evicted or overwritten meanwhile is never torn), the key listing read from the file
(never the map), usage, and ``audit`` of the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

import lmdb

from kvshelf.kvstore.lmdb_tier.damage import damaged_error
from kvshelf.kvstore.lmdb_tier.file import check_file, db_keys
from kvshelf.kvstore.lmdb_tier.layout import _CAPACITY, _CHARGED, _KEYSEQ, _SEQ
from kvshelf.kvstore.tier import TierUsage


class Reads:
    """``get_many``, ``peek_many``, ``prefix_run_length``, ``keys``, ``usage`` and ``audit`` (a mixin of
    ``LMDBTier``)."""

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

    def peek_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys`` as ``get_many`` reads them, the policy told nothing (no hit, no recency)."""

        def fn(txn: lmdb.Transaction) -> list[bytes | None]:
            return [bytes(buf) if (buf := txn.get(key)) is not None else None for key in keys]

        return self._read(fn)

    def prefix_run_length(self, keys: Sequence[bytes]) -> int:
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
