"""Codecs: round trips within each codec's documented bound, corruption, parameters, and a tiered store."""

from __future__ import annotations

import math

import pytest
import torch
from codec_bounds import BOUNDS, DTYPES, LOSSLESS_BOUND, bound_of, case, check_round_trip, error_bound
from helpers import FINGERPRINT, key_of, make_block
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshelf.compress import available_codecs, get_codec
from kvshelf.compress.sparse import compact_block, kept_mask, mark_dropped
from kvshelf.kvstore import KVBlock
from kvshelf.kvstore.encoding import decode_block, encode_block
from kvshelf.kvstore.errors import CodecParamError, CorruptBlockError

#: the registry itself: every codec registered, built in or added later, goes through every generic test below
CODECS = available_codecs()


def test_every_codec_has_a_bound() -> None:
    missing = sorted(set(CODECS) - set(BOUNDS))
    assert not missing, f"registered codecs without a round-trip bound: {missing}; add them to BOUNDS in " \
                        "tests/support/codec_bounds.py"
    stale = sorted(set(BOUNDS) - set(CODECS))
    assert not stale, f"BOUNDS names codecs that are not registered: {stale}"
    assert {"raw", "zstd"} <= {n for n in CODECS if bound_of(n) == LOSSLESS_BOUND}


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 33, 256])
def test_round_trip(name: str, dtype: torch.dtype, tokens: int) -> None:
    check_round_trip(name, case(name).block(tokens, layers=3, heads=2, head_dim=16, dtype=dtype))


@pytest.mark.parametrize("name", CODECS)
def test_round_trip_gqa_layouts(name: str) -> None:
    """Any layout, or the one of the model a codec is bound to."""
    c = case(name)
    layouts = ((1, 8), (3, 64), (8, 4)) if c.layout is None else (c.layout[1:],)
    for heads, dim in layouts:
        check_round_trip(name, c.block(19, layers=2, heads=heads, head_dim=dim))


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("group", [1, 5, 32, 1000])
def test_kivi_group_sizes(name: str, group: int) -> None:
    check_round_trip(name, make_block(37, layers=2, heads=3, head_dim=8), {"group_size": group})


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize(("heads", "dim", "group", "tokens"), [
    (4, 16, 32, 64),  # value groups of two whole heads, key groups tile the tokens: dequantized in place
    (2, 64, 32, 64),  # value groups inside a head
    (3, 64, 128, 64),  # value groups across an odd number of heads: the transposing path
    (2, 8, 16, 40),  # a partial key group: the transposing path for keys
])
def test_kivi_group_layouts(name: str, heads: int, dim: int, group: int, tokens: int) -> None:
    check_round_trip(name, make_block(tokens, layers=2, heads=heads, head_dim=dim), {"group_size": group})
    block = make_block(tokens, layers=2, heads=heads, head_dim=dim, dtype=torch.bfloat16)
    check_round_trip(name, block, {"group_size": group})


@pytest.mark.parametrize("params", [{"bits": 2, "early_extra_bits": 0}, {"bits": 6, "early_extra_bits": 2},
                                    {"group_size": 2, "early_fraction": 1.0}, {"bits": 1, "early_fraction": 0.0},
                                    {"rotate": True}, {"rotate": True, "bits": 7, "early_extra_bits": 1},
                                    {"bits": 3.25, "key_extra_bits": 1}, {"sink_ratio": 0},
                                    {"group_size": 1000}])
def test_cachegen_settings(params: dict) -> None:
    check_round_trip("cachegen", make_block(41, layers=4, heads=2, head_dim=8), params)


@pytest.mark.parametrize("tokens", [256, 251, 40])  # whole groups of 16, then a partial last group
def test_cachegen_uses_deltas_on_smooth_channels(tokens: int) -> None:
    """Slowly drifting channels code as anchors + deltas, and are smaller than the same quantization packed."""
    from kvshelf.compress.container import unpack_sections

    t = torch.arange(tokens, dtype=torch.float32)
    keys = (torch.sin(t / 300)[None, None, :, None] * torch.linspace(1, 3, 16)).expand(2, 2, tokens, 16).contiguous()
    block = KVBlock(keys, keys.clone() * 0.5, tuple(range(tokens)), 0, FINGERPRINT)
    check_round_trip("cachegen", block)
    codec = get_codec("cachegen", {"early_extra_bits": 0, "rotate": False, "sink_ratio": 0})
    payload = memoryview(b"".join(bytes(p) for p in codec.encode(block.keys, block.values)))
    if tokens >= 64:  # beyond the fixed per-channel overhead: smaller than 4-bit packing
        assert len(payload) < 0.8 * block.keys.numel() * 2 * 4 / 8
    flags = unpack_sections(payload, 16, "cachegen")[2]  # the per-channel delta flags
    assert any(flags)


