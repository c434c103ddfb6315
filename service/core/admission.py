"""What one put holds while its values arrive: in-flight budget (server-wide, and a per-tenant share of
``max_call_bytes``) and the namespace's quota, taken before the bytes they stand for are buffered, so an
over-limit put is refused before it holds memory."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import grpc

from kvshelf.kvstore.keys import KEY_BYTES, BlockKey, scope, scope_tag
from kvshelf.service.core.limits import ServerLimits
from kvshelf.service.status import fail
from kvshelf.service.usage import InflightBudget, NamespaceUsage, TierBytes, add_tier_bytes

LINEAGE_ENTRY_BYTES = 256  # a lineage entry's own objects (dict slot, tuple, key, array header), rounded up


class PutReservation:
    """The budget and quota of one put of ``namespace``, checked against the per-call limit, the in-flight budget
    and the quota before anything is kept (RESOURCE_EXHAUSTED naming which); ``close`` gives everything back.

    A value holds budget and quota from ``start_value`` on, for the sizes ``hold_value`` names (its declared size,
    else what its received messages hold); values announced with their sizes hold them all at once
    (``reserve_declared``). The lineage a value names (parent key, token ids, for its BlockStored events) is held
    until the put ends.
    """

    def __init__(self, limits: ServerLimits, usage: NamespaceUsage, inflight: InflightBudget, namespace: str) -> None:
        self.limits, self.usage, self.inflight = limits, usage, inflight
        self.namespace, self.tag = namespace, scope_tag(namespace)
        self.lineage: dict[bytes, tuple[bytes, array]] = {}  # key -> (parent key, token ids) its first chunk named
        self._key: bytes | None = None  # the value holding now
        self._call_bytes = 0  # bytes of the finished values plus what the current one holds
        self._value_held = 0  # bytes the current value holds (its declared size, else what arrived)
        self._budget = 0  # in-flight budget taken
        self._quota: TierBytes = {}  # quota reserved (the finished values, then the current one)
        self._value_quota: TierBytes = {}

    def start_value(self, key: bytes) -> None:
        """The next value, ``key``'s, starts holding (nothing yet)."""
        self._key, self._value_quota, self._value_held = key, {}, 0

    def keep_lineage(self, key: bytes, parent_key: bytes, token_ids: Sequence[int]) -> None:
        """Keep the ``(parent key, token ids)`` a value names for its BlockStored events, holding budget for them
        (4 bytes a token id) until the put ends."""
        if not (parent_key or token_ids):
            return
        if parent_key and len(parent_key) != KEY_BYTES:
            fail(grpc.StatusCode.INVALID_ARGUMENT,
                 f"parent_key of block {key.hex()} is {len(parent_key)} bytes; block keys are {KEY_BYTES}")
        parent, tokens = bytes(parent_key), array("I", token_ids)
        self.take(len(parent) + tokens.itemsize * len(tokens) + LINEAGE_ENTRY_BYTES)
        self.lineage[key] = (parent, tokens)

    def take(self, nbytes: int) -> None:
        """Hold ``nbytes`` of the put's own (not a value's) against the per-call limit and the in-flight budget."""
        self._check_call(nbytes)
        self.inflight.take(self.tag, self.namespace, nbytes)
        self._budget += nbytes
        self._call_bytes += nbytes

    def _check_call(self, grow: int) -> None:
        if self._call_bytes + grow > self.limits.max_call_bytes:
            fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                 f"one PutBlocks call may hold at most {self.limits.max_call_bytes} bytes (its values, the messages "
                 f"that carry them, and their token ids); this one would hold {self._call_bytes + grow}: split it")

    def hold_value(self, size: int) -> None:
        """Make the current value hold budget and quota for ``size`` bytes (its declared size, or what its
        received messages hold)."""
        grow = size - self._value_held
        if grow <= 0:
            return
        self._check_call(grow)
        if self.limits.quota_bytes is not None:
            assert self._key is not None
            tier_key = scope(self.tag, BlockKey(self._key))
            new = self.usage.reserve(self.tag, self.namespace, [(tier_key, size)], self.limits.quota_bytes,
                                     replacing=self._value_quota)
            add_tier_bytes(self._quota, new, self._value_quota)
            self._value_quota = new
        self.inflight.take(self.tag, self.namespace, grow)
        self._budget += grow
        self._call_bytes += grow
        self._value_held = size

    def reserve_declared(self, sizes: Sequence[tuple[bytes, int]]) -> None:
        """Hold budget and quota for values announced with their sizes (the bulk data path, ``service/bulk/``)
        before any of their bytes arrives: each within the max block size, all within the per-call limit, the
        in-flight budget and the namespace's quota (RESOURCE_EXHAUSTED naming which)."""
        limits = self.limits
        for key, size in sizes:
            if size > limits.max_block_bytes:
                fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                     f"a block of {size} bytes (key {key.hex()}) exceeds the max block size {limits.max_block_bytes}")
        total = sum(size for _, size in sizes)
        self._check_call(total)
        if limits.quota_bytes is not None:
            reserved = self.usage.reserve(self.tag, self.namespace,
                                          [(scope(self.tag, BlockKey(key)), size) for key, size in sizes],
                                          limits.quota_bytes)
            add_tier_bytes(self._quota, reserved, {})
        self.inflight.take(self.tag, self.namespace, total)
        self._budget += total
        self._call_bytes += total

    def hold_more(self, nbytes: int) -> None:
        """Take ``nbytes`` more in-flight budget (the copies a re-encode makes) until the put ends."""
        if nbytes > 0:
            self.inflight.take(self.tag, self.namespace, nbytes)
            self._budget += nbytes

    def reserve_exact(self, sizes: Sequence[tuple[bytes, int | TierBytes]]) -> None:
        """Replace the quota held so far by the exact sizes each tier will store."""
        if self.limits.quota_bytes is None:
            return
        self._quota = self.usage.reserve(self.tag, self.namespace, sizes, self.limits.quota_bytes,
                                         replacing=self._quota)

    def close(self) -> None:
        """Give back the quota and budget held (once; later calls do nothing)."""
        if self._quota:
            self.usage.release(self.tag, self._quota)
            self._quota = {}
        if self._budget:
            self.inflight.give(self.tag, self._budget)
            self._budget = 0
