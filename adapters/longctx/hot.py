"""A byte-bounded LRU of decoded layer blocks: the memory cache of hot blocks over the store's tiers."""

from __future__ import annotations

from collections import OrderedDict

import torch

LayerBlock = tuple[int, int]  # (layer, block index)


class HotBlocks:
    """Up to ``capacity`` bytes of ``(keys, values)`` ``[h, B, d]`` per ``(layer, block)``, least recently used
    out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._blocks: OrderedDict[LayerBlock, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def get(self, key: LayerBlock) -> tuple[torch.Tensor, torch.Tensor] | None:
        found = self._blocks.get(key)
        if found is None:
            self.misses += 1
            return None
        self._blocks.move_to_end(key)
        self.hits += 1
        return found

    def put(self, key: LayerBlock, keys: torch.Tensor, values: torch.Tensor) -> None:
        size = keys.nbytes + values.nbytes
        if size > self.capacity:
            return
        old = self._blocks.pop(key, None)
        if old is not None:
            self.bytes -= old[0].nbytes + old[1].nbytes
        while self._blocks and self.bytes + size > self.capacity:
            _, (k, v) = self._blocks.popitem(last=False)
            self.bytes -= k.nbytes + v.nbytes
        self._blocks[key] = (keys, values)
        self.bytes += size

    def held(self) -> list[LayerBlock]:
        return list(self._blocks)

    def resize(self, capacity: int) -> None:
        """Hold at most ``capacity`` bytes from now on (least recently used out first)."""
        self.capacity = max(0, int(capacity))
        while self._blocks and self.bytes > self.capacity:
            _, (k, v) = self._blocks.popitem(last=False)
            self.bytes -= k.nbytes + v.nbytes

    def drop(self, key: LayerBlock) -> None:
        old = self._blocks.pop(key, None)
        if old is not None:
            self.bytes -= old[0].nbytes + old[1].nbytes

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0
