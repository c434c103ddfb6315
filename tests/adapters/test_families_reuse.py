"""Architecture suite, RAG and prompt modules: every family (``families.CONFIGS``) x path x attention
implementation, each cell through ``arch_rule.run_cell`` against plain HF, its outcome compared with
``expected_reuse.EXPECTED`` (the README table's source).

Paths (see ``expected_reuse``): ``rag-reuse``, ``rag-blend``, ``rag-block-attention`` (approximate by design:
their exact limiting case must equal plain HF, and the approximate case must run) and ``prompt-modules`` (exact at
schema positions). A refused family must raise ``UnsupportedModelError`` naming its ``model_type`` and the
feature before storing anything (``precompute`` included)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from arch_rule import APPROXIMATE, EXACT, LOGIT_ATOL, REFUSED, Output, plain_generate, run_cell
from expected_reuse import EXPECTED, PATHS
from families import CONFIGS, WINDOW, attn_implementations, family_model
from helpers import SCHEMA_MARKUP, WordTokenizer, token_ids
from transformers import DynamicCache

from kvshelf.adapters import hf
from kvshelf.adapters.prompt_modules import PromptModuleGenerator
from kvshelf.adapters.rag import RAGGenerator, precompute
from kvshelf.adapters.rag.chunks import compute_chunk
from kvshelf.adapters.reuse_engine import move_kv, rope, ropes
from kvshelf.kvstore.errors import UnsupportedModelError
from kvshelf.reuse import ModuleUse

NEW = 4  # greedy tokens per cell
RAG_FEATURE, MODULES_FEATURE = "RAG", "prompt modules"

_MODELS: dict[tuple[str, str, torch.dtype], torch.nn.Module] = {}


def _model(family: str, attn: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Each family's tiny model, built once per attention implementation and dtype."""
    key = (family, attn, dtype)
    if key not in _MODELS:
        _MODELS[key] = family_model(family, attn=attn, dtype=dtype)
    return _MODELS[key]


class _Store:
    """An in-memory block store (the ``BlockStore`` calls the RAG and prompt-module front doors make) that
    records what was put."""

    namespace = "default"

    def __init__(self) -> None:
        self.blocks: dict[bytes, object] = {}

    def get_many(self, keys, **_):  # noqa: ANN001, ANN003, ANN201
        return [self.blocks.get(k) for k in keys]

    def put_many(self, items, pin: bool = False) -> None:  # noqa: ANN001
        self.blocks.update(items)

    def held(self, keys, **_) -> list[bool]:  # noqa: ANN001, ANN003
        return [k in self.blocks for k in keys]


# every exact limiting case is longer than the windowed families' sliding window (families.WINDOW)
CHUNKS = [token_ids(WINDOW + 6, 21), token_ids(WINDOW - 4, 22), token_ids(11, 23)]
PREFIX, QUESTION = token_ids(4, 24), token_ids(5, 25)
MODULE_TEXT = " ".join(["tell me a story now"] * 6)


def _rag_output(result) -> Output:  # noqa: ANN001
    return Output(result.new_ids, [result.first_logits])


def _approximate_runs(run: Callable[[], object]) -> None:
    """The approximate case runs, gives ``NEW`` tokens and finite logits."""
    result = run()
    assert len(result.new_ids) == NEW
    assert torch.isfinite(result.first_logits).all()


def _rerotation_is_exact(model) -> None:  # noqa: ANN001
    """Keys of a chunk computed alone at 0 and moved to ``p`` equal the chunk computed alone at ``p`` (the model's
    own rotary convention: partial, interleaved, scaled). MLA: the cache's values are its rotated part."""
    ids, position = CHUNKS[0], 37
    with torch.inference_mode():
        chunk = compute_chunk(model, ids, "fp", "default")
        cache = DynamicCache(config=model.config)
        hf.keep_sliding_history(cache)  # sliding-window layers keep every token
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(position, position + len(ids))[None],
                    use_cache=True, past_key_values=cache)
    at_p = [torch.stack([layer.keys[0] for layer in out.past_key_values.layers]),
            torch.stack([layer.values[0] for layer in out.past_key_values.layers])]
    moved = move_kv(model, chunk.keys, chunk.values, position, ropes(model))
    for got, want in zip(moved, at_p, strict=True):
        assert (got - want).abs().max().item() <= LOGIT_ATOL


