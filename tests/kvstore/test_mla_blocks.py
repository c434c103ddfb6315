"""Blocks whose keys and values differ in head dim (MLA: keys of ``qk_nope + qk_rope`` dims, values of
``v_head_dim``): every codec x every tier (memory, LMDB, Redis on a real ``redis-server``) stores and serves them
as the codec does in-process, and the writer never acknowledges a block that a reader would drop as damaged.

The remote store (a real in-process server, the wire path) is ``tests/service/test_remote_mla.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis_servers
import torch
from helpers import FINGERPRINT, assert_same_block, key_of
from mla_blocks import CODEC_IDS, CODECS, LOSSLESS, forge, header_text, mla_block

from kvshelf.compress.raw import RawCodec
from kvshelf.compress.sparse import mark_dropped
from kvshelf.kvstore import LMDBTier, MemoryTier, RedisTier, Tier, TieredStore
from kvshelf.kvstore import codec as codec_module
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.codec import BlockShape, block_shape, get_codec
from kvshelf.kvstore.encoding import (
    decode_block,
    decode_cost_bytes,
    decoded_nbytes,
    encode_block,
    prepare_block,
    read_header,
    verify_block,
)
from kvshelf.kvstore.errors import CodecParamError, ConfigError, CorruptBlockError, KVShelfError
from kvshelf.kvstore.store import TierSpec

redis_server = redis_servers.redis_server

MiB = 1 << 20
TIERS = ["memory", "lmdb", "redis"]
#: (keys' head dim, values' head dim): an MLA cache in transformers 5 (the latent, kv_lora_rank 32, and the rotated
#: key part, qk_rope_head_dim 8), expanded MLA keys and values (nope 16 + rope 8, v_head_dim 16), values wider
DIMS = [(32, 8), (24, 16), (8, 12)]


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == "memory":
        made: Tier = MemoryTier(64 * MiB)
    elif request.param == "lmdb":
        made = LMDBTier(tmp_path / "lmdb", initial_map_bytes=MiB, max_map_bytes=256 * MiB, durable=False)
    else:
        servers = request.getfixturevalue("redis_server")
        made = RedisTier.from_url(servers.url, prefix=f"mla{os.urandom(6).hex()}:", chunk_bytes=64 << 10)
    yield made
    made.close()


def _check_close(got: KVBlock, want: KVBlock, codec: str) -> None:
    """Shapes and metadata as stored; values as the codec promises (lossless: bit for bit)."""
    assert tuple(got.keys.shape) == tuple(want.keys.shape) and tuple(got.values.shape) == tuple(want.values.shape)
    if codec in LOSSLESS:
        assert_same_block(got, want)
        return
    for a, b in ((got.keys, want.keys), (got.values, want.values)):
        kept = ~torch.isnan(b)
        assert torch.isfinite(a[kept]).all()
        assert float((a[kept] - b[kept]).abs().max()) < 3.0  # every lossy codec here, even int2 on N(0, 1)
        assert float((a[kept] - b[kept]).abs().mean()) < 0.7


@pytest.mark.parametrize(("dk", "dv"), DIMS)
@pytest.mark.parametrize(("codec", "params"), CODECS, ids=CODEC_IDS)
def test_every_codec_round_trips_mla_blocks_in_every_tier(tier, codec, params, dk, dv):
    store = TieredStore([TierSpec(tier, codec, params)])
    blocks = [mla_block(16, dk=dk, dv=dv, start_pos=s) for s in (0, 16)]
    if codec == "sparse":  # tokens dropped (NaN) in the second block: only the kept ones are stored
        blocks[1] = mark_dropped(blocks[1], [0, 3, 4, 9, 15])
    pairs = [(key_of(b), b) for b in blocks]
    assert store.put_many(pairs) == 2  # acknowledged: and then served, never dropped as damaged
    keys = [k for k, _ in pairs]
    in_process = [decode_block(encode_block(b, k, codec, params)) for k, b in pairs]
    fetched = store.get_many(keys, fingerprint=FINGERPRINT)
    for got, same, (_, block) in zip(fetched, in_process, pairs, strict=True):
        assert_same_block(got, same)  # exactly what the codec decodes in-process
        _check_close(got, block, codec)
    prepared = store.get_prepared_many(keys, fingerprint=FINGERPRINT)
    for p, same in zip(prepared, in_process, strict=True):
        assert p is not None
        assert isinstance(p.shape, BlockShape) and p.shape.values == tuple(same.values.shape)
        k_out = torch.empty_like(same.keys)
        v_out = torch.empty_like(same.values)
        p.payload.write(k_out, v_out)
        torch.testing.assert_close(k_out, same.keys, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(v_out, same.values, equal_nan=True, rtol=0, atol=0)
    stats = store.stats()["tiers"][0]
    assert (stats["hits"], stats["misses"], stats["corrupt"], stats["rejected"]) == (4, 0, 0, 0)


@pytest.mark.parametrize(("codec", "params"), CODECS, ids=CODEC_IDS)
def test_header_declares_both_shapes_and_the_decode_cost_counts_them(codec, params):
    block = mla_block(16, dk=24, dv=16)
    data = encode_block(block, key_of(block), codec, params)
    header = verify_block(data)
    assert header.shape == (3, 2, 16, 24) and header.shape.value_head_dim == 16
    assert json.loads(header_text(data))["value_head_dim"] == 16
    assert decoded_nbytes(header) == block.nbytes == 3 * 2 * 16 * (24 + 16) * 4
    assert decode_cost_bytes(header) >= block.nbytes


def test_blocks_of_one_head_dim_keep_their_header():
    """No ``value_head_dim`` when keys and values agree: every block written before MLA support reads as before."""
    block = mla_block(8, dk=16, dv=16)
    data = encode_block(block, key_of(block))
    assert "value_head_dim" not in json.loads(header_text(data))
    header = read_header(data)
    assert header.shape.value_head_dim == 16 and header.shape.same_dims
    assert_same_block(decode_block(data), block)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_mla_blocks(dtype):
    block = mla_block(16, dk=24, dv=16, dtype=dtype)
    for codec in ("raw", "zstd", "fp16", "int8", "cachegen"):
        got = decode_block(encode_block(block, key_of(block), codec))
        assert got.keys.dtype == dtype and tuple(got.values.shape) == (3, 2, 16, 16)


def test_block_shape_helpers():
    shape = block_shape((2, 3, 4, 24), (2, 3, 4, 16))
    assert shape.keys == (2, 3, 4, 24) and shape.values == (2, 3, 4, 16) and not shape.same_dims
    assert "values [2, 3, 4, 16]" in repr(shape)
    assert BlockShape(shape).value_head_dim == 16  # a copy keeps it
    assert block_shape((2, 3, 4, 8)).values == (2, 3, 4, 8)
    with pytest.raises(ValueError, match="share"):
        block_shape((2, 3, 4, 8), (2, 3, 5, 8))
    with pytest.raises(ConfigError, match="disagree"):
        KVBlock(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 3, 8), (1, 2, 3, 4), 0, FINGERPRINT)


def test_xquant_refuses_mla_blocks_clearly():
    block = mla_block(16, dk=24, dv=16)
    with pytest.raises(CodecParamError, match="head dim"):
        encode_block(block, key_of(block), "xquant", {})


# ---------------------------------------------------------------------------------------------- the writer's check

@dataclass
class _KeysOnlyShapeRaw(RawCodec):
    """A broken codec: payload bounds of keys and values both of the keys' shape (what every block of an MLA model
    got before: ``raw payload is 10240 bytes, a block of shape [4, 1, 16, 32] float32 takes 16384``)."""

    name = "test-keys-shape-raw"

    @classmethod
    def payload_bounds(cls, params, shape, itemsize):  # noqa: ANN001, ANN206
        n = 2 * shape[0] * shape[1] * shape[2] * shape[3] * itemsize
        return n, n


@pytest.fixture
def broken_codec(monkeypatch: pytest.MonkeyPatch) -> str:
    registry = codec_module._registry()  # the built-in codecs loaded first
    monkeypatch.setitem(registry, _KeysOnlyShapeRaw.name, _KeysOnlyShapeRaw)
    return _KeysOnlyShapeRaw.name


def test_the_writer_refuses_a_payload_its_shapes_do_not_take(broken_codec, tmp_path):
    """encode_block checks the payload against the declared shapes (``payload_bounds``) before it writes: the put
    is refused with an error naming both shapes and the payload size, and no tier holds anything."""
    block = mla_block(16, dk=32, dv=8, layers=4, heads=1)
    with pytest.raises(ConfigError) as exc:
        encode_block(block, key_of(block), broken_codec)
    message = str(exc.value)
    assert "10240 bytes" in message and "16384" in message
    assert "keys [4, 1, 16, 32]" in message and "values [4, 1, 16, 8]" in message
    tiers = [MemoryTier(MiB), LMDBTier(tmp_path / "lmdb", initial_map_bytes=MiB, durable=False)]
    store = TieredStore([TierSpec(t, broken_codec) for t in tiers])
    with pytest.raises(ConfigError, match="10240 bytes"):
        store.put_many([(key_of(block), block)])
    assert [t.keys() for t in tiers] == [[], []]  # nothing acknowledged, nothing stored
    store.close()


def test_a_forged_mla_block_is_refused_by_put_and_named(tmp_path):
    """A block whose header lost its values' head dim (what the old writer wrote) is never stored: the put of an
    encoded value is refused with an error naming the declared shape and the payload size."""
    block = mla_block(16, dk=32, dv=8, layers=4, heads=1)
    forged = forge(encode_block(block, key_of(block)), value_head_dim=None)
    tier = LMDBTier(tmp_path / "lmdb", initial_map_bytes=MiB, durable=False)
    store = TieredStore([TierSpec(MemoryTier(MiB)), TierSpec(tier)])
    with pytest.raises(CorruptBlockError) as exc:
        store.put_encoded_many([(key_of(block), forged)])
    assert "raw payload is 10240 bytes, a block of shape [4, 1, 16, 32] float32 takes 16384" in str(exc.value)
    assert tier.keys() == []
    store.close()


# -------------------------------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("vdim", [-1, 4097, True, "16", 1.5, [16]])
def test_a_header_with_a_bad_value_head_dim_is_damaged(vdim):
    block = mla_block(4, dk=24, dv=16)
    forged = forge(encode_block(block, key_of(block)), value_head_dim=vdim)
    with pytest.raises(CorruptBlockError):
        verify_block(forged)
    with pytest.raises(CorruptBlockError):
        decode_block(forged)


@pytest.mark.parametrize(("codec", "params"), [*CODECS, ("xquant", {})], ids=[*CODEC_IDS, "xquant"])
@pytest.mark.parametrize("claim", ["other", "keys", "wider"])
def test_a_header_claiming_other_dims_is_a_clear_error_never_a_raw_one(codec, params, claim):
    """A checksum-valid header whose values' head dim disagrees with its payload: ``CorruptBlockError`` (or another
    kvshelf error), or a block of exactly the declared shapes; never a raw exception."""
    block = mla_block(16, dk=24, dv=16)
    data = (encode_block(block, key_of(block), codec, params) if codec != "xquant"
            else encode_block(mla_block(16, dk=16, dv=16), key_of(block), "raw"))
    claimed = {"other": 8, "keys": None, "wider": 40}[claim]
    forged = forge(data, value_head_dim=claimed) if codec != "xquant" else forge(
        data, codec="xquant", params=get_codec("xquant").params(), value_head_dim=claimed)
    header_vdim = 24 if claimed is None else claimed
    for read in (decode_block, prepare_block):
        try:
            got = read(forged)
        except KVShelfError:
            continue
        shape = got.values.shape if isinstance(got, KVBlock) else got.shape.values
        assert tuple(shape)[3] == header_vdim


@pytest.mark.parametrize(("codec", "params"), CODECS, ids=CODEC_IDS)
def test_a_truncated_or_corrupt_mla_block_is_a_counted_miss(codec, params):
    block = mla_block(16, dk=24, dv=16)
    key = key_of(block)
    data = encode_block(block, key, codec, params)
    tier = MemoryTier(MiB)
    store = TieredStore([TierSpec(tier, codec, params)])
    for damaged in (data[: len(data) // 2], data[:-9] + bytes([data[-9] ^ 0xFF]) + data[-8:]):
        with pytest.raises(CorruptBlockError):
            decode_block(damaged)
        tier.put_many([(key, damaged)])
        assert store.get_many([key], fingerprint=FINGERPRINT) == [None]
    assert store.stats()["tiers"][0]["corrupt"] == 2


def test_stored_events_carry_mla_blocks(tmp_path):
    """A stored event's size is the value stored and its header declares both head dims (events and the vLLM
    KV-event feed read them from there)."""
    events = []
    store = TieredStore([TierSpec(MemoryTier(MiB)), TierSpec(LMDBTier(tmp_path / "lmdb", initial_map_bytes=MiB,
                                                                      durable=False), "int8")])
    store.subscribe(events.append)
    block = mla_block(16, dk=24, dv=16)
    store.put_many([(key_of(block), block)])
    stored = [e for e in events if e.kind == "stored"]
    assert [e.codec for e in stored] == ["raw", "int8"]
    for event, codec in zip(stored, ("raw", "int8"), strict=True):
        assert event.nbytes == len(encode_block(block, key_of(block), codec))
        assert event.header.shape.values == (3, 2, 16, 16) and event.header.shape.keys == (3, 2, 16, 24)
    store.close()
