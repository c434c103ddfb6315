"""A received value checked before it is stored: verified as a block of its key and namespace with a known codec,
and bounded in what it decodes to."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvshelf.kvstore.codec import describe_shape, get_codec
from kvshelf.kvstore.encoding import DTYPE_NAMES, BlockHeader, decode_cost_bytes, verify_block
from kvshelf.kvstore.errors import ConfigError, CorruptBlockError, ForeignBlockError
from kvshelf.kvstore.keys import ScopedKey, unscope
from kvshelf.kvstore.store import TierSpec
from kvshelf.service.status import fail


def verify_value(namespace: str, key: bytes, value: bytes | bytearray, digest: bytes | None = None) -> BlockHeader:
    """The header of a received value once verified as a block of ``key`` in ``namespace`` with a known codec
    (DATA_LOSS, INVALID_ARGUMENT or PERMISSION_DENIED naming what is wrong); ``digest``: the xxh3-64 of its bytes
    before the checksum, when computed as they arrived (see ``verify_block``: the value is then not hashed again)."""
    try:
        header = verify_block(value, expected_key=key, digest=digest)
    except CorruptBlockError as exc:
        fail(grpc.StatusCode.DATA_LOSS, f"value of key {key.hex()} is damaged: {exc}")
    except ForeignBlockError as exc:
        fail(grpc.StatusCode.INVALID_ARGUMENT, f"value sent under key {key.hex()} is another key's: {exc}")
    if header.namespace != namespace:
        fail(grpc.StatusCode.PERMISSION_DENIED,
             f"block {key.hex()} is encoded for namespace {header.namespace!r}, this call is in {namespace!r}")
    try:
        get_codec(header.codec, header.params)
    except ConfigError as exc:
        fail(grpc.StatusCode.INVALID_ARGUMENT, f"block {key.hex()}: {exc}")
    return header


def check_reencode(tier_key: ScopedKey, header: BlockHeader, nbytes: int, targets: Sequence[TierSpec],
                   limit: int) -> None:
    """RESOURCE_EXHAUSTED when the block would decode to more than ``limit`` bytes (the max block size: a tier that
    re-encodes it decodes it; a tier that keeps it as sent hands it to clients that decode it), or a tier that
    re-encodes it would store more: from the declared shape and dtype, before anything is allocated."""
    reencoding = [spec for spec in targets if not spec.stores_as_is(header)]
    decoded = decode_cost_bytes(header)
    stored = max((spec.stored_nbytes(header, nbytes) for spec in reencoding), default=0)
    if max(decoded, stored) <= limit:
        return
    why = (f"(up to {stored} stored) to be re-encoded from {header.codec} for tier(s) "
           f"{', '.join(s.tier.name for s in reencoding)}" if reencoding else f"from {header.codec} once fetched")
    fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
         f"block {unscope(tier_key).hex()} of declared shape {describe_shape(header.shape)} "
         f"{DTYPE_NAMES[header.dtype]} decodes to {decoded} bytes {why}: over the max block size of {limit} bytes")
