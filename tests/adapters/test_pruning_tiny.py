"""Token pruning and selection (adapters.pruning) on hand-made tensors and a tiny random Llama (fast)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

from kvshelf.adapters import hf
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.pruning import (
    H2O,
    METHODS,
    AttentionImplementationError,
    BudgetError,
    Compose,
    Keyformer,
    KeyNorm,
    LayerInputs,
    PruningMethod,
    SnapKV,
    StreamingLLM,
    TokenSelect,
    UnsupportedArchitectureError,
    prune_cache,
    resolve_budget,
    scoring,
    select,
)
from kvshelf.kvstore.errors import KVShelfError

#: the registry itself: the generic tests (budgets, shapes, budget 1 = no pruning) cover every registered method
NAMES = sorted(METHODS)
STATIC = [n for n in NAMES if issubclass(METHODS[n], PruningMethod)]  # prune the cache after the prefill
DYNAMIC = [n for n in NAMES if n not in STATIC]  # keep the full cache, attend to a selection


@contextmanager
def _attention_for(model, method):
    """The attention implementation ``method`` runs with: eager when it reads attention weights, else sdpa."""
    model.set_attn_implementation("eager" if getattr(method, "needs_attentions", False) else "sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")


def test_methods_registry() -> None:
    assert {"streamingllm", "h2o", "keyformer", "snapkv", "keynorm", "tokenselect"} <= set(NAMES)
    assert STATIC and DYNAMIC
    for name in NAMES:
        method = METHODS[name](budget=0.5)
        assert callable(method), f"{name}: a method is used as `with method(model):`"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _ids(n: int = 60, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def _layer(model, n: int = 12, attentions: torch.Tensor | None = None, keys: torch.Tensor | None = None):
    """LayerInputs for layer 0 of ``model`` with made-up hidden states (and optional hand-made keys/weights)."""
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, n, 64, generator=g)
    keys = keys if keys is not None else torch.randn(1, 2, n, 16, generator=g)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(n).unsqueeze(0))
    return LayerInputs(module, hidden, keys, torch.randn(1, 2, n, 16, generator=g), (cos, sin), attentions)


def test_budget_resolution():
    assert resolve_budget(0.5, 100) == 50
    assert resolve_budget(0.125, 1300) == 163
    assert resolve_budget(1.0, 7) == 7
    assert resolve_budget(30, 100) == 30
    for bad in (0, -3, 0.0, 1.5, -0.1, True, "half"):
        with pytest.raises(BudgetError):
            resolve_budget(bad, 100)
    with pytest.raises(BudgetError, match="larger than the context"):
        resolve_budget(101, 100)
    assert issubclass(BudgetError, KVShelfError)


def test_select_keeps_the_best_in_position_order():
    scores = torch.tensor([[[0.1, 0.9, 0.3, 0.8, 0.2], [5.0, 1.0, 4.0, 2.0, 3.0]]])
    assert select(scores, 2).tolist() == [[[1, 3], [0, 2]]]


def test_streamingllm_keeps_sinks_and_recent(model):
    layer = _layer(model, n=20)
    idx = StreamingLLM(budget=8, sinks=2).keep_indices(layer)
    assert idx.tolist() == [[[0, 1, 14, 15, 16, 17, 18, 19]] * 2]


def test_h2o_picks_heavy_hitters_per_kv_head(model):
    n = 10
    attn = torch.full((1, 4, n, n), 0.01)
    attn[:, :2, :, 3] = 1.0  # query heads 0, 1 (KV head 0) attend to token 3
    attn[:, 2:, :, 5] = 1.0  # query heads 2, 3 (KV head 1) attend to token 5
    idx = H2O(budget=2, recent_ratio=0.5).keep_indices(_layer(model, n, attentions=attn))
    assert idx.tolist() == [[[3, 9], [5, 9]]]  # one heavy hitter + one recent token per head


def test_keyformer_is_seeded_and_finds_the_key_token(model):
    n = 10
    attn = torch.full((1, 4, n, n), 0.02)
    attn[..., 4] = 0.8
    layer = _layer(model, n, attentions=attn)
    a = Keyformer(budget=3, recent_ratio=0.34).keep_indices(layer)
    assert torch.equal(a, Keyformer(budget=3, recent_ratio=0.34).keep_indices(layer))
    assert all(4 in head and 9 in head for head in a[0].tolist())


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_keyformer_score_is_the_gumbel_softmax_of_the_logits(model, tau):
    """The closed form ``(w / E) ** (1 / tau)`` row-normalised equals ``softmax((log w + G) / tau)`` summed over
    queries, ``G = -log(E)``, ``E = -log(U)``, with the same uniforms; masked (zero) weights stay at zero."""
    n = 12
    weights = torch.softmax(torch.randn(1, 4, n, n, generator=torch.Generator().manual_seed(1)), dim=-1)
    weights = weights.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), 0.0)
    weights = weights / weights.sum(-1, keepdim=True)
    layer = _layer(model, n, attentions=weights)
    method = Keyformer(budget=4, tau=tau, seed=7)
    uniform = torch.from_numpy(np.random.default_rng((7, int(layer.module.layer_idx))).random(weights.numel(),
                                                                                             dtype=np.float32))
    gumbel = -(-uniform.double().log()).log().view(weights.shape)
    logits = weights.double().log()  # -inf where masked
    expected = layer.to_kv_heads(torch.softmax((logits + gumbel) / tau, dim=-1).sum(dim=2), reduce="sum")
    torch.testing.assert_close(method.base_score(layer).double(), expected, rtol=1e-4, atol=1e-5)


def test_keynorm_keeps_the_lowest_norm_keys(model):
    keys = torch.ones(1, 2, 6, 16)
    keys[0, 0, [1, 4]] = 0.1
    keys[0, 1, [0, 2]] = 0.1
    idx = KeyNorm(budget=2).keep_indices(_layer(model, 6, keys=keys))
    assert idx.tolist() == [[[1, 4], [0, 2]]]


def test_snapkv_follows_the_window_queries_gqa(model):
    layer = _layer(model, n=40)
    q = layer.queries(8)  # [b, h_q, w, d]
    assert q.shape == (1, 4, 8, 16)
    keys = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(5)) * 0.01
    keys[0, 0, 7] = q[0, :2].mean(dim=(0, 1)) * 50  # KV head 0's group queries match token 7
    keys[0, 1, 20] = q[0, 2:].mean(dim=(0, 1)) * 50  # KV head 1's group queries match token 20
    layer.keys = keys
    idx = SnapKV(budget=9, window=8, kernel=1).keep_indices(layer)
    assert idx.shape == (1, 2, 9)
    assert idx[0, 0].tolist() == [7, *range(32, 40)]
    assert idx[0, 1].tolist() == [20, *range(32, 40)]


def test_compose_keeps_forced_tokens_and_honours_the_budget(model):
    layer = _layer(model, n=30)
    idx = Compose(budget=10, methods=[StreamingLLM(sinks=2), KeyNorm()]).keep_indices(layer)
    assert idx.shape == (1, 2, 10)
    assert all({0, 1} <= set(head) for head in idx[0].tolist())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", [0.5, 0.25, 17])
def test_generate_keeps_the_budget_exactly(model, name, budget):
    """Static methods prune each layer's cache to the budget (``[b, kv_heads, kept]`` per layer); dynamic ones
    keep the whole cache (they attend to a selection of it)."""
    ids = _ids(60)
    method = METHODS[name](budget=budget)
    with _attention_for(model, method), method(model) as session:
        out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None,
                             return_dict_in_generate=True)
    keep = resolve_budget(budget, 60)
    assert out.sequences.shape == (1, 65)
    # the cache holds the (kept) prompt tokens plus the 4 decoded ones (the 5th token is never fed back)
    if name in DYNAMIC:
        assert out.past_key_values.get_seq_length() == 60 + 4
        return
    assert set(session.kept) == {0, 1}
    for idx in session.kept.values():
        assert idx.shape == (1, 2, keep)  # [b, kv_heads, kept]: GQA, 2 KV heads
    assert out.past_key_values.get_seq_length() == keep + 4


@pytest.mark.parametrize(("name", "budget"), [(n, b) for n in NAMES for b in ((1.0, 50) if n in STATIC else (1.0,))])
def test_full_budget_equals_plain_generate(model, name, budget):
    """Budget 1 keeps everything: the same tokens as plain ``generate``; so does a static method's budget of every
    prompt token (a dynamic method's token count is of a cache that grows while decoding)."""
    ids = _ids(50, seed=4)
    plain = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    method = METHODS[name](budget=budget)
    with _attention_for(model, method), method(model):
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None), plain)


