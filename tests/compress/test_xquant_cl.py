"""``xquant`` with ``cross_layer=True`` (XQuant-CL) on a tiny random Llama: tables, round trips within the documented
bound, the registry, and damaged or foreign payloads refused."""

from __future__ import annotations

import math

import pytest
import torch

from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.xquant import xquant_cl_tables, xquant_params
from kvshelf.compress import get_codec
from kvshelf.compress.container import pack_sections, unpack_sections
from kvshelf.compress.xquant import XQuantCodec, XQuantUnboundError, bound_tables, save_tables
from kvshelf.compress.xquant_cl import (
    FORMAT,
    XQuantCLTables,
    bind_cl_tables,
    bound_cl_tables,
    load_cl_tables,
    save_cl_tables,
    unbind_cl_tables,
)
from kvshelf.kvstore import KVBlock
from kvshelf.kvstore.codec import available_codecs
from kvshelf.kvstore.encoding import decode_block, encode_block
from kvshelf.kvstore.errors import CodecParamError, ConfigError, CorruptBlockError

EXACT = {"drop_below": 0.0, "max_sinks": 0}
CALIBRATION = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=3, layers=3)
    return model, xquant_params(model, CALIBRATION, cross_layer=True)


def _kv(model, tokens: int, start: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Real KV of the tiny model for ``tokens`` random ids, positions ``start..``: ``[layers, heads, tokens, dim]``."""
    ids = torch.randint(3, 512, (1, start + tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    keys = torch.stack([la.keys[0, :, start:] for la in cache.layers])
    values = torch.stack([la.values[0, :, start:] for la in cache.layers])
    return keys.contiguous(), values.contiguous()


def _encode(keys, values, params, start=0):  # noqa: ANN001, ANN202
    block = KVBlock(keys, values, tuple(range(keys.shape[2])), start, "fp")
    return encode_block(block, b"k" * 16, "xquant", params)


def _token_error(k2, v2, keys, values) -> torch.Tensor:  # noqa: ANN001
    """Per-token L2 error of ``[K | V]`` (RoPE is a rotation: equal to that of ``[K_pre | V]``)."""
    return torch.cat([(k2 - keys).permute(0, 2, 1, 3).flatten(2), (v2 - values).permute(0, 2, 1, 3).flatten(2)],
                     -1).norm(dim=-1)


def _bound(params: dict) -> float:
    """The documented per-token L2 bound (``drop_below=0``): ``sqrt(C) * max step / 2``, plus float32 slack."""
    codec = get_codec("xquant", params)
    width = bound_cl_tables(params["model"]).layer.width
    return math.sqrt(width) * float(codec._plan().steps.max()) / 2 * 1.0001 + 1e-4  # noqa: SLF001


def test_tables_predict_and_digest(tiny) -> None:  # noqa: ANN001
    model, params = tiny
    tables = bound_cl_tables(params["model"])
    assert tables.depth == 2 and tables.predict.shape == (3, 2 * 64 + 1, 64)
    assert bool((tables.predict[1, 64:128] == 0).all())  # layer 1 has one layer below it
    assert bool(tables.predict[2].abs().sum() > 0)
    basis = tables.layer.basis
    eye = torch.eye(64).expand_as(basis)
    assert torch.allclose(basis.transpose(1, 2) @ basis, eye, atol=1e-5)  # each residual basis orthonormal
    sigma = tables.layer.sigma
    assert torch.all(sigma[:, :-1] >= sigma[:, 1:] - 1e-5)  # the residual's KLT: by decreasing energy
    assert bound_tables(tables.layer.digest) is tables.layer  # the per-layer tables are bound with them
    other = XQuantCLTables(tables.layer, tables.predict * 1.5, 2)
    assert other.digest != tables.digest  # the predictors are part of the digest
    assert xquant_cl_tables(model, CALIBRATION, depth=1).digest != tables.digest
    with pytest.raises(ConfigError, match="depth"):
        XQuantCLTables(tables.layer, tables.predict, 3)
    with pytest.raises(ConfigError, match="depth"):
        xquant_cl_tables(model, CALIBRATION, depth=0)
    with pytest.raises(ConfigError, match="basis"):
        xquant_params(model, CALIBRATION, basis="svd", cross_layer=True)


@pytest.mark.parametrize("tokens,start", [(1, 0), (7, 3), (64, 0), (200, 300)])
def test_round_trip_within_bound(tiny, tokens: int, start: int) -> None:  # noqa: ANN001
    model, params = tiny
    keys, values = _kv(model, tokens, start)
    exact = {**params, **EXACT, "step": 0.05}
    back = decode_block(_encode(keys, values, exact, start))
    assert back.keys.shape == keys.shape and back.keys.dtype == keys.dtype
    err = _token_error(back.keys, back.values, keys, values)
    assert float(err.max()) <= _bound(exact)
    assert float(err.max()) > 0  # lossy
    # the closed loop: a coarser step's error stays within its bound in every layer (errors do not add up)
    coarse = {**exact, "step": 0.3}
    back = decode_block(_encode(keys, values, coarse, start))
    assert float(_token_error(back.keys, back.values, keys, values).max()) <= _bound(coarse)


def test_half_dtype_and_sinks(tiny) -> None:  # noqa: ANN001
    model, params = tiny
    keys, values = _kv(model, 40, 0, seed=4)
    keys[:, :, 0] *= 40.0  # an outlier token, as a sequence's first token often is
    values[:, :, 0] *= 40.0
    p = {**params, "step": 0.05, "drop_below": 0.0, "max_sinks": 2}
    back = decode_block(_encode(keys.half(), values.half(), p))
    assert back.keys.dtype == torch.float16
    assert torch.equal(back.keys[:, :, 0], keys[:, :, 0].half())  # kept exactly in fp16
    assert torch.equal(back.values[:, :, 0], values[:, :, 0].half())
    err = _token_error(back.keys.float(), back.values.float(), keys.half().float(), values.half().float())
    norm = torch.cat([keys.permute(0, 2, 1, 3).flatten(2), values.permute(0, 2, 1, 3).flatten(2)], -1).norm(dim=-1)
    assert bool((err <= _bound(p) + torch.finfo(torch.float16).eps * (norm + _bound(p))).all())


def test_selectable_by_name_and_params(tiny) -> None:  # noqa: ANN001
    _, params = tiny
    assert "xquant" in available_codecs()
    codec = get_codec("xquant", {**params, "step": 0.4})
    assert isinstance(codec, XQuantCodec) and codec.cross_layer is True
    assert codec.params()["cross_layer"] is True and codec.params()["model"] == params["model"]
    plain = get_codec("xquant", {"model": bound_cl_tables(params["model"]).layer.digest})
    assert "cross_layer" not in plain.params()  # a plain block's header is what it always was
    with pytest.raises(CodecParamError, match="cross_layer"):
        get_codec("xquant", {**params, "cross_layer": "yes"})
    assert XQuantCodec.decode_workspace_bytes(codec.params(), (3, 2, 64, 16), 4, 0) > 0


def test_other_setting_is_a_miss(tiny) -> None:  # noqa: ANN001
    model, params = tiny
    keys, values = _kv(model, 32, 8, seed=2)
    cl = get_codec("xquant", {**params, **EXACT})
    layer_digest = bound_cl_tables(params["model"]).layer.digest
    plain = get_codec("xquant", {"model": layer_digest, **EXACT})
    shape = tuple(keys.shape)
    cl_payload = memoryview(b"".join(bytes(b) for b in cl.encode_at(keys, values, 8)))
    plain_payload = memoryview(b"".join(bytes(b) for b in plain.encode_at(keys, values, 8)))
    # each decodes its own, and refuses the other's (format byte)
    cl.prepare_at(cl_payload, shape, torch.float32, 8)
    with pytest.raises(CorruptBlockError, match="cross-layer format"):
        cl.prepare_at(plain_payload, shape, torch.float32, 8)
    with pytest.raises(CorruptBlockError):
        plain.prepare_at(cl_payload, shape, torch.float32, 8)
    # plain blocks still decode with cross-layer tables bound beside them
    back = decode_block(_encode(keys, values, {"model": layer_digest, **EXACT}, 8))
    assert float(_token_error(back.keys, back.values, keys, values).max()) < 1.0
    assert bytes(cl_payload[:1]) != b"" and FORMAT != 2


def test_damaged_payloads_raise(tiny) -> None:  # noqa: ANN001
    model, params = tiny
    keys, values = _kv(model, 48, 0, seed=6)
    keys[:, :, 0] *= 40.0
    codec = get_codec("xquant", {**params, "drop_below": 0.0, "max_sinks": 2})
    shape = tuple(keys.shape)
    payload = b"".join(bytes(b) for b in codec.encode_at(keys, values, 0))
    sections = [bytes(s) for s in unpack_sections(memoryview(payload), 8, "xquant")]

    def prepare(parts: list[bytes]) -> None:
        codec.prepare_at(memoryview(b"".join(bytes(b) for b in pack_sections(parts))), shape, torch.float32, 0)

    prepare(sections)  # the intact payload
    with pytest.raises(CorruptBlockError):
        codec.prepare_at(memoryview(payload[:-7]), shape, torch.float32, 0)  # truncated
    with pytest.raises(CorruptBlockError):
        codec.prepare_at(memoryview(payload), (3, 2, 47, 16), torch.float32, 0)  # another token count
    with pytest.raises(CorruptBlockError):
        prepare([sections[0], sections[1][:-2], *sections[2:]])  # means cut short
    with pytest.raises(CorruptBlockError):
        prepare([*sections[:4], sections[4][:-3], *sections[5:]])  # a class stream cut short
    assert len(sections[2]) > 4  # a sink is stored
    with pytest.raises(CorruptBlockError, match="sink"):
        prepare([sections[0], sections[1], (10**6).to_bytes(4, "little") + sections[2][4:], *sections[3:]])


def test_unbound_and_saved_tables(tiny, tmp_path) -> None:  # noqa: ANN001
    model, params = tiny
    keys, values = _kv(model, 16)
    tables = bound_cl_tables(params["model"])
    data = _encode(keys, values, params)
    path = str(tmp_path / "cl.safetensors")
    save_cl_tables(tables, path)
    unbind_cl_tables(tables.digest)
    with pytest.raises(XQuantUnboundError, match=tables.digest):
        decode_block(data)
    loaded = load_cl_tables(path)
    assert loaded.digest == tables.digest
    bind_cl_tables(loaded)
    back = decode_block(data)
    assert back.keys.shape == keys.shape
    plain = str(tmp_path / "plain.safetensors")
    save_tables(tables.layer, plain)
    with pytest.raises(ConfigError, match="not xquant cross-layer tables"):
        load_cl_tables(plain)
