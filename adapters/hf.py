"""Every touch of transformers internals, in one module.

Tested with transformers 5.23.0. ``pyproject.toml`` allows ``>=5.20,<5.24``: the adapters, reuse and xquant tests
(``tests/adapters``, the architecture suite included, ``tests/reuse``, ``tests/compress/test_xquant.py``) also pass
on 5.22.2 and 5.20.0. On 5.0.0 the architecture suite fails (171 of 1135: sliding-window cache layers without past
recording, bf16 cells, RAG on some families), so the lower bound is the oldest release tested; the upper bound
stops after the newest.

Elsewhere in ``kvshelf.adapters``, modules import only public transformers names (``PreTrainedModel``,
``PreTrainedTokenizerBase``, ``DynamicCache``, ``AutoModelForCausalLM``, config classes); nothing outside
``adapters`` imports transformers at all (``tests/adapters/test_hf_boundary.py`` checks both). When a transformers
release changes one of the contracts below, this module is what to fix:

* attention implementations: reading ``config._attn_implementation``, registering attention and mask functions
  (``AttentionInterface``, ``AttentionMaskInterface``), HF's ``sdpa_attention_forward`` and ``sdpa_mask``, and
  switching per call: ``DISPATCH``, an implementation that looks the one to run up in a ``ContextVar`` (the calling
  thread's choice) and otherwise runs the model's own, so one thread's switch never changes another's attention
  (``attention_scope``, ``attention_implementation``, ``switch_attention``);
* cache layers: the ``layers`` list of a ``DynamicCache``, ``DynamicLayer`` (``lazy_initialization``,
  ``is_initialized``, ``keys`` / ``values``), ``DynamicSlidingWindowLayer``, and ``GrowingLayer``, kvshelf's
  ``DynamicLayer`` subclass for pruned caches; ``QuantizedCache``'s layers (for the codec benchmark's anchors);
* ``BaseStreamer``, the base class of ``generate``'s streamers (not exported at the top level);
* the decoder: where it is (``get_decoder()`` / ``model.model``), its layers, final norm and rotary embedding
  (``inv_freq``, ``attention_scaling``, ``rope_type``), the attention modules' fields and projections, and the
  calling conventions of a decoder layer and of an attention module's forward hook.

Shapes: ``b`` batch, ``h`` KV heads (``h_q`` query heads), ``n`` tokens, ``d`` head dim.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, DynamicCache, PretrainedConfig, PreTrainedModel, QuantizedCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation import BaseStreamer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvshelf.kvstore.errors import ConfigError, UnsupportedModelError

TESTED_VERSION = "5.23.0"

__all__ = [
    "ATTENTION_MODULE_FIELDS", "DEFAULT_HEADROOM", "DISPATCH", "TESTED_VERSION", "BaseStreamer", "DynamicLayer",
    "DynamicSlidingWindowLayer", "GrowingLayer", "Rotary", "attention_hook_inputs", "attention_implementation",
    "attention_scope", "attention_modules", "attn_implementation", "cache_bytes", "cache_from_tensors", "cache_layers",
    "cache_of_layers", "cache_tensors", "decoder", "decoder_layers", "dequantize_cache", "fill_layer", "final_norm",
    "full_attention_layers", "input_embeddings", "kv_projection_weights", "layer_tensors", "lm_logits",
    "model_type", "new_cache", "position_embeddings", "rope_layer_types", "rotaries",
    "quantized_cache", "register_attention", "rotary", "run_decoder_layer",
    "sdpa_attention_forward", "set_cache_layer", "supports_sdpa", "switch_attention",
    "FULL_ATTENTION", "SLIDING_ATTENTION", "attention_layer_types", "bridge_layers", "is_sliding_layer",
    "keep_sliding_history", "layer_start", "records_sliding_history", "state_layers", "is_state_only_layer",
    "layer_states", "set_layer_state", "repeat_batch",
    "absolute_position_problem", "attention_head_dim", "attention_queries", "attention_scaling", "attention_softcap",
    "can_switch_attention", "eager_attention_function", "query_path", "self_attention_modules",
    "uses_attention_interface",
]


# -- attention implementations ------------------------------------------------------------------------------
#
# kvshelf runs some calls with another attention implementation than the model's own (eager for a pruning
# prefill, ``kvshelf_gqa_fold`` for the reuse engine's layer-by-layer runs, ``kvshelf_tokenselect``). Switching
# ``config._attn_implementation`` for that would switch every thread using the model. Instead, while at least one
# kvshelf call uses the model (``attention_scope``), its configs name ``DISPATCH``: a registered attention function
# and mask function that look the implementation up per call, in a ``ContextVar`` (the calling thread's context),
# and fall back to the model's own implementation (``sdpa`` or ``eager``) when the context chose none. A call that
# is not kvshelf's, or another thread's, sees exactly the original functions (same masks, same attention); the
# last scope to exit puts the model's own name back.

#: the attention implementation (and mask function) name a model runs under while kvshelf calls use it
DISPATCH = "kvshelf_dispatch"
#: the implementations a model may have for ``DISPATCH`` to stand in for it (others: ``switch_attention`` is global)
_DISPATCHABLE = ("sdpa", "eager")
#: per config (by ``id``): the implementation this context chose; only configs with an active scope have an entry
_CHOSEN: ContextVar[dict[int, str] | None] = ContextVar("kvshelf_attention", default=None)
#: per config (by ``id``): the model's own implementation, recorded before its configs were switched to DISPATCH
_BASES: dict[int, str] = {}
_LOCK = threading.Lock()


@dataclass
class _Dispatch:
    base: str  # the model's own implementation
    configs: tuple[int, ...]  # ids of every config object of the model (the attention modules' included)
    users: int = 0  # active ``attention_scope`` s, all threads


_INSTALLED: weakref.WeakKeyDictionary[nn.Module, _Dispatch] = weakref.WeakKeyDictionary()


def _chosen(config: Any) -> str:
    """The implementation this context runs ``config`` 's attention with (a ``DISPATCH`` config)."""
    chosen = _CHOSEN.get()
    name = chosen.get(id(config)) if chosen else None
    if name is None:
        name = _BASES.get(id(config))
    if name is None:  # switched back meanwhile (the last scope exited between HF's lookup and the call)
        name = config._attn_implementation
        if name == DISPATCH:
            raise UnsupportedModelError("a model config names kvshelf's attention dispatch without kvshelf "
                                        "having installed it")
    return name


