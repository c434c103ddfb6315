"""Whole pages between vLLM's paged KV cache (CPU attention backend) and kvshelf blocks.

vLLM's CPU backend keeps one tensor per attention layer, ``[num_blocks, kv_heads, block_size, 2 * head_dim]``. Its
kernel views each ``(block, head)`` page as ``2 * block_size * head_dim`` values: the keys first, then the values
(``[B, H, 2N, C]`` cut in two along dim 2). Inside a page the values are ``[block_size, head_dim]`` (a token's row);
the keys of the ``vec``/``vec16`` kernels (x86 AVX2/AVX-512 in float32, bfloat16 and float16 without AMX) are stored
transposed, ``[head_dim, block_size]``, so a row of the ``[B, H, N, 2C]`` view is not one token's K and V.
``PageLayout.keys_transposed`` says which; the connector measures it once per engine with the kernel that writes
the cache (``connector.probe_layout``) and refuses a layout it cannot read back exactly.

A kvshelf ``KVBlock`` holds ``keys``/``values`` ``[layers, kv_heads, tokens, head_dim]`` in token order; a block of
``block_tokens`` tokens is ``block_tokens / block_size`` consecutive vLLM pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PageLayout:
    """The geometry of one layer's paged cache and how its key pages are ordered."""

    kv_heads: int
    block_size: int  # tokens per vLLM page
    head_dim: int
    keys_transposed: bool  # key page stored [head_dim, block_size] (True) or [block_size, head_dim]


def _pages(cache: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """``cache`` ``[B, H, N, 2C]`` seen as ``[B, H, 2, N*C]``: per page, the keys' then the values' values."""
    return cache.view(cache.shape[0], layout.kv_heads, 2, layout.block_size * layout.head_dim)


def read_pages(caches: Sequence[torch.Tensor], block_ids: Sequence[int],
               layout: PageLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the tokens in pages ``block_ids`` (in order) of every layer: two new tensors
    ``[layers, kv_heads, len(block_ids) * block_size, head_dim]``."""
    index = torch.as_tensor(list(block_ids), dtype=torch.long)
    count, h, n, c = len(block_ids), layout.kv_heads, layout.block_size, layout.head_dim
    keys = torch.empty((len(caches), h, count * n, c), dtype=caches[0].dtype)
    values = torch.empty_like(keys)
    for layer, cache in enumerate(caches):
        pages = _pages(cache, layout)[index]  # [count, H, 2, N*C], a copy
        k = pages[:, :, 0].view(count, h, c, n).transpose(-1, -2) if layout.keys_transposed else \
            pages[:, :, 0].view(count, h, n, c)
        keys[layer].view(h, count, n, c).copy_(k.permute(1, 0, 2, 3))
        values[layer].view(h, count, n, c).copy_(pages[:, :, 1].view(count, h, n, c).permute(1, 0, 2, 3))
    return keys, values


def write_pages(caches: Sequence[torch.Tensor], block_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor,
                layout: PageLayout) -> None:
    """Fill pages ``block_ids`` of every layer from ``keys``/``values`` ``[layers, kv_heads, len(block_ids) *
    block_size, head_dim]`` (cast to the cache's dtype): one strided copy per page and layer, straight from the
    block into the cache (an indexed assignment of the stacked pages costs ~20x more)."""
    count, h, n, c = len(block_ids), layout.kv_heads, layout.block_size, layout.head_dim
    for layer, cache in enumerate(caches):
        pages = _pages(cache, layout)
        k = keys[layer].view(h, count, n, c) if keys[layer].is_contiguous() else keys[layer].reshape(h, count, n, c)
        v = values[layer].reshape(h, count, n, c)
        for j, block in enumerate(block_ids):
            page = pages[block]  # [H, 2, N*C]
            if layout.keys_transposed:
                page[:, 0].view(h, c, n).copy_(k[:, j].transpose(-1, -2))
            else:
                page[:, 0].view(h, n, c).copy_(k[:, j])
            page[:, 1].view(h, n, c).copy_(v[:, j])
