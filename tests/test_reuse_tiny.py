"""Context reuse on a tiny random Llama (fast): RoPE re-encoding, masks, schemas, chunking, precompute, modes."""

from __future__ import annotations

import pytest
import torch
from helpers import token_ids
from transformers import DynamicCache

from adapters.model import tiny_llama
from adapters.prompt_modules import PromptModuleGenerator
from adapters.rag import RAGGenerator, compute_chunk, precompute
from adapters.reuse_engine import inv_freq
from kvstore import KVShelfError, open_embedded_store
from reuse import (
    ChunkMissingError,
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
from reuse.masks import GLOBAL, PREFIX, block_mask, causal_mask


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, layers=4)


def _kv_at(model, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV of ``ids`` computed alone at positions ``start...``: ``[layers, kv_heads, n, head_dim]``."""
    out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                use_cache=True, past_key_values=DynamicCache(config=model.config))
    cache = out.past_key_values
    return (torch.stack([layer.keys[0] for layer in cache.layers]),
            torch.stack([layer.values[0] for layer in cache.layers]))


# -- RoPE re-encoding --------------------------------------------------------------------------------------


@pytest.mark.parametrize("position", [1, 37, 1000, 3000])
def test_rerotated_chunk_equals_chunk_computed_at_its_position(model, position):
    ids = token_ids(24)
    with torch.inference_mode():
        k0, v0 = _kv_at(model, ids, 0)
        kp, vp = _kv_at(model, ids, position)
    moved = rerotate_keys(k0, position, inv_freq(model))
    # layer 0's pre-RoPE keys depend on the tokens only: re-rotation is exact up to fp32 rounding of cos/sin
    assert torch.allclose(moved[0], kp[0], atol=2e-5, rtol=0)
    # deeper layers: attention inside the chunk depends on relative positions only, so the same up to rounding
    assert torch.allclose(moved, kp, atol=1e-4, rtol=0)
    assert torch.allclose(v0, vp, atol=1e-4, rtol=0)
    back = rerotate_keys(moved, -position, inv_freq(model))
    assert torch.allclose(back, k0, atol=2e-5, rtol=0)


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


def _tok(text: str) -> list[int]:
    """A toy tokenizer: one token per word."""
    return [3 + (sum(map(ord, w)) % 400) for w in text.split()]


SCHEMA = """
<schema name="support">
  <module name="system">you are a helpful assistant</module>
  <module name="manual" start="10">manual of <param name="product" len="3"/> read it well</module>
  <module name="faq" scope="prefix">frequent questions here</module>
</schema>
"""


def test_schema_markup_layout():
    schema = PromptSchema.from_markup(SCHEMA)
    assert [m.name for m in schema.modules] == ["system", "manual", "faq"]
    assert schema.modules[1].parts[1] == Param("product", 3)
    compiled = schema.compile(_tok, max_positions=100)
    system, manual, faq = compiled.modules
    assert (system.start, system.end) == (0, 5)
    assert (manual.start, manual.end) == (10, 18)  # 2 words + 3-position slot + 3 words
    assert manual.positions == (10, 11, 15, 16, 17)
    assert manual.slots == (("product", 12, 3),)
    assert (faq.start, faq.end, faq.scope) == (18, 21, ("system", "manual"))


def test_prompt_markup_and_assembly():
    compiled = PromptSchema.from_markup(SCHEMA).compile(_tok)
    name, items = parse_prompt('<prompt schema="support"><system/><manual product="falcon x"/>how to reset</prompt>')
    assert name == "support"
    assert items[1] == ModuleUse("manual", {"product": "falcon x"})
    a = assemble(compiled, items, _tok, max_positions=100)
    assert a.positions == (0, 1, 2, 3, 4, 10, 11, 12, 13, 15, 16, 17, 18, 19, 20)
    assert a.cached_by[12:] == (None, None, None) and a.cached_by[7:9] == (None, None)
    assert a.uncached == 5


def test_schema_and_prompt_errors():
    with pytest.raises(SchemaError, match="overlaps"):
        PromptSchema("s", (Module("a", ("one two three",)), Module("b", ("four",), start=2))).compile(_tok)
    with pytest.raises(SchemaError, match="not well-formed"):
        PromptSchema.from_markup("<schema><module name='a'>x</schema>")
    with pytest.raises(SchemaError, match="declared twice"):
        PromptSchema("s", (Module("a", ("x",)), Module("a", ("y",))))
    with pytest.raises(SchemaError, match="reserves length"):
        PromptSchema("s", (Module("a", ("one two three",), length=2),)).compile(_tok)
    compiled = PromptSchema.from_markup(SCHEMA).compile(_tok)
    with pytest.raises(UnknownModuleError, match="'nope'"):
        assemble(compiled, [ModuleUse("nope")], _tok)
    with pytest.raises(ParameterTooLongError, match="'product' is 4 tokens, its slot holds 3"):
        assemble(compiled, [ModuleUse("manual", {"product": "a b c d"})], _tok)
    with pytest.raises(UnknownParameterError, match="'colour'"):
        assemble(compiled, [ModuleUse("manual", {"product": "a", "colour": "red"})], _tok)
    with pytest.raises(MissingParameterError, match="'product'"):
        assemble(compiled, [ModuleUse("manual")], _tok)
    with pytest.raises(ContextTooLongError, match="over the model's 20"):
        assemble(compiled, [ModuleUse("system"), ModuleUse("manual", {"product": "a"}), "x"], _tok,
                 max_positions=20, max_new_tokens=2)
    with pytest.raises(ContextTooLongError, match="over the model's 15"):
        PromptSchema.from_markup(SCHEMA).compile(_tok, max_positions=15)
    with pytest.raises(PromptLayoutError, match="out of schema order"):
        assemble(compiled, [ModuleUse("manual", {"product": "a"}), ModuleUse("system")], _tok)
    with pytest.raises(PromptLayoutError, match="must use"):
        assemble(compiled, [ModuleUse("system"), ModuleUse("faq")], _tok)
    for error in (SchemaError, UnknownModuleError, ParameterTooLongError, ContextTooLongError):
        assert issubclass(error, KVShelfError)


# -- prompt modules on the tiny model -------------------------------------------------------------------------


class _WordTokenizer:
    """A minimal tokenizer for the tiny model (one id per word)."""

    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": _tok(text)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def test_prompt_module_at_position_zero_equals_full_prefill(model, tmp_path):
    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    schema = PromptSchema.from_markup(SCHEMA)
    gen = PromptModuleGenerator(model, _WordTokenizer(), store, schema)
    assert gen.precompute() == {"modules": 3, "computed": 3, "tokens": 13}
    assert gen.precompute()["computed"] == 0  # stored (and pinned) already
    assert all(store.is_pinned(gen.key(m)) for m in gen.compiled.modules)
    for prompt in ([ModuleUse("system"), "tell me a story now"],
                   [ModuleUse("system"), ModuleUse("manual", {"product": "x y z"}), ModuleUse("faq"), "why"]):
        warm = gen.generate(prompt, max_new_tokens=8, eos_token_id=None)
        cold = gen.generate(prompt, max_new_tokens=8, eos_token_id=None, reuse=False)
        assert warm.reused_tokens > 0 and cold.reused_tokens == 0
        if len(prompt) == 2:  # one module at position 0 + free text: the same KV as full prefill
            assert warm.new_ids == cold.new_ids
            assert torch.allclose(warm.first_logits, cold.first_logits, atol=1e-4)


# -- RAG chunks -----------------------------------------------------------------------------------------------


def test_precompute_is_resumable_and_skips_stored_chunks(model, tmp_path):
    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    tok = _WordTokenizer()
    docs = [" ".join(f"w{i}" for i in range(25)), " ".join(f"v{i}" for i in range(9))]
    first = precompute(docs[:1], model, tok, store, chunk_size=10, progress=False)
    assert (first["chunks"], first["computed"], first["skipped"]) == (3, 3, 0)
    (tmp_path / "doc.txt").write_text(docs[1])
    second = precompute(docs[:1], model, tok, store, paths=[tmp_path / "doc.txt"], chunk_size=10, progress=False)
    assert (second["documents"], second["chunks"], second["computed"], second["skipped"]) == (2, 4, 1, 3)
    store.close()
    reopened = open_embedded_store(tmp_path, memory_bytes=None)  # a new process: only LMDB holds them
    third = precompute(docs, model, tok, reopened, chunk_size=10, overlap=2, progress=False)
    # with overlap the first chunk is unchanged (read back from disk, skipped), the next two are new
    assert (third["chunks"], third["computed"], third["skipped"]) == (4, 2, 2)


def test_modes_run_and_full_equals_plain_generate(model, tmp_path):
    from adapters.generate import CachedGenerator

    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    chunks = [token_ids(20, 2), token_ids(30, 3), token_ids(25, 4)]
    prefix, question = token_ids(5, 5), token_ids(7, 6)
    rag = RAGGenerator(model, None, store, prefix=prefix)
    full = rag.generate(chunks, question, mode="full", max_new_tokens=10, eos_token_id=None)
    plain = CachedGenerator(model).generate(prefix + sum(chunks, []) + question, max_new_tokens=10, reuse=False,
                                            store=False, eos_token_id=None)
    assert full.new_ids == plain.new_ids
    reuse = rag.generate(chunks, question, mode="reuse", max_new_tokens=10, eos_token_id=None)
    assert (reuse.reused_chunks, reuse.computed_chunks) == (0, 3)  # computed on demand and stored
    reuse = rag.generate(chunks[::-1], question, mode="reuse", max_new_tokens=10, eos_token_id=None)
    assert (reuse.reused_chunks, reuse.computed_chunks) == (3, 0)  # any order reuses them
    blend = RAGGenerator(model, None, store, prefix=prefix, blend_base="chunk").generate(
        chunks, question, mode="reuse-blend", max_new_tokens=10, eos_token_id=None)
    assert blend.reused_chunks == 3 and blend.recomputed_tokens == 12  # ceil(0.15 * 75), over the position-0 chunks
    block = rag.generate(chunks, question, mode="block-attention", max_new_tokens=10, eos_token_id=None)
    assert block.computed_chunks == 3
    block = rag.generate(chunks, question, mode="block-attention", max_new_tokens=10, eos_token_id=None)
    assert block.reused_chunks == 3
    blend = rag.generate(chunks, question, mode="reuse-blend", max_new_tokens=10, eos_token_id=None)
    assert blend.reused_chunks == 3 and blend.recomputed_tokens == 12  # default base: the blocks after the prefix
    for base in ("block", "chunk"):
        everything = RAGGenerator(model, None, store, prefix=prefix, recompute_ratio=1.0, blend_base=base)
        exact = everything.generate(chunks, question, mode="reuse-blend", max_new_tokens=10, eos_token_id=None)
        assert exact.new_ids == full.new_ids  # recomputing every token restores full prefill
        assert torch.allclose(exact.first_logits, full.first_logits, atol=1e-4)
    with pytest.raises(KVShelfError, match="blend_base"):
        RAGGenerator(model, None, store, blend_base="bogus")
    ape = RAGGenerator(model, None, store, prefix=prefix, ape=(0.9, 0.8))
    assert len(ape.generate(chunks, question, mode="reuse", max_new_tokens=4, eos_token_id=None).new_ids) == 4
    with pytest.raises(KVShelfError, match="unknown mode"):
        rag.generate(chunks, question, mode="bogus")
    with pytest.raises(ContextTooLongError):
        rag.generate([token_ids(4000, 7)], question, mode="reuse", max_new_tokens=200)


def test_single_chunk_without_prefix_reuse_equals_full(model, tmp_path):
    rag = RAGGenerator(model, None, open_embedded_store(tmp_path, memory_bytes="64MiB"))
    chunk, question = token_ids(40, 8), token_ids(6, 9)
    full = rag.generate([chunk], question, mode="full", max_new_tokens=6, eos_token_id=None)
    reuse = rag.generate([chunk], question, mode="reuse", max_new_tokens=6, eos_token_id=None)
    assert reuse.new_ids == full.new_ids
    assert torch.allclose(reuse.first_logits, full.first_logits, atol=1e-4)


def test_foreign_model_chunk_is_never_used(model, tmp_path):
    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    other = tiny_llama(seed=1, layers=4)
    chunks = [token_ids(12, 10), token_ids(12, 11)]
    tok = _WordTokenizer()
    RAGGenerator(other, tok, store).chunk_blocks(chunks)  # stored for the other model
    strict = RAGGenerator(model, tok, store, on_missing="error")
    with pytest.raises(ChunkMissingError, match="stored by another model"):
        strict.generate(chunks, token_ids(4, 12), mode="reuse")
    lenient = RAGGenerator(model, tok, store)
    result = lenient.generate(chunks, token_ids(4, 12), mode="reuse", max_new_tokens=2)
    assert (result.reused_chunks, result.computed_chunks) == (0, 2)
    own = compute_chunk(model, chunks[0], lenient.fingerprint, "default")
    (loaded, _), _ = lenient.chunk_blocks(chunks)
    assert torch.equal(loaded.keys, own.keys)  # what is used now is this model's own KV
