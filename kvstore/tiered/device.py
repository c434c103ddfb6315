"""The GPU tier as a layer above the tier stack: decoded blocks on one torch device (``kvstore.device_tier``).

Every put writes through to it, reads and lookups ask it first, and ``offer`` fills it with blocks a load brought
up from below. It is a cache of decoded tensors: never pinned, evicted blocks dropped (the tiers below hold them),
no store events; its hits, misses and writes are counted under its name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from kvshelf.kvstore.block import KVBlock, PreparedBlock
from kvshelf.kvstore.codec import BlockShape, DecodedPayload
from kvshelf.kvstore.device_tier import DeviceBlock, DeviceTier
from kvshelf.kvstore.keys import TierKey
from kvshelf.kvstore.stats import TIER_STATS_METRICS, Metric, TierStats
from kvshelf.kvstore.tiered.meter import StoreMeter

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def as_kv_block(block: DeviceBlock, *, copy: bool) -> KVBlock:
    """A held block as a ``KVBlock``: the tier's own tensors (on its device; never write to them) unless ``copy``."""
    if not copy:
        return block.as_block()
    return KVBlock(block.keys.clone(), block.values.clone(), block.token_ids, block.start_pos,
                   block.fingerprint, block.namespace)


def as_prepared(block: DeviceBlock) -> PreparedBlock:
    """A held block as a ``PreparedBlock`` whose payload writes into a cache by a device-to-device copy."""
    return PreparedBlock(payload=DecodedPayload(block.keys, block.values),
                         shape=BlockShape(block.keys.shape, block.values.shape[3]), dtype=block.keys.dtype,
                         token_ids=block.token_ids, start_pos=block.start_pos,
                         fingerprint=block.fingerprint, namespace=block.namespace)


class DeviceLayer:
    """``tier`` counted by ``meter``; what adapters use to offer a load's blocks (``device``, ``holds``, ``offer``)."""

    def __init__(self, tier: DeviceTier, meter: StoreMeter) -> None:
        self.tier = tier
        self.meter = meter
        tier.set_eviction_callback(
            lambda _, b: meter.count(tier.name, b.namespace, b.fingerprint, Metric.EVICTIONS))

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def device(self) -> torch.device:
        """The device its blocks are on."""
        return self.tier.device

    def holds(self, keys: Sequence[TierKey]) -> list[bool]:
        """Per key: is it held (not counted, the policy hears nothing)."""
        return self.tier.holds(keys)

    def prefix_run_length(self, keys: Sequence[TierKey]) -> int:
        return self.tier.prefix_run_length(keys)

    def offer(self, entries: Sequence[tuple[TierKey, KVBlock]]) -> int:
        """Store ``(key, block)`` pairs (their tensors are copied); return how many it took, each counted."""
        if not entries:
            return 0
        stored = self.tier.put_many(entries)
        if stored:
            held = self.tier.get_many([k for k, _ in entries]) if stored < len(entries) else None
            for i, (_, block) in enumerate(entries):
                if held is None or held[i] is not None:
                    self.meter.count(self.name, block.namespace, block.fingerprint, Metric.BLOCKS_WRITTEN)
                    self.meter.count(self.name, block.namespace, block.fingerprint, Metric.BYTES_WRITTEN,
                                     block.nbytes)
        return stored

    def read(self, keys: Sequence[TierKey], model: str, namespace: str,
             convert: Callable[[DeviceBlock], T]) -> tuple[list[T | None], list[int]]:
        """The held blocks of ``model`` and ``namespace`` among ``keys``, ``convert``ed, and the indices of the keys
        it misses (a block of another model or namespace is a counted ``foreign`` miss); hits, misses and bytes
        counted under its name."""
        result: list[T | None] = [None] * len(keys)
        below: list[int] = []
        for j, block in enumerate(self.tier.get_many(keys)):
            if block is not None and (block.fingerprint != model or block.namespace != namespace):
                self.meter.count(self.name, namespace, model, Metric.FOREIGN)
                block = None
            if block is None:
                below.append(j)
                continue
            result[j] = convert(block)
            self.meter.count(self.name, namespace, model, Metric.BYTES_READ, block.nbytes)
        hits = len(keys) - len(below)
        self.meter.count(self.name, namespace, model, Metric.HITS, hits)
        self.meter.count(self.name, namespace, model, Metric.MISSES, len(below))
        return result, below

    def delete(self, keys: Sequence[TierKey]) -> set[bytes]:
        """Remove ``keys``; return those it held."""
        return {k for k in keys if self.tier.delete([k])}

    def delete_prefix(self, prefix: bytes, length: int | None) -> list[bytes]:
        return self.tier.delete_prefix(prefix, length)

    def stats(self) -> TierStats:
        usage = self.tier.usage()
        return TierStats(
            name=self.name, codec=f"decoded on {self.tier.device}", available=True, damaged=False,
            blocks=usage.blocks, bytes=usage.bytes, capacity_bytes=usage.capacity_bytes,
            **{m.value: self.meter.counters.total(m, tier=self.name) for m in TIER_STATS_METRICS},
        )

    def close(self) -> None:
        self.tier.close()
