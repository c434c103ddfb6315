"""Shaped random-weight models (``adapters.shaped``): the published shapes, cut to N layers, loaded by name."""

from __future__ import annotations

import pytest
import torch

from kvshelf.adapters.model import load_model
from kvshelf.adapters.shaped import SHAPES, is_shaped, shaped_config
from kvshelf.kvstore.errors import ModelLoadError


def test_every_shape_builds_its_config():
    for name in SHAPES:
        config = shaped_config(f"{name}-shaped")
        assert config.num_hidden_layers > 0 and config.hidden_size > 0


def test_published_shapes():
    llama = shaped_config("llama3-8b-shaped")
    assert (llama.num_hidden_layers, llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads,
            llama.hidden_size // llama.num_attention_heads) == (32, 4096, 32, 8, 128)
    qwen = shaped_config("qwen3.5-0.8b-shaped")
    assert (qwen.num_hidden_layers, qwen.hidden_size, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.head_dim) == (24, 1024, 8, 2, 256)
    assert qwen.layer_types.count("full_attention") == 6 and qwen.layer_types[3] == "full_attention"
    deepseek = shaped_config("deepseek-v3-shaped")
    assert (deepseek.num_attention_heads, deepseek.qk_nope_head_dim + deepseek.qk_rope_head_dim,
            deepseek.v_head_dim, deepseek.kv_lora_rank, deepseek.qk_rope_head_dim) == (128, 192, 128, 512, 64)


def test_a_cut_keeps_the_layer_pattern():
    config = shaped_config("qwen3.5-0.8b-shaped:8")
    assert config.num_hidden_layers == 8
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2


@pytest.mark.parametrize("name", ["nope-shaped", "llama3-8b-shaped:0", "llama3-8b-shaped:33", "llama3-8b-shaped:x"])
def test_bad_names_are_model_load_errors(name):
    assert is_shaped(name)
    with pytest.raises(ModelLoadError):
        shaped_config(name)


def test_load_model_builds_a_shaped_model_with_a_tokenizer():
    model, tokenizer = load_model("smollm2-135m-shaped:2")
    assert model.config.num_hidden_layers == 2 and not model.training
    ids = torch.tensor([tokenizer("a shaped model")["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], 49152)
