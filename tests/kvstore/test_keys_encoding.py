"""Block keys (content addressing, chaining, cross-process stability) and the encoded block format."""

from __future__ import annotations

import ast
import json
import random
import struct
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from helpers import assert_same_block, key_of, make_block, run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshelf.compress import available_codecs, get_codec
from kvshelf.kvstore import (
    KEY_BYTES,
    CodecParamError,
    ConfigError,
    CorruptBlockError,
    ForeignBlockError,
    KVBlock,
    KVShelfError,
    UnknownCodecError,
    chunk_key,
    decode_block,
    encode_block,
    fingerprint_from_properties,
    prefix_block_keys,
    prefix_block_spans,
    read_header,
)
from kvshelf.kvstore.encoding import MAGIC
from kvshelf.kvstore.keys import (
    SCOPE_BYTES,
    SCOPED_KEY_BYTES,
    TIER_KEY_LENGTHS,
    block_key,
    block_key_of,
    check_keys,
    is_scoped,
    scope,
    scope_of,
    scope_tag,
    split_scoped,
    unscope,
)

FP = "model-a"
NS = "tenant-1"
PREFIX = struct.Struct("<4sHI")  # magic, version, header length (the documented layout)
CHECKSUM = 8

# ------------------------------------------------------------------------------------------------------------
# keys
# ------------------------------------------------------------------------------------------------------------

_KEYS_SNIPPET = """
import json
from kvshelf.kvstore import chunk_key, prefix_block_keys
print(json.dumps({
    "chunk": chunk_key("model-a", "tenant-1", [1, 2, 3, 4]).hex(),
    "chunk_empty_ns_other": chunk_key("model-a", "tenant-2", [1, 2, 3, 4]).hex(),
    "prefix": [k.hex() for k in prefix_block_keys("model-a", "tenant-1", list(range(10)), 4)],
    "big_ids": chunk_key("m", "n", [2**40, 7, 151_000]).hex(),
}))
"""


def _keys_here() -> dict:
    return {
        "chunk": chunk_key("model-a", "tenant-1", [1, 2, 3, 4]).hex(),
        "chunk_empty_ns_other": chunk_key("model-a", "tenant-2", [1, 2, 3, 4]).hex(),
        "prefix": [k.hex() for k in prefix_block_keys("model-a", "tenant-1", list(range(10)), 4)],
        "big_ids": chunk_key("m", "n", [2**40, 7, 151_000]).hex(),
    }


def test_keys_are_stable_across_processes():
    here = _keys_here()
    # two fresh interpreters with different str-hash seeds: keys must not depend on Python's hash()
    first = run_python(_KEYS_SNIPPET, hash_seed="1")
    second = run_python(_KEYS_SNIPPET, hash_seed="98765")
    assert first == here
    assert second == here


def test_keys_match_known_values():
    # Persisted stores are addressed by these keys: changing the key function silently orphans every block
    # already on disk or in Redis. If this fails on purpose, bump the key version ("kvshelf-key-v1").
    assert chunk_key("model-a", "tenant-1", [1, 2, 3, 4]).hex() == "c5c4ab99b35b8452fa3ab628f5d44e4a"
    assert [k.hex() for k in prefix_block_keys("model-a", "tenant-1", list(range(10)), 4)] == [
        "557aa6d965780a06c501c6af68ecd830",
        "d9c31f6598b119c5e333c2771269fd88",
    ]


def test_key_size_and_type():
    key = chunk_key(FP, NS, [1, 2, 3])
    assert isinstance(key, bytes)
    assert len(key) == KEY_BYTES == 16
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in prefix_block_keys(FP, NS, range(8), 2))


