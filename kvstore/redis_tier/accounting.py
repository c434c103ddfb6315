"""Usage and eviction: the registry and counters kept by every put and delete (``kvstore.redis_tier.usage`` has the
scripts), ``usage()`` and ``recount()``; the reconciliation passes that find what Redis evicted on its own are
``kvstore.redis_tier.reconcile``.

kvshelf never evicts from Redis: configure ``maxmemory`` with ``maxmemory-policy allkeys-lfu`` (or ``allkeys-lru``).
See docs/storage.md ("Redis tier", Eviction and Usage).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import redis.cluster
import redis.exceptions as rex

from kvshelf.kvstore.redis_tier.connection import _UNAVAILABLE, Client, _is_data_error, _readable
from kvshelf.kvstore.redis_tier.layout import (
    _CHUNKED,
    _DROP_CHUNKS,
    _DROP_DAMAGED,
    _WARN_EVERY_S,
    _Manifest,
)
from kvshelf.kvstore.redis_tier.usage import (
    INIT_SCRIPT,
    LOST,
    RECONCILE_STEP,
    SCAN_BATCH,
    USAGE_SCRIPT,
    entry_field,
    unflagged,
)
from kvshelf.kvstore.tier import EvictionCallback, TierUsage

log = logging.getLogger(__package__)


class Accounting:
    """The usage registry, its counters and reconciliation (a mixin of ``RedisTier``)."""

    @staticmethod
    def _op(op: str, key: bytes, manifest: _Manifest) -> tuple[str, str, int, int]:
        return op, entry_field(key, manifest.generation), manifest.total, manifest.chunks

    def _script(self, client: Client, script: str, args: Sequence[Any]) -> Any:
        """One of the registry scripts on the usage hash (without its flags on a Redis older than 7)."""
        if self._flagged:
            try:
                return client.eval(script, 1, self._usage_key, *args)
            except rex.ResponseError as exc:
                if isinstance(exc, _UNAVAILABLE) or "near '#'" not in str(exc):
                    raise
                self._flagged = False
                log.warning("Redis tier %s: this Redis takes no script flags (it is older than 7.0): the usage "
                            "accounting of a full noeviction Redis may be refused", self.name)
        return client.eval(unflagged(script), 1, self._usage_key, *args)

    def _account(self, client: Client, ops: Sequence[tuple[str, str, int, int]]) -> list[int]:
        """Apply registry operations ``(op, field, size, chunks)``; for each, 1 if it changed something.

        A missing or damaged registry (a new tier, or Redis evicted it) is replaced by an empty one marked ``stale``
        and the operations applied to it (a removal of a value it does not know counts nothing there); the next
        ``usage()`` recounts."""
        out: list[int] = []
        for start in range(0, len(ops), 1024):
            batch = ops[start:start + 1024]
            reply = self._apply(client, batch)
            if reply == LOST:
                init = self._script(client, INIT_SCRIPT, ["0"])
                if init == 1:
                    log.info("Redis tier %s: created the usage registry at %s (a new tier, or Redis evicted it): the "
                             "next usage() recounts", self.name, self._usage_key)
                elif init == 2:
                    log.warning("Redis tier %s: the usage counters at %s were damaged: replaced by an empty registry; "
                                "the next usage() recounts", self.name, self._usage_key)
                if init in (0, 1, 2):  # nothing of the batch was applied: it all applies to the registry there now
                    reply = self._apply(client, batch)
            if isinstance(reply, list) and len(reply) == len(batch):
                out.extend(int(r) for r in reply)
            else:
                out.extend(0 for _ in batch)
        return out

    def _apply(self, client: Client, ops: Sequence[tuple[str, str, int, int]]) -> Any:
        """``USAGE_SCRIPT`` on ``ops``: its reply, or ``None`` when Redis refused it (the next ``usage()`` then
        recounts)."""
        if not ops:
            return []
        try:
            return self._script(client, USAGE_SCRIPT, [str(x) for op in ops for x in op])
        except rex.ResponseError as exc:
            if isinstance(exc, _UNAVAILABLE):
                raise
            log.warning("Redis tier %s: the usage accounting was refused (%s): the next usage() recounts",
                        self.name, exc)
            self._stale = True
            return None

    def _whole(self, client: Client, values: Sequence[tuple[bytes, _Manifest]], *, exact: bool = False) -> list[bool]:
        """Whether each value's manifest and chunks all exist (``EXISTS``, which leaves Redis's LRU/LFU clocks
        alone; at most 1024 keys a command). ``exact``: the manifest must also be this value's (same generation; a
        ``GETRANGE`` of its header, which does touch the clocks: only for a recount)."""
        commands: list[tuple[int, list[str]]] = []
        for i, (key, manifest) in enumerate(values):
            names = self._names(key, manifest)
            commands.extend((i, names[at:at + 1024]) for at in range(0, len(names), 1024))
        replies = self._execute(client, (lambda p, n=names: p.execute_command("EXISTS", *n) for _, names in commands))
        found = [0] * len(values)
        unsure: set[int] = set()
        for (i, _), reply in zip(commands, replies, strict=True):
            reply = _readable(reply)
            if isinstance(reply, BaseException):
                unsure.add(i)  # a data error EXISTS never gives: leave the value be
            else:
                found[i] += int(reply)
        whole = [i in unsure or found[i] == 1 + manifest.chunks for i, (_, manifest) in enumerate(values)]
        if exact and values:
            headers = self._headers(client, [key for key, _ in values])
            whole = [ok and (not isinstance(header, _Manifest) or header.generation == value[1].generation)
                     for ok, header, value in zip(whole, headers, values, strict=True)]
        return whole

    def _lost(self, client: Client, values: Sequence[tuple[bytes, _Manifest]]) -> list[bytes]:
        """Values found no longer whole (Redis evicted a chunk or the manifest): each is counted out (only if it was
        counted in, and by one finder only), then what Redis left of it is removed (the manifest only if it is still
        this value), so a read finds it absent at once. Returns the keys this call counted out: evictions to
        report."""
        if not values:
            return []
        results = self._account(client, [self._op("x", key, manifest) for key, manifest in values])
        for key, manifest in values:
            if manifest.kind != _CHUNKED:
                continue
            with contextlib.suppress(rex.ResponseError):  # nothing of ours there to remove
                client.eval(_DROP_DAMAGED, 1, self._manifest_key(key), "bytes", manifest.pack())
            # the chunks Redis left (at most _DROP_CHUNKS: a forged manifest costs one round; more are left for
            # Redis to evict, as nothing reads them)
            chunks = itertools.islice(self._chunk_keys(key, manifest), _DROP_CHUNKS)
            self._execute(client, (lambda p, c=c: p.delete(c) for c in chunks))
        return [key for (key, _), counted in zip(values, results, strict=True) if counted]

    def _warn_refused(self, refused: BaseException) -> None:
        """A warning that Redis refused writes: at most one per ``_WARN_EVERY_S``, with the count since the last."""
        now = time.monotonic()
        with self._lock:
            self._refused_since += 1
            if now < self._next_refused_warning:
                return
            count, self._refused_since = self._refused_since, 0
            self._next_refused_warning = now + _WARN_EVERY_S
        log.warning("Redis tier %s: Redis refused %d write(s) (%s): it is full and does not evict; set "
                    "maxmemory-policy allkeys-lfu or allkeys-lru", self.name, count, refused)

    def _report(self, keys: Sequence[bytes]) -> None:
        """Report values Redis evicted to the store (an empty value: the tier no longer has it)."""
        callback = self._on_evict
        if callback is not None:
            for key in keys:
                callback(key, b"")

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Called with ``(key, b"")`` for each value of this tier found evicted by Redis (the value is gone: the
        empty value says so); kvshelf itself never evicts from Redis."""
        self._on_evict = callback

    def _counters(self, client: Client, *, stale_ok: bool = False) -> tuple[int, int] | str:
        """``(blocks, bytes)`` from the usage hash, or why it cannot be used: ``missing``, ``stale`` (awaiting a
        recount; ``stale_ok``: its figures all the same), ``format...`` or ``damaged...``."""
        try:
            version, blocks, size, stale = client.hmget(self._usage_key, ["v", "blocks", "bytes", "stale"])
        except rex.ResponseError as exc:
            if not _is_data_error(exc):
                raise
            return f"damaged: {exc}"
        if version is None:
            return "missing" if blocks is None and size is None else "format: kept by an older kvshelf"
        if version != b"2":
            return f"format {version[:20]!r}"
        if stale is not None and not stale_ok:
            return "stale"
        values = []
        for field, raw in (("blocks", blocks), ("bytes", size)):
            try:
                value = int(raw if raw is not None else b"")
            except ValueError:
                return f"damaged: {field} is {(raw or b'')[:40]!r}, not an integer"
            if not -(1 << 63) <= value < 1 << 63:
                return f"damaged: {field} is out of range"
            values.append(max(value, 0))
        return values[0], values[1]

    def _recount(self, client: Client, *, force: bool) -> list[bytes]:
        """(Re)build the registry from what Redis holds: a fresh one (``force``: always; else only if the one there
        is missing or damaged), every whole value found by SCAN seeded into it (counted in unless already known),
        values found partly evicted removed; then (not ``force``) a whole reconciliation pass, and the ``stale``
        mark cleared. Returns the keys counted out: evictions to report."""
        self._script(client, INIT_SCRIPT, ["1" if force else "0"])
        self._stale = False
        self.loss_epoch += 1
        keys = self._keys(client)
        found: list[bytes] = []
        for start in range(0, len(keys), SCAN_BATCH):
            batch = keys[start:start + SCAN_BATCH]
            sound = [(key, m) for key, m in zip(batch, self._headers(client, batch), strict=True)
                     if isinstance(m, _Manifest)]
            whole = self._whole(client, sound)
            self._account(client, [self._op("s", key, m) for (key, m), ok in zip(sound, whole, strict=True) if ok])
            found += self._lost(client, [value for value, ok in zip(sound, whole, strict=True) if not ok])
        with self._reconcile_lock:
            self._cursor = 0
            if not force:  # a registry rebuilt while values came and went: each one's generation is checked
                while True:
                    found += self._reconcile_step(client, RECONCILE_STEP, exact=True)
                    if not self._cursor:
                        break
        client.hdel(self._usage_key, "stale")
        return found

    def _info(self, client: Client) -> tuple[int | None, int | None]:
        """Redis's ``maxmemory`` (summed over primaries; ``None`` when one is unlimited or it cannot be read) and
        ``evicted_keys`` since it started (summed; ``None`` when it cannot be read: INFO refused)."""
        try:
            if isinstance(client, redis.cluster.RedisCluster):
                primaries = redis.cluster.RedisCluster.PRIMARIES
                memory, stats = client.info("memory", target_nodes=primaries), client.info("stats",
                                                                                          target_nodes=primaries)
            else:
                memory, stats = client.info("memory"), client.info("stats")
        except rex.ResponseError as exc:  # no permission (a managed Redis), or INFO renamed away
            if isinstance(exc, _UNAVAILABLE):
                raise
            return None, None

        def nodes(info: dict[Any, Any]) -> list[dict[Any, Any]]:
            return [info] if "maxmemory" in info or "evicted_keys" in info else list(info.values())

        try:
            limits = [int(node.get("maxmemory", 0)) for node in nodes(memory)]
            evicted = sum(int(node.get("evicted_keys", 0)) for node in nodes(stats))
        except (TypeError, ValueError, AttributeError):
            return None, None
        capacity = sum(limits) if limits and all(limit > 0 for limit in limits) else None
        return capacity, evicted

    def usage(self) -> TierUsage:
        """The counters (``HMGET`` of the usage hash), Redis's ``maxmemory`` and ``evicted_keys`` (``INFO``), and --
        when Redis evicted keys since the last look -- a reconciliation step first (see ``kvstore.redis_tier.usage``),
        so the figures count what Redis holds now. A missing, damaged or old-format usage hash is rebuilt with a
        recount (a warning, unless this tier never saw one: a new tier)."""

        def fn(client: Client) -> tuple[TierUsage, list[bytes]]:
            found: list[bytes] = []
            problem = self._counters(client)
            if isinstance(problem, str) or self._stale:
                if isinstance(problem, str) and problem != "stale" and (problem != "missing" or self._saw_registry):
                    why = "gone (evicted by Redis?)" if problem == "missing" else problem
                    log.warning("Redis tier %s: the usage counters at %s are %s: rebuilding them with a recount",
                                self.name, self._usage_key, why)
                found += self._recount(client, force=False)
            capacity, evicted = self._info(client)
            found += self._reconcile_if_due(client, evicted)
            counters = self._counters(client, stale_ok=True)
            if isinstance(counters, str):  # lost again at once (a Redis evicting everything): nothing counted
                counters = (0, 0)
            else:
                self._saw_registry = True
            return TierUsage(blocks=counters[0], bytes=counters[1], capacity_bytes=capacity), found

        usage, found = self._run("usage", fn)
        self._report(found)
        return usage

    def recount(self) -> TierUsage:
        """Rebuild the usage registry and counters from scratch from what Redis holds now (a SCAN, one GETRANGE
        per value and one EXISTS per chunked value). Values being written or deleted meanwhile settle within
        ``SETTLE_S``."""
        found = self._run("recount", lambda client: self._recount(client, force=True))
        self._report(found)
        return self.usage()
