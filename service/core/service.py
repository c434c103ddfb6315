"""``ServiceCore``: the one object every transport holds to put and get values under the service's rules."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from kvshelf.kvstore.encoding import BlockHeader
from kvshelf.kvstore.keys import ScopedKey
from kvshelf.kvstore.store import TieredStore
from kvshelf.service.core.admission import PutReservation
from kvshelf.service.core.commit import store_values
from kvshelf.service.core.limits import ServerLimits
from kvshelf.service.core.reads import Reader
from kvshelf.service.core.tenancy import check_keys, check_model, scope_keys
from kvshelf.service.core.verify import verify_value
from kvshelf.service.events import EventHub
from kvshelf.service.hot_prefixes import HotPrefixes
from kvshelf.service.usage import InflightBudget, NamespaceUsage


class ServiceCore:
    """The put and get rules of one server over ``store``, whatever transport carries the values: a put is
    admitted (``put_call``: budget and quota held before its bytes are buffered), each value verified as it is
    whole (``verify``), all stored once all are verified (``commit``); a get's values are ``served`` a few ahead of
    what is sent. The caller has authenticated the tenant (its ``namespace``)."""

    check_keys = staticmethod(check_keys)
    check_model = staticmethod(check_model)
    verify = staticmethod(verify_value)

    def __init__(self, store: TieredStore, limits: ServerLimits, events: EventHub, hot_prefixes: HotPrefixes) -> None:
        self.store, self.limits, self.events = store, limits, events
        self.usage = NamespaceUsage(store)
        self.inflight = InflightBudget(limits.inflight_bytes, limits.max_call_bytes)
        self.reader = Reader(store, hot_prefixes)

    def scope(self, namespace: str, keys: Sequence[bytes]) -> list[ScopedKey]:
        """``keys`` (checked) as ``namespace``'s tier keys."""
        return scope_keys(namespace, keys)

    def put_call(self, namespace: str) -> PutReservation:
        """The budget and quota holder of one put of ``namespace`` (``close`` it when the call ends)."""
        return PutReservation(self.limits, self.usage, self.inflight, namespace)

    def commit(self, call: PutReservation, values: Sequence[tuple[bytes, bytes | bytearray]],
               headers: Sequence[BlockHeader], pin: bool, active: Callable[[], bool]) -> tuple[int, int]:
        """Store a put's verified values; ``(received, stored)`` (``service.core.commit.store_values``)."""
        return store_values(self.store, self.events, call, values, headers, pin, active)

    def served(self, keys: Sequence[ScopedKey], namespace: str, fingerprint: str | None,
               tokens: Sequence[int]) -> Iterator[tuple[int, ScopedKey, bytes | None]]:
        """``(index, tier key, value or None)`` of the scoped ``keys`` in order (``Reader.served``)."""
        return self.reader.served(keys, namespace, fingerprint, tokens)

    def count_prefix(self, namespace: str, keys: Sequence[ScopedKey], depth: int,
                     tokens: Sequence[int] | None) -> None:
        """One reuse of the prefix of ``keys[:depth]``."""
        self.reader.count_prefix(namespace, keys, depth, tokens)

    def close(self) -> None:
        self.usage.close()
