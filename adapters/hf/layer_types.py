"""The decoder's attention type per layer (full, sliding, chunked), as ``DynamicCache(config=...)`` builds its
layers.
"""

from __future__ import annotations

from transformers import PretrainedConfig

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
