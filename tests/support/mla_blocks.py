"""Blocks whose keys and values differ in head dim (MLA), for the tests of every codec, tier and the remote store
(``tests/kvstore/test_mla_blocks.py``, ``tests/service/test_remote_mla.py``)."""

from __future__ import annotations

import json
import struct

import torch
import xxhash
from helpers import FINGERPRINT

from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.encoding import MAGIC

#: every codec but xquant (it rematerializes K and V of one head dim from X: it refuses MLA)
CODECS = [
    ("raw", {}), ("zstd", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("int4", {"group_size": 32}), ("int2", {}),
    ("cachegen", {}), ("cachegen", {"bits": 4, "rotate": True}), ("sparse", {"inner": "int8"}),
    ("sparse", {"inner": "raw"}),
]
CODEC_IDS = [f"{c}{p or ''}" for c, p in CODECS]
#: lossless codecs give back the block bit for bit; the others within what they promise
LOSSLESS = {"raw", "zstd"}


def mla_block(tokens: int = 16, *, dk: int = 24, dv: int = 16, layers: int = 3, heads: int = 2, start_pos: int = 0,
              dtype: torch.dtype = torch.float32, namespace: str = "default", seed: int = 0) -> KVBlock:
    """A random block whose keys are ``[layers, heads, tokens, dk]`` and values ``[layers, heads, tokens, dv]``."""
    gen = torch.Generator().manual_seed(seed + 1000 * start_pos + dk + 7 * dv)
    keys = torch.randn(layers, heads, tokens, dk, generator=gen).to(dtype)
    values = torch.randn(layers, heads, tokens, dv, generator=gen).to(dtype)
    ids = tuple(range(100 + start_pos + seed, 100 + start_pos + seed + tokens))
    return KVBlock(keys, values, ids, start_pos, FINGERPRINT, namespace)


def header_text(data: bytes) -> bytes:
    """The JSON header of an encoded block."""
    (header_len,) = struct.unpack_from("<I", data, 6)
    return data[10 : 10 + header_len]


def forge(data: bytes, **changes: object) -> bytes:
    """``data`` with its header fields changed (``None``: removed) and a valid checksum: a hostile or buggy
    writer's block, not random damage."""
    header = json.loads(header_text(data))
    payload = data[10 + len(header_text(data)) : -8]
    for name, value in changes.items():
        if value is None:
            header.pop(name, None)
        else:
            header[name] = value
    text = json.dumps(header, separators=(",", ":")).encode()
    body = struct.pack("<4sHI", MAGIC, 1, len(text)) + text + payload
    return body + xxhash.xxh3_64_digest(body)
