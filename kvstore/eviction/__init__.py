"""Eviction policies for bounded tiers, by name (``make_policy``): one interface (``EvictionPolicy``), each
policy in its own module, judged by prefix-hit rate against Belady's OPT on real traces (``kvshelf replay``)."""

from __future__ import annotations

from collections.abc import Callable

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.eviction.arc import ARCPolicy
from kvshelf.kvstore.eviction.base import EvictionPolicy
from kvshelf.kvstore.eviction.lru import LRUPolicy
from kvshelf.kvstore.eviction.prefix import PrefixAwarePolicy
from kvshelf.kvstore.eviction.s3fifo import S3FIFOPolicy

#: name -> factory taking the tier's capacity in bytes
POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    S3FIFOPolicy.name: S3FIFOPolicy,
    ARCPolicy.name: ARCPolicy,
    PrefixAwarePolicy.name: PrefixAwarePolicy,
}
#: the policy of ``open_embedded_store`` and ``kvshelf serve`` when none is named
DEFAULT_POLICY = "prefix"


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    """A new policy ``name`` for a tier of ``capacity_bytes``; ``ConfigError`` naming the known ones otherwise."""
    factory = POLICIES.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ConfigError(f"unknown eviction policy {name!r}; known policies: {', '.join(sorted(POLICIES))}")
    return factory(capacity_bytes)


__all__ = [
    "DEFAULT_POLICY", "POLICIES", "ARCPolicy", "EvictionPolicy", "LRUPolicy", "PrefixAwarePolicy", "S3FIFOPolicy",
    "make_policy",
]
