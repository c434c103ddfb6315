"""``memory://`` URLs (``kvstore.tier_registry``): a ``MemoryTier``, or its page-locked form ``PinnedMemoryTier``.

Its own module so that ``memory_tier`` and ``pinned_memory`` (which subclasses it) import one way only.
"""

from __future__ import annotations

from typing import Any

from kvshelf.kvstore.eviction import DEFAULT_POLICY
from kvshelf.kvstore.memory_tier import MemoryTier
from kvshelf.kvstore.tier_registry import TierURL


def open_url(url: TierURL, *, capacity_bytes: int = 2 << 30, policy: str = DEFAULT_POLICY, pinned: bool = False,
             **options: Any) -> MemoryTier:
    """``memory://[?capacity=SIZE&policy=NAME&pinned=BOOL]`` (kvstore/tier_registry.py): a ``MemoryTier``, or with
    ``pinned`` a ``PinnedMemoryTier`` (values in page-locked memory where CUDA is present)."""
    if url.location:
        raise url.error("memory:// takes no host or path (only ?capacity=SIZE&policy=NAME&pinned=BOOL)")
    capacity = url.take_size("capacity", capacity_bytes)
    policy = url.take("policy", policy)
    pinned = url.take_bool("pinned", pinned)
    url.done(("capacity", "policy", "pinned"))
    if not capacity:
        raise url.error("capacity must be > 0 bytes")
    if pinned:  # torch: imported only for a pinned tier
        from kvshelf.kvstore.pinned_memory import PinnedMemoryTier

        return PinnedMemoryTier(capacity, policy=policy, **options)
    return MemoryTier(capacity, policy=policy, **options)
