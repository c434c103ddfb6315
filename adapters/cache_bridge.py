"""``DynamicCache`` (transformers 5.x) <-> ``KVBlock``.

A Llama-family decoder's cache holds, per layer, keys and values shaped ``[batch, kv_heads, tokens,
head_dim]`` with RoPE already applied. A block stacks the layers: ``[layers, kv_heads, tokens, head_dim]``.
Only batch size 1 and full-attention (non-sliding) dynamic layers are bridged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PretrainedConfig

from kvshelf.adapters import hf
from kvshelf.compress import hugepages
from kvshelf.kvstore.block import KVBlock, PreparedBlock
from kvshelf.kvstore.codec import PreparedPayload
from kvshelf.kvstore.errors import UnsupportedModelError


def check_supported(config: PretrainedConfig) -> None:
    """Raise ``UnsupportedModelError`` for caches kvshelf cannot bridge (sliding windows, no RoPE...)."""
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(text, "sliding_window", None):
        raise UnsupportedModelError(
            f"model type {text.model_type!r} uses sliding-window or non-standard attention layers "
            f"({sorted(set(layer_types)) or 'sliding_window'}); kvshelf bridges full-attention caches only"
        )
    if not hasattr(text, "num_hidden_layers") or not hasattr(text, "num_attention_heads"):
        raise UnsupportedModelError(f"model type {text.model_type!r} is not a decoder kvshelf can bridge")


def blocks_from_cache(
    cache: DynamicCache,
    token_ids: Sequence[int],
    *,
    start: int,
    end: int,
    block_size: int,
    fingerprint: str,
    namespace: str,
    position_offset: int = 0,
) -> list[KVBlock]:
    """The blocks covering tokens ``[start, end)`` of the cache, each ``block_size`` long (last may be shorter).

    ``token_ids`` are the tokens of the whole cache; ``position_offset`` is the position of cache index 0.
    Blocks own their memory (copies), so the cache may keep growing.
    """
    hf.full_attention_layers(cache)
    layers = hf.cache_tensors(cache)  # per layer (keys, values) [1, kv_heads, tokens, head_dim]
    if layers and layers[0][0].shape[0] != 1:
        raise UnsupportedModelError(f"only batch size 1 is bridged, got {layers[0][0].shape[0]}")
    blocks = []
    for s in range(start, end, block_size):
        e = min(s + block_size, end)
        keys = torch.stack([k[0, :, s:e] for k, _ in layers]).to("cpu")
        values = torch.stack([v[0, :, s:e] for _, v in layers]).to("cpu")
        blocks.append(
            KVBlock(keys, values, tuple(int(t) for t in token_ids[s:e]), position_offset + s, fingerprint, namespace)
        )
    return blocks


def cache_from_blocks(
    blocks: Sequence[KVBlock], config: PretrainedConfig, *, max_tokens: int | None = None,
    device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
) -> DynamicCache:
    """A ``DynamicCache`` holding the blocks in order (at most ``max_tokens`` tokens). One copy of the data."""
    cache = DynamicCache(config=config)
    if not blocks:
        return cache
    keys = torch.cat([b.keys for b in blocks], dim=2)  # [layers, kv_heads, tokens, head_dim]
    values = torch.cat([b.values for b in blocks], dim=2)
    if max_tokens is not None:
        keys, values = keys[:, :, :max_tokens], values[:, :, :max_tokens]
    keys = keys.to(device=device, dtype=dtype or keys.dtype)
    values = values.to(device=device, dtype=dtype or values.dtype)
    _fill(cache, keys, values)
    return cache


def cache_from_prepared(
    blocks: Sequence[PreparedBlock], config: PretrainedConfig, *, max_tokens: int | None = None,
    device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
) -> DynamicCache:
    """``cache_from_blocks`` for checked, parsed blocks (``TieredStore.get_prepared_many``): each codec writes
    straight into the cache's tensors, consecutive blocks of one codec in one call (``PreparedPayload.write_run``:
    one matrix product per layer for ``xquant``), so the blocks' data is written once, in the cache's dtype."""
    cache = DynamicCache(config=config)
    if not blocks:
        return cache
    layers, heads, _, dim = blocks[0].shape
    for block in blocks:
        if (block.shape[0], block.shape[1], block.shape[3]) != (layers, heads, dim):
            raise UnsupportedModelError(f"blocks of shapes {blocks[0].shape} and {block.shape} cannot be joined")
    total = sum(b.num_tokens for b in blocks)
    staging = torch.device(device).type != "cpu"  # decode on the CPU, then one transfer
    out_dtype = dtype or blocks[0].dtype
    # faulted in (by torch's threads, or recycled from an earlier cache) before the codecs' loops write them
    keys = hugepages.empty((layers, heads, total, dim), out_dtype, prefault=True)
    values = hugepages.empty((layers, heads, total, dim), out_dtype, prefault=True)
    start = 0
    for run in _runs([b.payload for b in blocks]):
        end = start + sum(p.num_tokens for p in run)
        type(run[0]).write_run(run, keys[:, :, start:end], values[:, :, start:end])
        start = end
    if max_tokens is not None:
        keys, values = keys[:, :, :max_tokens], values[:, :, :max_tokens]
    if staging:
        keys, values = keys.to(device), values.to(device)
    _fill(cache, keys, values)
    return cache


def _runs(payloads: Sequence[PreparedPayload]) -> list[list[PreparedPayload]]:
    """Consecutive payloads grouped by class (each class writes its runs at once)."""
    runs: list[list[PreparedPayload]] = []
    for payload in payloads:
        if runs and type(runs[-1][-1]) is type(payload):
            runs[-1].append(payload)
        else:
            runs.append([payload])
    return runs


def _fill(cache: DynamicCache, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``keys`` / ``values`` ``[layers, kv_heads, tokens, head_dim]`` the contents of the empty ``cache``."""
    layers = hf.full_attention_layers(cache)
    if len(layers) != keys.shape[0]:
        raise UnsupportedModelError(f"blocks have {keys.shape[0]} layers, the model has {len(layers)}")
    for index, layer in enumerate(layers):
        hf.fill_layer(layer, keys[index].unsqueeze(0), values[index].unsqueeze(0))
