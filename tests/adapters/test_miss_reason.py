"""Why a prompt missed (``GenerationResult.miss_reason``, ``CachedGenerator.explain``, ``adapters.miss``): one test
per reason, on tiny random Llamas over a real embedded store (memory + LMDB)."""

from __future__ import annotations

import pytest
import torch
from chat_tokenizer import ChatTokenizer
from helpers import WordTokenizer

from kvshelf.adapters.chat import Conversation
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.miss import MissKind
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.rag.chunks import compute_chunk
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.eviction_log import EvictionLog
from kvshelf.kvstore.keys import chunk_key, prefix_block_keys
from kvshelf.kvstore.stats import StoreEvent

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture
def store(tmp_path):
    with open_embedded_store(tmp_path / "data", memory_bytes="64MiB") as opened:
        yield opened


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _kinds(result) -> list[MissKind]:  # noqa: ANN001
    return [reason.kind for reason in result.miss_reasons]


def test_a_fresh_prompt_was_never_stored_and_a_full_hit_has_no_reason(model, store):
    gen = CachedGenerator(model, store=store, block_size=BLOCK)
    prompt = _prompt(70)
    first = gen.generate(prompt, max_new_tokens=1, wait=True)
    assert _kinds(first) == [MissKind.NEVER_STORED]
    assert first.miss_reason is first.miss_reasons[0]
    assert "cannot tell whether the weights changed" in first.miss_reason.detail  # no other model known
    again = gen.generate(prompt, max_new_tokens=1)
    assert again.reused_tokens == 64 and again.miss_reason is None and again.miss_reasons == ()
    # a prompt longer than the stored one: the rest was never stored
    longer = gen.generate(prompt + _prompt(40, seed=2), max_new_tokens=1)
    assert (longer.reused_tokens, longer.miss_reason.kind, longer.miss_reason.tokens) == (64, MissKind.NEVER_STORED,
                                                                                          64)
    # no lookup, no reason; and the diagnosis can be turned off
    assert gen.generate(_prompt(70, seed=3), max_new_tokens=1, reuse=False).miss_reason is None
    quiet = CachedGenerator(model, store=store, block_size=BLOCK, explain_misses=False)
    assert quiet.generate(_prompt(70, seed=4), max_new_tokens=1).miss_reason is None
    assert quiet.eviction_log is None


def test_blocks_evicted_from_the_last_tier_are_evicted_not_never_stored(model, tmp_path):
    store = open_embedded_store(tmp_path / "data", memory_bytes="256KiB", max_disk_bytes="1MiB",
                                eviction_policy="lru")
    gen = CachedGenerator(model, store=store, block_size=BLOCK)
    prompt = _prompt(64)
    gen.generate(prompt, max_new_tokens=1, wait=True)
    first_key = prefix_block_keys(gen.fingerprint, gen.namespace, prompt, BLOCK)[0]
    for seed in range(100, 400):  # other prompts until the LRU disk tier has evicted the first one's blocks
        if not store.held([first_key])[0]:
            break
        gen.generate(_prompt(64, seed=seed), max_new_tokens=1, wait=True)
    assert not store.held([first_key])[0]
    result = gen.generate(prompt, max_new_tokens=1, store=False)
    assert result.reused_tokens == 0
    assert result.miss_reason.kind is MissKind.EVICTED
    assert result.miss_reason.candidate == store.specs[-1].tier.name  # the disk tier: the memory one keeps none
    assert result.miss_reason.blocks >= 1
    # another generator on the store heard none of it: to it the blocks were never stored
    late = CachedGenerator(model, store=store, block_size=BLOCK)
    assert late.generate(prompt, max_new_tokens=1, store=False).miss_reason.kind is MissKind.NEVER_STORED
    gen.close()
    late.close()
    store.close()


def test_the_eviction_log_forgets_a_key_stored_again_and_keeps_the_newest():
    log = EvictionLog(capacity=2)
    for key in (b"a" * 16, b"b" * 16, b"c" * 16):
        log(StoreEvent("evicted", "disk", key, 10))
    assert (log.tier_of(b"a" * 16), log.tier_of(b"c" * 16), len(log)) == (None, "disk", 2)
    log(StoreEvent("stored", "memory", b"c" * 16, 10))
    assert log.tier_of(b"c" * 16) is None


def test_blocks_stored_in_another_dtype(store):
    prompt = _prompt(70, seed=5)
    bf16 = CachedGenerator(tiny_llama(seed=0, dtype=torch.bfloat16), store=store, block_size=BLOCK)
    bf16.generate(prompt, max_new_tokens=1, wait=True)
    fp32 = CachedGenerator(tiny_llama(seed=0), store=store, block_size=BLOCK)
    result = fp32.generate(prompt, max_new_tokens=1, store=False)
    assert (result.miss_reason.kind, result.miss_reason.candidate, result.miss_reason.blocks) == (
        MissKind.OTHER_DTYPE, "bfloat16", 4)
    assert (result.other_dtype_blocks, result.other_dtypes) == (4, ("bfloat16",))  # the same probes


