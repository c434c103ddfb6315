"""``TieredStore``: the store over ordered tiers, composed of layers (``kvstore.tiered``): the tier stack
(fall-through reads, promotion, write policy), per-tier codecs, pins, counters and events, and the GPU tier
above the stack."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Self, TypeVar

from kvshelf.kvstore.block import KVBlock, PreparedBlock
from kvshelf.kvstore.device_tier import DeviceBlock, DeviceTier
from kvshelf.kvstore.encoding import BlockHeader, decode_block, prepare_block, verify_block
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import TierKey, check_keys
from kvshelf.kvstore.limits import DEFAULT_MAX_DECODE_BYTES
from kvshelf.kvstore.protocol import DEFAULT_NAMESPACE, UNKNOWN_MODEL
from kvshelf.kvstore.stats import UNKNOWN, Counters, Metric, StoreStats
from kvshelf.kvstore.tier import Tier
from kvshelf.kvstore.tiered.codecs import TierSpec, check_reencodes, encode_blocks, header_key, verified_values
from kvshelf.kvstore.tiered.device import DeviceLayer, as_kv_block, as_prepared
from kvshelf.kvstore.tiered.meter import Listener, StoreMeter
from kvshelf.kvstore.tiered.reads import Decode, read_through
from kvshelf.kvstore.tiered.stack import TierStack

__all__ = ["TierSpec", "TieredStore"]
T = TypeVar("T")


class TieredStore:
    """Blocks by key across ordered tiers (fastest first); a ``kvstore.protocol.BlockStore``.

    * ``get_many`` falls through the tiers and promotes hits into the tiers above.
    * ``put_many`` writes through to every tier (``write_policy="through"``) or to the first tier only,
      evicted values moving down one tier (``"back"``).
    * A damaged value is a counted ``corrupt`` miss and is removed from its tier; a value of another key,
      namespace or model is a counted ``foreign`` miss; neither is ever returned.
    * ``namespace``: what reads default to (``namespace=None``). The store holds blocks of every namespace;
      each is written under the namespace its header carries.
    * Keys are 16-byte block keys, or the service's scoped tier keys (an 8-byte namespace tag before the key).
    * Pins name held blocks only: a pinned key that no tier holds any more (a tier dropped it for a value it could not
      hold, no tier took a pinned put, Redis evicted it, a read dropped it as damaged, ``clear_prefix``) loses its pin.
    * ``device_tier`` (decoded blocks in GPU memory) is a layer above the tiers (``device_cache``): puts write
      through to it, ``get_many`` / ``get_prepared_many`` / lookups read it first, ``offer_device`` fills it with
      blocks a load brought up from below; ``get_encoded_many`` (the service's reads) does not read it.
    """

    def __init__(
        self, tiers: Sequence[Tier | TierSpec], write_policy: Literal["through", "back"] = "through", *,
        namespace: str = DEFAULT_NAMESPACE, max_decoded_bytes: int | None = None,
        max_decode_bytes: int | None = DEFAULT_MAX_DECODE_BYTES, device_tier: DeviceTier | None = None,
    ) -> None:
        if not namespace:
            raise ConfigError("namespace must be a non-empty string")
        self.meter = StoreMeter()
        specs = [t if isinstance(t, TierSpec) else TierSpec(t) for t in tiers]
        self._stack = TierStack(specs, write_policy, self.meter,
                                other_names=[device_tier.name] if device_tier is not None else [])
        self.namespace = namespace
        #: the most bytes decoding a value may take (``decode_cost_bytes``) when a tier re-encodes it
        #: (``put_encoded_many``, promotion, write-down); None: unbounded (promotion and write-down: the target
        #: tier's capacity). The service sets its max block size here.
        self.max_decoded_bytes = max_decoded_bytes
        #: the most bytes decoding a value may take on a read (``get_many``, ``get_prepared_many``): a larger one
        #: (its header declares more, whatever tier or writer it came from) is a miss counted as ``rejected`` and
        #: stays in its tier; None: bounded by the header limits only (``kvstore.limits``)
        if max_decode_bytes is not None and max_decode_bytes <= 0:
            raise ConfigError(f"max_decode_bytes must be > 0 (or None), got {max_decode_bytes}")
        self.max_decode_bytes = max_decode_bytes
        self.device_tier = device_tier
        #: the GPU tier's layer (None without one): what a load offers the blocks it brought up to
        self.device_cache = DeviceLayer(device_tier, self.meter) if device_tier is not None else None
        self._closers: list[Callable[[], None]] = []

    @property
    def specs(self) -> list[TierSpec]:
        """The tiers in order, each with its codec."""
        return self._stack.specs

    @property
    def write_policy(self) -> Literal["through", "back"]:
        return self._stack.write_policy

    @property
    def max_decoded_bytes(self) -> int | None:
        return self._stack.max_decoded_bytes

    @max_decoded_bytes.setter
    def max_decoded_bytes(self, value: int | None) -> None:
        self._stack.max_decoded_bytes = value

    @property
    def counters(self) -> Counters:
        return self.meter.counters

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` for every stored/removed/evicted event; returns a function that unsubscribes."""
        return self.meter.subscribe(listener)

    def write_targets(self) -> list[TierSpec]:
        """The tiers a put writes: every tier (write-through) or the first (write-back)."""
        return self._stack.write_targets()

    # -- writes ---------------------------------------------------------------------------------------

    def put_many(self, entries: Sequence[tuple[bytes, KVBlock]], *, pin: bool = False) -> int:
        """Store ``(key, block)`` pairs; return how many the first written tier accepted.

        Raises ``StoreFullError`` if a tier cannot take them even after growing; the other tiers are still
        written and nothing already stored is lost.
        """
        entries = list(entries)
        keys = check_keys((k for k, _ in entries), scoped=True)
        checked = list(zip(keys, (b for _, b in entries), strict=True))
        owners = [(b.namespace, b.fingerprint) for _, b in checked]
        accepted = self._stack.write(encode_blocks(checked), owners, keys, pin)
        if self.device_cache is not None and checked:
            self.device_cache.offer(checked)
        return accepted

    def offer_device(self, entries: Sequence[tuple[bytes, KVBlock]]) -> int:
        """Store ``(key, block)`` pairs in the device tier only (blocks a load decoded from a lower tier; their
        tensors are copied); return how many it took (0 without a device tier)."""
        entries = list(entries)
        if self.device_cache is None or not entries:
            return 0
        keys = check_keys((k for k, _ in entries), scoped=True)
        return self.device_cache.offer(list(zip(keys, (b for _, b in entries), strict=True)))

    def put_encoded_many(self, items: Sequence[tuple[bytes, bytes]], *, pin: bool = False) -> int:
        """Store already-encoded values (from a remote client, say); each is verified first.

        Raises ``CorruptBlockError`` / ``ForeignBlockError`` (nothing stored) if any value is damaged or was
        encoded under another key. Values are re-encoded only for tiers configured with another codec; with
        ``max_decoded_bytes`` set, a value some tier would re-encode whose decoding may take more
        (``decode_cost_bytes``, from its header) is refused with ``BlockTooLargeError`` before anything is decoded
        or stored.
        """
        items = list(items)
        checked = list(zip(check_keys((k for k, _ in items), scoped=True), (v for _, v in items), strict=True))
        headers = [verify_block(value, expected_key=header_key(key)) for key, value in checked]
        return self._put_verified(checked, headers, pin)

    def put_verified_many(self, items: Sequence[tuple[bytes, bytes]], headers: Sequence[BlockHeader], *,
                          pin: bool = False) -> int:
        """``put_encoded_many`` of values the caller has verified: ``headers[i]`` is what ``verify_block`` returned
        for ``items[i]`` under its key (the service verifies each value as it arrives). Keys are checked; values
        are not verified again."""
        items = list(items)
        checked = list(zip(check_keys((k for k, _ in items), scoped=True), (v for _, v in items), strict=True))
        if len(headers) != len(checked):
            raise ValueError(f"{len(checked)} values and {len(headers)} headers")
        return self._put_verified(checked, headers, pin)

    def _put_verified(self, items: list[tuple[TierKey, bytes]], headers: Sequence[BlockHeader], pin: bool) -> int:
        """Store ``items`` (keys checked, values verified: ``headers``)."""
        check_reencodes(items, headers, self.write_targets(), self.max_decoded_bytes)
        owners = [(h.namespace, h.fingerprint) for h in headers]
        return self._stack.write(verified_values(items, headers), owners, [k for k, _ in items], pin)

    # -- reads ----------------------------------------------------------------------------------------

    def lookup_prefix(
        self, keys: Sequence[bytes], *, namespace: str | None = None, model: str = UNKNOWN_MODEL,
        tokens: Sequence[int] | None = None,
    ) -> int:
        """How many of ``keys``, in order, are cached in some tier (blocks may be split across tiers).

        ``namespace`` (default: the store's) and ``model`` name the counters; ``tokens``: tokens per key, to count
        the lookup hit rate in tokens as well as in blocks.
        """
        checked = check_keys(keys, scoped=True)
        above = [self.device_cache] if self.device_cache is not None else []
        found = self._stack.lookup(checked, above)
        self.meter.lookup(namespace or self.namespace, model, len(checked), found, tokens)
        return found

    def get_many(
        self, keys: Sequence[bytes], *, fingerprint: str, namespace: str | None = None, copy: bool = True,
        tokens: Sequence[int] | None = None,
    ) -> list[KVBlock | None]:
        """Blocks for ``keys`` (``None`` for misses). Only blocks of ``fingerprint`` and ``namespace`` (default: the
        store's) are served.

        With ``copy=False`` tensors may be read-only views of stored bytes (faster; never write to them).
        ``tokens``: tokens per key, to count the retrieve hit rate in tokens as well as in blocks.
        """
        namespace = namespace or self.namespace

        def decode(key: bytes, value: bytes) -> KVBlock:
            return decode_block(value, expected_key=header_key(key), expected_fingerprint=fingerprint,
                                expected_namespace=namespace, copy=copy, max_decode_bytes=self.max_decode_bytes)

        return self._read(keys, fingerprint, namespace, functools.partial(as_kv_block, copy=copy), decode, tokens)

    def get_prepared_many(
        self, keys: Sequence[bytes], *, fingerprint: str, namespace: str | None = None,
        tokens: Sequence[int] | None = None,
    ) -> list[PreparedBlock | None]:
        """Like ``get_many``, but blocks are checked and parsed, not materialized: ``block.payload.write`` (or
        ``adapters.cache_bridge.cache_from_prepared``) decodes them straight into a cache."""
        namespace = namespace or self.namespace

        def prepare(key: bytes, value: bytes) -> PreparedBlock:
            return prepare_block(value, expected_key=header_key(key), expected_fingerprint=fingerprint,
                                 expected_namespace=namespace, max_decode_bytes=self.max_decode_bytes)

        return self._read(keys, fingerprint, namespace, as_prepared, prepare, tokens, parallel=True)

    def _read(self, keys: Sequence[bytes], model: str, namespace: str, from_device: Callable[[DeviceBlock], T],
              decode: Decode[T], tokens: Sequence[int] | None, *, parallel: bool = False) -> list[T | None]:
        """The device layer first (when there is one), the keys it misses through the tier stack."""
        checked = check_keys(keys, scoped=True)
        if self.device_cache is None:
            result = read_through(self._stack, checked, model, namespace, decode, parallel=parallel)
        else:
            result, below = self.device_cache.read(checked, model, namespace, from_device)
            if below:
                rest = read_through(self._stack, [checked[j] for j in below], model, namespace, decode,
                                    parallel=parallel)
                for j, value in zip(below, rest, strict=True):
                    result[j] = value
        self.meter.retrieved(namespace, model, result, tokens)
        return result

    def get_encoded_many(
        self, keys: Sequence[bytes], *, fingerprint: str | None = None, namespace: str | None = None,
        tokens: Sequence[int] | None = None,
    ) -> list[bytes | None]:
        """Verified encoded values for ``keys`` (checksum, key, namespace and the fingerprint when given checked;
        tensors not decoded)."""
        namespace = namespace or self.namespace

        def verify(key: bytes, value: bytes, checksum_checked: bool = False) -> bytes:
            verify_block(value, expected_key=header_key(key), expected_fingerprint=fingerprint,
                         expected_namespace=namespace, checksum_checked=checksum_checked)
            return value

        result = read_through(self._stack, check_keys(keys, scoped=True), fingerprint or UNKNOWN, namespace, verify,
                              parallel=True, decode_checked=functools.partial(verify, checksum_checked=True))
        self.meter.retrieved(namespace, fingerprint or UNKNOWN, result, tokens)
        return result

    # -- management -----------------------------------------------------------------------------------

    def held(self, keys: Iterable[bytes], *, namespace: str | None = None) -> list[bool]:
        """Per key: does some reachable tier hold it. Not counted as a lookup. ``namespace`` is accepted for the
        interface: a block key already names its namespace (keys are hashes over it)."""
        checked = check_keys(keys, scoped=True)
        present = self.device_cache.holds(checked) if self.device_cache is not None else [False] * len(checked)
        return self._stack.held(checked, present)

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove ``keys`` (and their pins) from every reachable tier; return how many distinct keys were held."""
        checked = check_keys(keys, scoped=True)
        self.unpin(checked)
        removed = self.device_cache.delete(checked) if self.device_cache is not None else set()
        return len(removed | self._stack.delete(checked))

    def pin(self, keys: Iterable[bytes]) -> int:
        """Pin the held ones of ``keys`` (never evicted from any tier); return how many distinct keys were pinned.

        Absent keys are not pinned: ``put_many(..., pin=True)`` pins blocks as it writes them.
        """
        checked = check_keys(keys, scoped=True)
        held = list(dict.fromkeys(k for k, h in zip(checked, self.held(checked), strict=True) if h))
        self._stack.pins.pin(held)
        return len(held)

    def unpin(self, keys: Iterable[bytes]) -> int:
        """Unpin ``keys``; return how many distinct keys were pinned."""
        return self._stack.pins.unpin(check_keys(keys, scoped=True))

    def clear_prefix(self, prefix: bytes, length: int | None = None) -> int:
        """Remove every block whose key starts with ``prefix`` (a namespace's scope tag; of ``length`` bytes when
        given) from every reachable tier, and drop every pin of such a key (held or not); return how many distinct
        keys some tier held. Each tier finds the keys its own way (``Tier.delete_prefix``: Redis by a matching
        SCAN, without a round trip per key)."""
        if not prefix:
            raise ConfigError("clear_prefix needs a non-empty prefix")
        self.unpin(self._stack.pins.with_prefix(prefix, length))
        removed: set[bytes] = set()
        if self.device_cache is not None:
            removed.update(self.device_cache.delete_prefix(prefix, length))
        return len(removed | self._stack.delete_prefix(prefix, length))

    def is_pinned(self, key: bytes) -> bool:
        return self._stack.pins.is_pinned(key)

    def pinned_keys(self) -> list[bytes]:
        """Every pinned key (a snapshot)."""
        return list(self._stack.pins.keys())

    def typed_stats(self) -> StoreStats:
        """A snapshot: usage and counters per tier, and counter rows per namespace and model."""
        tiers = [self.device_cache.stats()] if self.device_cache is not None else []
        tiers += self._stack.tier_stats()
        self._stack.pins.check_after_losses()
        return StoreStats(
            tiers=tuple(tiers),
            lookup_hit_rate=self.meter.hit_rate(Metric.LOOKUP_HIT_BLOCKS, Metric.LOOKUP_BLOCKS),
            retrieve_hit_rate=self.meter.hit_rate(Metric.RETRIEVE_HIT_BLOCKS, Metric.RETRIEVE_BLOCKS),
            rows=tuple(self.counters.counter_rows()),
            pinned=len(self.pinned_keys()),
        )

    def stats(self) -> dict[str, Any]:
        """``typed_stats()`` as a JSON-ready dict (``StoreStats.as_dict``)."""
        return self.typed_stats().as_dict()

    def on_close(self, closer: Callable[[], None]) -> None:
        """Call ``closer`` when the store closes, before its tiers close (a publisher of its events, say)."""
        self._closers.append(closer)

    def close(self) -> None:
        closers, self._closers = self._closers, []
        for closer in closers:
            closer()
        if self.device_cache is not None:
            self.device_cache.close()
        self._stack.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
