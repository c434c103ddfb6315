"""Tiny hybrid models (attention plus recurrent-state layers) from transformers' own config classes: hidden 64,
2-3 layers with at least one attention and one state layer, small state sizes (``adapters.hybrid``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers as tf

_BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "tie_word_embeddings": False}
_DELTA = {"head_dim": 16, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
          "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 16}

HYBRID_CONFIGS: dict[str, Callable[[], tf.PretrainedConfig]] = {
    "qwen3_next": lambda: tf.Qwen3NextConfig(**_BASE, **_DELTA, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                             decoder_sparse_step=1),
    "qwen3_5": lambda: tf.Qwen3_5TextConfig(**_BASE, **_DELTA),
    "nemotron_h": lambda: tf.NemotronHConfig(**_BASE, head_dim=16, num_hidden_layers=3, hybrid_override_pattern="M*-",
                                             mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                                             mamba_d_conv=4, chunk_size=16),
    "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(**_BASE, num_hidden_layers=2,
                                                          layer_types=["mamba", "attention"], **_MAMBA2,
                                                          num_local_experts=4, num_experts_per_tok=2),
    "lfm2": lambda: tf.Lfm2Config(**_BASE, num_hidden_layers=2, layer_types=["conv", "full_attention"],
                                  conv_L_cache=3),
    "bamba": lambda: tf.BambaConfig(**_BASE, num_hidden_layers=2, attn_layer_indices=[1], **_MAMBA2),
    "qwen3_5_moe": lambda: tf.Qwen3_5MoeTextConfig(**_BASE, **_DELTA, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "lfm2_moe": lambda: tf.Lfm2MoeConfig(**_BASE, num_hidden_layers=2, layer_types=["conv", "full_attention"],
                                         conv_L_cache=4, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32),
    "olmo_hybrid": lambda: tf.OlmoHybridConfig(**{**_DELTA, **_BASE}),
    "kimi_linear": lambda: tf.KimiLinearConfig(
        **{**_BASE, "num_key_value_heads": 4}, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"], moe_intermediate_size=32, num_experts=4, num_experts_per_token=2,
        num_shared_experts=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, head_dim=16, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4),
    "bailing_hybrid": lambda: tf.BailingHybridConfig(
        **{**_BASE, "num_key_value_heads": 4}, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"], layer_group_size=2, qk_head_dim=32, num_expert_group=1, topk_group=1,
        moe_intermediate_size=32, num_experts=4,
        num_experts_per_token=2, num_shared_experts=1, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, head_dim=16, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4),
    "jamba": lambda: tf.JambaConfig(**_BASE, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                    expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                                    num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8),
    "falcon_h1": lambda: tf.FalconH1Config(**_BASE, num_hidden_layers=2, mamba_d_ssm=128, mamba_n_heads=8,
                                           mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16),
    "zamba": lambda: tf.ZambaConfig(**_BASE, num_hidden_layers=3, attention_hidden_size=128, attention_head_dim=16,
                                    n_mamba_heads=2, mamba_d_state=8, mamba_dt_rank=8, attn_layer_period=6,
                                    attn_layer_offset=4,
                                    layers_block_type=["linear_attention", "linear_attention", "hybrid"]),
    "zamba2": lambda: tf.Zamba2Config(**_BASE, num_hidden_layers=3, mamba_d_state=8, n_mamba_heads=8,
                                      mamba_headdim=16, chunk_size=16, attention_head_dim=16,
                                      layers_block_type=["linear_attention", "linear_attention", "hybrid"]),
    "zaya": lambda: tf.ZayaConfig(**_BASE, num_hidden_layers=2, layer_types=["hybrid", "hybrid"], head_dim=16,
                                  moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1),
    "lfm3": lambda: tf.Lfm3Config(**_BASE, num_hidden_layers=3, head_dim=16, conv_L_cache=4, sliding_window=24,
                                  layer_types=["conv", "full_attention", "sliding_attention"]),
}
#: families served exactly (the rest are refused: ``adapters.states.NOT_EXACT``)
EXACT_HYBRIDS = ("qwen3_next", "qwen3_5", "nemotron_h", "granitemoehybrid", "lfm2", "qwen3_5_moe", "lfm2_moe",
                 "olmo_hybrid", "kimi_linear", "bailing_hybrid", "jamba", "falcon_h1", "zamba", "zamba2", "zaya",
                 "lfm3")


def hybrid_model(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> tf.PreTrainedModel:
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(HYBRID_CONFIGS[name](), dtype=dtype).eval()
