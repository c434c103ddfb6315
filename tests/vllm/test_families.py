"""Model families on a real vLLM engine with kvshelf's connector: a Qwen3-type model (QK-norm, head dim 128) and a
Qwen2-type GQA model (biased QKV projections, head dim 32), random weights saved to a folder. Per family, one
engine: a prompt's first run (nothing stored: vLLM computes every token, as without the connector) stores its
blocks, the second run loads them and answers with the same greedy tokens; and the HF adapter (``CachedGenerator``
on the same folder) finds those blocks under its own keys and reuses them exactly."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_engine import BLOCK, engine, generate, report, tokens_of

from kvshelf.kvstore.keys import prefix_block_keys
from kvshelf.kvstore.store_url import open_store

pytestmark = pytest.mark.slow


def _qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0))


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0))


FAMILIES = {"qwen3": _qwen3, "qwen2": _qwen2}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_reuses_exactly_in_vllm_and_across_to_hf(family: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.vllm.fingerprint import checkpoint_fingerprint

    torch.manual_seed(0)
    folder = tmp_path / family
    FAMILIES[family]().save_pretrained(folder)
    url = f"embedded://{tmp_path / 'store'}?memory=0"
    rng = random.Random(1)
    prompt = [rng.randrange(3, 512) for _ in range(600)]  # 2 full blocks
    keys = prefix_block_keys(checkpoint_fingerprint(folder, torch.float32), "default", prompt, BLOCK)
    with engine(str(folder), {"store": url}, skip_tokenizer_init=True) as llm:
        cold = generate(llm, [prompt], detokenize=False)[0]
        with open_store(url) as store:
            deadline = time.monotonic() + 60
            while not all(store.held(keys)):
                assert time.monotonic() < deadline
                time.sleep(0.2)
        warm = generate(llm, [prompt], detokenize=False)[0]
    assert report(cold)["saved_blocks"] == 2 and report(warm)["loaded_tokens"] == 2 * BLOCK
    assert tokens_of([warm]) == tokens_of([cold])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with open_store(url) as store:
        generator = CachedGenerator(model, None, store, write_behind=False)
        alone = generator.generate(prompt, max_new_tokens=8, reuse=False, store=False)
        reused: Any = generator.generate(prompt, max_new_tokens=8, store=False)
    assert reused.reused_tokens == 2 * BLOCK and reused.new_ids == alone.new_ids
