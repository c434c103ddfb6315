"""Blocks stored in a tier whose codec differs from the block's: re-encoded under the right (unscoped) key,
readable after a restart, and never decoded into more than the configured bound (real gRPC server on loopback,
real LMDB in tmp_path)."""

from __future__ import annotations

import pytest
import torch
from helpers import FINGERPRINT, key_of, make_block
from service_helpers import ServeProcess

from kvshelf.compress.sparse import mark_dropped
from kvshelf.kvstore import LMDBTier, MemoryTier, TieredStore, TierSpec, encode_block, open_embedded_store
from kvshelf.kvstore.codec import payload_len_bounds
from kvshelf.kvstore.encoding import decode_cost_bytes, decoded_nbytes, read_header, verify_block
from kvshelf.kvstore.errors import BlockTooLargeError
from kvshelf.service.auth import scope_tag
from kvshelf.service.client import RemoteStore
from kvshelf.service.server import ServerLimits, start_server


def _blocks(n: int = 4, namespace: str = "default") -> list[tuple[bytes, object]]:
    blocks = [make_block([10 + i, 20 + i, 30 + i, 40 + i], namespace=namespace) for i in range(n)]
    return [(key_of(b), b) for b in blocks]


def test_int8_client_blocks_into_a_raw_memory_tier_are_readable(tmp_path):
    """Remote put in int8 -> the raw memory tier re-encodes them: every read used to reject them as foreign."""
    store = open_embedded_store(tmp_path / "data")  # memory raw, disk raw: both re-encode int8 blocks
    running = start_server(store)
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default", codec="int8") as remote:
            pairs = _blocks()
            assert remote.put_many(pairs) == 4
            keys = [k for k, _ in pairs]
            assert remote.lookup_prefix(keys) == 4
            got = remote.get_many(keys, fingerprint=FINGERPRINT)
            assert sum(b is not None for b in got) == 4
            for (_, expected), block in zip(pairs, got, strict=True):
                assert block.token_ids == expected.token_ids
                assert (block.keys - expected.keys).abs().max() < 0.05
    finally:
        running.stop(0)
        store.close()


def test_disk_codec_int8_blocks_survive_a_restart(tmp_path):
    """`kvshelf serve --disk-codec int8` with a raw client: reads worked from memory until a restart, then the
    disk tier counted every block foreign."""
    pairs = _blocks()
    keys = [k for k, _ in pairs]
    store = open_embedded_store(tmp_path / "data", disk_codec="int8")
    running = start_server(store)
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default") as remote:
            assert remote.put_many(pairs) == 4
    finally:
        running.stop(0)
        store.close()
    store = open_embedded_store(tmp_path / "data", disk_codec="int8")
    running = start_server(store)
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default") as remote:
            got = remote.get_many(keys, fingerprint=FINGERPRINT)
            assert sum(b is not None for b in got) == 4
            stats = store.stats()
            assert all(t["foreign"] == 0 and t["corrupt"] == 0 for t in stats["tiers"])
            # the promoted copies (int8 -> raw memory) are readable too
            assert sum(b is not None for b in remote.get_many(keys, fingerprint=FINGERPRINT)) == 4
            assert store.stats()["tiers"][0]["hits"] == 4
    finally:
        running.stop(0)
        store.close()


def test_reencoded_headers_name_the_unscoped_key(tmp_path):
    """Scoped tier keys (namespace tag + key): every re-encoded copy names the 16-byte key in its header."""
    tag = scope_tag("default")
    memory = MemoryTier(1 << 20, charge_overhead=False)  # the big value below fills exactly its bytes
    disk = LMDBTier(tmp_path / "lmdb")
    store = TieredStore([TierSpec(memory, "raw"), TierSpec(disk, "int8")], write_policy="back")
    key, block = _blocks(1)[0]
    assert store.put_encoded_many([(tag + key, encode_block(block, key, "fp16"))]) == 1
    assert read_header(memory.get_many([tag + key])[0]).key == key
    store.put_many([(tag + key, block)])
    assert read_header(memory.get_many([tag + key])[0]).key == key
    store.delete([tag + key])
    assert store.put_encoded_many([(tag + key, encode_block(block, key))]) == 1
    memory.put_many([(tag + b"\x01" * 16, b"x" * ((1 << 20) - 100))])  # evicts the block: written down in int8
    assert read_header(disk.get_many([tag + key])[0]).key == key
    store.close()


