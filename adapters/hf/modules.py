"""Attention modules: finding each decoder layer's self-attention module in any layout kvshelf knows (Llama-style,
GPT-NeoX, Falcon, GPT-2), and reading their fields (projections, head dim, scaling, soft cap, eager function,
whether they call transformers' attention interface) and forward hooks' inputs.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from kvshelf.adapters.hf.dynamic import HFModule
from kvshelf.kvstore.errors import UnsupportedModelError

#: what kvshelf reads of an attention module: its projections, head dim, GQA group size and layer index
ATTENTION_MODULE_FIELDS = ("q_proj", "k_proj", "v_proj", "head_dim", "num_key_value_groups", "layer_idx")


def attention_modules(model: HFModule) -> list[HFModule]:
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


def kv_projection_weights(model: HFModule) -> list[tuple[torch.Tensor, torch.Tensor]]:
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


def self_attention_modules(model: HFModule, *, some: bool = False) -> list[HFModule]:
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


def attention_head_dim(module: HFModule) -> int:
    """An attention module's head dim (``head_dim``, GPT-NeoX's ``head_size``)."""
    return int(getattr(module, "head_dim", None) or module.head_size)


def attention_scaling(module: HFModule) -> float:
    """The factor an attention module multiplies ``q @ k^T`` by: its ``scaling`` (Granite's ``attention_multiplier``,
    Gemma 2/3's ``query_pre_attn_scalar ** -0.5``, GPT-2's per-layer scaling...), Falcon's ``inv_norm_factor``."""
    for name in ("scaling", "inv_norm_factor"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise UnsupportedModelError(f"attention module {type(module).__name__} has no attention scaling kvshelf reads")


def attention_softcap(module: HFModule) -> float | None:
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


def eager_attention_function(module: HFModule) -> Callable[..., Any]:
    """The eager attention function of the module's modeling file (what it runs under ``attn_implementation=
    "eager"``): ``(module, query, key, value, additive_mask, scaling=..., dropout=..., [softcap=...]) ->
    (output [b, q, h_q, d], weights)``."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if not callable(function):
        raise UnsupportedModelError(f"attention module {type(module).__name__}: no eager attention function")
    return function


def uses_attention_interface(module: HFModule) -> bool:
    """Whether the module's forward calls transformers' attention interface (so a registered attention function
    sees its queries), rather than its own attention code (Falcon's)."""
    return _calls_interface(type(module))


@functools.cache
def _calls_interface(cls: type) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