def test_same_input_same_key_for_any_sequence_type():
    tokens = [5, 17, 99, 3]
    expected = chunk_key(FP, NS, tokens)
    assert chunk_key(FP, NS, tuple(tokens)) == expected
    assert chunk_key(FP, NS, np.array(tokens, dtype=np.int32)) == expected
    assert chunk_key(FP, NS, np.array(tokens, dtype=np.int64)) == expected
    assert prefix_block_keys(FP, NS, tokens, 2) == prefix_block_keys(FP, NS, tuple(tokens), 2)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param((FP, NS, [1, 2, 3]), (FP, "tenant-2", [1, 2, 3]), id="namespace"),
        pytest.param((FP, NS, [1, 2, 3]), ("model-b", NS, [1, 2, 3]), id="fingerprint"),
        pytest.param((FP, NS, [1, 2, 3]), (FP, NS, [1, 2, 4]), id="last-token"),
        pytest.param((FP, NS, [1, 2, 3]), (FP, NS, [3, 2, 1]), id="order"),
        pytest.param((FP, NS, [1, 2, 3]), (FP, NS, [1, 2]), id="length"),
        pytest.param((FP, NS, [1, 2, 3]), (FP, NS, [1, 2, 3, 0]), id="trailing-zero"),
        pytest.param((FP, NS, [2**40]), (FP, NS, [0]), id="large-id-not-truncated"),
        pytest.param(("ab", "c", [1]), ("a", "bc", [1]), id="field-boundary"),
        pytest.param(("a", "b", [1]), ("b", "a", [1]), id="fields-swapped"),
    ],
)
def test_chunk_keys_differ(a, b):
    assert chunk_key(*a) != chunk_key(*b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param((FP, NS), (FP, "tenant-2"), id="namespace"),
        pytest.param((FP, NS), ("model-b", NS), id="fingerprint"),
    ],
)
def test_prefix_keys_differ_by_model_and_namespace(a, b):
    tokens = list(range(12))
    ka, kb = prefix_block_keys(*a, tokens, 4), prefix_block_keys(*b, tokens, 4)
    assert len(ka) == len(kb) == 3
    assert not set(ka) & set(kb)


def test_block_key_depends_on_parent():
    tokens = [7, 8, 9, 10]
    root = block_key(FP, NS, None, tokens)
    parent = block_key(FP, NS, None, [1, 2, 3, 4])
    other_parent = block_key(FP, NS, None, [1, 2, 3, 5])
    assert block_key(FP, NS, parent, tokens) != root
    assert block_key(FP, NS, parent, tokens) != block_key(FP, NS, other_parent, tokens)
    assert block_key(FP, NS, parent, tokens) == block_key(FP, NS, parent, list(tokens))


def test_prefix_and_chunk_keys_are_different_domains():
    tokens = [1, 2, 3, 4]
    assert prefix_block_keys(FP, NS, tokens, 4)[0] != chunk_key(FP, NS, tokens)


def test_prefix_keys_chain():
    tokens = list(range(100, 110))  # 10 tokens, block size 3 -> 3 full blocks, 1 trailing token
    keys = prefix_block_keys(FP, NS, tokens, 3)
    assert len(keys) == 3
    parent = None
    for i, key in enumerate(keys):
        parent = block_key(FP, NS, parent, tokens[3 * i : 3 * i + 3])
        assert key == parent
    assert len(set(keys)) == 3


def test_prefix_keys_name_the_whole_prefix():
    block = [1, 2, 3, 4]
    keys = prefix_block_keys(FP, NS, block * 3, 4)
    assert len(set(keys)) == 3  # identical token blocks at different depths get different keys

    base = list(range(16))
    changed = list(base)
    changed[9] = 999  # inside the third block of 4
    ka, kb = prefix_block_keys(FP, NS, base, 4), prefix_block_keys(FP, NS, changed, 4)
    assert ka[:2] == kb[:2]
    assert ka[2] != kb[2] and ka[3] != kb[3]


def test_prefix_keys_extend_with_the_prompt():
    short, long_ = list(range(8)), list(range(8)) + [42] * 9
    ks, kl = prefix_block_keys(FP, NS, short, 4), prefix_block_keys(FP, NS, long_, 4)
    assert kl[: len(ks)] == ks
    assert len(kl) == len(long_) // 4 == 4