def test_blocks_cut_in_another_block_size(model, store):
    prompt = _prompt(70, seed=6)
    CachedGenerator(model, store=store, block_size=BLOCK).generate(prompt, max_new_tokens=1, wait=True)
    result = CachedGenerator(model, store=store, block_size=32).generate(prompt, max_new_tokens=1, store=False)
    reason = result.miss_reason
    assert (reason.kind, reason.candidate, reason.blocks, reason.tokens) == (MissKind.OTHER_BLOCK_SIZE, "16", 4, 64)
    assert "block_size=16" in reason.detail
    # a prompt shorter than one block of 256 asks for no block, yet its 16-token blocks are there
    short = _prompt(40, seed=7)
    CachedGenerator(model, store=store, block_size=BLOCK).generate(short, max_new_tokens=1, wait=True)
    wide = CachedGenerator(model, store=store, block_size=256).generate(short, max_new_tokens=1, store=False)
    assert (wide.miss_reason.kind, wide.miss_reason.candidate) == (MissKind.OTHER_BLOCK_SIZE, "16")
    # ... and one that no setting holds has no reason (nothing to reuse)
    nothing = CachedGenerator(model, store=store, block_size=256).generate(_prompt(40, seed=8), max_new_tokens=1)
    assert nothing.miss_reason is None


def test_blocks_stored_in_another_namespace(model, store, tmp_path):
    prompt = _prompt(70, seed=9)
    CachedGenerator(model, store=store, namespace="tenant-a", block_size=BLOCK).generate(prompt, max_new_tokens=1,
                                                                                         wait=True)
    other = CachedGenerator(model, store=store, namespace="tenant-b", block_size=BLOCK)
    result = other.generate(prompt, max_new_tokens=1, store=False)
    assert (result.miss_reason.kind, result.miss_reason.candidate) == (MissKind.OTHER_NAMESPACE, "tenant-a")
    store.close()
    # a fresh process knows no counters and an empty memory tier: explain() scans the disk tier's headers
    with open_embedded_store(tmp_path / "data", memory_bytes="64MiB") as reopened:
        report = CachedGenerator(model, store=reopened, namespace="tenant-b", block_size=BLOCK).explain(prompt)
        assert (report.blocks, report.held_blocks) == (4, 0)
        assert [r.kind for r in report.reasons] == [MissKind.OTHER_NAMESPACE]
        # one the caller names is tried first
        named = CachedGenerator(model, store=reopened, namespace="tenant-c", block_size=BLOCK).explain(
            prompt, namespaces=["tenant-a"], scan=0)
        assert [(r.kind, r.candidate) for r in named.reasons] == [(MissKind.OTHER_NAMESPACE, "tenant-a")]


def test_blocks_stored_for_other_weights(store):
    prompt = _prompt(70, seed=10)
    edited = tiny_llama(seed=0)
    gen = CachedGenerator(edited, store=store, block_size=BLOCK)
    gen.generate(prompt, max_new_tokens=1, wait=True)
    before = gen.fingerprint
    with torch.no_grad():
        edited.model.embed_tokens.weight[0, 0] += 1.0  # the weights change in place: another fingerprint
    assert gen.fingerprint != before
    result = gen.generate(prompt, max_new_tokens=1, store=False)
    assert (result.miss_reason.kind, result.miss_reason.candidate, result.miss_reason.blocks) == (
        MissKind.OTHER_MODEL, before, 4)
    assert "this model's shape" in result.miss_reason.detail  # a scanned header of it shows the same KV shape
    # another model altogether (its KV shaped otherwise)
    three_layers = CachedGenerator(tiny_llama(seed=0, layers=3), store=store, block_size=BLOCK)
    three_layers.generate(_prompt(70, seed=11), max_new_tokens=1, wait=True)
    result = CachedGenerator(tiny_llama(seed=0), store=store, block_size=BLOCK).generate(
        _prompt(70, seed=11), max_new_tokens=1, store=False)
    assert (result.miss_reason.kind, result.miss_reason.candidate) == (MissKind.OTHER_MODEL, three_layers.fingerprint)
    assert "another model" in result.miss_reason.detail


