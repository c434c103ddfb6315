"""Prefix reuse through ``CachedGenerator`` on a tiny random Llama (fast; the real model is in *_smollm2)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from helpers import WordTokenizer
from transformers import MistralConfig, MistralForCausalLM

from kvshelf.adapters.cache_bridge import blocks_from_cache, cache_from_blocks
from kvshelf.adapters.fingerprint import model_fingerprint
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.model import tiny_llama
from kvshelf.kvstore import (
    KVBlock,
    MemoryTier,
    TieredStore,
    open_embedded_store,
    prefix_block_keys,
    prefix_block_spans,
)
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


def test_sampling_with_the_same_seed_matches_plain_generate(model, tmp_path):
    """Sampling arguments reach ``model.generate`` untouched: with a fixed seed the cached run draws what plain HF
    ``model.generate`` draws on the same prompt, with and without a reused prefix."""
    gen = CachedGenerator(model, store=open_embedded_store(tmp_path, memory_bytes="64MiB"), block_size=16)
    prompt = _prompt(70)
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "eos_token_id": None}
    torch.manual_seed(7)
    with torch.inference_mode():
        plain = model.generate(torch.tensor([prompt]), max_new_tokens=10, pad_token_id=0, **sampling)
    want = plain[0, len(prompt):].tolist()
    greedy = gen.generate(prompt, max_new_tokens=10, eos_token_id=None, store=False)
    assert greedy.new_ids != want  # the sampled run is not the greedy one: the test can tell them apart
    for expected_reuse in (0, 64):  # cold (stores), then warm
        torch.manual_seed(7)
        result = gen.generate(prompt, max_new_tokens=10, wait=True, **sampling)
        assert result.reused_tokens == expected_reuse
        assert result.new_ids == want


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
    with pytest.raises(ConfigError, match="attention_mask"):  # a list prompt has no padding
        gen.generate([5, 6, 7], attention_mask=[1, 1, 1])
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


# -- streaming ----------------------------------------------------------------------------------------------------


class _Recorder(BaseStreamer):
    """A caller's streamer: records every call (the prompt first, then one tensor per new token)."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append([int(t) for t in value.reshape(-1).tolist()])

    def end(self) -> None:
        self.ended += 1


def test_a_callers_streamer_gets_every_token_and_ttft_is_still_measured(model, tmp_path):
    gen = CachedGenerator(model, store=open_embedded_store(tmp_path, memory_bytes="64MiB"), block_size=16)
    prompt = _prompt(50)
    for _ in range(2):  # cold, then with a reused prefix
        recorder = _Recorder()
        result = gen.generate(prompt, max_new_tokens=6, eos_token_id=None, streamer=recorder, wait=True)
        assert recorder.puts[0] == prompt
        assert [t for put in recorder.puts[1:] for t in put] == result.new_ids
        assert recorder.ended == 1
        assert 0 < result.ttft_s <= result.total_s
    assert result.reused_tokens == 48
    with pytest.raises(ConfigError, match="put"):
        gen.generate(prompt, streamer=object())


def test_batch_streamer_gets_one_token_per_row_per_step(model):
    gen = CachedGenerator(model, block_size=16)
    recorder = _Recorder()
    rows = [_prompt(20, seed=5), _prompt(9, seed=6)]
    results = gen.generate(rows, max_new_tokens=4, eos_token_id=None, streamer=recorder)
    steps = recorder.puts[1:]
    assert len(steps) == 4 and all(len(step) == 2 for step in steps)
    assert [[step[b] for step in steps] for b in range(2)] == [r.new_ids for r in results]


def test_stream_iterates_the_new_tokens(model, tmp_path):
    gen = CachedGenerator(model, WordTokenizer(), open_embedded_store(tmp_path, memory_bytes="64MiB"),
                          block_size=16)
    prompt = _prompt(40)
    stream = gen.stream(prompt, max_new_tokens=7, eos_token_id=None)
    tokens = list(stream)
    assert tokens == stream.result.new_ids == gen.generate(prompt, max_new_tokens=7, reuse=False, store=False,
                                                           eos_token_id=None).new_ids
    assert stream.result.ttft_s > 0
    texts = "".join(gen.stream(prompt, max_new_tokens=7, eos_token_id=None).texts())
    assert texts == " ".join(map(str, tokens))
    with pytest.raises(ConfigError, match="one prompt"):
        gen.stream([prompt, prompt])
    failing = gen.stream(_prompt(4090), max_new_tokens=10)  # the worker's error reaches the consumer
    with pytest.raises(ConfigError, match="positions"):
        list(failing)


# -- write-behind ---------------------------------------------------------------------------------------------


def _held(store, gen: CachedGenerator, prompt: list[int]) -> list[bool]:  # noqa: ANN001
    return store.held(prefix_block_keys(gen.fingerprint, gen.namespace, prompt, gen.block_size))