def _dispatch_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The ``DISPATCH`` attention function: the implementation ``_chosen`` for the module's config, called as
    the module's forward would call it (``query [b, h_q, q, d]``, ``key/value [b, h, n, d]`` -> ``([b, q, h_q, d],
    weights or None)``); ``eager`` is the module's own modeling file's eager function (GPT-2's reordered upcast
    when the module asks for it)."""
    name = _chosen(module.config)
    if name == "eager":
        if getattr(module, "reorder_and_upcast_attn", False):
            return module._upcast_and_reordered_attn(query, key, value, attention_mask)
        return eager_attention_function(module)(module, query, key, value, attention_mask, **kwargs)
    return AttentionInterface._global_mapping[name](module, query, key, value, attention_mask, **kwargs)


def _dispatch_mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
    """The ``DISPATCH`` mask function: the mask function of the implementation ``_chosen`` for ``config`` (eager:
    additive float; sdpa: bool, or ``None`` for a plain causal mask), or ``None`` for an implementation without
    one (what transformers gives such an implementation)."""
    function = AttentionMaskInterface._global_mapping.get(_chosen(config))
    return None if function is None else function(*args, config=config, **kwargs)


def _configs(model: nn.Module) -> list[Any]:
    """Every config object of the model: its own, its sub-configs', its submodules' (the attention modules')."""
    found: dict[int, Any] = {}
    pending = [model.config]
    pending += [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    while pending:
        config = pending.pop()
        if id(config) not in found:
            found[id(config)] = config
            pending += [getattr(config, k) for k in getattr(config, "sub_configs", {}) if getattr(config, k, None)]
    return list(found.values())


def _install(model: nn.Module) -> _Dispatch | None:
    """Make the model's configs name ``DISPATCH`` (one more user if they do already); ``None`` when the model
    cannot be dispatched (its own implementation is not sdpa or eager, it cannot switch implementations, or its
    configs disagree)."""
    with _LOCK:
        state = _INSTALLED.get(model)
        own = model.config._attn_implementation
        if own != DISPATCH:
            configs = _configs(model)
            if (own not in _DISPATCHABLE or not can_switch_attention(model)
                    or any(c._attn_implementation != own for c in configs)):
                return None
            AttentionInterface.register(DISPATCH, _dispatch_attention)
            AttentionMaskInterface.register(DISPATCH, _dispatch_mask)
            for config in configs:  # before the switch: a dispatched call always finds its base
                _BASES[id(config)] = own
            if state is None:
                state = _INSTALLED[model] = _Dispatch(own, tuple(id(c) for c in configs))
            state.base = own
            model.set_attn_implementation(DISPATCH)
        elif state is None:
            raise UnsupportedModelError("a model config names kvshelf's attention dispatch without kvshelf having "
                                        "installed it")
        state.users += 1
        return state


def _uninstall(model: nn.Module, state: _Dispatch) -> None:
    with _LOCK:
        state.users -= 1
        if state.users == 0 and model.config._attn_implementation == DISPATCH:
            model.set_attn_implementation(state.base)


def _scoped(model: nn.Module) -> bool:
    """Whether an ``attention_scope`` of the model is active in this context."""
    chosen = _CHOSEN.get()
    return bool(chosen) and id(model.config) in chosen


def attn_implementation(model: PreTrainedModel) -> str:
    """The attention implementation the model runs with now in this context (thread): ``"sdpa"``, ``"eager"``, a
    registered name... Another thread's ``attention_implementation`` block does not change what this returns."""
    own = model.config._attn_implementation
    return _chosen(model.config) if own == DISPATCH else own


@contextmanager
def attention_scope(model: PreTrainedModel) -> Iterator[bool]:
    """A block in which ``switch_attention`` changes the model's attention implementation for the current context
    only (this thread, and contexts copied from it): yields whether it can (``False``: the model's own
    implementation is not sdpa or eager, or the model cannot switch; ``switch_attention`` then switches it for
    every thread). On exit the context's choice is what it was before the block."""
    state = _install(model)
    if state is None:
        yield False
        return
    try:
        chosen = dict(_CHOSEN.get() or {})
        current = attn_implementation(model)
        for config_id in state.configs:
            chosen.setdefault(config_id, current)
        token = _CHOSEN.set(chosen)
        try:
            yield True
        finally:
            _CHOSEN.reset(token)
    finally:
        _uninstall(model, state)


def switch_attention(model: PreTrainedModel, name: str) -> None:
    """Switch the model to the attention implementation ``name``: inside an ``attention_scope`` of the model, for
    the current context only (until the scope exits); otherwise for every thread (a model kvshelf cannot dispatch,
    ``attention_scope`` yielded ``False``). ``ConfigError`` outside a scope while other kvshelf calls dispatch the
    model (a global switch would change their attention)."""
    if name != "eager" and name not in AttentionInterface._global_mapping:
        raise ConfigError(f"unknown attention implementation {name!r} (register it first)")
    if _scoped(model):
        state = _INSTALLED[model]
        chosen = dict(_CHOSEN.get() or {})
        chosen.update(dict.fromkeys(state.configs, name))
        _CHOSEN.set(chosen)
        return
    if model.config._attn_implementation == DISPATCH:
        raise ConfigError(f"switch_attention({name!r}) outside an attention_scope of a model that other kvshelf calls "
                          "are using: it would switch their attention too")
    model.set_attn_implementation(name)


@contextmanager
def attention_implementation(model: PreTrainedModel, name: str) -> Iterator[str]:
    """Run the block with attention implementation ``name`` in the current context (this thread; other threads
    using the model keep theirs); the previous one is yielded, and back afterwards."""
    previous = attn_implementation(model)
    if previous == name:
        yield previous
        return
    with attention_scope(model) as scoped:
        if scoped:
            switch_attention(model, name)
            yield previous
            return
        with _LOCK:  # a model kvshelf cannot dispatch: the old global switch, for every thread
            model.set_attn_implementation(name)
        try:
            yield previous
        finally:
            with _LOCK:
                model.set_attn_implementation(previous)


def supports_sdpa(model: nn.Module) -> bool:
    """Whether the model class can run with ``sdpa`` attention."""
    return bool(getattr(model, "_supports_sdpa", False))


def can_switch_attention(model: nn.Module) -> bool:
    """Whether ``switch_attention`` works on the model (Falcon's attention ignores it: transformers only warns)."""
    can = getattr(model, "_can_set_attn_implementation", None)
    return bool(can()) if callable(can) else False


def register_attention(name: str, function: Callable[..., Any], *, sdpa_masks: bool = False) -> None:
    """Register ``function`` as the attention implementation ``name`` (idempotent).

    ``function(module, query [b, h_q, q, d], key [b, h, n, d], value [b, h, n, d], attention_mask, **kwargs)``
    returns ``(output [b, q, h_q, d], weights or None)``. ``sdpa_masks``: the model builds its masks for ``name``
    as for ``sdpa`` (else the model's default for unknown implementations applies).
    """
    AttentionInterface.register(name, function)
    if sdpa_masks:
        AttentionMaskInterface.register(name, sdpa_mask)


# -- cache layers ---------------------------------------------------------------------------------------------


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


# -- attention layer types; sliding-window layers ------------------------------------------------------------

#: the attention layer types of ``attention_layer_types`` that kvshelf bridges (sliding windows: prefix reuse)
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
#: chunked attention (Llama 4): each token attends within its chunk of ``attention_chunk_size`` tokens. Its cache
#: layer is a sliding window of the chunk size (``DynamicSlidingWindowLayer``; only the mask differs), so a path that
#: loads sliding layers loads chunked ones alike.
CHUNKED_ATTENTION = "chunked_attention"
#: layer types whose cache keeps a window of the last tokens (``is_sliding_layer``)
WINDOWED_ATTENTION = frozenset({SLIDING_ATTENTION, CHUNKED_ATTENTION})


def attention_layer_types(config: PretrainedConfig) -> list[str]:
    """The decoder's attention type per layer, as ``DynamicCache(config=...)`` builds its layers (transformers'
    ``get_layer_types_and_kwargs``): ``layer_types`` when the config has them (authoritative: Gemma 3 with every
    layer ``"full_attention"`` has no window although its ``sliding_window`` is set), else ``"sliding_attention"``
    for every layer when ``sliding_window`` is set (Mistral), ``"chunked_attention"`` with
    ``attention_chunk_size``, else ``"full_attention"``; layers sharing another's KV, or without attention, are
    ``"dummy"``."""
    text = config.get_text_config(decoder=True)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # older 5.x: the same inference, by hand
        types = getattr(text, "layer_types", None)
        if types is None:
            kind = (SLIDING_ATTENTION if getattr(text, "sliding_window", None) is not None
                    else "chunked_attention" if getattr(text, "attention_chunk_size", None) is not None
                    else FULL_ATTENTION)
            types = [kind] * int(getattr(text, "num_hidden_layers", 0) or 0)
        return [str(t) for t in types]
    return [str(t) for t in get_layer_types_and_kwargs(text)[0]]


def batch_positions_follow_mask(model: nn.Module) -> bool:
    """Whether a left-padded batch gives each row the positions it has alone: the forward takes ``position_ids``
    (``generate`` derives them from the attention mask) and no embeddings module counts positions from the
    input ids past a padding index (RoBERTa-style ``create_position_ids_from_input_ids``, which a padded row's
    past length shifts while decoding). TrOCR and MPT take no ``position_ids``; RoBERTa, CamemBERT, XLM-R, X-MOD
    and Data2Vec-text count from padding."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return False
    return not any(name.endswith("embeddings") and not isinstance(module, nn.Embedding)
                   and hasattr(module, "padding_idx") for name, module in model.named_modules())


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
        cache.layers = [DynamicLayer() for _ in tensors]
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
    cache.layers = list(layers)
    return cache


DEFAULT_HEADROOM = 16


class _Buffer:
    """A ``[b, h, capacity, d]`` tensor whose first ``n`` positions (dim 2) are filled."""

    __slots__ = ("data", "n")

    def __init__(self, tensor: torch.Tensor, headroom: int) -> None:
        b, h, n, d = tensor.shape
        self.data = tensor.new_empty(b, h, n + headroom, d)
        self.data[:, :, :n].copy_(tensor)
        self.n = n

    def append(self, tensor: torch.Tensor, headroom: int) -> None:
        q = tensor.shape[2]
        if self.n + q > self.data.shape[2]:
            old = self.data[:, :, : self.n]
            b, h, _, d = old.shape
            self.data = old.new_empty(b, h, self.n + q + max(headroom, self.n // 8), d)
            self.data[:, :, : self.n].copy_(old)
        self.data[:, :, self.n:self.n + q].copy_(tensor)
        self.n += q

    def view(self) -> torch.Tensor:
        return self.data[:, :, : self.n]


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with in-place appends into preallocated buffers (see ``adapters.pruning.layout``).

    Keys and values live in buffers ``[b, h, capacity, d]`` with ``headroom`` free token slots; ``keys`` /
    ``values`` are views ``[b, h, n, d]`` of the filled part. Assigning ``layer.keys = tensor`` (pruning, ``crop``,
    beam reordering) copies the tensor into a new buffer.

    Args:
        headroom: free token slots allocated past the current length, and the least a full buffer grows by.
    """

    def __init__(self, headroom: int = DEFAULT_HEADROOM) -> None:
        self.headroom = headroom
        self._k: _Buffer | None = None
        self._v: _Buffer | None = None
        super().__init__()

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, headroom: int = DEFAULT_HEADROOM) -> GrowingLayer:
        """A layer holding ``keys`` / ``values`` ``[b, h, n, d]`` (copied)."""
        layer = cls(headroom)
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.keys, layer.values = keys, values
        layer.is_initialized = True
        return layer

    def _store(self, tensor: torch.Tensor | None) -> _Buffer | None:
        if tensor is None or tensor.dim() != 4:  # DynamicLayer's lazy init assigns an empty 1-D tensor
            return None
        return _Buffer(tensor, self.headroom)

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._k is None else self._k.view()

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._k = self._store(tensor)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._v is None else self._v.view()

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._v = self._store(tensor)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[b, h, q, d]`` new keys / values in place; returns the whole cache ``[b, h, n, d]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._k is None or self._v is None:
            self._k, self._v = _Buffer(key_states, self.headroom), _Buffer(value_states, self.headroom)
        else:
            self._k.append(key_states, self.headroom)
            self._v.append(value_states, self.headroom)
        return self._k.view(), self._v.view()

    def get_seq_length(self) -> int:
        return 0 if self._k is None else self._k.n

    def reset(self) -> None:
        """Drop the buffers: an empty, uninitialized layer (``DynamicLayer.reset`` zeroes them in place in
        transformers 5.0 and drops them in 5.23; a pruned cache wants them dropped in either)."""
        self._k = self._v = None
        self.is_initialized = False
        if hasattr(self, "cumulative_length"):
            self.cumulative_length = 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes the buffers take, headroom included (``keys.nbytes + values.nbytes`` counts only the filled part)."""
        return sum(b.data.nbytes for b in (self._k, self._v) if b is not None)


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


# -- the decoder ----------------------------------------------------------------------------------------------


def decoder(model: PreTrainedModel) -> Any:
    """The decoder module (``layers``, ``norm``, ``rotary_emb``); ``UnsupportedModelError`` when there is none."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise UnsupportedModelError(f"{type(model).__name__}: no decoder layers with rotary embeddings found")
    return inner


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder layers, in order."""
    return decoder(model).layers


def final_norm(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The decoder's final norm of ``hidden`` ``[b, n, hidden]`` (what the LM head reads): ``norm``, or GPT-NeoX's
    ``final_layer_norm``."""
    inner = decoder(model)
    norm = getattr(inner, "norm", None) or getattr(inner, "final_layer_norm", None)
    if norm is None:
        raise UnsupportedModelError(f"model type {model_type(model)!r}: no final norm found in the decoder")
    return norm(hidden)


def model_type(model: PreTrainedModel) -> str:
    """The text decoder's ``model_type`` (what refusals name)."""
    return str(model.config.get_text_config(decoder=True).model_type)


def input_embeddings(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """``[b, n, hidden]``: what the decoder's first layer reads for ``input_ids`` ``[b, n]``: the embedding module's
    output (Gemma's scales itself) times the decoder's ``embedding_multiplier`` (Granite), as the decoder's own
    forward computes it."""
    hidden = model.get_input_embeddings()(input_ids)
    multiplier = getattr(decoder(model), "embedding_multiplier", None)
    return hidden if multiplier in (None, 1, 1.0) else hidden * multiplier


def lm_logits(model: PreTrainedModel, normed: torch.Tensor) -> torch.Tensor:
    """The causal LM's logits of final-normed hidden states ``[b, n, hidden]``, as its own forward computes them:
    the LM head, then Granite's ``/ logits_scaling``, Cohere's ``* logit_scale`` or Gemma 2/3's final soft cap."""
    logits = model.get_output_embeddings()(normed)
    text = model.config.get_text_config(decoder=True)
    scaling = getattr(text, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        logits = logits / scaling
    scale = getattr(model, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1:
        logits = logits * scale
    cap = getattr(text, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


@dataclass(frozen=True, eq=False)
class Rotary:
    """A model's rotary embedding: ``inv_freq`` ``[rotary_dim / 2]`` float32 on the CPU (after any static
    scaling), ``attention_scaling`` (the factor HF multiplies cos and sin by), ``rope_type``, and its convention:
    ``rotary_dim`` (``2 * len(inv_freq)``; less than the head dim with partial rotary) and ``interleaved`` (pairs
    ``(2i, 2i + 1)``, Cohere's, rather than halves ``(i, i + rotary_dim / 2)``)."""

    inv_freq: torch.Tensor
    attention_scaling: float
    rope_type: str
    rotary_dim: int = 0
    interleaved: bool = False
    static_positions: int | None = None  # length-dependent RoPE: its tables stay ``inv_freq`` up to this many positions


def rotary(model: PreTrainedModel, layer_type: str | None = None) -> Rotary:
    """The decoder's rotary embedding parameters; ``UnsupportedModelError`` without one.

    A rotary embedding with one table per attention layer type (Gemma 3's ``full_attention_inv_freq`` and
    ``sliding_attention_inv_freq``) is read for ``layer_type``, by default the model's one layer type (refused when
    its layers have several: see ``rotaries``)."""
    rotary_emb = getattr(decoder(model), "rotary_emb", None)
    layer_type = _rope_layer_type(model, rotary_emb, layer_type)
    prefix = "" if layer_type is None else f"{layer_type}_"
    inv_freq = getattr(rotary_emb, f"{prefix}inv_freq", None)
    if inv_freq is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no rotary embedding with inv_freq (not a RoPE "
                                    "decoder in the Llama layout)")
    rope_type = getattr(rotary_emb, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type, "default")
    static = _static_positions(model, rotary_emb, str(rope_type), layer_type)
    if static is not None:  # the tables it starts from (and returns to on short inputs), not the current ones
        inv_freq = getattr(rotary_emb, f"{prefix}original_inv_freq", None)
        if inv_freq is None:
            raise UnsupportedModelError(f"model type {model_type(model)!r}: RoPE type {rope_type!r} without its "
                                        "original inv_freq")
    freqs = inv_freq.detach().to("cpu", torch.float32)
    interleaved = _interleaved(model, rotary_emb, freqs.numel(), layer_type) or _applies_interleaved(model)
    return Rotary(freqs, float(getattr(rotary_emb, f"{prefix}attention_scaling", 1.0)), str(rope_type),
                  2 * freqs.numel(), interleaved, static)


def _applies_interleaved(model: PreTrainedModel) -> bool:
    """Whether the attention rotates interleaved pairs although its rotary table is in halves: GLM, GLM-4,
    ERNIE 4.5 and Helium give ``apply_rotary_pos_emb`` Llama's table and turn it into pairs there
    (``cos[..., :d // 2].repeat_interleave(2)`` with an interleaved ``rotate_half``): the rotation is Cohere's,
    pairs ``(2i, 2i + 1)`` at frequency ``i``. Read from the modeling module's ``rotate_half``."""
    try:
        modules = self_attention_modules(model)
        return bool(modules) and _interleaved_rotation(type(modules[0]))
    except UnsupportedModelError:
        return False


def _static_positions(model: PreTrainedModel, rotary_emb: nn.Module, rope_type: str,
                      layer_type: str | None) -> int | None:
    """For a length-dependent RoPE (HF's ``dynamic_rope_update``), the number of positions up to which every
    forward uses its original tables: ``dynamic`` grows its frequencies past ``original_max_seq_len`` (and resets
    them below it: one less, to be safe), ``longrope`` switches to its long factors past
    ``original_max_position_embeddings``. ``None`` for static RoPE."""
    if "dynamic" in rope_type:
        return int(rotary_emb.original_max_seq_len) - 1
    if rope_type == "longrope":
        params = model.config.get_text_config(decoder=True).rope_parameters
        params = params.get(layer_type, params) if layer_type is not None else params
        return int(params["original_max_position_embeddings"])
    return None


def rope_layer_types(model: PreTrainedModel) -> list[str | None]:
    """Per decoder layer, the layer type its rotary table belongs to: ``None`` for every layer of a model with one
    rotary table, else ``config.layer_types`` (Gemma 3: local RoPE on sliding layers, global on full ones)."""
    rotary_emb = getattr(decoder(model), "rotary_emb", None)
    layers = len(decoder_layers(model))
    if not _per_layer_type(rotary_emb):
        return [None] * layers
    return list(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or [None] * layers)


def rotaries(model: PreTrainedModel) -> list[Rotary]:
    """``rotary`` of each decoder layer (the same object for layers of the same rotary table)."""
    kinds = rope_layer_types(model)
    tables = {kind: rotary(model, kind) for kind in dict.fromkeys(kinds)}
    return [tables[kind] for kind in kinds]


def _per_layer_type(rotary_emb: nn.Module | None) -> bool:
    return rotary_emb is not None and "layer_type" in inspect.signature(rotary_emb.forward).parameters


def _rope_layer_type(model: PreTrainedModel, rotary_emb: nn.Module | None, layer_type: str | None) -> str | None:
    """``None`` for a rotary embedding with one table; for one with a table per layer type (its ``forward`` takes
    ``layer_type``), ``layer_type`` or else the model's only layer type (``UnsupportedModelError`` when several)."""
    if not _per_layer_type(rotary_emb):
        return None
    if layer_type is not None:
        return layer_type
    types = sorted(set(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []))
    if len(types) != 1:
        raise UnsupportedModelError(f"model type {model_type(model)!r}: one rotary embedding per layer type "
                                    f"({types}); name the layer type")
    return types[0]


def _rope_call(model: PreTrainedModel, rotary_emb: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
               layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    layer_type = _rope_layer_type(model, rotary_emb, layer_type)
    if layer_type is None:
        return rotary_emb(hidden, position_ids=position_ids)
    return rotary_emb(hidden, position_ids=position_ids, layer_type=layer_type)


def _interleaved(model: PreTrainedModel, rotary_emb: nn.Module, pairs: int, layer_type: str | None = None) -> bool:
    """Whether the rotary embedding's ``cos`` table repeats each angle twice in a row (pairs ``(2i, 2i + 1)``,
    Cohere's ``repeat_interleave``) rather than concatenating two halves (Llama's ``rotate_half``); read from
    its own output at position 1 (angles ``inv_freq``, all different)."""
    probe = torch.zeros(1, 1, 1, dtype=torch.float32, device=model.device)
    with torch.no_grad():
        table = _rope_call(model, rotary_emb, probe, torch.ones(1, 1, dtype=torch.long, device=model.device),
                           layer_type)
    if isinstance(table, torch.Tensor) and table.is_complex():  # DeepSeek-V2's freqs_cis: pairs (2i, 2i + 1)
        if table.numel() != pairs:
            raise UnsupportedModelError(f"model type {model_type(model)!r}: a complex rotary table of "
                                        f"{table.numel()} entries for {pairs} frequencies (an unknown RoPE layout)")
        return True
    cos = table[0].reshape(-1).float().cpu()
    if cos.numel() != 2 * pairs or pairs == 1 or torch.equal(cos[:pairs], cos[pairs:]):
        if cos.numel() != 2 * pairs:
            raise UnsupportedModelError(f"model type {model_type(model)!r}: a rotary table of {cos.numel()} "
                                        f"entries for {pairs} frequencies (an unknown RoPE layout)")
        return False
    if torch.equal(cos[0::2], cos[1::2]):
        return True
    raise UnsupportedModelError(f"model type {model_type(model)!r}: its rotary table is neither halves nor "
                                "interleaved pairs (an unknown RoPE layout)")


def position_embeddings(model: PreTrainedModel, hidden: torch.Tensor, position_ids: torch.Tensor,
                        layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``(cos, sin)`` for ``position_ids`` ``[1, q]``: each ``[1, q, d]`` (both halves equal, times the
    attention scaling) in ``hidden``'s dtype, as the decoder layers take them; a rotary embedding per layer type
    gives ``layer_type``'s (``rope_layer_types``), by default the model's one layer type's."""
    return _rope_call(model, decoder(model).rotary_emb, hidden, position_ids, layer_type)


def run_decoder_layer(model: PreTrainedModel, index: int, hidden: torch.Tensor, *, position_ids: torch.Tensor,
                      embeddings: tuple[torch.Tensor, torch.Tensor], cache: Any,
                      **attention_kwargs: Any) -> torch.Tensor:
    """Decoder layer ``index`` on ``hidden`` ``[1, q, hidden]`` at ``position_ids`` ``[1, q]`` with
    ``embeddings`` (``position_embeddings``); returns the layer's output ``[1, q, hidden]``.

    The layer's attention calls only ``cache.update(key_states [1, h, q, d], value_states, layer_idx)`` (keys
    RoPE'd) and attends over the ``(keys, values)`` it returns, so ``cache`` may be any object with that method.
    ``attention_kwargs`` (``attention_mask`` ``[1, 1, q, n]`` or ``None``, extra kwargs of a registered attention
    function) go to the attention.
    """
    layer = decoder_layers(model)[index]
    return layer(hidden, position_ids=position_ids, use_cache=True, position_embeddings=embeddings,
                 **{_cache_argument(layer): cache}, **attention_kwargs)


def _cache_argument(layer: nn.Module) -> str:
    """The name a decoder layer takes its cache under: ``past_key_values``, or GPT-NeoX's ``layer_past``."""
    params = inspect.signature(layer.forward).parameters
    return "layer_past" if "layer_past" in params and "past_key_values" not in params else "past_key_values"


#: what kvshelf reads of an attention module: its projections, head dim, GQA group size and layer index
ATTENTION_MODULE_FIELDS = ("q_proj", "k_proj", "v_proj", "head_dim", "num_key_value_groups", "layer_idx")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's attention module, in layer order; ``UnsupportedModelError`` unless every layer has one
    with ``ATTENTION_MODULE_FIELDS`` (a Llama-style ``self_attn``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    modules = [getattr(layer, "self_attn", None) for layer in layers] if layers is not None else []
    if not modules or any(m is None or not all(hasattr(m, a) for a in ATTENTION_MODULE_FIELDS) for m in modules):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no Llama-style attention modules (model.model.layers[i].self_attn with "
            f"{', '.join(ATTENTION_MODULE_FIELDS)})"
        )
    return modules


def kv_projection_weights(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the key and value projection weights ``([h * d, hidden], [h * d, hidden])`` (detached)."""
    return [(m.k_proj.weight.detach(), m.v_proj.weight.detach()) for m in attention_modules(model)]


def attention_hook_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, Any, Any]:
    """From an attention module's forward hook (``with_kwargs=True``): ``(hidden_states [b, n, hidden], the
    cache or None, position_embeddings (cos, sin) each [b, n, d])``."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    cache = kwargs.get("past_key_values", kwargs.get("layer_past"))  # GPT-NeoX and Falcon: ``layer_past``
    return hidden, cache, kwargs.get("position_embeddings")


# -- attention modules of any layout (token pruning and selection) ---------------------------------------------

#: where a causal LM keeps its decoder layers (Llama-style ``model.layers``, GPT-NeoX, Falcon and GPT-2)
_LAYER_LISTS = (("model", "layers"), ("gpt_neox", "layers"), ("transformer", "h"))
#: the attribute of a decoder layer's self-attention module, per layout
_SELF_ATTENTION = ("self_attn", "attention", "self_attention", "attn")
#: the submodules an attention module may have for ``attention_queries`` to know its query path
_QUERY_PATH_CHILDREN = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "q_layernorm", "k_layernorm", "qkv_proj",
    "query_key_value", "dense", "c_attn", "c_proj", "attn_dropout", "resid_dropout", "attention_dropout"})


def self_attention_modules(model: nn.Module, *, some: bool = False) -> list[nn.Module]:
    """Each decoder layer's self-attention module, in layer order, in any layout kvshelf knows: Llama-style
    ``model.layers[i].self_attn``, GPT-NeoX ``gpt_neox.layers[i].attention``, Falcon
    ``transformer.h[i].self_attention``, GPT-2 ``transformer.h[i].attn``. Each has a ``layer_idx`` (its cache
    layer). ``UnsupportedModelError`` otherwise. With ``some`` (a hybrid model, whose state layers have none),
    those of the layers that have one."""
    for outer, inner in _LAYER_LISTS:
        layers = getattr(getattr(model, outer, None), inner, None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            modules = [next((getattr(layer, a) for a in _SELF_ATTENTION if isinstance(getattr(layer, a, None),
                                                                                    nn.Module)), None)
                       for layer in layers]
            if some:
                modules = [m for m in modules if m is not None]
            if modules and all(m is not None and isinstance(getattr(m, "layer_idx", None), int) for m in modules):
                return modules
    raise UnsupportedModelError(f"{type(model).__name__} has no decoder layers with self-attention modules kvshelf "
                                "can hook (model.layers[i].self_attn, gpt_neox.layers[i].attention, "
                                "transformer.h[i].self_attention or .attn, each with a layer_idx)")


def absolute_position_problem(model: PreTrainedModel) -> str | None:
    """Why the model's positions would not survive a cache with gaps (tokens dropped), or ``None``: RoPE, learned
    absolute positions (GPT-2) are encoded per token from ``position_ids``; ALiBi biases (Falcon ``alibi=True``)
    are computed from cache indices, which pruning shifts."""
    text = model.config.get_text_config(decoder=True)
    if getattr(text, "alibi", False):
        return "ALiBi attention biases (computed from cache indices, which pruning shifts)"
    return None


def attention_head_dim(module: nn.Module) -> int:
    """An attention module's head dim (``head_dim``, GPT-NeoX's ``head_size``)."""
    return int(getattr(module, "head_dim", None) or module.head_size)


def attention_scaling(module: nn.Module) -> float:
    """The factor an attention module multiplies ``q @ k^T`` by: its ``scaling`` (Granite's ``attention_multiplier``,
    Gemma 2/3's ``query_pre_attn_scalar ** -0.5``, GPT-2's per-layer scaling...), Falcon's ``inv_norm_factor``."""
    for name in ("scaling", "inv_norm_factor"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise UnsupportedModelError(f"attention module {type(module).__name__} has no attention scaling kvshelf reads")


def attention_softcap(module: nn.Module) -> float | None:
    """The soft cap the module applies to its attention logits (Gemma 2 passes its ``attn_logit_softcapping`` to
    the attention function), or ``None``: Gemma 3 keeps the attribute but never passes it (its logits are not
    capped)."""
    cap = getattr(module, "attn_logit_softcapping", None)
    return float(cap) if cap is not None and _passes_softcap(type(module)) else None


@functools.cache
def _passes_softcap(cls: type) -> bool:
    try:
        return "softcap=" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True  # cannot tell: assume the cap applies (as the attribute says)


def eager_attention_function(module: nn.Module) -> Callable[..., Any]:
    """The eager attention function of the module's modeling file (what it runs under ``attn_implementation=
    "eager"``): ``(module, query, key, value, additive_mask, scaling=..., dropout=..., [softcap=...]) ->
    (output [b, q, h_q, d], weights)``."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if not callable(function):
        raise UnsupportedModelError(f"attention module {type(module).__name__}: no eager attention function")
    return function


def uses_attention_interface(module: nn.Module) -> bool:
    """Whether the module's forward calls transformers' attention interface (so a registered attention function
    sees its queries), rather than its own attention code (Falcon's)."""
    return _calls_interface(type(module))


@functools.cache
def _calls_interface(cls: type) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


@functools.cache
def _interleaved_rotation(cls: type) -> bool:
    """The rotary convention of the attention class's modeling module, read from its own ``rotate_half`` on a probe:
    halves (Llama's ``[-x2, x1]``) or interleaved pairs (Cohere's)."""
    rotate_half = getattr(sys.modules[cls.__module__], "rotate_half", None)
    out = rotate_half(torch.arange(4.0)).tolist() if callable(rotate_half) else None
    if out == [-2.0, -3.0, 0.0, 1.0]:
        return False
    if out == [-1.0, 0.0, -3.0, 2.0]:
        return True
    raise UnsupportedModelError(f"attention module {cls.__name__}: unknown rotary convention (no rotate_half with "
                                "halves or interleaved pairs in its modeling module)")


def query_path(module: nn.Module) -> str:
    """How ``attention_queries`` recomputes the module's queries: ``"q_proj"`` (Llama-style, with any q norm),
    ``"qkv_proj"`` (Phi3), ``"gpt_neox"`` / ``"falcon"`` (fused ``query_key_value``), ``"gpt2"`` (``c_attn``).
    ``UnsupportedModelError`` naming what it does not know (then queries cannot be recomputed exactly)."""
    unknown = {name for name, _ in module.named_children()} - _QUERY_PATH_CHILDREN
    if unknown:
        raise UnsupportedModelError(f"attention module {type(module).__name__} has submodules kvshelf does not know "
                                    f"on its query path ({', '.join(sorted(unknown))})")
    if hasattr(module, "q_proj"):
        path = "q_proj"
    elif hasattr(module, "qkv_proj"):
        path = "qkv_proj"
    elif hasattr(module, "query_key_value"):
        path = "falcon" if hasattr(module, "new_decoder_architecture") else "gpt_neox"
    elif hasattr(module, "c_attn") and not getattr(module, "is_cross_attention", False):
        path = "gpt2"
    else:
        raise UnsupportedModelError(f"attention module {type(module).__name__}: no query projection kvshelf knows")
    if path != "gpt2":
        _interleaved_rotation(type(module))
    return path


def _fused_queries(module: nn.Module, hidden: torch.Tensor, path: str, d: int) -> torch.Tensor:
    """``[b, n, h_q, d]`` queries of the fused projections (before any norm or RoPE)."""
    b, n, _ = hidden.shape
    if path == "qkv_proj":  # Phi3: [q | k | v] along the output
        return module.qkv_proj(hidden)[..., : module.config.num_attention_heads * d].view(b, n, -1, d)
    if path == "gpt_neox":  # per head [q | k | v]
        return module.query_key_value(hidden).view(b, n, -1, 3 * d)[..., :d]
    if path == "gpt2":
        return module.c_attn(hidden).split(module.split_size, dim=2)[0].view(b, n, -1, d)
    fused = module.query_key_value(hidden)  # Falcon, as its _split_heads
    if module.new_decoder_architecture:
        return fused.view(b, n, -1, module.num_heads // module.num_kv_heads + 2, d)[:, :, :, :-2].flatten(2, 3)
    if not module.multi_query:
        return fused.view(b, n, module.num_heads, 3, d)[..., 0, :]
    return fused.view(b, n, module.num_heads + 2, d)[..., :-2, :]


def attention_queries(module: nn.Module, hidden: torch.Tensor,
                      embeddings: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The module's queries of ``hidden`` ``[b, n, hidden]`` (its normed input), as its own forward computes them
    before attending: projection (``query_path``), q norm where the family puts it (OLMo2: over all heads before
    the head split; Qwen3, Gemma3, Cohere: per head; StableLM: per-head layer norms), then RoPE with
    ``embeddings`` (HF's ``(cos, sin)`` ``[b, n, rotary_dim]``; partial rotary: only the first ``rotary_dim`` dims
    of each head rotate; Cohere's interleaved pairs), none for GPT-2. Returns ``[b, h_q, n, d]``."""
    from kvshelf.reuse.rope import apply_rope

    path, d = query_path(module), attention_head_dim(module)
    b, n, _ = hidden.shape
    if path == "q_proj":
        q = module.q_proj(hidden)
        norm = getattr(module, "q_norm", None)
        if norm is not None and getattr(module, "use_qk_norm", True):
            weight = getattr(norm, "weight", None)
            if weight is not None and weight.dim() == 1 and weight.numel() == q.shape[-1] != d:
                q = norm(q).view(b, n, -1, d)  # OLMo2: one norm over every head's dims
            else:
                q = norm(q.view(b, n, -1, d))  # Qwen3, Gemma3, Cohere: per head
        else:
            q = q.view(b, n, -1, d)
    else:
        q = _fused_queries(module, hidden, path, d)
    q = q.transpose(1, 2)  # [b, h_q, n, d]
    if getattr(module, "qk_layernorm", False):
        q = module.q_layernorm(q)  # StableLM: per-head layer norms on [b, h_q, n, d]
    if path == "gpt2" or embeddings is None:
        return q
    cos, sin = (t.unsqueeze(1) for t in embeddings)  # [b, 1, n, rotary_dim]
    return apply_rope(q, cos.to(q.dtype), sin.to(q.dtype), rotary_dim=cos.shape[-1],
                      interleaved=_interleaved_rotation(type(module)))