def test_tokens_stored_as_a_position_independent_chunk(model, store):
    prompt = _prompt(70, seed=12)
    gen = CachedGenerator(model, store=store, block_size=BLOCK)
    chunk = prompt[16:48]  # a RAG chunk inside the prompt, stored at position 0
    with torch.inference_mode():
        block = compute_chunk(model, chunk, gen.fingerprint, gen.namespace)
    store.put_many([(chunk_key(gen.fingerprint, gen.namespace, chunk), block)])
    result = gen.generate(prompt, max_new_tokens=1, store=False)
    reason = result.miss_reason
    assert (reason.kind, reason.token_index, reason.tokens) == (MissKind.CHUNKED, 16, 32)
    # the whole looked-up context stored as one chunk is found by its key
    context = _prompt(40, seed=13)
    with torch.inference_mode():
        block = compute_chunk(model, context, gen.fingerprint, gen.namespace)
    store.put_many([(chunk_key(gen.fingerprint, gen.namespace, context), block)])
    whole = gen.generate(context + _prompt(5, seed=14), max_new_tokens=1, cacheable_prefix=40, store=False)
    assert (whole.miss_reason.kind, whole.miss_reason.token_index, whole.miss_reason.tokens) == (
        MissKind.CHUNKED, 0, 40)


@pytest.mark.parametrize("index", [5, 21])  # in the first block, and after one block that matched
def test_other_token_ids_name_the_first_differing_token(model, store, index):
    tokenizer = WordTokenizer()
    gen = CachedGenerator(model, tokenizer, store=store, block_size=BLOCK)
    stored = _prompt(70, seed=15)
    gen.generate(stored, max_new_tokens=1, wait=True)
    prompt = list(stored)
    prompt[index] = 7 if stored[index] != 7 else 8
    result = gen.generate(prompt, max_new_tokens=1, store=False)
    reason = result.miss_reason
    assert result.reused_tokens == (index // BLOCK) * BLOCK
    assert (reason.kind, reason.token_index) == (MissKind.TOKENS_DIFFER, index)
    assert (reason.prompt_token, reason.stored_token) == (str(prompt[index]), str(stored[index]))
    assert f"token {index} differs" in reason.detail


def test_an_edited_chat_history_names_the_first_token_the_template_changed(model, store):
    gen = CachedGenerator(model, ChatTokenizer(), store=store, block_size=BLOCK)
    chat = Conversation(gen, system="you are a terse helper who answers in few words")
    chat.send("what is the capital of france and why", max_new_tokens=4)
    edited = chat.messages[:-1]
    edited[0] = {"role": "system", "content": "you are a terse helper who answers in many words"}
    turn = chat.reply(edited, max_new_tokens=2)
    ids, common = turn.result.prompt_ids, turn.common_prefix
    assert common % BLOCK, "the edit must fall inside a block for its lookup to miss one"
    reason = turn.miss_reason
    assert (reason.kind, reason.token_index) == (MissKind.TOKENS_DIFFER, common)
    assert reason.prompt_token == ChatTokenizer().decode([ids[common]])
    assert turn.reused_tokens == (common // BLOCK) * BLOCK


def test_explain_refuses_bad_input(model, store):
    with pytest.raises(ConfigError, match="needs a generator with a store"):
        CachedGenerator(model, block_size=BLOCK).explain(_prompt(20))
    gen = CachedGenerator(model, store=store, block_size=BLOCK)
    with pytest.raises(ConfigError, match="the prompt is empty"):
        gen.explain([])
    with pytest.raises(ConfigError, match="cacheable_prefix must be in"):
        gen.explain(_prompt(20), cacheable_prefix=21)
    gen.close()
    with pytest.raises(ConfigError, match="is closed"):
        gen.explain(_prompt(20))


def test_blocks_of_a_float32_model_looked_up_from_its_bfloat16_copy_are_another_dtype(tmp_path):
    """A bfloat16 copy of float32 weights cannot name their blocks (its cast weights lost the bits in their
    fingerprint), but a scanned header shows this model's KV shape in float32: another dtype, not another model;
    in a fresh process too, where the memory tier holds only the blocks of the lookup itself and the disk tier's
    headers are read."""
    prompt = _prompt(70, seed=12)
    with open_embedded_store(tmp_path / "data", memory_bytes="64MiB") as store:
        CachedGenerator(tiny_llama(seed=0), store=store, block_size=BLOCK).generate(prompt, max_new_tokens=1,
                                                                                     wait=True)
        bf16 = CachedGenerator(tiny_llama(seed=0).to(torch.bfloat16), store=store, block_size=BLOCK)
        reason = bf16.generate(prompt, max_new_tokens=1, store=False).miss_reason
        assert (reason.kind, reason.candidate, reason.blocks, reason.tokens) == (MissKind.OTHER_DTYPE, "float32", 4,
                                                                                 64)
        assert "load the model in float32" in reason.detail and "this model runs in bfloat16" in reason.detail
    with open_embedded_store(tmp_path / "data", memory_bytes="64MiB") as reopened:  # no counters, memory empty
        bf16 = CachedGenerator(tiny_llama(seed=0).to(torch.bfloat16), store=reopened, block_size=BLOCK)
        result = bf16.generate(prompt, max_new_tokens=1, wait=True)  # its own blocks reach the memory tier
        assert [(r.kind, r.candidate) for r in result.miss_reasons] == [(MissKind.OTHER_DTYPE, "float32")]
        assert (result.other_dtype_blocks, result.other_dtypes) == (4, ("float32",))
