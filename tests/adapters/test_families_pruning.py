"""Architecture suite, token pruning and selection: every family (``families.CONFIGS``) x method
(``kvshelf.adapters.pruning.METHODS``) x attention implementation, each cell through ``arch_rule.run_cell``
against plain HF ``generate``, its outcome compared with ``expected_pruning.EXPECTED`` (the README table's source).

* budget 1.0 keeps everything: the reference's greedy tokens and logits (fp32, 1e-4), or a refusal naming the
  method and the family before any work (raised when the ``with`` block is entered);
* budget 0.5 runs (approximate) and really prunes: every full-attention layer keeps half the prompt, sliding-window
  layers keep their window; TokenSelect attends to a selection at every decode step;
* methods reading attention weights (H2O, Keyformer) run with eager; under sdpa they raise
  ``AttentionImplementationError``;
* recomputed queries (SnapKV) follow each family's own query path: their softmax equals the model's own eager
  attention weights (OLMo2's q norm before the head split, StableLM's per-head norms and partial rotary, Cohere's
  interleaved RoPE, GPT-NeoX / Phi3 / Falcon / GPT-2 fused projections, Granite's and Gemma's scalings, Gemma 2's
  soft cap);
* positions stay absolute after a pruned prefill: ``generate`` equals a decode loop given absolute positions;
* FastKV (prefill-time, ``expected_pruning.PREFILL_METHODS``): ratio 1.0 is exact or refused before any work; ratio
  0.5 prefills the layers after the TSP layer on half the prompt and leaves half of it in every cache layer.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from arch_rule import EXACT, REFUSED, Output, plain_generate, run_cell
from expected_pruning import EXPECTED, PREFILL_METHODS
from expected_pruning import METHODS as METHOD_NAMES
from families import CONFIGS, attn_implementations, family_model

from kvshelf.adapters import hf
from kvshelf.adapters.hf.propagation import decoder_stack
from kvshelf.adapters.pruning import (
    METHODS,
    AttentionImplementationError,
    FastKV,
    LayerInputs,
    PruningMethod,
    SnapKV,
    StreamingLLM,
    prune_cache,
    resolve_budget,
    scoring,
)
from kvshelf.adapters.pruning.base import attention_modules, queries_recomputable

PROMPT, NEW = 40, 4  # the prompt is longer than the windowed families' window (24)
IDS = torch.randint(3, 500, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()

_MODELS: dict[tuple[str, str, torch.dtype], torch.nn.Module] = {}
_REFERENCES: dict[tuple[str, str, torch.dtype], Output] = {}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(family: str, attn: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Each family's tiny model, built once per attention implementation and dtype."""
    if (family, attn, dtype) not in _MODELS:
        _MODELS[(family, attn, dtype)] = family_model(family, attn=attn, dtype=dtype)
    return _MODELS[(family, attn, dtype)]


def _reference(family: str, attn: str, dtype: torch.dtype = torch.float32) -> Output:
    if (family, attn, dtype) not in _REFERENCES:
        _REFERENCES[(family, attn, dtype)] = plain_generate(_model(family, attn, dtype), IDS, NEW)
    return _REFERENCES[(family, attn, dtype)]


def _needs_eager(family: str, name: str) -> bool:
    """Whether the method reads eager attention weights on this family (H2O and Keyformer do where the family's
    queries cannot be recomputed: MLA, complex-pair RoPE); such cells run eager only."""
    cls = METHODS[name]
    if not issubclass(cls, PruningMethod) or not (cls.needs_attentions or cls.attention_mass):
        return False
    return cls.needs_attentions or not queries_recomputable(_model(family, attn_implementations(family)[0]))


