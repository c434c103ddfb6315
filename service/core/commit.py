"""A put's verified values stored: re-encodes bounded, the exact sizes each tier will store reserved against the
quota, the lineage its client sent attached to the BlockStored events, then one ``put_verified_many``."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence

import grpc

from kvshelf.kvstore.encoding import BlockHeader
from kvshelf.kvstore.keys import BlockKey, scope
from kvshelf.kvstore.store import TieredStore
from kvshelf.service.core.admission import PutReservation
from kvshelf.service.core.verify import check_reencode
from kvshelf.service.events import EventHub
from kvshelf.service.status import fail
from kvshelf.service.usage import TierBytes


def store_values(store: TieredStore, events: EventHub, call: PutReservation,
                 values: Sequence[tuple[bytes, bytes | bytearray]], headers: Sequence[BlockHeader], pin: bool,
                 active: Callable[[], bool]) -> tuple[int, int]:
    """Store a put's verified values (``headers``: their verified headers, so nothing is hashed again); ``(received,
    stored)``. Nothing is stored when ``active()`` says the call has ended (CANCELLED)."""
    targets = store.write_targets()
    items = [(scope(call.tag, BlockKey(key)), value) for key, value in values]
    sizes: list[tuple[bytes, int | TierBytes]] = []
    reencoded: TierBytes = {}  # per tier: the re-encoded copies it is handed at once
    for (key, value), header in zip(items, headers, strict=True):
        check_reencode(key, header, len(value), targets, call.limits.max_block_bytes)
        per_tier: TierBytes = {spec.tier.name: spec.stored_nbytes(header, len(value)) for spec in targets}
        sizes.append((key, per_tier))
        for spec in targets:
            if not spec.stores_as_is(header):
                reencoded[spec.tier.name] = reencoded.get(spec.tier.name, 0) + per_tier[spec.tier.name]
    call.reserve_exact(sizes)
    call.hold_more(max(reencoded.values(), default=0))  # in-flight budget for the re-encoded copies
    if not active():
        fail(grpc.StatusCode.CANCELLED, "the call was cancelled; nothing stored")
    if call.lineage:  # the BlockStored events carry what the client sent, else what the headers say
        events.annotate(_annotations(items, values, call.lineage))
    # re-encodes are bounded by store.max_decoded_bytes (the max block size)
    stored = store.put_verified_many(items, headers, pin=pin)
    return len(items), stored


def _annotations(items: Sequence[tuple[bytes, bytes | bytearray]], values: Sequence[tuple[bytes, bytes | bytearray]],
                 lineage: dict[bytes, tuple[bytes, array]]) -> Iterator[tuple[bytes, bytes, Sequence[int]]]:
    """``(tier key, parent key, token ids)`` of the stored values whose first chunk named them."""
    for (tier_key, _), (key, _) in zip(items, values, strict=True):
        if key in lineage:
            yield tier_key, *lineage[key]
