"""The vLLM connector's parts that need no vLLM: the checkpoint fingerprint, the settings, the scheduler's plan and
the page <-> block conversion (the engine itself: tests/vllm, in the vLLM venv)."""

from __future__ import annotations

import pytest
import torch

from kvshelf.adapters.fingerprint import model_fingerprint
from kvshelf.adapters.model import convert_bundled, tiny_llama
from kvshelf.adapters.vllm.config import ConnectorSettings
from kvshelf.adapters.vllm.fingerprint import checkpoint_fingerprint
from kvshelf.adapters.vllm.pages import PageLayout, read_pages, write_pages
from kvshelf.adapters.vllm.plan import Planner, StepPlan
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import prefix_block_keys

# -- the fingerprint, from the checkpoint without loading it -------------------------------------------------


def _qwen3(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_fingerprint_is_the_loaded_models(tmp_path, family: str, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    (tiny_llama() if family == "llama" else _qwen3()).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    assert checkpoint_fingerprint(tmp_path, dtype) == model_fingerprint(loaded)


def test_checkpoint_fingerprint_tells_weights_apart(tmp_path) -> None:
    tiny_llama(seed=0).save_pretrained(tmp_path / "a")
    tiny_llama(seed=1).save_pretrained(tmp_path / "b")
    assert checkpoint_fingerprint(tmp_path / "a", torch.float32) != checkpoint_fingerprint(tmp_path / "b",
                                                                                           torch.float32)


def test_checkpoint_fingerprint_of_smollm2(smollm2) -> None:
    model, _ = smollm2
    assert checkpoint_fingerprint(convert_bundled("smollm2-135m"), torch.float32) == model_fingerprint(model)


# -- settings -------------------------------------------------------------------------------------------------


def test_settings_defaults_and_values() -> None:
    assert ConnectorSettings.from_extra_config(None) == ConnectorSettings()
    settings = ConnectorSettings.from_extra_config({"store": "grpc://h:1", "namespace": "t", "block_tokens": 512})
    assert (settings.store, settings.namespace, settings.block_tokens) == ("grpc://h:1", "t", 512)


@pytest.mark.parametrize(("extra", "words"), [
    ({"stor": "embedded://"}, "unknown key(s) 'stor'"),
    ({"store": "/var/lib"}, "store must be a store URL"),
    ({"namespace": ""}, "namespace"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"block_tokens": True}, "block_tokens"),
    ({"load_failure_policy": "ignore"}, "load_failure_policy"),
])
def test_bad_settings_are_one_clear_config_error(extra: dict, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorSettings.from_extra_config(extra)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_block_tokens_must_be_whole_vllm_pages() -> None:
    ConnectorSettings(block_tokens=256).check_block_size(128)
    with pytest.raises(ConfigError, match="not a multiple of vLLM's block size 128"):
        ConnectorSettings(block_tokens=192).check_block_size(128)


# -- the scheduler's plan ------------------------------------------------------------------------------------

FP = "f" * 32


def _planner() -> Planner:
    return Planner(FP, "default", block_tokens=8, page_tokens=4)


def test_keys_are_the_ones_cached_generator_computes() -> None:
    planner, prompt = _planner(), list(range(100, 121))
    assert [s.key for s in planner.spans(prompt)] == prefix_block_keys(FP, "default", prompt, 8)


def test_a_full_hit_leaves_the_last_token_to_vllm() -> None:
    planner, prompt = _planner(), list(range(16))  # two full blocks, both stored
    spans = planner.spans(prompt)
    assert planner.loadable(spans, len(prompt), stored=2) == 8  # block 2 ends at the last token: not loaded
    assert planner.loadable(spans, 17, stored=2) == 16
    assert planner.loadable(planner.spans(list(range(7))), 7, stored=0) == 0  # shorter than a block


def test_load_skips_pages_vllm_holds_and_saves_what_completes() -> None:
    planner, prompt = _planner(), list(range(30))  # 3 full blocks (24 tokens) + 6
    plan = planner.admit("r", prompt, planner.spans(prompt), stored=2)
    plan.load_from, plan.load_to = 4, 16  # vLLM holds page 0; the store gives tokens 4..16
    planner.set_pages("r", [10, 11, 12, 13, 14, 15, 16, 17], replace=True)
    out = StepPlan()
    planner.step("r", computed_after=20, out=out)  # the chunk ends at token 20: block 2 (16..24) not complete
    loads = out.loads["r"]
    assert [(m.first_page, m.pages, m.start) for m in loads] == [(1, (11,), 0), (0, (12, 13), 8)]
    assert loads[1].parent == loads[0].key and loads[0].token_ids == tuple(range(8))
    assert "r" not in out.saves
    out = StepPlan()
    planner.step("r", computed_after=30, out=out)
    assert not out.loads and [(m.start, m.pages) for m in out.saves["r"]] == [(16, (14, 15))]
    assert plan.report() == {"stored_blocks": 2, "loaded_tokens": 12, "failed_tokens": 0, "saved_blocks": 1}


def test_a_failed_load_is_counted_and_saved_again_once_recomputed() -> None:
    planner, prompt = _planner(), list(range(30))
    plan = planner.admit("r", prompt, planner.spans(prompt), stored=3)
    plan.load_from, plan.load_to = 0, 24
    planner.set_pages("r", [1, 2, 3, 4, 5, 6, 7, 8], replace=True)
    planner.step("r", computed_after=30, out=StepPlan())
    planner.load_failed({3, 4})  # the second block's pages
    assert plan.failed_tokens == 8 and plan.next_save == 1
    out = StepPlan()
    planner.step("r", computed_after=30, out=out)
    assert [m.start for m in out.saves["r"]] == [8, 16]


# -- pages <-> blocks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True])
def test_pages_round_trip_and_lay_out_as_the_kernel_does(transposed: bool) -> None:
    h, n, c, layers = 2, 4, 8, 3
    layout = PageLayout(h, n, c, transposed)
    caches = [torch.zeros(6, h, n, 2 * c) for _ in range(layers)]
    keys, values = torch.randn(layers, h, 2 * n, c), torch.randn(layers, h, 2 * n, c)
    write_pages(caches, [4, 1], keys, values, layout)
    got_k, got_v = read_pages(caches, [4, 1], layout)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    page = caches[0].view(6, h, 2, n * c)[1, 0]  # the second page (block id 1), head 0: its K then its V
    k_page = page[0].view(c, n).T if transposed else page[0].view(n, c)
    assert torch.equal(k_page, keys[0, 0, n:]) and torch.equal(page[1].view(n, c), values[0, 0, n:])
    assert caches[0][[0, 2, 3, 5]].abs().sum() == 0  # no other page touched


# -- the worker's page mover over a real store --------------------------------------------------------------


def _mover(tmp_path, caches):
    from kvshelf.adapters.vllm.worker import PageMover
    from kvshelf.kvstore.store_url import open_store

    store = open_store(f"embedded://{tmp_path}?memory=0")
    return PageMover(store, caches, PageLayout(2, 4, 8, True), fingerprint=FP, namespace="default",
                     model_name="tiny", max_pending_blocks=4)


def test_saved_pages_load_back_and_a_missing_block_is_reported(tmp_path) -> None:
    planner, prompt = _planner(), list(range(20))  # blocks of 8 tokens = 2 pages of 4
    plan = planner.admit("r", prompt, planner.spans(prompt), stored=0)
    planner.set_pages("r", [1, 2, 3, 4, 5], replace=True)
    out = StepPlan()
    planner.step("r", computed_after=20, out=out)
    caches = [torch.randn(6, 2, 4, 16) for _ in range(3)]
    mover = _mover(tmp_path, caches)
    try:
        mover.save(out)
        mover.writer.flush()
        assert mover.counts.saved_blocks == 2 and mover.store.held([s.key for s in plan.spans]) == [True, True]
        block = mover.store.get_many([plan.spans[1].key], fingerprint=FP)[0]
        assert block.extra["model_name"] == "tiny" and block.extra["parent"] == plan.spans[0].key.hex()
        mover.caches = fresh = [torch.zeros(6, 2, 4, 16) for _ in range(3)]
        loads = StepPlan(loads={"r": out.saves["r"]})
        mover.store.delete([plan.spans[1].key])  # evicted between the lookup and the load
        mover.load(loads)
        assert all(torch.equal(f[[1, 2]], c[[1, 2]]) for f, c in zip(fresh, caches, strict=True))
        assert all(f[[3, 4]].abs().sum() == 0 for f in fresh)
        assert mover.take_errors() == {3, 4} and mover.take_errors() == set()
        assert (mover.counts.loaded_blocks, mover.counts.failed_blocks) == (1, 1)
    finally:
        mover.close()
        mover.store.close()


def test_a_block_of_other_tokens_is_not_written(tmp_path) -> None:
    from kvshelf.adapters.vllm.plan import BlockMove

    planner, prompt = _planner(), list(range(8))
    caches = [torch.randn(6, 2, 4, 16) for _ in range(3)]
    mover = _mover(tmp_path, caches)
    try:
        plan = planner.admit("r", prompt + [99], planner.spans(prompt + [99]), stored=0)
        planner.set_pages("r", [1, 2, 3], replace=True)
        out = StepPlan()
        planner.step("r", computed_after=9, out=out)
        mover.save(out)
        mover.writer.flush()
        move = out.saves["r"][0]
        wrong = BlockMove(move.key, b"", 0, tuple(range(1, 9)), 0, move.pages)  # the key's block, other tokens
        mover.caches = fresh = [torch.zeros(6, 2, 4, 16) for _ in range(3)]
        mover.load(StepPlan(loads={"r": [wrong]}))
        assert mover.take_errors() == {1, 2} and all(f.abs().sum() == 0 for f in fresh)
        assert plan.spans[0].key == move.key
    finally:
        mover.close()
        mover.store.close()
