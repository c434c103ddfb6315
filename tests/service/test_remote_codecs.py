"""Compressed remote reuse: a client stores and fetches blocks in any codec over a real ``kvshelf serve``; the
server keeps them as sent (no decode, no re-encode; it holds no xquant tables) and the client decodes them
bit-exactly as the same codec does in-process. Real servers (a subprocess and one in-process), real LMDB."""

from __future__ import annotations

import pytest
import torch
from helpers import FINGERPRINT, assert_same_block, key_of, make_block
from service_helpers import ServeProcess

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.xquant import xquant_params
from kvshelf.kvstore import LMDBTier, open_embedded_store
from kvshelf.kvstore.encoding import decode_block, decode_cost_bytes, encode_block, read_header
from kvshelf.service.auth import scope_tag
from kvshelf.service.client import RemoteStore
from kvshelf.service.serve import ServeConfig, open_store
from kvshelf.service.server import start_server

CODECS = [
    ("raw", {}), ("zstd", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("int4", {"group_size": 32}), ("int2", {}),
    ("cachegen", {}), ("cachegen", {"bits": 4}), ("sparse", {"inner": "int8"}), ("xquant", {"step": 0.35}),
]


@pytest.fixture(scope="module")
def model():
    """The tiny Llama (2 layers, 2 KV heads, head dim 16): its xquant tables are bound in this process only."""
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def xquant_model_params(model):
    calibration = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    return xquant_params(model, calibration)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `kvshelf serve` (default tiers: memory over LMDB, no --disk-codec) in another process."""
    data = tmp_path_factory.mktemp("serve") / "data"
    process = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(data), "--memory", "64MiB")
    yield process, data
    process.stop()


def _blocks(namespace: str) -> list[tuple[bytes, object]]:
    """Two consecutive blocks of the tiny model's geometry (the second at position 16: xquant's RoPE)."""
    blocks = [make_block(list(range(100 + s, 116 + s)), start_pos=s, layers=2, heads=2, head_dim=16,
                         namespace=namespace) for s in (0, 16)]
    return [(key_of(b), b) for b in blocks]


def _params(codec: str, params: dict, xquant_model_params: dict) -> dict:
    return {**xquant_model_params, **params} if codec == "xquant" else params


@pytest.mark.parametrize(("codec", "params"), CODECS, ids=[f"{c}{p or ''}" for c, p in CODECS])
def test_every_codec_is_stored_as_sent_and_decodes_as_in_process(server, xquant_model_params, codec, params):
    process, _ = server
    params = _params(codec, params, xquant_model_params)
    namespace = f"codec-{codec}-{len(params)}"
    pairs = _blocks(namespace)
    sent = [encode_block(block, key, codec, params) for key, block in pairs]
    with RemoteStore(process.address, namespace=namespace, codec=codec, codec_params=params,
                     shared_memory=False) as remote:
        assert remote.put_many(pairs) == 2
        keys = [k for k, _ in pairs]
        # the bytes come back as sent (encoding is deterministic: the client's put sent exactly these)
        assert remote.get_encoded_many(keys) == sent
        fetched = remote.get_many(keys, fingerprint=FINGERPRINT)
        for value, block in zip(sent, fetched, strict=True):
            assert_same_block(block, decode_block(value))  # the codec's own in-process round trip, bit for bit
        prepared = remote.get_prepared_many(keys, fingerprint=FINGERPRINT)
        assert all(p is not None for p in prepared)
        tiers = {t["name"]: t for t in remote.stats()["tiers"]}
        assert tiers["memory"]["codec"] == tiers["disk"]["codec"] == "as-sent"
        for name in ("memory", "disk"):  # what the server holds of this namespace: exactly the bytes sent
            assert tiers[name]["blocks"] == 2 and tiers[name]["bytes"] == sum(map(len, sent))
            assert tiers[name]["bytes_written"] == sum(map(len, sent))


def test_the_lmdb_tier_holds_the_bytes_as_sent(server, xquant_model_params):
    """After the server is gone, its LMDB environment read directly: every codec's values are the sent bytes."""
    process, data = server
    expected = {}
    for codec, params in CODECS:
        params = _params(codec, params, xquant_model_params)
        namespace = f"lmdb-{codec}-{len(params)}"
        pairs = _blocks(namespace)
        with RemoteStore(process.address, namespace=namespace, codec=codec, codec_params=params,
                         shared_memory=False) as remote:
            assert remote.put_many(pairs) == 2
        for key, block in pairs:
            expected[scope_tag(namespace) + key] = encode_block(block, key, codec, params)
    process.stop()  # SIGKILL: the LMDB tier writes through durably
    tier = LMDBTier(data / "lmdb")
    try:
        keys = list(expected)
        assert tier.get_many(keys) == [expected[k] for k in keys]
        assert {read_header(v).codec for v in expected.values()} == {c for c, _ in CODECS}
    finally:
        tier.close()


