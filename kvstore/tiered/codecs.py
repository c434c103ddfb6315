"""Per-tier codecs: the codec each tier stores its values in (``TierSpec``), encoding a put for every tier,
re-encoding a verified value for a tier of another codec, and the decode bounds that guard re-encoding.

A value's codec is a property of the value (its header), not of the key: a tier keeps a value as it is when the
value is already in the tier's codec (or the tier is ``as_sent``), else the value is decoded and encoded again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.codec import describe_shape, get_codec, payload_len_bounds
from kvshelf.kvstore.encoding import (
    ITEMSIZES,
    BlockHeader,
    decode_block,
    decode_cost_bytes,
    decoded_nbytes,
    encode_block,
    read_header,
    verify_block,
)
from kvshelf.kvstore.errors import BlockTooLargeError, CorruptBlockError, KVShelfError
from kvshelf.kvstore.keys import BlockKey, TierKey, block_key_of
from kvshelf.kvstore.tier import Tier

log = logging.getLogger(__name__)

#: header bytes a re-encoding may add (another codec's name and parameters, a longer payload length)
HEADER_SLACK = 256
#: ``(key, encoded value)`` pairs as a tier stores them
Encoded = list[tuple[TierKey, bytes]]
#: the values a write stores in one tier, by that tier's spec
EncodeFor = Callable[["TierSpec"], Encoded]


def header_key(tier_key: bytes) -> BlockKey:
    """The key an encoded value names in its header: a tier key may carry a scope prefix before it
    (the service prefixes a tag of the tenant's namespace), the header holds the unscoped key
    (``kvstore.keys.block_key_of``)."""
    return block_key_of(tier_key)


def header_of(value: bytes) -> BlockHeader | None:
    """An encoded value's header (None when it has none readable): for the stored events."""
    try:
        return read_header(value)
    except KVShelfError:
        return None


@dataclass
class TierSpec:
    """A tier plus the codec its values are stored in (memory ``raw``, disk and Redis compressed...).

    ``as_sent``: the tier keeps already-encoded values (``put_encoded_many``: a remote client's blocks, and the
    promotions and write-downs of such values) in the codec they come in, never decoding or re-encoding them;
    ``codec`` is then only what the store encodes its own ``put_many`` blocks in. ``kvshelf serve``'s tiers are
    ``as_sent`` unless the operator names a tier codec (``--disk-codec``).
    """

    tier: Tier
    codec: str = "raw"
    codec_params: dict[str, Any] = field(default_factory=dict)
    as_sent: bool = False

    def __post_init__(self) -> None:
        # fail fast on an unknown codec or parameter; keep the full parameters (defaults filled in), the form
        # encoded headers carry, so a value already in this tier's codec is recognised and never re-encoded
        self.codec_params = get_codec(self.codec, self.codec_params).params()

    def same_codec(self, other: TierSpec) -> bool:
        return self.codec == other.codec and self.codec_params == other.codec_params

    @property
    def codec_label(self) -> str:
        """The codec as stats show it: ``as-sent`` for an ``as_sent`` tier."""
        return "as-sent" if self.as_sent else self.codec

    def stores_as_is(self, header: BlockHeader) -> bool:
        """Whether a block with ``header`` is stored in this tier as it is (else it is re-encoded)."""
        return self.as_sent or (header.codec == self.codec and header.params == self.codec_params)

    def stored_nbytes(self, header: BlockHeader, encoded_len: int) -> int:
        """An upper bound of the bytes this tier stores for an encoded block of ``encoded_len`` bytes: the block
        itself, or its re-encoding (the target codec's exact payload size where it can state it, else the
        decoded size), computed from the header alone."""
        if self.stores_as_is(header):
            return encoded_len
        bounds = payload_len_bounds(self.codec, self.codec_params, header.shape, ITEMSIZES[header.dtype])
        payload = bounds[1] if bounds is not None and bounds[1] is not None else decoded_nbytes(header)
        return encoded_len - header.payload_len + payload + HEADER_SLACK

    def reencode_bound(self, max_decoded_bytes: int | None) -> int | None:
        """The most bytes a stored value may decode to for a re-encode into this tier: ``max_decoded_bytes`` (the
        store's bound) and the tier's byte capacity, when either is set."""
        bounds = [b for b in (max_decoded_bytes, getattr(self.tier, "capacity_bytes", None)) if isinstance(b, int)]
        return min(bounds) if bounds else None


def check_decoded_size(header: BlockHeader, key: bytes, bound: int) -> None:
    """``BlockTooLargeError`` when decoding a block of ``header`` may take more than ``bound`` bytes
    (``decode_cost_bytes``: its decoded size plus its codec's working memory, from the header alone)."""
    need = decode_cost_bytes(header)
    if need > bound:
        raise BlockTooLargeError(
            f"block {header_key(key).hex()} of declared shape {describe_shape(header.shape)} needs up to {need} "
            f"bytes to decode ({decoded_nbytes(header)} decoded), more than the limit of {bound} bytes for a block "
            f"re-encoded into another codec")


def reencode(value: bytes, key: bytes, spec: TierSpec) -> bytes:
    """``value`` (verified) decoded and encoded in ``spec``'s codec, its header naming the unscoped key.

    A payload that passed its checksum but does not decode is ``CorruptBlockError``, whatever the codec raised.
    """
    try:
        block = decode_block(value, copy=False)
    except (KVShelfError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - a crafted payload can trip a codec's array code anywhere
        raise CorruptBlockError(f"block {header_key(key).hex()} does not decode: {type(exc).__name__}: {exc}") from exc
    return encode_block(block, header_key(key), spec.codec, spec.codec_params)


def encode_blocks(entries: Sequence[tuple[TierKey, KVBlock]]) -> EncodeFor:
    """``put_many``'s values per tier: the blocks encoded in each tier's codec, once per distinct codec."""
    cache: dict[tuple[str, str], Encoded] = {}

    def encode_for(spec: TierSpec) -> Encoded:
        ident = (spec.codec, json.dumps(spec.codec_params, sort_keys=True))  # nested params (sparse) too
        if ident not in cache:
            cache[ident] = [(k, encode_block(b, header_key(k), spec.codec, spec.codec_params)) for k, b in entries]
        return cache[ident]

    return encode_for


def verified_values(items: Sequence[tuple[TierKey, bytes]], headers: Sequence[BlockHeader]) -> EncodeFor:
    """``put_encoded_many``'s values per tier: each verified value as it is, or re-encoded for a tier of another
    codec."""

    def encode_for(spec: TierSpec) -> Encoded:
        out = []
        for (key, value), header in zip(items, headers, strict=True):
            if not spec.stores_as_is(header):
                value = reencode(value, key, spec)
            out.append((key, value))
        return out

    return encode_for


def check_reencodes(items: Sequence[tuple[TierKey, bytes]], headers: Sequence[BlockHeader],
                    targets: Sequence[TierSpec], bound: int | None) -> None:
    """``BlockTooLargeError`` before anything is decoded or stored when a value some target tier would re-encode
    may take more than ``bound`` bytes to decode (no check when ``bound`` is None)."""
    if bound is None:
        return
    for (key, _), header in zip(items, headers, strict=True):
        if any(not spec.stores_as_is(header) for spec in targets):
            check_decoded_size(header, key, bound)


def promotion_values(spec: TierSpec, hits: Sequence[tuple[TierKey, bytes]], headers: Sequence[BlockHeader],
                     bound: int | None) -> tuple[Encoded, list[int]]:
    """Verified hits of a lower tier as ``spec``'s tier stores them, and the indices of ``hits`` they are. A
    value is never decoded for a tier it cannot fit in (or past ``bound``): its promotion is skipped; one that
    fails to re-encode is skipped too (the lower tier served it all the same)."""
    encoded: Encoded = []
    kept: list[int] = []
    for i, ((key, value), header) in enumerate(zip(hits, headers, strict=True)):
        if not spec.stores_as_is(header):  # each value's own codec decides (an as_sent tier holds any codec)
            try:
                if bound is not None:
                    check_decoded_size(header, key, bound)
                value = reencode(value, key, spec)
            except BlockTooLargeError:
                continue
            except KVShelfError as exc:
                log.warning("tier %s: block %s not promoted: %s", spec.tier.name, key.hex(), exc)
                continue
        encoded.append((key, value))
        kept.append(i)
    return encoded, kept


def write_down_value(lower: TierSpec, key: bytes, value: bytes, bound: int | None) -> bytes | None:
    """An evicted ``value`` as the tier below (``lower``) stores it: as it is, or verified and re-encoded
    within ``bound``; None (logged) when it cannot be."""
    try:  # the value's own codec decides (an as_sent tier above holds values of any codec)
        as_is = lower.stores_as_is(read_header(value))
    except KVShelfError:
        as_is = False  # verified below, and not written down
    if as_is:
        return value
    try:
        header = verify_block(value, expected_key=header_key(key))
        if bound is not None:
            check_decoded_size(header, key, bound)
        return reencode(value, key, lower)
    except KVShelfError as exc:
        log.warning("tier %s: block %s not written down: %s", lower.tier.name, key.hex(), exc)
        return None
