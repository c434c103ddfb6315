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
    from kvshelf.cli import app

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


# -- streaming, sampling, batches ------------------------------------------------------------------------------

CHUNK_IDS = [token_ids(14, 31), token_ids(11, 32), token_ids(9, 33)]
Q_IDS, P_IDS = token_ids(6, 34), token_ids(4, 35)
ALL_MODES = ("full", "reuse", "reuse-blend", "block-attention")


class _Collect:
    """A streamer recording every ``put`` (as lists) and whether ``end`` was called."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.puts.append([int(t) for t in value.reshape(-1).tolist()])

    def end(self) -> None:
        self.ended = True


class _Counting:
    """A logits processor that counts its calls (proves ``logits_processor`` reaches ``model.generate``)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return scores


@pytest.mark.parametrize("ape", [None, (0.9, 0.8)])
def test_streaming_yields_the_tokens_generate_gives(model, store, ape):
    rag = RAGGenerator(model, None, store, prefix=P_IDS, ape=ape)
    for mode in ALL_MODES:
        want = rag.generate(CHUNK_IDS, Q_IDS, mode=mode, max_new_tokens=5, eos_token_id=None)
        stream = rag.stream(CHUNK_IDS, Q_IDS, mode=mode, max_new_tokens=5, eos_token_id=None)
        assert list(stream) == want.new_ids == stream.result.new_ids, mode
        collect = _Collect()
        result = rag.generate(CHUNK_IDS, Q_IDS, mode=mode, max_new_tokens=5, eos_token_id=None, streamer=collect)
        prompt = P_IDS + sum(CHUNK_IDS, []) + Q_IDS
        assert collect.puts[0] == prompt and sum(collect.puts[1:], []) == want.new_ids and collect.ended, mode
        assert 0 < result.ttft_s <= result.total_s


def test_sampling_goes_through_generate_and_equals_plain_sampling(model, store):
    """Exact paths (full; one chunk without prefix under reuse; reuse-blend recomputing everything) sample the
    same tokens as ``model.generate`` over the whole prompt under the same seed; every mode passes sampling
    arguments and logits processors on; APE refuses them."""
    def plain(ids: list[int]) -> list[int]:
        torch.manual_seed(7)
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=True, temperature=0.8, top_k=50,
                             eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()

    sampling = {"max_new_tokens": 8, "do_sample": True, "temperature": 0.8, "top_k": 50, "eos_token_id": None}
    cases = [(RAGGenerator(model, None, store), [CHUNK_IDS[0]], "reuse"),
             (RAGGenerator(model, None, store, prefix=P_IDS), CHUNK_IDS, "full"),
             (RAGGenerator(model, None, store, prefix=P_IDS, recompute_ratio=1.0), CHUNK_IDS, "reuse-blend")]
    for rag, chunks, mode in cases:
        torch.manual_seed(7)
        got = rag.generate(chunks, Q_IDS, mode=mode, **sampling).new_ids
        assert got == plain(rag.prefix + sum(chunks, []) + Q_IDS), mode
        greedy = rag.generate(chunks, Q_IDS, mode=mode, max_new_tokens=8, eos_token_id=None).new_ids
        assert got != greedy, mode  # it did sample
    rag = RAGGenerator(model, None, store, prefix=P_IDS)
    for mode in ALL_MODES:
        counting = _Counting()
        rag.generate(CHUNK_IDS, Q_IDS, mode=mode, max_new_tokens=4, eos_token_id=None, logits_processor=[counting],
                     do_sample=True, top_k=5)
        assert counting.calls == 4, mode
    with pytest.raises(ConfigError, match="do_sample"):
        RAGGenerator(model, None, store, ape=(0.9, 0.8)).generate(CHUNK_IDS, Q_IDS, do_sample=True)
    with pytest.raises(ConfigError, match="past_key_values"):
        rag.generate(CHUNK_IDS, Q_IDS, past_key_values=None)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_batch_rows_equal_single_row_runs(model, store, mode):
    handles = precompute(DOCS, model, WordTokenizer(), store, prefix=PREFIX, chunk_size=SIZE, progress=False).chunks
    rag = RAGGenerator(model, WordTokenizer(), store, prefix=PREFIX, chunk_size=SIZE)
    rows = [(handles[:3], QUESTION), (DOCS[1:], "what is the last word"), (handles[3:4] + handles[:1], QUESTION)]
    batch = rag.generate_batch(rows, mode=mode, max_new_tokens=5, eos_token_id=None)
    single = [rag.generate(chunks, q, mode=mode, max_new_tokens=5, eos_token_id=None) for chunks, q in rows]
    assert [r.new_ids for r in batch] == [r.new_ids for r in single]
    for got, want in zip(batch, single, strict=True):
        assert torch.allclose(got.first_logits, want.first_logits, atol=1e-4)
    if mode == "full":
        tok = WordTokenizer()
        for (chunks, q), got in zip(rows, batch, strict=True):
            ids = prefix_ids(tok, PREFIX) + sum(rag.split(chunks), []) + tok(q)["input_ids"]
            assert got.new_ids == plain_generate(model, ids, 5).tokens
    else:
        assert [r.computed_chunks for r in batch] == [0, 0, 0]


def test_prompt_modules_stream_sample_and_close(model, store):
    from helpers import SCHEMA_MARKUP

    from kvshelf.adapters.prompt_modules import PromptModuleGenerator
    from kvshelf.reuse import ModuleUse

    gen = PromptModuleGenerator(model, WordTokenizer(), store, SCHEMA_MARKUP)
    exact = [ModuleUse("system"), "tell me a story now"]
    slotted = [ModuleUse("system"), ModuleUse("manual", {"product": "x y"}), ModuleUse("faq"), "why"]
    for prompt in (exact, slotted):
        want = gen.generate(prompt, max_new_tokens=5, eos_token_id=None)
        stream = gen.stream(prompt, max_new_tokens=5, eos_token_id=None)
        assert list(stream) == want.new_ids == stream.result.new_ids
    # positions with gaps (a parameter slot): no reuse equals HF generate over the same tokens and positions
    assembly = gen.assemble(slotted)
    assert list(assembly.positions) != list(range(len(assembly.tokens)))
    cold = gen.generate(slotted, max_new_tokens=5, eos_token_id=None, reuse=False)
    ids = torch.tensor([list(assembly.tokens)])
    with torch.inference_mode():
        ref = model.generate(ids, position_ids=torch.tensor([list(assembly.positions)]),
                             attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert cold.new_ids == ref[0, ids.shape[1]:].tolist()
    # sampling on the exact prompt equals plain sampling under the same seed
    tokens = list(gen.assemble(exact).tokens)
    torch.manual_seed(3)
    got = gen.generate(exact, max_new_tokens=6, do_sample=True, temperature=0.9, eos_token_id=None).new_ids
    torch.manual_seed(3)
    plain = model.generate(torch.tensor([tokens]), max_new_tokens=6, do_sample=True, temperature=0.9,
                           eos_token_id=None, pad_token_id=0)[0, len(tokens):].tolist()
    assert got == plain
    collect = _Collect()
    gen.generate(exact, max_new_tokens=3, eos_token_id=None, streamer=collect)
    assert collect.puts[0] == tokens and len(collect.puts) == 4 and collect.ended
    with gen:
        pass
    with pytest.raises(ConfigError, match="is closed"):
        gen.generate(exact)
    with pytest.raises(ConfigError, match="is closed"):
        gen.stream(exact)
