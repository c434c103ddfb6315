"""RAG precompute that serves every mode, chunk handles, missing-chunk errors, and the RAGGenerator front door
(streaming, sampling, batches, close) on a tiny random Llama."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from arch_rule import plain_generate
from helpers import WordTokenizer, token_ids

from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.rag import ChunkHandle, RAGGenerator, precompute, prefix_ids
from kvshelf.kvstore import ConfigError, open_embedded_store
from kvshelf.reuse.chunking import chunk_tokens
from kvshelf.reuse.errors import ChunkMissingError, ForeignChunkError
from kvshelf.reuse.keys import prefix_digest

PREFIX = "system you answer from the documents user"
QUESTION = "which word comes first in the second document"
DOCS = [" ".join(f"alpha{i}" for i in range(23)), " ".join(f"beta{i}" for i in range(9)),
        " ".join(f"gamma{i}" for i in range(14))]
SIZE = 10  # tokens per chunk: the first document makes 3 chunks, the second 1, the third 2
MODES = [("reuse", "block"), ("block-attention", "block"), ("reuse-blend", "block"), ("reuse-blend", "chunk")]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, layers=4)


@pytest.fixture
def store(tmp_path):
    with open_embedded_store(tmp_path, memory_bytes="64MiB") as s:
        yield s


def _strict(model, store, **kw) -> RAGGenerator:  # noqa: ANN001
    return RAGGenerator(model, WordTokenizer(), store, prefix=PREFIX, on_missing="error", chunk_size=SIZE, **kw)


# -- precompute ------------------------------------------------------------------------------------------------


def test_precompute_returns_handles_and_a_summary_and_resumes(model, store):
    result = precompute(DOCS, model, WordTokenizer(), store, prefix=PREFIX, chunk_size=SIZE, progress=False)
    assert [(h.document, h.index, h.start, h.end) for h in result.chunks] == [
        (0, 0, 0, 10), (0, 1, 10, 20), (0, 2, 20, 23), (1, 0, 0, 9), (2, 0, 0, 10), (2, 1, 10, 14)]
    tok = WordTokenizer()
    for handle in result.chunks:
        ids = tok(DOCS[handle.document])["input_ids"]
        assert list(handle.token_ids) == ids[handle.start:handle.end]
        assert handle.text == tok.decode(handle.token_ids)
        assert (handle.namespace, handle.chunk_size, handle.overlap) == ("default", SIZE, 0)
    summary = result.summary()
    assert (summary["documents"], summary["chunks"], summary["computed"], summary["skipped"]) == (3, 6, 6, 0)
    assert result["tokens"] == 46 and summary["prefix_tokens"] == 7
    assert summary["prefix_digest"] == prefix_digest(prefix_ids(tok, PREFIX))
    # default modes: position-0 chunks (reuse), blocks after the prefix (block-attention, reuse-blend), the prefix
    assert summary["kinds"] == {"block": {"computed": 6, "skipped": 0}, "chunk": {"computed": 6, "skipped": 0},
                                "prefix": {"computed": 1, "skipped": 0}}
    json.dumps(summary)  # the CLI prints it
    again = precompute(DOCS, model, tok, store, prefix=PREFIX, chunk_size=SIZE, progress=False)
    assert (again["computed"], again["skipped"], again["computed_tokens"]) == (0, 6, 0)
    assert again.chunks == result.chunks
    other_prefix = precompute(DOCS, model, tok, store, prefix="another system prompt", chunk_size=SIZE,
                              progress=False)
    # the position-0 chunks are shared; the blocks after another prefix are new
    assert other_prefix["kinds"]["chunk"] == {"computed": 0, "skipped": 6}
    assert other_prefix["kinds"]["block"] == {"computed": 6, "skipped": 0}


def test_only_the_asked_modes_are_stored(model, store):
    result = precompute(DOCS[:1], model, WordTokenizer(), store, prefix=PREFIX, modes=["reuse"], chunk_size=SIZE,
                        progress=False)
    assert set(result["kinds"]) == {"chunk", "prefix"}
    with pytest.raises(ChunkMissingError) as info:
        _strict(model, store).generate(result.chunks, QUESTION, mode="block-attention", max_new_tokens=1)
    assert info.value.reason == "other-kind" and info.value.kind == "block"
    for bad in ([], ["full"], ["bogus"]):
        with pytest.raises(ConfigError):
            precompute(DOCS, model, WordTokenizer(), store, modes=bad, progress=False)


@pytest.mark.parametrize(("mode", "base"), MODES)
def test_first_query_after_precompute_reuses_every_chunk(model, store, mode, base):
    """The figure: after precompute with the generator's prefix, the first query of every mode computes no chunk
    (``on_missing="error"`` would raise otherwise), given handles, whole documents (split as precompute split
    them) or the chunks' token ids."""
    handles = precompute(DOCS, model, WordTokenizer(), store, prefix=PREFIX, chunk_size=SIZE, blend_base=base,
                         progress=False).chunks
    rag = _strict(model, store, blend_base=base)
    for chunks in (handles, DOCS, [list(h.token_ids) for h in handles]):
        result = rag.generate(chunks, QUESTION, mode=mode, max_new_tokens=3, eos_token_id=None)
        assert (result.chunks, result.reused_chunks, result.computed_chunks) == (6, 6, 0)
        assert len(result.new_ids) == 3


