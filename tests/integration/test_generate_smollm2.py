"""Prefix reuse on the real SmolLM2-135M-Instruct: cached answers equal uncached ones."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import lmdb
import pytest

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.bench.ttft import build_context
from kvshelf.kvstore import open_embedded_store, prefix_block_keys

pytestmark = pytest.mark.slow


def _question(tokenizer, text: str) -> list[int]:
    return tokenizer(f"\n\nQuestion: {text}\nAnswer:", add_special_tokens=False)["input_ids"]


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("context_tokens", "block_size"), [(512, 256), (700, 256), (700, 96)])
def test_reuse_equals_full_prefill(smollm2, texts, tmp_path, context_tokens, block_size):
    model, tokenizer = smollm2
    gen = CachedGenerator(model, tokenizer, open_embedded_store(tmp_path), block_size=block_size)
    prompt = build_context(tokenizer, texts, context_tokens) + _question(tokenizer, "What is the main idea?")
    cold = gen.generate(prompt, max_new_tokens=16, reuse=False, output_logits=True)
    warm = gen.generate(prompt, max_new_tokens=16, output_logits=True)
    assert cold.stored_blocks == len(prompt) // block_size
    assert warm.reused_tokens == (len(prompt) // block_size) * block_size
    assert warm.new_ids == cold.new_ids
    diff = _max_diff(cold.logits, warm.logits)
    print(f"{context_tokens} tokens, block {block_size}: reused {warm.reused_tokens}, max |logit diff| {diff:.2e}")
    assert diff < 1e-2


def test_context_reused_whole_for_another_question(smollm2, texts, tmp_path):
    model, tokenizer = smollm2
    gen = CachedGenerator(model, tokenizer, open_embedded_store(tmp_path))
    context = build_context(tokenizer, texts, 600)
    gen.generate(context + _question(tokenizer, "Who are the authors?"), max_new_tokens=4,
                 cacheable_prefix=len(context))
    prompt = context + _question(tokenizer, "Which method is proposed in the first abstract?")
    warm = gen.generate(prompt, max_new_tokens=16, cacheable_prefix=len(context))
    cold = gen.generate(prompt, max_new_tokens=16, reuse=False, store=False)
    assert warm.reused_tokens == 600
    assert warm.new_ids == cold.new_ids


_CHILD = textwrap.dedent(
    """
    import json, sys
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import load_model
    from kvshelf.kvstore import open_embedded_store

    data_dir, prompt = sys.argv[1], json.loads(sys.argv[2])
    model, tokenizer = load_model("smollm2-135m")
    store = open_embedded_store(data_dir)
    reopened = store.stats()
    result = CachedGenerator(model, tokenizer, store).generate(prompt, max_new_tokens=16, store=False)
    print(json.dumps({"reused": result.reused_tokens, "new_ids": result.new_ids,
                      "reopened": reopened, "after": store.stats()}))
    """
)


def test_new_process_reuses_blocks_from_disk(smollm2, texts, tmp_path):
    model, tokenizer = smollm2
    store = open_embedded_store(tmp_path)
    prompt = build_context(tokenizer, texts, 512) + _question(tokenizer, "Summarise the first abstract.")
    cold = CachedGenerator(model, tokenizer, store).generate(prompt, max_new_tokens=16, wait=True)
    store.close()
    out = subprocess.run([sys.executable, "-P", "-c", _CHILD, str(tmp_path), json.dumps(prompt)],
                         capture_output=True, text=True, check=True)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["reused"] == 512
    assert child["new_ids"] == cold.new_ids
    memory, disk = child["reopened"]["tiers"]
    assert (memory["blocks"], disk["blocks"]) == (0, 2)  # a new process: memory empty, disk holds the blocks
    assert disk["bytes"] > 0 and disk["hits"] == 0 and disk["misses"] == 0
    memory, disk = child["after"]["tiers"]
    assert (disk["hits"], memory["misses"], memory["blocks"]) == (2, 2, 2)  # read from disk, promoted
    assert child["after"]["retrieve_hit_rate"] == 1.0


def test_corrupted_block_on_disk_is_a_miss_and_output_unchanged(smollm2, texts, tmp_path):
    model, tokenizer = smollm2
    prompt = build_context(tokenizer, texts, 768) + _question(tokenizer, "What is new here?")
    store = open_embedded_store(tmp_path)
    gen = CachedGenerator(model, tokenizer, store)
    cold = gen.generate(prompt, max_new_tokens=16, reuse=False, wait=True)  # stored before the store closes
    second_key = prefix_block_keys(gen.fingerprint, gen.namespace, prompt, gen.block_size)[1]
    store.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=4, map_size=1 << 30)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        value = bytearray(txn.get(second_key))
        value[len(value) // 2] ^= 0xFF
        txn.put(second_key, bytes(value))
    env.close()
    store = open_embedded_store(tmp_path, memory_bytes=None)
    warm = CachedGenerator(model, tokenizer, store).generate(prompt, max_new_tokens=16, store=False)
    assert warm.reused_tokens == 256  # the prefix ends at the damaged block
    assert warm.new_ids == cold.new_ids
    disk = store.stats()["tiers"][0]
    assert disk["corrupt"] == 1
    assert disk["blocks"] == 2  # the damaged value was dropped; the others stay


def test_batch_rows_equal_single_uncached_runs(smollm2, texts, tmp_path):
    """Rows of different lengths, one extending a cached context, one sharing its first block, one short: each
    row's greedy tokens equal its own uncached single-row run."""
    model, tokenizer = smollm2
    gen = CachedGenerator(model, tokenizer, open_embedded_store(tmp_path), block_size=128)
    context = build_context(tokenizer, texts, 400)
    gen.generate(context, max_new_tokens=1, wait=True)  # 3 blocks of 128
    rows = [
        context + _question(tokenizer, "What is the main idea?"),
        context[:200] + _question(tokenizer, "Who wrote it?"),
        _question(tokenizer, "What is a transformer?"),
    ]
    results = gen.generate(rows, max_new_tokens=12, output_logits=True)
    assert [r.reused_tokens for r in results] == [384, 128, 0]
    for row, result in zip(rows, results, strict=True):
        single = gen.generate(row, max_new_tokens=12, reuse=False, store=False, output_logits=True)
        assert result.new_ids == single.new_ids
        assert _max_diff(result.logits, single.logits) < 1e-2


def test_stream_and_a_callers_streamer(smollm2, tmp_path):
    from transformers import TextIteratorStreamer

    model, tokenizer = smollm2
    gen = CachedGenerator(model, tokenizer, open_embedded_store(tmp_path))
    prompt = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    stream = gen.stream(prompt, max_new_tokens=8)
    text = "".join(stream.texts())
    assert text == stream.result.text and stream.result.ttft_s > 0
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = gen.generate(prompt, max_new_tokens=8, streamer=streamer)
    assert "".join(streamer).strip() == result.text.strip() == text.strip()
