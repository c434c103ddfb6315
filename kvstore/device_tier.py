"""The GPU tier: decoded blocks held in device memory, ready for a cache without a transfer or a decode.

The other tiers hold encoded bytes (``kvstore.tier.Tier``); this one holds each block's keys and values as tensors
on one device (``[layers, kv_heads, tokens, head_dim]``, the block's dtype), so a hit is a device-to-device copy
into the cache being built. It sits above the CPU tier of a ``TieredStore`` (``TieredStore(device_tier=...)``,
``open_embedded_store(gpu_bytes=...)``) as a layer (``kvstore.tiered.device``): puts write through to it, and
blocks that a load brought up from a lower tier are offered to it (``TieredStore.device_cache``). Its capacity is
in bytes of tensor data and its evictions follow the same policies as the other tiers (``kvstore.eviction``). It
is a cache: an evicted block is dropped (the tiers below hold it), nothing is written down and nothing is pinned
in it.

The code is the same on every device: CI runs it with ``device="cpu"``; ``open_embedded_store`` puts it on CUDA.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from kvshelf.kvstore.keys import TierKey
from kvshelf.kvstore.tier import TierUsage

#: the tier's name in stats, counters and store events (vLLM's KV events name its medium ``GPU``)
GPU_TIER_NAME = "gpu"


@dataclass(frozen=True)
class DeviceBlock:
    """One block held on the device: ``keys`` ``[layers, kv_heads, tokens, head_dim]`` and ``values`` (head dim
    may differ: MLA), with the owner checks of an encoded block's header (``fingerprint``, ``namespace``)."""

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: tuple[int, ...]
    start_pos: int
    fingerprint: str
    namespace: str

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def as_block(self) -> KVBlock:
        """A ``KVBlock`` whose tensors are this block's own (on the device; never write to them)."""
        return KVBlock(self.keys, self.values, self.token_ids, self.start_pos, self.fingerprint, self.namespace)


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``; ``ConfigError`` for a CUDA device this machine does not have."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"not a torch device: {device!r} ({exc})") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: CUDA is not available on this machine (torch "
                              f"{torch.__version__}); use a CPU store or a machine with a GPU")
        index = resolved.index if resolved.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        resolved = torch.device("cuda", index)
    return resolved


class DeviceTier:
    """Blocks as tensors on ``device`` within ``capacity_bytes`` of tensor data; ``policy`` picks what to evict.

    A block larger than the capacity, or one the policy does not admit, is not stored. Thread-safe.
    """

    def __init__(self, capacity_bytes: int, device: torch.device | str = "cuda", *,
                 policy: str | EvictionPolicy = DEFAULT_POLICY, name: str = GPU_TIER_NAME) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"GPU tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.name = name
        self.device = resolve_device(device)
        self.capacity_bytes = capacity_bytes
        self.policy = make_policy(policy, capacity_bytes) if isinstance(policy, str) else policy
        self._data: dict[bytes, DeviceBlock] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._on_evict: Callable[[bytes, DeviceBlock], None] | None = None

    def set_eviction_callback(self, callback: Callable[[bytes, DeviceBlock], None] | None) -> None:
        """``callback(key, block)`` hears of every block evicted to make room (called outside the tier's lock)."""
        self._on_evict = callback

    def get_many(self, keys: Sequence[TierKey]) -> list[DeviceBlock | None]:
        with self._lock:
            out = [self._data.get(key) for key in keys]
            for key, block in zip(keys, out, strict=True):
                if block is not None:
                    self.policy.on_hit(key)
        return out

    def put_many(self, items: Sequence[tuple[TierKey, KVBlock]]) -> int:
        """Copy each ``(key, block)`` to the device (from pinned memory without blocking; a block already on the
        device is cloned: the tier owns its tensors); return how many were stored."""
        stored = 0
        evicted: list[tuple[bytes, DeviceBlock]] = []
        for key, block in items:
            charge = block.nbytes
            if charge > self.capacity_bytes:
                continue
            with self._lock:
                held = key in self._data
                if not held and not self.policy.admit(key, charge):
                    continue
            entry = DeviceBlock(self._own(block.keys), self._own(block.values), tuple(block.token_ids),
                                block.start_pos, block.fingerprint, block.namespace)
            with self._lock:
                if key in self._data:
                    self._remove(key)
                if not self._make_room(charge, evicted):
                    continue
                self._data[key] = entry
                self._bytes += charge
                self.policy.on_insert(key, charge)
                stored += 1
        if self._on_evict is not None:
            for key, block in evicted:
                self._on_evict(key, block)
        return stored

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device:
            return tensor.detach().clone(memory_format=torch.contiguous_format)
        return tensor.detach().to(self.device, non_blocking=tensor.is_pinned()).contiguous()

    def _make_room(self, charge: int, evicted: list[tuple[bytes, DeviceBlock]]) -> bool:
        while self._bytes + charge > self.capacity_bytes:
            victim = self.policy.victim(set())
            if victim is None or victim not in self._data:
                return False
            evicted.append((victim, self._remove(victim)))
        return True

    def _remove(self, key: bytes) -> DeviceBlock:
        block = self._data.pop(key)
        self._bytes -= block.nbytes
        self.policy.on_remove(key)
        return block

    def holds(self, keys: Sequence[TierKey]) -> list[bool]:
        """Per key: is it held (the policy hears nothing)."""
        with self._lock:
            return [key in self._data for key in keys]

    def prefix_run_length(self, keys: Sequence[TierKey]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._data:
                    return i
            return len(keys)

    def delete(self, keys: Iterable[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                if key in self._data:
                    self._remove(key)
                    removed += 1
        return removed

    def delete_prefix(self, prefix: bytes, length: int | None = None) -> list[bytes]:
        with self._lock:
            held = [k for k in self._data if k.startswith(prefix) and (length is None or len(k) == length)]
            for key in held:
                self._remove(key)
        return held

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._data)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(blocks=len(self._data), bytes=self._bytes, capacity_bytes=self.capacity_bytes)

    def close(self) -> None:
        with self._lock:
            for key in list(self._data):
                self._remove(key)
