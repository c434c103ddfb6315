"""Context reuse on a tiny random Llama (fast): RoPE re-encoding, masks, schemas, chunking, precompute, modes."""

from __future__ import annotations

import pytest
import torch
from helpers import SCHEMA_MARKUP, WordTokenizer, token_ids
from transformers import DynamicCache

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.prompt_modules import PromptModuleGenerator
from kvshelf.adapters.rag import RAGGenerator, precompute
from kvshelf.adapters.rag.chunks import compute_chunk
from kvshelf.adapters.reuse_engine import inv_freq
from kvshelf.kvstore import KVShelfError, open_embedded_store
from kvshelf.reuse import (
    ChunkMissingError,
    ContextTooLongError,
    ModuleUse,
    PromptSchema,
    rerotate_keys,
)


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


def test_prompt_module_at_position_zero_equals_full_prefill(model, tmp_path):
    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    schema = PromptSchema.from_markup(SCHEMA_MARKUP)
    gen = PromptModuleGenerator(model, WordTokenizer(), store, schema)
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
    tok = WordTokenizer()
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
    from kvshelf.adapters.generate import CachedGenerator

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
    tok = WordTokenizer()
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


def test_front_doors_work_in_their_stores_namespace(model, tmp_path):
    """Without ``namespace=``, every front door uses its store's namespace (a remote store's is its token's)."""
    with open_embedded_store(tmp_path, memory_bytes="64MiB", namespace="team-a") as store:
        assert RAGGenerator(model, WordTokenizer(), store).namespace == "team-a"
        assert PromptModuleGenerator(model, WordTokenizer(), store, SCHEMA_MARKUP).namespace == "team-a"
        assert CachedGenerator(model, store=store).namespace == "team-a"
        assert CachedGenerator(model, store=store, namespace="team-b").namespace == "team-b"
        assert CachedGenerator(model).namespace == "default"
        precompute(["one two three four five six"], model, WordTokenizer(), store, chunk_size=4, progress=False)
        assert {row["namespace"] for row in store.stats()["rows"]} == {"team-a"}
