"""A cache layer for pruned caches that decodes without copying the whole cache at every step.

transformers' ``DynamicLayer.update`` concatenates each new token onto the cache (``torch.cat``), so every decode
step copies all cached keys and values of every layer: on CPU that copy is a fifth to a third of a SmolLM2
decode step at ~650 cached tokens (torch profiler). A pruned cache knows its size, so ``GrowingLayer`` keeps keys
and values in buffers ``[b, h_kv, capacity, d]`` with some headroom and writes new tokens in place; ``keys`` /
``values`` are views ``[b, h_kv, n, d]`` of the filled part (per-head contiguous, which sdpa and eager attention
take as they are). When the headroom is used up the buffer grows by ``max(headroom, n / 8)`` tokens (one copy).

It is a ``DynamicLayer`` subclass, so ``DynamicCache`` (and ``model.generate``) use it unchanged; code that
assigns ``layer.keys = tensor`` (pruning, ``crop``, beam reordering) still works: the tensor is copied into a new
buffer. The class itself lives in ``adapters.hf`` (it implements transformers' cache-layer contract).
"""

from __future__ import annotations

from typing import Any

import torch

from kvshelf.adapters.hf import DEFAULT_HEADROOM, GrowingLayer, cache_bytes, cache_of_layers

__all__ = ["DEFAULT_HEADROOM", "GrowingLayer", "cache_bytes", "growing_cache"]


def growing_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], headroom: int = DEFAULT_HEADROOM) -> Any:
    """A ``DynamicCache`` of ``GrowingLayer`` s holding ``[(keys, values) [b, h_kv, n, d]]`` per layer (copied)."""
    return cache_of_layers([GrowingLayer.of(k, v, headroom) for k, v in layers])