def test_full_budget_with_method_options_equals_plain_generate(model):
    ids = _ids(50, seed=4)
    plain = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    for method in (StreamingLLM(1.0, sinks=2), SnapKV(1.0, window=8), KeyNorm(50, recent=8)):
        with method(model):
            assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None), plain)


def test_pruned_generate_matches_manual_decode_with_positions(model):
    """Inside generate, new tokens keep their absolute RoPE positions after the cache shrank."""
    ids = _ids(40, seed=6)
    with StreamingLLM(budget=16)(model):
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    cache = DynamicCache()
    with torch.inference_mode(), StreamingLLM(budget=16)(model):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    tokens = [int(logits[0, -1].argmax())]
    with torch.inference_mode():
        for step in range(5):
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                           position_ids=torch.tensor([[40 + step]])).logits
            tokens.append(int(logits[0, -1].argmax()))
    assert out[0, 40:].tolist() == tokens


def test_scoring_many_methods_on_one_prefill_matches_hooked_pruning(model):
    ids = _ids(48, seed=7)
    methods = {"snap": SnapKV(0.25, window=8), "stream": StreamingLLM(0.5)}
    cache = DynamicCache()
    with torch.inference_mode(), scoring(model, methods) as kept:
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 48  # scoring prunes nothing
    pruned = prune_cache(cache, kept["snap"])
    own = DynamicCache()
    with torch.inference_mode(), SnapKV(0.25, window=8)(model):
        model(input_ids=ids, past_key_values=own, use_cache=True)
    for a, b in zip(pruned.layers, own.layers, strict=True):
        assert torch.allclose(a.keys, b.keys) and torch.allclose(a.values, b.values)