@pytest.mark.parametrize(("n_tokens", "block_size", "n_keys"), [(0, 4, 0), (3, 4, 0), (4, 4, 1), (7, 4, 1),
                                                                 (8, 4, 2), (5, 1, 5)])
def test_only_full_blocks_get_keys(n_tokens, block_size, n_keys):
    assert len(prefix_block_keys(FP, NS, list(range(n_tokens)), block_size)) == n_keys


def test_partial_tail_key_matches_known_value():
    # CachedGenerator(cacheable_prefix=...) stores a context's trailing partial block under this key
    assert [k.hex() for k in prefix_block_keys("model-a", "tenant-1", list(range(10)), 4, partial=True)] == [
        "557aa6d965780a06c501c6af68ecd830",
        "d9c31f6598b119c5e333c2771269fd88",
        "23f5b6d95ea3661ca3aa877430385b0b",
    ]


@pytest.mark.parametrize(("n_tokens", "block_size"), [(0, 4), (3, 4), (4, 4), (7, 4), (8, 4), (5, 1), (10, 3)])
@pytest.mark.parametrize("partial", [False, True])
def test_spans_are_the_chained_blocks(n_tokens, block_size, partial):
    tokens = list(range(100, 100 + n_tokens))
    spans = prefix_block_spans(FP, NS, tokens, block_size, partial=partial)
    assert [s.key for s in spans] == prefix_block_keys(FP, NS, tokens, block_size, partial=partial)
    full = n_tokens // block_size
    assert len(spans) == (-(-n_tokens // block_size) if partial else full)
    parent = None
    for i, (start, end, key) in enumerate(spans):  # consecutive, block_size long but the partial tail
        assert start == i * block_size and end == min(start + block_size, n_tokens)
        parent = block_key(FP, NS, parent, tokens[start:end])
        assert key == parent
    assert [s.key for s in spans[:full]] == prefix_block_keys(FP, NS, tokens, block_size)


@pytest.mark.parametrize("block_size", [0, -1, -256])
def test_block_size_must_be_positive(block_size):
    with pytest.raises(ConfigError, match="block_size"):
        prefix_block_keys(FP, NS, list(range(10)), block_size)


@pytest.mark.parametrize(("fingerprint", "namespace"), [("", NS), (FP, "")])
def test_empty_fingerprint_or_namespace_rejected(fingerprint, namespace):
    with pytest.raises(ConfigError):
        chunk_key(fingerprint, namespace, [1, 2])
    with pytest.raises(ConfigError):
        prefix_block_keys(fingerprint, namespace, [1, 2], 1)


def test_fingerprint_is_stable_and_sensitive():
    props = {"arch": "llama", "layers": 30, "kv_heads": 3, "head_dim": 64, "rope": {"theta": 10000.0}}
    fp = fingerprint_from_properties(props, b"w")
    assert fp == fingerprint_from_properties(dict(reversed(list(props.items()))), b"w")
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert fp != fingerprint_from_properties({**props, "layers": 29}, b"w")
    assert fp != fingerprint_from_properties({**props, "rope": {"theta": 500000.0}}, b"w")
    assert fp != fingerprint_from_properties(props, b"x")


# ------------------------------------------------------------------------------------------------------------
# KVBlock
# ------------------------------------------------------------------------------------------------------------


def test_kvblock_validation():
    k = torch.zeros(2, 2, 3, 4)
    with pytest.raises(ConfigError):
        KVBlock(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), (1, 2, 3), 0, FP)
    with pytest.raises(ConfigError):
        KVBlock(k, torch.zeros(2, 2, 4, 4), (1, 2, 3), 0, FP)
    with pytest.raises(ConfigError):
        KVBlock(k, torch.zeros(2, 2, 3, 4, dtype=torch.float16), (1, 2, 3), 0, FP)
    with pytest.raises(ConfigError):
        KVBlock(k, torch.zeros_like(k), (1, 2), 0, FP)
    with pytest.raises(ConfigError):
        KVBlock(k, torch.zeros_like(k), (1, 2, 3), -1, FP)
    block = KVBlock(k, torch.zeros_like(k), (1, 2, 3), 5, FP)
    assert (block.num_layers, block.num_tokens, block.dtype) == (2, 3, torch.float32)
    assert block.nbytes == 2 * 48 * 4


def test_make_block_helper_is_reproducible():
    a, b = make_block(5, seed=3), make_block(5, seed=3)
    assert_same_block(a, b)
    assert not torch.equal(make_block(5, seed=3).keys, make_block(5, seed=4).keys)
    assert not torch.equal(make_block([1, 2]).keys, make_block([1, 3]).keys)


# ------------------------------------------------------------------------------------------------------------
# encoding: round trips
# ------------------------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 7, 16])
@pytest.mark.parametrize("copy", [True, False])
def test_round_trip_exact(dtype, tokens, copy):
    block = make_block(tokens, dtype=dtype, start_pos=11, namespace="ns-x", extra={"source": "doc-1"})
    key = key_of(block)
    data = encode_block(block, key)
    out = decode_block(data, expected_key=key, expected_fingerprint=block.fingerprint,
                       expected_namespace="ns-x", copy=copy)
    assert_same_block(out, block)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_from_bytearray_and_memoryview(dtype):
    block = make_block(5, dtype=dtype)
    data = encode_block(block, key_of(block))
    assert_same_block(decode_block(bytearray(data)), block)
    assert_same_block(decode_block(memoryview(data)), block)


def test_round_trip_zero_tokens():
    block = make_block(0)
    out = decode_block(encode_block(block, b"\x01" * 16))
    assert out.keys.shape == (2, 2, 0, 8) and out.token_ids == ()


def test_round_trip_float64():
    block = make_block(3, dtype=torch.float64)
    assert_same_block(decode_block(encode_block(block, b"k" * 16)), block)


def test_round_trip_non_contiguous_tensors():
    base = make_block(6, head_dim=8)
    keys = base.keys.transpose(2, 3).contiguous().transpose(2, 3)  # same values, non-contiguous strides
    assert not keys.is_contiguous()
    block = KVBlock(keys, base.values[:, :, :, :], base.token_ids, 0, base.fingerprint)
    out = decode_block(encode_block(block, b"k" * 16))
    assert torch.equal(out.keys, base.keys) and torch.equal(out.values, base.values)


def test_copy_true_is_independent_of_the_buffer():
    block = make_block(4)
    data = bytearray(encode_block(block, b"k" * 16))
    out = decode_block(data, copy=True)
    expected = out.keys.clone()
    data[:] = bytes(len(data))  # wipe the source buffer
    assert torch.equal(out.keys, expected)
    out.keys.add_(1.0)  # writable


def test_special_float_values_survive():
    block = make_block(2)
    keys = block.keys.clone()
    keys[0, 0, 0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, float("nan")])
    special = KVBlock(keys, block.values, block.token_ids, 0, block.fingerprint)
    assert_same_block(decode_block(encode_block(special, b"k" * 16)), special)