def test_an_over_long_text_is_split_as_precompute_split_it(model, store):
    precompute(DOCS[:1], model, WordTokenizer(), store, chunk_size=SIZE, modes=["reuse"], progress=False)
    rag = RAGGenerator(model, WordTokenizer(), store, chunk_size=SIZE, on_missing="error")
    assert rag.split(DOCS[:1]) == chunk_tokens(WordTokenizer()(DOCS[0])["input_ids"], SIZE)
    result = rag.generate(DOCS[:1], QUESTION, mode="reuse", max_new_tokens=1)
    assert (result.chunks, result.reused_chunks) == (3, 3)
    # another chunk size splits differently: those chunks were never stored, and the error says which
    with pytest.raises(ChunkMissingError, match=r"chunk 0 \(input 0 piece 1 of 4, 7 tokens"):
        RAGGenerator(model, WordTokenizer(), store, chunk_size=7, on_missing="error").generate(
            DOCS[:1], QUESTION, mode="reuse")
    whole = RAGGenerator(model, WordTokenizer(), store, chunk_size=None)  # no splitting: one 23-token chunk
    assert whole.generate(DOCS[:1], QUESTION, mode="reuse", max_new_tokens=1).chunks == 1


def test_a_handle_of_another_model_or_namespace_is_refused(model, store, tmp_path):
    handles = precompute(DOCS[:1], model, WordTokenizer(), store, chunk_size=SIZE, progress=False).chunks
    other = tiny_llama(seed=1, layers=4)
    with pytest.raises(ForeignChunkError, match=f"model {handles[0].fingerprint}.*this generator's model is"):
        RAGGenerator(other, WordTokenizer(), store).generate(handles, QUESTION, max_new_tokens=1)
    with (open_embedded_store(tmp_path / "b", memory_bytes="64MiB", namespace="team-b") as elsewhere,
          pytest.raises(ForeignChunkError, match="namespace 'default', this generator's is 'team-b'")):
        RAGGenerator(model, WordTokenizer(), elsewhere).generate(handles, QUESTION, max_new_tokens=1)
    half = copy.deepcopy(model).to(torch.bfloat16)
    half_handles = precompute(DOCS[:1], half, WordTokenizer(), store, chunk_size=SIZE, progress=False).chunks
    with pytest.raises(ForeignChunkError, match=r"\(the same weights in bfloat16\), this generator's model is .* "
                                                r"\(float32\)"):
        RAGGenerator(model, WordTokenizer(), store).generate(half_handles[:1], QUESTION, max_new_tokens=1)
    assert isinstance(handles[0], ChunkHandle) and half_handles[0].token_ids == handles[0].token_ids