def test_tokenselect_attends_to_a_selection_and_restores_the_model(model):
    ids = _ids(80, seed=8)
    with TokenSelect(budget=0.25, similarity=-1.0)(model) as ts:
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                             return_dict_in_generate=True)
    assert out.sequences.shape == (1, 86)
    assert out.past_key_values.get_seq_length() == 85  # the full cache is kept
    assert ts.steps == 5 and ts.reused == 4  # similarity -1: every later step reuses the selection cache
    assert model.config._attn_implementation == "sdpa"
    with TokenSelect(budget=0.25, similarity=1.01)(model) as strict:
        model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert strict.reused == 0


def test_tokenselect_chunk_matches_full_attention_at_full_budget(model):
    ids = _ids(40, seed=9)
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids[:, :30], past_key_values=cache, use_cache=True)
        ref = model(input_ids=ids[:, 30:], past_key_values=cache, use_cache=True).logits
        cache2 = DynamicCache()
        model(input_ids=ids[:, :30], past_key_values=cache2, use_cache=True)
        with TokenSelect(1.0)(model):
            got = model(input_ids=ids[:, 30:], past_key_values=cache2, use_cache=True).logits
        with TokenSelect(5)(model):
            cache3 = DynamicCache()
            model(input_ids=ids[:, :30], past_key_values=cache3, use_cache=True)
            sparse = model(input_ids=ids[:, 30:], past_key_values=cache3, use_cache=True).logits
    assert torch.allclose(ref, got, atol=1e-4)
    assert not torch.allclose(ref, sparse, atol=1e-4)


def test_static_and_dynamic_compose(model):
    ids = _ids(64, seed=10)
    with SnapKV(0.5, window=8)(model) as session, TokenSelect(0.5)(model) as ts:
        out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None,
                             return_dict_in_generate=True)
    assert session.kept[0].shape == (1, 2, 32)
    assert out.past_key_values.get_seq_length() == 32 + 4
    assert ts.steps == 4


