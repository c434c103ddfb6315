"""Blocks prepared (checked, parsed) by the store and written straight into a cache: ``get_prepared_many``,
``PreparedPayload.write_run`` (xquant's one matrix product per layer over chained blocks) and
``cache_from_prepared``, against the block-by-block decode they replace."""

from __future__ import annotations

import pytest
import torch
from helpers import FINGERPRINT, key_of, make_block, token_ids

from kvshelf.adapters.cache_bridge import cache_from_blocks, cache_from_prepared
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.xquant import xquant_params
from kvshelf.compress.kivi import KiviPayload
from kvshelf.compress.xquant import XQuantPayload
from kvshelf.kvstore import KVBlock, open_embedded_store
from kvshelf.kvstore.codec import DecodedPayload
from kvshelf.kvstore.encoding import decode_block, encode_block, prepare_block


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=3, layers=2)
    return model, xquant_params(model, token_ids(600, seed=1))


def _chained_blocks(model, sizes: list[int], *, outlier: bool = False) -> list[KVBlock]:  # noqa: ANN001
    """Consecutive blocks of one prompt's real KV (sizes in tokens); ``outlier`` scales one token's values so
    that its latent symbols overflow their classes (escapes)."""
    ids = torch.tensor([token_ids(sum(sizes), seed=4)])
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    if outlier:
        values[:, :, 5] *= 40.0
    blocks, start = [], 0
    for size in sizes:
        end = start + size
        blocks.append(KVBlock(keys[:, :, start:end].contiguous(), values[:, :, start:end].contiguous(),
                              tuple(ids[0, start:end].tolist()), start, FINGERPRINT))
        start = end
    return blocks