def _generate(model: torch.nn.Module, method, entered: list[bool]):  # noqa: ANN001, ANN202
    """Greedy ``generate`` under ``method``; ``entered`` records that its ``with`` block was entered."""
    with torch.inference_mode(), method(model) as session:
        entered.append(True)
        out = model.generate(torch.tensor([IDS]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return session, out


CELLS = [(family, name, attn) for family in CONFIGS for name in METHODS for attn in attn_implementations(family)
         if attn == "eager" or not _needs_eager(family, name)]


def test_expected_table_covers_every_family_and_method():
    assert set(METHOD_NAMES) == set(METHODS)
    assert set(EXPECTED) == {(family, name) for family in CONFIGS for name in (*METHODS, *PREFILL_METHODS)}


@pytest.mark.parametrize(("family", "name", "attn"), CELLS)
def test_cell(family: str, name: str, attn: str) -> None:
    """Budget 1.0 exact or refused before any work; budget 0.5 runs and prunes (or selects)."""
    model, cls = _model(family, attn), METHODS[name]
    entered: list[bool] = []

    def full() -> Output:
        _, out = _generate(model, cls(budget=1.0), entered)
        return Output(out.sequences[0, PROMPT:].tolist(), [lg[0].float() for lg in out.logits])

    feature = cls(budget=1.0).name
    outcome = run_cell(model, feature, full, lambda: _reference(family, attn), nothing_stored=lambda: not entered)
    assert outcome == EXPECTED[(family, name)], f"{family}/{name} ({attn}): {outcome}"
    if outcome == REFUSED:
        return
    session, out = _generate(model, cls(budget=0.5), entered)
    assert out.sequences.shape == (1, PROMPT + NEW)
    layers = hf.cache_layers(out.past_key_values)
    full_layers = {m.layer_idx for m in attention_modules(model)}
    if not issubclass(cls, PruningMethod):  # dynamic selection: the whole cache stays, each step attends to some
        assert session.steps == NEW - 1
        assert all(layer.get_seq_length() == PROMPT + NEW - 1 for i, layer in enumerate(layers) if i in full_layers)
        return
    keep = resolve_budget(0.5, PROMPT)
    assert set(session.kept) == full_layers
    for i, layer in enumerate(layers):
        if i in full_layers:
            assert session.kept[i].shape[-1] == keep and layer.get_seq_length() == keep + NEW - 1
        else:  # a sliding-window layer is not pruned: it keeps its window
            assert hf.is_sliding_layer(layer), f"{family}: layer {i} is neither pruned nor sliding"


FASTKV_CELLS = [(family, attn) for family in CONFIGS for attn in attn_implementations(family)]


@pytest.mark.parametrize(("family", "attn"), FASTKV_CELLS)
def test_fastkv_cell(family: str, attn: str) -> None:
    """FastKV ratio 1.0 (TSP after layer 0: every later layer sees every token) exact or refused before any work;
    ratio 0.5 runs, the later layers prefilling half the prompt and every cache layer holding half of it."""
    model = _model(family, attn)
    entered: list[bool] = []

    def full() -> Output:
        _, out = _generate(model, FastKV(layer=0, ratio=1.0), entered)
        return Output(out.sequences[0, PROMPT:].tolist(), [lg[0].float() for lg in out.logits])

    outcome = run_cell(model, "FastKV", full, lambda: _reference(family, attn), nothing_stored=lambda: not entered)
    assert outcome == EXPECTED[(family, "fastkv")], f"{family}/fastkv ({attn}): {outcome}"
    if outcome == REFUSED:
        return
    lengths: list[int] = []
    layers = decoder_stack(model)[1]
    handles = [layer.register_forward_pre_hook(lambda m, args, kw: lengths.append(int(args[0].shape[1])),
                                               with_kwargs=True) for layer in layers]
    try:
        session, out = _generate(model, FastKV(layer=0, ratio=0.5, window=8), entered)
    finally:
        for handle in handles:
            handle.remove()
    keep = resolve_budget(0.5, PROMPT)
    assert lengths[:len(layers)] == [PROMPT] + [keep] * (len(layers) - 1)
    assert session.propagated.shape == (keep,) and out.sequences.shape == (1, PROMPT + NEW)
    assert all(layer.get_seq_length() == keep + NEW - 1 for layer in hf.cache_layers(out.past_key_values))


@pytest.mark.parametrize("family", [f for f in CONFIGS if EXPECTED[(f, "fastkv")] == EXACT])
def test_fastkv_bf16_full_ratio(family: str) -> None:
    """bf16: FastKV ratio 1.0 gives plain ``generate``'s tokens (logits within the bf16 tolerance)."""
    attn = attn_implementations(family)[-1]
    model = _model(family, attn, torch.bfloat16)

    def full() -> Output:
        _, out = _generate(model, FastKV(layer=0, ratio=1.0), [])
        return Output(out.sequences[0, PROMPT:].tolist(), [lg[0].float() for lg in out.logits])

    assert run_cell(model, "FastKV", full, lambda: _reference(family, attn, torch.bfloat16),
                    dtype=torch.bfloat16) == EXACT


BF16_CELLS = [(family, name) for family in CONFIGS for name in METHODS if EXPECTED[(family, name)] == EXACT]


@pytest.mark.parametrize(("family", "name"), BF16_CELLS)
def test_bf16_full_budget(family: str, name: str) -> None:
    """bf16: budget 1.0 gives plain ``generate``'s tokens (logits within the bf16 tolerance), also when TokenSelect
    falls back to full attention on a model loaded with eager (it runs the model's own eager function)."""
    attn = "eager" if _needs_eager(family, name) else attn_implementations(family)[-1]
    model, cls = _model(family, attn, torch.bfloat16), METHODS[name]

    def full() -> Output:
        _, out = _generate(model, cls(budget=1.0), [])
        return Output(out.sequences[0, PROMPT:].tolist(), [lg[0].float() for lg in out.logits])

    assert run_cell(model, cls(budget=1.0).name, full, lambda: _reference(family, attn, torch.bfloat16),
                    dtype=torch.bfloat16) == EXACT


SDPA_FAMILIES = [f for f in CONFIGS if "sdpa" in attn_implementations(f)]


@pytest.mark.parametrize("family", SDPA_FAMILIES)
def test_attention_weight_methods_refuse_sdpa(family: str) -> None:
    model = _model(family, "sdpa")
    for name in METHODS:
        if _needs_eager(family, name) and EXPECTED[(family, name)] == EXACT:
            with pytest.raises(AttentionImplementationError, match="eager"), METHODS[name](0.5)(model):
                pass


def _snapkv_from_weights(method: SnapKV, layer: LayerInputs) -> torch.Tensor:
    """SnapKV's scores ``[b, h_kv, n]`` computed from the model's own attention weights of the window's rows."""
    w = method.window
    votes = layer.attentions.float()[:, :, -w:, :-w].mean(dim=2)  # [b, h_q, n - w]
    votes = torch.nn.functional.max_pool1d(votes, method.kernel, stride=1, padding=method.kernel // 2)
    return torch.nn.functional.pad(layer.to_kv_heads(votes), (0, w), value=float("inf"))


def _check_recomputed_attention(model: torch.nn.Module, what: str) -> None:
    """In an eager prefill, each full-attention layer's SnapKV scores equal those computed from the model's own
    attention weights; and every recomputed query (``LayerInputs.queries``), scaled and capped as the model does
    (``LayerInputs.logits``), gives the model's own attention weights."""
    checked: list[int] = []
    snapkv = SnapKV(0.5, window=8)

    def hook(module, args, kwargs, output) -> None:  # noqa: ANN001
        hidden, cache, embeddings = hf.attention_hook_inputs(args, kwargs)
        keys, values = hf.layer_tensors(hf.cache_layers(cache)[module.layer_idx])
        n = hidden.shape[1]
        layer = LayerInputs(module, hidden, keys, values, embeddings, output[1])
        scores, want = snapkv.base_score(layer), _snapkv_from_weights(snapkv, layer)
        diff = (scores[..., :-8] - want[..., :-8]).abs().max().item()
        assert diff < 1e-5, f"{what}: layer {module.layer_idx} SnapKV scores differ by {diff:.3g}"
        logits = layer.logits(layer.queries(n))
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        probs = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)
        diff = (probs - layer.attentions.float()).abs().max().item()
        assert diff < 1e-5, f"{what}: layer {module.layer_idx} recomputed attention differs by {diff:.3g}"
        checked.append(module.layer_idx)

    modules = [m for m in hf.self_attention_modules(model)
               if hf.attention_layer_types(model.config)[m.layer_idx] == hf.FULL_ATTENTION]
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([IDS[:30]]), past_key_values=tf.DynamicCache(config=model.config),
                  use_cache=True, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    assert checked == [m.layer_idx for m in modules]


QUERY_FAMILIES = [f for f in CONFIGS if EXPECTED[(f, "snapkv")] == EXACT]


@pytest.mark.parametrize("family", QUERY_FAMILIES)
def test_recomputed_queries_follow_the_family(family: str) -> None:
    """SnapKV's window queries are the model's own (bug: OLMo2 and StableLM crashed, Cohere rotated them as
    halves, Granite and Gemma scaled them by 1/sqrt(d), Gemma 2 lost its soft cap)."""
    _check_recomputed_attention(_model(family, "eager"), family)


#: query paths the families above leave out: q/k norms that are off by default, Falcon's older fused layouts
VARIANTS = {
    "stablelm-qk-layernorm": lambda: tf.StableLmConfig(**_small(), qk_layernorm=True),
    "cohere-qk-norm": lambda: tf.CohereConfig(**_small(), use_qk_norm=True),
    "falcon-multi-query": lambda: tf.FalconConfig(**_falcon(), new_decoder_architecture=False, multi_query=True),
    "falcon-multi-head": lambda: tf.FalconConfig(**_falcon(), new_decoder_architecture=False, multi_query=False),
    # a soft cap small enough to matter on a tiny model; Gemma 3 has the attribute but does not cap its logits
    "gemma2-softcap": lambda: tf.Gemma2Config(**_small(), head_dim=16, sliding_window=24, attn_logit_softcapping=1.0),
    "gemma3-softcap-unused": lambda: tf.Gemma3TextConfig(**_small(), head_dim=16, attn_logit_softcapping=1.0,
                                                         layer_types=["full_attention"] * 2),
}


def _small() -> dict:
    return {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0}


def _falcon() -> dict:
    return {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _variant(variant: str) -> torch.nn.Module:
    """A variant's tiny model (eager, fp32), built once."""
    key = (variant, "eager", torch.float32)
    if key not in _MODELS:
        torch.manual_seed(0)
        _MODELS[key] = tf.AutoModelForCausalLM.from_config(VARIANTS[variant](), attn_implementation="eager").eval()
    return _MODELS[key]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_recomputed_queries_follow_variants(variant: str) -> None:
    model = _variant(variant)
    _check_recomputed_attention(model, variant)
    with torch.inference_mode(), SnapKV(0.5, window=8)(model) as session:
        model.generate(torch.tensor([IDS]), max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert all(idx.shape[-1] == PROMPT // 2 for idx in session.kept.values())


POSITION_FAMILIES = [f for f in CONFIGS if EXPECTED[(f, "streamingllm")] == EXACT]


@pytest.mark.parametrize("family", POSITION_FAMILIES)
def test_positions_stay_absolute_after_pruning(family: str) -> None:
    """``generate`` after a pruned prefill gives new tokens their absolute positions (RoPE or GPT-2's learned
    ones), as a decode loop given those positions does (not the shorter cache's length)."""
    attn = attn_implementations(family)[0]
    model = _model(family, attn)
    ids = torch.tensor([IDS])
    with torch.inference_mode(), StreamingLLM(budget=16, sinks=2)(model):
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    cache = tf.DynamicCache(config=model.config)
    with torch.inference_mode():
        with StreamingLLM(budget=16, sinks=2)(model):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        tokens = [int(logits[0, -1].argmax())]
        for step in range(NEW - 1):
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[PROMPT + step]])).logits
            tokens.append(int(logits[0, -1].argmax()))
    assert out[0, PROMPT:].tolist() == tokens


@pytest.mark.parametrize("family", ["llama", "qwen2-window", "gemma2", "gemma3"])
def test_scoring_and_prune_cache_match_hooked_pruning(family: str) -> None:
    """``scoring`` + ``prune_cache`` (the benchmark's path) build the cache ``with method(model):`` leaves, hybrid
    models included (sliding layers copied as they are), and decode the same tokens."""
    model = _model(family, "eager")
    ids = torch.tensor([IDS])
    with torch.inference_mode():
        cache = tf.DynamicCache(config=model.config)
        with scoring(model, {"snap": SnapKV(0.5, window=8)}) as kept:
            first = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].argmax()
        pruned = prune_cache(cache, kept["snap"])
        own = tf.DynamicCache(config=model.config)
        with SnapKV(0.5, window=8)(model):
            model(input_ids=ids, past_key_values=own, use_cache=True)
        for a, b in zip(hf.cache_layers(pruned), hf.cache_layers(own), strict=True):
            assert type(a) is type(b) and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        token = first.view(1, 1)
        for step in range(NEW):
            a = model(input_ids=token, past_key_values=pruned, position_ids=torch.tensor([[PROMPT + step]])).logits
            b = model(input_ids=token, past_key_values=own, position_ids=torch.tensor([[PROMPT + step]])).logits
            assert torch.equal(a, b)
            token = a[:, -1:].argmax(-1)


@pytest.mark.parametrize(("variant", "name"), [(v, n) for v in sorted(VARIANTS) for n in METHODS])
def test_variant_full_budget(variant: str, name: str) -> None:
    """The variants' budget 1.0 cells (eager): exact, or refused (TokenSelect on Falcon)."""
    model, cls = _variant(variant), METHODS[name]

    def full() -> Output:
        _, out = _generate(model, cls(budget=1.0), [])
        return Output(out.sequences[0, PROMPT:].tolist(), [lg[0].float() for lg in out.logits])

    outcome = run_cell(model, cls(budget=1.0).name, full, lambda: plain_generate(model, IDS, NEW))
    assert outcome == (REFUSED if variant.startswith("falcon") and name == "tokenselect" else EXACT)
