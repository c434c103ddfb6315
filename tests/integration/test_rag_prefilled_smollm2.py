"""RAG decoding from the reuse engine's last prompt row on the real SmolLM2-135M-Instruct: 8 retrieved chunks
after a chat prefix (``kvshelf bench rag``'s shape), each mode against the previous path (``model.generate``
computing the last prompt token itself), greedy and sampled, with a streamer."""

from __future__ import annotations

import pytest
import torch

from kvshelf.adapters.decode import generate_from_layout
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.rag import RAGGenerator, precompute
from kvshelf.adapters.rag.modes import assembled as rag_module
from kvshelf.adapters.reuse_engine import Layout
from kvshelf.kvstore import open_embedded_store

pytestmark = pytest.mark.slow

PREFIX = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\nDocuments:\n\n"
QUESTION = "\nQuestion: Which method does the first document use?<|im_end|>\n<|im_start|>assistant\n"


def previous_path(model, layout, ids, first_logits, positions=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
    rest = Layout([k[:, :, :-1] for k in layout.keys], [v[:, :, :-1] for v in layout.values])
    return generate_from_layout(model, rest, ids, positions, **kwargs)


class _Recorder(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


@pytest.fixture(scope="module")
def setup(smollm2, texts, tmp_path_factory):  # noqa: ANN001, ANN201
    model, tokenizer = smollm2
    store = open_embedded_store(tmp_path_factory.mktemp("rag-prefilled"), memory_bytes="1GiB")
    chunks = precompute([t[:600] + "\n\n" for t in texts[20:28]], model, tokenizer, store, prefix=PREFIX,
                        chunk_size=4096, progress=False).chunks
    return model, tokenizer, RAGGenerator(model, tokenizer, store, prefix=PREFIX, on_missing="error"), chunks


@pytest.mark.parametrize("mode", ["reuse", "reuse-blend", "block-attention"])
def test_same_answer_as_generate_computing_the_last_token_with_no_forward_over_the_prompt(setup, monkeypatch,
                                                                                         mode):
    model, _, rag, chunks = setup
    lengths: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: lengths.append(int(kwargs.get("input_ids", args[0] if args else None).shape[-1])),
        with_kwargs=True)
    try:
        new = rag.generate(chunks, QUESTION, mode=mode, max_new_tokens=12, eos_token_id=None, all_logits=True)
    finally:
        hook.remove()
    assert lengths == [1] * 11  # the first token's logits are the engine's
    with monkeypatch.context() as patch:
        patch.setattr(rag_module, "generate_prefilled", previous_path)
        old = rag.generate(chunks, QUESTION, mode=mode, max_new_tokens=12, eos_token_id=None, all_logits=True)
    assert new.new_ids == old.new_ids
    for a, b in zip(new.logits, old.logits, strict=True):
        assert float((a - b).abs().max()) <= 1e-3 * (1 + float(b.abs().max()))
    assert new.reused_chunks == len(chunks) and new.computed_chunks == 0


def test_sampling_with_a_streamer_equals_the_previous_path(setup, monkeypatch):
    model, tokenizer, rag, chunks = setup
    runs = []
    for patched in (False, True):
        with monkeypatch.context() as patch:
            if patched:
                patch.setattr(rag_module, "generate_prefilled", previous_path)
            streamer = _Recorder()
            torch.manual_seed(3)
            result = rag.generate(chunks, QUESTION, mode="reuse-blend", max_new_tokens=12, do_sample=True,
                                  temperature=0.9, top_p=0.95, streamer=streamer)
            runs.append((result, streamer))
    (new, streamed), (old, _) = runs
    assert new.new_ids == old.new_ids
    assert sum(streamed.puts[1:], []) == new.new_ids and len(streamed.puts[0]) == new.prompt_tokens
    assert "_prefill" not in vars(model)