def _write(prepared: list, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    layers, heads, _, dim = prepared[0].shape
    total = sum(p.num_tokens for p in prepared)
    keys, values = torch.empty(layers, heads, total, dim, dtype=dtype), torch.empty(layers, heads, total, dim,
                                                                                      dtype=dtype)
    payloads = [p.payload for p in prepared]
    type(payloads[0]).write_run(payloads, keys, values)
    return keys, values


@pytest.mark.parametrize("sizes", [[32, 32, 32], [40, 40, 17], [1, 63], [50]])
@pytest.mark.parametrize("params", [{}, {"max_sinks": 0, "step": 0.1}])
def test_xquant_run_equals_block_by_block(tiny, sizes: list[int], params: dict) -> None:
    """One matrix product per layer over chained blocks gives each block's own decode (escapes, sinks, unequal
    block sizes included)."""
    model, bound = tiny
    blocks = _chained_blocks(model, sizes, outlier=True)
    encoded = [encode_block(b, key_of(b), "xquant", {**bound, **params}) for b in blocks]
    prepared = [prepare_block(e) for e in encoded]
    assert all(isinstance(p.payload, XQuantPayload) for p in prepared)
    assert any(len(p.payload.escapes) for p in prepared) or params.get("max_sinks") != 0
    keys, values = _write(prepared)
    one_by_one = [decode_block(e) for e in encoded]
    torch.testing.assert_close(keys, torch.cat([b.keys for b in one_by_one], dim=2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, torch.cat([b.values for b in one_by_one], dim=2), atol=1e-5, rtol=1e-5)


def test_xquant_blocks_that_are_not_chained_are_written_one_by_one(tiny) -> None:
    """Position-independent chunks (every block at position 0) do not share one RoPE run: each block is
    rematerialized at its own positions."""
    model, bound = tiny
    a, b = _chained_blocks(model, [24, 24])
    b0 = KVBlock(b.keys, b.values, b.token_ids, 0, FINGERPRINT)  # as if encoded at position 0
    encoded = [encode_block(x, key_of(x), "xquant", bound) for x in (a, b0)]
    keys, values = _write([prepare_block(e) for e in encoded])
    expected = [decode_block(e) for e in encoded]
    torch.testing.assert_close(keys, torch.cat([x.keys for x in expected], dim=2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, torch.cat([x.values for x in expected], dim=2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("codecs", [["raw"], ["int8"], ["raw", "int8", "int8", "zstd", "raw"]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_from_prepared_matches_cache_from_blocks(tiny, codecs: list[str], dtype: torch.dtype) -> None:
    """Mixed codecs (each run written by its own class), truncation to ``max_tokens``, a dtype change."""
    model, _ = tiny
    blocks = _chained_blocks(model, [16] * len(codecs))
    encoded = [encode_block(b, key_of(b), c) for b, c in zip(blocks, codecs, strict=True)]
    prepared = [prepare_block(e) for e in encoded]
    expected = {"raw": DecodedPayload, "zstd": DecodedPayload, "int8": KiviPayload}
    assert [type(p.payload) for p in prepared] == [expected[c] for c in codecs]
    limit = 16 * len(codecs) - 3
    got = cache_from_prepared(prepared, model.config, max_tokens=limit, dtype=dtype)
    want = cache_from_blocks([decode_block(e) for e in encoded], model.config, max_tokens=limit, dtype=dtype)
    assert got.get_seq_length() == want.get_seq_length() == limit
    for g, w in zip(got.layers, want.layers, strict=True):
        assert g.keys.dtype == dtype and torch.equal(g.keys, w.keys) and torch.equal(g.values, w.values)


def test_get_prepared_many_serves_misses_for_damaged_and_foreign_blocks(tmp_path) -> None:
    """A damaged block is a counted miss and is dropped; a block of another model is a miss; the rest load."""
    store = open_embedded_store(tmp_path, memory_bytes=None, disk_codec="int8", durable=False)
    try:
        good, damaged = make_block(8, seed=1), make_block(8, seed=2, start_pos=8)
        store.put_many([(key_of(good), good), (key_of(damaged), damaged)])
        lmdb = store.specs[0].tier
        (value,) = lmdb.get_many([key_of(damaged)])
        lmdb.put_many([(key_of(damaged), value[:-40] + bytes(40))])
        got = store.get_prepared_many([key_of(good), key_of(damaged)], fingerprint=FINGERPRINT)
        assert got[0] is not None and got[1] is None
        assert got[0].token_ids == good.token_ids and got[0].start_pos == 0
        assert store.stats()["tiers"][0]["corrupt"] == 1
        assert lmdb.get_many([key_of(damaged)]) == [None]  # dropped, the good block kept
        assert store.get_prepared_many([key_of(good)], fingerprint="another-model") == [None]
    finally:
        store.close()


@pytest.mark.parametrize("codec", ["zstd", "fp16"])
def test_generate_through_a_compressed_disk_tier(codec: str, tmp_path) -> None:
    """Reuse from an LMDB tier holding ``zstd`` (lossless) or ``fp16`` blocks, through the prepared path."""
    model = tiny_llama(seed=0)
    store = open_embedded_store(tmp_path, memory_bytes=None, disk_codec=codec, durable=False)
    try:
        gen = CachedGenerator(model, store=store, block_size=16)
        prompt = token_ids(70, seed=5)
        cold = gen.generate(prompt, max_new_tokens=8, reuse=False, output_logits=True, eos_token_id=None)
        warm = gen.generate(prompt, max_new_tokens=8, output_logits=True, eos_token_id=None)
    finally:
        store.close()
    assert warm.reused_tokens == 64
    assert warm.new_ids == cold.new_ids
    diff = max(float((a - b).abs().max()) for a, b in zip(cold.logits, warm.logits, strict=True))
    assert diff < (1e-3 if codec == "zstd" else 5e-2)


@pytest.mark.parametrize("params", [{"group_size": 8}, {"group_size": 16}, {"group_size": 32}, {"group_size": 5}])
def test_kivi_writes_into_slices_of_a_larger_cache(tiny, params: dict) -> None:
    """KIVI dequantizes straight into each block's slice (groups that tile the layout) or through its fallback
    (groups that do not), with the same values as a block-by-block decode."""
    model, _ = tiny
    blocks = _chained_blocks(model, [16, 16, 16])
    encoded = [encode_block(b, key_of(b), "int4", params) for b in blocks]
    keys, values = _write([prepare_block(e) for e in encoded])
    expected = [decode_block(e) for e in encoded]
    assert torch.equal(keys, torch.cat([x.keys for x in expected], dim=2))
    assert torch.equal(values, torch.cat([x.values for x in expected], dim=2))
