"""xquant's decode with its numba loops against the numpy / torch fallback, its int8 matrix product against the
float ones, and the huge-page buffers the decoded cache lands in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import FINGERPRINT, key_of, token_ids

from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.xquant import xquant_params
from kvshelf.compress import hugepages, xquant_kernels
from kvshelf.kvstore import KVBlock
from kvshelf.kvstore.encoding import decode_block, encode_block, prepare_block
from kvshelf.kvstore.errors import CorruptBlockError

needs_numba = pytest.mark.skipif(not xquant_kernels.AVAILABLE, reason="numba is not available here")


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=5, layers=3)
    return model, xquant_params(model, token_ids(600, seed=2))


def _blocks(model, sizes: list[int], outlier: bool) -> list[KVBlock]:  # noqa: ANN001
    ids = torch.tensor([token_ids(sum(sizes), seed=6)])
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    if outlier:  # symbols beyond int8 (wide escapes) when no sink slot catches the token
        keys[:, :, min(3, sum(sizes) - 1)] *= 60.0
    blocks, start = [], 0
    for size in sizes:
        blocks.append(KVBlock(keys[:, :, start : start + size].contiguous(), values[:, :, start : start + size]
                              .contiguous(), tuple(ids[0, start : start + size].tolist()), start, FINGERPRINT))
        start += size
    return blocks


def _decode_run(encoded: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    prepared = [prepare_block(e) for e in encoded]
    layers, heads, _, dim = prepared[0].shape
    total = sum(p.num_tokens for p in prepared)
    keys, values = torch.empty(layers, heads, total, dim), torch.empty(layers, heads, total, dim)
    payloads = [p.payload for p in prepared]
    type(payloads[0]).write_run(payloads, keys, values)
    return keys, values


@needs_numba
@pytest.mark.parametrize("sizes", [[64, 64, 33], [1], [7, 1, 9]])
@pytest.mark.parametrize("params", [{}, {"max_sinks": 0, "step": 0.02}])
@pytest.mark.parametrize("matmul", ["int8", "bf16", "fp32"])
def test_numba_loops_match_the_fallback(tiny, monkeypatch, sizes: list[int], params: dict, matmul: str) -> None:
    """Unpacking, placing and the epilogue (scales, means, RoPE, layout) give what numpy and torch give."""
    model, bound = tiny
    blocks = _blocks(model, sizes, outlier=params.get("max_sinks") == 0)
    encoded = [encode_block(b, key_of(b), "xquant", {**bound, **params, "matmul": matmul}) for b in blocks]
    fused = _decode_run(encoded)
    monkeypatch.setattr(xquant_kernels, "AVAILABLE", False)
    fallback = _decode_run(encoded)
    if params and sum(sizes) > 4:  # (a 1-token block is its own mean: nothing to escape)
        assert any(len(prepare_block(e).payload.escapes) for e in encoded)  # wide escapes exercised
    for a, b in zip(fused, fallback, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("matmul", ["int8", "bf16"])
def test_quantized_matrix_products_stay_close_to_float32(tiny, matmul: str) -> None:
    """The int8 (per-column scales, exact int32 accumulation) and bf16 products are near the float32 one:
    well inside the codec's own quantization error (step / 2 per latent component)."""
    model, bound = tiny
    blocks = _blocks(model, [96, 40], outlier=False)
    params = {**bound, "step": 0.02}
    exact = _decode_run([encode_block(b, key_of(b), "xquant", {**params, "matmul": "fp32"}) for b in blocks])
    other = _decode_run([encode_block(b, key_of(b), "xquant", {**params, "matmul": matmul}) for b in blocks])
    original = torch.cat([b.keys for b in blocks], dim=2), torch.cat([b.values for b in blocks], dim=2)
    for got, ref, orig in zip(other, exact, original, strict=True):
        assert float((got - ref).abs().max()) <= 0.25 * float((ref - orig).abs().max()) + 1e-4


def test_wide_escapes_are_exact_in_every_matmul(tiny) -> None:
    """A token whose symbols overflow int8 is recomputed in float32: its error stays within the step bound."""
    model, bound = tiny
    (block,) = _blocks(model, [48], outlier=True)
    params = {**bound, "max_sinks": 0, "drop_below": 0.0, "step": 0.02}
    encoded = encode_block(block, key_of(block), "xquant", params)
    payload = prepare_block(encoded).payload
    layers, tokens, _ = payload.codec._plan().escape_coordinates(payload.escapes, block.num_tokens)  # noqa: SLF001
    wide = sorted({int(layer) for layer, token in zip(layers, tokens, strict=True) if token == 3})
    assert wide  # the outlier token overflows int8 in some layers
    back = decode_block(encoded)
    exact = decode_block(encode_block(block, key_of(block), "xquant", {**params, "matmul": "fp32"}))
    for got, ref in ((back.keys, exact.keys), (back.values, exact.values)):
        torch.testing.assert_close(got[wide][:, :, 3], ref[wide][:, :, 3], atol=1e-4, rtol=1e-5)


def test_huge_page_buffers_behave_like_torch_empty() -> None:
    big = hugepages.empty((3, 1024, 1024), torch.float32)  # 12 MiB: above the threshold
    small = hugepages.empty((4, 5), torch.bfloat16)
    assert big.shape == (3, 1024, 1024) and big.dtype == torch.float32 and big.is_contiguous()
    assert small.shape == (4, 5) and small.dtype == torch.bfloat16
    view = big[1, 2:4]
    del big
    view.fill_(2.5)  # the mapping outlives the tensor it was made for
    assert float(view.sum()) == 2.5 * view.numel()
    assert isinstance(hugepages.available(), bool)


@pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages on this kernel: torch.empty there")
def test_huge_page_buffers_are_recycled_only_once_freed() -> None:
    """A freed buffer goes back to the pool and the next one of its size reuses it (already faulted in); one still
    referenced by a view is never handed out twice."""
    hugepages.release_pool()
    shape = (3, 1024, 1024)
    first = hugepages.empty(shape, torch.float32, prefault=True)
    assert float(first.abs().sum()) == 0.0  # a fresh prefaulted mapping: written with zeros
    first.fill_(7.0)
    keep = first[0]
    del first
    assert hugepages.pooled_bytes() == 0  # the view still uses it
    second = hugepages.empty(shape, torch.float32)
    second.fill_(1.0)
    assert float(keep.sum()) == 7.0 * keep.numel()  # untouched by the second buffer
    address = second.data_ptr()
    del second
    assert hugepages.pooled_bytes() == 12 << 20
    third = hugepages.empty(shape, torch.float32)
    assert third.data_ptr() == address and hugepages.pooled_bytes() == 0  # reused
    del keep, third
    hugepages.release_pool()
    assert hugepages.pooled_bytes() == 0


@pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages on this kernel: torch.empty there")
def test_huge_page_pool_keeps_the_most_recent_buffers_within_its_cap(monkeypatch) -> None:
    hugepages.release_pool()
    monkeypatch.setattr(hugepages, "POOL_MAX_BYTES", 20 << 20)
    older, newer = hugepages.empty((3 << 20,), torch.float32), hugepages.empty((4 << 20,), torch.float32)
    del older  # 12 MiB pooled
    del newer  # 16 MiB more: over the cap, the older one is dropped
    assert hugepages.pooled_bytes() == 16 << 20
    assert hugepages._take(12 << 20) is None and hugepages._take(16 << 20) is not None
    hugepages.release_pool()


@needs_numba
def test_place_block_matches_numpy(monkeypatch) -> None:
    """The numba copy of a block's (class, layer) segments equals the numpy slicing it replaces."""
    rng = np.random.default_rng(0)
    counts = np.array([[2, 0, 3], [1, 4, 0]], dtype=np.int64)  # [classes, layers]
    slots = np.cumsum(counts, axis=0) - counts
    widths = counts.sum(axis=0)
    tokens, total, start = 5, 9, 3
    starts = (np.cumsum(widths * total) - widths * total).astype(np.int64)
    rows = rng.integers(-100, 100, int(counts.sum()) * tokens).astype(np.int8)
    fused = np.zeros(int(widths.sum()) * total, np.int8)
    xquant_kernels.place_block(rows, counts, slots, widths, starts, start, tokens, fused)
    monkeypatch.setattr(xquant_kernels, "AVAILABLE", False)
    plain = np.zeros_like(fused)
    xquant_kernels.place_block(rows, counts, slots, widths, starts, start, tokens, plain)
    assert np.array_equal(fused, plain) and fused.any()


def test_place_block_refuses_segments_that_do_not_fit() -> None:
    """The numba copy moves raw bytes: a layout that does not fit its buffers is refused before any copy."""
    counts = np.array([[2, 3]], dtype=np.int64)
    slots, widths = np.zeros((1, 2), np.int64), counts[0].copy()
    starts = np.array([0, 2 * 4], dtype=np.int64)  # 4 tokens: layer 0 [4, 2], layer 1 [4, 3]
    out = np.zeros(2 * 4 + 3 * 4, np.int8)
    xquant_kernels.place_block(np.ones(5 * 4, np.int8), counts, slots, widths, starts, 0, 4, out)
    assert out.all()
    with pytest.raises(ValueError, match="do not fit"):  # rows of the wrong length
        xquant_kernels.place_block(np.ones(5 * 4 - 1, np.int8), counts, slots, widths, starts, 0, 4, out)
    with pytest.raises(ValueError, match="do not fit"):  # tokens beyond the output
        xquant_kernels.place_block(np.ones(5 * 2, np.int8), counts, slots, widths, starts, 3, 2, out)


@needs_numba
@pytest.mark.parametrize("count", [1, 2, 7, 8, 9, 23, 24, 25, 47, 301])
def test_unpack_kernel_matches_numpy(count: int) -> None:
    """The numba unpack (whole 8-byte words per escape-free group of bytes) equals numpy's, at every group
    boundary, with escapes in and beyond int8 anywhere, streams at odd offsets, and a truncated escape list."""
    from kvshelf.compress import xquant

    rng = np.random.default_rng(count)
    streams, escaped, sizes = [], [], []
    for c, (per, half_range) in enumerate(xquant._SCHEMES):
        size = count + c  # unequal segments: later streams start at unaligned offsets of the rows
        symbols = torch.from_numpy(rng.integers(-half_range, half_range + 1, size).astype(np.int32))
        where = rng.random(size) < 0.1
        symbols[where] = torch.from_numpy(rng.choice([-300, -128, half_range + 1, 127, 1000], int(where.sum()))
                                          .astype(np.int32))
        data, escapes = xquant._pack(symbols, per, half_range)
        streams.append(data)
        escaped.append(escapes.numpy())
        sizes.append(size)
    esc_values = np.concatenate(escaped).astype(np.int32)
    total = sum(sizes)
    fused = xquant._unpack_fused(streams, sizes, 1, esc_values, np.empty(total, np.int8))
    plain = xquant._unpack_numpy(streams, sizes, 1, esc_values, np.empty(total, np.int8))
    for a, b in zip(fused, plain, strict=True):
        assert np.array_equal(a, b)
    if len(esc_values):
        with pytest.raises(CorruptBlockError, match="escape"):
            xquant._unpack_fused(streams, sizes, 1, esc_values[:-1], np.empty(total, np.int8))
