"""The suite follows transformers: every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is placed
by ``catalog`` (hand-written suite, built from a tiny config, or excluded with the reason), and prefix reuse runs
on every built family against ``expected_catalog`` (docs/families.md's catalog table).

Each built family: a tiny random model (fp32; sdpa, or eager where the class has none) through ``CachedGenerator``
over a memory ``TieredStore``, three chained prompts (40, 64, 76 tokens; blocks of 16): the first stores 2 blocks
from a cold prefill, the second reuses them and stores 2 more, the third reuses all 64 tokens; its greedy tokens
and logits must equal plain ``model.generate`` (``arch_rule.run_cell``). A refusal is kvshelf's
``UnsupportedModelError`` naming the model type, the feature and the reason of ``expected_catalog.REFUSED``, raised
before any block is stored or any forward is run. Never a raw exception; no block is stored and then dropped as
damaged (the store's ``corrupt`` / ``foreign`` counters, the writer's failed and rejected blocks stay 0).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import catalog
import pytest
import torch
from arch_rule import EXACT, REFUSED, Output, plain_generate, run_cell
from expected_catalog import EXPECTED, HYBRID, PRUNING_REFUSED
from expected_catalog import REFUSED as REASONS

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.states import NOT_EXACT
from kvshelf.kvstore import MemoryTier, TieredStore
from kvshelf.kvstore.errors import UnsupportedModelError

FEATURE = "prefix reuse"
NEW = 3
BLOCK = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, catalog.VOCAB - 12, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


FIRST = _tokens(40, seed=1)  # 2 full blocks stored
SECOND = FIRST + _tokens(24, seed=2)  # 64: reuses 32, stores 2 more
THIRD = SECOND + _tokens(12, seed=3)  # 76: reuses 64


def _damage(store: TieredStore, gen: CachedGenerator) -> dict[str, int]:
    """Blocks stored and then dropped or refused: the store's corrupt / foreign counts, the writer's failures."""
    rows = store.stats()["rows"]
    counts = {name: sum(int(r.get(name, 0) or 0) for r in rows) for name in ("corrupt", "foreign")}
    writer = gen.write_behind_stats() or {}
    counts |= {name: int(writer.get(name, 0) or 0) for name in ("failed_blocks", "rejected_blocks")}
    return {k: v for k, v in counts.items() if v}


# -- the catalog places every model type transformers maps -------------------------------------------------------


def test_catalog_places_every_causal_lm_model_type():
    types = set(catalog.model_types())
    placed = set(catalog.suite()) | set(catalog.EXCLUDED) | set(EXPECTED)
    unplaced = sorted(types - placed)
    assert not unplaced, (f"transformers maps model types the catalog does not place: {unplaced}; add each to "
                          "tests/support/expected_catalog.py (built: exact or refused) or catalog.EXCLUDED (why)")
    stale = sorted((set(catalog.EXCLUDED) | set(EXPECTED) | set(catalog.OVERRIDES)) - types)
    assert not stale, f"the catalog names model types transformers no longer maps: {stale}"
    both = sorted(set(catalog.EXCLUDED) & (set(EXPECTED) | set(catalog.suite())))
    assert not both, f"model types both excluded and run: {both}"
    assert set(REASONS) <= {t for t, outcome in EXPECTED.items() if outcome == REFUSED}


def test_exclusions_are_never_kvshelf_limitations():
    for model_type, why in catalog.EXCLUDED.items():
        assert why and "kvshelf does not" not in why, model_type


# -- prefix reuse on every built family -----------------------------------------------------------------------


@pytest.mark.parametrize("model_type", catalog.built())
def test_prefix_reuse_on_built_family(model_type):
    model = catalog.tiny_model(model_type)
    store = TieredStore([MemoryTier(64 << 20)])
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    results, refusals, gens = [], [], []

    def run() -> Output:
        try:
            gen = CachedGenerator(model, store=store, block_size=BLOCK, snapshot_every=1)  # hybrids: every block
            gens.append(gen)
            for ids in (FIRST, SECOND, THIRD):
                results.append(gen.generate(ids, max_new_tokens=NEW, output_logits=True, eos_token_id=None,
                                            pad_token_id=0))
            gen.flush()
        except UnsupportedModelError as exc:
            refusals.append((str(exc), len(forwards)))
            raise
        return Output(results[-1].new_ids, [logits[0] for logits in results[-1].logits])

    def nothing_done() -> bool:
        return sum(t["blocks"] for t in store.stats()["tiers"]) == 0 and not forwards

    try:
        outcome = run_cell(model, FEATURE, run, lambda: plain_generate(model, THIRD, NEW),
                           nothing_stored=nothing_done)
    finally:
        hook.remove()
    assert outcome == EXPECTED[model_type], f"{model_type}: {outcome}, expected {EXPECTED[model_type]}"
    if outcome == REFUSED:
        reason = REASONS.get(model_type) or NOT_EXACT.get(model_type) or "recurrent state"
        assert reason in refusals[0][0], refusals[0][0]
        return
    assert outcome == EXACT
    if model_type in HYBRID:  # reused up to the deepest snapshot (a last prompt token is never a boundary)
        reused = [r.reused_tokens for r in results]
        assert reused[:2] == [0, 32] and reused[2] in (48, 64), reused
    else:
        assert [(r.reused_tokens, r.stored_blocks) for r in results] == [(0, 2), (32, 2), (64, 0)]
    assert not _damage(store, gens[0]), _damage(store, gens[0])


def test_an_encoder_loaded_without_is_decoder_is_refused_before_any_work():
    """BERT's causal-LM head on a config with ``is_decoder=False`` attends bidirectionally: prefix reuse gave other
    tokens than plain ``generate`` (megatron-bert, xlm-roberta-xl); now it is refused when the generator is built.
    GPT-NeoX's config has ``is_decoder=False`` too, and no module reads it: not refused."""
    import transformers as tf

    config = catalog.tiny_config("megatron-bert")
    config.is_decoder = False
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match=r"prefix reuse does not support model type 'megatron-bert'.*"
                                                     "is_decoder=False"):
        CachedGenerator(model, store=TieredStore([MemoryTier(1 << 20)]))
    CachedGenerator(catalog.tiny_model("gpt_neox"), store=None)


