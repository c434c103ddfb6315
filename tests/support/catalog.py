"""Every model type of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, placed (the suite follows
transformers).

Each model type is exactly one of:

* suite (``suite()``): a family of the hand-written architecture suite (``families.CONFIGS``), run through every
  path by the suites of ``tests/adapters/test_families_*.py``;
* built: a tiny random config made generically from the model type's own config class (``tiny_config``: hidden 64,
  2 layers or as many as its layer pattern needs, 4 heads / 2 KV heads, head dim 16, vocab 512, intermediate 128,
  4 experts, short convolutions, small states), plus what the family needs (``OVERRIDES``), keeping what makes it
  different; ``tests/adapters/test_families_catalog.py`` runs prefix reuse on each and compares the outcome with
  ``expected_catalog.EXPECTED``;
* ``EXCLUDED``: not run, with the reason, which is never kvshelf's (multimodal-only, encoder-decoder or encoder
  models, a config transformers itself cannot build or run on CPU in fp32, a package that is not installed).

``test_families_catalog.py`` fails, naming them, when transformers maps a model type the catalog does not place,
or the catalog names one transformers no longer has.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 512
MAX_PARAMS = 20_000_000  # a tiny model of the catalog has at most this many parameters


@functools.cache
def suite() -> dict[str, str]:
    """model type -> the first ``families.CONFIGS`` id of that model type (the hand-written suite runs it)."""
    from families import CONFIGS

    out: dict[str, str] = {}
    for family, make in CONFIGS.items():
        out.setdefault(make().get_text_config(decoder=True).model_type, family)
    return out


_MULTIMODAL = "multimodal-only: its causal-LM class takes a vision/audio config (the text model is {text})"
_ENCODER = "an encoder (masked LM) with a causal-LM head for encoder-decoder use, not a decoder-only family"
_ENC_DEC = "the decoder half of an encoder-decoder (its causal-LM class is that decoder)"

#: model type -> why it is not built (never a kvshelf limitation)
EXCLUDED: dict[str, str] = {
    **{t: _MULTIMODAL.format(text=text) for t, text in {
        "dots3_note": "dots3_note_text", "emu3": "none in transformers", "fuyu": "none in transformers",
        "gemma3": "gemma3_text", "gemma3n": "gemma3n_text", "gemma4": "gemma4_text",
        "gemma4_unified": "gemma4_unified_text", "git": "none in transformers", "got_ocr2": "none in transformers",
        "llama4": "llama4_text", "mllama": "none in transformers", "moss_transcribe_diarize": "none in transformers",
        "phi4_multimodal": "none in transformers", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
        "qwen4_exp": "qwen4_exp_text",
    }.items()},
    **{t: "audio-only: a decoder over parallel audio codebooks ([batch * codebooks, tokens] inputs), "
          "conditioned on an encoder's output" for t in ("musicgen", "musicgen_melody")},
    **{t: "a speculative-decoding assistant: it reads its backbone model's hidden states and KV cache (bidirectional "
          "masks); not a standalone causal LM" for t in ("gemma4_assistant", "gemma4_unified_assistant")},
    "blt": "a config transformers itself cannot run with a cache: BltForCausalLM.generate (and forward with "
           "use_cache) builds DynamicCache(config=BltConfig), which reads num_hidden_layers, a field BltConfig does "
           "not have (AttributeError in transformers 5.23, for any BLT config; the tiny one in OVERRIDES runs "
           "without a cache)",
    **{t: _ENC_DEC for t in ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp",
                             "pegasus", "plbart", "prophetnet", "whisper")},
}

#: model type -> config kwargs merged over the generic tiny sizes (what the family needs to build and run)
OVERRIDES: dict[str, dict[str, Any]] = {
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "dots3_note_text": {"num_key_value_heads": 4, "head_dim": 32, "index_n_heads": 2, "index_head_dim": 16,
                        "index_topk": 16, "shared_experts_intermediate_size": 32, "per_layer_config": {"2": {
                            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
                            "head_dim": 48, "qk_nope_head_dim": 32, "v_head_dim": 16, "qk_rope_head_dim": 16}}},
    "gemma3n_text": {"num_hidden_layers": 10, "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 2,
                     "num_kv_shared_layers": 5, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
                     "laurel_rank": 8, "sliding_window": 24},
    "gemma4_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 24},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # its default config has no conv layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "jamba": {"num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "zaya": {"num_experts_per_tok": 1},
    "xmod": {"default_language": "en_XX"},
    "mamba2": {"num_heads": 8},
    "blt": {"vocab_size": 260, "encoder_hash_byte_group_vocab": 512, "cross_attn_k": 2, "patch_in_forward": False,
            **{f"{part}_config": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "num_hidden_layers": 2, "intermediate_size": 128, "head_dim": 16,
                                  **({"hidden_size_global": 64} if part in ("encoder", "decoder") else {})}
               for part in ("patcher", "encoder", "decoder", "global")}},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 24,
                            "rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0}
                                                for t in ("full_attention", "sliding_attention")}},
    "qwen4_exp_text": {"indexer_budget": 16, "indexer_compress_ratio": 4, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                       "indexer_head_dim": 16, "hc_lowrank": 16, "ple_embed_dim": 64, "ngram_vocab_size_base": 512,
                       "split_ngram_parts": 4, "make_ngram_vocab_size_divisible_by": 8},
    "reformer": {"is_decoder": True, "axial_pos_embds": False, "attn_layers": ["local", "local"],
                 "local_attn_chunk_length": 16, "attention_head_size": 16, "feed_forward_size": 128},
    "xlstm": {"embedding_dim": 64, "num_blocks": 2, "num_heads": 4, "qk_dim_factor": 1.0},
}

# -- the generic tiny config --------------------------------------------------------------------------------

#: generic size fields (under any of their names) -> tiny value
_SIZES: dict[tuple[str, ...], Any] = {
    ("vocab_size",): VOCAB,
    ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "n_embed"): 64,
    ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "intermediate_size_mlp"): 128,
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers"): 2,
    ("num_attention_heads", "n_head", "num_heads", "n_heads"): 4,
    ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"): 2,
    ("head_dim", "kv_channels", "attention_head_dim"): 16,
    ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"): 4096,
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"): 4,
    ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k"): 2,
    ("moe_intermediate_size", "expert_intermediate_size"): 32,
    ("shared_expert_intermediate_size",): 32,
    ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"): 1,
    ("first_k_dense_replace",): 1,
    ("n_group",): 1,
    ("topk_group",): 1,
    ("conv_kernel", "d_conv", "mamba_d_conv", "conv_L_cache", "linear_conv_kernel_dim", "short_conv_kernel_size"): 4,
    ("state_size", "d_state", "ssm_state_size", "mamba_d_state"): 8,
    ("mamba_n_heads",): 8,
    ("mamba_head_dim", "mamba_headdim"): 16,
    ("mamba_n_groups", "n_groups"): 1,
    ("time_step_rank", "mamba_dt_rank", "dt_rank"): 8,
    ("linear_num_key_heads",): 2,
    ("linear_num_heads",): 4,
    ("linear_head_dim",): 16,
    ("linear_num_value_heads",): 4,
    ("linear_key_head_dim",): 16,
    ("linear_value_head_dim",): 16,
    ("q_lora_rank",): 32,
    ("kv_lora_rank",): 32,
    ("qk_nope_head_dim",): 16,
    ("qk_rope_head_dim",): 16,
    ("v_head_dim",): 16,
    ("pad_token_id",): 0,
    ("bos_token_id",): 1,
    ("eos_token_id",): 2,
}


def _fields(config: tf.PretrainedConfig) -> set[str]:
    names = set(config.to_dict())
    names |= set(getattr(config, "attribute_map", {}) or {})
    with contextlib.suppress(TypeError, ValueError):
        names |= set(inspect.signature(type(config).__init__).parameters)
    return names


def _layer_pattern(types: list[str], minimum: int = 2) -> list[str]:
    """The shortest prefix of ``types`` holding every distinct layer type (at least ``minimum`` layers)."""
    distinct = set(types)
    for n in range(minimum, len(types) + 1):
        if set(types[:n]) == distinct:
            return list(types[:n])
    return list(types)


def tiny_config(model_type: str) -> tf.PretrainedConfig:
    """The tiny random config of ``model_type`` (its own config class, generic tiny sizes, ``OVERRIDES``)."""
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    fields = _fields(default)
    kwargs: dict[str, Any] = {}
    for names, value in _SIZES.items():
        for name in names:
            if name in fields:
                kwargs[name] = value
    if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:  # MLA: the rotary part is the head dim of RoPE
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    if "kv_lora_rank" in kwargs:  # MLA: every query head has its own decompressed K and V
        for name in ("num_key_value_heads", "num_kv_heads"):
            if name in kwargs:
                kwargs[name] = kwargs.get("num_attention_heads", 4)
    types = getattr(default, "layer_types", None)
    if isinstance(types, list | tuple) and types:
        pattern = _layer_pattern([str(t) for t in types])
        if not isinstance(getattr(cls, "layer_types", None), property):  # else derived from other fields
            kwargs["layer_types"] = pattern
        for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if name in kwargs:
                kwargs[name] = len(pattern)
    if "is_decoder" in fields:  # an encoder's causal-LM head runs it as a decoder (causal attention, a KV cache)
        kwargs["is_decoder"] = True
    kwargs["tie_word_embeddings"] = False if "tie_word_embeddings" in fields else kwargs.get("tie_word_embeddings")
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    attribute_map = getattr(cls, "attribute_map", {}) or {}
    kwargs = {k: v for k, v in kwargs.items()  # a property derived from other fields cannot be set
              if not isinstance(getattr(cls, attribute_map.get(k, k), None), property)}
    kwargs.update(OVERRIDES.get(model_type, {}))
    extra = kwargs.pop("_post", None)
    config = cls(**kwargs)
    if callable(extra):
        extra(config)
    return config


def tiny_model(model_type: str, *, attn: str = "sdpa", dtype: torch.dtype = torch.float32,
               seed: int = 0) -> tf.PreTrainedModel:
    """The tiny random causal LM of ``model_type`` (seeded, eval mode); ``attn`` falls back to eager where the
    class has no sdpa."""
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    if attn == "sdpa" and not has_sdpa(model_type):
        attn = "eager"
    with torch.device("meta"):  # sized before any memory is taken: a config that is not tiny fails here
        params = sum(p.numel() for p in tf.AutoModelForCausalLM.from_config(config).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"{model_type}: the tiny config has {params} parameters (> {MAX_PARAMS})")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval()


def model_class(model_type: str) -> type:
    """The causal-LM class transformers maps ``model_type`` to."""
    return getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def has_sdpa(model_type: str) -> bool:
    """Whether the family's causal-LM class has an sdpa attention (else the catalog runs it with eager)."""
    return bool(getattr(model_class(model_type), "_supports_sdpa", False))


def model_types() -> list[str]:
    """The model types transformers maps to a causal-LM class (the catalog's universe)."""
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def built() -> list[str]:
    """The model types the catalog builds from a tiny config (neither in the suite nor excluded)."""
    return [t for t in model_types() if t not in suite() and t not in EXCLUDED]
