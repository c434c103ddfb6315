"""``RedisTier``: its settings, ``from_url``, ``healthy`` and ``close``; the rest comes from the mixins of this
package (connection, key layout, reads, writes, delete, accounting)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvshelf.kvstore.errors import ConfigError, TierUnavailableError
from kvshelf.kvstore.redis_tier.accounting import Accounting
from kvshelf.kvstore.redis_tier.connection import _UNAVAILABLE, Client, Connection, _Breaker, connector
from kvshelf.kvstore.redis_tier.delete import Delete
from kvshelf.kvstore.redis_tier.layout import (
    CLEAR_SCAN_COUNT,
    DEFAULT_MAX_VALUE_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    KeyLayout,
    MiB,
)
from kvshelf.kvstore.redis_tier.reads import Reads
from kvshelf.kvstore.redis_tier.reconcile import Reconciliation
from kvshelf.kvstore.redis_tier.usage import RECONCILE_INTERVAL_S
from kvshelf.kvstore.redis_tier.writes import Writes
from kvshelf.kvstore.tier import EvictionCallback, Tier

if TYPE_CHECKING:
    from kvshelf.kvstore.tier_registry import TierURL


class RedisTier(Reads, Writes, Delete, Accounting, Reconciliation, KeyLayout, Connection, Tier):
    """Encoded blocks in Redis (standalone or Cluster), chunked, under one hash tag per value.

    Build it with :meth:`from_url`; ``connect`` is any zero-argument function returning a redis-py client
    (``redis.Redis`` or ``redis.cluster.RedisCluster``, with ``decode_responses=False``, and bounded socket
    timeouts); it is called on first use, and again after a failed attempt. ``max_value_bytes``: the largest value
    stored (larger ones are not: ``put_many`` counts them out) and read (a manifest declaring more is damaged).
    """

    def __init__(
        self,
        connect: Callable[[], Client],
        *,
        name: str = "redis",
        prefix: str = "kvshelf:",
        chunk_bytes: int = 4 * MiB,
        where: str = "redis",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        reconcile_interval_s: float = RECONCILE_INTERVAL_S,
    ) -> None:
        if isinstance(reconcile_interval_s, bool) or not isinstance(reconcile_interval_s, int | float) or not (
                reconcile_interval_s >= 0):
            raise ConfigError(f"Redis reconcile_interval_s must be a number of seconds >= 0, "
                              f"got {reconcile_interval_s!r}")
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
            raise ConfigError(f"Redis chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError(f"Redis chunk_bytes must be between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES} bytes, "
                              f"got {chunk_bytes}")
        if not isinstance(max_value_bytes, int) or isinstance(max_value_bytes, bool) or max_value_bytes <= 0:
            raise ConfigError(f"Redis max_value_bytes must be a positive number of bytes, got {max_value_bytes!r}")
        if "{" in prefix or "}" in prefix:
            raise ConfigError(f"Redis key prefix must not contain '{{' or '}}' (they delimit hash tags): {prefix!r}")
        self.name = name
        self.prefix = prefix
        self.chunk_bytes = chunk_bytes
        self.max_value_bytes = max_value_bytes
        self.where = where
        self._connect = connect
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._usage_key = f"{{{prefix}#usage}}"
        self._breaker = _Breaker(name)
        self.reconcile_interval_s = float(reconcile_interval_s)
        self._on_evict: EvictionCallback | None = None
        self._flagged = True  # whether Redis takes script flags (7+); cleared on the first refusal
        self._reconcile_lock = threading.Lock()
        self._cursor = 0  # the registry HSCAN cursor of a reconciliation pass in progress (0: none)
        self._seen_evicted: int | None = None  # Redis's evicted_keys when the last pass started
        self._next_check = 0.0  # monotonic time of the next check a put may make
        self._saw_registry = False  # whether this tier has seen its registry (a lost one is then worth a warning)
        self._stale = False  # an accounting change was refused: the next usage() recounts
        self._refused_since = 0  # writes Redis refused since the last warning
        self._next_refused_warning = 0.0
        self._next_blind = 0.0  # INFO unreadable: monotonic time of the next pass usage() may run
        self._pass_evicted: int | None = None  # evicted_keys when the pass under way began
        #: grows with each recount: values Redis evicted while the registry was lost (or before a recount) were
        #: never reported one by one, so a store holding pins checks them again (``TieredStore.stats``)
        self.loss_epoch = 0
        #: the COUNT hint of the SCANs that find a prefix's keys (a larger one: fewer calls, each blocking longer)
        self.clear_scan_count = CLEAR_SCAN_COUNT

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        name: str = "redis",
        prefix: str = "kvshelf:",
        chunk_bytes: int = 4 * MiB,
        socket_timeout: float = 1.0,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        reconcile_interval_s: float = RECONCILE_INTERVAL_S,
    ) -> RedisTier:
        """A tier on ``redis://[:password@]host:port/db`` (standalone) or ``redis+cluster://host:port`` (a seed
        node of a Redis Cluster). Nothing is connected until first use. ``socket_timeout``: seconds a connect or a
        read may take before Redis counts as unreachable (a timed-out command is not retried)."""
        if isinstance(socket_timeout, bool) or not isinstance(socket_timeout, int | float) or not socket_timeout > 0:
            raise ConfigError(f"Redis socket_timeout must be a positive number of seconds, got {socket_timeout!r}")
        connect, where = connector(url, socket_timeout)
        return cls(connect, name=name, prefix=prefix, chunk_bytes=chunk_bytes, where=where,
                   max_value_bytes=max_value_bytes, reconcile_interval_s=reconcile_interval_s)

    def healthy(self) -> bool:
        """Whether Redis answers a PING now (tried even while the breaker is open; its outcome opens or closes
        the breaker)."""
        try:
            return bool(self._run("ping", lambda client: client.ping(), probe=True))
        except TierUnavailableError:
            return False

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*_UNAVAILABLE):
                client.close()


def open_url(url: TierURL, **options: Any) -> RedisTier:
    """``redis://[:password@]host:port/db``, ``rediss://`` (TLS), ``redis+cluster://host:port`` (a seed node of a
    Redis Cluster) or ``rediss+cluster://`` (kvstore/tier_registry.py): a ``RedisTier``; the query may carry
    only the TLS parameters of ``connection.TLS_PARAMETERS`` (``rediss://``), which go to redis-py.
    ``options``: ``RedisTier.from_url``'s keywords."""
    if not url.location.split("/", 1)[0].rsplit("@", 1)[-1]:
        raise url.error("a Redis URL needs a host (redis://HOST:PORT/DB)")
    return RedisTier.from_url(url.url, **options)
