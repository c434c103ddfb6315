"""Context reuse on the real SmolLM2-135M-Instruct: prompt modules, RAG modes, foreign chunks."""

from __future__ import annotations

import math

import pytest

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.prompt_modules import PromptModuleGenerator
from kvshelf.adapters.rag import RAGGenerator, precompute
from kvshelf.kvstore import open_embedded_store
from kvshelf.reuse import ChunkMissingError, Module, ModuleUse, PromptSchema

pytestmark = pytest.mark.slow


def _enc(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_prompt_modules_at_schema_positions_equal_full_prefill(smollm2, texts, tmp_path):
    model, tokenizer = smollm2
    system = "<|im_start|>system\nYou summarise research abstracts.<|im_end|>\n<|im_start|>user\n"
    schema = PromptSchema("papers", (Module("system", (system,)),
                                     Module("paper", (texts[0][:700],), scope="prefix"),
                                     Module("other", (texts[1][:300],))))
    gen = PromptModuleGenerator(model, tokenizer, open_embedded_store(tmp_path), schema)
    assert gen.precompute()["computed"] == 3
    prompt = [ModuleUse("system"), ModuleUse("paper"), "\nWhat is the main idea?<|im_end|>\n<|im_start|>assistant\n"]
    warm = gen.generate(prompt, max_new_tokens=16)
    assembly = gen.assemble(prompt)
    plain = CachedGenerator(model, tokenizer).generate(list(assembly.tokens), max_new_tokens=16, reuse=False,
                                                       store=False)
    assert warm.reused_tokens == len(gen.compiled.modules[0].tokens) + len(gen.compiled.modules[1].tokens)
    assert warm.prefilled_tokens == len(assembly.tokens) - warm.reused_tokens
    assert warm.new_ids == plain.new_ids


def test_rag_modes_end_to_end_and_full_equals_plain_generate(smollm2, texts, tmp_path):
    model, tokenizer = smollm2
    store = open_embedded_store(tmp_path)
    docs = [t[:500] for t in texts[:3]]
    summary = precompute(docs, model, tokenizer, store, chunk_size=96, progress=False)
    assert summary["computed"] == summary["chunks"] > 3
    assert precompute(docs, model, tokenizer, store, chunk_size=96, progress=False)["skipped"] == summary["chunks"]
    chunks = [_enc(tokenizer, d)[:96] for d in docs]
    prefix = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
    question = "\nWhich topic does the first document study?<|im_end|>\n<|im_start|>assistant\n"
    rag = RAGGenerator(model, tokenizer, store, prefix=prefix)
    full = rag.generate(chunks, question, mode="full", max_new_tokens=12)
    ids = _enc(tokenizer, prefix) + [t for c in chunks for t in c] + _enc(tokenizer, question)
    plain = CachedGenerator(model, tokenizer).generate(ids, max_new_tokens=12, reuse=False, store=False)
    assert full.new_ids == plain.new_ids
    # reuse reads the position-0 chunks precomputed above; block-attention computes the blocks after the
    # prefix on first use, and reuse-blend (over those blocks by default) then reads them
    for mode, computed in (("reuse", 0), ("block-attention", 3), ("reuse-blend", 0)):
        result = rag.generate(chunks, question, mode=mode, max_new_tokens=12)
        assert result.new_ids and result.prompt_tokens == len(ids)
        assert (result.reused_chunks, result.computed_chunks) == (3 - computed, computed)
        print(mode, repr(result.text), "| full:", repr(full.text))
    blend = rag.generate(chunks, question, mode="reuse-blend", max_new_tokens=1)
    assert blend.recomputed_tokens == math.ceil(0.15 * sum(len(c) for c in chunks))


def test_chunk_of_another_model_is_never_used(smollm2, tmp_path):
    model, tokenizer = smollm2
    store = open_embedded_store(tmp_path)
    other = tiny_llama(seed=3, vocab=model.config.vocab_size)
    chunks = [_enc(tokenizer, "Graph neural networks for molecules."), _enc(tokenizer, "Sparse attention.")]
    RAGGenerator(other, tokenizer, store).chunk_blocks(chunks)
    with pytest.raises(ChunkMissingError, match="another model"):
        RAGGenerator(model, tokenizer, store, on_missing="error").generate(chunks, "What?", mode="reuse")
    result = RAGGenerator(model, tokenizer, store).generate(chunks, "What?", mode="reuse", max_new_tokens=2)
    assert (result.reused_chunks, result.computed_chunks) == (0, 2)


def test_exact_reuse_paths_equal_full_prefill(smollm2, texts, tmp_path):
    """The reuse paths that are exact by construction give full prefill's answer on the real model: a single
    chunk re-encoded from the store (no prefix), reuse-blend recomputing every token (r = 1), and block
    attention with one block after the prefix."""
    model, tokenizer = smollm2
    store = open_embedded_store(tmp_path)
    chunk = _enc(tokenizer, texts[5])[:120]
    question = _enc(tokenizer, "\nIn one sentence, what does this abstract study?\nAnswer:")
    plain = RAGGenerator(model, tokenizer, store)
    full = plain.generate([chunk], question, mode="full", max_new_tokens=10)
    first = plain.generate([chunk], question, mode="reuse", max_new_tokens=10)  # computes and stores the chunk
    again = plain.generate([chunk], question, mode="reuse", max_new_tokens=10)  # reads it back
    assert again.reused_chunks == 1 and again.computed_chunks == 0
    assert first.new_ids == again.new_ids == full.new_ids
    assert (again.first_logits - full.first_logits).abs().max() < 1e-3

    prefix = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
    chunks = [_enc(tokenizer, t)[:80] for t in texts[6:9]]
    blend = RAGGenerator(model, tokenizer, store, prefix=prefix, recompute_ratio=1.0)
    full_p = blend.generate(chunks, question, mode="full", max_new_tokens=10)
    assert blend.generate(chunks, question, mode="reuse-blend", max_new_tokens=10).new_ids == full_p.new_ids
    one_block = blend.generate(chunks[:1], question, mode="block-attention", max_new_tokens=10)
    assert one_block.new_ids == blend.generate(chunks[:1], question, mode="full", max_new_tokens=10).new_ids
