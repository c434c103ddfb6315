"""``BlockStore``: the one store interface every consumer (the adapters, the benchmarks, the demo) types against.

Two implementations follow it with the same signatures, defaults and return types: ``kvstore.store.TieredStore``
(embedded: tiers in this process) and ``service.client.RemoteStore`` (a kvshelf server over gRPC). A test checks
the signatures against this class, and one behaviour suite (``tests/service/test_blockstore_contract.py``) runs
against both.

The common rules:

* Keys are 16-byte block keys (``kvstore.keys``); another length raises ``ConfigError`` before anything is done.
  (``TieredStore`` also takes the service's scoped tier keys, a namespace tag before the block key.)
* Every store has a ``namespace`` (default ``"default"``). Methods that read take ``namespace: str | None = None``:
  ``None`` means the store's own. Only blocks of that namespace (and of ``fingerprint``, where given) are served;
  any other block is a miss, never returned. Blocks are written under the namespace their header carries.
* Lists answer ``keys`` in order, ``None`` for a miss; an empty input is an empty answer (or 0), never an error.
* ``delete``, ``pin`` and ``unpin`` return how many distinct keys they acted on: removed (held somewhere),
  pinned (held: absent keys are never pinned; ``put_many(..., pin=True)`` pins as it writes), unpinned (were
  pinned). Pinned blocks are never evicted.
* ``stats()`` is a JSON-ready dict with at least ``STATS_KEYS``, each of its ``"tiers"`` with ``TIER_STATS_KEYS``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

from kvshelf.kvstore.stats import StoreStats, TierStats, field_names  # no torch either

if TYPE_CHECKING:  # annotations only: importing the interface loads no torch
    import torch

    from kvshelf.kvstore.block import KVBlock, PreparedBlock
    from kvshelf.kvstore.keys import TierKey

DEFAULT_NAMESPACE = "default"
#: the model name lookups are counted under when none is given
UNKNOWN_MODEL = "?"
#: keys every store's ``stats()`` has: the fields of ``kvstore.stats.StoreStats``, whose ``as_dict()`` an embedded
#: store returns (a store may add more: the server adds its usage and health)
STATS_KEYS = field_names(StoreStats)
#: keys of every entry of ``stats()["tiers"]``: the fields of ``kvstore.stats.TierStats`` but ``damaged`` (which a
#: server's per-namespace view leaves out)
TIER_STATS_KEYS = field_names(TierStats) - {"damaged"}
#: the methods of the interface (what the signature test compares)
METHODS = (
    "put_many", "put_encoded_many", "get_many", "get_prepared_many", "get_encoded_many", "lookup_prefix",
    "held", "delete", "pin", "unpin", "stats", "close", "__enter__", "__exit__",
)


@runtime_checkable
class BlockStore(Protocol):
    """Blocks by key: write, read (decoded, prepared or encoded), look up cached prefixes, manage, count."""

    #: the namespace reads default to (``namespace=None``)
    namespace: str

    # -- writes ---------------------------------------------------------------------------------------

    def put_many(self, entries: Sequence[tuple[bytes, KVBlock]], *, pin: bool = False) -> int:
        """Store ``(key, block)`` pairs (pinned with ``pin``); return how many the first tier accepted."""
        ...

    def put_encoded_many(self, items: Sequence[tuple[bytes, bytes]], *, pin: bool = False) -> int:
        """Store already-encoded ``(key, value)`` pairs, each verified first (``CorruptBlockError`` /
        ``ForeignBlockError``, or the server's refusal, when one is damaged or another key's: nothing stored)."""
        ...

    # -- reads ----------------------------------------------------------------------------------------

    def get_many(
        self, keys: Sequence[bytes], *, fingerprint: str, namespace: str | None = None, copy: bool = True,
        tokens: Sequence[int] | None = None,
    ) -> list[KVBlock | None]:
        """Decoded blocks of ``keys`` (``None``: a miss, or a block of another model or namespace).

        ``copy=False``: tensors may be read-only views of stored bytes. ``tokens``: tokens per key, to count the
        retrieve hit rate in tokens as well as in blocks.
        """
        ...

    def get_prepared_many(
        self, keys: Sequence[bytes], *, fingerprint: str, namespace: str | None = None,
        tokens: Sequence[int] | None = None,
    ) -> list[PreparedBlock | None]:
        """Like ``get_many``, but checked and parsed only: ``adapters.cache_bridge.cache_from_prepared`` decodes
        them straight into a cache."""
        ...

    def get_encoded_many(
        self, keys: Sequence[bytes], *, fingerprint: str | None = None, namespace: str | None = None,
        tokens: Sequence[int] | None = None,
    ) -> list[bytes | None]:
        """Encoded values of ``keys``, checked by the store (checksum, key, namespace, and ``fingerprint`` when
        given) but not decoded."""
        ...

    def lookup_prefix(
        self, keys: Sequence[bytes], *, namespace: str | None = None, model: str = UNKNOWN_MODEL,
        tokens: Sequence[int] | None = None,
    ) -> int:
        """How many of ``keys``, in order, are held (the cached prefix, in blocks). ``namespace`` and ``model``
        name the counters (a remote store also looks in that namespace only); ``tokens`` as in ``get_many``."""
        ...

    def held(self, keys: Iterable[bytes], *, namespace: str | None = None) -> list[bool]:
        """Per key: is it held. Not counted as a lookup (probes, admin tools): the hit rates stay the users'.
        ``namespace``: where a remote store looks (an embedded store's keys already name their namespace)."""
        ...

    # -- management -----------------------------------------------------------------------------------

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove ``keys`` (and their pins); return how many were held."""
        ...

    def pin(self, keys: Iterable[bytes]) -> int:
        """Pin the held ones of ``keys`` (never evicted); return how many were pinned."""
        ...

    def unpin(self, keys: Iterable[bytes]) -> int:
        """Unpin ``keys``; return how many were pinned."""
        ...

    def stats(self) -> dict[str, Any]:
        """Usage and counters, JSON-ready (see ``STATS_KEYS``)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class DeviceCache(Protocol):
    """Decoded blocks on one torch device above a store's tiers (``TieredStore.device_cache``, the GPU tier's
    layer ``kvstore.tiered.device.DeviceLayer``): a load that brought blocks up from a lower tier offers them here, so
    the next load of that prefix is a copy within the device."""

    @property
    def device(self) -> torch.device:
        """The device its blocks are on (offer only tensors already there)."""
        ...

    def holds(self, keys: Sequence[TierKey]) -> list[bool]:
        """Per key: is it held (not counted as a lookup)."""
        ...

    def offer(self, entries: Sequence[tuple[TierKey, KVBlock]]) -> int:
        """Store ``(key, block)`` pairs (tensors ``[layers, kv_heads, tokens, head_dim]``, copied); return how many
        it took."""
        ...


def device_cache_of(store: BlockStore | None) -> DeviceCache | None:
    """``store``'s device cache: a ``TieredStore``'s with a GPU tier; None for one without, or for a store that has
    none (``RemoteStore``)."""
    cache = getattr(store, "device_cache", None)
    return cache if isinstance(cache, DeviceCache) else None


def namespace_of(store: BlockStore | None, namespace: str | None) -> str:
    """The namespace a consumer works in: ``namespace`` when given, else the store's (a ``RemoteStore`` with a
    token lives in its token's namespace), else ``"default"``."""
    if namespace is not None:
        return namespace
    return store.namespace if store is not None else DEFAULT_NAMESPACE