def test_cachegen_beats_packed_int4_on_gaussian_outliers() -> None:
    """On Gaussian KV with outlier tokens, cachegen is smaller than int4 and more accurate at the same time."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn((4, 2, 256, 32), generator=gen)
    keys[:, :, ::50] *= 4  # outliers stretch int4's min/max ranges, as in real KV
    block = KVBlock(keys, keys.flip(2).clone(), tuple(range(256)), 0, FINGERPRINT)
    sizes, errors = {}, {}
    for name, params in (("cachegen", {"bits": 3, "early_extra_bits": 0}), ("int4", {"group_size": 256})):
        data = encode_block(block, key_of(block), name, params)
        back = decode_block(data)
        sizes[name] = len(data)
        errors[name] = float((back.keys - block.keys).pow(2).mean() + (back.values - block.values).pow(2).mean())
    assert sizes["cachegen"] < 0.9 * sizes["int4"]
    assert errors["cachegen"] < errors["int4"]


def _cachegen_sections(block: KVBlock, params: dict) -> list:
    from kvshelf.compress.container import unpack_sections

    codec = get_codec("cachegen", params)
    payload = memoryview(b"".join(bytes(p) for p in codec.encode(block.keys, block.values)))
    return unpack_sections(payload, 16, "cachegen")


def test_cachegen_wide_escapes() -> None:
    """Escapes far apart (index gap >= 65535) and far out (coarse part beyond int8) take their wide forms."""
    gen = torch.Generator().manual_seed(11)
    keys = torch.rand((2, 1, 1100, 64), generator=gen) * 2 - 1  # bounded: no escapes but the two below
    values = torch.rand((2, 1, 1100, 64), generator=gen) * 2 - 1
    keys[0, 0, 0, 0] = 3e4
    values[1, 0, -1, -1] = -3e4
    block = KVBlock(keys, values, tuple(range(1100)), 0, FINGERPRINT)
    params = {"bits": 3.5, "sink_ratio": 0}
    check_round_trip("cachegen", block, params)
    parts = _cachegen_sections(block, params)
    assert len(parts[14]) == 4 and len(parts[15]) == 8  # one uint32 gap, two int32 coarse parts
    back = decode_block(encode_block(block, key_of(block), "cachegen", params))
    assert abs(float(back.keys[0, 0, 0, 0]) - 3e4) < 1e-3 * 3e4
    assert abs(float(back.values[1, 0, -1, -1]) + 3e4) < 1e-3 * 3e4


@pytest.mark.parametrize(("section", "edit"), [
    (0, lambda b: b"\x02"),  # the previous payload format
    (9, lambda b: b"\xfe\xff" + b[2:]),  # the first escape's index gap pushes the last one past the block
    (10, lambda b: b[:1] + b"\x01" + b[2:]),  # an escape whose coarse part would not need one
    (14, lambda b: b + b"\0\0\0\0"),  # a wide gap too many
    (15, lambda b: b[:-4]),  # a wide coarse part too few
    (8, lambda b: b[:-1]),  # sign bits too few
    (11, lambda b: b + b"\0\0"),  # an escaped flag word too many
])
def test_cachegen_inconsistent_sections_raise(section: int, edit) -> None:  # noqa: ANN001
    """Well-framed payloads (valid CRC) whose sections disagree raise CorruptBlockError, never garbage."""
    from kvshelf.compress.container import pack_sections

    gen = torch.Generator().manual_seed(11)
    keys = torch.rand((2, 1, 1100, 64), generator=gen) * 2 - 1
    values = torch.randn((2, 1, 1100, 64), generator=gen)
    keys[0, 0, 0, 0], values[1, 0, -1, -1] = 3e4, -3e4
    parts = [bytes(p) for p in _cachegen_sections(KVBlock(keys, values, tuple(range(1100)), 0, FINGERPRINT),
                                                  {"sink_ratio": 0})]
    parts[section] = edit(parts[section])
    payload = memoryview(b"".join(bytes(p) for p in pack_sections(parts)))
    with pytest.raises(CorruptBlockError):
        get_codec("cachegen").decode(payload, (2, 1, 1100, 64), torch.float32, True)


def test_cachegen_mixed_fine_widths() -> None:
    """Streams with different fine widths, some beyond 6 bits (int16 symbols), decode within the bound."""
    block = make_block(300, layers=4, heads=2, head_dim=16, seed=9)
    params = {"bits": 7, "early_extra_bits": 1, "early_fraction": 0.25, "sink_ratio": 0}
    check_round_trip("cachegen", block, params)
    widths = set(bytes(_cachegen_sections(block, params)[1]))
    assert len(widths) >= 2 and max(widths) >= 7


def test_cachegen_rotation_error_is_bounded_in_l2() -> None:
    """With the Hadamard rotation each (layer, head, token) vector is within sqrt(head_dim) * step / 2 in L2."""
    block = make_block(40, layers=2, heads=2, head_dim=16, seed=5)
    codec = get_codec("cachegen", {"bits": 2, "rotate": True})
    back = decode_block(encode_block(block, key_of(block), "cachegen", {"bits": 2, "rotate": True}))
    bound = codec.steps(block.keys, block.values) / 2 * 4 * (1 + 2**-9) + 1e-5  # sqrt(16) = 4
    for n, (got, want) in enumerate(((back.keys, block.keys), (back.values, block.values))):
        err = (got - want).norm(dim=-1)  # [layers, heads, tokens]
        assert bool((err <= bound[n][:, None, None]).all())


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=6, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 4),
    tokens=st.integers(1, 70),
    dim=st.sampled_from([1, 2, 8, 24]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    start=st.integers(0, 5000),
)
def test_round_trip_property(name, layers, heads, tokens, dim, dtype, seed, start) -> None:  # noqa: ANN001
    block = case(name).block(tokens, layers=layers, heads=heads, head_dim=dim, dtype=dtype, seed=seed,
                             start_pos=start)
    check_round_trip(name, block)


def _layout(name: str, default: tuple[int, int, int] = (2, 2, 4)) -> tuple[int, int, int]:
    return case(name).layout or default


@pytest.mark.parametrize("name", CODECS)
def test_constant_and_zero_blocks(name: str) -> None:
    layers, heads, dim = _layout(name)
    for fill in (0.0, 3.5, -1e4):
        keys = torch.full((layers, heads, 9, dim), fill)
        block = KVBlock(keys, keys.clone(), tuple(range(9)), 0, FINGERPRINT)
        check_round_trip(name, block)


@pytest.mark.parametrize("name", CODECS)
def test_empty_block_round_trips(name: str) -> None:
    layers, heads, dim = _layout(name)
    block = KVBlock(torch.zeros(layers, heads, 0, dim), torch.zeros(layers, heads, 0, dim), (), 0, FINGERPRINT)
    back = decode_block(encode_block(block, key_of(block), name, case(name).params))
    assert back.keys.shape == (layers, heads, 0, dim)


# -- sparse -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["raw", "fp16", "int8", "cachegen"])
def test_sparse_keeps_marked_tokens(inner: str) -> None:
    block = make_block(50, layers=2, heads=3, head_dim=8, start_pos=100)
    kept = [0, 1, 2, 3, 17, 30, 49]
    sparse = mark_dropped(block, kept)
    assert kept_mask(sparse.keys).nonzero().flatten().tolist() == kept
    data = encode_block(sparse, key_of(sparse), "sparse", {"inner": inner})
    assert len(data) < len(encode_block(block, key_of(block), inner))
    back = decode_block(data)
    assert back.keys.shape == block.keys.shape
    assert kept_mask(back.keys).nonzero().flatten().tolist() == kept
    assert torch.isnan(back.values[:, :, 5]).all()
    compact = compact_block(back)
    assert compact.num_tokens == len(kept)
    assert compact.extra["positions"] == ",".join(str(100 + i) for i in kept)
    assert compact.token_ids == tuple(block.token_ids[i] for i in kept)
    tol = {"raw": 0.0, "fp16": 0.01, "int8": 0.05}.get(inner, 0.3)
    assert torch.allclose(compact.keys, block.keys[:, :, kept], atol=tol, rtol=0.02)


def test_sparse_zero_fill_and_all_dropped() -> None:
    block = make_block(8)
    back = decode_block(encode_block(mark_dropped(block, [2]), key_of(block), "sparse", {"fill": "zero"}))
    assert back.keys[:, :, 0].abs().sum() == 0 and torch.equal(back.keys[:, :, 2], block.keys[:, :, 2].half().float())
    none = decode_block(encode_block(mark_dropped(block, []), key_of(block), "sparse"))
    assert torch.isnan(none.keys).all()


# -- corruption -------------------------------------------------------------------------------------------------


START = 40  # blocks of the corruption tests start here (codecs given the position use it)


def _payload(name: str, block: KVBlock) -> tuple[memoryview, object]:
    codec = get_codec(name, case(name).params)
    src = mark_dropped(block, list(range(0, block.num_tokens, 2))) if name == "sparse" else block
    return memoryview(b"".join(bytes(p) for p in codec.encode_at(src.keys, src.values, block.start_pos))), codec


def _decode(codec, payload: memoryview, shape: tuple, block: KVBlock) -> None:  # noqa: ANN001
    codec.decode_at(payload, shape, block.dtype, True, block.start_pos)


#: codecs whose payload has no room for a check: every byte string of the right length is a valid block
UNCHECKED = {n for n in CODECS if n == "raw"}


@pytest.mark.parametrize("name", sorted(set(CODECS) - UNCHECKED))
def test_flipped_bytes_raise(name: str) -> None:
    block = case(name).block(21, layers=2, heads=2, head_dim=8, start_pos=START)
    payload, codec = _payload(name, block)
    shape = tuple(block.keys.shape)
    for pos in sorted({0, 3, 9, len(payload) // 3, len(payload) // 2, len(payload) - 5, len(payload) - 1}):
        damaged = bytearray(payload)
        damaged[pos] ^= 0x5A
        with pytest.raises(CorruptBlockError):
            _decode(codec, memoryview(bytes(damaged)), shape, block)


@pytest.mark.parametrize("name", CODECS)
def test_truncated_payloads_raise(name: str) -> None:
    block = case(name).block(21, layers=2, heads=2, head_dim=8, start_pos=START)
    payload, codec = _payload(name, block)
    shape = tuple(block.keys.shape)
    for cut in (0, 1, len(payload) // 2, len(payload) - 1):
        with pytest.raises(CorruptBlockError):
            _decode(codec, payload[:cut], shape, block)
    with pytest.raises(CorruptBlockError):
        _decode(codec, memoryview(bytes(payload) + b"\0"), shape, block)


@pytest.mark.parametrize("name", sorted(set(CODECS) - UNCHECKED))
def test_wrong_shape_raises(name: str) -> None:
    block = case(name).block(21, layers=2, heads=2, head_dim=8, start_pos=START)
    payload, codec = _payload(name, block)
    layers, heads, tokens, dim = block.keys.shape
    with pytest.raises(CorruptBlockError):
        _decode(codec, payload, (layers, heads, tokens + 1, dim), block)


@pytest.mark.parametrize("name", CODECS)
def test_corrupt_encoded_block_raises(name: str) -> None:
    block = case(name).block(13, layers=2, heads=2, head_dim=8)
    src = mark_dropped(block, [0, 5]) if name == "sparse" else block
    data = encode_block(src, key_of(block), name, case(name).params)
    damaged = bytearray(data)
    damaged[len(data) - 20] ^= 0xFF
    with pytest.raises(CorruptBlockError):
        decode_block(bytes(damaged))
    with pytest.raises(CorruptBlockError):
        decode_block(data[:-30])


# -- parameters -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "named"),
    [
        ("int4", {"group": 32}, "group"),
        ("int8", {"bits": 4}, "bits"),
        ("zstd", {"levle": 3}, "levle"),
        ("cachegen", {"anchors": 2}, "anchors"),
        ("sparse", {"keep": [1]}, "keep"),
        ("fp16", {"x": 1}, "x"),
    ],
)
def test_unknown_params_are_named(name: str, params: dict, named: str) -> None:
    with pytest.raises(CodecParamError, match=named):
        get_codec(name, params)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("int4", {"group_size": 0}),
        ("int2", {"group_size": "32"}),
        ("zstd", {"level": 99}),
        ("cachegen", {"bits": 0}),
        ("cachegen", {"bits": 7, "early_extra_bits": 2}),
        ("cachegen", {"early_fraction": 1.5}),
        ("cachegen", {"rotate": 1}),
        ("cachegen", {"sink_ratio": 1.0}),
        ("sparse", {"inner": "nope"}),
        ("sparse", {"inner": "int4", "inner_params": {"bogus": 1}}),
        ("sparse", {"fill": "ones"}),
    ],
)
def test_invalid_params_raise(name: str, params: dict) -> None:
    with pytest.raises(CodecParamError, match=next(iter(params))):
        get_codec(name, params)


# -- through the store ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("disk_codec", ["int8", "cachegen", "zstd"])
def test_tiered_store_memory_raw_disk_compressed(tmp_path, disk_codec: str) -> None:  # noqa: ANN001
    from kvshelf.kvstore.embedded import open_embedded_store

    blocks = [make_block(n + 5, layers=2, heads=2, head_dim=16, start_pos=n) for n in range(3)]
    store = open_embedded_store(tmp_path / "data", disk_codec=disk_codec, durable=False)
    try:
        store.put_many([(key_of(b), b) for b in blocks])
        store.close()
        store = open_embedded_store(tmp_path / "data", memory_bytes=None, disk_codec=disk_codec, durable=False)
        got = store.get_many([key_of(b) for b in blocks], fingerprint=FINGERPRINT)
        for block, back in zip(blocks, got, strict=True):
            assert back is not None and back.token_ids == block.token_ids
            if disk_codec == "cachegen":  # within its documented bound
                kb, vb = error_bound("cachegen", get_codec("cachegen"), block.keys, block.values)
                assert bool(((back.keys - block.keys).abs() <= kb + 1e-5).all())
                assert bool(((back.values - block.values).abs() <= vb + 1e-5).all())
                continue
            tol = {"zstd": 0.0, "int8": 0.05}[disk_codec]
            assert torch.allclose(back.keys, block.keys, atol=tol) and torch.allclose(back.values, block.values,
                                                                                       atol=tol)
    finally:
        store.close()
    assert math.isfinite(float(blocks[0].keys.sum()))


@pytest.mark.parametrize("codec", ["int8", "int4", "fp16", "bf16"])
def test_a_verified_payload_skips_only_the_inner_crc(codec: str) -> None:
    """``prepare_at(verified=True)`` (the block's xxh3 already covered the bytes) does not compute the container's
    CRC again, but still checks the framing and lengths; unverified, a changed byte is caught by the CRC; through
    ``prepare_block`` the block checksum catches it first."""
    from helpers import key_of, make_block

    from kvshelf.kvstore.codec import get_codec
    from kvshelf.kvstore.encoding import encode_block, prepare_block
    from kvshelf.kvstore.errors import CorruptBlockError

    block = make_block(16, seed=5)
    c = get_codec(codec)
    payload = bytearray(b"".join(bytes(p) for p in c.encode(block.keys, block.values)))
    payload[len(payload) // 2] ^= 0xFF  # inside a section, away from the frame
    shape = tuple(block.keys.shape)
    with pytest.raises(CorruptBlockError, match="checksum"):
        c.prepare_at(memoryview(bytes(payload)), shape, block.dtype, 0)
    c.prepare_at(memoryview(bytes(payload)), shape, block.dtype, 0, verified=True)  # no CRC pass
    with pytest.raises(CorruptBlockError):  # the framing is still checked
        c.prepare_at(memoryview(bytes(payload[:-9])), shape, block.dtype, 0, verified=True)
    encoded = bytearray(encode_block(block, key_of(block), codec))
    encoded[len(encoded) // 2] ^= 0xFF
    with pytest.raises(CorruptBlockError):
        prepare_block(bytes(encoded))