def _rag_cell(model, path: str) -> str:  # noqa: ANN001
    store = _Store()
    nothing_stored = lambda: not store.blocks  # noqa: E731
    if path == "rag-reuse":  # exact limiting case: one chunk, no prefix
        outcome = run_cell(model, RAG_FEATURE, lambda: _rag_output(RAGGenerator(model, None, store).generate(
            [CHUNKS[0]], QUESTION, mode="reuse", max_new_tokens=NEW, eos_token_id=None)),
            lambda: plain_generate(model, CHUNKS[0] + QUESTION, NEW), nothing_stored=nothing_stored)
        precomputed = run_cell(model, RAG_FEATURE, lambda: Output(
            [precompute(["a b c d e f g h"], model, WordTokenizer(), store, chunk_size=4, progress=False)
             ["computed"]]), Output([2]), nothing_stored=nothing_stored)
        assert precomputed == outcome
        if outcome == REFUSED:
            return REFUSED
        _rerotation_is_exact(model)
        rag = RAGGenerator(model, None, store, prefix=PREFIX)
        _approximate_runs(lambda: rag.generate(CHUNKS, QUESTION, mode="reuse", max_new_tokens=NEW,
                                               eos_token_id=None))
        _approximate_runs(lambda: rag.generate(CHUNKS[::-1], QUESTION, mode="reuse", max_new_tokens=NEW,
                                               eos_token_id=None))
        return APPROXIMATE
    if path == "rag-blend":  # exact limiting case: recompute_ratio=1.0, both blend bases
        everything = PREFIX + sum(CHUNKS, []) + QUESTION
        outcomes = {run_cell(model, RAG_FEATURE, lambda base=base: _rag_output(RAGGenerator(
            model, None, store, prefix=PREFIX, recompute_ratio=1.0, blend_base=base).generate(
                CHUNKS, QUESTION, mode="reuse-blend", max_new_tokens=NEW, eos_token_id=None)),
            lambda: plain_generate(model, everything, NEW), nothing_stored=nothing_stored)
            for base in ("block", "chunk")}
        (outcome,) = outcomes
        if outcome == REFUSED:
            return REFUSED
        _approximate_runs(lambda: RAGGenerator(model, None, store, prefix=PREFIX).generate(
            CHUNKS, QUESTION, mode="reuse-blend", max_new_tokens=NEW, eos_token_id=None))
        return APPROXIMATE
    # rag-block-attention: exact limiting case: one block after the prefix (it sees the prefix, the question all)
    outcome = run_cell(model, RAG_FEATURE, lambda: _rag_output(RAGGenerator(model, None, store, prefix=PREFIX).generate(
        [CHUNKS[1]], QUESTION, mode="block-attention", max_new_tokens=NEW, eos_token_id=None)),
        lambda: plain_generate(model, PREFIX + CHUNKS[1] + QUESTION, NEW), nothing_stored=nothing_stored)
    if outcome == REFUSED:
        return REFUSED
    rag = RAGGenerator(model, None, store, prefix=PREFIX)
    for _ in range(2):  # blocks computed, then reused
        _approximate_runs(lambda: rag.generate(CHUNKS, QUESTION, mode="block-attention", max_new_tokens=NEW,
                                               eos_token_id=None))
    # precompute with the prefix serves every mode's first query: no chunk computed (on_missing="error")
    fresh = _Store()
    handles = precompute(CHUNKS, model, None, fresh, prefix=PREFIX, progress=False).chunks
    strict = RAGGenerator(model, None, fresh, prefix=PREFIX, on_missing="error")
    for mode in ("reuse", "block-attention", "reuse-blend"):
        result = strict.generate(handles, QUESTION, mode=mode, max_new_tokens=1, eos_token_id=None)
        assert (result.reused_chunks, result.computed_chunks) == (len(CHUNKS), 0), mode
    return APPROXIMATE


