"""The architecture suite's model families: tiny random-weight models built from transformers' own config classes.

Every family is a small decoder (2-4 layers, hidden 64, 4 query heads, 2 KV heads where the family has GQA,
head dim 16, vocab 512) built with ``AutoModelForCausalLM.from_config``: no download, a fraction of a second each.
Each keeps what makes its family different from Llama (sliding windows, partial or interleaved rotary,
multipliers, norms on q/k, MoE, no RoPE...), so a path that is exact on Llama but wrong elsewhere shows up here.

``FAMILIES`` maps a family id to a function ``(attn_implementation, dtype) -> model``; ``family_model(name)``
builds one (seeded) in eval mode. ``window`` in ``WINDOWED`` is the sliding window of families that have one
(prompts in the suite are longer than it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers as tf

VOCAB = 512
WINDOW = 24  # sliding window of the windowed families: shorter than the suite's prompts
_BASE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


#: what makes a config MLA, kept tiny: a q and a kv LoRA rank, keys of nope + rope dims, values of another dim
_MLA: dict[str, Any] = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                        "v_head_dim": 16}


def _rope(theta: float = 10000.0, **extra: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **extra}}


def _llama(**over: Any) -> tf.PretrainedConfig:
    return tf.LlamaConfig(**{**_BASE, **over})


#: family id -> config factory (kwargs of the base config merged with the family's own)
CONFIGS: dict[str, Callable[[], tf.PretrainedConfig]] = {
    "llama": lambda: _llama(),
    "llama-linear": lambda: _llama(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "llama-dynamic": lambda: _llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "llama-llama3": lambda: _llama(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "llama-yarn": lambda: _llama(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}),
    "llama-longrope": lambda: _llama(max_position_embeddings=4096, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}),
    "qwen2": lambda: tf.Qwen2Config(**_BASE),
    "qwen2-window": lambda: tf.Qwen2Config(**_BASE, use_sliding_window=True, sliding_window=WINDOW,
                                           max_window_layers=1),
    "qwen3": lambda: tf.Qwen3Config(**_BASE, head_dim=16),
    "qwen2-moe": lambda: tf.Qwen2MoeConfig(**_BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32),
    "qwen3-moe": lambda: tf.Qwen3MoeConfig(**_BASE, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32),
    "mistral": lambda: tf.MistralConfig(**_BASE, sliding_window=WINDOW),
    "mixtral": lambda: tf.MixtralConfig(**_BASE, num_local_experts=4, num_experts_per_tok=2),
    "gemma": lambda: tf.GemmaConfig(**_BASE, head_dim=16),
    "gemma2": lambda: tf.Gemma2Config(**_BASE, head_dim=16, sliding_window=WINDOW),
    "gemma3": lambda: tf.Gemma3TextConfig(**{**_BASE, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW,
                                          sliding_window_pattern=2),
    "gemma3-full": lambda: tf.Gemma3TextConfig(**_BASE, head_dim=16, layer_types=["full_attention"] * 2),
    "phi3": lambda: tf.Phi3Config(**_BASE),
    "phi3-partial": lambda: tf.Phi3Config(**_BASE, partial_rotary_factor=0.5),
    "olmo2": lambda: tf.Olmo2Config(**_BASE),
    "stablelm": lambda: tf.StableLmConfig(**_BASE),
    "gpt-neox": lambda: tf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=4096, rotary_pct=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False),
    "cohere": lambda: tf.CohereConfig(**_BASE, logit_scale=0.5),
    "granite": lambda: tf.GraniteConfig(**_BASE, embedding_multiplier=2.0, logits_scaling=4.0,
                                        residual_multiplier=0.5, attention_multiplier=0.2),
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=4096,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # Llama 4: chunked attention (a chunk of WINDOW tokens) on 3 layers of 4, the 4th full attention without RoPE
    # (NoPE) and with attention temperature tuning by position (floor_scale small enough that the suite's positions
    # change it), MoE on every layer
    "llama4": lambda: tf.Llama4TextConfig(**{**_BASE, "num_hidden_layers": 4}, head_dim=16, intermediate_size_mlp=128,
                                          num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=WINDOW,
                                          no_rope_layers=[1, 1, 1, 0], floor_scale=16, attn_scale=0.1),
    "falcon": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_kv_heads=2, new_decoder_architecture=True, max_position_embeddings=4096,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # MLA (multi-head latent attention): low-rank q and kv projections, keys of nope + rope dims, values of another
    # dim; the cache holds the compressed latent (one head: "keys" kv_lora_rank = 32 wide, "values" the shared
    # rotated key part, qk_rope_head_dim = 8), so a block's K and V differ in head dim; a small MoE
    "deepseek-v2": lambda: tf.DeepseekV2Config(**{**_BASE, "num_key_value_heads": 4}, **_MLA, n_routed_experts=4,
                                               num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                                               first_k_dense_replace=1, n_group=1, topk_group=1),
    "deepseek-v3": lambda: tf.DeepseekV3Config(**{**_BASE, "num_key_value_heads": 4}, **_MLA, n_routed_experts=4,
                                               num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                                               first_k_dense_replace=1, n_group=1, topk_group=1),
    "minicpm3": lambda: tf.MiniCPM3Config(**{**_BASE, "num_key_value_heads": 4}, **_MLA,
                                          dim_model_base=16),  # logits scaled down (hidden / 16) as in the real one
}
#: MLA families (keys and values of different head dims)
MLA = frozenset({"deepseek-v2", "deepseek-v3", "minicpm3"})
#: families with sliding-window layers (all or some)
WINDOWED = frozenset({"qwen2-window", "mistral", "gemma2", "gemma3", "llama4"})
#: families whose HF class has no sdpa attention (the suite runs them with eager only)
NO_SDPA = frozenset({"gemma2"})


def attn_implementations(name: str) -> tuple[str, ...]:
    """The attention implementations the suite runs family ``name`` with."""
    return ("eager",) if name in NO_SDPA else ("sdpa", "eager")


def family_model(name: str, *, attn: str = "sdpa", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> tf.PreTrainedModel:
    """The tiny random model of family ``name`` (seeded), in eval mode, with attention implementation ``attn``."""
    config = CONFIGS[name]()
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval()
