"""Blocks name the model that made them (``MODEL_NAME_EXTRA``): the name a person knows, read from where the model was
loaded from; a dashboard shows it instead of the fingerprint. The name is never part of a key: reuse is unchanged."""

from __future__ import annotations

import torch
from helpers import make_block
from transformers import LlamaForCausalLM

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.model_label import MAX_LABEL_CHARS, label_blocks, model_label
from kvshelf.adapters.rag import RAGGenerator
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.encoding import read_header
from kvshelf.kvstore.keys import MODEL_NAME_EXTRA


def _named(name_or_path: str) -> LlamaForCausalLM:
    model = tiny_llama(seed=0)
    model.config._name_or_path = name_or_path
    return model


def test_the_label_is_the_folder_a_hub_id_or_the_model_type():
    assert model_label(_named("/root/.cache/kvshelf/models/smollm2-135m")) == "smollm2-135m"
    assert model_label(_named("./checkpoints/my-finetune/")) == "my-finetune"
    assert model_label(_named("HuggingFaceTB/SmolLM2-135M-Instruct")) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_label(tiny_llama(seed=0)) == "llama"  # built from a config: no source
    long = model_label(_named("/x/" + "n" * 500 + "\x1b[31m"))
    assert len(long) == MAX_LABEL_CHARS and long.isprintable()


def test_a_block_that_names_its_model_keeps_that_name():
    model = _named("/models/a")
    named = make_block([1, 2, 3], extra={MODEL_NAME_EXTRA: "given"})
    assert label_blocks([named], model)[0].extra[MODEL_NAME_EXTRA] == "given"


def _stored_names(store) -> set[str]:  # noqa: ANN001
    names = set()
    for tier in (spec.tier for spec in store.specs):
        held = tier.keys()
        for key in held:
            (value,) = tier.get_many([key])
            names.add(read_header(bytes(value)).extra.get(MODEL_NAME_EXTRA))
    return names


def test_prefix_blocks_and_rag_chunks_carry_the_model_name_and_reuse_is_unchanged(tmp_path):
    model = _named("/models/tiny-chat-v2")
    store = open_embedded_store(tmp_path / "a", memory_bytes="64MiB")
    gen = CachedGenerator(model, store=store, block_size=16)
    prompt = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    cold = gen.generate(prompt, max_new_tokens=6, reuse=False, eos_token_id=None, wait=True)
    warm = gen.generate(prompt, max_new_tokens=6, eos_token_id=None)
    assert warm.reused_tokens == 64 and warm.new_ids == cold.new_ids
    assert _stored_names(store) == {"tiny-chat-v2"}

    rag_store = open_embedded_store(tmp_path / "b", memory_bytes="64MiB")
    rag = RAGGenerator(model, None, rag_store, prefix=[5, 6, 7])
    chunks = [[10 + i for i in range(12)], [40 + i for i in range(9)]]
    for mode in ("reuse", "block-attention"):
        rag.generate(chunks, [9, 9, 8], mode=mode, max_new_tokens=3, eos_token_id=None)
    assert _stored_names(rag_store) == {"tiny-chat-v2"}
