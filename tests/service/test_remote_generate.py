"""``CachedGenerator`` through ``RemoteStore`` and a real kvshelf server: same tokens as without a cache."""

from __future__ import annotations

import pytest
import torch
from service_helpers import TOKENS, ServeProcess, write_tokens

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.kvstore import open_embedded_store, prefix_block_keys
from kvshelf.service.client import RemoteStore
from kvshelf.service.server import start_server


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _prompt(n: int, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def test_generate_through_remote_store_matches_uncached(model, tmp_path):
    store = open_embedded_store(tmp_path / "data", memory_bytes="64MiB")
    running = start_server(store)
    try:
        with RemoteStore(f"127.0.0.1:{running.port}") as remote:
            gen = CachedGenerator(model, store=remote, block_size=16)
            prompt = _prompt(100)
            cold = gen.generate(prompt, max_new_tokens=12, reuse=False, eos_token_id=None)
            warm = gen.generate(prompt, max_new_tokens=12, eos_token_id=None)
            assert cold.stored_blocks == 6
            assert warm.reused_tokens == 96 and warm.prefilled_tokens == 4
            assert warm.new_ids == cold.new_ids
            longer = prompt + _prompt(40, seed=4)
            uncached = CachedGenerator(model, store=None, block_size=16).generate(
                longer, max_new_tokens=12, eos_token_id=None)
            extended = gen.generate(longer, max_new_tokens=12, eos_token_id=None)
            assert extended.reused_tokens == 96
            assert extended.new_ids == uncached.new_ids
            stats = remote.stats()
            assert stats["retrieve_hit_rate"] == 1.0
    finally:
        running.stop(0)
        store.close()


def test_two_workers_share_a_served_cache_per_tenant(model, tmp_path):
    """A real `kvshelf serve` process with tokens: worker 2 reuses what worker 1 prefilled; another tenant
    with the same prompt does not."""
    token_a, token_b = list(TOKENS)
    proc = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
                        "--tokens-file", str(write_tokens(tmp_path / "tokens.toml")))
    try:
        prompt = _prompt(70, seed=5)
        with RemoteStore(proc.address, token=token_a, namespace="tenant-a") as worker1:
            first = CachedGenerator(model, store=worker1, namespace="tenant-a", block_size=16).generate(
                prompt, max_new_tokens=8, eos_token_id=None)
        with RemoteStore(proc.address, token=token_a, namespace="tenant-a") as worker2:
            # no namespace given: the generator works in its store's (the token's) namespace
            second = CachedGenerator(model, store=worker2, block_size=16).generate(
                prompt, max_new_tokens=8, eos_token_id=None)
        with RemoteStore(proc.address, token=token_b, namespace="tenant-b") as other:
            third = CachedGenerator(model, store=other, block_size=16).generate(
                prompt, max_new_tokens=8, eos_token_id=None)
        assert first.reused_tokens == 0 and second.reused_tokens == 64 and third.reused_tokens == 0
        assert first.new_ids == second.new_ids == third.new_ids
    finally:
        proc.stop()


def test_remote_prepared_blocks_reject_foreign_and_unknown_keys(model, tmp_path):
    """``RemoteStore.get_prepared_many`` (what ``CachedGenerator`` reads through): the stored block parses for
    its own model, and is a miss for another model's fingerprint or a key the server does not hold."""
    store = open_embedded_store(tmp_path / "data", memory_bytes="64MiB")
    running = start_server(store)
    try:
        with RemoteStore(f"127.0.0.1:{running.port}") as remote:
            gen = CachedGenerator(model, store=remote, block_size=16)
            prompt = _prompt(40, seed=6)
            gen.generate(prompt, max_new_tokens=2, eos_token_id=None, wait=True)  # stored before the reads below
            keys = prefix_block_keys(gen.fingerprint, gen.namespace, prompt, gen.block_size)
            got = remote.get_prepared_many(keys, fingerprint=gen.fingerprint)
            assert [b.token_ids for b in got] == [tuple(prompt[:16]), tuple(prompt[16:32])]
            assert remote.get_prepared_many(keys, fingerprint="f" * 32) == [None, None]
            assert remote.get_prepared_many([bytes(16)], fingerprint=gen.fingerprint) == [None]
    finally:
        running.stop(0)
        store.close()