@dataclass
class _WeightsReader(H2O):
    """H2O made to read the eager attention weights (what a method with ``needs_attentions`` does)."""

    needs_attentions: ClassVar[bool] = True


def test_attention_weight_methods_need_eager(model):
    with pytest.raises(AttentionImplementationError, match='attn_implementation="eager"'), _WeightsReader(0.5)(model):
        pass
    with pytest.raises(AttentionImplementationError), Compose(0.5, methods=[SnapKV(), _WeightsReader()])(model):
        pass
    for cls in (H2O, Keyformer):  # they recompute their attention mass from the queries: any attention runs
        with cls(0.5)(model):
            pass


@pytest.mark.parametrize("name", NAMES)
def test_bad_budgets_raise_clear_errors(model, name):
    cls = METHODS[name]
    for bad in (0, -1, 0.0, 2.0, 1.5, True, "half"):
        with pytest.raises(BudgetError):
            cls(budget=bad)
    method = cls(budget=500)
    with pytest.raises(BudgetError, match="larger than the context"), _attention_for(model, method), method(model):
        model.generate(_ids(60), max_new_tokens=2, do_sample=False)


def test_unsupported_architecture(model):
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    mistral = MistralForCausalLM(config).eval()
    for method in (SnapKV(0.5), TokenSelect(0.5)):
        with pytest.raises(UnsupportedArchitectureError, match="does not support"), method(mistral):
            pass
    with pytest.raises(UnsupportedArchitectureError, match="Llama-style"), SnapKV(0.5)(torch.nn.Linear(2, 2)):
        pass


def test_pruned_cache_round_trips_through_the_sparse_codec(model):
    """A StreamingLLM cache (same kept tokens in every layer and head) stored as kept tokens + their indices."""
    from helpers import key_of

    from kvshelf.adapters.cache_bridge import blocks_from_cache
    from kvshelf.compress.sparse import compact_block, mark_dropped
    from kvshelf.kvstore.encoding import decode_block, encode_block

    ids = _ids(40, seed=11)
    cache = DynamicCache()
    with torch.inference_mode(), scoring(model, {"s": StreamingLLM(budget=12, sinks=4)}) as kept:
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    idx = kept["s"][0][0, 0]
    assert all(torch.equal(k[0, h], idx) for k in kept["s"].values() for h in range(2))
    (block,) = blocks_from_cache(cache, ids[0].tolist(), start=0, end=40, block_size=40, fingerprint="tiny",
                                 namespace="default")
    data = encode_block(mark_dropped(block, idx.tolist()), key_of(block), "sparse", {"inner": "raw"})
    compact = compact_block(decode_block(data))
    pruned = prune_cache(cache, kept["s"])
    assert compact.extra["positions"] == ",".join(str(i) for i in idx.tolist())
    assert torch.equal(compact.keys, torch.stack([layer.keys[0] for layer in pruned.layers]))
    assert torch.equal(compact.values, torch.stack([layer.values[0] for layer in pruned.layers]))


def test_tokenselect_is_batch_one_and_resets_between_prompts(model):
    with TokenSelect(0.5, similarity=-1.0)(model) as ts:
        model.generate(_ids(40, seed=12), max_new_tokens=3, do_sample=False, eos_token_id=None)
        assert ts.reused == 1
        model.generate(_ids(41, seed=13), max_new_tokens=2, do_sample=False, eos_token_id=None)
        assert ts.reused == 1  # the new prompt's first step made a fresh selection
        with pytest.raises(KVShelfError, match="batch size 1"):
            model.generate(torch.cat([_ids(30), _ids(30, seed=2)]), max_new_tokens=2, do_sample=False)


