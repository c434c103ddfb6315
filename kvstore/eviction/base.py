"""The eviction-policy interface shared by every bounded tier (memory, LMDB).

A policy sees keys and sizes, never values. Its tier tells it what happened (a key stored, read, removed; a
prefix chain looked up) and asks it two questions: is a new key worth a place (``admit``), and which held key
goes next (``victim``). Pins stay with the tier: ``victim`` is told which keys it must not name.

Policies are not thread-safe: a tier calls its policy under its own lock. State is O(1) per held key, plus
bounded ghost lists of recently evicted keys where a policy keeps one.

Memory. A tier that counts its process memory against its capacity (``MemoryTier``) asks the policy what its
state takes: ``entry_bytes`` (at most, per held key: the charge it adds to each entry), ``memory_bytes`` (all of
it now) and ``extra_bytes`` (the part that remembers keys the tier does not hold: ghost lists, learnt chain
links). It sets ``extra_limit`` (the policy then keeps ``extra_bytes`` under it, dropping its oldest such state
first) and may call ``trim_extra`` to shed more. A policy that keeps no state besides its held keys' entries
keeps the defaults (0, nothing to trim); ``memory_bytes`` and ``extra_bytes`` are O(1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence, Set
from typing import ClassVar


class EvictionPolicy(ABC):
    """Which held key a bounded tier gives up next, and whether a new key is worth a place.

    The tier's calls, in order of a key's life: ``admit`` (new key) -> ``on_insert`` -> any number of ``on_hit``
    (read or re-written) -> ``on_remove`` (deleted, or evicted after ``victim`` named it). ``on_lookup`` reports
    a prefix lookup (``prefix_run_length``): the keys of one chain in order, of which the leading ``held`` are held;
    it is how a policy learns a chain's structure (a block's parent is the key before it).
    """

    #: the name ``make_policy`` and ``--eviction-policy`` know it by
    name: ClassVar[str]

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        #: keep ``extra_bytes()`` at most this (None: bounded only by the policy's own rules, in sizes)
        self.extra_limit: int | None = None

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

    # -- memory (see the module docstring) --------------------------------------------------------------------

    def entry_bytes(self, key_len: int) -> int:
        """The most memory this policy keeps per held key of ``key_len`` bytes (the key object, which the tier
        holds, not counted)."""
        return 0

    def memory_bytes(self) -> int:
        """The memory all of this policy's state takes now (an upper bound where objects may be shared)."""
        return 0

    def extra_bytes(self) -> int:
        """The part of ``memory_bytes`` that remembers keys not held (ghost lists, learnt links), which
        ``trim_extra`` can drop."""
        return 0

    def trim_extra(self, limit: int) -> None:
        """Drop the oldest state about keys not held until ``extra_bytes()`` is at most ``limit`` (or none is
        left: emptied containers keep their tables)."""
        over = self.extra_bytes() - limit
        if over > 0:
            self._shed(over)

    def _shed(self, over: int) -> int:
        """Drop the oldest state about keys not held until its objects freed ``over`` bytes (tables do not shrink
        when entries leave them, so nothing else changes ``extra_bytes``); return what is still over (> 0 when
        nothing is left to drop). Policies that keep such state override it."""
        return over

    def _keep_extra_limit(self) -> None:
        """Called by a policy after its state about keys not held grew."""
        if self.extra_limit is not None:
            self.trim_extra(self.extra_limit)
