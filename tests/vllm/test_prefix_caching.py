"""kvshelf's connector beside vLLM's own prefix caching (on, as vLLM serves by default): when vLLM holds part of a
kvshelf block (3 of doc0's 128-token pages, from another prompt), the connector loads the rest of that block's
pages and the blocks after it, never the pages vLLM holds, and the answer equals vLLM's without the connector."""

from __future__ import annotations

import time

import pytest
from vllm_engine import BLOCK, engine, generate, report, tokens_of

from kvshelf.kvstore.keys import prefix_block_keys
from kvshelf.kvstore.store_url import open_store

pytestmark = pytest.mark.slow


def test_load_completes_a_block_vllm_holds_in_part(model_dir: str, documents: dict, reference: dict,
                                                   fingerprint: str, tmp_path) -> None:
    url = f"embedded://{tmp_path}?memory=0"
    keys = prefix_block_keys(fingerprint, "default", documents["doc0"], BLOCK)
    with engine(model_dir, {"store": url}, enable_prefix_caching=True) as llm:
        first = generate(llm, [documents["doc0"]])[0]  # stores doc0's 3 blocks
        with open_store(url) as store:
            deadline = time.monotonic() + 60
            while not all(store.held(keys)):
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert llm.reset_prefix_cache()  # vLLM forgets doc0's pages; the store keeps its blocks
        straddle = generate(llm, [documents["straddle"]])[0]  # vLLM caches doc0's first 3 pages (384 tokens)
        again = generate(llm, [documents["doc0"]])[0]
    assert tokens_of([first, straddle, again]) == [reference["doc0"], reference["straddle"], reference["doc0"]]
    assert report(straddle)["loaded_tokens"] == BLOCK  # doc0's first block, from the store
    assert again.num_cached_tokens == 3 * BLOCK
    assert report(again)["loaded_tokens"] == 3 * BLOCK - 384  # block 1's last page, and block 2