def test_header_describes_the_block():
    block = make_block(3, start_pos=40, namespace="ns-h", dtype=torch.bfloat16, extra={"a": "b"})
    key = key_of(block)
    data = encode_block(block, key)
    assert data[:4] == MAGIC
    header = read_header(data)
    assert header.codec == "raw" and header.params == {}
    assert header.shape == (2, 2, 3, 8)
    assert header.dtype == torch.bfloat16
    assert header.start_pos == 40 and header.token_ids == (40, 41, 42)
    assert header.fingerprint == block.fingerprint and header.namespace == "ns-h"
    assert header.key == key and header.extra == {"a": "b"}
    assert header.payload_len == block.nbytes
    magic, version, header_len = PREFIX.unpack_from(data, 0)
    assert len(data) == PREFIX.size + header_len + header.payload_len + CHECKSUM
    assert b"pickle" not in data and data[:2] != b"\x80\x04"


def test_encoding_is_deterministic():
    block = make_block(4)
    assert encode_block(block, b"k" * 16) == encode_block(make_block(4), b"k" * 16)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    tokens=st.integers(0, 9),
    head_dim=st.integers(1, 9),
    dtype=st.sampled_from(DTYPES),
    start_pos=st.integers(0, 100_000),
    seed=st.integers(0, 2**31 - 1),
    namespace=st.text(min_size=1, max_size=12),
    extra=st.dictionaries(st.text(max_size=5), st.text(max_size=8), max_size=3),
    copy=st.booleans(),
)
def test_round_trip_property(layers, heads, tokens, head_dim, dtype, start_pos, seed, namespace, extra, copy):
    block = make_block(tokens, layers=layers, heads=heads, head_dim=head_dim, dtype=dtype,
                       start_pos=start_pos, seed=seed, namespace=namespace, extra=extra)
    key = key_of(block)
    out = decode_block(encode_block(block, key), expected_key=key, expected_namespace=namespace, copy=copy)
    assert_same_block(out, block)


