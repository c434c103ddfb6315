"""The payloads of ``kvshelf bench abuse``'s abusive tenant (``bench/abuser.py``, ``bench/abuse_events.py``): blocks
that pass the checksum but lie in their header (a declared shape past what is sent, nested JSON, a dense Hadamard
matrix's head dim), the largest block the header limits admit, and PutBlocks messages as raw bytes (padded, or a
first chunk alone). Blocks are ``[layers, kv_heads, tokens, head_dim]`` of ones."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import xxhash

from kvshelf.kvstore import KVBlock, encode_block
from kvshelf.kvstore.limits import MAX_HEAD_DIM
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.client import put_requests
from kvshelf.service.wire import varint


def block_key(label: str) -> bytes:
    """A 16-byte key named by ``label`` (BLAKE2b-128)."""
    return hashlib.blake2b(label.encode(), digest_size=16).digest()


def ones_block(shape: tuple[int, int, int, int], namespace: str, dtype: torch.dtype = torch.float16) -> KVBlock:
    """A block of ones, keys and values shaped ``shape`` (``[layers, kv_heads, tokens, head_dim]``)."""
    keys = torch.ones(shape, dtype=dtype)
    return KVBlock(keys, keys.clone(), tuple(range(shape[2])), 0, "a" * 32, namespace)


def _reframe(encoded: bytes, edit: Callable[[dict[str, Any]], Any]) -> bytes:
    """``encoded`` with its JSON header edited by ``edit`` (which may return new header bytes), re-checksummed:
    a block that passes the checksum but says something else."""
    prefix = struct.Struct("<4sHI")
    magic, version, header_len = prefix.unpack_from(encoded, 0)
    header = json.loads(encoded[prefix.size : prefix.size + header_len])
    replaced = edit(header)
    raw = replaced if isinstance(replaced, bytes) else json.dumps(header, separators=(",", ":")).encode()
    body = prefix.pack(magic, version, len(raw)) + raw + encoded[prefix.size + header_len : -8]
    return body + xxhash.xxh3_64_digest(body)


def bomb_block(key: bytes, namespace: str, shape: tuple[int, int, int, int] = (32, 64, 1, 4096)) -> bytes:
    """A ~350-byte ``sparse`` block with 0 kept tokens, ``fill: zero`` and a declared ``shape`` within the header
    limits (``kvstore.limits``) of float32: decoding it allocates ``2 x 4 x prod(shape)`` bytes (64 MiB by
    default; 128 MiB to decode, ``decode_cost_bytes``)."""
    block = ones_block((1, 1, 1, 8), namespace, torch.float32)
    dropped = KVBlock(torch.full_like(block.keys, float("nan")), torch.full_like(block.values, float("nan")),
                      block.token_ids, 0, block.fingerprint, namespace)
    encoded = encode_block(dropped, key, "sparse", {"fill": "zero"})
    return _reframe(encoded, lambda h: h.__setitem__("shape", list(shape)))


def nested_header_block(key: bytes, namespace: str, depth: int = 100_000) -> bytes:
    """A checksummed block whose header is ``depth`` nested JSON arrays (a RecursionError for a naive parser)."""
    encoded = encode_block(ones_block((1, 1, 1, 8), namespace), key)
    return _reframe(encoded, lambda h: b'{"codec":' + b"[" * depth + b"]" * depth + b"}")


def bad_payload_block(key: bytes, namespace: str) -> bytes:
    """A checksummed ``raw`` block whose header declares twice the tokens its payload holds."""
    encoded = encode_block(ones_block((1, 1, 2, 8), namespace), key)

    def edit(h: dict[str, Any]) -> None:
        h["shape"] = [1, 1, 4, 8]
        h["token_ids"] = [0, 1, 2, 3]

    return _reframe(encoded, edit)


def hadamard_block(key: bytes, namespace: str, head_dim: int = 8192) -> bytes:
    """A checksummed ``cachegen`` block with ``rotate: true`` whose header declares ``head_dim`` (one token): a
    decoder that builds the dense ``[head_dim, head_dim]`` Hadamard matrix allocates ``8 x head_dim**2`` bytes
    (512 MiB at 8192) for its ~20 KB. Made from a real block of two tokens of half that dim (the same elements),
    its header rewritten: past ``kvstore.limits.MAX_HEAD_DIM`` no writer makes one, and a reader refuses it."""
    half = ones_block((1, 1, 2, head_dim // 2), namespace)
    encoded = encode_block(half, key, "cachegen", {"rotate": True})

    def edit(h: dict[str, Any]) -> None:
        h["shape"] = [1, 1, 1, head_dim]
        h["token_ids"] = h["token_ids"][:1]

    return _reframe(encoded, edit)


def largest_hadamard_block(key: bytes, namespace: str) -> bytes:
    """A real ``cachegen`` block with ``rotate: true`` at the largest head dim the header limits admit
    (``kvstore.limits.MAX_HEAD_DIM``, two tokens): valid, so served; its decode must stay within the limits."""
    return encode_block(ones_block((1, 1, 2, MAX_HEAD_DIM), namespace), key, "cachegen", {"rotate": True})


def _raw_field(number: int, body: bytes) -> bytes:
    """A length-delimited protobuf field, serialised."""
    return varint(number << 3 | 2) + varint(len(body)) + body


def padded_message(namespace: str, chunk: pb.Chunk, padding: str, nbytes: int) -> bytes:
    """A PutBlocksRequest carrying ``chunk`` and ``nbytes`` of padding: an unknown field (number 15) beside the
    chunk (``padding="unknown"``) or token ids inside it (``"token_ids"``, 3 bytes each)."""
    head = pb.PutBlocksRequest(namespace=namespace).SerializeToString()
    body = chunk.SerializeToString()
    if padding == "token_ids":
        return head + _raw_field(3, body + _raw_field(8, varint(100_000) * (nbytes // 3)))
    return head + _raw_field(3, body) + _raw_field(15, bytes(nbytes))


def put_messages(values: Iterable[tuple[bytes, bytes]], namespace: str) -> Iterator[bytes]:
    """Serialised PutBlocks requests for ``(key, value)`` pairs, chunked as ``RemoteStore`` does."""
    yield from put_requests(values, namespace)


def first_chunk(namespace: str, key: bytes, data: bytes, total: int = 0) -> bytes:
    """A serialised PutBlocksRequest of one chunk of ``key``: ``data``, declaring ``total`` bytes in all."""
    return pb.PutBlocksRequest(namespace=namespace, chunk=pb.Chunk(key=key, data=data, total_size=total)
                               ).SerializeToString()
