"""Every registered RAG mode (``adapters.rag.modes.registry``) on a tiny random Llama: where a mode claims an exact
case (``RAGMode.exactness``) its greedy answer there equals full prefill's, computed and then read back from the
store; a mode that assembles stored KV refuses the families the reuse engine cannot drive, before any work. A mode
registered later is covered by these tests as it is."""

from __future__ import annotations

import pytest
import torch
from expected_reuse import REFUSED_FAMILIES
from families import family_model
from helpers import token_ids

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.rag import MODES, RAGGenerator, precompute
from kvshelf.adapters.rag.modes.registry import REGISTRY, needed_kinds
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import ConfigError, UnsupportedModelError

NAMES = [pytest.param(name, id=name) for name in REGISTRY]
CHUNKS = [token_ids(20, 2), token_ids(30, 3), token_ids(25, 4)]
PREFIX, QUESTION = token_ids(5, 5), token_ids(7, 6)
NEW = 8


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, layers=4)


def test_the_public_names_are_the_registrys():
    assert MODES == tuple(REGISTRY) == ("full", "reuse", "reuse-blend", "block-attention")
    with pytest.raises(ConfigError, match="unknown mode 'bogus'"):
        needed_kinds(["bogus"])


@pytest.mark.parametrize("name", NAMES)
def test_the_exact_case_equals_full_prefill(model, name, tmp_path):
    mode = REGISTRY[name]
    exact = mode.exactness
    if exact is None:
        pytest.skip(f"{name} is approximate by design: no exact case")
    chunks = CHUNKS[: exact.max_chunks]
    prefix = PREFIX if exact.prefix else []
    plain = CachedGenerator(model).generate(prefix + sum(chunks, []) + QUESTION, max_new_tokens=NEW, reuse=False,
                                            store=False, eos_token_id=None)
    with open_embedded_store(tmp_path, memory_bytes="64MiB") as store:
        rag = RAGGenerator(model, None, store, prefix=prefix or None, **exact.settings)
        full = rag.generate(chunks, QUESTION, mode="full", max_new_tokens=NEW, eos_token_id=None)
        assert full.new_ids == plain.new_ids
        for computed in (len(chunks) if mode.engine else 0, 0):  # computed and stored, then read back
            got = rag.generate(chunks, QUESTION, mode=name, max_new_tokens=NEW, eos_token_id=None)
            assert got.new_ids == full.new_ids, f"{name}: {got.new_ids} != full prefill's {full.new_ids}"
            assert torch.allclose(got.first_logits, full.first_logits, atol=1e-4)
            assert got.computed_chunks == computed


@pytest.mark.parametrize("name", NAMES)
def test_precompute_stores_what_the_mode_reads(model, name, tmp_path):
    mode = REGISTRY[name]
    if not mode.engine:
        with pytest.raises(ConfigError, match="reuses nothing"):
            precompute([CHUNKS[0]], model, None, None, modes=[name], progress=False)
        return
    with open_embedded_store(tmp_path, memory_bytes="64MiB") as store:
        done = precompute(CHUNKS, model, None, store, prefix=PREFIX, modes=[name], chunk_size=32, progress=False)
        assert set(done["kinds"]) == needed_kinds([name])
        rag = RAGGenerator(model, None, store, prefix=PREFIX, on_missing="error", chunk_size=32)
        got = rag.generate(CHUNKS, QUESTION, mode=name, max_new_tokens=2, eos_token_id=None)
        assert (got.reused_chunks, got.computed_chunks) == (len(CHUNKS), 0)


@pytest.mark.parametrize("family", sorted(REFUSED_FAMILIES))
@pytest.mark.parametrize("name", NAMES)
def test_refusal_comes_before_any_work(name, family):
    model = family_model(family)
    mode = REGISTRY[name]
    if mode.engine:
        with pytest.raises(UnsupportedModelError):
            mode.check(model, 64)
    else:
        assert mode.check(model, 64) is None  # full prefill is plain HF: nothing to refuse
    with pytest.raises(UnsupportedModelError):  # the generator takes no model a reuse mode would refuse
        RAGGenerator(model, None, None)
