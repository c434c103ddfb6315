"""RAG decoding from the reuse engine's own last prompt row (``decode.generate_prefilled``, ``hf.prefilled``).

The engine computes every prompt row, the last one included, and ``model.generate`` takes that row's logits and
the full cache as its prefill: no model forward runs over the prompt. Checked here: the forward calls ``generate``
makes, equality with the previous path (``generate`` computing the last prompt token itself over a cache of the
others) on every family the RAG paths support, sampling and streamers, the fallback for decoding modes that take
no prefill, and that the per-call ``_prefill`` leaves nothing behind and never answers another thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
from arch_rule import LOGIT_ATOL
from expected_reuse import REFUSED_FAMILIES
from families import CONFIGS, attn_implementations, family_model
from helpers import token_ids

from kvshelf.adapters import decode, hf
from kvshelf.adapters.decode import generate_from_layout
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.rag import RAGGenerator
from kvshelf.adapters.rag.modes import assembled as rag_module
from kvshelf.adapters.reuse_engine import Layout
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import UnsupportedModelError

NEW = 4
CHUNKS = [token_ids(30, 31), token_ids(20, 32), token_ids(11, 33)]
PREFIX, QUESTION = token_ids(4, 34), token_ids(6, 35)
RAG_MODES = ("reuse", "reuse-blend", "block-attention")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, layers=4)


def previous_path(model, layout, ids, first_logits, positions=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
    """What RAG decoding did before: the cache holds every prompt row but the last, which ``model.generate``
    computes itself (the engine's last row and its logits are dropped)."""
    rest = Layout([k[:, :, :-1] for k in layout.keys], [v[:, :, :-1] for v in layout.values])
    return generate_from_layout(model, rest, ids, positions, **kwargs)


def _both(monkeypatch, rag: RAGGenerator, mode: str, **kwargs):  # noqa: ANN001, ANN003, ANN202
    """``(new path, previous path)`` results of one generate call."""
    seed = kwargs.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    new = rag.generate(CHUNKS, QUESTION, mode=mode, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(rag_module, "generate_prefilled", previous_path)
        if seed is not None:
            torch.manual_seed(seed)
        old = rag.generate(CHUNKS, QUESTION, mode=mode, **kwargs)
    return new, old


def _assert_same(new, old, what: str) -> None:  # noqa: ANN001
    assert new.new_ids == old.new_ids, f"{what}: {new.new_ids} != previous path's {old.new_ids}"
    for step, (a, b) in enumerate(zip(new.logits, old.logits, strict=True)):
        diff = float((a - b).abs().max())
        assert diff <= LOGIT_ATOL, f"{what}: logits of new token {step} differ from the previous path's by {diff:.3g}"


class _Forwards:
    """Records the input length of every model forward (what ``generate`` runs; the engine drives the decoder
    layers directly)."""

    def __init__(self, model) -> None:  # noqa: ANN001
        self.lengths: list[int] = []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:  # noqa: ANN001
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(int(ids.shape[-1]))

    def close(self) -> None:
        self.handle.remove()


class _Recorder(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended += 1


@pytest.mark.parametrize("mode", RAG_MODES)
def test_the_last_prompt_token_is_the_engines_generate_runs_no_forward_over_the_prompt(model, mode, tmp_path):
    rag = RAGGenerator(model, None, open_embedded_store(tmp_path, memory_bytes="64MiB"), prefix=PREFIX)
    rag.generate(CHUNKS, QUESTION, mode=mode, max_new_tokens=1)  # stores the chunks (computing them is forwards)
    forwards = _Forwards(model)
    try:
        result = rag.generate(CHUNKS, QUESTION, mode=mode, max_new_tokens=NEW, eos_token_id=None)
        first_only = rag.generate(CHUNKS, QUESTION, mode=mode, max_new_tokens=1, eos_token_id=None)
    finally:
        forwards.close()
    # one forward per new token after the first, each over that one token; none over the prompt (the previous
    # path ran one more, over the last prompt token); a one-token answer runs none at all
    assert forwards.lengths == [1] * (NEW - 1)
    assert first_only.new_ids == result.new_ids[:1]
    assert torch.equal(first_only.first_logits, result.first_logits)
    assert "_prefill" not in vars(model)  # the per-call override is gone


def test_full_mode_still_prefills_through_generate(model):
    rag = RAGGenerator(model, None, None, prefix=PREFIX)
    forwards = _Forwards(model)
    try:
        rag.generate(CHUNKS, QUESTION, mode="full", max_new_tokens=NEW, eos_token_id=None)
    finally:
        forwards.close()
    assert forwards.lengths == [len(PREFIX) + sum(map(len, CHUNKS)) + len(QUESTION)] + [1] * (NEW - 1)


FAMILIES = [pytest.param(family, id=family) for family in CONFIGS if family not in REFUSED_FAMILIES]


@pytest.mark.parametrize("family", FAMILIES)
def test_same_tokens_and_logits_as_generate_computing_the_last_token(monkeypatch, family):
    model = family_model(family, attn=attn_implementations(family)[0])
    rag = RAGGenerator(model, None, None, prefix=PREFIX)
    for mode in RAG_MODES:
        new, old = _both(monkeypatch, rag, mode, max_new_tokens=NEW, eos_token_id=None, all_logits=True)
        _assert_same(new, old, f"{family}/{mode}")


def test_sampling_and_streamers_on_the_prefilled_path(monkeypatch, model):
    rag = RAGGenerator(model, None, None, prefix=PREFIX)
    sampling = {"do_sample": True, "temperature": 0.8, "top_k": 40, "max_new_tokens": 8, "eos_token_id": None}
    for mode in RAG_MODES:
        new, old = _both(monkeypatch, rag, mode, seed=5, all_logits=True, **sampling)
        _assert_same(new, old, f"sampling/{mode}")
        greedy = rag.generate(CHUNKS, QUESTION, mode=mode, max_new_tokens=8, eos_token_id=None)
        assert new.new_ids != greedy.new_ids  # sampling did sample (seeded: deterministic)
        streamer = _Recorder()
        torch.manual_seed(5)
        streamed = rag.generate(CHUNKS, QUESTION, mode=mode, streamer=streamer, **sampling)
        prompt = PREFIX + sum(CHUNKS, []) + QUESTION
        assert streamer.puts[0] == prompt and streamer.ended == 1
        assert sum(streamer.puts[1:], []) == streamed.new_ids == new.new_ids
        stream = rag.stream(CHUNKS, QUESTION, mode=mode, max_new_tokens=8, eos_token_id=None)
        assert list(stream) == greedy.new_ids and stream.result.new_ids == greedy.new_ids
        assert 0 < streamed.ttft_s <= streamed.total_s


def test_a_decoding_mode_without_prefill_decodes_as_before(monkeypatch, model):
    """Prompt lookup decoding (assisted generation) takes no prefill: ``generate`` computes the last prompt token
    itself over a cache of the others, as every mode did before (same output as the previous path)."""
    rag = RAGGenerator(model, None, None, prefix=PREFIX)
    new, old = _both(monkeypatch, rag, "reuse", max_new_tokens=NEW, eos_token_id=None, prompt_lookup_num_tokens=2)
    assert new.new_ids == old.new_ids and torch.equal(new.first_logits, old.first_logits)
    assert "_prefill" not in vars(model)


def test_generate_ignoring_the_prefill_is_an_error(monkeypatch, model):
    """A transformers release whose loop never asked for the prefill would have decoded from a cache already
    holding the last prompt row: refused loudly, never returned."""
    layout = Layout.empty(model, 3)
    cache_rows = []

    def fake_generate(model, ids, positions, cache, **kwargs):  # noqa: ANN001, ANN003, ANN202
        cache_rows.append(cache.get_seq_length())
        return None, None

    monkeypatch.setattr(decode, "generate_from_cache", fake_generate)
    with pytest.raises(UnsupportedModelError, match="_prefill"):
        decode.generate_prefilled(model, layout, [5, 6, 7], torch.zeros(model.config.vocab_size), max_new_tokens=2)
    assert cache_rows == [3] and "_prefill" not in vars(model)


def test_prefilled_refuses_a_prompt_of_another_length(model):
    layout = Layout.empty(model, 3)
    cache = decode.cache_for_decoding(model, layout, 2)
    with torch.inference_mode(), hf.prefilled(model, torch.zeros(model.config.vocab_size), cache), \
            pytest.raises(ValueError, match="covers 3 prompt rows"):
        model.generate(torch.tensor([[5, 6, 7, 8]]), past_key_values=cache, max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    assert "_prefill" not in vars(model)


def test_another_threads_generate_meanwhile_runs_its_own_prefill(model):
    """While one thread decodes from a handed-over prefill (the model carries the per-call ``_prefill``), a plain
    ``model.generate`` in another thread prefills its own prompt as usual, and the override is gone after."""
    other = torch.tensor([token_ids(17, 40)])
    plain = lambda: model.generate(other, attention_mask=torch.ones_like(other), max_new_tokens=5,  # noqa: E731
                                   do_sample=False, pad_token_id=0).tolist()
    want = plain()
    seen: dict[str, object] = {}

    class _Meanwhile(BaseStreamer):
        def put(self, value: torch.Tensor) -> None:
            if "during" in seen or value.numel() != 1:
                return
            seen["during"] = "_prefill" in vars(model)
            thread = threading.Thread(target=lambda: seen.setdefault("got", plain()))
            thread.start()
            thread.join()

        def end(self) -> None:
            pass

    rag = RAGGenerator(model, None, None, prefix=PREFIX)
    rag.generate(CHUNKS, QUESTION, mode="reuse", max_new_tokens=3, eos_token_id=None, streamer=_Meanwhile())
    assert seen["during"] is True and seen["got"] == want
    assert "_prefill" not in vars(model)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rerotating_into_a_layouts_rows_gives_the_same_bits(interleaved, rotary_dim):
    """``rerotate_keys(out=)`` (what ``Layout.fill_moved`` writes each chunk with) equals the plain result bit for
    bit, into a strided view of a larger buffer; partial and interleaved rotary take the copying path."""
    from kvshelf.reuse import rerotate_keys

    keys = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(4))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    for delta in (0, 5, 1234, -3):
        want = rerotate_keys(keys, delta, inv_freq, interleaved=interleaved)
        buffer = torch.full((2, 3, 20, 16), float("nan"))
        got = rerotate_keys(keys, delta, inv_freq, interleaved=interleaved, out=buffer[:, :, 4:11])
        assert torch.equal(got, want) and torch.equal(buffer[:, :, 4:11], want)
        assert buffer[:, :, :4].isnan().all() and buffer[:, :, 11:].isnan().all()
    with pytest.raises(ValueError, match="out is"):
        rerotate_keys(keys, 1, inv_freq, out=torch.empty(2, 3, 6, 16))
