"""Model-level checks of a path's support, before any work (the suite follows transformers).

``check_supported`` (``cache_bridge``) judges a config; some causal LMs of transformers pass it and still have no
KV cache kvshelf can store, which only the model shows:

* a model whose ``forward`` takes no ``past_key_values`` (GPT-1, XLM, XLNet's ``mems``, Reformer's buckets):
  ``generate`` returns no cache, so nothing could ever be stored or reused;
* an encoder (BERT, RoBERTa...) whose config has ``is_decoder=False``: it attends bidirectionally, so no prefix's
  KV stays valid;
* a model that prepends learned prompt tokens to every input (CPM-Ant's ``prompt_length``): its cache entries
  are not the prompt's tokens;
* a model whose layers differ in KV heads or head dim (Gemma 4's per-layer attention geometry, MiMo-V2-Flash's
  sliding layers with more KV heads): a block is ``[layers, kv_heads, tokens, head_dim]``, one shape for all
  layers.

``check_model_supported`` raises ``UnsupportedModelError`` naming the model type and the feature.
"""

from __future__ import annotations

import inspect
from typing import Any

from kvshelf.kvstore.errors import UnsupportedModelError

#: per-layer config attributes that make the KV cache's shape differ between layers
_GEOMETRY = ("head_dim", "num_key_value_heads", "global_head_dim", "num_global_key_value_heads")


def _model_type(model: Any) -> str:
    config = model.config
    text = config.get_text_config(decoder=True)
    return getattr(text, "model_type", None) or getattr(config, "model_type", "?")


def check_per_layer_geometry(text: Any, refuse: str) -> None:
    """Raise ``UnsupportedModelError`` (``refuse``: "FEATURE does not support model type 'X'") for a text config
    whose KV heads or head dim are set per layer (Gemma 4's ``per_layer_attributes``): reading them globally is an
    error in transformers, and a block has one shape for every layer. A config-only check (``check_supported``
    runs it for every path)."""
    per_layer = sorted(set(getattr(text, "per_layer_attributes", None) or ()) & set(_GEOMETRY))
    if per_layer:
        raise UnsupportedModelError(f"{refuse}: its attention geometry (KV heads, head dim) is set per layer "
                                    f"({per_layer}); kvshelf's blocks have one shape for every layer")


def _bidirectional(model: Any) -> bool:
    """Whether a module of the model was built as an encoder: its ``is_decoder`` (BERT-style layers) or an
    attention's ``is_causal`` is ``False`` (GPT-NeoX's config has ``is_decoder=False`` too, but no module reads
    it)."""
    return any(getattr(m, "is_decoder", None) is False or getattr(m, "is_causal", None) is False
               for m in model.modules())


def check_model_supported(model: Any, feature: str) -> None:
    """Raise ``UnsupportedModelError`` (model type, feature) for a model without a KV cache kvshelf can store as
    blocks: no ``past_key_values`` in its ``forward``, or layers of different KV heads / head dims."""
    refuse = f"{feature} does not support model type {_model_type(model)!r}"
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "past_key_values" not in params:
        raise UnsupportedModelError(f"{refuse}: its forward takes no past_key_values (it keeps no KV cache that "
                                    "kvshelf can store)")
    text = model.config.get_text_config(decoder=True)
    if getattr(text, "is_decoder", True) is False and _bidirectional(model):  # BERT-style: encoder unless decoder
        raise UnsupportedModelError(f"{refuse}: its config has is_decoder=False, so it attends bidirectionally (a "
                                    "later token changes an earlier one's KV); load it with is_decoder=True to "
                                    "use it as a causal LM")
    if int(getattr(text, "prompt_length", 0) or 0) > 0:  # CPM-Ant
        raise UnsupportedModelError(f"{refuse}: it prepends {text.prompt_length} learned prompt tokens to every "
                                    "input, so its cache holds more entries than tokens (cache index != token "
                                    "position)")
    check_per_layer_geometry(text, refuse)
    widths = set()
    layers = getattr(getattr(model, "model", None), "layers", None) or ()
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        k_proj = getattr(attn, "k_proj", None)
        weight = getattr(k_proj, "weight", None)
        if weight is not None and getattr(weight, "dim", lambda: 0)() == 2:
            widths.add(int(weight.shape[0]))
    if len(widths) > 1:
        raise UnsupportedModelError(f"{refuse}: its layers' key projections differ in width ({sorted(widths)}: "
                                    "KV heads or head dim per layer); kvshelf's blocks have one shape for every "
                                    "layer")