# ------------------------------------------------------------------------------------------------------------
# encoding: damaged values are always CorruptBlockError
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def encoded() -> tuple[bytes, bytes]:
    block = make_block(3, layers=1, heads=2, head_dim=4, dtype=torch.float16, start_pos=2)
    key = key_of(block)
    return encode_block(block, key), key


def _regions(data: bytes) -> dict[str, range]:
    _, _, header_len = PREFIX.unpack_from(data, 0)
    body_start = PREFIX.size + header_len
    return {
        "magic": range(0, 4),
        "version": range(4, 6),
        "header_len": range(6, 10),
        "header": range(10, body_start),
        "payload": range(body_start, len(data) - CHECKSUM),
        "checksum": range(len(data) - CHECKSUM, len(data)),
    }


@pytest.mark.parametrize("region", ["magic", "version", "header_len", "header", "payload", "checksum"])
@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_flipped_byte_is_detected(encoded, region, mask):
    data, key = encoded
    positions = _regions(data)[region]
    assert len(positions) > 0
    for i in positions:
        damaged = bytearray(data)
        damaged[i] ^= mask
        with pytest.raises(CorruptBlockError):
            decode_block(bytes(damaged), expected_key=key)


def test_random_byte_replacements_are_detected(encoded):
    data, _ = encoded
    rng = random.Random(1234)
    for _ in range(2000):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(damaged))
            damaged[i] = (damaged[i] + rng.randint(1, 255)) % 256
        with pytest.raises(CorruptBlockError):
            decode_block(bytes(damaged))


def test_every_truncation_is_detected(encoded):
    data, _ = encoded
    for length in range(len(data)):
        with pytest.raises(CorruptBlockError):
            decode_block(data[:length])
    with pytest.raises(CorruptBlockError):
        read_header(data[:5])


@pytest.mark.parametrize("tail", [b"\x00", b"garbage", b"\x00" * 8])
def test_appended_bytes_are_detected(encoded, tail):
    data, _ = encoded
    with pytest.raises(CorruptBlockError):
        decode_block(data + tail)


def test_bad_magic(encoded):
    data, _ = encoded
    with pytest.raises(CorruptBlockError, match="magic"):
        decode_block(b"PKL!" + data[4:])
    with pytest.raises(CorruptBlockError, match="magic"):
        read_header(b"\x80\x04" + data[2:])  # a pickle protocol-4 prefix


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("length", [0, 1, 9, 17, 64, 1000])
def test_garbage_is_corrupt(seed, length):
    rng = random.Random(seed * 1000 + length)
    junk = bytes(rng.getrandbits(8) for _ in range(length))
    with pytest.raises(CorruptBlockError):
        decode_block(junk)
    with pytest.raises(CorruptBlockError):
        decode_block(MAGIC + junk)
    with pytest.raises(CorruptBlockError):
        decode_block(PREFIX.pack(MAGIC, 1, len(junk)) + junk + b"\x00" * CHECKSUM)