@pytest.mark.parametrize("model_type", ["zamba2", "zamba"])
def test_snapkv_on_zamba_is_refused_before_any_work(model_type):
    """SnapKV on Zamba2 raised a raw ``RuntimeError`` (a shape mismatch) mid-prefill; now it is refused when its
    ``with`` block is entered, naming the method, the model type and the recurrent-state layer types."""
    from kvshelf.adapters.pruning import SnapKV

    model = catalog.tiny_model(model_type, attn="eager")
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(UnsupportedModelError, match=rf"SnapKV does not support model type '{model_type}'.*"
                                                         "linear_attention"), SnapKV(budget=1.0)(model):
            model(torch.tensor([FIRST]))
    finally:
        hook.remove()
    assert not forwards


# -- token pruning and selection on every built family ----------------------------------------------------------

PROMPT = FIRST  # 40 tokens


@pytest.mark.slow  # ~35 s on a 2-core CPU
@pytest.mark.parametrize("model_type", catalog.built())
def test_pruning_methods_on_built_family(model_type):
    """Every pruning / selection method at budget 1.0 (eager, so the attention-weight methods run too): plain
    ``generate``'s tokens and logits, or ``UnsupportedModelError`` naming the method and the model type when its
    ``with`` block is entered, before any forward; compared with ``expected_catalog.PRUNING_REFUSED``."""
    from kvshelf.adapters.pruning import METHODS

    model = catalog.tiny_model(model_type, attn="eager")
    assert set(PRUNING_REFUSED) == set(METHODS)
    reference: list[Output] = []
    for name, cls in METHODS.items():
        method, entered = cls(budget=1.0), []

        def full(method=method, entered=entered) -> Output:  # noqa: ANN001
            with torch.inference_mode(), method(model):
                entered.append(True)
                out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            return Output(out.sequences[0, len(PROMPT):].tolist(), [lg[0].float() for lg in out.logits])

        def ref() -> Output:
            if not reference:
                reference.append(plain_generate(model, PROMPT, NEW))
            return reference[0]

        outcome = run_cell(model, method.name, full, ref, nothing_stored=lambda entered=entered: not entered)
        if model_type in HYBRID:
            continue
        want = REFUSED if model_type in PRUNING_REFUSED[name] else EXACT
        assert outcome == want, f"{model_type}/{name}: {outcome}, expected {want}"