def test_put_encoded_refuses_to_decode_past_the_bound(tmp_path):
    """A block that a tier would re-encode is refused with our own error when decoding it may take more than the
    store's ``max_decoded_bytes`` (its decoded size plus the codec's working memory, from the header), before any
    allocation; a block stored as is (same codec) is not bounded."""
    memory = MemoryTier(64 << 20)
    key, block = _blocks(1)[0]
    value = encode_block(block, key, "int8")
    assert decoded_nbytes(read_header(value)) == 2 * 2 * 2 * 4 * 8 * 4
    need = decode_cost_bytes(read_header(value))
    assert need > decoded_nbytes(read_header(value))
    store = TieredStore([TierSpec(memory, "raw")], max_decoded_bytes=need - 1)
    with pytest.raises(BlockTooLargeError, match="declared shape"):
        store.put_encoded_many([(key, value)])
    assert memory.usage().blocks == 0
    store.max_decoded_bytes = need
    assert store.put_encoded_many([(key, value)]) == 1
    store.max_decoded_bytes = 1
    assert store.put_encoded_many([(key, encode_block(block, key))]) == 1  # no re-encode: stored as sent


def test_promotion_skips_values_too_large_for_the_tier_above(tmp_path):
    """A value in the lower tier whose decoded size exceeds the tier above's capacity is served, not promoted
    (and never decoded for it)."""
    memory = MemoryTier(600)
    disk = LMDBTier(tmp_path / "lmdb")
    store = TieredStore([TierSpec(memory, "raw"), TierSpec(disk, "int8")])
    key, block = _blocks(1)[0]
    disk.put_many([(key, encode_block(block, key, "int8"))])
    assert store.get_many([key], fingerprint=FINGERPRINT)[0] is not None
    assert memory.usage().blocks == 0
    assert store.stats()["tiers"][0]["rejected"] == 0
    store.close()


def test_server_bounds_promotion_by_max_block(tmp_path):
    """The server's max block bounds promotion re-encodes: a stored int8 value that would decode past it stays
    where it is and is still served."""
    store = open_embedded_store(tmp_path / "data", disk_codec="int8")
    pairs = _blocks(2)
    tag = scope_tag("default")
    lmdb_tier = store.specs[1].tier
    lmdb_tier.put_many([(tag + k, encode_block(b, k, "int8")) for k, b in pairs])
    running = start_server(store, limits=ServerLimits(max_block_bytes=400))
    try:
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default") as remote:
            got = remote.get_encoded_many([k for k, _ in pairs])
            assert sum(v is not None for v in got) == 2
            assert store.specs[0].tier.usage().blocks == 0
    finally:
        running.stop(0)
        store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codec,params", [
    ("raw", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("int4", {"group_size": 5}), ("int2", {}), ("zstd", {}),
    ("sparse", {}), ("sparse", {"inner": "int8"}), ("sparse", {"inner": "zstd", "fill": "zero"}), ("cachegen", {}),
])
def test_payload_bounds_hold_for_real_blocks(codec, params, dtype):
    """The payload-size check in ``verify_block`` never rejects a real block (0 to many tokens, dropped ones)."""
    for tokens in (0, 1, 3, 33):
        block = make_block(tokens, dtype=dtype) if tokens else make_block([], dtype=dtype)
        if codec == "sparse" and tokens > 1:
            block = mark_dropped(block, [0, tokens - 1])
        value = encode_block(block, key_of(block), codec, params)
        header = verify_block(value)
        bounds = payload_len_bounds(codec, header.params, header.shape, block.keys.element_size())
        if codec == "cachegen":
            assert bounds is None
        else:
            assert bounds is not None and bounds[0] <= header.payload_len
            assert bounds[1] is None or header.payload_len <= bounds[1]


def test_kvshelf_serve_disk_codec_int8_serves_after_a_restart(tmp_path):
    """The issue's reproduction: `kvshelf serve --disk-codec int8`, a raw client, a restart (SIGKILL): 0 hits
    before the fix."""
    pairs = _blocks()
    keys = [k for k, _ in pairs]
    args = ("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--disk-codec", "int8")
    server = ServeProcess(*args)
    try:
        with RemoteStore(server.address, namespace="default") as remote:
            assert remote.put_many(pairs) == 4
    finally:
        server.stop()
    server = ServeProcess(*args)
    try:
        with RemoteStore(server.address, namespace="default") as remote:
            assert sum(b is not None for b in remote.get_many(keys, fingerprint=FINGERPRINT)) == 4
            disk = next(t for t in remote.stats()["tiers"] if t["name"] == "disk")
            assert disk["foreign"] == 0 and disk["hits"] == 4
    finally:
        server.stop()