def test_huge_header_length_is_corrupt(encoded):
    data, _ = encoded
    with pytest.raises(CorruptBlockError):
        decode_block(PREFIX.pack(MAGIC, 1, 0xFFFFFFFF) + data[PREFIX.size :])


def _reseal(data: bytes, mutate=None, *, header_bytes: bytes | None = None, payload: bytes | None = None,
            version: int = 1) -> bytes:
    """Re-encode ``data`` with a modified header/payload and a *valid* checksum (a well-formed lie)."""
    _, _, header_len = PREFIX.unpack_from(data, 0)
    header = json.loads(data[PREFIX.size : PREFIX.size + header_len])
    if mutate is not None:
        mutate(header)
    hb = header_bytes if header_bytes is not None else json.dumps(header).encode()
    body = data[PREFIX.size + header_len : len(data) - CHECKSUM] if payload is None else payload
    out = PREFIX.pack(MAGIC, version, len(hb)) + hb + body
    return out + xxhash.xxh3_64_digest(out)


def test_reseal_helper_is_faithful(encoded):
    # the tests below rely on _reseal producing a valid block when nothing is changed
    data, key = encoded
    assert decode_block(_reseal(data), expected_key=key).token_ids == decode_block(data).token_ids


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda h: h.update(shape=[1, 2, 3]), id="shape-rank"),
        pytest.param(lambda h: h.update(shape=[1, 2, -3, 4]), id="shape-negative"),
        pytest.param(lambda h: h.update(shape=[1, 2, 3, 5]), id="shape-vs-payload"),
        pytest.param(lambda h: h.update(shape="wxyz"), id="shape-string"),
        pytest.param(lambda h: h.update(dtype="int8"), id="dtype-unknown"),
        pytest.param(lambda h: h.update(payload_len=h["payload_len"] + 2), id="payload-len"),
        pytest.param(lambda h: h.update(token_ids=[1, 2]), id="token-count"),
        pytest.param(lambda h: h.update(token_ids=["x", 2, 3]), id="token-not-int"),
        pytest.param(lambda h: h.update(key="zz"), id="key-not-hex"),
        pytest.param(lambda h: h.pop("fingerprint"), id="missing-field"),
        pytest.param(lambda h: h.update(params=7), id="params-not-object"),
        pytest.param(lambda h: h.update(extra=["a"]), id="extra-not-object"),
        pytest.param(lambda h: h.update(start_pos=-1), id="start-pos-negative"),
        pytest.param(lambda h: h.update(start_pos=float("inf")), id="start-pos-infinite"),
        pytest.param(lambda h: h.update(shape=[1, 2, float("inf"), 4]), id="shape-infinite"),
        pytest.param(lambda h: h.update(payload_len=float("nan")), id="payload-len-nan"),
    ],
)
def test_well_formed_but_invalid_headers_are_corrupt(encoded, mutate):
    data, key = encoded
    bad = _reseal(data, mutate)
    with pytest.raises(CorruptBlockError):
        decode_block(bad, expected_key=key)


@pytest.mark.parametrize("header_bytes", [b"", b"{", b"[]", b'"x"', b"null", b"\xff\xfe", b"{}"])
def test_non_object_headers_are_corrupt(encoded, header_bytes):
    data, _ = encoded
    with pytest.raises(CorruptBlockError):
        decode_block(_reseal(data, header_bytes=header_bytes))


def test_unsupported_version_is_corrupt(encoded):
    data, _ = encoded
    with pytest.raises(CorruptBlockError, match="version"):
        decode_block(_reseal(data, version=2))


