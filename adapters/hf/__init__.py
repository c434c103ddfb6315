"""Every touch of transformers internals, in one package.

Tested with transformers 5.23.0. ``pyproject.toml`` allows ``>=5.20,<5.24``: the adapters, reuse and xquant tests
(``tests/adapters``, the architecture suite included, ``tests/reuse``, ``tests/compress/test_xquant.py``) also pass
on 5.22.2 and 5.20.0. On 5.0.0 the architecture suite fails (171 of 1135: sliding-window cache layers without past
recording, bf16 cells, RAG on some families), so the lower bound is the oldest release tested; the upper bound
stops after the newest.

Elsewhere in ``kvshelf.adapters``, modules import only public transformers names (``PreTrainedModel``,
``PreTrainedTokenizerBase``, ``DynamicCache``, ``AutoModelForCausalLM``, config classes); nothing outside
``adapters`` imports transformers at all (``tests/adapters/test_hf_boundary.py`` checks both). When a transformers
release changes one of the contracts below, this package is what to fix (import its names from here:
``from kvshelf.adapters import hf; hf.NAME``):

* ``attention``: reading ``config._attn_implementation``, registering attention and mask functions
  (``AttentionInterface``, ``AttentionMaskInterface``), HF's ``sdpa_attention_forward`` and ``sdpa_mask``, and
  switching per call: ``DISPATCH``, an implementation that looks the one to run up in a ``ContextVar`` (the calling
  thread's choice) and otherwise runs the model's own, so one thread's switch never changes another's attention
  (``attention_scope``, ``attention_implementation``, ``switch_attention``);
* ``layer_types``, ``layers``, ``cache``, ``growing``: the attention type per layer; the ``layers`` list of a
  ``DynamicCache``, ``DynamicLayer`` (``lazy_initialization``, ``is_initialized``, ``keys`` / ``values``),
  ``DynamicSlidingWindowLayer``, state layers, and ``GrowingLayer``, kvshelf's ``DynamicLayer`` subclass for pruned
  caches; ``QuantizedCache``'s layers (for the codec benchmark's anchors);
* ``BaseStreamer``, the base class of ``generate``'s streamers (not exported at the top level);
* ``decoding``, ``rope``: the decoder: where it is (``get_decoder()`` / ``model.model``), its layers, final norm and
  rotary embedding (``inv_freq``, ``attention_scaling``, ``rope_type``), and the calling convention of a decoder
  layer;
* ``modules``, ``queries``: the attention modules' fields and projections, an attention module's forward hook, and
  its queries recomputed;
* ``prefill``: ``GenerationMixin._prefill``, the first step of ``generate``'s decoding loop, answered for one call
  from a prefill computed elsewhere (``prefilled``: the reuse engine's last prompt row).

Shapes: ``b`` batch, ``h`` KV heads (``h_q`` query heads), ``n`` tokens, ``d`` head dim.
"""

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation.streamers import BaseStreamer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvshelf.adapters.hf.attention import (
    DISPATCH,
    attention_implementation,
    attention_scope,
    attn_implementation,
    can_switch_attention,
    register_attention,
    supports_sdpa,
    switch_attention,
)
from kvshelf.adapters.hf.cache import (
    cache_bytes,
    cache_from_tensors,
    cache_of_layers,
    cache_tensors,
    dequantize_cache,
    fill_layer,
    new_cache,
    quantized_cache,
    set_cache_layer,
)
from kvshelf.adapters.hf.decoding import (
    batch_positions_follow_mask,
    decoder,
    decoder_layers,
    final_norm,
    input_embeddings,
    lm_logits,
    model_type,
    run_decoder_layer,
)
from kvshelf.adapters.hf.dynamic import HFConfig, HFModule
from kvshelf.adapters.hf.growing import DEFAULT_HEADROOM, GrowingLayer
from kvshelf.adapters.hf.layer_types import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    WINDOWED_ATTENTION,
    attention_layer_types,
)
from kvshelf.adapters.hf.layers import (
    bridge_layers,
    cache_layers,
    filled_layer_tensors,
    full_attention_layers,
    is_sliding_layer,
    is_state_only_layer,
    keep_sliding_history,
    layer_start,
    layer_states,
    layer_tensors,
    records_sliding_history,
    repeat_batch,
    set_layer_state,
    state_layers,
)
from kvshelf.adapters.hf.modules import (
    ATTENTION_MODULE_FIELDS,
    absolute_position_problem,
    attention_head_dim,
    attention_hook_inputs,
    attention_modules,
    attention_scaling,
    attention_softcap,
    eager_attention_function,
    kv_projection_weights,
    self_attention_modules,
    uses_attention_interface,
)
from kvshelf.adapters.hf.owned import LayerOwner, OwnedLayer
from kvshelf.adapters.hf.prefill import NOT_PREFILLED, Prefill, prefilled
from kvshelf.adapters.hf.queries import attention_queries, query_path
from kvshelf.adapters.hf.rope import Rotary, position_embeddings, rope_layer_types, rotaries, rotary
from kvshelf.adapters.hf.version import TESTED_VERSION

__all__ = [
    "HFConfig",
    "HFModule",
    "ATTENTION_MODULE_FIELDS", "DEFAULT_HEADROOM", "DISPATCH", "TESTED_VERSION", "BaseStreamer", "DynamicLayer",
    "DynamicSlidingWindowLayer", "GrowingLayer", "LayerOwner", "OwnedLayer", "Rotary", "attention_hook_inputs",
    "attention_implementation",
    "attention_scope", "attention_modules", "attn_implementation", "cache_bytes", "cache_from_tensors", "cache_layers",
    "cache_of_layers", "cache_tensors", "decoder", "decoder_layers", "dequantize_cache", "fill_layer", "final_norm",
    "full_attention_layers", "input_embeddings", "kv_projection_weights", "filled_layer_tensors",
    "layer_tensors", "lm_logits",
    "model_type", "new_cache", "position_embeddings", "rope_layer_types", "rotaries",
    "quantized_cache", "register_attention", "rotary", "run_decoder_layer",
    "sdpa_attention_forward", "set_cache_layer", "supports_sdpa", "switch_attention",
    "FULL_ATTENTION", "SLIDING_ATTENTION", "attention_layer_types", "bridge_layers", "is_sliding_layer",
    "keep_sliding_history", "layer_start", "records_sliding_history", "state_layers", "is_state_only_layer",
    "layer_states", "set_layer_state", "repeat_batch",
    "absolute_position_problem", "attention_head_dim", "attention_queries", "attention_scaling", "attention_softcap",
    "can_switch_attention", "eager_attention_function", "query_path", "self_attention_modules",
    "uses_attention_interface",
    "CHUNKED_ATTENTION", "WINDOWED_ATTENTION", "batch_positions_follow_mask",
    "NOT_PREFILLED", "Prefill", "prefilled",
]
