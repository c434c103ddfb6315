"""The CUDA paths on a real GPU: a model on CUDA, the GPU tier on CUDA, the CPU tier page-locked, every codec's
blocks written into device tensors. Skipped where there is no CUDA (CI): the same code runs on the CPU in
``test_gpu_tier_generate.py`` and ``tests/kvstore/test_device_tier.py``; on a lent GPU these run first in the
device script of ``kvshelf bench gpu`` (docs/benchmarks.md, "GPU")."""

from __future__ import annotations

import pytest
import torch
from helpers import key_of, make_block, token_ids

from kvshelf.adapters.cache_bridge import tensors_from_prepared
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.device_tier import GPU_TIER_NAME
from kvshelf.kvstore.encoding import encode_block, prepare_block
from kvshelf.kvstore.pinned_memory import PinnedMemoryTier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("codec", ["raw", "zstd", "int8", "int4"])
def test_blocks_written_on_the_device_equal_those_written_on_the_cpu(codec: str) -> None:
    blocks = [make_block(40, seed=i, start_pos=40 * i, layers=3, heads=2, head_dim=64) for i in range(3)]
    prepared = [prepare_block(encode_block(b, key_of(b), codec)) for b in blocks]
    on_cpu = tensors_from_prepared(prepared, dtype=torch.float32)
    on_gpu = tensors_from_prepared(prepared, device="cuda", dtype=torch.float32)
    assert on_gpu[0].device.type == "cuda"
    torch.testing.assert_close(on_gpu[0].cpu(), on_cpu[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(on_gpu[1].cpu(), on_cpu[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("disk_codec", ["raw", "int8"])
def test_reuse_on_cuda_through_every_tier_gives_the_uncached_output(tmp_path, disk_codec: str) -> None:
    model = tiny_llama(seed=0).to("cuda")
    prompt = token_ids(300)
    store = open_embedded_store(tmp_path, gpu_bytes="64MiB", device="cuda", disk_codec=disk_codec, durable=False)
    assert isinstance(store.specs[0].tier, PinnedMemoryTier) and store.specs[0].tier.page_lock
    gen = CachedGenerator(model, store=store, block_size=64)
    cold = gen.generate(prompt, max_new_tokens=8, reuse=False, store=True, wait=True, eos_token_id=None)
    from_gpu = gen.generate(prompt, max_new_tokens=8, eos_token_id=None)
    assert from_gpu.reused_tokens == 256 and from_gpu.new_ids == cold.new_ids
    gpu = next(t for t in store.stats()["tiers"] if t["name"] == GPU_TIER_NAME)
    assert gpu["hits"] == 4
    store.device_tier.delete(store.device_tier.keys())  # next: from the pinned CPU tier, offered back to the GPU
    from_cpu = gen.generate(prompt, max_new_tokens=8, eos_token_id=None)
    assert from_cpu.new_ids == cold.new_ids and store.device_tier.usage().blocks == 4
    assert store.specs[0].tier.pin_failures == 0
    gen.close()
    store.close()