def test_payload_of_wrong_length_is_corrupt(encoded):
    data, _ = encoded

    def shrink(h):
        h["payload_len"] -= 2

    header = read_header(data)
    _, _, header_len = PREFIX.unpack_from(data, 0)
    body = data[PREFIX.size + header_len : -CHECKSUM]
    assert len(body) == header.payload_len
    with pytest.raises(CorruptBlockError):
        decode_block(_reseal(data, shrink, payload=body[:-2]))


def test_unknown_codec_in_a_stored_value_is_never_decoded(encoded):
    data, _ = encoded
    with pytest.raises(KVShelfError):
        decode_block(_reseal(data, lambda h: h.update(codec="from-the-future")))


# ------------------------------------------------------------------------------------------------------------
# encoding: foreign blocks
# ------------------------------------------------------------------------------------------------------------


def test_foreign_key_fingerprint_namespace():
    block = make_block(4, namespace="alice")
    key = key_of(block)
    data = encode_block(block, key)
    assert_same_block(
        decode_block(
            data, expected_key=key, expected_fingerprint=block.fingerprint, expected_namespace="alice"
        ),
        block,
    )
    other_key = chunk_key(block.fingerprint, "alice", [9, 9, 9])
    with pytest.raises(ForeignBlockError, match=key.hex()):
        decode_block(data, expected_key=other_key)
    with pytest.raises(ForeignBlockError, match="model"):
        decode_block(data, expected_fingerprint="another-model")
    with pytest.raises(ForeignBlockError, match="namespace") as exc_info:
        decode_block(data, expected_namespace="bob")
    assert "alice" not in str(exc_info.value)  # do not leak the owner to another tenant
    assert not isinstance(exc_info.value, CorruptBlockError)


# ------------------------------------------------------------------------------------------------------------
# codec registry
# ------------------------------------------------------------------------------------------------------------


def test_unknown_codec_names_it_and_lists_available():
    block = make_block(2)
    with pytest.raises(UnknownCodecError) as exc_info:
        encode_block(block, key_of(block), codec_name="zstd-ultra")
    message = str(exc_info.value)
    assert "zstd-ultra" in message
    assert available_codecs()
    for name in available_codecs():
        assert name in message
    assert isinstance(exc_info.value, ConfigError)
    with pytest.raises(UnknownCodecError, match="nope"):
        get_codec("nope")


def test_unknown_codec_params_are_named():
    block = make_block(2)
    with pytest.raises(CodecParamError) as exc_info:
        encode_block(block, key_of(block), codec_name="raw", codec_params={"level": 3, "bogus_knob": 1})
    message = str(exc_info.value)
    assert "level" in message and "bogus_knob" in message and "raw" in message
    assert isinstance(exc_info.value, ConfigError)


def test_raw_codec_is_registered_and_parameterless():
    assert "raw" in available_codecs()
    codec = get_codec("raw")
    assert codec.name == "raw" and codec.params() == {} and not codec.needs_model
    assert get_codec("raw", {}).params() == {}
    assert get_codec("raw", None).params() == {}


def test_unsupported_dtype_is_rejected_at_encode():
    k = torch.zeros(1, 1, 2, 2, dtype=torch.int32)
    block = KVBlock(k, k.clone(), (1, 2), 0, FP)
    with pytest.raises(KVShelfError, match="dtype"):
        encode_block(block, b"k" * 16)


# -- scoped keys ------------------------------------------------------------------------------------------------


def test_scope_joins_a_namespace_tag_and_a_block_key():
    key = block_key(FP, NS, None, [1, 2, 3])
    tag = scope_tag("team-a")
    scoped = scope(tag, key)
    assert len(tag) == SCOPE_BYTES == 8 and len(scoped) == SCOPED_KEY_BYTES == 24
    assert scoped == tag + key and scoped.startswith(tag)
    assert unscope(scoped) == key and scope_of(scoped) == tag and split_scoped(scoped) == (tag, key)
    assert is_scoped(scoped) and not is_scoped(key)
    assert block_key_of(scoped) == key == block_key_of(key)  # a store's tier key: scoped or bare
    assert scope(scope_tag("team-b"), key) != scoped  # namespaces never share a tier key
    assert scope_tag("team-a") == tag  # stable: a tag is a digest of the name
    assert check_keys([key, scoped], scoped=True) == [key, scoped] and TIER_KEY_LENGTHS == (16, 24)


