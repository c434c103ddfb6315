"""Random-weight models of real models' shapes, for timing and sizing where the weights cannot be had here.

A *shaped* model has the layer pattern, hidden size and head sizes of a published model, built from transformers'
own config class with random weights (seeded): its TTFT and KV (or state) bytes are those of the real model, its
outputs are not. ``NAME-shaped`` builds every layer; ``NAME-shaped:N`` builds the first ``N`` layers of the pattern
(a hybrid keeps its mix of layer types), to keep a CPU run within minutes. The tokenizer is the bundled SmolLM2's:
its ids (< 49,152) are valid for every shape here, and only the token count matters for timing.

Where a public model card gives only some fields, the others are the family's defaults in transformers (noted per
shape in ``SHAPES``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers as tf
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters.bundled import BUNDLED_MODELS, convert_bundled
from kvshelf.kvstore.errors import ModelLoadError

SUFFIX = "-shaped"


def _smollm2_135m() -> PretrainedConfig:
    """SmolLM2-135M: Llama, 30 layers, hidden 576, 9 heads, 3 KV heads, head dim 64."""
    return tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                          tie_word_embeddings=True)


def _llama3_8b() -> PretrainedConfig:
    """Llama-3-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128, llama3 RoPE."""
    return tf.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192})


def _qwen35_08b() -> PretrainedConfig:
    """Qwen3.5-0.8B (the smallest Qwen3.5): 24 layers, 3 gated delta-net layers then one full-attention layer
    (6 of them), hidden 1024, 8 heads, 2 KV heads, head dim 256 (the family's). Its linear-attention head sizes
    (16 key and 16 value heads of 128) are the family's defaults scaled to its width: the model card gives layers,
    hidden size and attention heads only."""
    return tf.Qwen3_5TextConfig(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                                linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                                linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
                                max_position_embeddings=262144, tie_word_embeddings=True)


def _qwen3_next_80b() -> PretrainedConfig:
    """Qwen3-Next-80B-A3B: 48 layers (3 gated delta-net, 1 full attention), hidden 2048, 16 heads, 2 KV heads,
    head dim 256, linear attention 16 key / 32 value heads of 128, 512 experts of 512 (10 active + 1 shared)."""
    return tf.Qwen3NextConfig(vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
                              num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                              num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12,
                              max_position_embeddings=262144)


def _deepseek_v3() -> PretrainedConfig:
    """DeepSeek-V3 (671B): 61 layers of multi-head latent attention, 128 heads, keys of 128 + 64 (RoPE) dims and
    values of 128 per head, from a latent of 512 + 64 per token (what transformers caches), 256 experts."""
    return tf.DeepseekV3Config()


#: shape name -> config factory (the published model's shape; see each factory's docstring)
SHAPES: dict[str, Callable[[], PretrainedConfig]] = {
    "smollm2-135m": _smollm2_135m,
    "llama3-8b": _llama3_8b,
    "qwen3.5-0.8b": _qwen35_08b,
    "qwen3-next-80b": _qwen3_next_80b,
    "deepseek-v3": _deepseek_v3,
}


def is_shaped(name: str) -> bool:
    """Whether ``name`` names a shaped model (``NAME-shaped`` or ``NAME-shaped:N``)."""
    return name.split(":", 1)[0].endswith(SUFFIX)


def shaped_config(name: str) -> PretrainedConfig:
    """The config of ``NAME-shaped[:N]``: the published shape, cut to its first ``N`` layers when given."""
    base, _, layers = name.partition(":")
    shape = base.removesuffix(SUFFIX)
    if not base.endswith(SUFFIX) or shape not in SHAPES:
        raise ModelLoadError(f"unknown shaped model {name!r}; known: "
                             f"{', '.join(s + SUFFIX for s in SHAPES)} (optionally ':LAYERS')")
    config = SHAPES[shape]()
    if layers:
        if not layers.isdigit() or not 1 <= int(layers) <= config.num_hidden_layers:
            raise ModelLoadError(f"{name!r}: the layer count must be 1..{config.num_hidden_layers}, got {layers!r}")
        _cut_layers(config, int(layers))
    return config


def _cut_layers(config: PretrainedConfig, layers: int) -> None:
    """Keep the first ``layers`` layers of ``config``'s pattern."""
    config.num_hidden_layers = layers
    layer_types: Any = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):
        config.layer_types = layer_types[:layers]
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = min(config.first_k_dense_replace, layers)


def load_shaped(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", *,
                seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` of ``NAME-shaped[:N]``: random weights (seeded) in eval mode, SmolLM2's tokenizer."""
    config = shaped_config(name)
    torch.manual_seed(seed)
    with torch.device(device):  # the weights are made where they are used (an 8B model in seconds on a GPU)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(convert_bundled(next(iter(BUNDLED_MODELS)))),
                                                 local_files_only=True)
    return model.eval(), tokenizer