def _modules_cell(model, dtype: torch.dtype = torch.float32) -> str:  # noqa: ANN001
    store = _Store()
    prompt = [ModuleUse("system"), MODULE_TEXT]  # a module at 0 and text right after: exact
    gen: list[PromptModuleGenerator] = []

    def run() -> Output:
        gen.append(PromptModuleGenerator(model, WordTokenizer(), store, SCHEMA_MARKUP))
        result = gen[0].generate(prompt, max_new_tokens=NEW, eos_token_id=None)
        assert result.reused_tokens > 0
        assert list(result.assembly.positions) == list(range(len(result.assembly.tokens)))
        assert len(result.assembly.tokens) > WINDOW
        return Output(result.new_ids, [result.first_logits])

    def reference() -> Output:
        return plain_generate(model, list(gen[0].assemble(prompt).tokens), NEW)

    outcome = run_cell(model, MODULES_FEATURE, run, reference, dtype=dtype, nothing_stored=lambda: not store.blocks)
    if outcome == EXACT:  # modules away from 0, a parameter slot: the paper's approximation runs
        _approximate_runs(lambda: gen[0].generate(
            [ModuleUse("system"), ModuleUse("manual", {"product": "x y z"}), ModuleUse("faq"), "why"],
            max_new_tokens=NEW, eos_token_id=None))
    return outcome


CELLS = [pytest.param(family, attn, path, id=f"{family}-{attn}-{path}")
         for family in CONFIGS for attn in attn_implementations(family) for path in PATHS]


@pytest.mark.parametrize(("family", "attn", "path"), CELLS)
def test_cell(family, attn, path):
    model = _model(family, attn)
    outcome = _modules_cell(model) if path == "prompt-modules" else _rag_cell(model, path)
    assert outcome == EXPECTED[(family, path)], f"{family}/{path} under {attn}: {outcome}"


BF16_CELLS = [pytest.param(family, path, id=f"{family}-bf16-{path}")
              for family in ("llama", "cohere", "granite", "stablelm", "phi3-partial", "gpt-neox") for path in PATHS]


def _bf16_limit(model, path: str) -> tuple[Callable[[], Output], Callable[[], Output]]:  # noqa: ANN001
    """A RAG path's exact limiting case: ``(run, reference)``."""
    if path == "rag-reuse":
        return (lambda: _rag_output(RAGGenerator(model, None, _Store()).generate(
            [CHUNKS[0]], QUESTION, mode="reuse", max_new_tokens=NEW, eos_token_id=None)),
            lambda: plain_generate(model, CHUNKS[0] + QUESTION, NEW))
    if path == "rag-blend":
        return (lambda: _rag_output(RAGGenerator(model, None, _Store(), prefix=PREFIX, recompute_ratio=1.0).generate(
            CHUNKS, QUESTION, mode="reuse-blend", max_new_tokens=NEW, eos_token_id=None)),
            lambda: plain_generate(model, PREFIX + sum(CHUNKS, []) + QUESTION, NEW))
    return (lambda: _rag_output(RAGGenerator(model, None, _Store(), prefix=PREFIX).generate(
        [CHUNKS[1]], QUESTION, mode="block-attention", max_new_tokens=NEW, eos_token_id=None)),
        lambda: plain_generate(model, PREFIX + CHUNKS[1] + QUESTION, NEW))


@pytest.mark.parametrize(("family", "path"), BF16_CELLS)
def test_bf16_cell(family, path):
    """bf16 (sdpa): the exact limiting cases give the reference's tokens, logits within the bf16 tolerance."""
    model = _model(family, "sdpa", torch.bfloat16)
    if path == "prompt-modules":
        outcome = _modules_cell(model, torch.bfloat16)
    else:
        run, reference = _bf16_limit(model, path)
        outcome = run_cell(model, RAG_FEATURE, run, reference, dtype=torch.bfloat16)
    assert outcome == EXACT


