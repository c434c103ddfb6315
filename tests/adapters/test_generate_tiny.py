"""Prefix reuse through ``CachedGenerator`` on a tiny random Llama (fast; the real model is in *_smollm2)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from kvshelf.adapters.cache_bridge import blocks_from_cache, cache_from_blocks
from kvshelf.adapters.fingerprint import model_fingerprint
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.kvstore import KVBlock, MemoryTier, TieredStore, open_embedded_store, prefix_block_spans
from kvshelf.kvstore.errors import ConfigError, UnsupportedModelError


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _max_logit_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("length", [64, 64 + 1, 100, 127, 128])
def test_reuse_gives_the_same_tokens_and_logits(model, tmp_path, length):
    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    gen = CachedGenerator(model, store=store, block_size=16)
    prompt = _prompt(length)
    cold = gen.generate(prompt, max_new_tokens=12, reuse=False, output_logits=True, eos_token_id=None)
    warm = gen.generate(prompt, max_new_tokens=12, output_logits=True, eos_token_id=None)
    assert cold.reused_tokens == 0
    expected_reuse = min((length // 16) * 16, length - 1)
    assert warm.reused_tokens == expected_reuse
    assert warm.prefilled_tokens == length - expected_reuse
    assert warm.new_ids == cold.new_ids
    diff = _max_logit_diff(cold.logits, warm.logits)
    print(f"length {length}: max |logit diff| = {diff:.2e}")
    assert diff < 1e-3


def test_longer_prompt_reuses_the_shared_prefix(model, tmp_path):
    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    gen = CachedGenerator(model, store=store, block_size=16)
    base = _prompt(80)
    gen.generate(base, max_new_tokens=2)
    extended = base + _prompt(30, seed=2)
    warm = gen.generate(extended, max_new_tokens=8, eos_token_id=None)
    cold = gen.generate(extended, max_new_tokens=8, reuse=False, store=False, eos_token_id=None)
    assert warm.reused_tokens == 80
    assert warm.new_ids == cold.new_ids


def test_cacheable_prefix_stores_and_reuses_the_partial_tail(model, tmp_path):
    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    gen = CachedGenerator(model, store=store, block_size=16)
    context = _prompt(50)
    first = gen.generate(context + _prompt(7, seed=3), max_new_tokens=4, cacheable_prefix=50)
    assert first.stored_blocks == 4  # 3 full blocks + the 2-token tail
    question = _prompt(9, seed=4)
    warm = gen.generate(context + question, max_new_tokens=6, cacheable_prefix=50, eos_token_id=None)
    cold = gen.generate(context + question, max_new_tokens=6, reuse=False, store=False, eos_token_id=None)
    assert warm.reused_tokens == 50
    assert warm.new_ids == cold.new_ids
    with pytest.raises(ConfigError, match="cacheable_prefix"):
        gen.generate(context, cacheable_prefix=51)


def test_sampling_with_the_same_seed_matches(model, tmp_path):
    gen = CachedGenerator(model, store=open_embedded_store(tmp_path, memory_bytes="64MiB"), block_size=16)
    prompt = _prompt(70)
    gen.generate(prompt, max_new_tokens=1)
    torch.manual_seed(123)
    cold = gen.generate(prompt, max_new_tokens=10, reuse=False, do_sample=True, temperature=0.8, top_k=50,
                        eos_token_id=None)
    torch.manual_seed(123)
    warm = gen.generate(prompt, max_new_tokens=10, do_sample=True, temperature=0.8, top_k=50, eos_token_id=None)
    assert warm.reused_tokens == 64
    assert warm.new_ids == cold.new_ids


def test_other_model_never_reuses_blocks(tmp_path):
    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    a, b = tiny_llama(seed=0), tiny_llama(seed=1)
    assert model_fingerprint(a) != model_fingerprint(b)
    prompt = _prompt(64)
    CachedGenerator(a, store=store, block_size=16).generate(prompt, max_new_tokens=2)
    gen_b = CachedGenerator(b, store=store, block_size=16)
    result = gen_b.generate(prompt, max_new_tokens=6, eos_token_id=None)
    assert result.reused_tokens == 0
    assert result.new_ids == gen_b.generate(prompt, max_new_tokens=6, reuse=False, eos_token_id=None).new_ids


def test_forged_block_of_another_model_is_a_counted_miss(model, tmp_path):
    """A block of model B stored under model A's key is never served to A."""
    store = TieredStore([MemoryTier(64 << 20)])
    gen = CachedGenerator(model, store=store, block_size=16)
    prompt = _prompt(40)
    span = prefix_block_spans(gen.fingerprint, gen.namespace, prompt, gen.block_size)[0]
    forged = KVBlock(torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 16), tuple(prompt[:16]), 0, "f" * 32)
    store.put_many([(span.key, forged)])
    result = gen.generate(prompt, max_new_tokens=5, eos_token_id=None)
    assert result.reused_tokens == 0
    assert store.stats()["tiers"][0]["foreign"] == 1
    assert result.new_ids == gen.generate(prompt, max_new_tokens=5, reuse=False, eos_token_id=None).new_ids


def test_bad_inputs(model, tmp_path):
    gen = CachedGenerator(model, store=open_embedded_store(tmp_path, memory_bytes="64MiB"), block_size=16)
    with pytest.raises(ConfigError, match="empty"):
        gen.generate([])
    with pytest.raises(ConfigError, match="batch size 1"):
        gen.generate(torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ConfigError, match="tokenizer"):
        gen.generate("a string prompt")
    with pytest.raises(ConfigError, match="positions"):
        gen.generate(_prompt(4090), max_new_tokens=10)
    with pytest.raises(ConfigError, match="block_size"):
        CachedGenerator(model, block_size=0)


def test_sliding_window_model_is_accepted_by_prefix_reuse_only():
    """Prefix reuse bridges sliding-window layers (``tests/adapters/test_families_prefix.py`` checks it exact); a
    path that does not opt in (``check_supported``'s default) still refuses them."""
    from kvshelf.adapters.cache_bridge import check_supported

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    CachedGenerator(MistralForCausalLM(config))
    with pytest.raises(UnsupportedModelError, match="'mistral'.*sliding"):
        check_supported(config)


def test_bridge_round_trip_is_exact(model):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    prompt = _prompt(40)
    with torch.no_grad():
        model(torch.tensor([prompt]), past_key_values=cache)
    blocks = blocks_from_cache(cache, prompt, start=0, end=40, block_size=16, fingerprint="x" * 32,
                               namespace="ns")
    assert [b.num_tokens for b in blocks] == [16, 16, 8]
    assert [b.start_pos for b in blocks] == [0, 16, 32]
    rebuilt = cache_from_blocks(blocks, model.config)
    for original, copy in zip(cache.layers, rebuilt.layers, strict=True):
        assert torch.equal(original.keys, copy.keys) and torch.equal(original.values, copy.values)


def test_two_threads_generate_through_one_store(model, tmp_path):
    store = open_embedded_store(tmp_path, memory_bytes="2MiB")  # small: eviction happens while they run
    gen = CachedGenerator(model, store=store, block_size=16)
    prompts = [_prompt(48 + 8 * i, seed=10 + i) for i in range(4)]
    expected = [gen.generate(p, max_new_tokens=4, reuse=False, store=False, eos_token_id=None).new_ids
                for p in prompts]
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(8):
                k = (i + offset) % len(prompts)
                assert gen.generate(prompts[k], max_new_tokens=4, eos_token_id=None).new_ids == expected[k]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.stats()["retrieve_hit_rate"] > 0
