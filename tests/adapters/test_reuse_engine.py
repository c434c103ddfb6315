"""The layer-by-layer engine behind RAG reuse and prompt modules (tiny random Llama, fast): grouped causal
queries, GQA-folded attention, K/V-only layers (CacheBlend's selection), contiguous fills, the bench's needle."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import token_ids
from transformers import DynamicCache

from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.rag import RAGGenerator
from kvshelf.adapters.reuse_engine import (
    Layout,
    contiguous_span,
    embed,
    folded_attention,
    folded_gqa_attention,
    layer_kv,
    run_layers,
)
from kvshelf.bench.rag import NEEDLE, answer_code, plant
from kvshelf.reuse.masks import causal_mask


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, layers=4)


def _full_cache(model, ids: list[int]) -> DynamicCache:
    return model(input_ids=torch.tensor([ids]), use_cache=True, past_key_values=DynamicCache(config=model.config),
                 ).past_key_values


def test_contiguous_span():
    assert contiguous_span(torch.arange(3, 9)) == slice(3, 9)
    assert contiguous_span(torch.tensor([1, 2, 4])) is None
    assert contiguous_span(torch.tensor([2, 1, 3])) is None
    assert contiguous_span(torch.zeros(0, dtype=torch.long)) is None


@pytest.mark.parametrize("group_rows", [None, 5, 16])
def test_grouped_and_plain_run_layers_equal_full_prefill(model, group_rows):
    """Rows 0..n computed through the layout (plain causal prefill, or explicit-mask groups) give the KV of a
    plain model forward."""
    ids = token_ids(40)
    cache = _full_cache(model, ids)
    layers = range(model.config.num_hidden_layers)
    rows = torch.arange(len(ids))
    for mask in (None, causal_mask(rows, len(ids), model.dtype)):
        layout = Layout.empty(model, len(ids), zero=False)
        run_layers(model, layout, embed(model, ids), rows, rows, mask, layers, group_rows=group_rows)
        for layer, (k, v) in enumerate(zip(layout.keys, layout.values, strict=True)):
            assert torch.allclose(k, cache.layers[layer].keys, atol=1e-5)
            assert torch.allclose(v, cache.layers[layer].values, atol=1e-5)


def test_scattered_groups_equal_one_group(model):
    """Scattered query rows (CacheBlend's chosen tokens) in causal groups equal the same rows in one group."""
    ids = token_ids(50, 2)
    cache = _full_cache(model, ids)
    chosen = torch.tensor([3, 4, 11, 20, 21, 22, 30, 41, 47, 49])
    results = []
    for group_rows in (None, 3):
        layout = Layout.empty(model, len(ids))
        layout.fill(0, torch.stack([layer.keys[0] for layer in cache.layers]),
                    torch.stack([layer.values[0] for layer in cache.layers]))
        hidden = run_layers(model, layout, embed(model, [ids[i] for i in chosen]), chosen, chosen, None,
                            range(model.config.num_hidden_layers), group_rows=group_rows)
        results.append(hidden)
    assert torch.allclose(results[0], results[1], atol=1e-5)


def test_folded_gqa_attention_equals_sdpa(model):
    attn = model.model.layers[0].self_attn
    q, n = 6, 10
    query, key, value = torch.randn(1, 4, q, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    mask = causal_mask(torch.arange(n - q, n), n)
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=mask).transpose(1, 2)
    for given in (mask, mask.repeat(1, 1, 2, 1)):  # plain, or already tiled for the folded heads
        out, _ = folded_gqa_attention(attn, query, key, value, given, scaling=None)
        assert out.shape == (1, q, 4, 16)
        assert torch.allclose(out, reference, atol=1e-5)
    with folded_attention(model) as tiles:
        assert tiles == 2 and model.config._attn_implementation != "sdpa"
    assert model.config._attn_implementation == "sdpa"


def test_layer_kv_is_the_layers_own_kv(model):
    """CacheBlend's selection needs only a layer's K/V projections: they equal that layer's cache entries."""
    ids = token_ids(30, 3)
    cache = _full_cache(model, ids)
    layout = Layout.empty(model, len(ids))
    rows = torch.arange(len(ids))
    hidden = run_layers(model, layout, embed(model, ids), rows, rows, None, range(2))
    k, v = layer_kv(model, 2, hidden, rows)
    assert torch.allclose(k, cache.layers[2].keys, atol=1e-5)
    assert torch.allclose(v, cache.layers[2].values, atol=1e-5)


def test_blend_full_ratio_restores_every_layer(model):
    """With r = 100% the blended cache is the full prefill's cache at every layer and row (the last layer's
    chunk rows come from K/V projections only)."""
    chunks, prefix, question = [token_ids(20, 4), token_ids(30, 5)], token_ids(5, 6), token_ids(7, 7)
    rag = RAGGenerator(model, None, None, prefix=prefix, recompute_ratio=1.0)
    full = rag.generate(chunks, question, mode="full", max_new_tokens=6, eos_token_id=None)
    blend = rag.generate(chunks, question, mode="reuse-blend", max_new_tokens=6, eos_token_id=None)
    assert blend.new_ids == full.new_ids and blend.recomputed_tokens == 50
    assert torch.allclose(blend.first_logits, full.first_logits, atol=1e-4)
    partial = RAGGenerator(model, None, None, prefix=prefix, select_layer=3)  # selection at the last layer
    assert partial.generate(chunks, question, mode="reuse-blend", max_new_tokens=2).recomputed_tokens == 8


def test_needle_is_its_own_paragraph_and_answers_are_exact():
    text = "First sentence. Second one. Third one. Fourth"
    planted = plant(text, "4821", random.Random(0))
    assert "\n\n" + NEEDLE.format(code="4821") + "\n\n" in planted
    assert planted.replace("\n\n" + NEEDLE.format(code="4821") + "\n\n", " ").startswith("First sentence.")
    assert answer_code(" 4821.") == "4821"
    assert answer_code(" 48211") == "48211"  # exact match: a longer number is wrong
    assert answer_code(" a novel framework") is None
