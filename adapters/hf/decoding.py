"""The decoder: where it is (``get_decoder()`` / ``model.model``), its layers, final norm, input embeddings and LM
head as its own forward applies them, running one decoder layer, and how a batch's positions follow its mask.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from kvshelf.kvstore.errors import UnsupportedModelError


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
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no output embeddings (an LM head) to compute logits")
    logits = head(normed)
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


_CACHE_ARGUMENTS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def _cache_argument(layer: nn.Module) -> str:
    """The name a decoder layer takes its cache under: ``past_key_values``, or GPT-NeoX's ``layer_past`` (read
    from the signature once per layer: ``inspect.signature`` per layer call cost a reuse call milliseconds)."""
    name = _CACHE_ARGUMENTS.get(layer)
    if name is None:
        params = inspect.signature(layer.forward).parameters
        name = "layer_past" if "layer_past" in params and "past_key_values" not in params else "past_key_values"
        _CACHE_ARGUMENTS[layer] = name
    return name
