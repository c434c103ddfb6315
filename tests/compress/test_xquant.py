"""``xquant`` on a tiny random Llama: tables, binding, round trips within the documented bound, bad input."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.xquant import bind_xquant, xquant_params, xquant_tables
from kvshelf.compress import get_codec, xquant_kernels
from kvshelf.compress.container import pack_sections, unpack_sections
from kvshelf.compress.xquant import (
    XQuantTables,
    XQuantUnboundError,
    bind_tables,
    bound_tables,
    load_tables,
    save_tables,
    unbind_tables,
)
from kvshelf.kvstore import KVBlock
from kvshelf.kvstore.encoding import decode_block, encode_block
from kvshelf.kvstore.errors import CodecParamError, ConfigError, CorruptBlockError, KVShelfError

EXACT = {"drop_below": 0.0, "max_sinks": 0, "matmul": "fp32"}


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=3, layers=2)
    calibration = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, xquant_params(model, calibration)


def _kv(model, tokens: int, start: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Real KV of the tiny model for ``tokens`` random ids, positions ``start..``."""
    ids = torch.randint(3, 512, (1, start + tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    keys = torch.stack([la.keys[0, :, start:] for la in cache.layers])
    values = torch.stack([la.values[0, :, start:] for la in cache.layers])
    return keys.contiguous(), values.contiguous()


def _round_trip(keys, values, params, start=0, dtype=None):  # noqa: ANN001, ANN202
    dtype = dtype or keys.dtype
    block = KVBlock(keys.to(dtype), values.to(dtype), tuple(range(keys.shape[2])), start, "fp")
    data = encode_block(block, b"k" * 16, "xquant", params)
    back = decode_block(data)
    assert back.keys.dtype == dtype and back.keys.shape == keys.shape and back.values.shape == values.shape
    return back.keys, back.values, data


def _bound(params: dict) -> float:
    """The documented per-token L2 bound of ``[K_pre | V]`` for ``drop_below=0`` (plus float32 slack)."""
    tables = bound_tables(params["model"])
    codec = get_codec("xquant", params)
    steps = codec._plan().steps  # noqa: SLF001
    return math.sqrt(tables.width) * float(steps.max()) / 2 * 1.0001 + 1e-4


def test_tables_are_orthonormal_and_bound(tiny) -> None:  # noqa: ANN001
    model, params = tiny
    tables = bound_tables(params["model"])
    assert (tables.layers, tables.kv_heads, tables.head_dim) == (2, 2, 16)
    eye = torch.eye(tables.width)
    assert torch.allclose(tables.basis.transpose(1, 2) @ tables.basis, eye.expand_as(tables.basis), atol=1e-5)
    assert torch.all(tables.sigma[:, :-1] >= tables.sigma[:, 1:] - 1e-5)  # klt: by decreasing energy
    svd = xquant_tables(model, list(range(3, 200)), basis="svd")
    assert svd.digest != tables.digest
    assert torch.allclose(svd.basis.transpose(1, 2) @ svd.basis, eye.expand_as(svd.basis), atol=1e-5)
    assert bind_xquant(model) == bind_xquant(model)  # cached per model
    with pytest.raises(ConfigError, match="basis"):
        xquant_tables(model, basis="pca")
    with pytest.raises(ConfigError, match="calibration"):
        xquant_tables(model, [5, 6, 7])


@pytest.mark.parametrize("tokens,start", [(1, 0), (7, 0), (64, 0), (33, 300), (256, 1000)])
def test_round_trip_within_bound(tiny, tokens: int, start: int) -> None:  # noqa: ANN001
    model, params = tiny
    keys, values = _kv(model, tokens, start)
    exact = {**params, **EXACT, "step": 0.05}
    k2, v2, _ = _round_trip(keys, values, exact, start)
    # RoPE is a rotation: the per-token error of [K | V] equals that of [K_pre | V]
    err = torch.cat([(k2 - keys).permute(0, 2, 1, 3).flatten(2), (v2 - values).permute(0, 2, 1, 3).flatten(2)], -1)
    assert float(err.norm(dim=-1).max()) <= _bound(exact)
    assert float(err.abs().max()) > 0  # lossy
    # bf16 rematerialization: close to the fp32 one (bf16 rounding of the step-scaled basis, 2**-8 relative)
    k3, v3, _ = _round_trip(keys, values, {**exact, "matmul": "bf16"}, start)
    assert float((k3 - k2).abs().max()) <= 0.05 * float(keys.abs().max()) + 1e-3
    assert float((v3 - v2).abs().max()) <= 0.05 * float(values.abs().max()) + 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_round_trip(tiny, dtype: torch.dtype) -> None:  # noqa: ANN001
    model, params = tiny
    keys, values = _kv(model, 20, 5)
    keys, values = keys.to(dtype).float(), values.to(dtype).float()
    exact = {**params, **EXACT, "step": 0.05}
    k2, v2, _ = _round_trip(keys, values, exact, 5, dtype)
    err = torch.cat([(k2.float() - keys).permute(0, 2, 1, 3).flatten(2),
                     (v2.float() - values).permute(0, 2, 1, 3).flatten(2)], -1)
    norm = torch.cat([keys.permute(0, 2, 1, 3).flatten(2), values.permute(0, 2, 1, 3).flatten(2)], -1).norm(dim=-1)
    rounding = torch.finfo(dtype).eps * (norm + _bound(exact))  # the output dtype's rounding
    assert bool((err.norm(dim=-1) <= _bound(exact) + rounding).all())


def test_default_params_compress_and_stay_close(tiny) -> None:  # noqa: ANN001
    model, params = tiny
    keys, values = _kv(model, 256)
    k2, v2, data = _round_trip(keys, values, {**params, "step": 0.02})  # step is in KV units (tiny KV is small)
    assert len(data) < keys.numel() * 2 * 2 / 3  # well below fp16 even on a random tiny model
    rel = (torch.cat([k2 - keys, v2 - values]).norm() / torch.cat([keys, values]).norm()).item()
    assert rel < 0.2


def test_sink_tokens_are_kept_in_fp16(tiny) -> None:  # noqa: ANN001
    model, params = tiny
    keys, values = _kv(model, 64)
    keys[:, :, 9] *= 40.0
    values[:, :, 9] *= 40.0
    k2, v2, _ = _round_trip(keys, values, {**params, "max_sinks": 2})
    assert torch.equal(k2[:, :, 9], keys[:, :, 9].half().float())
    assert torch.equal(v2[:, :, 9], values[:, :, 9].half().float())


def test_empty_block(tiny) -> None:  # noqa: ANN001
    _, params = tiny
    empty = torch.empty(2, 2, 0, 16)
    k2, v2, _ = _round_trip(empty, empty, params)
    assert k2.shape == (2, 2, 0, 16) and v2.shape == (2, 2, 0, 16)


def test_unbound_tables_are_a_clear_error(tiny) -> None:  # noqa: ANN001
    model, params = tiny
    keys, values = _kv(model, 8)
    block = KVBlock(keys, values, tuple(range(8)), 0, "fp")
    with pytest.raises(XQuantUnboundError, match="not bound") as info:
        encode_block(block, b"k" * 16, "xquant", {})
    assert isinstance(info.value, KVShelfError)
    data = encode_block(block, b"k" * 16, "xquant", params)
    tables = bound_tables(params["model"])
    unbind_tables(params["model"])
    try:
        with pytest.raises(XQuantUnboundError, match=params["model"]):
            decode_block(data)
    finally:
        bind_tables(tables)
    assert decode_block(data).keys.shape == keys.shape


def test_position_free_entry_points_refuse(tiny) -> None:  # noqa: ANN001
    _, params = tiny
    codec = get_codec("xquant", params)
    with pytest.raises(CodecParamError, match="start position"):
        codec.encode(torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16))
    with pytest.raises(CodecParamError, match="start position"):
        codec.decode(memoryview(b""), (2, 2, 3, 16), torch.float32, True)


def test_wrong_geometry_is_named(tiny) -> None:  # noqa: ANN001
    _, params = tiny
    block = KVBlock(torch.zeros(3, 2, 4, 16), torch.zeros(3, 2, 4, 16), (1, 2, 3, 4), 0, "fp")
    with pytest.raises(CodecParamError, match="3 x 2 x 16"):
        encode_block(block, b"k" * 16, "xquant", params)


@pytest.mark.parametrize("params,named", [
    ({"step": 0}, "step"), ({"step": -1.0}, "step"), ({"step": float("nan")}, "step"),
    ({"key_step_scale": 0}, "key_step_scale"), ({"drop_below": -0.1}, "drop_below"),
    ({"max_sinks": 65}, "max_sinks"), ({"max_sinks": 1.5}, "max_sinks"), ({"sink_ratio": 1.0}, "sink_ratio"),
    ({"matmul": "fp8"}, "matmul"), ({"model": 3}, "model"), ({"bits": 2}, "bits"),
])
def test_bad_params_are_named(params: dict, named: str) -> None:
    with pytest.raises(CodecParamError, match=named):
        get_codec("xquant", params)


def _encoded_payload(tiny) -> tuple[dict, bytes, tuple[int, int, int, int]]:  # noqa: ANN001
    """A payload with escaped symbols, some beyond int8 (an outlier token, no sinks to catch it)."""
    model, params = tiny
    params = {**params, "max_sinks": 0, "step": 0.02}
    keys, values = _kv(model, 40)
    keys[:, :, 7] *= 60.0
    codec = get_codec("xquant", params)
    payload = b"".join(bytes(p) for p in codec.encode_at(keys, values, 0))
    prepared = codec.prepare_at(memoryview(payload), tuple(keys.shape), torch.float32, 0)
    assert len(prepared.escapes) > 0  # wide escapes (|symbol| > 127) are kept aside
    return params, payload, tuple(keys.shape)


@pytest.fixture(params=[True, False] if xquant_kernels.AVAILABLE else [False], ids=lambda on: "numba" if on else
                "numpy")
def kernels(request, monkeypatch) -> bool:  # noqa: ANN001
    """Run a test with xquant's numba loops (where numba is installed) and with their numpy / torch fallback."""
    monkeypatch.setattr(xquant_kernels, "AVAILABLE", request.param)
    return request.param


def test_corrupt_payloads_raise(tiny, kernels) -> None:  # noqa: ANN001
    params, payload, shape = _encoded_payload(tiny)
    codec = get_codec("xquant", params)
    for cut in (0, 10, len(payload) // 2, len(payload) - 1):
        with pytest.raises(CorruptBlockError):
            codec.decode_at(memoryview(payload[:cut]), shape, torch.float32, True, 0)
    for pos in (3, 40, len(payload) // 2, len(payload) - 6):
        bad = bytearray(payload)
        bad[pos] ^= 0x5A
        with pytest.raises(CorruptBlockError):
            codec.decode_at(memoryview(bytes(bad)), shape, torch.float32, True, 0)
    with pytest.raises(CorruptBlockError):  # a payload of another block size
        codec.decode_at(memoryview(payload), (shape[0], shape[1], shape[2] + 1, shape[3]), torch.float32, True, 0)


@pytest.mark.parametrize("section,edit", [
    (0, lambda b: struct.pack("<BHHI", 9, *struct.unpack("<BHHI", b)[1:])),  # unknown format
    (0, lambda b: struct.pack("<BHHI", *struct.unpack("<BHHI", b)[:3], 5)),  # escape count
    (0, lambda b: struct.pack("<BHHI", *struct.unpack("<BHHI", b)[:3], 0)),  # escape digits, no values
    (0, lambda b: struct.pack("<BHHI", 1, *struct.unpack("<BHHI", b)[1:])),  # format 1 (component-major)
    (1, lambda b: b[:-2]),  # means
    (3, lambda b: b"\x00" * 9),  # escapes: not zstd
    (5, lambda b: b[:-1]),  # a class stream
])
def test_inconsistent_sections_raise(tiny, kernels, section: int, edit) -> None:  # noqa: ANN001
    params, payload, shape = _encoded_payload(tiny)
    sections = [bytes(s) for s in unpack_sections(memoryview(payload), 8, "xquant")]
    sections[section] = edit(sections[section])
    rebuilt = b"".join(bytes(p) for p in pack_sections(sections))  # valid CRC, inconsistent content
    with pytest.raises(CorruptBlockError):
        get_codec("xquant", params).decode_at(memoryview(rebuilt), shape, torch.float32, True, 0)


def test_tables_save_and_load(tiny, tmp_path) -> None:  # noqa: ANN001
    _, params = tiny
    tables = bound_tables(params["model"])
    path = str(tmp_path / "tables.safetensors")
    save_tables(tables, path)
    loaded = load_tables(path)
    assert loaded.digest == tables.digest and torch.equal(loaded.basis, tables.basis)
    raw = bytearray((tmp_path / "tables.safetensors").read_bytes())
    raw[-5] ^= 0xFF
    (tmp_path / "bad.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ConfigError):
        load_tables(str(tmp_path / "bad.safetensors"))
    with pytest.raises(ConfigError):
        load_tables(str(tmp_path / "missing.safetensors"))
    with pytest.raises(ConfigError, match="do not fit"):
        XQuantTables(tables.basis[:, :4], tables.sigma, tables.inv_freq, 2, 16)


def test_calibration_changes_the_tables(tiny) -> None:  # noqa: ANN001
    model, params = tiny
    assert bind_xquant(model, list(range(3, 300))) != params["model"]


def test_tiered_store_disk_xquant(tiny, tmp_path) -> None:  # noqa: ANN001
    """Memory raw, LMDB xquant: a block written, the store reopened, read back through the disk tier."""
    from helpers import key_of

    from kvshelf.kvstore.embedded import open_embedded_store

    model, params = tiny
    keys, values = _kv(model, 40, 16)
    block = KVBlock(keys, values, tuple(range(40)), 16, "fp")
    exact = {**params, **EXACT, "step": 0.05}
    store = open_embedded_store(tmp_path / "data", disk_codec="xquant", disk_codec_params=exact, durable=False)
    try:
        store.put_many([(key_of(block), block)])
        store.close()
        store = open_embedded_store(tmp_path / "data", memory_bytes=None, disk_codec="xquant",
                                    disk_codec_params=exact, durable=False)
        (back,) = store.get_many([key_of(block)], fingerprint="fp")
    finally:
        store.close()
    assert back is not None and back.start_pos == 16
    err = torch.cat([(back.keys - keys).permute(0, 2, 1, 3).flatten(2),
                     (back.values - values).permute(0, 2, 1, 3).flatten(2)], -1)
    assert float(err.norm(dim=-1).max()) <= _bound(exact)
