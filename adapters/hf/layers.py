"""Cache layers: the per-layer objects of a ``DynamicCache`` (``DynamicLayer``, ``DynamicSlidingWindowLayer``,
transformers' linear-attention state layers, ``DummyLayer``), their tensors, which of them kvshelf bridges, sliding
windows' history, and recurrent states.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvshelf.adapters.hf.version import TESTED_VERSION
from kvshelf.kvstore.errors import UnsupportedModelError


def cache_layers(cache: Any) -> list[Any]:
    """The per-layer objects of a ``DynamicCache`` (``DynamicLayer`` s or subclasses), in layer order."""
    return list(cache.layers)


def full_attention_layers(cache: Any) -> list[DynamicLayer]:
    """``cache_layers``, refused (``UnsupportedModelError``) unless each is a full-attention ``DynamicLayer``."""
    layers = cache_layers(cache)
    for layer in layers:
        if not isinstance(layer, DynamicLayer) or isinstance(layer, DynamicSlidingWindowLayer):
            raise UnsupportedModelError(f"cannot bridge cache layer type {type(layer).__name__}")
    return layers


def is_sliding_layer(layer: Any) -> bool:
    """Whether a cache layer is a sliding-window ``DynamicSlidingWindowLayer`` (sliding or chunked attention)."""
    return isinstance(layer, DynamicSlidingWindowLayer)


def records_sliding_history() -> bool:
    """Whether this transformers' sliding-window cache layers can keep every token (``keep_sliding_history``)."""
    return hasattr(DynamicSlidingWindowLayer, "activate_past_recording")


def keep_sliding_history(cache: Any) -> None:
    """Make the sliding-window layers of ``cache`` keep every token they are given from now on, so that blocks of
    all tokens can be read from them after a forward or ``generate``. Attention is unchanged: each update still
    returns only the window (HF's past recording, made for speculative decoding's rollback). Full layers are
    untouched."""
    for layer in cache_layers(cache):
        if is_sliding_layer(layer):
            if not hasattr(layer, "activate_past_recording"):
                raise UnsupportedModelError(f"transformers {TESTED_VERSION}+ is needed to keep the tokens of "
                                            "sliding-window cache layers")
            layer.activate_past_recording()


def bridge_layers(cache: Any) -> list[DynamicLayer]:
    """``cache_layers``, refused (``UnsupportedModelError``) unless each is a ``DynamicLayer``: full attention or a
    sliding window (``DynamicSlidingWindowLayer``; ``layer_start`` says which tokens it still holds). Layers without
    per-token KV (a hybrid model's recurrent-state layers, ``state_layers``, and its layers without a cache) are
    left out: blocks hold the attention layers only."""
    layers = [layer for layer in cache_layers(cache) if not is_state_only_layer(layer)]
    for layer in layers:
        if not isinstance(layer, DynamicLayer):
            raise UnsupportedModelError(f"cannot bridge cache layer type {type(layer).__name__}")
    return layers


def _state_classes() -> tuple[type, ...]:
    from transformers import cache_utils

    return tuple(getattr(cache_utils, name) for name in ("LinearAttentionCacheLayerMixin",)
                 if hasattr(cache_utils, name))


def _dummy_classes() -> tuple[type, ...]:
    from transformers import cache_utils

    return tuple(getattr(cache_utils, name) for name in ("DummyLayer",) if hasattr(cache_utils, name))


def state_layers(cache: Any) -> list[tuple[int, Any]]:
    """``(index, layer)`` of the cache layers holding a recurrent state (transformers' linear-attention cache
    layers: ``conv_states`` / ``recurrent_states`` per state index), hybrid attention+state layers included."""
    classes = _state_classes()
    return [(i, layer) for i, layer in enumerate(cache_layers(cache)) if classes and isinstance(layer, classes)]


def layer_states(layer: Any) -> list[tuple[str, int, torch.Tensor]]:
    """A state layer's initialized states: ``(kind, state index, tensor)``, kind ``"conv"`` (``[b, channels,
    kernel]``) or ``"recurrent"`` (``[b, heads, ...]``), conv first, by state index. Raises
    ``UnsupportedModelError`` while the layer records past conv states (speculative rollback: not a state)."""
    if getattr(layer, "record_past", False):
        raise UnsupportedModelError("a state layer that records its past conv states cannot be snapshotted")
    out = []
    for index in range(int(layer.number_of_states)):
        if layer.is_conv_states_initialized.get(index) and layer.conv_states[index] is not None:
            out.append(("conv", index, layer.conv_states[index]))
        if layer.is_recurrent_states_initialized.get(index) and layer.recurrent_states[index] is not None:
            out.append(("recurrent", index, layer.recurrent_states[index]))
    return out


def set_layer_state(layer: Any, kind: str, index: int, tensor: torch.Tensor) -> None:
    """Make ``tensor`` (owned by the layer from now on) state ``index`` of kind ``kind`` of an empty state layer,
    as a prefill that ended there leaves it (``has_previous_state``: the next forward continues it)."""
    if kind == "conv":
        layer.conv_states[index] = tensor
        layer.conv_kernel_size[index] = int(tensor.shape[-1])
        layer.is_conv_states_initialized[index] = True
    else:
        layer.recurrent_states[index] = tensor
        layer.is_recurrent_states_initialized[index] = True
    layer.has_previous_state[index] = True
    if layer.device is None:
        layer.device, layer.dtype = tensor.device, tensor.dtype


def repeat_batch(cache: Any, repeats: int) -> None:
    """``cache.batch_repeat_interleave(repeats)`` in place, state layers included (transformers' linear-attention
    layers have no such method: their conv and recurrent states are repeated here)."""
    for layer in cache_layers(cache):
        if isinstance(layer, _state_classes()):
            for index in range(int(layer.number_of_states)):
                for states in (layer.conv_states, layer.recurrent_states):
                    if states.get(index) is not None:
                        states[index] = states[index].repeat_interleave(repeats, dim=0)
        if isinstance(layer, DynamicLayer) or not isinstance(layer, _state_classes() + _dummy_classes()):
            layer.batch_repeat_interleave(repeats)


def is_state_only_layer(layer: Any) -> bool:
    """A cache layer without per-token KV: a pure recurrent-state layer, or a layer that caches nothing."""
    classes, dummies = _state_classes(), _dummy_classes()
    if dummies and isinstance(layer, dummies):
        return True
    return bool(classes) and isinstance(layer, classes) and not isinstance(layer, DynamicLayer)


def layer_start(layer: Any) -> int:
    """The cache index (token count from the start) of the first token a layer holds: 0 for a full-attention layer;
    for a sliding-window layer, how many tokens it has dropped (all it has seen, minus what it holds)."""
    tensors = layer_tensors(layer)
    if is_sliding_layer(layer) and tensors is not None:
        return int(layer.cumulative_length) - tensors[0].shape[-2]
    return 0


def layer_tensors(layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cache layer's ``(keys, values)`` ``[b, h, n, d]`` (RoPE applied to keys); ``None`` before its first
    update."""
    if not layer.is_initialized or layer.keys is None or layer.keys.dim() != 4:
        return None
    return layer.keys, layer.values


def filled_layer_tensors(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_tensors`` of a layer a forward has filled; ``UnsupportedModelError`` when it holds nothing."""
    tensors = layer_tensors(layer)
    if tensors is None:
        raise UnsupportedModelError(f"cache layer {type(layer).__name__} holds no keys and values after the prefill")
    return tensors
