"""Blocks whose keys and values differ in head dim (MLA) over the remote store: a real in-process server (memory
over LMDB), every codec through the gRPC path and the same-host wire path, a server that re-encodes them
(``--disk-codec``), a forged block refused before anything is stored, and prefix reuse on an MLA model through
``RemoteStore`` equal to plain ``generate``. The tiers alone: ``tests/kvstore/test_mla_blocks.py``."""

from __future__ import annotations

import pytest
import torch
from arch_rule import Output, assert_same, plain_generate
from families import family_model
from helpers import FINGERPRINT, assert_same_block, key_of
from mla_blocks import CODEC_IDS, CODECS, forge, mla_block

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.kvstore.encoding import decode_block, encode_block, read_header
from kvshelf.service.auth import scope_tag
from kvshelf.service.client import RemoteStore, RemoteStoreError
from kvshelf.service.serve import ServeConfig, open_store
from kvshelf.service.server import start_server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An in-process server; tiers keep blocks as sent (memory over LMDB)."""
    data_dir = tmp_path_factory.mktemp("served") / "data"
    store = open_store(ServeConfig.from_settings(data_dir=str(data_dir), memory="64MiB"))
    running = start_server(store)
    yield store, f"127.0.0.1:{running.port}"
    running.stop(0)
    store.close()


def _pairs(namespace: str, dk: int = 24, dv: int = 16) -> list[tuple[bytes, object]]:
    blocks = [mla_block(16, dk=dk, dv=dv, start_pos=s, namespace=namespace) for s in (0, 16)]
    return [(key_of(b), b) for b in blocks]


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "wire"])
@pytest.mark.parametrize(("codec", "params"), CODECS, ids=CODEC_IDS)
def test_every_codec_carries_mla_blocks_over_the_remote_store(served, codec, params, shared_memory):
    store, address = served
    namespace = f"mla-{codec}-{len(params)}-{int(shared_memory)}"
    pairs = _pairs(namespace)
    sent = [encode_block(block, key, codec, params) for key, block in pairs]
    keys = [k for k, _ in pairs]
    with RemoteStore(address, namespace=namespace, codec=codec, codec_params=params,
                     shared_memory=shared_memory) as remote:
        assert remote.put_many(pairs) == 2
        assert remote.get_encoded_many(keys) == sent  # held as sent: value_head_dim and all
        for got, value in zip(remote.get_many(keys, fingerprint=FINGERPRINT), sent, strict=True):
            assert_same_block(got, decode_block(value))
            assert tuple(got.values.shape) == (3, 2, 16, 16) and tuple(got.keys.shape) == (3, 2, 16, 24)
        for prepared, value in zip(remote.get_prepared_many(keys, fingerprint=FINGERPRINT), sent, strict=True):
            want = decode_block(value)
            k_out, v_out = torch.empty_like(want.keys), torch.empty_like(want.values)
            prepared.payload.write(k_out, v_out)
            torch.testing.assert_close(v_out, want.values, equal_nan=True, rtol=0, atol=0)
        tier_stats = {t["name"]: t for t in remote.stats()["tiers"]}
        assert all(t["corrupt"] == 0 for t in tier_stats.values())
    tag = scope_tag(namespace)
    for spec in store.specs:  # both tiers hold them, readable
        held = spec.tier.get_many([tag + k for k in keys])
        assert [read_header(v).shape.value_head_dim for v in held] == [16, 16]


def test_a_server_that_reencodes_keeps_both_head_dims(tmp_path):
    """``--disk-codec int8``: LMDB re-encodes the raw MLA blocks a client sends, values of their own head dim."""
    store = open_store(ServeConfig.from_settings(data_dir=str(tmp_path / "data"), memory="64MiB", disk_codec="int8"))
    running = start_server(store)
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", codec="raw",
                         shared_memory=False) as remote:
            pairs = _pairs("default", dk=8, dv=12)
            assert remote.put_many(pairs) == 2
            disk = store.specs[-1].tier
            held = disk.get_many([scope_tag("default") + k for k, _ in pairs])
            headers = [read_header(v) for v in held]
            assert [(h.codec, h.shape.value_head_dim, h.shape[3]) for h in headers] == [("int8", 12, 8)] * 2
            for value, (_, block) in zip(held, pairs, strict=True):  # what LMDB serves once memory lets go of it
                got = decode_block(value)
                assert tuple(got.values.shape) == (3, 2, 16, 12)
                assert float((got.values - block.values).abs().max()) < 0.05
            got = remote.get_many([k for k, _ in pairs], fingerprint=FINGERPRINT)
            assert all(b is not None and tuple(b.values.shape) == (3, 2, 16, 12) for b in got)
    finally:
        running.stop(0)
        store.close()


def test_a_forged_mla_block_is_refused_by_the_server_and_named(served):
    """A block whose header lost its values' head dim (what the old writer wrote): DATA_LOSS naming the declared
    shape and the payload size, and nothing stored."""
    store, address = served
    block = mla_block(16, dk=32, dv=8, layers=4, heads=1, namespace="forged")
    forged = forge(encode_block(block, key_of(block)), value_head_dim=None)
    with RemoteStore(address, namespace="forged", shared_memory=False) as remote:
        with pytest.raises(RemoteStoreError) as excinfo:
            remote.put_encoded_many([(key_of(block), forged)])
        assert excinfo.value.code.name == "DATA_LOSS"
        assert "payload is 10240 bytes, a block of shape [4, 1, 16, 32] float32 takes 16384" in str(excinfo.value)
        assert remote.held([key_of(block)]) == [False]


def test_prefix_reuse_on_an_mla_model_over_the_remote_store_is_exact(served):
    """DeepSeek-V2 (tiny): blocks stored through RemoteStore are reused (never dropped as damaged) and the answer
    equals plain ``generate``: tokens, and logits within 1e-4."""
    model = family_model("deepseek-v2", attn="sdpa")
    prompt = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    _, address = served
    with RemoteStore(address, namespace="mla-model", codec="zstd") as remote:
        gen = CachedGenerator(model, store=remote, block_size=16)
        cold = gen.generate(prompt, max_new_tokens=4, eos_token_id=None, pad_token_id=0, wait=True)
        warm = gen.generate(prompt, max_new_tokens=4, eos_token_id=None, pad_token_id=0, output_logits=True)
        assert (cold.reused_tokens, cold.stored_blocks) == (0, 4) and warm.reused_tokens == 64
        assert all(t["corrupt"] == 0 for t in remote.stats()["tiers"])
        gen.close()
    assert_same(Output(warm.new_ids, [lg[0] for lg in warm.logits]), plain_generate(model, prompt, 4),
                what="deepseek-v2 over RemoteStore")
