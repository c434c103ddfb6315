"""FastKV (adapters.pruning.fastkv): token-selective propagation on tiny random models (fast) and SmolLM2 (slow).

Ratio 1.0 on every family is in ``test_families_pruning.py``; here: the later layers really prefill fewer tokens,
the pruned prefill equals the propagation computed by hand, budgets, composition with TokenSelect and with the
sparse codec, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from helpers import key_of
from hybrid_families import hybrid_model

from kvshelf.adapters import hf
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.pruning import (
    BudgetError,
    FastKV,
    PruningError,
    TokenSelect,
    UnsupportedArchitectureError,
)
from kvshelf.compress.sparse import compact_block
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.encoding import decode_block, encode_block
from kvshelf.kvstore.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N, NEW = 48, 4
GEN = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}


def _ids(n: int = N, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    llama = tiny_llama(seed=0, layers=4)
    llama.set_attn_implementation(request.param)
    return llama


def _layer_inputs(model) -> tuple[list[int], list]:  # noqa: ANN001
    """Hooks recording each decoder layer's input length; returns (lengths, handles)."""
    lengths: list[int] = []
    handles = [layer.register_forward_pre_hook(lambda m, args, kw: lengths.append(int(args[0].shape[1])),
                                               with_kwargs=True) for layer in model.model.layers]
    return lengths, handles


def test_later_layers_prefill_only_the_propagated_tokens(model) -> None:
    lengths, handles = _layer_inputs(model)
    try:
        with torch.inference_mode(), FastKV(layer=1, ratio=0.25, window=4)(model) as session:
            out = model.generate(_ids(), max_new_tokens=NEW, return_dict_in_generate=True, **GEN)
    finally:
        for handle in handles:
            handle.remove()
    k = N // 4
    assert lengths[:4] == [N, N, k, k]  # the prefill: the TSP layer (1) and those before it see every token
    assert lengths[4:] == [1] * 4 * (NEW - 1)  # decode steps
    propagated = session.propagated
    assert propagated.shape == (k,) and torch.equal(propagated, propagated.sort().values)
    assert set(range(N - 4, N)) <= set(propagated.tolist())  # the window (the last token included) goes on
    for i, layer in enumerate(hf.cache_layers(out.past_key_values)):
        assert layer.get_seq_length() == k + NEW - 1
        assert torch.equal(session.kept[i], propagated.view(1, 1, -1).expand(1, 2, -1))


def test_pruned_prefill_equals_the_propagation_by_hand(model) -> None:
    """The prefill's last logits: layers 0..1 on every token, then layers 2..3 on the propagated tokens only, at
    their absolute positions, causally among themselves (computed here with ``hf.run_decoder_layer``)."""
    ids = _ids()
    with torch.inference_mode():
        with FastKV(layer=1, ratio=0.5, window=4)(model) as session:
            got = model(input_ids=ids, past_key_values=tf.DynamicCache(config=model.config), use_cache=True).logits
        index = session.propagated
        full = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hidden = full.hidden_states[2][:, index]  # the TSP layer's output at the propagated tokens
        positions = index.view(1, -1)
        embeddings = hf.position_embeddings(model, hidden, positions)
        k = len(index)
        mask = None
        if hf.attn_implementation(model) == "eager":
            mask = torch.full((k, k), torch.finfo(hidden.dtype).min).triu(1).view(1, 1, k, k)
        cache = tf.DynamicCache(config=model.config)
        for layer in (2, 3):
            hidden = hf.run_decoder_layer(model, layer, hidden, position_ids=positions, embeddings=embeddings,
                                          cache=cache, attention_mask=mask)
        want = hf.lm_logits(model, hf.final_norm(model, hidden))
    assert got.shape == (1, k, model.config.vocab_size)  # logits of the propagated tokens only
    assert (got - want).abs().max().item() < 1e-4
    assert not torch.allclose(got[0, -1], full.logits[0, -1], atol=1e-4)  # the later layers really saw fewer


