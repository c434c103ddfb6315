"""Batches through ``CachedGenerator.generate``: each row reuses its own cached prefix, all rows decode together in
one left-padded ``model.generate``, and each row's greedy output equals plain ``model.generate`` on that row alone
(``arch_rule``: same tokens, logits within 1e-4) on every family of the architecture suite."""

from __future__ import annotations

import pytest
import torch
from arch_rule import Output, assert_same, plain_generate
from families import CONFIGS, attn_implementations, family_model
from helpers import WordTokenizer

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.kvstore import MemoryTier, TieredStore
from kvshelf.kvstore.errors import ConfigError

BLOCK = 16
NEW = 5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = _tokens(70, seed=1)
# rows of different lengths: one extends a stored prompt, one shares only its first blocks, a short one (shorter
# than the windowed families' window), one longer than the rest
ROWS = [SHARED + _tokens(9, seed=2), SHARED[:40] + _tokens(30, seed=3), _tokens(6, seed=4), _tokens(101, seed=5)]


def _store() -> TieredStore:
    return TieredStore([MemoryTier(64 << 20)])


def _output(result) -> Output:  # noqa: ANN001
    return Output(result.new_ids, [lg[0] for lg in result.logits])


def _run(gen: CachedGenerator, rows, **kwargs):  # noqa: ANN001, ANN003, ANN202
    return gen.generate(rows, max_new_tokens=NEW, output_logits=True, eos_token_id=None, pad_token_id=0,
                        wait=True, **kwargs)


@pytest.mark.parametrize(("family", "attn"), [(f, a) for f in CONFIGS for a in attn_implementations(f)])
def test_batch_rows_equal_single_uncached_runs(family, attn):
    model = family_model(family, attn=attn)
    gen = CachedGenerator(model, store=_store(), block_size=BLOCK)
    gen.generate(SHARED, max_new_tokens=1, eos_token_id=None, pad_token_id=0, wait=True)  # 4 blocks stored
    first = _run(gen, ROWS)
    assert [r.reused_tokens for r in first] == [64, 32, 0, 0]
    assert [r.stored_blocks for r in first] == [0, 2, 0, 6]
    second = _run(gen, ROWS)  # every row now finds its own blocks
    assert [r.reused_tokens for r in second] == [64, 64, 0, 96]
    for index, ids in enumerate(ROWS):
        want = plain_generate(model, ids, NEW)
        for results in (first, second):
            assert results[index].prompt_ids == ids
            assert_same(_output(results[index]), want, what=f"{family}/{attn} row {index}")


def test_padded_tensor_with_attention_mask_left_or_right():
    model = tiny_llama(seed=0)
    gen = CachedGenerator(model, store=_store(), block_size=BLOCK)
    rows = ROWS[:3]
    width = max(map(len, rows))
    for side in ("left", "right"):
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, row in enumerate(rows):
            span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
            ids[b, span], mask[b, span] = torch.tensor(row), 1
        results = _run(gen, ids, attention_mask=mask)
        for row, result in zip(rows, results, strict=True):
            assert result.prompt_ids == row
            assert_same(_output(result), plain_generate(model, row, NEW), what=side)


def test_single_prompt_returns_one_result_a_batch_a_list():
    gen = CachedGenerator(tiny_llama(seed=0), store=_store(), block_size=BLOCK)
    single = gen.generate(ROWS[2], max_new_tokens=2)
    assert single.prompt_ids == ROWS[2]
    one_row = gen.generate([ROWS[2]], max_new_tokens=2)
    assert isinstance(one_row, list) and one_row[0].new_ids == single.new_ids
    tensor_row = gen.generate(torch.tensor([ROWS[2]]), max_new_tokens=2)
    assert isinstance(tensor_row, list) and tensor_row[0].new_ids == single.new_ids
    words = CachedGenerator(tiny_llama(seed=0), WordTokenizer(), block_size=BLOCK)
    texts = words.generate(["the cat sat on the mat", "a dog"], max_new_tokens=3, eos_token_id=None)
    assert [r.prompt_ids for r in texts] == [WordTokenizer()(t)["input_ids"] for t in ("the cat sat on the mat",
                                                                                        "a dog")]


def test_rows_stop_at_their_own_eos():
    """A row that ends (EOS) while others go on gets no pad tokens appended: its tokens are the single run's."""
    model = tiny_llama(seed=0)
    gen = CachedGenerator(model, store=_store(), block_size=BLOCK)
    alone = [gen.generate(row, max_new_tokens=6, eos_token_id=None).new_ids for row in ROWS[:3]]
    eos = alone[1][2]  # row 1 ends at its third token; pick the id so that it does
    results = gen.generate(ROWS[:3], max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    for got, full in zip(results, alone, strict=True):
        cut = full[: full.index(eos) + 1] if eos in full else full
        assert got.new_ids == cut
    assert results[1].new_ids == alone[1][:3]


def test_bad_batches_are_clear_errors():
    gen = CachedGenerator(tiny_llama(seed=0), WordTokenizer(), store=_store(), block_size=BLOCK)
    with pytest.raises(ConfigError, match="empty"):
        gen.generate([])
    with pytest.raises(ConfigError, match="mixes strings and token ids"):
        gen.generate(["a b c", [5, 6, 7]])
    with pytest.raises(ConfigError, match="mixes single token ids"):
        gen.generate([5, [6, 7]])
    with pytest.raises(ConfigError, match="row 1 is empty"):
        gen.generate([[5, 6], []])
    with pytest.raises(ConfigError, match="does not match"):
        gen.generate(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(ConfigError, match="0 .padding. and 1"):
        gen.generate(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.full((2, 5), 2))
    with pytest.raises(ConfigError, match="one prompt"):
        gen.generate([[5, 6, 7], [8, 9]], cacheable_prefix=2)
    with pytest.raises(ConfigError, match="past_key_values"):
        gen.generate([5, 6, 7], past_key_values=None)