def test_an_explicit_disk_codec_still_reencodes_within_the_max_block(tmp_path):
    """`--disk-codec raw` (an operator's choice): the memory tier keeps the int8 blocks as sent, LMDB re-encodes
    them to raw; a block whose re-encode would decode past the max block (its decoded size plus int8's working
    memory: ``decode_cost_bytes``, ~17 KiB for the 8 KiB blocks) is refused before anything is decoded."""
    from kvshelf.service.client import RemoteStoreError
    from kvshelf.service.server import ServerLimits

    store = open_store(ServeConfig.from_settings(data_dir=str(tmp_path / "data"), memory="64MiB", disk_codec="raw"))
    running = start_server(store, limits=ServerLimits(max_block_bytes=20_000))
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", codec="int8",
                         shared_memory=False) as remote:
            pairs = _blocks("default")
            assert remote.put_many(pairs) == 2
            tag = scope_tag("default")
            memory, disk = (spec.tier for spec in store.specs)
            keys = [tag + k for k, _ in pairs]
            assert [read_header(v).codec for v in memory.get_many(keys)] == ["int8", "int8"]
            assert [read_header(v).codec for v in disk.get_many(keys)] == ["raw", "raw"]
            big = make_block(list(range(64)), layers=2, heads=2, head_dim=16)  # 32 KiB decoded (8.6 KiB in int8)
            with pytest.raises(RemoteStoreError) as excinfo:
                remote.put_many([(key_of(big), big)])
            assert excinfo.value.code.name == "RESOURCE_EXHAUSTED" and "re-encoded" in str(excinfo.value)
            assert not any(memory.get_many([tag + key_of(big)]))
    finally:
        running.stop(0)
        store.close()


def test_blocks_kept_as_sent_still_decode_within_the_max_block(tmp_path):
    """Tiers that keep blocks as sent never decode them, but their clients do: a small zstd block of zeros that
    decodes to 4 MiB is refused by a 1 MiB max block (a decompression bomb for the readers), before it is stored."""
    import dataclasses

    from kvshelf.service.client import RemoteStoreError
    from kvshelf.service.server import ServerLimits

    store = open_store(ServeConfig.from_settings(data_dir=str(tmp_path / "data"), memory="64MiB"))
    running = start_server(store, limits=ServerLimits(max_block_bytes=1 << 20))
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", codec="zstd",
                         shared_memory=False) as remote:
            block = make_block(1024, layers=2, heads=2, head_dim=128)
            zeros = dataclasses.replace(block, keys=torch.zeros_like(block.keys), values=torch.zeros_like(block.values))
            assert len(encode_block(zeros, key_of(zeros), "zstd")) < 64 << 10
            with pytest.raises(RemoteStoreError) as excinfo:
                remote.put_many([(key_of(zeros), zeros)])
            assert excinfo.value.code.name == "RESOURCE_EXHAUSTED"
            cost = decode_cost_bytes(read_header(encode_block(zeros, key_of(zeros), "zstd")))
            assert cost > 4194304  # the decoded size, plus zstd's planes
            assert f"decodes to {cost} bytes" in str(excinfo.value) and "max block" in str(excinfo.value)
            assert remote.stats()["usage"]["bytes"] == 0
            small = _blocks("default")  # real blocks within the limit are stored as sent
            assert remote.put_many(small) == 2
    finally:
        running.stop(0)
        store.close()


def test_the_adapter_path_over_int8_matches_the_embedded_store(model, tmp_path):
    """CachedGenerator over RemoteStore(int8, wire path) gives the same tokens and logits as over the embedded
    store whose tier is int8: the same blocks, decoded by the same code, once on each side."""
    prompt = torch.randint(3, 500, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    embedded = open_embedded_store(tmp_path / "embedded", memory_bytes=None, disk_codec="int8", durable=False)
    store = open_store(ServeConfig.from_settings(data_dir=str(tmp_path / "served"), memory="64MiB"))
    running = start_server(store)
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", codec="int8",
                         shared_memory=False) as remote:
            outputs = []
            for backend in (embedded, remote):
                generator = CachedGenerator(model, store=backend, block_size=16)
                cold = generator.generate(prompt, max_new_tokens=8, reuse=False, store=True, wait=True,
                                          eos_token_id=None)
                warm = generator.generate(prompt, max_new_tokens=8, store=False, output_logits=True,
                                          eos_token_id=None)
                assert warm.reused_tokens == 96 and cold.new_ids
                outputs.append(warm)
            tag = scope_tag("default")
            memory_keys = list(store.specs[0].tier.keys())
            held = [v for v in store.specs[0].tier.get_many(memory_keys) if v is not None]
            assert len(held) == 6 and all(read_header(v).codec == "int8" for v in held)  # as sent, not raw
            assert all(k.startswith(tag) for k in memory_keys)
    finally:
        running.stop(0)
        store.close()
        embedded.close()
    local, served = outputs
    assert served.new_ids == local.new_ids
    for a, b in zip(local.logits, served.logits, strict=True):
        assert torch.equal(a, b)
