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
    docs = [t[:700] for t in texts[:3]]  # over 96 tokens each: two chunks a document
    prefix = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
    result = precompute(docs, model, tokenizer, store, prefix=prefix, chunk_size=96, progress=False)
    summary = result.summary()
    assert summary["computed"] == summary["chunks"] == len(result.chunks) > 3
    assert summary["kinds"]["prefix"]["computed"] == 1
    again = precompute(docs, model, tokenizer, store, prefix=prefix, chunk_size=96, progress=False)
    assert again["skipped"] == summary["chunks"] and again["computed_tokens"] == 0
    firsts = [h for h in result.chunks if h.index == 0]  # each document's first chunk
    assert [list(h.token_ids) for h in firsts] == [_enc(tokenizer, d)[:96] for d in docs]
    question = "\nWhich topic does the first document study?<|im_end|>\n<|im_start|>assistant\n"
    rag = RAGGenerator(model, tokenizer, store, prefix=prefix, chunk_size=96, on_missing="error")
    full = rag.generate(firsts, question, mode="full", max_new_tokens=12)
    ids = _enc(tokenizer, prefix) + [t for h in firsts for t in h.token_ids] + _enc(tokenizer, question)
    plain = CachedGenerator(model, tokenizer).generate(ids, max_new_tokens=12, reuse=False, store=False)
    assert full.new_ids == plain.new_ids
    # after precompute with the prefix, the first query of every mode reuses every chunk (on_missing="error")
    for mode in ("reuse", "block-attention", "reuse-blend"):
        answer = rag.generate(firsts, question, mode=mode, max_new_tokens=12)
        assert answer.new_ids and answer.prompt_tokens == len(ids)
        assert (answer.reused_chunks, answer.computed_chunks) == (3, 0)
        print(mode, repr(answer.text), "| full:", repr(full.text))
    whole = rag.generate(docs, question, mode="block-attention", max_new_tokens=1)  # split as precompute did
    assert (whole.chunks, whole.reused_chunks) == (len(result.chunks), len(result.chunks))
    blend = rag.generate(firsts, question, mode="reuse-blend", max_new_tokens=1)
    assert blend.recomputed_tokens == math.ceil(0.15 * sum(h.num_tokens for h in firsts))


def test_rag_streams_batches_and_samples(smollm2, texts, tmp_path):
    """Streaming gives generate's tokens; a batch of questions gives each row's single answer; sampling on an
    exact path (one chunk, no prefix) equals HF sampling over the whole prompt under the same seed."""
    import torch

    model, tokenizer = smollm2
    store = open_embedded_store(tmp_path)
    prefix = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
    handles = precompute([t[:400] for t in texts[9:12]], model, tokenizer, store, prefix=prefix, chunk_size=64,
                         modes=["block-attention"], progress=False).chunks
    rag = RAGGenerator(model, tokenizer, store, prefix=prefix, chunk_size=64, on_missing="error")
    questions = [f"\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in ("What is studied?", "Name one method.")]
    rows = [(handles[:4], questions[0]), (handles[2:6], questions[1])]
    batch = rag.generate_batch(rows, mode="block-attention", max_new_tokens=8)
    single = [rag.generate(c, q, mode="block-attention", max_new_tokens=8) for c, q in rows]
    assert [r.new_ids for r in batch] == [r.new_ids for r in single]
    stream = rag.stream(*rows[0], mode="block-attention", max_new_tokens=8)
    assert "".join(stream.texts()) == single[0].text and stream.result.new_ids == single[0].new_ids
    chunk = _enc(tokenizer, texts[4])[:100]
    question = _enc(tokenizer, "\nIn one sentence, what does this abstract study?\nAnswer:")
    torch.manual_seed(11)
    got = RAGGenerator(model, tokenizer, store).generate([chunk], question, mode="reuse", max_new_tokens=10,
                                                         do_sample=True, temperature=0.7, top_k=50)
    torch.manual_seed(11)
    want = model.generate(torch.tensor([chunk + question]), max_new_tokens=10, do_sample=True, temperature=0.7,
                          top_k=50, pad_token_id=tokenizer.pad_token_id)
    assert got.new_ids == want[0, len(chunk) + len(question):].tolist()


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