def test_scope_helpers_refuse_wrong_lengths():
    key, tag = block_key(FP, NS, None, [1]), scope_tag("a")
    for bad in (lambda: scope(tag, key + b"x"), lambda: scope(tag[:4], key), lambda: unscope(key),
                lambda: scope_of(key), lambda: split_scoped(tag + key + b"x")):
        with pytest.raises(ConfigError):
            bad()


# the key widths a fixed-offset slice of a key or tag would cut at
_KEY_WIDTH_NAMES = {"KEY_BYTES", "SCOPE_BYTES", "SCOPED_KEY_BYTES"}
_KEY_WIDTHS = {8, 16, 24}


def _source_modules() -> list[Path]:
    """Every module of the package: the folders of pyproject's package-dir mapping (``kvshelf/`` with its CLI)."""
    repo = Path(__file__).resolve().parents[2]
    folders = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    return sorted(p for folder in set(folders) for p in (repo / folder).rglob("*.py"))


def _last_name(node: ast.expr) -> str:
    while isinstance(node, ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _int_value(node: ast.expr | None) -> int | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_value(node.operand)
        return None if inner is None else -inner
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


def key_slices(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, why)`` of each slice that cuts a key at a fixed offset: a slice bound that names ``KEY_BYTES``,
    ``SCOPE_BYTES`` or ``SCOPED_KEY_BYTES`` (anywhere in its expression, bare or as an attribute), or an
    integer-literal bound of a key width (+-8, 16, 24) on a subscripted expression whose last name ends in ``key``
    or ``tag`` (``key``, ``tier_key``, ``event.key``, ``self._tag``...)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Subscript):
            continue
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        for part in parts:
            if not isinstance(part, ast.Slice):
                continue
            bounds = [b for b in (part.lower, part.upper, part.step) if b is not None]
            names = {n.id if isinstance(n, ast.Name) else n.attr
                     for b in bounds for n in ast.walk(b) if isinstance(n, ast.Name | ast.Attribute)}
            if names & _KEY_WIDTH_NAMES:
                found.append((node.lineno, f"sliced at {', '.join(sorted(names & _KEY_WIDTH_NAMES))}"))
            elif _last_name(node.value).lower().endswith(("key", "tag")) and any(
                    abs(v) in _KEY_WIDTHS for v in map(_int_value, bounds) if v is not None):
                found.append((node.lineno, f"{_last_name(node.value)} sliced at a key width"))
    return found


def test_key_slicing_rule_catches_the_old_patterns():
    for code in ("key[SCOPE_BYTES:]", "k[:-KEY_BYTES]", "b[:keys.SCOPE_BYTES + n]", "tier_key[-16:]",
                 "event.key[:8]", "self._tag[0:24]", "key[:, 16:]"):
        assert key_slices(ast.parse(code)), code
    for code in ("keys[:held]", "key[:, :, :kv_end]", "raw[_HEADER.size:]", "first[:16]", "key[:4]"):
        assert not key_slices(ast.parse(code)), code


def test_only_keys_module_slices_keys_at_fixed_offsets():
    """Keys are cut and joined by ``kvstore.keys`` alone (``scope``, ``unscope``, ``scope_of``, ``split_scoped``,
    ``block_key_of``): no other module of the package slices at a key width (the rule: ``key_slices``)."""
    modules = _source_modules()
    assert any(p.parts[-2:] == ("kvstore", "keys.py") for p in modules)
    offenders = [f"{p}:{line}: {why}" for p in modules if p.parts[-2:] != ("kvstore", "keys.py")
                 for line, why in key_slices(ast.parse(p.read_text(), str(p)))]
    assert not offenders, "slice keys with kvstore.keys' helpers:\n" + "\n".join(offenders)
