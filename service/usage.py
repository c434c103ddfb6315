"""What each namespace holds and has in flight: the per-tier byte counts behind the quota, and the in-flight budget
of buffered put bytes (server-wide, and a per-tenant share)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import grpc

from kvshelf.kvstore.errors import TierUnavailableError
from kvshelf.kvstore.keys import SCOPED_KEY_BYTES, is_scoped, scope_of
from kvshelf.kvstore.stats import StoreEvent
from kvshelf.kvstore.store import TieredStore
from kvshelf.service.status import fail

#: bytes per tier: what a put will store in each tier, or what it has reserved there
TierBytes = dict[str, int]


class NamespaceUsage:
    """Bytes and blocks each namespace holds per tier, from a one-time scan per namespace plus store events.

    Used for the per-namespace quota and per-namespace stats. Puts in flight are reserved per tier so concurrent
    puts cannot together overshoot a quota; an overwrite counts what it adds to the size held now.
    """

    def __init__(self, store: TieredStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._sizes: dict[bytes, dict[str, dict[bytes, int]]] = {}  # tag -> tier -> tier key -> bytes
        self._totals: dict[bytes, dict[str, int]] = {}
        self._pending: dict[bytes, TierBytes] = {}
        self._unsubscribe = store.subscribe(self._on_event)

    def _scan(self, tag: bytes) -> None:
        sizes: dict[str, dict[bytes, int]] = {}
        for keys, spec in ((tier_keys(spec.tier, tag), spec) for spec in self._store.specs):
            held: dict[bytes, int] = {}
            for start in range(0, len(keys), 64):
                batch = keys[start : start + 64]
                try:
                    values = spec.tier.get_many(batch)
                except TierUnavailableError:
                    break
                held.update((k, len(v)) for k, v in zip(batch, values, strict=True) if v is not None)
            sizes[spec.tier.name] = held
        self._sizes[tag] = sizes
        self._totals[tag] = {tier: sum(held.values()) for tier, held in sizes.items()}

    def _ensure(self, tag: bytes) -> None:
        if tag not in self._sizes:
            self._scan(tag)

    def _on_event(self, event: StoreEvent) -> None:
        if not is_scoped(event.key):
            return
        tag = scope_of(event.key)
        with self._lock:
            if tag not in self._sizes:
                return  # the namespace's first use scans the tiers
            held = self._sizes[tag].setdefault(event.tier, {})
            totals = self._totals[tag]
            old = held.pop(event.key, 0)
            totals[event.tier] = totals.get(event.tier, 0) - old
            if event.kind == "stored":
                held[event.key] = event.nbytes
                totals[event.tier] += event.nbytes

    def usage(self, tag: bytes) -> dict[str, tuple[int, int]]:
        """``tier -> (blocks, bytes)`` the namespace of ``tag`` holds."""
        with self._lock:
            self._ensure(tag)
            return {tier: (len(held), self._totals[tag].get(tier, 0)) for tier, held in self._sizes[tag].items()}

    def held_bytes(self, tag: bytes) -> int:
        """Bytes the namespace holds in the tier holding the most of it."""
        with self._lock:
            self._ensure(tag)
            return max(self._totals[tag].values(), default=0)

    def reserve(self, tag: bytes, namespace: str, items: Sequence[tuple[bytes, int | TierBytes]], quota: int,
                *, replacing: TierBytes | None = None) -> TierBytes:
        """Reserve room under ``quota`` for ``(tier key, size)`` puts, ``size`` in bytes per tier (or one size for
        every tier the store writes); return the reservation per tier, for ``release``.

        A key already held counts what it adds: ``max(0, new size - size held now)`` in each tier. The quota
        holds in every tier: held + reserved by puts in flight + this put. ``replacing``: a reservation of the
        caller's that this one replaces (released if this one succeeds). Raises ``_Abort(RESOURCE_EXHAUSTED)``
        naming the quota when over it (``replacing`` then stays reserved).
        """
        tiers = [spec.tier.name for spec in self._store.write_targets()]
        with self._lock:
            self._ensure(tag)
            sizes = self._sizes[tag]
            per_key: dict[bytes, TierBytes] = {}
            for key, size in items:
                new = {t: size for t in tiers} if isinstance(size, int) else size
                old = per_key.setdefault(key, {})
                for tier, n in new.items():
                    old[tier] = max(old.get(tier, 0), n)
            adding: TierBytes = {}
            for key, new in per_key.items():
                for tier, n in new.items():
                    adding[tier] = adding.get(tier, 0) + max(0, n - sizes.get(tier, {}).get(key, 0))
            pending = dict(self._pending.get(tag, {}))
            for tier, n in (replacing or {}).items():
                pending[tier] = pending.get(tier, 0) - n
            totals = self._totals[tag]
            for tier, n in adding.items():
                held, waiting = totals.get(tier, 0), pending.get(tier, 0)
                if held + waiting + n > quota:
                    fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"namespace {namespace!r} quota of {quota} bytes exceeded: it holds {held} bytes"
                          f"{f' (+{waiting} being written)' if waiting else ''} and this put adds {n}"
                          f"{f' in tier {tier}' if len(tiers) > 1 else ''}")
            for tier, n in adding.items():
                pending[tier] = pending.get(tier, 0) + n
            self._pending[tag] = pending
            return adding

    def release(self, tag: bytes, amount: TierBytes) -> None:
        with self._lock:
            pending = self._pending.setdefault(tag, {})
            for tier, n in amount.items():
                pending[tier] = pending.get(tier, 0) - n

    def close(self) -> None:
        self._unsubscribe()


class InflightBudget:
    """Put bytes buffered at once: at most ``total`` over all tenants and ``per_tenant`` for one tenant's puts
    together. A put that cannot get budget is refused at once (RESOURCE_EXHAUSTED naming the budget): never a
    wait that a slow or hostile tenant could make last forever."""

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total, self.per_tenant = total, per_tenant
        self._lock = threading.Lock()
        self._used = 0
        self._by_tenant: dict[bytes, int] = {}

    def take(self, tag: bytes, namespace: str, nbytes: int) -> None:
        with self._lock:
            mine = self._by_tenant.get(tag, 0)
            if mine + nbytes > self.per_tenant:
                fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"namespace {namespace!r}: its puts in flight may buffer at most {self.per_tenant} bytes "
                      f"together (the per-call limit); {mine} are buffered and this put needs {nbytes} more")
            if self._used + nbytes > self.total:
                fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"the server's in-flight put budget of {self.total} bytes is in use ({self._used} buffered); "
                      f"retry later")
            self._used += nbytes
            self._by_tenant[tag] = mine + nbytes

    def give(self, tag: bytes, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes
            left = self._by_tenant.get(tag, 0) - nbytes
            if left > 0:
                self._by_tenant[tag] = left
            else:
                self._by_tenant.pop(tag, None)

    def used(self) -> int:
        with self._lock:
            return self._used


def tier_keys(tier: Any, tag: bytes) -> list[bytes]:
    """The tier keys of one namespace (tag + 16-byte key) in ``tier``; [] if it cannot list or is unreachable."""
    try:
        return tier.keys_with_prefix(tag, SCOPED_KEY_BYTES)  # Redis: a SCAN matching the tag
    except (NotImplementedError, TierUnavailableError):
        return []


def add_tier_bytes(total: TierBytes, new: TierBytes, old: TierBytes) -> None:
    """``total += new - old``, per tier."""
    for tier in set(new) | set(old):
        total[tier] = total.get(tier, 0) + new.get(tier, 0) - old.get(tier, 0)
