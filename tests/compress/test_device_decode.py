"""The codecs' portable decode path (the one a CUDA destination takes), run on the CPU: it must give the tensors of
the CPU path, for KIVI bit for bit, for xquant bit for bit against its torch epilogue; and ``bench.gpu_decode``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import FINGERPRINT, key_of, token_ids
from xquant_tables import random_xquant_tables

from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.xquant import xquant_params
from kvshelf.bench.gpu_decode import decode_rates
from kvshelf.compress import device, get_codec, kivi, xquant, xquant_kernels
from kvshelf.compress.bitpack import pack_bits, unpack_bits
from kvshelf.kvstore import KVBlock
from kvshelf.kvstore.codec import BlockShape
from kvshelf.kvstore.encoding import encode_block, prepare_block

FILL = -1000.0  # the destination's margin: neither path may write it (no decoded value is this)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [1, 7, 64, 333])
def test_unpack_bits_matches_the_host_unpack(bits: int, count: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, count), generator=torch.Generator().manual_seed(count), dtype=torch.uint8)
    packed = [pack_bits(row, bits) for row in codes]
    batched = torch.stack([torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in packed])
    got = device.unpack_bits(batched, count, bits)
    assert got.shape == (3, count) and got.dtype == torch.uint8
    for row, p, want in zip(got, packed, codes, strict=True):
        assert torch.equal(row, unpack_bits(p, count, bits)) and torch.equal(row, want)


def test_upload_aligns_and_concatenates_parts() -> None:
    halves = np.arange(5, dtype=np.float16)
    sent = device.upload([b"abc", [b"de", b"f"], halves, torch.arange(3, dtype=torch.int64)], "cpu", slot=3)
    assert [bytes(t.numpy()) for t in sent[:2]] == [b"abc", b"def"]
    assert torch.equal(device.typed(sent[2], torch.float16, (5,)), torch.from_numpy(halves))
    assert torch.equal(device.typed(sent[3], torch.int64, (3,)), torch.arange(3))
    assert device.typed(device.upload([b""], "cpu")[0], torch.float32, (0, 4)).shape == (0, 4)


def _kivi_run(name: str, group_size: int, dtype: torch.dtype, vdim: int, sizes: list[int], seed: int = 0):  # noqa: ANN202
    """Prepared KIVI blocks of 2 layers x 3 heads x 16 (values ``vdim``), and their original KV (concatenated)."""
    codec = get_codec(name, {"group_size": group_size})
    generator = torch.Generator().manual_seed(seed)
    prepared, keys, values = [], [], []
    for tokens in sizes:
        k = (torch.randn(2, 3, tokens, 16, generator=generator) * 3).to(dtype)
        v = torch.randn(2, 3, tokens, vdim, generator=generator).to(dtype)
        payload = memoryview(b"".join(bytes(p) for p in codec.encode(k, v)))
        prepared.append(codec.prepare_at(payload, BlockShape((2, 3, tokens, 16), vdim), dtype, 0))
        keys.append(k)
        values.append(v)
    return prepared, torch.cat(keys, dim=2), torch.cat(values, dim=2)


def _destinations(shape: tuple[int, ...], vdim: int, dtype: torch.dtype, margin: int = 5):  # noqa: ANN202
    """A larger cache filled with ``FILL`` and its ``[..., margin:margin + tokens, ...]`` slices (strided views)."""
    layers, heads, tokens, dim = shape
    k = torch.full((layers, heads, tokens + 2 * margin, dim), FILL, dtype=dtype)
    v = torch.full((layers, heads, tokens + 2 * margin, vdim), FILL, dtype=dtype)
    return (k, v), (k[:, :, margin : margin + tokens], v[:, :, margin : margin + tokens])


@pytest.mark.parametrize("name,group_size", [("int8", 128), ("int4", 32), ("int2", 32), ("int4", 8), ("int4", 5),
                                             ("int2", 48), ("int8", 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vdim", [16, 12])
def test_kivi_portable_path_is_bit_identical(name: str, group_size: int, dtype: torch.dtype, vdim: int) -> None:
    """Runs of blocks of odd token counts (batched where shapes repeat), strided destinations, MLA-like value head
    dims, every group layout (a partial last group; value groups within a head, of whole heads, across heads)."""
    sizes = [7, 7, 64, 3, 3, 1]
    prepared, keys, values = _kivi_run(name, group_size, dtype, vdim, sizes)
    (k_ref, v_ref), (k_ref_view, v_ref_view) = _destinations(keys.shape, vdim, dtype)
    (k_got, v_got), (k_got_view, v_got_view) = _destinations(keys.shape, vdim, dtype)
    kivi.KiviPayload.write_run(prepared, k_ref_view, v_ref_view)
    kivi.KiviPayload.write_run(prepared, k_got_view, v_got_view, prefer_portable=True)
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)
    assert bool((k_got[:, :, :5] == FILL).all()) and bool((v_got[:, :, -5:] == FILL).all())  # margins untouched
    # and it is the block, not a copy of some constant: within KIVI's bound of the original
    levels = (1 << prepared[0].codec.bits) - 1
    assert float((k_got_view.float() - keys.float()).abs().max()) <= 2 * 3 * 8 / levels + 0.1
    assert float((v_got_view.float() - values.float()).abs().max()) <= 2 * 8 / levels + 0.1


def test_kivi_portable_single_write_and_lazy_host_unpack(monkeypatch) -> None:  # noqa: ANN001
    """``write`` of one block takes the portable path for a destination off the CPU (here: asked for), and the CPU
    path unpacks lazily where ``prepare_at`` did not (a CUDA machine): the same tensors either way."""
    monkeypatch.setattr(kivi, "eager_host_unpack", lambda: False)
    prepared, keys, _ = _kivi_run("int4", 32, torch.bfloat16, 16, [33])
    assert prepared[0]._host is None  # noqa: SLF001 - nothing unpacked on the host yet
    ref = torch.empty_like(keys), torch.empty_like(keys)
    prepared[0].write(*ref)
    assert prepared[0]._host is not None  # noqa: SLF001
    got = torch.empty_like(keys), torch.empty_like(keys)
    monkeypatch.setattr(kivi, "portable", lambda out, prefer=False: True)
    prepared[0].write(*got)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_kivi_portable_batches_are_cut_at_the_staging_size(monkeypatch) -> None:  # noqa: ANN001
    prepared, keys, values = _kivi_run("int8", 16, torch.float32, 16, [32] * 6)
    size = sum(len(b) for section in prepared[0].sections for b in section)
    monkeypatch.setattr(kivi, "STAGING_BYTES", 2 * size)
    assert [len(b) for b in kivi._batches(prepared)] == [2, 2, 2]  # noqa: SLF001
    ref = torch.empty_like(keys), torch.empty_like(values)
    kivi.KiviPayload.write_run(prepared, *ref)
    got = torch.empty_like(keys), torch.empty_like(values)
    kivi.KiviPayload.write_run(prepared, *got, prefer_portable=True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


# ---------------------------------------------------------------------------------------------------- xquant
@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=5, layers=3)
    return model, xquant_params(model, token_ids(600, seed=2))


def _xquant_blocks(model, sizes: list[int], outlier: bool) -> list[KVBlock]:  # noqa: ANN001
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


def _xquant_write(encoded: list[bytes], dtype: torch.dtype, portable: bool, margin: int = 3):  # noqa: ANN202
    payloads = [prepare_block(e).payload for e in encoded]
    layers, heads, _, dim = payloads[0].shape
    total = sum(p.num_tokens for p in payloads)
    (k, v), (k_view, v_view) = _destinations((layers, heads, total, dim), dim, dtype, margin)
    xquant.XQuantPayload.write_run(payloads, k_view, v_view, prefer_portable=portable)
    return k, v


@pytest.mark.parametrize("sizes", [[64, 64, 33], [1], [7, 1, 9], [20]])
@pytest.mark.parametrize("params", [{}, {"max_sinks": 0, "step": 0.02}])
@pytest.mark.parametrize("matmul", ["int8", "bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xquant_portable_path_is_bit_identical(tiny, monkeypatch, sizes: list[int], params: dict, matmul: str,
                                               dtype: torch.dtype) -> None:
    """Against the CPU path's torch epilogue (numba off): the same tensors, sinks and wide escapes included, for
    runs of blocks of odd token counts (and fewer than ``torch._int_mm``'s 17 rows) in strided destinations."""
    model, bound = tiny
    blocks = _xquant_blocks(model, sizes, outlier=True)  # a sink, or wide escapes where sinks are off
    encoded = [encode_block(b, key_of(b), "xquant", {**bound, **params, "matmul": matmul}) for b in blocks]
    if params and sum(sizes) > 4:
        assert any(len(prepare_block(e).payload.escapes) for e in encoded)  # wide escapes exercised
    if not params and sum(sizes) > 4:
        assert any(len(prepare_block(e).payload.sinks) for e in encoded)  # sinks exercised
    got = _xquant_write(encoded, dtype, portable=True)
    monkeypatch.setattr(xquant_kernels, "AVAILABLE", False)
    ref = _xquant_write(encoded, dtype, portable=False)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
        assert bool((a[:, :, :3] == FILL).all()) and not bool((a[:, :, 3:-3] == FILL).any())
    original = torch.cat([b.keys for b in blocks], dim=2)
    assert float((got[0][:, :, 3:-3].float() - original).abs().max()) < 0.5 * float(original.abs().max())


@pytest.mark.skipif(not xquant_kernels.AVAILABLE, reason="numba is not available here")
def test_xquant_portable_path_is_close_to_the_numba_epilogue(tiny) -> None:  # noqa: ANN001
    """A contiguous float32 destination: the CPU path's fused numba epilogue (fastmath), within its own tests'
    tolerance of the portable path."""
    model, bound = tiny
    blocks = _xquant_blocks(model, [64, 30], outlier=False)
    encoded = [encode_block(b, key_of(b), "xquant", bound) for b in blocks]
    got = _xquant_write(encoded, torch.float32, portable=True, margin=0)
    ref = _xquant_write(encoded, torch.float32, portable=False, margin=0)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_xquant_layer_chunks_and_device_constants(tiny, monkeypatch) -> None:  # noqa: ANN001
    """Layers cut into chunks (one per layer here) give the same tensors; the plan's constants are sent once."""
    model, bound = tiny
    encoded = [encode_block(b, key_of(b), "xquant", bound) for b in _xquant_blocks(model, [40, 9], outlier=False)]
    whole = _xquant_write(encoded, torch.float32, portable=True)
    plan = get_codec("xquant", bound)._plan()  # noqa: SLF001
    constants = plan.on_device[("cpu", "int8")]
    monkeypatch.setattr(xquant, "EPILOGUE_ELEMENTS", 1)
    assert xquant._layer_chunks(plan, 49, 64) == [1, 2, 3]  # noqa: SLF001
    cut = _xquant_write(encoded, torch.float32, portable=True)
    assert torch.equal(cut[0], whole[0]) and torch.equal(cut[1], whole[1])
    assert plan.on_device[("cpu", "int8")] is constants


@pytest.mark.parametrize("tokens,kept,width_c", [(5, 13, 64), (17, 16, 64), (40, 3, 12), (16, 24, 36)])
def test_int_mm_padding_for_cuda_is_exact(tokens: int, kept: int, width_c: int) -> None:
    """The padding that fits ``torch._int_mm``'s CUDA shape rules leaves the int32 product unchanged."""
    generator = torch.Generator().manual_seed(tokens)
    symbols = torch.randint(-127, 128, (tokens, kept), generator=generator, dtype=torch.int8)
    matrix = torch.randint(-127, 128, (kept + 3, width_c), generator=generator, dtype=torch.int8)
    rows, cols = -(-(kept + 3) // 8) * 8, -(-width_c // 8) * 8
    padded = torch.nn.functional.pad(matrix, (0, cols - width_c, 0, rows - kept - 3))
    want = symbols.int() @ matrix[:kept].int()
    got = xquant._int_mm(symbols, padded, kept, width_c, pad=True)  # noqa: SLF001
    assert got.dtype == torch.int32 and torch.equal(got, want)


# ----------------------------------------------------------------------------------------- bench.gpu_decode
def test_decode_rates_on_the_cpu() -> None:
    shape = {"layers": 2, "kv_heads": 2, "head_dim": 16, "tokens": 70, "block_tokens": 32, "runs": 2}
    codecs = [("raw", {}), ("int8", {}), ("int4", {"group_size": 16}), ("xquant", {"step": 0.35})]
    rows = decode_rates("cpu", codecs, **shape)
    assert [r["codec"] for r in rows] == ["raw", "int8", "int4", "xquant"]
    assert "model" in rows[3]["skipped"] and "decode_s" not in rows[3]
    decoded = 2 * 2 * 2 * 70 * 16 * 2  # keys and values, bf16
    for row in rows[:3]:
        assert set(row) == {"codec", "params", "device", "decoded_bytes", "encoded_bytes", "decode_s", "decode_gb_s",
                            "prepare_s"}
        assert row["device"] == "cpu" and row["decoded_bytes"] == decoded and row["decode_s"] > row["prepare_s"] > 0
        assert row["decode_gb_s"] == pytest.approx(decoded / row["decode_s"] / 1e9)
    assert rows[0]["encoded_bytes"] == decoded > rows[1]["encoded_bytes"] > rows[2]["encoded_bytes"]
    assert rows[2]["params"] == {"group_size": 16}
    tables = random_xquant_tables(2, 2, 16)
    (row,) = decode_rates("cpu", [("xquant", {"step": 0.35})], model=tables, **shape)
    assert row["decode_s"] > 0 and row["encoded_bytes"] < decoded and row["params"] == {"step": 0.35}
    (row,) = decode_rates("cpu", [("xquant", {})], model=tables, **{**shape, "layers": 3})
    assert "2 layers" in row["skipped"]


def test_staging_buffers_made_in_inference_mode_are_written_outside_it() -> None:
    """A generator's first load can run under ``torch.inference_mode`` (``generate``), a later one outside it
    (``load_prefix``): the thread's kept staging buffer must take both (an inference tensor refuses in-place
    writes outside inference mode)."""
    from kvshelf.compress import device as staging

    big = np.arange(staging._THREADED_COPY + 64, dtype=np.int64).view(np.uint8)  # the threaded-copy branch too
    with torch.inference_mode():
        (inside,) = staging.upload([big], "cpu", slot=1)
        assert torch.equal(inside, torch.from_numpy(big))
    (outside,) = staging.upload([big[::-1].copy()], "cpu", slot=1)
    assert torch.equal(outside, torch.from_numpy(big[::-1].copy()))
