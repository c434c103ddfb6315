"""Token pruning and selection on the real SmolLM2-135M-Instruct (slow: loads the model)."""

from __future__ import annotations

import pytest
import torch

from kvshelf.adapters.pruning import H2O, Keyformer, KeyNorm, SnapKV, StreamingLLM, TokenSelect
from kvshelf.bench.pruning import QUESTION

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def case(smollm2, texts):
    _, tokenizer = smollm2
    # easy: the needle sits ~30 tokens before the question, inside every recent window (64 for KeyNorm here)
    context = tokenizer("\n\n".join(texts[:4]), add_special_tokens=False)["input_ids"][:360]
    needle = tokenizer("\n\nThe secret code is 4821.\n\n", add_special_tokens=False)["input_ids"]
    tail = tokenizer(texts[5], add_special_tokens=False)["input_ids"][:20]
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    return {"ids": context + needle + tail + question, "code": "4821"}


def _generate(model, ids: list[int], new: int = 8) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


def test_full_budget_equals_plain_generate(smollm2, case):
    model, _ = smollm2
    plain = _generate(model, case["ids"])
    for method in (StreamingLLM(1.0), SnapKV(1.0), KeyNorm(1.0), TokenSelect(1.0)):
        with method(model):
            assert _generate(model, case["ids"]) == plain, method.name


@pytest.mark.parametrize("cls", [StreamingLLM, SnapKV, KeyNorm, H2O, Keyformer])
def test_static_method_at_half_budget_finds_the_code(smollm2, case, cls):
    model, tokenizer = smollm2
    method = cls(budget=0.5, recent=64) if cls is KeyNorm else cls(budget=0.5)
    model.set_attn_implementation("eager" if cls.needs_attentions else "sdpa")
    try:
        with method(model) as session:
            answer = tokenizer.decode(_generate(model, case["ids"]))
    finally:
        model.set_attn_implementation("sdpa")
    assert session.kept[0].shape[-1] == (len(case["ids"]) + 1) // 2
    assert case["code"] in answer, (method.name, answer)


def test_tokenselect_finds_the_code_attending_to_an_eighth(smollm2, case):
    model, tokenizer = smollm2
    with TokenSelect(0.125)(model) as ts:
        answer = tokenizer.decode(_generate(model, case["ids"]))
    assert case["code"] in answer, answer
    assert ts.steps == 7


def test_in_place_pruned_cache_decodes_like_a_dynamic_cache(smollm2, case):
    """``with SnapKV(...)`` decodes in ``GrowingLayer`` s: same tokens and logits as its tokens in DynamicLayers."""
    from transformers import DynamicCache

    from kvshelf.adapters.pruning import scoring
    from kvshelf.adapters.pruning.layout import GrowingLayer

    model, _ = smollm2
    ids = case["ids"]
    with SnapKV(0.25)(model):
        out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                             return_dict_in_generate=True, output_logits=True)
    assert all(isinstance(layer, GrowingLayer) for layer in out.past_key_values.layers)
    full = DynamicCache()
    with torch.inference_mode(), scoring(model, {"s": SnapKV(0.25)}) as kept:
        logits = model(input_ids=torch.tensor([ids]), past_key_values=full, use_cache=True).logits[0, -1]
    plain = DynamicCache()
    for i, layer in enumerate(full.layers):
        idx = kept["s"][i].unsqueeze(-1).expand(-1, -1, -1, layer.keys.shape[-1])
        plain.update(layer.keys.gather(2, idx), layer.values.gather(2, idx), i)
    tokens, reference = [int(logits.argmax())], [logits]
    with torch.inference_mode():
        for step in range(19):
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=plain,
                           position_ids=torch.tensor([[len(ids) + step]])).logits[0, -1]
            tokens.append(int(logits.argmax()))
            reference.append(logits)
    assert out.sequences[0, len(ids):].tolist() == tokens
    for ours, ref in zip(out.logits, reference, strict=True):
        assert torch.allclose(ours[0], ref, atol=1e-3)
