"""HF-native export on the real SmolLM2: a prefix stored by ``CachedGenerator`` handed to a plain
``pipeline("text-generation")`` and to ``model.generate`` gives the uncached answer."""

from __future__ import annotations

import pytest
import torch
from transformers import pipeline

from kvshelf.adapters.export import cached_prefix
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.bench.ttft import build_context
from kvshelf.kvstore import open_embedded_store

pytestmark = pytest.mark.slow


def test_pipeline_and_generate_with_an_exported_prefix(smollm2, texts, tmp_path):
    model, tokenizer = smollm2
    store = open_embedded_store(tmp_path)
    context = tokenizer.decode(build_context(tokenizer, texts, 600))
    CachedGenerator(model, tokenizer, store).generate(context + "\n\nSummary:", max_new_tokens=1)
    prompt = context + "\n\nQuestion: What is the main idea?\nAnswer:"
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    settings = {"max_new_tokens": 16, "do_sample": False, "return_full_text": False}
    plain = pipe(prompt, **settings)[0]["generated_text"]
    prefix = cached_prefix(model, store, prompt, tokenizer=tokenizer)
    assert prefix.reused_tokens == 512  # two 256-token blocks of the context
    assert pipe(prompt, past_key_values=prefix.cache, **settings)[0]["generated_text"] == plain
    batch = cached_prefix(model, store, prompt, tokenizer=tokenizer, batch_size=2)
    with torch.inference_mode():
        out = model.generate(**batch.generate_inputs(), max_new_tokens=16, do_sample=False)
    texts_out = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    assert texts_out == [plain, plain]
