"""Prefix reuse through the GPU tier and the device load path, on the CPU (the same code as on CUDA, with a
``device`` argument; ``kvshelf bench gpu`` runs it on a GPU): the output equals the uncached one whether the
blocks come from the device tier, from the tiers below (then offered to the device tier), or through the staged
path that codecs without a device decode take on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import FINGERPRINT, key_of, make_block, token_ids

from kvshelf.adapters.cache_bridge import cache_from_blocks, tensors_from_prepared
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.device_tier import GPU_TIER_NAME
from kvshelf.kvstore.encoding import encode_block, prepare_block

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _tier(store, name: str) -> dict:  # noqa: ANN001
    return next(t for t in store.stats()["tiers"] if t["name"] == name)


@pytest.mark.parametrize("disk_codec", ["raw", "int8"])
def test_reuse_through_the_gpu_tier_gives_the_uncached_output(model, tmp_path, disk_codec: str) -> None:
    prompt = token_ids(70)
    store = open_embedded_store(tmp_path, gpu_bytes="16MiB", device="cpu", disk_codec=disk_codec, durable=False)
    gen = CachedGenerator(model, store=store, block_size=16)
    cold = gen.generate(prompt, max_new_tokens=10, reuse=False, store=True, wait=True, eos_token_id=None)
    assert _tier(store, GPU_TIER_NAME)["blocks"] == 4  # the put wrote through to the device tier
    warm = gen.generate(prompt, max_new_tokens=10, eos_token_id=None)
    assert warm.reused_tokens == 64 and warm.new_ids == cold.new_ids
    assert _tier(store, GPU_TIER_NAME)["hits"] == 4 and _tier(store, "memory")["hits"] == 0
    gen.close()
    store.close()
    # a new process: the blocks only on disk; the first load offers them to the device tier, the second reads it
    store = open_embedded_store(tmp_path, gpu_bytes="16MiB", device="cpu", memory_bytes=None,
                                disk_codec=disk_codec, durable=False)
    gen = CachedGenerator(model, store=store, block_size=16)
    from_disk = gen.generate(prompt, max_new_tokens=10, eos_token_id=None)
    assert from_disk.reused_tokens == 64 and from_disk.new_ids == cold.new_ids
    gpu = _tier(store, GPU_TIER_NAME)
    assert gpu["misses"] == 4 and gpu["blocks"] == 4
    again = gen.generate(prompt, max_new_tokens=10, eos_token_id=None)
    assert again.new_ids == cold.new_ids and _tier(store, GPU_TIER_NAME)["hits"] == 4
    gen.close()
    store.close()


@pytest.mark.parametrize("codecs", [["raw", "raw"], ["int8", "int4", "raw"], ["zstd", "fp16"]])
def test_the_staged_path_writes_what_the_direct_path_writes(codecs: list[str]) -> None:
    """The path a GPU takes for codecs that decode on the host (a staging buffer, then one copy), run on the CPU:
    the same tensors as writing straight into the destination."""
    blocks = [make_block(12, seed=i, start_pos=12 * i) for i in range(len(codecs))]
    prepared = [prepare_block(encode_block(b, key_of(b), c)) for b, c in zip(blocks, codecs, strict=True)]
    direct = tensors_from_prepared(prepared, dtype=torch.float32, stage=False)
    staged = tensors_from_prepared(prepared, dtype=torch.float32, stage=True)
    assert torch.equal(direct[0], staged[0]) and torch.equal(direct[1], staged[1])
    if codecs[0] == "raw":  # exact codecs: the blocks themselves
        expected = cache_from_blocks(blocks, _config(blocks[0]))
        assert torch.equal(expected.layers[0].keys[0], staged[0][0])


def _config(block):  # noqa: ANN001, ANN202
    from transformers import LlamaConfig

    layers, heads, _, dim = block.keys.shape
    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       hidden_size=heads * dim, head_dim=dim, vocab_size=16)


def test_blocks_of_another_fingerprint_in_the_gpu_tier_are_not_served(model, tmp_path) -> None:
    store = open_embedded_store(tmp_path, gpu_bytes="16MiB", device="cpu", durable=False)
    stranger = make_block(16, seed=2)
    store.put_many([(key_of(stranger), stranger)])
    assert store.get_prepared_many([key_of(stranger)], fingerprint="another-model") == [None]
    assert store.get_prepared_many([key_of(stranger)], fingerprint=FINGERPRINT)[0] is not None
    store.close()
