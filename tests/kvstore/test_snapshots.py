"""State snapshot records (``kvstore.snapshot``): their key, their block form through the codec registry, and
records whose layout is missing or inconsistent (a miss, never a state)."""

from __future__ import annotations

import json

import pytest
import torch

from kvshelf.kvstore import MemoryTier, TieredStore
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.encoding import decode_block, encode_block
from kvshelf.kvstore.errors import ConfigError, CorruptBlockError, ForeignBlockError
from kvshelf.kvstore.keys import block_key, state_key
from kvshelf.kvstore.snapshot import STATE_EXTRA, StateEntry, StateSnapshot, pack, unpack

FP, NS = "model-fp", "tenant"


def _snapshot(tokens: int = 32, dtype: torch.dtype = torch.float32) -> StateSnapshot:
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(1, 24, 4, generator=g).to(dtype)
    rec = torch.randn(1, 4, 16, 16, generator=g)  # the recurrent state may be wider than the model's dtype
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    entries = (StateEntry(0, "conv", 0, tuple(conv.shape), name),
               StateEntry(0, "recurrent", 0, tuple(rec.shape), "float32"),
               StateEntry(2, "conv", 0, (1, 24, 4), "float32"))
    return StateSnapshot(tokens, entries, (conv, rec, torch.randn(1, 24, 4, generator=g)))


def test_state_key_is_derived_and_distinct() -> None:
    key = block_key(FP, NS, None, [1, 2, 3])
    assert state_key(key) == state_key(key) and state_key(key) != key and len(state_key(key)) == 16
    assert state_key(key) != state_key(block_key(FP, "other", None, [1, 2, 3]))
    with pytest.raises(ConfigError):
        state_key(b"short")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_raw_and_zstd_is_exact(dtype: torch.dtype) -> None:
    snap = _snapshot(dtype=dtype)
    key = state_key(block_key(FP, NS, None, list(range(32))))
    record = pack(snap, last_token=31, fingerprint=FP, namespace=NS)
    for codec in ("raw", "zstd"):
        back = unpack(decode_block(encode_block(record, key, codec), expected_key=key, expected_fingerprint=FP,
                                   expected_namespace=NS))
        assert back.layout() == snap.layout() and back.tokens == 32
        for a, b in zip(back.tensors, snap.tensors, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert snap.nbytes == sum(t.numel() * t.element_size() for t in snap.tensors)


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_round_trip_in_a_half_codec_rounds_only(codec: str) -> None:
    snap = _snapshot()
    key = state_key(block_key(FP, NS, None, [7]))
    back = unpack(decode_block(encode_block(pack(snap, last_token=7, fingerprint=FP, namespace=NS), key, codec)))
    for a, b in zip(back.tensors, snap.tensors, strict=True):
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-2, atol=1e-2)


def test_foreign_and_damaged_records_are_refused() -> None:
    key = state_key(block_key(FP, NS, None, [7]))
    value = encode_block(pack(_snapshot(), last_token=7, fingerprint=FP, namespace=NS), key)
    with pytest.raises(ForeignBlockError):
        decode_block(value, expected_key=key, expected_fingerprint="another-model")
    with pytest.raises(CorruptBlockError):
        decode_block(value[:-9], expected_key=key)
    store = TieredStore([MemoryTier(1 << 20)], namespace=NS)
    assert store.put_encoded_many([(key, value)]) == 1
    assert store.get_encoded_many([key], fingerprint=FP) == [value]
    assert store.get_encoded_many([key], fingerprint="another-model") == [None]


def _record(extra: dict[str, str], n: int = 8, start: int = 31) -> KVBlock:
    return KVBlock(torch.zeros(1, 1, 1, n // 2), torch.zeros(1, 1, 1, n // 2), (5,), start, FP, NS, extra=extra)


@pytest.mark.parametrize("layout", [
    None,  # a plain block, not a snapshot
    "not json",
    json.dumps({"v": 2, "tokens": 32, "numel": 8, "entries": []}),
    json.dumps({"v": 1, "tokens": 32, "numel": 8, "entries": [[0, "conv", 0, [1, 9], "float32"]]}),
    json.dumps({"v": 1, "tokens": 32, "numel": 8, "entries": [[0, "ssm", 0, [1, 8], "float32"]]}),
    json.dumps({"v": 1, "tokens": 32, "numel": 8, "entries": [[0, "conv", 0, [1, 8], "int8"]]}),
    json.dumps({"v": 1, "tokens": 40, "numel": 8, "entries": [[0, "conv", 0, [1, 8], "float32"]]}),
    json.dumps({"v": 1, "tokens": 32, "numel": 16, "entries": [[0, "conv", 0, [1, 16], "float32"]]}),
    json.dumps({"v": 1, "tokens": 32, "numel": 8, "entries": [[0, "conv", 0]]}),
])
def test_inconsistent_layouts_are_corrupt(layout: str | None) -> None:
    with pytest.raises(CorruptBlockError):
        unpack(_record({} if layout is None else {STATE_EXTRA: layout}))


def test_a_consistent_layout_unpacks() -> None:
    layout = json.dumps({"v": 1, "tokens": 32, "numel": 8, "entries": [[0, "conv", 0, [1, 8], "float32"]]})
    assert unpack(_record({STATE_EXTRA: layout})).tensors[0].shape == (1, 8)


def test_large_states_fit_the_block_limits() -> None:
    """A Qwen3-Next-80B-sized state (36 layers of 32 x 128 x 128 plus conv) packs within the header limits."""
    entries = tuple(StateEntry(i, "recurrent", 0, (1, 32, 128, 128), "float32") for i in range(36))
    tensors = tuple(torch.zeros(1, 32, 128, 128) for _ in range(36))
    record = pack(StateSnapshot(256, entries, tensors), last_token=1, fingerprint=FP, namespace=NS)
    key = state_key(block_key(FP, NS, None, [1]))
    assert unpack(decode_block(encode_block(record, key), expected_key=key)).layout() == \
        StateSnapshot(256, entries, tensors).layout()
