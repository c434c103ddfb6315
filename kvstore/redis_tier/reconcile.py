"""Reconciliation: passes over the usage registry that find the values Redis evicted on its own (``maxmemory``)
and count them out, a step at a time when Redis's ``evicted_keys`` grew, or whole (``reconcile()``). A mixin of
``RedisTier`` beside ``accounting.Accounting``, whose registry it reads and writes."""

from __future__ import annotations

import time

import redis.exceptions as rex

from kvshelf.kvstore.errors import TierUnavailableError
from kvshelf.kvstore.redis_tier.connection import Client, _is_data_error
from kvshelf.kvstore.redis_tier.layout import _CHUNKED, _DROP_CHUNKS, _INLINE, _Manifest, read_manifest
from kvshelf.kvstore.redis_tier.usage import RECONCILE_STEP, SCAN_BATCH, SETTLE_S, Entry


class Reconciliation:
    """The reconciliation passes (a mixin of ``RedisTier``)."""

    def _reconcile_step(self, client: Client, budget: int, *, exact: bool = False) -> list[bytes]:
        """Look at up to about ``budget`` registry entries from where the pass stands (``HSCAN``): values counted in
        that are no longer whole (``exact``: or whose manifest is another value's) are counted out and removed
        (``_lost``); ``-``/``x`` leftovers older than ``SETTLE_S`` are settled. Returns the keys counted out."""
        found: list[bytes] = []
        cursor, seen = self._cursor, 0
        while True:
            try:
                cursor, fields = client.hscan(self._usage_key, cursor, match="e:*", count=SCAN_BATCH)
            except rex.ResponseError as exc:
                if not _is_data_error(exc):
                    raise
                self._stale, cursor = True, 0  # a damaged registry: the next usage() rebuilds it
                break
            entries = [e for e in (Entry.parse(f, v) for f, v in fields.items()) if e is not None]
            counted = []
            for e in entries:
                manifest = _Manifest(_CHUNKED if e.chunks else _INLINE, e.generation, e.chunks, e.size)
                # an entry no writer could have made (damaged, or planted) is left alone: checking it could cost
                # a million EXISTS
                if e.state == "+" and e.chunks <= _DROP_CHUNKS and isinstance(
                        read_manifest(manifest.pack(), self.max_value_bytes, whole=False), _Manifest):
                    counted.append((e.key, manifest))
            whole = self._whole(client, counted, exact=exact)
            found += self._lost(client, [value for value, ok in zip(counted, whole, strict=True) if not ok])
            # leftovers ("-", "x") and fields that are no entry (planted, damaged: the script drops them)
            parsed = {e.field for e in entries}
            junk = [f.decode("ascii", "replace") if isinstance(f, bytes) else f for f in fields]
            self._account(client, [("settle", e.field, SETTLE_S, 0) for e in entries if e.state != "+"]
                          + [("settle", f, SETTLE_S, 0) for f in junk if f not in parsed])
            seen += len(fields)
            if not cursor or seen >= budget:
                break
        self._cursor = int(cursor)
        return found

    def _reconcile_if_due(self, client: Client, evicted: int | None) -> list[bytes]:
        """A reconciliation step when Redis has evicted keys since the last pass began (``evicted_keys`` grew), a
        pass is under way, or -- INFO unreadable -- once per ``reconcile_interval_s``. Skipped while another thread
        reconciles."""
        now = time.monotonic()
        if not self._cursor:
            if evicted is None:
                if now < self._next_blind:
                    return []
                self._next_blind = now + max(self.reconcile_interval_s, 1.0)
            elif evicted == self._seen_evicted or (self._seen_evicted is None and evicted == 0):
                self._seen_evicted = evicted
                return []
        if not self._reconcile_lock.acquire(blocking=False):
            return []
        try:
            if not self._cursor:
                self._pass_evicted = evicted
            found = self._reconcile_step(client, RECONCILE_STEP)
            if not self._cursor:
                self._seen_evicted = self._pass_evicted
            return found
        finally:
            self._reconcile_lock.release()

    def _check_evictions(self) -> None:
        """Before a put, at most every ``reconcile_interval_s``: Redis's ``evicted_keys``, and a reconciliation step
        if it grew (so a namespace quota counts what Redis holds). Never fails the put: an unreachable Redis is the
        put's own business."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.reconcile_interval_s
        try:
            found = self._run("reconcile", lambda client: self._reconcile_if_due(client, self._info(client)[1]))
        except TierUnavailableError:
            return
        self._report(found)

    def reconcile(self) -> int:
        """A whole reconciliation pass now (every registry entry, an ``EXISTS`` each); returns how many values it
        found evicted by Redis (counted out and reported to the store as evictions)."""

        def fn(client: Client) -> list[bytes]:
            found: list[bytes] = []
            with self._reconcile_lock:
                self._cursor = 0
                while True:
                    found += self._reconcile_step(client, RECONCILE_STEP)
                    if not self._cursor:
                        return found

        found = self._run("reconcile", fn)
        self._report(found)
        return len(found)