def test_missing_chunk_errors_say_what_and_why(model, store):
    tok = WordTokenizer()
    strict = _strict(model, store)
    with pytest.raises(ChunkMissingError) as info:  # nothing stored at all: the prefix is missing first
        strict.generate(DOCS[1:2], QUESTION, mode="reuse")
    assert info.value.kind == "prefix" and "7-token prefix" in str(info.value)
    precompute(DOCS[1:2], model, tok, store, prefix=PREFIX, modes=["reuse"], chunk_size=SIZE, progress=False)
    with pytest.raises(ChunkMissingError) as info:  # the position-0 chunk is there, not the block
        strict.generate(DOCS[1:2] + DOCS[2:], QUESTION, mode="block-attention")
    message, error = str(info.value), info.value
    assert (error.index, error.kind, error.mode, error.reason) == (0, "block", "block-attention", "other-kind")
    digest = prefix_digest(prefix_ids(tok, PREFIX))
    for part in ("chunk 0 (input 0, 9 tokens:", "block after the 7-token prefix " + digest, strict.fingerprint,
                 "namespace 'default'", "(and 2 more chunks)", "position-0 chunk is stored", "'block-attention'"):
        assert part in message, (part, message)
    with pytest.raises(ChunkMissingError) as info:  # never stored
        strict.generate(DOCS[2:], QUESTION, mode="reuse")
    assert info.value.reason == "absent" and "never precomputed" in str(info.value)
    assert "position-0 chunk" in str(info.value)
    half = copy.deepcopy(model).to(torch.bfloat16)  # stored for the bfloat16 cast of the same weights
    precompute(DOCS[2:], half, tok, store, prefix=PREFIX, modes=["reuse"], chunk_size=SIZE, progress=False)
    precompute([], model, tok, store, prefix=PREFIX, modes=["reuse"], progress=False)
    with pytest.raises(ChunkMissingError) as info:
        strict.generate(DOCS[2:], QUESTION, mode="reuse")
    assert info.value.reason == "other-dtype" and "bfloat16" in str(info.value)


def test_bad_inputs_are_clear_errors(model, store):
    rag = RAGGenerator(model, WordTokenizer(), store)
    with pytest.raises(ConfigError, match="no chunks"):
        rag.generate([], QUESTION)
    with pytest.raises(ConfigError, match="chunk 1 is empty"):
        rag.generate(["a b", ""], QUESTION)
    with pytest.raises(ConfigError, match="not one str"):
        rag.generate("a b c", QUESTION)
    with pytest.raises(ConfigError, match="at least one"):
        rag.generate_batch([])
    mixed = rag.generate(["one two three", token_ids(5, 3)], QUESTION, max_new_tokens=1)  # text and ids mix
    assert mixed.chunks == 2
    with RAGGenerator(model, WordTokenizer(), store) as scoped:
        scoped.generate(["a b"], QUESTION, max_new_tokens=1)
    for call in (lambda: scoped.generate(["a b"], QUESTION), lambda: scoped.stream(["a b"], QUESTION),
                 lambda: scoped.generate_batch([(["a b"], QUESTION)])):
        with pytest.raises(ConfigError, match="is closed"):
            call()
    assert RAGGenerator(model, WordTokenizer(), store).generate(["a b"], QUESTION, max_new_tokens=1).reused_chunks \
        == 1  # the store stays open: closing a generator leaves it to its owner


def test_precompute_command_takes_a_prefix_and_modes(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kvshelf.adapters import model as model_module
    from kvshelf.service.cli import app

    monkeypatch.setattr(model_module, "load_model", lambda name, dtype="float32", device="cpu": (
        tiny_llama(seed=0, layers=4), WordTokenizer()))
    doc, prefix = tmp_path / "doc.txt", tmp_path / "prefix.txt"
    doc.write_text(DOCS[0])
    prefix.write_text(PREFIX)
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path / "store"), "--chunk-size", str(SIZE)]
    result = runner.invoke(app, ["precompute", str(doc), *data, "--prefix-file", str(prefix), "--modes",
                                 "block-attention"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    assert (summary["chunks"], summary["computed"], summary["prefix_tokens"], summary["modes"]) == (
        3, 3, 7, ["block-attention"])
    assert set(summary["kinds"]) == {"block", "prefix"}
    result = runner.invoke(app, ["precompute", str(doc), *data, "--prefix", PREFIX])  # resumes: blocks held
    summary = json.loads(result.output[result.output.index("{"):])
    assert summary["kinds"]["block"] == {"computed": 0, "skipped": 3}
    assert summary["kinds"]["chunk"] == {"computed": 3, "skipped": 0}
    result = runner.invoke(app, ["precompute", str(doc), *data, "--modes", "full"])
    assert result.exit_code != 0 and "--modes" in str(result.exception or result.output)


def test_full_mode_equals_plain_generate(model, store):
    ids = [token_ids(12, 2), token_ids(9, 3)]
    q = token_ids(5, 4)
    rag = RAGGenerator(model, None, store, prefix=token_ids(4, 5))
    result = rag.generate(ids, q, mode="full", max_new_tokens=6, eos_token_id=None, all_logits=True)
    want = plain_generate(model, token_ids(4, 5) + ids[0] + ids[1] + q, 6)
    assert result.new_ids == want.tokens
    assert result.logits is not None and len(result.logits) == 6
    assert torch.allclose(result.logits[-1], want.logits[-1], atol=1e-4)
