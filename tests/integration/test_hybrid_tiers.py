"""Hybrid models (state snapshots beside KV blocks, ``adapters.hybrid``) exact through every tier and the remote
store: the embedded store's LMDB tier alone (memory cleared: every value read back from disk, zstd on disk), write-
behind storing, and a ``RemoteStore`` over gRPC."""

from __future__ import annotations

import pytest
import torch
from hybrid_families import hybrid_model
from redis_servers import redis_server  # noqa: F401 - a fixture

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.kvstore import MemoryTier, TieredStore, open_embedded_store
from kvshelf.kvstore.lmdb_tier import LMDBTier
from kvshelf.kvstore.redis_tier import RedisTier
from kvshelf.kvstore.store import TierSpec
from kvshelf.service.client import RemoteStore
from kvshelf.service.server import ServerLimits, start_server

BLOCK, NEW = 16, 4
IDS = torch.randint(3, 500, (120,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield hybrid_model("qwen3_next")
    torch.set_num_threads(threads)


def _plain(model, ids):
    t = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), out.logits


def _run(model, store, *, write_behind: bool = False) -> list[int]:
    """Three prompts sharing a prefix through a fresh generator each (nothing held in process): reused tokens."""
    reused = []
    for n in (70, 100, 120):
        with CachedGenerator(model, None, store, block_size=BLOCK, snapshot_every=2,
                             write_behind=write_behind) as gen:
            result = gen.generate(IDS[:n], max_new_tokens=NEW, output_logits=True)
        tokens, logits = _plain(model, IDS[:n])
        assert result.new_ids == tokens
        assert max(float((a - b).abs().max()) for a, b in zip(result.logits, logits, strict=True)) <= 1e-4
        reused.append(result.reused_tokens)
    return reused


def test_lmdb_tier_with_zstd(model, tmp_path) -> None:
    tier = LMDBTier(tmp_path / "disk")
    store = TieredStore([TierSpec(tier, codec="zstd")])
    try:
        assert _run(model, store) == [0, 64, 96]
    finally:
        store.close()


def test_redis_tier(model, redis_server) -> None:  # noqa: F811 - the fixture
    tier = RedisTier.from_url(redis_server.url, prefix="hybrid-tiers:", chunk_bytes=4096)
    store = TieredStore([TierSpec(tier, codec="zstd")])
    try:
        assert _run(model, store) == [0, 64, 96]
    finally:
        store.close()


def test_embedded_store_write_behind(model, tmp_path) -> None:
    store = open_embedded_store(tmp_path / "data")
    try:
        assert _run(model, store, write_behind=True) == [0, 64, 96]
    finally:
        store.close()


def test_remote_store(model, tmp_path) -> None:
    backing = open_embedded_store(tmp_path / "data")
    running = start_server(backing, limits=ServerLimits(max_block_bytes=64 << 20))
    try:
        with RemoteStore(f"127.0.0.1:{running.port}") as remote:
            assert _run(model, remote) == [0, 64, 96]
    finally:
        running.stop(0)
        backing.close()


def test_memory_tier_evicting_snapshots_never_serves_kv_alone(model) -> None:
    """A memory tier too small for everything: whatever survives, the output is exact."""
    store = TieredStore([MemoryTier(40_000)])
    _run(model, store)
