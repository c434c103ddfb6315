"""HF-native export (``adapters.export.cached_prefix``): the cached prefix handed to plain ``model.generate`` gives
plain HF's output on every family of the architecture suite, cropped so that generate computes the last prompt
token, as an independent copy the caller may grow, and expandable to a batch."""

from __future__ import annotations

import pytest
import torch
from arch_rule import Output, plain_generate, run_cell
from expected_prefix import EXPECTED, PATH
from families import CONFIGS, attn_implementations, family_model

from kvshelf.adapters.export import cached_prefix
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.kvstore import MemoryTier, TieredStore
from kvshelf.kvstore.errors import ConfigError

NEW = 4
BLOCK = 16


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CONTEXT = _tokens(64, seed=11)  # 4 full blocks
PROMPT = CONTEXT + _tokens(9, seed=12)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _store() -> TieredStore:
    return TieredStore([MemoryTier(64 << 20)])


def _store_context(model, store: TieredStore | None = None) -> TieredStore:  # noqa: ANN001
    """``store`` (a new one by default) holding ``CONTEXT``'s blocks, written before returning."""
    store = store if store is not None else _store()
    CachedGenerator(model, store=store, block_size=BLOCK).generate(CONTEXT + [7], max_new_tokens=1, wait=True)
    return store


def _hf_generate(model, **inputs) -> Output:  # noqa: ANN001, ANN003
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    n = inputs["input_ids"].shape[1]
    return Output(out.sequences[0, n:].tolist(), [lg[0].float() for lg in out.logits])


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_exported_prefix_in_plain_generate_equals_plain_hf(family):
    model = family_model(family, attn=attn_implementations(family)[0])
    store = _store()

    def run() -> Output:
        _store_context(model, store)
        prefix = cached_prefix(model, store, PROMPT, block_size=BLOCK)
        assert prefix.reused_tokens == len(CONTEXT)
        return _hf_generate(model, **prefix.generate_inputs())

    outcome = run_cell(model, "prefix reuse", run, plain_generate(model, PROMPT, NEW))
    assert outcome == EXPECTED[(family, PATH)]


def test_a_prefix_covering_the_whole_prompt_is_cropped_by_one_token():
    model = tiny_llama()
    store = _store_context(model)
    prefix = cached_prefix(model, store, CONTEXT, block_size=BLOCK)  # every token of it is stored
    assert prefix.reused_tokens == len(CONTEXT) - 1 and prefix.cache.get_seq_length() == len(CONTEXT) - 1
    run_cell(model, "prefix reuse", lambda: _hf_generate(model, **prefix.generate_inputs()),
             plain_generate(model, CONTEXT, NEW))


def test_the_export_is_a_copy_the_caller_may_grow():
    model = tiny_llama()
    store = _store_context(model)
    first = cached_prefix(model, store, PROMPT, block_size=BLOCK)
    _hf_generate(model, **first.generate_inputs())
    assert first.cache.get_seq_length() == len(PROMPT) + NEW - 1  # generate grew the caller's copy in place
    second = cached_prefix(model, store, PROMPT, block_size=BLOCK)  # the store is untouched
    assert second.cache.get_seq_length() == len(CONTEXT)
    run_cell(model, "prefix reuse", lambda: _hf_generate(model, **second.generate_inputs()),
             plain_generate(model, PROMPT, NEW))


def test_expand_gives_a_batch_of_the_prompt():
    model = tiny_llama()
    store = _store_context(model)
    prefix = cached_prefix(model, store, PROMPT, block_size=BLOCK)
    batch = prefix.expand(3)
    assert batch.batch_size == 3 and prefix.cache.get_seq_length() == len(CONTEXT)
    with torch.inference_mode():
        out = model.generate(**batch.generate_inputs(), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    want = plain_generate(model, PROMPT, NEW).tokens
    assert [row[len(PROMPT):].tolist() for row in out] == [want] * 3
    assert prefix.cache.get_seq_length() == len(CONTEXT)  # the single-row original is untouched
    with pytest.raises(ConfigError, match="batch_size"):
        prefix.expand(0)
    with pytest.raises(ConfigError, match="single-row"):
        batch.expand(2)


def test_a_miss_is_an_empty_cache_and_generate_prefills_everything():
    model = tiny_llama()
    prefix = cached_prefix(model, _store(), PROMPT, block_size=BLOCK)
    assert prefix.reused_tokens == 0 and prefix.cache.get_seq_length() == 0
    run_cell(model, "prefix reuse", lambda: _hf_generate(model, **prefix.generate_inputs()),
             plain_generate(model, PROMPT, NEW))


def test_an_empty_prompt_is_refused():
    with pytest.raises(ConfigError, match="empty"):
        cached_prefix(tiny_llama(), _store(), [], block_size=BLOCK)
