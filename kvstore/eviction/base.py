"""The eviction-policy interface shared by every bounded tier (memory, LMDB).

A policy sees keys and sizes, never values. Its tier tells it what happened (a key stored, read, removed; a
prefix chain looked up) and asks it two questions: is a new key worth a place (``admit``), and which held key
goes next (``victim``). Pins stay with the tier: ``victim`` is told which keys it must not name.

Policies are not thread-safe: a tier calls its policy under its own lock. State is O(1) per held key, plus
bounded ghost lists of recently evicted keys where a policy keeps one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence, Set
from typing import ClassVar


class EvictionPolicy(ABC):
    """Which held key a bounded tier gives up next, and whether a new key is worth a place.

    The tier's calls, in order of a key's life: ``admit`` (new key) -> ``on_insert`` -> any number of ``on_hit``
    (read or re-written) -> ``on_remove`` (deleted, or evicted after ``victim`` named it). ``on_lookup`` reports
    a prefix lookup (``contains_many``): the keys of one chain in order, of which the leading ``held`` are held;
    it is how a policy learns a chain's structure (a block's parent is the key before it).
    """

    #: the name ``make_policy`` and ``--eviction-policy`` know it by
    name: ClassVar[str]

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes

    def admit(self, key: bytes, size: int) -> bool:
        """Whether a new ``key`` of ``size`` bytes should be stored at all (default: always)."""
        return True

    @abstractmethod
    def on_insert(self, key: bytes, size: int) -> None:
        """``key`` (not held before) was stored."""

    @abstractmethod
    def on_hit(self, key: bytes) -> None:
        """A held ``key`` was read, or written again."""

    @abstractmethod
    def on_remove(self, key: bytes) -> None:
        """A held ``key`` left the tier: deleted, or evicted after ``victim`` named it."""

    @abstractmethod
    def victim(self, pinned: Set[bytes]) -> bytes | None:
        """The held key to evict next, never one in ``pinned``; ``None`` when every held key is pinned.

        The tier evicts it and calls ``on_remove`` before asking again."""

    def on_lookup(self, keys: Sequence[bytes], held: int) -> None:
        """A prefix lookup of one chain (``keys`` in chain order; the leading ``held`` are held)."""
