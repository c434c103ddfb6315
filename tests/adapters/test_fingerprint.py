"""The model fingerprint follows the model (dtype, weights), so a changed model is never served its old blocks."""

from __future__ import annotations

import pytest
import torch
from helpers import SCHEMA_MARKUP, WordTokenizer

from kvshelf.adapters import fingerprint as fingerprint_module
from kvshelf.adapters.fingerprint import model_fingerprint
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.prompt_modules import PromptModuleGenerator
from kvshelf.adapters.rag import RAGGenerator
from kvshelf.kvstore import open_embedded_store
from kvshelf.reuse import ModuleUse


@pytest.fixture
def digests(monkeypatch):
    """Counts the weight-digest computations (the memo must spare them while nothing changed)."""
    calls = []
    original = fingerprint_module._weight_sample_digest  # noqa: SLF001

    def counting(sampled):  # noqa: ANN001, ANN202
        calls.append(1)
        return original(sampled)

    monkeypatch.setattr(fingerprint_module, "_weight_sample_digest", counting)
    return calls


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_unchanged_model_same_fingerprint_computed_once(digests):
    model = tiny_llama(seed=0)
    first = model_fingerprint(model)
    assert [model_fingerprint(model) for _ in range(3)] == [first] * 3
    assert len(digests) == 1
    assert model_fingerprint(tiny_llama(seed=0)) == first  # content-defined: same weights, same fingerprint


def test_dtype_change_changes_the_fingerprint():
    model = tiny_llama(seed=0)
    before = model_fingerprint(model)
    model.to(torch.bfloat16)
    assert model_fingerprint(model) != before
    assert model_fingerprint(model) == model_fingerprint(tiny_llama(seed=0, dtype=torch.bfloat16))


def test_load_state_dict_of_other_weights_changes_the_fingerprint():
    model, other = tiny_llama(seed=0), tiny_llama(seed=1)
    before = model_fingerprint(model)
    model.load_state_dict(other.state_dict())  # in place (copy_)
    assert model_fingerprint(model) == model_fingerprint(other) != before
    model.load_state_dict(tiny_llama(seed=0).state_dict(), assign=True)  # new parameter objects
    assert model_fingerprint(model) == before


def _fresh(model) -> str:  # noqa: ANN001
    """The fingerprint computed from scratch (no memo)."""
    model.__dict__.pop(fingerprint_module._MEMO, None)  # noqa: SLF001
    return model_fingerprint(model)


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "data"])
def test_in_place_edit_of_a_sampled_weight_changes_the_fingerprint(how):
    model = tiny_llama(seed=0)
    before = model_fingerprint(model)
    weight = model.get_input_embeddings().weight
    if how == "data":  # storage swapped under the same parameter object
        weight.data = weight.data.clone().mul_(2)
    else:
        with torch.no_grad() if how == "no_grad" else torch.inference_mode():
            weight[0, 0] += 1.0
    after = model_fingerprint(model)
    assert after != before and after == _fresh(model)


def test_generator_never_reuses_blocks_of_the_model_before_a_weight_change(tmp_path):
    model = tiny_llama(seed=0)
    gen = CachedGenerator(model, store=open_embedded_store(tmp_path, memory_bytes="64MiB"), block_size=16)
    prompt = _prompt(70)
    assert gen.generate(prompt, max_new_tokens=2).stored_blocks == 4
    model.load_state_dict(tiny_llama(seed=1).state_dict())
    warm = gen.generate(prompt, max_new_tokens=8, eos_token_id=None)
    cold = gen.generate(prompt, max_new_tokens=8, reuse=False, store=False, eos_token_id=None)
    assert warm.reused_tokens == 0 and warm.new_ids == cold.new_ids
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # in place, a sampled (last) parameter
    warm = gen.generate(prompt, max_new_tokens=8, eos_token_id=None)
    assert warm.reused_tokens == 0
    assert warm.new_ids == gen.generate(prompt, max_new_tokens=8, reuse=False, store=False,
                                        eos_token_id=None).new_ids
    model.to(torch.bfloat16)
    assert gen.generate(prompt, max_new_tokens=2).reused_tokens == 0
    model.to(torch.float32)
    model.load_state_dict(tiny_llama(seed=0).state_dict())  # the original dtype and weights again
    assert gen.fingerprint == model_fingerprint(tiny_llama(seed=0))
    assert gen.generate(prompt, max_new_tokens=2).reused_tokens == 64  # its blocks are valid again


def test_rag_and_prompt_modules_recompute_after_a_weight_change(tmp_path):
    model = tiny_llama(seed=0, layers=3)
    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    rag = RAGGenerator(model, None, store, prefix=_prompt(5, seed=9))
    chunks, question = [_prompt(12, seed=2), _prompt(9, seed=3)], _prompt(4, seed=4)
    assert rag.generate(chunks, question, max_new_tokens=2).computed_chunks == 2
    assert rag.generate(chunks, question, max_new_tokens=2).reused_chunks == 2
    modules = PromptModuleGenerator(model, WordTokenizer(), store, SCHEMA_MARKUP)
    assert modules.precompute()["computed"] == 3
    model.load_state_dict(tiny_llama(seed=1, layers=3).state_dict())
    for mode in ("reuse", "block-attention"):
        result = rag.generate(chunks, question, mode=mode, max_new_tokens=4, eos_token_id=None)
        assert result.reused_chunks == 0
    assert rag.generate(chunks, question, max_new_tokens=4, eos_token_id=None).reused_chunks == 2  # stored again
    assert modules.precompute()["computed"] == 3
    prompt = [ModuleUse("system"), "tell me a story now"]
    warm = modules.generate(prompt, max_new_tokens=6, eos_token_id=None)
    cold = modules.generate(prompt, max_new_tokens=6, eos_token_id=None, reuse=False)
    assert warm.new_ids == cold.new_ids


def _tiny_mamba(seed: int = 0):  # noqa: ANN202
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    config = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=2)
    return MambaForCausalLM(config).eval()


def test_a_model_without_attention_heads_has_a_fingerprint():
    """A state-space model (Mamba: no num_attention_heads) is fingerprinted from its layers, state sizes and
    weights; its weights and dtype change it as they do an attention model's."""
    model = _tiny_mamba()
    first = model_fingerprint(model)
    assert len(first) == 32 and int(first, 16) >= 0
    assert model_fingerprint(model) == first == model_fingerprint(_tiny_mamba())
    assert model_fingerprint(_tiny_mamba(seed=1)) != first
    assert model_fingerprint(model.to(torch.bfloat16)) != first


def test_kv_geometry_of_a_model_without_attention_heads_names_what_is_missing():
    from kvshelf.adapters.fingerprint import kv_geometry
    from kvshelf.kvstore.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"MambaForCausalLM \(model type mamba\) has no attention heads "
                                                    r"\(its config has no num_attention_heads\)"):
        kv_geometry(_tiny_mamba())


def test_attention_models_keep_their_fingerprints():
    """The properties of a model with attention heads are what they were: blocks already stored stay found."""
    from kvshelf.adapters.fingerprint import _properties  # noqa: PLC2701

    assert list(_properties(tiny_llama(seed=0), torch.float32)) == [
        "architecture", "model_type", "layers", "kv_heads", "head_dim", "rope", "dtype", "vocab"]
