"""``LayerInputs.attention_mass`` (H2O's accumulated attention, Keyformer's noisy one): computed in row chunks from
recomputed queries, it equals the eager prefill's attention weights summed over queries, on every family of the
architecture suite whose queries kvshelf recomputes; on the others (MLA, complex-pair RoPE) H2O and Keyformer need
the eager weights, and say so before any work when the model runs another attention."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from families import CONFIGS, family_model

from kvshelf.adapters.pruning import H2O, AttentionImplementationError, Keyformer, UnsupportedArchitectureError
from kvshelf.adapters.pruning import base as pruning_base
from kvshelf.adapters.pruning.base import (
    LayerInputs,
    _layer_inputs,
    attention_modules,
    needs_attention_weights,
    queries_recomputable,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 40
IDS = torch.randint(3, 500, (1, N), generator=torch.Generator().manual_seed(21))
# families where no layer is a full-attention layer (nothing to score)
NO_FULL_LAYERS = ("mistral",)


def _prefill_inputs(model: torch.nn.Module) -> list[LayerInputs]:
    """Each full-attention layer's ``LayerInputs`` of one eager prefill of ``IDS`` (attention weights included)."""
    from kvshelf.adapters import hf

    found: list[LayerInputs] = []

    def hook(module, args, kwargs, output) -> None:  # noqa: ANN001
        got = _layer_inputs(module, args, kwargs, output)
        if got is not None:
            found.append(got[1])

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in attention_modules(model)]
    try:
        with torch.inference_mode():
            model(input_ids=IDS, past_key_values=hf.new_cache(model.config), use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return found


@pytest.mark.parametrize("family", [f for f in CONFIGS if f not in NO_FULL_LAYERS])
def test_attention_mass_from_recomputed_queries_equals_the_eager_weights(family, monkeypatch) -> None:
    model = family_model(family, attn="eager")
    if not queries_recomputable(model):
        # H2O and Keyformer read the eager weights there (and refuse another attention: the test below)
        assert needs_attention_weights(H2O(), model) and needs_attention_weights(Keyformer(), model)
        return
    assert not needs_attention_weights(H2O(), model)
    monkeypatch.setattr(pruning_base, "ATTENTION_CHUNK_BYTES", 4 * 2 * 8 * N)  # several row chunks per layer
    layers = _prefill_inputs(model)
    assert layers and all(layer.attentions is not None for layer in layers)
    for layer in layers:
        with torch.inference_mode():
            _check_layer(layer)


def _check_layer(layer: LayerInputs) -> None:
    want = layer.attentions.float().sum(dim=2)  # [b, h_q, n]
    recomputed = replace(layer, attentions=None)
    torch.testing.assert_close(layer.attention_mass(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(recomputed.attention_mass(), want, rtol=1e-4, atol=1e-4)
    noisy = Keyformer(seed=3)
    torch.testing.assert_close(noisy.base_score(recomputed), noisy.base_score(layer), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("family", ["deepseek-v3", "llama4"])
def test_where_queries_are_not_recomputed_attention_mass_methods_need_eager(family) -> None:
    model = family_model(family, attn="sdpa")
    assert not queries_recomputable(model)
    for cls in (H2O, Keyformer):
        assert needs_attention_weights(cls(0.5), model)
        with pytest.raises(AttentionImplementationError, match='attn_implementation="eager"'), cls(0.5)(model):
            pass


def test_llama_scores_under_sdpa_without_eager_weights() -> None:
    model = family_model("llama", attn="sdpa")
    for cls in (H2O, Keyformer):
        with torch.inference_mode(), cls(0.5)(model) as session:
            model.generate(IDS, max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert session.kept and all(k.shape[-1] == N // 2 for k in session.kept.values())


def test_mistral_has_no_full_attention_layer_to_score() -> None:
    with pytest.raises(UnsupportedArchitectureError):
        attention_modules(family_model("mistral"))
