"""``DynamicCache`` (transformers 5.x) <-> ``KVBlock``.

A Llama-family decoder's cache holds, per layer, keys and values shaped ``[batch, kv_heads, tokens,
head_dim]`` with RoPE already applied. A block stacks the layers: ``[layers, kv_heads, tokens, head_dim]``.
Only batch size 1 and dynamic layers are bridged: full attention, and sliding windows where a path allows them
(``check_supported(..., sliding_window=True)``: prefix reuse). A block always holds every token of every layer;
a sliding-window layer is read while it still holds the tokens (``hf.keep_sliding_history``) and loaded as its
cache class keeps it: its last ``window - 1`` tokens, counting all (``hf.fill_layer``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PretrainedConfig

from kvshelf.adapters import hf
from kvshelf.adapters import states as state_types
from kvshelf.adapters.kv_support import check_per_layer_geometry
from kvshelf.compress import hugepages
from kvshelf.kvstore.block import KVBlock, PreparedBlock
from kvshelf.kvstore.codec import PreparedPayload, value_head_dim
from kvshelf.kvstore.errors import UnsupportedModelError


def check_supported(config: PretrainedConfig, feature: str = "KV reuse", *, sliding_window: bool = False,
                    states: bool = False) -> None:
    """Raise ``UnsupportedModelError``, naming the model type and ``feature``, for a model whose KV cache kvshelf
    cannot bridge for that feature: an encoder-decoder (T5...), a decoder without attention heads, attention layers
    other than full attention (linear or recurrent state, KV shared between layers...) and, unless
    ``sliding_window`` (a feature that loads and stores sliding-window layers: prefix reuse), sliding-window and
    chunked-attention layers (Llama 4: a chunked layer's cache is a window of its chunk size). Which layers are
    sliding follows the config as transformers reads it (``hf.attention_layer_types``).
    With ``states`` (a path that snapshots recurrent state beside the blocks: prefix reuse), a hybrid model's state
    layers (``states.STATE_LAYER_TYPES``) and cache-less layers pass for the families in
    ``states.STATE_FAMILIES``; other paths refuse them, naming the layer type (they cannot be exact on them)."""
    text = config.get_text_config(decoder=True)
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", "?")
    refuse = f"{feature} does not support model type {model_type!r}"
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{refuse}: it is an encoder-decoder model; kvshelf reuses the KV cache of "
                                    "decoder-only causal LMs")
    if not hasattr(text, "num_hidden_layers") or not hasattr(text, "num_attention_heads"):
        why = state_types.NOT_EXACT.get(model_type) or (
            "its config names no attention layers and heads (num_hidden_layers / num_attention_heads): no KV cache "
            "kvshelf can bridge")
        raise UnsupportedModelError(f"{refuse}: {why}")
    check_per_layer_geometry(text, refuse)
    types = hf.attention_layer_types(config)
    allowed = {hf.FULL_ATTENTION, *hf.WINDOWED_ATTENTION} if sliding_window else {hf.FULL_ATTENTION}
    if states and set(types) & state_types.STATE_LAYER_TYPES:
        state_types.check_state_family(config, feature)
        allowed |= state_types.STATE_LAYER_TYPES | {"dummy"}
    elif set(types) & state_types.STATE_LAYER_TYPES:
        raise UnsupportedModelError(
            f"{refuse}: it has attention layers of types {state_types.state_layer_types(config)} that keep a "
            "recurrent state, which this path cannot reproduce exactly (only prefix reuse restores recurrent state, "
            "from snapshots at block boundaries)")
    other = sorted(set(types) - allowed)
    if other == [hf.SLIDING_ATTENTION]:
        raise UnsupportedModelError(
            f"{refuse}: it has sliding-window attention layers (window {getattr(text, 'sliding_window', None)}); "
            "this path bridges full-attention caches only"
        )
    if other == [hf.CHUNKED_ATTENTION]:
        raise UnsupportedModelError(
            f"{refuse}: it has chunked attention layers (chunk {getattr(text, 'attention_chunk_size', None)}: "
            "sliding-window caches of the chunk size); this path bridges full-attention caches only (prefix reuse "
            "loads chunked layers as it loads sliding-window ones)")
    if other:
        raise UnsupportedModelError(f"{refuse}: it has attention layers of types {other}, which kvshelf does not "
                                    "bridge (it bridges full-attention, sliding-window and chunked KV caches)")
    if hf.WINDOWED_ATTENTION & set(types) and not hf.records_sliding_history():
        raise UnsupportedModelError(f"{refuse}: its sliding-window layers need transformers "
                                    f"{hf.TESTED_VERSION}+ (sliding layers that keep their past)")


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
    starts = [hf.layer_start(layer) for layer in hf.bridge_layers(cache)]  # cache index of each layer's first token
    layers = hf.cache_tensors(cache)  # per layer (keys, values) [1, kv_heads, tokens, head_dim]
    if layers and layers[0][0].shape[0] != 1:
        raise UnsupportedModelError(f"only batch size 1 is bridged, got {layers[0][0].shape[0]}")
    for index, (first, (k, _)) in enumerate(zip(starts, layers, strict=True)):
        if first > start or first + k.shape[2] < end:
            raise UnsupportedModelError(
                f"cache layer {index} holds tokens [{first}, {first + k.shape[2]}), not all of [{start}, {end}) (a "
                "sliding-window layer that dropped them: keep them with hf.keep_sliding_history)"
            )
    blocks = []
    for s in range(start, end, block_size):
        e = min(s + block_size, end)
        keys = torch.stack([k[0, :, s - o:e - o] for o, (k, _) in zip(starts, layers, strict=True)]).to("cpu")
        values = torch.stack([v[0, :, s - o:e - o] for o, (_, v) in zip(starts, layers, strict=True)]).to("cpu")
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
    straight into the cache's tensors (``tensors_from_prepared``)."""
    cache = DynamicCache(config=config)
    if not blocks:
        return cache
    keys, values = tensors_from_prepared(blocks, device=device, dtype=dtype)
    return cache_from_tensors(keys, values, config, max_tokens=max_tokens, cache=cache)


def cache_from_tensors(keys: torch.Tensor, values: torch.Tensor, config: PretrainedConfig, *,
                       max_tokens: int | None = None, cache: DynamicCache | None = None) -> DynamicCache:
    """A ``DynamicCache`` whose contents are ``keys`` / ``values`` ``[layers, kv_heads, tokens, head_dim]`` (at most
    ``max_tokens`` tokens; views, not copies)."""
    cache = cache if cache is not None else DynamicCache(config=config)
    if max_tokens is not None:
        keys, values = keys[:, :, :max_tokens], values[:, :, :max_tokens]
    _fill(cache, keys, values)
    return cache


def tensors_from_prepared(blocks: Sequence[PreparedBlock], *, device: torch.device | str = "cpu",
                          dtype: torch.dtype | None = None, stage: bool | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' keys and values, in order along the tokens, as ``[layers, kv_heads, tokens, head_dim]`` tensors
    on ``device`` in ``dtype`` (default: the blocks'). Each codec writes its blocks straight into them,
    consecutive blocks of one codec in one call (``PreparedPayload.write_run``: one matrix product per layer for
    ``xquant``), so the blocks' data is written once.

    On a GPU: a codec whose payloads write into device tensors (``writes_to_device``: ``raw`` and the other
    codecs that decode to host tensors first copy them, from page-locked memory by DMA where the memory tier is
    pinned; blocks of the GPU tier copy within the device; codecs that decode on the GPU decode there) writes
    into the cache on the device; another decodes on the CPU into a page-locked staging buffer, then one copy.
    ``stage``: True stages every run that way, False none (default: as just said; the tests stage on the CPU).
    """
    layers, heads, _, dim = blocks[0].shape
    vdim = value_head_dim(blocks[0].shape)  # MLA: the values' head dim differs from the keys'
    for block in blocks:
        if (block.shape[0], block.shape[1], block.shape[3], value_head_dim(block.shape)) != (layers, heads, dim, vdim):
            raise UnsupportedModelError(f"blocks of shapes {blocks[0].shape!r} and {block.shape!r} cannot be joined")
    total = sum(b.num_tokens for b in blocks)
    target = torch.device(device)
    out_dtype = dtype or blocks[0].dtype
    if target.type == "cpu":
        # faulted in (by torch's threads, or recycled from an earlier cache) before the codecs' loops write them
        keys = hugepages.empty((layers, heads, total, dim), out_dtype, prefault=True)
        values = hugepages.empty((layers, heads, total, vdim), out_dtype, prefault=True)
    else:
        keys = torch.empty((layers, heads, total, dim), dtype=out_dtype, device=target)
        values = torch.empty((layers, heads, total, vdim), dtype=out_dtype, device=target)
    start = 0
    for run in _runs([b.payload for b in blocks]):
        end = start + sum(p.num_tokens for p in run)
        writer = type(run[0])
        keys_out, values_out = keys[:, :, start:end], values[:, :, start:end]
        staged = (target.type != "cpu" and not getattr(writer, "writes_to_device", False)) if stage is None else stage
        if not staged:
            writer.write_run(run, keys_out, values_out)
        else:
            pin = torch.cuda.is_available()
            staged_keys = torch.empty(keys_out.shape, dtype=out_dtype, pin_memory=pin)
            staged_values = torch.empty(values_out.shape, dtype=out_dtype, pin_memory=pin)
            writer.write_run(run, staged_keys, staged_values)
            keys_out.copy_(staged_keys, non_blocking=pin)
            values_out.copy_(staged_values, non_blocking=pin)
        start = end
    if target.type == "cuda":  # the sources (staging buffers, views of tier memory) must outlive their copies
        torch.cuda.current_stream(target).synchronize()
    return keys, values


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
    layers = hf.bridge_layers(cache)  # a sliding-window layer keeps its window of them (hf.fill_layer)
    if len(layers) != keys.shape[0]:
        raise UnsupportedModelError(f"blocks have {keys.shape[0]} layers, the model has {len(layers)}")
    for index, layer in enumerate(layers):
        hf.fill_layer(layer, keys[index].unsqueeze(0), values[index].unsqueeze(0))
