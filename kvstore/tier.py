"""The ``Tier`` interface: one storage level holding encoded blocks by key, with batch operations."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the key types only: importing the interface loads no numpy
    from kvshelf.kvstore.keys import TierKey

#: Called with ``(key, value)`` for every value a tier evicts to make room.
EvictionCallback = Callable[[bytes, bytes], None]


@dataclass(frozen=True)
class TierUsage:
    """What a tier holds now."""

    blocks: int
    bytes: int
    capacity_bytes: int | None  # None: bounded only by the medium


class Tier(ABC):
    """A key -> encoded-block store. Implementations are thread-safe.

    Keys are tier keys (``kvstore.keys.TierKey``: a block key, or a scoped one); ``delete``, ``pin`` and ``unpin``
    also take keys as a tier gave them back (listings, evictions), plain ``bytes``.

    Values are the self-describing byte strings of ``kvstore.encoding``; a tier never interprets them.
    """

    name: str

    #: True when every value this tier returns is its own immutable copy of a value its store checked (checksum,
    #: header) before writing it, and no one else can write to: a store's read then checks the header and whose
    #: block it is, but does not recompute the checksum (a process-memory tier; never a medium that can be damaged
    #: or shared: disk, Redis). Write such a tier through its store only.
    holds_checked_copies: bool = False

    @abstractmethod
    def get_many(self, keys: Sequence[TierKey]) -> list[bytes | None]:
        """The values of ``keys`` in order, ``None`` where absent."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[TierKey, bytes]]) -> int:
        """Store ``(key, value)`` pairs (atomically where the medium allows); return how many were stored."""

    @abstractmethod
    def prefix_run_length(self, keys: Sequence[TierKey]) -> int:
        """Length of the leading run of ``keys`` that this tier holds (a cached-prefix length in blocks)."""

    @abstractmethod
    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove ``keys``; return how many were present."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def peek_many(self, keys: Sequence[TierKey]) -> list[bytes | None]:
        """``get_many`` that the eviction policy does not hear of (diagnostics: ``adapters.miss`` reads headers
        with it). This default is ``get_many``; tiers whose policy counts reads override it."""
        return self.get_many(keys)

    def keys(self) -> list[bytes]:
        """Every key held (for admin tools and tests; may be slow on large tiers)."""
        raise NotImplementedError(f"tier {self.name} cannot list its keys")

    def keys_with_prefix(self, prefix: bytes, length: int | None = None) -> list[bytes]:
        """Every key held starting with ``prefix``, of ``length`` bytes when given. This default lists every key;
        tiers that find a prefix's keys cheaper override it."""
        return [key for key in self.keys() if key.startswith(prefix) and (length is None or len(key) == length)]

    def delete_prefix(self, prefix: bytes, length: int | None = None) -> list[bytes]:
        """Remove every key starting with ``prefix`` (a namespace's scope tag), of ``length`` bytes when given;
        return the keys removed. This default lists every key; tiers that find a prefix's keys cheaper override it."""
        held = self.keys_with_prefix(prefix, length)
        self.delete(held)
        return held

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Tiers that evict report each evicted value here (the store counts it or writes it back)."""

    def pin(self, keys: Iterable[bytes]) -> None:
        """Pinned keys are never evicted (no-op for tiers that never evict)."""

    def unpin(self, keys: Iterable[bytes]) -> None: ...

    def close(self) -> None: ...