@pytest.mark.parametrize(("family", "rotary_dim", "interleaved"), [
    ("llama", 16, False), ("phi3-partial", 8, False), ("stablelm", 4, False), ("gpt-neox", 4, False),
    ("cohere", 16, True), ("gemma3-full", 16, False)])
def test_rotary_convention_is_read_from_the_model(family, rotary_dim, interleaved):
    """Partial rotary and interleaved pairs come from the model's own rotary embedding (head dim 16)."""
    rotary = rope(_model(family, "sdpa"))
    assert (rotary.rotary_dim, rotary.interleaved) == (rotary_dim, interleaved)


def test_a_forward_detail_the_engine_does_not_know_is_refused_before_any_work():
    """The once-per-model self-check: a model whose own forward does something the layer-by-layer engine does not
    (here: logits doubled by a hook) is refused, naming family and feature, and nothing is stored."""
    model = family_model("llama")  # its own instance: the self-check's verdict is kept per model

    def doubled(module, args, output):  # noqa: ANN001, ANN202
        output.logits = output.logits * 2
        return output

    model.register_forward_hook(doubled)
    store = _Store()
    for feature, start in ((RAG_FEATURE, lambda: RAGGenerator(model, None, store)),
                           (RAG_FEATURE, lambda: precompute(["a b c d"], model, WordTokenizer(), store,
                                                            chunk_size=2, progress=False)),
                           (MODULES_FEATURE, lambda: PromptModuleGenerator(model, WordTokenizer(), store,
                                                                           SCHEMA_MARKUP))):
        assert run_cell(model, feature, start, Output([]), nothing_stored=lambda: not store.blocks) == REFUSED


def test_ape_on_sliding_window_layers_is_refused_up_front():
    """APE's column bias rides on an explicit decoding mask, which sliding-window layers cannot take."""
    with pytest.raises(UnsupportedModelError, match="'mistral'.*APE"):
        RAGGenerator(_model("mistral", "sdpa"), None, _Store(), ape=(0.9, 0.8))
    assert RAGGenerator(_model("llama", "sdpa"), None, _Store(), ape=(0.9, 0.8)).ape == (0.9, 0.8)


@pytest.mark.parametrize("family", ["llama-dynamic", "llama-longrope"])
def test_length_dependent_rope_is_refused_past_its_static_length_before_any_work(family):
    """Dynamic and longrope RoPE keep their original tables up to a length (exact there, the cells above); a
    context, chunk or module past it is refused, naming family and feature, with nothing stored."""
    model = _model(family, "sdpa")
    limit = min(r.static_positions for r in ropes(model))  # dynamic: the model's own max positions - 1
    chunk = token_ids(limit - len(QUESTION), 26)  # with the question and one new token: one position too many
    store = _Store()
    stored = lambda: not store.blocks  # noqa: E731
    rag = RAGGenerator(model, None, store)
    for mode in ("reuse", "reuse-blend", "block-attention"):
        assert run_cell(model, RAG_FEATURE, lambda mode=mode: rag.generate([chunk], QUESTION, mode=mode,
                                                                           max_new_tokens=1),
                        Output([]), nothing_stored=stored) == REFUSED
    assert run_cell(model, RAG_FEATURE, lambda: precompute(
        [" ".join(f"w{i}" for i in range(limit + 1))], model, WordTokenizer(), store, chunk_size=limit + 1,
        progress=False), Output([]), nothing_stored=stored) == REFUSED
    late = f'<schema name="late"><module name="m" start="{limit - 1}">far away</module></schema>'
    assert run_cell(model, MODULES_FEATURE, lambda: PromptModuleGenerator(model, WordTokenizer(), store, late),
                    Output([]), nothing_stored=stored) == REFUSED
