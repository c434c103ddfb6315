"""The model-independent parts of kvshelf.reuse: RoPE re-rotation, masks, blend selection, chunking, schemas."""

from __future__ import annotations

import pytest
import torch
from helpers import SCHEMA_MARKUP, word_ids

from kvshelf.kvstore import KVShelfError
from kvshelf.reuse import (
    ContextTooLongError,
    MissingParameterError,
    Module,
    ModuleUse,
    Param,
    ParameterTooLongError,
    PromptLayoutError,
    PromptSchema,
    SchemaError,
    UnknownModuleError,
    UnknownParameterError,
    assemble,
    chunk_tokens,
    kv_deviation,
    parse_prompt,
    rerotate_keys,
    select_recompute,
)
from kvshelf.reuse.masks import GLOBAL, PREFIX, block_mask, causal_mask


def test_rerotation_per_token_deltas_and_zero():
    keys = torch.randn(2, 2, 5, 16)
    freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.equal(rerotate_keys(keys, 0, freq), keys)
    per_token = rerotate_keys(keys, torch.tensor([3, 3, 3, 3, 3]), freq)
    assert torch.allclose(per_token, rerotate_keys(keys, 3, freq), atol=1e-6)
    # a rotation preserves norms
    assert torch.allclose(per_token.norm(dim=-1), keys.norm(dim=-1), atol=1e-5)


# -- masks ----------------------------------------------------------------------------------------------------


def test_causal_and_block_masks():
    allowed = causal_mask(torch.tensor([1, 3]), 4)[0, 0] == 0
    assert allowed.tolist() == [[True, True, False, False], [True, True, True, True]]
    segments = torch.tensor([PREFIX, PREFIX, 0, 0, 1, 1, GLOBAL])
    mask = block_mask(torch.arange(7), segments)[0, 0] == 0
    assert mask[3].tolist() == [True, True, True, True, False, False, False]  # block 0: prefix + itself
    assert mask[4].tolist() == [True, True, False, False, True, False, False]  # block 1 does not see block 0
    assert mask[6].all()  # the last block sees everything
    bias = torch.tensor([0.0, 0.0, -0.5, -0.5])
    biased = causal_mask(torch.tensor([3]), 4, column_bias=bias)[0, 0, 0]
    assert biased.tolist() == [0.0, 0.0, -0.5, -0.5]


def test_blend_selection():
    old = torch.ones(1, 2, 10, 4)
    new = old.clone()
    new[:, :, [2, 7]] = 5.0
    deviation = kv_deviation(old, old, new, old)
    assert select_recompute(deviation, 0.2).tolist() == [2, 7]
    assert select_recompute(deviation, 0.0).numel() == 0
    assert select_recompute(deviation, 0.15).numel() == 2  # ceil(0.15 * 10)
    with pytest.raises(KVShelfError, match="ratio"):
        select_recompute(deviation, 1.5)


# -- chunking -------------------------------------------------------------------------------------------------


def test_chunk_tokens():
    ids = list(range(10))
    assert chunk_tokens(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert chunk_tokens(ids, 4, overlap=1) == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert chunk_tokens(ids, 20) == [ids]
    assert chunk_tokens([], 4) == []
    with pytest.raises(KVShelfError, match="overlap"):
        chunk_tokens(ids, 4, overlap=4)
    with pytest.raises(KVShelfError, match="chunk_size"):
        chunk_tokens(ids, 0)


# -- schemas --------------------------------------------------------------------------------------------------


def test_schema_markup_layout():
    schema = PromptSchema.from_markup(SCHEMA_MARKUP)
    assert [m.name for m in schema.modules] == ["system", "manual", "faq"]
    assert schema.modules[1].parts[1] == Param("product", 3)
    compiled = schema.compile(word_ids, max_positions=100)
    system, manual, faq = compiled.modules
    assert (system.start, system.end) == (0, 5)
    assert (manual.start, manual.end) == (10, 18)  # 2 words + 3-position slot + 3 words
    assert manual.positions == (10, 11, 15, 16, 17)
    assert manual.slots == (("product", 12, 3),)
    assert (faq.start, faq.end, faq.scope) == (18, 21, ("system", "manual"))


def test_prompt_markup_and_assembly():
    compiled = PromptSchema.from_markup(SCHEMA_MARKUP).compile(word_ids)
    name, items = parse_prompt('<prompt schema="support"><system/><manual product="falcon x"/>how to reset</prompt>')
    assert name == "support"
    assert items[1] == ModuleUse("manual", {"product": "falcon x"})
    a = assemble(compiled, items, word_ids, max_positions=100)
    assert a.positions == (0, 1, 2, 3, 4, 10, 11, 12, 13, 15, 16, 17, 18, 19, 20)
    assert a.cached_by[12:] == (None, None, None) and a.cached_by[7:9] == (None, None)
    assert a.uncached == 5


def test_schema_and_prompt_errors():
    with pytest.raises(SchemaError, match="overlaps"):
        PromptSchema("s", (Module("a", ("one two three",)), Module("b", ("four",), start=2))).compile(word_ids)
    with pytest.raises(SchemaError, match="not well-formed"):
        PromptSchema.from_markup("<schema><module name='a'>x</schema>")
    with pytest.raises(SchemaError, match="declared twice"):
        PromptSchema("s", (Module("a", ("x",)), Module("a", ("y",))))
    with pytest.raises(SchemaError, match="reserves length"):
        PromptSchema("s", (Module("a", ("one two three",), length=2),)).compile(word_ids)
    compiled = PromptSchema.from_markup(SCHEMA_MARKUP).compile(word_ids)
    with pytest.raises(UnknownModuleError, match="'nope'"):
        assemble(compiled, [ModuleUse("nope")], word_ids)
    with pytest.raises(ParameterTooLongError, match="'product' is 4 tokens, its slot holds 3"):
        assemble(compiled, [ModuleUse("manual", {"product": "a b c d"})], word_ids)
    with pytest.raises(UnknownParameterError, match="'colour'"):
        assemble(compiled, [ModuleUse("manual", {"product": "a", "colour": "red"})], word_ids)
    with pytest.raises(MissingParameterError, match="'product'"):
        assemble(compiled, [ModuleUse("manual")], word_ids)
    with pytest.raises(ContextTooLongError, match="over the model's 20"):
        assemble(compiled, [ModuleUse("system"), ModuleUse("manual", {"product": "a"}), "x"], word_ids,
                 max_positions=20, max_new_tokens=2)
    with pytest.raises(ContextTooLongError, match="over the model's 15"):
        PromptSchema.from_markup(SCHEMA_MARKUP).compile(word_ids, max_positions=15)
    with pytest.raises(PromptLayoutError, match="out of schema order"):
        assemble(compiled, [ModuleUse("manual", {"product": "a"}), ModuleUse("system")], word_ids)
    with pytest.raises(PromptLayoutError, match="must use"):
        assemble(compiled, [ModuleUse("system"), ModuleUse("faq")], word_ids)
    for error in (SchemaError, UnknownModuleError, ParameterTooLongError, ContextTooLongError):
        assert issubclass(error, KVShelfError)


# -- prompt modules on the tiny model -------------------------------------------------------------------------