def test_ratio_one_equals_plain_generate_and_decode_positions_stay_absolute(model) -> None:
    ids = _ids()
    with torch.inference_mode():
        plain = model.generate(ids, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True, **GEN)
        with FastKV(layer=2, ratio=1.0)(model):
            same = model.generate(ids, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True, **GEN)
        with FastKV(layer=0, ratio=0.5)(model):
            pruned = model.generate(ids, max_new_tokens=NEW, **GEN)
        cache = tf.DynamicCache(config=model.config)
        with FastKV(layer=0, ratio=0.5)(model):
            tokens = [int(model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].argmax())]
        for step in range(NEW - 1):
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[N + step]])).logits
            tokens.append(int(logits[0, -1].argmax()))
    assert torch.equal(same.sequences, plain.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(same.logits, plain.logits, strict=True)) < 1e-4
    assert pruned[0, N:].tolist() == tokens


def test_budget_keeps_per_head_choices_of_the_same_size_in_every_layer(model) -> None:
    with torch.inference_mode(), FastKV(layer=1, ratio=0.5, budget=8, window=4)(model) as session:
        out = model.generate(_ids(), max_new_tokens=NEW, return_dict_in_generate=True, **GEN)
    propagated = set(session.propagated.tolist())
    assert all(layer.get_seq_length() == 8 + NEW - 1 for layer in hf.cache_layers(out.past_key_values))
    assert all(session.kept[i].shape == (1, 2, 8) for i in range(4))
    assert all(set(session.kept[i].flatten().tolist()) <= propagated for i in (2, 3))
    assert any(not set(session.kept[i].flatten().tolist()) <= propagated for i in (0, 1))  # chose from all
    with pytest.raises(PruningError, match="budget=None"):
        session.stored_tensors(out.past_key_values)
    with torch.inference_mode(), FastKV(layer=1, ratio=0.25, budget=0.5)(model) as capped:
        out = model.generate(_ids(), max_new_tokens=1, return_dict_in_generate=True, **GEN)
    assert all(layer.get_seq_length() == N // 4 for layer in hf.cache_layers(out.past_key_values))
    assert all(idx.shape[-1] == N // 4 for idx in capped.kept.values())


def test_composes_with_tokenselect(model) -> None:
    ids = _ids()
    with torch.inference_mode():
        plain = model.generate(ids, max_new_tokens=NEW, **GEN)
        with FastKV(layer=1, ratio=1.0)(model), TokenSelect(1.0)(model):
            assert torch.equal(model.generate(ids, max_new_tokens=NEW, **GEN), plain)
        with FastKV(layer=1, ratio=0.5)(model) as session, TokenSelect(0.5, similarity=-1.0)(model) as ts:
            out = model.generate(ids, max_new_tokens=NEW, return_dict_in_generate=True, **GEN)
    assert ts.steps == NEW - 1 and ts.reused > 0  # decode steps attended to a selection of the pruned cache
    assert session.propagated.shape == (N // 2,)
    assert all(layer.get_seq_length() == N // 2 + NEW - 1 for layer in hf.cache_layers(out.past_key_values))


def test_pruned_cache_stores_through_the_sparse_codec_and_decodes_the_same(model) -> None:
    """One token set for every layer and head: the prompt's block with the dropped tokens marked (NaN) goes
    through the ``sparse`` codec; its kept tokens, at their absolute positions, decode as the live cache does."""
    ids = _ids()
    with torch.inference_mode():
        cache = tf.DynamicCache(config=model.config)
        with FastKV(layer=1, ratio=0.25)(model) as session:
            first = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        keys, values = session.stored_tensors(cache)
        block = KVBlock(keys, values, tuple(ids[0].tolist()), 0, "tiny-llama")
        compact = compact_block(decode_block(encode_block(block, key_of(block), "sparse", {"inner": "raw"})))
        assert compact.extra["positions"] == ",".join(str(i) for i in session.propagated.tolist())
        stored = hf.cache_of_layers([hf.GrowingLayer.of(k.unsqueeze(0), v.unsqueeze(0))
                                     for k, v in zip(compact.keys, compact.values, strict=True)])
        a = b = first
        for step in range(NEW):
            position = torch.tensor([[N + step]])
            la = model(input_ids=a, past_key_values=cache, position_ids=position, use_cache=True).logits
            lb = model(input_ids=b, past_key_values=stored, position_ids=position, use_cache=True).logits
            assert torch.equal(la, lb)
            a, b = la[:, -1:].argmax(-1), lb[:, -1:].argmax(-1)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"ratio": 0.0}, BudgetError, "ratio"), ({"ratio": 1.5}, BudgetError, "ratio"),
    ({"ratio": 0}, BudgetError, "ratio"),
    ({"budget": 0.0}, BudgetError, "budget"), ({"budget": -3}, BudgetError, "budget"),
    ({"layer": -1}, ConfigError, "TSP layer"), ({"layer": 1.5}, ConfigError, "TSP layer"),
    ({"window": 0}, ConfigError, "window"), ({"kernel": 2}, ConfigError, "kernel"),
])
def test_bad_settings_raise_when_made(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        FastKV(**kwargs)


def test_default_tsp_layer_is_two_thirds_of_the_depth(model) -> None:
    assert [FastKV().tsp_layer(n) for n in (2, 3, 4, 30, 32)] == [0, 1, 2, 20, 21]
    with FastKV()(model) as session:
        assert session.layer == 2


def test_refusals_before_any_work(model) -> None:
    with pytest.raises(ConfigError, match=r"TSP layer must be in \[0, 2\].*got 3"), FastKV(layer=3)(model):
        pytest.fail("entered")
    with torch.inference_mode(), FastKV(layer=1, ratio=0.5)(model):
        with pytest.raises(PruningError, match="batch size 1"):
            model.generate(torch.cat([_ids(), _ids(seed=2)]), max_new_tokens=1, **GEN)
        with pytest.raises(BudgetError, match="larger than the context"), FastKV(layer=1, ratio=N + 1)(model):
            model.generate(_ids(), max_new_tokens=1, **GEN)
    mistral = tf.MistralForCausalLM(tf.MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8)).eval()
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4)).eval()
    qwen = tf.Qwen2ForCausalLM(tf.Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1)).eval()
    hybrid = hybrid_model("qwen3_5")
    for other, feature in ((mistral, "sliding"), (gpt2, "reshapes"), (qwen, "sliding_attention"),
                           (hybrid, "recurrent state")):
        with pytest.raises(UnsupportedArchitectureError, match=f"FastKV.*{hf.model_type(other)}.*{feature}"), \
                FastKV(layer=0)(other):
            pytest.fail("entered")


def test_hooks_are_gone_after_the_block(model) -> None:
    ids = _ids()
    with torch.inference_mode():
        with FastKV(layer=0, ratio=0.25)(model):
            pass
        lengths, handles = _layer_inputs(model)
        try:
            model(input_ids=ids, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
    assert lengths == [N] * 4


@pytest.mark.slow
def test_smollm2_finds_the_needle_after_propagating_a_fifth(smollm2, texts) -> None:
    """The real model: a needle in ~1,300 tokens survives propagating 20% of them past layer 20 of 30 (SmolLM2's
    votes find needles from about layer 17 on, not before: docs/pruning.md)."""
    from kvshelf.bench.pruning import needle_cases

    model, tokenizer = smollm2
    case = needle_cases(tokenizer, texts, 1)[0]
    ids = torch.tensor([case["ids"]])
    with torch.inference_mode(), FastKV(layer=20, ratio=0.2)(model) as session:
        out = model.generate(ids, max_new_tokens=6, **GEN)
    assert len(session.propagated) == -(-ids.shape[1] // 5)
    assert case["code"] in tokenizer.decode(out[0, ids.shape[1]:])
