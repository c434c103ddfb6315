"""The self-describing encoded form of a block.

Layout (little-endian)::

    b"KVSH" | version: u16 | header_len: u32 | header: UTF-8 JSON | payload | xxh3-64 of all preceding bytes

The JSON header carries the codec name and parameters, shape ``[layers, kv_heads, tokens, head_dim]`` (the
keys'; ``value_head_dim`` when the values' head dim differs, as in MLA models: absent, it is the keys'), dtype,
payload length, start position, token ids, model fingerprint, namespace and the block's key, so a value read back
under another key, namespace or model is recognised as foreign. No pickle anywhere.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from kvshelf.kvstore.block import KVBlock, PreparedBlock
from kvshelf.kvstore.codec import (
    BlockShape,
    Codec,
    block_numel,
    block_shape,
    describe_shape,
    get_codec,
    payload_len_bounds,
    value_shape,
)
from kvshelf.kvstore.errors import (
    BlockTooLargeError,
    CodecParamError,
    ConfigError,
    CorruptBlockError,
    ForeignBlockError,
    KVShelfError,
)
from kvshelf.kvstore.limits import MAX_HEADER_BYTES, MAX_HEADER_CONTAINERS, check_block_fields

MAGIC = b"KVSH"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_CHECKSUM_BYTES = 8

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZES: dict[torch.dtype, int] = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPES.values()}


@dataclass(frozen=True)
class BlockHeader:
    """The parsed header of an encoded block."""

    codec: str
    params: dict[str, Any]
    shape: BlockShape  # the keys' [layers, kv_heads, tokens, head_dim], with the values' head dim
    dtype: torch.dtype
    payload_len: int
    start_pos: int
    token_ids: tuple[int, ...]
    fingerprint: str
    namespace: str
    key: bytes
    extra: dict[str, str]


def decoded_nbytes(header: BlockHeader) -> int:
    """Bytes the keys and values of a block with this header take once decoded (``(prod(keys' shape) +
    prod(values' shape)) x itemsize``), from its declared shapes and dtype alone. Not what decoding it costs: see
    ``decode_cost_bytes``."""
    return block_numel(header.shape) * ITEMSIZES[header.dtype]


def header_codec(header: BlockHeader) -> Codec:
    """The codec of a block with this header; ``CorruptBlockError`` when its parameters are invalid or past
    their limits (a damaged or hostile header), ``UnknownCodecError`` when this build has no such codec."""
    try:
        return get_codec(header.codec, header.params)
    except CodecParamError as exc:
        raise CorruptBlockError(f"block header: {exc}"[:500]) from exc


def decode_cost_bytes(header: BlockHeader) -> int:
    """The most bytes decoding a block with this header may allocate, from the header alone, before anything is
    decoded: its decoded keys and values (``decoded_nbytes``) plus its codec's working memory
    (``Codec.decode_workspace_bytes``: every decode path, whatever the payload holds). What every "may I decode
    this" check compares to its bound (a store's ``max_decoded_bytes``, a server's max block size, a client's
    ``max_decode_bytes``). Raises like ``header_codec``."""
    codec = header_codec(header)
    workspace = type(codec).decode_workspace_bytes(codec.params(), header.shape, ITEMSIZES[header.dtype],
                                                   header.payload_len)
    return decoded_nbytes(header) + workspace


def check_decode_cost(header: BlockHeader, bound: int | None) -> None:
    """``BlockTooLargeError`` when decoding a block with this header may take more than ``bound`` bytes (None:
    unbounded), naming the block's shape, its cost and the bound."""
    if bound is None:
        return
    cost = decode_cost_bytes(header)
    if cost > bound:
        raise BlockTooLargeError(
            f"block {header.key.hex()} of declared shape {describe_shape(header.shape)} {DTYPE_NAMES[header.dtype]} "
            f"({header.codec}) needs up to {cost} bytes to decode ({decoded_nbytes(header)} decoded): more than the "
            f"limit of {bound} bytes")


def encode_block(block: KVBlock, key: bytes, codec_name: str = "raw", codec_params: dict | None = None) -> bytes:
    """Encode ``block`` stored under ``key`` with the named codec."""
    if block.dtype not in DTYPE_NAMES:
        raise KVShelfError(f"unsupported KV dtype {block.dtype}; supported: {sorted(DTYPES)}")
    check_block_fields(codec=codec_name, shapes=[tuple(block.keys.shape), tuple(block.values.shape)],
                       itemsize=ITEMSIZES[block.dtype], start_pos=block.start_pos, token_ids=block.token_ids,
                       fingerprint=block.fingerprint, namespace=block.namespace, key=key, extra=block.extra,
                       error=ConfigError)  # what every reader would refuse is never written
    codec = get_codec(codec_name, codec_params)
    shape = block_shape(block.keys.shape, block.values.shape)
    parts = codec.encode_at(block.keys, block.values, block.start_pos)
    payload_len = sum(len(p) for p in parts)
    check_payload_len(codec.name, codec.params(), shape, block.dtype, payload_len, ConfigError)  # never acknowledge
    fields: dict[str, Any] = {"codec": codec.name, "params": codec.params(), "shape": list(shape)}
    if not shape.same_dims:  # absent: the keys' head dim (every block written before MLA support reads as before)
        fields["value_head_dim"] = shape.value_head_dim
    header = json.dumps(
        {
            **fields,
            "dtype": DTYPE_NAMES[block.dtype],
            "payload_len": payload_len,
            "start_pos": block.start_pos,
            "token_ids": list(block.token_ids),
            "fingerprint": block.fingerprint,
            "namespace": block.namespace,
            "key": key.hex(),
            "extra": block.extra,
        },
        separators=(",", ":"),
    ).encode()
    if len(header) > MAX_HEADER_BYTES or header.count(b"[") + header.count(b"{") > MAX_HEADER_CONTAINERS:
        raise ConfigError(f"the block's header is {len(header)} bytes with {header.count(b'[') + header.count(b'{')} "
                          f"brackets: the limits are {MAX_HEADER_BYTES} bytes and {MAX_HEADER_CONTAINERS} brackets")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header))
    hasher = xxhash.xxh3_64()
    for part in (prefix, header, *parts):
        hasher.update(part)
    return b"".join([prefix, header, *parts, hasher.digest()])


def check_payload_len(codec: str, params: dict[str, Any], shape: BlockShape, dtype: torch.dtype, payload_len: int,
                      error: type[Exception]) -> None:
    """``error`` naming the declared shape (keys' and values') and the payload size when ``payload_len`` is outside
    what ``codec`` with ``params`` takes for a block of ``shape`` (``Codec.payload_bounds``; unchecked when the
    codec cannot state them). ``encode_block`` checks every block it writes (``ConfigError``), so no store
    acknowledges a block that every reader would then drop as damaged (``CorruptBlockError``)."""
    bounds = payload_len_bounds(codec, params, shape, ITEMSIZES[dtype])
    if bounds is not None and not (bounds[0] <= payload_len and (bounds[1] is None or payload_len <= bounds[1])):
        expected = f"{bounds[0]}" if bounds[0] == bounds[1] else f"{bounds[0]}..{bounds[1] or ''}"
        raise error(f"{codec} payload is {payload_len} bytes, a block of shape {describe_shape(shape)} "
                    f"{DTYPE_NAMES[dtype]} takes {expected}")


def _parse_header(data: memoryview) -> tuple[BlockHeader, int]:
    if len(data) < _PREFIX.size + _CHECKSUM_BYTES:
        raise CorruptBlockError(f"encoded block truncated: {len(data)} bytes")
    magic, version, header_len = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptBlockError(f"not a kvshelf block (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"unsupported block format version {version} (this build reads {FORMAT_VERSION})")
    if header_len > MAX_HEADER_BYTES:
        raise CorruptBlockError(f"block header of {header_len} bytes: the limit is {MAX_HEADER_BYTES}")
    if _PREFIX.size + header_len + _CHECKSUM_BYTES > len(data):
        raise CorruptBlockError(f"encoded block truncated: header of {header_len} bytes does not fit")
    text = bytes(data[_PREFIX.size : _PREFIX.size + header_len])
    if text.count(b"[") + text.count(b"{") > MAX_HEADER_CONTAINERS:  # before parsing: JSON containers cost ~27x
        raise CorruptBlockError(f"block header with more than {MAX_HEADER_CONTAINERS} brackets (kvstore.limits)")
    try:
        raw = json.loads(text)
        shape = tuple(int(x) for x in raw["shape"])
        if len(shape) != 4:
            raise ValueError(f"shape {list(shape)} is not [layers, kv_heads, tokens, head_dim]")
        vdim = raw.get("value_head_dim")
        if vdim is not None and (isinstance(vdim, bool) or not isinstance(vdim, int)):
            raise ValueError(f"value_head_dim {vdim!r} is not an integer")
        header = BlockHeader(
            codec=str(raw["codec"]),
            params=dict(raw["params"]),
            shape=BlockShape(shape, vdim),
            dtype=DTYPES[raw["dtype"]],
            payload_len=int(raw["payload_len"]),
            start_pos=int(raw["start_pos"]),
            token_ids=tuple(int(t) for t in raw["token_ids"]),
            fingerprint=str(raw["fingerprint"]),
            namespace=str(raw["namespace"]),
            key=bytes.fromhex(raw["key"]),
            extra={str(k): str(v) for k, v in raw.get("extra", {}).items()},
        )
    except RecursionError as exc:  # a deeply nested JSON header
        raise CorruptBlockError("unreadable block header: nested too deeply") from exc
    except Exception as exc:  # noqa: BLE001 - whatever the bytes hold, a bad header is a damaged block
        raise CorruptBlockError(f"unreadable block header: {type(exc).__name__}: {exc}"[:500]) from exc
    check_block_fields(codec=header.codec, shapes=[tuple(header.shape), value_shape(header.shape)],
                       itemsize=ITEMSIZES[header.dtype],
                       start_pos=header.start_pos, token_ids=header.token_ids, fingerprint=header.fingerprint,
                       namespace=header.namespace, key=header.key, extra=header.extra, error=CorruptBlockError)
    return header, _PREFIX.size + header_len


def read_header(data: bytes | memoryview) -> BlockHeader:
    """Parse only the header (no checksum over the payload): for bookkeeping, never for serving."""
    return _parse_header(memoryview(data))[0]


def verify_block(
    data: bytes | memoryview,
    *,
    expected_key: bytes | None = None,
    expected_fingerprint: str | None = None,
    expected_namespace: str | None = None,
    digest: bytes | None = None,
    checksum_checked: bool = False,
) -> BlockHeader:
    """Check an encoded block without decoding its tensors: checksum, header, and whose block it is.

    ``digest``: the xxh3-64 of the block's bytes before its checksum, when the caller computed it as they arrived
    (the bytes are then not hashed again). ``checksum_checked``: ``data`` is an immutable copy of bytes whose
    checksum was checked already (``Tier.holds_checked_copies``): it is not recomputed. Raises
    ``CorruptBlockError`` when the bytes are damaged and ``ForeignBlockError`` when they are a valid block of
    another key, model or namespace.
    """
    view = memoryview(data)
    header, payload_start = _parse_header(view)
    body_end = len(view) - _CHECKSUM_BYTES
    if not checksum_checked:
        if digest is None:
            digest = xxhash.xxh3_64_digest(view[:body_end])
        if digest != bytes(view[body_end:]):
            raise CorruptBlockError("block checksum mismatch")
    if body_end - payload_start != header.payload_len:
        raise CorruptBlockError(f"payload is {body_end - payload_start} bytes, header says {header.payload_len}")
    if len(header.token_ids) != header.shape[2]:
        raise CorruptBlockError(f"{len(header.token_ids)} token ids for {header.shape[2]} tokens")
    check_payload_len(header.codec, header.params, header.shape, header.dtype, header.payload_len, CorruptBlockError)
    if expected_key is not None and header.key != expected_key:
        raise ForeignBlockError(f"block was stored under key {header.key.hex()}, not {expected_key.hex()}")
    if expected_fingerprint is not None and header.fingerprint != expected_fingerprint:
        raise ForeignBlockError(f"block belongs to model {header.fingerprint}, not {expected_fingerprint}")
    if expected_namespace is not None and header.namespace != expected_namespace:
        raise ForeignBlockError("block belongs to another namespace")
    return header


def _verified_payload(
    data: bytes | memoryview, expected_key: bytes | None, expected_fingerprint: str | None,
    expected_namespace: str | None, max_decode_bytes: int | None,
) -> tuple[BlockHeader, Codec, memoryview]:
    """``verify_block``, then the block's codec (``header_codec``) and a view of its payload, once its decode cost
    is known to be within ``max_decode_bytes`` (``check_decode_cost``)."""
    view = memoryview(data)
    header = verify_block(view, expected_key=expected_key, expected_fingerprint=expected_fingerprint,
                          expected_namespace=expected_namespace)
    codec = header_codec(header)
    check_decode_cost(header, max_decode_bytes)
    body_end = len(view) - _CHECKSUM_BYTES
    return header, codec, view[body_end - header.payload_len : body_end]


def decode_block(
    data: bytes | memoryview,
    *,
    expected_key: bytes | None = None,
    expected_fingerprint: str | None = None,
    expected_namespace: str | None = None,
    copy: bool = True,
    max_decode_bytes: int | None = None,
) -> KVBlock:
    """Validate (see ``verify_block``) and decode an encoded block.

    With ``copy=False`` tensors may be read-only views of ``data``. ``max_decode_bytes``: a block that may take
    more to decode (``decode_cost_bytes``) is ``BlockTooLargeError``, before anything is allocated for it.
    """
    header, codec, payload = _verified_payload(data, expected_key, expected_fingerprint, expected_namespace,
                                               max_decode_bytes)
    keys, values = codec.decode_at(payload, header.shape, header.dtype, copy, header.start_pos)
    return KVBlock(
        keys=keys,
        values=values,
        token_ids=header.token_ids,
        start_pos=header.start_pos,
        fingerprint=header.fingerprint,
        namespace=header.namespace,
        extra=header.extra,
    )


def prepare_block(
    data: bytes | memoryview,
    *,
    expected_key: bytes | None = None,
    expected_fingerprint: str | None = None,
    expected_namespace: str | None = None,
    max_decode_bytes: int | None = None,
) -> PreparedBlock:
    """Validate (see ``verify_block``) and parse an encoded block for a later ``write`` (``Codec.prepare_at``).

    Damaged payloads raise ``CorruptBlockError`` here, before anything is written. The result may hold views
    of ``data``. ``max_decode_bytes``: as for ``decode_block`` (the cost counts the ``write`` too).
    """
    header, codec, payload = _verified_payload(data, expected_key, expected_fingerprint, expected_namespace,
                                               max_decode_bytes)
    prepared = codec.prepare_at(payload, header.shape, header.dtype, header.start_pos, verified=True)
    return PreparedBlock(payload=prepared, shape=header.shape, dtype=header.dtype, token_ids=header.token_ids,
                         start_pos=header.start_pos, fingerprint=header.fingerprint, namespace=header.namespace)