def test_blt_is_excluded_while_transformers_cannot_generate_with_it():
    """BLT is excluded because transformers itself fails to build its cache; when that is fixed this fails: build
    it (``catalog.OVERRIDES["blt"]`` is its tiny config) and give it an expected outcome."""
    model = catalog.tiny_model("blt")
    with pytest.raises(AttributeError, match="num_hidden_layers"), torch.inference_mode():
        model.generate(torch.tensor([FIRST[:8]]), max_new_tokens=2, do_sample=False)
    assert "blt" in catalog.EXCLUDED


# -- RAG chunks and prompt modules on every built family --------------------------------------------------------


def _reuse_cells() -> list:
    from expected_catalog import RAG_REROTATION_INEXACT

    cells = []
    for model_type in catalog.built():
        for path in ("rag-reuse", "rag-blend", "rag-block-attention", "prompt-modules"):
            marks = ()
            if path == "rag-reuse" and model_type in RAG_REROTATION_INEXACT:
                marks = pytest.mark.xfail(strict=True, raises=AssertionError,
                                          reason="RAG chunk keys moved to a position differ from the chunk computed "
                                                 "there (expected_catalog.RAG_REROTATION_INEXACT): open")
            cells.append(pytest.param(model_type, path, marks=marks, id=f"{model_type}-{path}"))
    return cells


@pytest.mark.slow  # ~60 s on a 2-core CPU
@pytest.mark.parametrize(("model_type", "path"), _reuse_cells())
def test_reuse_paths_on_built_family(model_type, path):
    """The suite's RAG and prompt-module cells (``test_families_reuse``: the exact limiting case against plain HF,
    the approximate case runs, refusals before anything is stored) on every built family, against
    ``expected_catalog.REUSE_RUNS``; MLA families (refused in HEAD, being enabled by the MLA work) pass the cell's
    rule either way, hybrids are refused."""
    from expected_catalog import REUSE_RUNS

    cells = _reuse_suite()
    model = _reuse_model(model_type)
    outcome = cells._modules_cell(model) if path == "prompt-modules" else cells._rag_cell(model, path)
    if model_type in HYBRID:
        assert outcome == REFUSED
        return
    text = model.config.get_text_config(decoder=True)
    if getattr(text, "kv_lora_rank", None) is not None:  # MLA on the layer-by-layer engine: the MLA work's
        return
    want = (EXACT if path == "prompt-modules" else "approximate") if model_type in REUSE_RUNS[path] else REFUSED
    assert outcome == want, f"{model_type}/{path}: {outcome}, expected {want}"


_REUSE_MODELS: dict[str, torch.nn.Module] = {}


@functools.cache
def _reuse_suite():  # noqa: ANN202
    """``test_families_reuse``, whose cell functions these tests run (loaded by path: tests are not a package)."""
    spec = importlib.util.spec_from_file_location("_catalog_families_reuse",
                                                  Path(__file__).with_name("test_families_reuse.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reuse_model(model_type: str) -> torch.nn.Module:
    if model_type not in _REUSE_MODELS:
        _REUSE_MODELS.clear()  # one at a time
        _REUSE_MODELS[model_type] = catalog.tiny_model(model_type)
    return _REUSE_MODELS[model_type]