class _SlowStore:
    """A real store whose writes wait for an event (the writer thread blocks in ``put_many``)."""

    def __init__(self, store, release: threading.Event) -> None:  # noqa: ANN001
        self._store, self._release = store, release

    def put_many(self, entries, *, pin=False):  # noqa: ANN001, ANN201
        self._release.wait(30)
        return self._store.put_many(entries, pin=pin)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._store, name)


def test_write_behind_stores_after_returning_and_wait_stores_before(model, tmp_path):
    inner = open_embedded_store(tmp_path, memory_bytes="64MiB")
    release = threading.Event()
    store = _SlowStore(inner, release)
    gen = CachedGenerator(model, store=store, block_size=16, namespace="default")
    prompt = _prompt(50)
    queued = gen.generate(prompt, max_new_tokens=2)
    assert queued.stored_blocks == 3  # handed to the writer...
    assert _held(inner, gen, prompt) == [False] * 3  # ...which has not written them yet
    assert gen.write_behind_stats()["pending_blocks"] == 3
    release.set()
    gen.flush()
    assert _held(inner, gen, prompt) == [True] * 3
    assert gen.write_behind_stats()["written_blocks"] == 3
    other = _prompt(40, seed=9)
    release.clear()
    synchronous = CachedGenerator(model, store=inner, block_size=16, namespace="default").generate(
        other, max_new_tokens=2, wait=True)
    assert synchronous.stored_blocks == 2 and _held(inner, gen, other) == [True] * 2
    gen.close()


def test_the_next_call_reads_its_own_pending_writes(model, tmp_path):
    """A lookup that misses blocks while this generator's writes are pending waits for them: a repeated prompt is
    reused at once, without ``wait=True``."""
    inner = open_embedded_store(tmp_path, memory_bytes="64MiB")
    release = threading.Event()
    gen = CachedGenerator(model, store=_SlowStore(inner, release), block_size=16, namespace="default")
    prompt = _prompt(50)
    cold = gen.generate(prompt, max_new_tokens=4, eos_token_id=None)
    threading.Timer(0.2, release.set).start()  # the writer finishes while the next call waits
    warm = gen.generate(prompt, max_new_tokens=4, eos_token_id=None)
    assert warm.reused_tokens == 48 and warm.new_ids == cold.new_ids
    gen.close()


def test_write_errors_are_counted_and_logged_never_lost_silently(model, tmp_path, caplog):
    class _FailingStore(_SlowStore):
        def put_many(self, entries, *, pin=False):  # noqa: ANN001, ANN201
            raise OSError("disk full")

    store = _FailingStore(open_embedded_store(tmp_path, memory_bytes="64MiB"), threading.Event())
    gen = CachedGenerator(model, store=store, block_size=16, namespace="default")
    with caplog.at_level(logging.ERROR):
        result = gen.generate(_prompt(50), max_new_tokens=2)
        gen.flush()
    assert result.stored_blocks == 3
    stats = gen.write_behind_stats()
    assert (stats["failed_blocks"], stats["written_blocks"]) == (3, 0)
    assert "disk full" in stats["last_error"] and "disk full" in caplog.text
    with pytest.raises(OSError, match="disk full"):  # wait=True: the caller sees the error itself
        gen.generate(_prompt(50, seed=3), max_new_tokens=2, wait=True)


def test_close_flushes_and_a_closed_generator_refuses_calls(model, tmp_path):
    inner = open_embedded_store(tmp_path, memory_bytes="64MiB")
    release = threading.Event()
    prompt = _prompt(50)
    with CachedGenerator(model, store=_SlowStore(inner, release), block_size=16, namespace="default") as gen:
        gen.generate(prompt, max_new_tokens=2)
        threading.Timer(0.2, release.set).start()
    assert gen.closed and _held(inner, gen, prompt) == [True] * 3  # leaving the block flushed the writes
    for call in (lambda: gen.generate(prompt), lambda: gen.stream(prompt), lambda: gen.__enter__()):
        with pytest.raises(ConfigError, match="CachedGenerator is closed"):
            call()
    gen.close()  # idempotent


def test_a_dropped_generator_still_writes_what_it_queued(model, tmp_path):
    inner = open_embedded_store(tmp_path, memory_bytes="64MiB")
    release = threading.Event()
    prompt = _prompt(50)
    gen = CachedGenerator(model, store=_SlowStore(inner, release), block_size=16, namespace="default")
    gen.generate(prompt, max_new_tokens=2)
    keys = prefix_block_keys(gen.fingerprint, gen.namespace, prompt, gen.block_size)
    threading.Timer(0.2, release.set).start()
    del gen  # its finalizer flushes (CPython frees it here)
    assert inner.held(keys) == [True] * 3
