"""Whole caches: built from tensors or layers, read as tensors, their size in memory, and HF's ``QuantizedCache``
(for the codec benchmark's anchors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig, QuantizedCache
from transformers.cache_utils import DynamicLayer

from kvshelf.adapters.hf.growing import GrowingLayer
from kvshelf.adapters.hf.layers import bridge_layers, cache_layers, is_sliding_layer, layer_tensors
from kvshelf.kvstore.errors import UnsupportedModelError


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every KV layer's (``bridge_layers``) ``(keys, values)`` ``[b, h, n, d]``; ``UnsupportedModelError`` if a
    layer is still empty."""
    out = []
    for index, layer in enumerate(bridge_layers(cache)):
        tensors = layer_tensors(layer)
        if tensors is None:
            raise UnsupportedModelError(f"cache layer {index} holds no keys and values yet")
        out.append(tensors)
    return out


def fill_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``keys`` / ``values`` ``[b, h, n, d]`` (not copied) the contents of an empty ``DynamicLayer``, as if
    it had been updated with them: a sliding-window layer keeps the last ``sliding_window - 1`` tokens (what its
    ``update`` keeps) and counts all ``n``."""
    layer.lazy_initialization(keys, values)
    if is_sliding_layer(layer):
        n = keys.shape[-2]
        keep = min(n, max(int(layer.sliding_window) - 1, 0))
        keys, values = keys[:, :, n - keep:], values[:, :, n - keep:]
        layer.cumulative_length = n
    layer.keys, layer.values = keys, values


def new_cache(config: PretrainedConfig | None = None) -> DynamicCache:
    """An empty ``DynamicCache``: with ``config`` of the model's layer types, else growing ``DynamicLayer`` s."""
    return DynamicCache(config=config) if config is not None else DynamicCache()


def cache_from_tensors(tensors: Sequence[tuple[torch.Tensor, torch.Tensor]],
                       config: PretrainedConfig | None = None) -> DynamicCache:
    """A ``DynamicCache`` whose layer ``i`` holds ``tensors[i]`` = ``(keys, values)`` ``[b, h, n, d]`` (not copied).

    With ``config`` the cache has the model's layer types (and must have ``len(tensors)`` layers); without, it
    has one ``DynamicLayer`` per entry.
    """
    cache = new_cache(config)
    if config is None:
        cache.layers = [DynamicLayer() for _ in tensors]  # pyright: ignore[reportAttributeAccessIssue]
    layers = cache_layers(cache)
    if len(layers) != len(tensors):
        raise UnsupportedModelError(f"{len(tensors)} layers of keys and values for a cache of {len(layers)} layers")
    for layer, (keys, values) in zip(layers, tensors, strict=True):
        fill_layer(layer, keys, values)
    return cache


def set_cache_layer(cache: Any, index: int, layer: DynamicLayer) -> None:
    """Replace layer ``index`` of a ``DynamicCache`` (e.g. by a pruned ``GrowingLayer``)."""
    cache.layers[index] = layer


def cache_of_layers(layers: Sequence[DynamicLayer]) -> DynamicCache:
    """A ``DynamicCache`` made of the given layer objects."""
    cache = DynamicCache()
    cache.layers = list(layers)  # pyright: ignore[reportAttributeAccessIssue]
    return cache


def cache_bytes(cache: Any) -> int:
    """Bytes a cache's keys and values take in memory (a ``GrowingLayer``'s headroom included)."""
    total = 0
    for layer in cache_layers(cache):
        if isinstance(layer, GrowingLayer):
            total += layer.allocated_bytes
        elif (tensors := layer_tensors(layer)) is not None:
            total += tensors[0].nbytes + tensors[1].nbytes
    return total


def quantized_cache(backend: str, config: PretrainedConfig, *, nbits: int, group_size: int,
                    residual_length: int) -> Any:
    """HF's ``QuantizedCache`` (quanto or HQQ backend; keys and values quantized along axis 0)."""
    return QuantizedCache(backend=backend, config=config, nbits=nbits, axis_key=0, axis_value=0,
                          q_group_size=group_size, residual_length=residual_length)


def dequantize_cache(cache: Any) -> None:
    """Dequantize every layer's quantized keys and values of a ``QuantizedCache`` (the results are dropped: this
    is for timing the backend's dequantization)."""
    for layer in cache_layers(cache):
        layer._dequantize(layer._quantized_keys)
        layer._dequantize(layer._quantized_values)