def test_growing_layer_behaves_like_a_dynamic_layer():
    """In-place appends past the headroom, crop and reset give the same tensors as ``DynamicLayer``'s cat."""
    from transformers.cache_utils import DynamicLayer

    from kvshelf.adapters.pruning.layout import GrowingLayer

    g = torch.Generator().manual_seed(5)
    start = torch.randn(1, 2, 10, 4, generator=g), torch.randn(1, 2, 10, 4, generator=g)
    grow, plain = GrowingLayer.of(*start, headroom=3), DynamicLayer()
    plain.update(*start)
    buffer = grow._k.data
    for step in range(9):  # 3 fit in the headroom, then the buffer grows
        new = torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g)
        k, v = grow.update(*new)
        pk, pv = plain.update(*new)
        assert torch.equal(k, pk) and torch.equal(v, pv)
        assert grow.get_seq_length() == plain.get_seq_length() == 11 + step
        if step < 3:
            assert grow._k.data is buffer  # written in place, no copy of the cache
    assert grow.allocated_bytes >= grow.keys.nbytes + grow.values.nbytes
    grow.crop(-4)
    plain.crop(-4)
    assert torch.equal(grow.keys, plain.keys) and grow.get_seq_length() == 15
    grow.reset()
    assert grow.get_seq_length() == 0 and grow.keys is None


def test_pruned_cache_decodes_in_place_and_matches_a_dynamic_cache(model):
    """``prune_cache`` / ``with method(model)`` leave ``GrowingLayer`` s; decoding them gives DynamicLayer's logits."""
    from kvshelf.adapters.pruning.layout import GrowingLayer, cache_bytes

    ids = _ids(48, seed=14)
    cache = DynamicCache()
    with torch.inference_mode(), scoring(model, {"s": SnapKV(0.5, window=8)}) as kept:
        first = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].argmax()
    pruned = prune_cache(cache, kept["s"])
    plain = DynamicCache()
    for i, layer in enumerate(pruned.layers):
        plain.update(layer.keys.clone(), layer.values.clone(), i)
    assert all(isinstance(layer, GrowingLayer) for layer in pruned.layers)
    assert cache_bytes(pruned) > cache_bytes(plain)  # the headroom is counted
    token = torch.tensor([[int(first)]])
    with torch.inference_mode():
        for step in range(40):  # past the 16-token headroom: the buffer grows
            a = model(input_ids=token, past_key_values=pruned, position_ids=torch.tensor([[48 + step]])).logits
            b = model(input_ids=token, past_key_values=plain, position_ids=torch.tensor([[48 + step]])).logits
            assert torch.allclose(a, b, atol=1e-5)
            token = a[:, -1:].argmax(-1)
    assert pruned.get_seq_length() == plain.get_seq_length() == 24 + 40
    with SnapKV(0.5, window=8)(model):
        out = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    assert all(isinstance(layer, GrowingLayer) for layer in out.past_key_values.layers)


def test_attention_weight_methods_prefill_eager_and_decode_sdpa(model):
    """A method reading the prefill's attention weights gets an eager prefill; its decode steps run with sdpa, same
    tokens as eager."""
    ids = _ids(50, seed=15)
    seen: list[str] = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(hf.attn_implementation(model)))  # what this thread's call runs with
    model.set_attn_implementation("eager")
    try:
        with _WeightsReader(0.5)(model) as session:
            out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None,
                                 return_dict_in_generate=True, output_logits=True)
            again = model.generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=None)
        assert model.config._attn_implementation == "eager"  # restored
        # eager all the way: score with H2O on an eager prefill, decode the pruned cache with eager attention
        cache = DynamicCache()
        with torch.inference_mode(), scoring(model, {"h": _WeightsReader(0.5)}) as kept:
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        pruned, token, eager_logits = prune_cache(cache, kept["h"]), logits.argmax().view(1, 1), [logits]
        with torch.inference_mode():
            for step in range(4):
                logits = model(input_ids=token, past_key_values=pruned, position_ids=torch.tensor([[50 + step]]))
                eager_logits.append(logits.logits[0, -1])
                token = logits.logits[:, -1:].argmax(-1)
    finally:
        handle.remove()
        model.set_attn_implementation("sdpa")
    assert seen[:5] == ["eager", "sdpa", "sdpa", "sdpa", "sdpa"]
    assert seen[5:7] == ["eager", "sdpa"]  # a second prompt's prefill is eager again
    assert set(session.kept) == {0, 1}
    assert torch.equal(again[0, :52], out.sequences[0, :52])
    for ours, eager in zip(out.logits, eager_logits, strict=True):
        assert torch.allclose(ours[0], eager, atol=1e-4)
