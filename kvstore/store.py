"""``TieredStore``: ordered tiers with read-through promotion, write-through (or write-back), pinning,
per-tier counters and stored/removed/evicted events."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal, Self, TypeVar

from kvshelf.kvstore.block import KVBlock, PreparedBlock
from kvshelf.kvstore.codec import BlockShape, DecodedPayload, describe_shape, get_codec, payload_len_bounds
from kvshelf.kvstore.device_tier import DeviceTier
from kvshelf.kvstore.encoding import (
    ITEMSIZES,
    BlockHeader,
    decode_block,
    decode_cost_bytes,
    decoded_nbytes,
    encode_block,
    prepare_block,
    read_header,
    verify_block,
)
from kvshelf.kvstore.errors import (
    BlockTooLargeError,
    ConfigError,
    CorruptBlockError,
    ForeignBlockError,
    KVShelfError,
    StoreFullError,
    TierDamagedError,
    TierUnavailableError,
)
from kvshelf.kvstore.keys import BlockKey, block_key_of, check_keys
from kvshelf.kvstore.limits import DEFAULT_MAX_DECODE_BYTES
from kvshelf.kvstore.protocol import DEFAULT_NAMESPACE, UNKNOWN_MODEL
from kvshelf.kvstore.stats import (
    ALL_TIERS,
    TIER_STATS_METRICS,
    UNKNOWN,
    Counters,
    Metric,
    StoreEvent,
    StoreStats,
    TierStats,
)
from kvshelf.kvstore.tier import Tier, TierUsage

log = logging.getLogger(__name__)
UNAVAILABLE_LOG_INTERVAL_S = 30.0  # an unreachable tier is logged at most this often
Listener = Callable[[StoreEvent], None]
T = TypeVar("T")


def _header_of(value: bytes) -> BlockHeader | None:
    """An encoded value's header (None when it has none readable): for the stored events."""
    try:
        return read_header(value)
    except KVShelfError:
        return None


def header_key(tier_key: bytes) -> BlockKey:
    """The key an encoded value names in its header: a tier key may carry a scope prefix before it
    (the service prefixes a tag of the tenant's namespace), the header holds the unscoped key
    (``kvstore.keys.block_key_of``)."""
    return block_key_of(tier_key)


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
        return encoded_len - header.payload_len + payload + _HEADER_SLACK


#: header bytes a re-encoding may add (another codec's name and parameters, a longer payload length)
_HEADER_SLACK = 256


_PARALLEL_MIN_BYTES = 1 << 20


def decode_all(decode: Callable[[bytes, bytes], T], keys: Sequence[bytes], values: Sequence[bytes | None],
                *, parallel: bool) -> list[T | BaseException | None]:
    """``decode`` every present value: the result, or the exception it raised (``None`` for a missing value).

    With ``parallel``, several large values are decoded by a few threads: for decoders that do no torch work
    (checksums, zstd, numpy and numba release the GIL), so the entropy decoding of a long prefix uses every core
    without a second OpenMP team competing with the caller's. The threads exit when the call ends: idle threads
    kept in a pool after decoding xquant blocks left every later forward pass of the model 20-40 ms slower
    (measured A/B in one process; starting them costs ~0.1 ms).
    """

    def one(key: bytes, value: bytes | None) -> T | BaseException | None:
        if value is None:
            return None
        try:
            return decode(key, value)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller, which sorts them out
            return exc

    present = [v for v in values if v is not None]
    if not parallel or len(present) < 2 or sum(len(v) for v in present) < _PARALLEL_MIN_BYTES:
        return [one(k, v) for k, v in zip(keys, values, strict=True)]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="kvshelf-decode") as pool:
        return list(pool.map(one, keys, values))


def _check_decoded_size(header: BlockHeader, key: bytes, bound: int) -> None:
    """``BlockTooLargeError`` when decoding a block of ``header`` may take more than ``bound`` bytes
    (``decode_cost_bytes``: its decoded size plus its codec's working memory, from the header alone)."""
    need = decode_cost_bytes(header)
    if need > bound:
        raise BlockTooLargeError(
            f"block {header_key(key).hex()} of declared shape {describe_shape(header.shape)} needs up to {need} "
            f"bytes to decode ({decoded_nbytes(header)} decoded), more than the limit of {bound} bytes for a block "
            f"re-encoded into another codec")


def _reencode(value: bytes, key: bytes, spec: TierSpec) -> bytes:
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
    * ``device_tier`` (``kvstore.device_tier``: decoded blocks in GPU memory) sits above the tiers: every put writes
      through to it, ``get_many`` / ``get_prepared_many`` / lookups read it first, and ``offer_device`` fills it
      with blocks a load brought up from below. It is a cache of decoded tensors: never pinned, evicted blocks
      dropped (the tiers below hold them), no store events; its hits, misses and writes are counted under its name.
      ``get_encoded_many`` (the service's reads) does not read it.
    """

    def __init__(
        self, tiers: Sequence[Tier | TierSpec], write_policy: Literal["through", "back"] = "through", *,
        namespace: str = DEFAULT_NAMESPACE, max_decoded_bytes: int | None = None,
        max_decode_bytes: int | None = DEFAULT_MAX_DECODE_BYTES, device_tier: DeviceTier | None = None,
    ) -> None:
        if not namespace:
            raise ConfigError("namespace must be a non-empty string")
        if not tiers:
            raise ConfigError("a TieredStore needs at least one tier")
        if write_policy not in ("through", "back"):
            raise ConfigError(f"write_policy must be 'through' or 'back', got {write_policy!r}")
        self.specs = [t if isinstance(t, TierSpec) else TierSpec(t) for t in tiers]
        names = [s.tier.name for s in self.specs] + ([device_tier.name] if device_tier is not None else [])
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        self.write_policy = write_policy
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
        self.counters = Counters()
        self._listeners: list[Listener] = []
        self._closers: list[Callable[[], None]] = []
        self._pinned: set[bytes] = set()
        self._loss_epochs: dict[str, int] = {}  # tier -> its loss_epoch when the pins were last checked
        self._lock = threading.Lock()
        self._damaged_logged: set[str] = set()
        self._unavailable_log: dict[str, tuple[float, int]] = {}  # tier -> (last warning, failures unlogged since)
        if device_tier is not None:
            device_tier.set_eviction_callback(
                lambda _, b: self.counters.add(device_tier.name, b.namespace, b.fingerprint, Metric.EVICTIONS))
        for index, spec in enumerate(self.specs):
            spec.tier.set_eviction_callback(lambda k, v, i=index: self._on_evict(i, k, v))
            spec.tier.pin(self._pinned)

    # -- events ---------------------------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` for every stored/removed/evicted event; returns a function that unsubscribes."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def _emit(self, event: StoreEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a listener must never break the store
                log.exception("store event listener failed")

    # -- writes ---------------------------------------------------------------------------------------

    def put_many(self, entries: Sequence[tuple[bytes, KVBlock]], *, pin: bool = False) -> int:
        """Store ``(key, block)`` pairs; return how many the first written tier accepted.

        Raises ``StoreFullError`` if a tier cannot take them even after growing; the other tiers are still
        written and nothing already stored is lost.
        """
        entries = list(entries)
        check_keys((k for k, _ in entries), scoped=True)
        cache: dict[tuple, list[tuple[bytes, bytes]]] = {}

        def encode_for(spec: TierSpec) -> list[tuple[bytes, bytes]]:
            ident = (spec.codec, json.dumps(spec.codec_params, sort_keys=True))  # nested params (sparse) too
            if ident not in cache:
                cache[ident] = [(k, encode_block(b, header_key(k), spec.codec, spec.codec_params)) for k, b in entries]
            return cache[ident]

        owners = [(b.namespace, b.fingerprint) for _, b in entries]
        accepted = self._write(encode_for, owners, [k for k, _ in entries], pin)
        self.offer_device(entries)
        return accepted

    def offer_device(self, entries: Sequence[tuple[bytes, KVBlock]]) -> int:
        """Store ``(key, block)`` pairs in the device tier only (blocks a load decoded from a lower tier; their
        tensors are copied); return how many it took (0 without a device tier)."""
        tier = self.device_tier
        if tier is None or not entries:
            return 0
        stored = tier.put_many(entries)
        if stored:
            held = tier.get_many([k for k, _ in entries]) if stored < len(entries) else None
            for i, (_, block) in enumerate(entries):
                if held is None or held[i] is not None:
                    self.counters.add(tier.name, block.namespace, block.fingerprint, Metric.BLOCKS_WRITTEN)
                    self.counters.add(tier.name, block.namespace, block.fingerprint, Metric.BYTES_WRITTEN,
                                      block.nbytes)
        return stored

    def write_targets(self) -> list[TierSpec]:
        """The tiers a put writes: every tier (write-through) or the first (write-back)."""
        return self.specs if self.write_policy == "through" else self.specs[:1]

    def put_encoded_many(self, items: Sequence[tuple[bytes, bytes]], *, pin: bool = False) -> int:
        """Store already-encoded values (from a remote client, say); each is verified first.

        Raises ``CorruptBlockError`` / ``ForeignBlockError`` (nothing stored) if any value is damaged or was
        encoded under another key. Values are re-encoded only for tiers configured with another codec; with
        ``max_decoded_bytes`` set, a value some tier would re-encode whose decoding may take more
        (``decode_cost_bytes``, from its header) is refused with ``BlockTooLargeError`` before anything is decoded
        or stored.
        """
        items = list(items)
        check_keys((k for k, _ in items), scoped=True)
        headers = [verify_block(value, expected_key=header_key(key)) for key, value in items]
        return self._put_verified(items, headers, pin)

    def put_verified_many(self, items: Sequence[tuple[bytes, bytes]], headers: Sequence[BlockHeader], *,
                          pin: bool = False) -> int:
        """``put_encoded_many`` of values the caller has verified: ``headers[i]`` is what ``verify_block`` returned
        for ``items[i]`` under its key (the service verifies each value as it arrives; hashing 8 MiB again costs
        about a millisecond). Keys are checked; values are not verified again."""
        items = list(items)
        check_keys((k for k, _ in items), scoped=True)
        if len(headers) != len(items):
            raise ValueError(f"{len(items)} values and {len(headers)} headers")
        return self._put_verified(items, headers, pin)

    def _put_verified(self, items: list[tuple[bytes, bytes]], headers: Sequence[BlockHeader], pin: bool) -> int:
        """Store ``items`` (keys checked, values verified: ``headers``)."""
        if self.max_decoded_bytes is not None:
            for (key, _), header in zip(items, headers, strict=True):
                if any(not spec.stores_as_is(header) for spec in self.write_targets()):
                    _check_decoded_size(header, key, self.max_decoded_bytes)

        def encode_for(spec: TierSpec) -> list[tuple[bytes, bytes]]:
            out = []
            for (key, value), header in zip(items, headers, strict=True):
                if not spec.stores_as_is(header):
                    value = _reencode(value, key, spec)
                out.append((key, value))
            return out

        owners = [(h.namespace, h.fingerprint) for h in headers]
        return self._write(encode_for, owners, [k for k, _ in items], pin)

    def _write(self, encode_for: Callable[[TierSpec], list[tuple[bytes, bytes]]],
               owners: list[tuple[str, str]], keys: list[bytes], pin: bool) -> int:
        if not keys:
            return 0
        if pin:  # before the write, so that making room for these never evicts them
            self._pin_all(keys)
        targets = self.write_targets()
        accepted, full_error = 0, None
        missed: list[bytes] = []  # keys some tier did not take: pinned ones no tier holds lose their pin
        for n, spec in enumerate(targets):
            encoded = encode_for(spec)
            try:
                stored = spec.tier.put_many(encoded)
            except StoreFullError as exc:
                full_error = exc
                stored = 0
            except TierUnavailableError as exc:
                self._unavailable(spec, exc)
                continue
            if n == 0:
                accepted = stored
            rejected = self._count_writes(spec, encoded, owners, stored)
            missed += [key for key, _ in rejected]
            if self.write_policy == "back" and rejected and len(self.specs) > 1:
                # what the first tier cannot hold (too large, or room only by evicting pins) goes one tier down
                for key, value in rejected:
                    self._write_down(0, key, value)
        if pin:  # again: an eviction report racing this write may have found the key held nowhere yet
            self._pin_all(keys)
        if missed or full_error is not None:
            self._forget_pins(missed if full_error is None else keys)
        if full_error is not None:
            raise full_error
        return accepted

    def _count_writes(
        self, spec: TierSpec, encoded: list[tuple[bytes, bytes]], owners: list[tuple[str, str]], stored: int
    ) -> list[tuple[bytes, bytes]]:
        """Count and announce what ``spec``'s tier stored; return the ``(key, value)`` pairs it rejected."""
        name = spec.tier.name
        # a tier that stored fewer than offered rejected the rest (too large, or room only by evicting pins)
        try:
            present = spec.tier.get_many([k for k, _ in encoded]) if stored < len(encoded) else None
        except TierUnavailableError as exc:  # it stopped answering: count none of them stored
            self._unavailable(spec, exc)
            present = [None] * len(encoded)
        rejected = []
        for i, ((key, value), (ns, model)) in enumerate(zip(encoded, owners, strict=True)):
            if present is not None and present[i] is None:
                self.counters.add(name, ns, model, Metric.REJECTED)
                rejected.append((key, value))
                continue
            self.counters.add(name, ns, model, Metric.BLOCKS_WRITTEN)
            self.counters.add(name, ns, model, Metric.BYTES_WRITTEN, len(value))
            header = _header_of(value)
            self._emit(StoreEvent("stored", name, key, len(value), ns, model, header.codec if header else "", header))
        return rejected

    def _on_evict(self, index: int, key: bytes, value: bytes) -> None:
        spec = self.specs[index]
        codec = ""
        try:
            header = read_header(value)
            ns, model, codec = header.namespace, header.fingerprint, header.codec
        except KVShelfError:
            ns = model = UNKNOWN
        self.counters.add(spec.tier.name, ns, model, Metric.EVICTIONS)
        self._emit(StoreEvent("evicted", spec.tier.name, key, len(value), ns, model, codec))
        # an empty value: the medium evicted it on its own (Redis's maxmemory) and it is gone: nothing to write down
        if value and self.write_policy == "back" and index + 1 < len(self.specs):
            self._write_down(index, key, value)
        self._forget_pins([key])

    def _reencode_bound(self, spec: TierSpec) -> int | None:
        """The most bytes a stored value may decode to for a re-encode into ``spec``'s tier: the store's bound
        and the tier's byte capacity, when either is set."""
        bounds = [b for b in (self.max_decoded_bytes, getattr(spec.tier, "capacity_bytes", None))
                  if isinstance(b, int)]
        return min(bounds) if bounds else None

    def _write_down(self, index: int, key: bytes, value: bytes) -> None:
        lower = self.specs[index + 1]
        try:  # the value's own codec decides (an as_sent tier above holds values of any codec)
            as_is = lower.stores_as_is(read_header(value))
        except KVShelfError:
            as_is = False  # verified below, and not written down
        if not as_is:
            try:
                header = verify_block(value, expected_key=header_key(key))
                bound = self._reencode_bound(lower)
                if bound is not None:
                    _check_decoded_size(header, key, bound)
                value = _reencode(value, key, lower)
            except KVShelfError as exc:
                log.warning("tier %s: block %s not written down: %s", lower.tier.name, key.hex(), exc)
                return
        try:
            stored = lower.tier.put_many([(key, value)])
        except TierUnavailableError as exc:  # unreachable or damaged: the block leaves the store, counted
            self._unavailable(lower, exc)
            return
        if stored:
            header = read_header(value)
            self.counters.add(lower.tier.name, header.namespace, header.fingerprint, Metric.BLOCKS_WRITTEN)
            self.counters.add(lower.tier.name, header.namespace, header.fingerprint, Metric.BYTES_WRITTEN, len(value))
            self._emit(StoreEvent("stored", lower.tier.name, key, len(value), header.namespace, header.fingerprint,
                                  header.codec, header))

    # -- reads ----------------------------------------------------------------------------------------

    def lookup_prefix(
        self, keys: Sequence[bytes], *, namespace: str | None = None, model: str = UNKNOWN_MODEL,
        tokens: Sequence[int] | None = None,
    ) -> int:
        """How many of ``keys``, in order, are cached in some tier (blocks may be split across tiers).

        ``namespace`` (default: the store's) and ``model`` name the counters; ``tokens``: tokens per key, to count
        the lookup hit rate in tokens as well as in blocks.
        """
        keys = check_keys(keys, scoped=True)
        namespace = namespace or self.namespace
        n, progress = 0, True
        while progress and n < len(keys):
            progress = False
            for spec in self._lookup_order():
                try:
                    found = spec.tier.contains_many(keys[n:])
                except TierUnavailableError as exc:
                    self._unavailable(spec, exc)
                    continue
                if found:
                    n += found
                    progress = True
                    if n == len(keys):
                        break
        self.counters.add(ALL_TIERS, namespace, model, Metric.LOOKUP_BLOCKS, len(keys))
        self.counters.add(ALL_TIERS, namespace, model, Metric.LOOKUP_HIT_BLOCKS, n)
        if tokens is not None:
            self.counters.add(ALL_TIERS, namespace, model, Metric.LOOKUP_TOKENS, sum(tokens))
            self.counters.add(ALL_TIERS, namespace, model, Metric.LOOKUP_HIT_TOKENS, sum(tokens[:n]))
        return n

    contains_many = lookup_prefix

    def _lookup_order(self) -> list[Any]:
        """The tiers a lookup asks, the device tier first (as a spec-like object: ``.tier``)."""
        if self.device_tier is None:
            return self.specs
        return [SimpleNamespace(tier=self.device_tier), *self.specs]

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

        def from_device(block: Any) -> KVBlock:  # the tier's own tensors (on its device): a copy unless told
            if not copy:
                return block.as_block()
            return KVBlock(block.keys.clone(), block.values.clone(), block.token_ids, block.start_pos,
                           block.fingerprint, block.namespace)

        return self._fetch_through_device(keys, fingerprint, namespace, from_device, decode, tokens)

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

        def from_device(block: Any) -> PreparedBlock:  # written by a device-to-device copy
            return PreparedBlock(payload=DecodedPayload(block.keys, block.values),
                                 shape=BlockShape(block.keys.shape, block.values.shape[3]), dtype=block.keys.dtype,
                                 token_ids=block.token_ids, start_pos=block.start_pos,
                                 fingerprint=block.fingerprint, namespace=block.namespace)

        return self._fetch_through_device(keys, fingerprint, namespace, from_device, prepare, tokens, parallel=True)

    def _fetch_through_device(
        self, keys: Sequence[bytes], model: str, namespace: str, from_device: Callable[[Any], T],
        decode: Callable[[bytes, bytes], T], tokens: Sequence[int] | None = None, *, parallel: bool = False,
    ) -> list[T | None]:
        """``_fetch`` with the device tier read first (a block of another model or namespace there is a counted
        ``foreign`` miss); the keys it misses go to the tiers below."""
        tier = self.device_tier
        if tier is None:
            return self._fetch(keys, model, namespace, decode, tokens, parallel=parallel)
        keys = check_keys(keys, scoped=True)
        result: list[T | None] = [None] * len(keys)
        below: list[int] = []
        for j, block in enumerate(tier.get_many(keys)):
            if block is not None and (block.fingerprint != model or block.namespace != namespace):
                self.counters.add(tier.name, namespace, model, Metric.FOREIGN)
                block = None
            if block is None:
                below.append(j)
                continue
            result[j] = from_device(block)
            self.counters.add(tier.name, namespace, model, Metric.BYTES_READ, block.nbytes)
        hits = len(keys) - len(below)
        self.counters.add(tier.name, namespace, model, Metric.HITS, hits)
        self.counters.add(tier.name, namespace, model, Metric.MISSES, len(below))
        if hits:  # the device tier's share of the retrieve counts (``_fetch`` counts the rest)
            self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_BLOCKS, hits)
            self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_HIT_BLOCKS, hits)
            if tokens is not None:
                hit_tokens = sum(tokens) - sum(tokens[j] for j in below)
                self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_TOKENS, hit_tokens)
                self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_HIT_TOKENS, hit_tokens)
        if below:
            rest = self._fetch([keys[j] for j in below], model, namespace, decode,
                               [tokens[j] for j in below] if tokens is not None else None, parallel=parallel)
            for j, value in zip(below, rest, strict=True):
                result[j] = value
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

        return self._fetch(keys, fingerprint or UNKNOWN, namespace, verify, tokens, parallel=True,
                           decode_checked=functools.partial(verify, checksum_checked=True))

    def _fetch(
        self, keys: Sequence[bytes], model: str, namespace: str, decode: Callable[[bytes, bytes], T],
        tokens: Sequence[int] | None = None, *, parallel: bool = False,
        decode_checked: Callable[[bytes, bytes], T] | None = None,
    ) -> list[T | None]:
        """``decode``d values of ``keys`` from the first tier holding each (counted; damaged and foreign values are
        misses, a damaged one removed); hits of a lower tier are promoted. ``decode_checked``, when given, decodes
        the values of a tier that ``holds_checked_copies`` instead."""
        keys = check_keys(keys, scoped=True)
        result: list[T | None] = [None] * len(keys)
        remaining = list(range(len(keys)))
        for index, spec in enumerate(self.specs):
            if not remaining:
                break
            name = spec.tier.name
            try:
                values = spec.tier.get_many([keys[j] for j in remaining])
            except TierUnavailableError as exc:
                self._unavailable(spec, exc)
                continue
            missed, promote = [], []
            checked = decode_checked is not None and spec.tier.holds_checked_copies
            # a checked copy's check is a header parse, all of it Python: threads would only add their start-up
            outcomes = decode_all(decode_checked if checked else decode, [keys[j] for j in remaining], values,
                                  parallel=parallel and not checked)
            for j, value, outcome in zip(remaining, values, outcomes, strict=True):
                if value is None:
                    missed.append(j)
                    continue
                try:
                    if isinstance(outcome, BaseException):
                        raise outcome
                    result[j] = outcome
                except ForeignBlockError:
                    self.counters.add(name, namespace, model, Metric.FOREIGN)
                    missed.append(j)
                    continue
                except BlockTooLargeError as exc:  # within the header limits, over this reader's: kept for others
                    log.warning("tier %s: not decoding block %s: %s", name, keys[j].hex(), exc)
                    self.counters.add(name, namespace, model, Metric.REJECTED)
                    missed.append(j)
                    continue
                except KVShelfError as exc:
                    log.warning("tier %s: dropping damaged block %s: %s", name, keys[j].hex(), exc)
                    self.counters.add(name, namespace, model, Metric.CORRUPT)
                    try:
                        self._delete_from(spec, [keys[j]])
                    except TierUnavailableError as exc:
                        self._unavailable(spec, exc)
                    self._forget_pins([keys[j]])
                    missed.append(j)
                    continue
                self.counters.add(name, namespace, model, Metric.BYTES_READ, len(value))
                promote.append((keys[j], value))
            self.counters.add(name, namespace, model, Metric.HITS, len(remaining) - len(missed))
            self.counters.add(name, namespace, model, Metric.MISSES, len(missed))
            if index > 0 and promote:
                self._promote(index, promote)
            remaining = missed
        self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_BLOCKS, len(keys))
        self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_HIT_BLOCKS, len(keys) - len(remaining))
        if tokens is not None:
            missed_tokens = sum(tokens[j] for j in remaining)
            self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_TOKENS, sum(tokens))
            self.counters.add(ALL_TIERS, namespace, model, Metric.RETRIEVE_HIT_TOKENS, sum(tokens) - missed_tokens)
        return result

    def _promote(self, found_in: int, hits: list[tuple[bytes, bytes]]) -> None:
        """Copy verified ``(key, value)`` hits of tier ``found_in`` into every tier above it."""
        headers = [read_header(v) for _, v in hits]
        owners = [(h.namespace, h.fingerprint) for h in headers]
        for spec in self.specs[:found_in]:
            encoded, spec_owners = hits, owners
            # each value's own codec decides (an as_sent tier holds values of any codec)
            if not all(map(spec.stores_as_is, headers)):
                bound = self._reencode_bound(spec)
                # never decode a value for a tier it cannot fit in (or past the store's bound): skip its promotion
                encoded, spec_owners = [], []
                for i, ((key, value), header) in enumerate(zip(hits, headers, strict=True)):
                    if spec.stores_as_is(header):
                        encoded.append((key, value))
                        spec_owners.append(owners[i])
                        continue
                    try:
                        if bound is not None:
                            _check_decoded_size(header, key, bound)
                        encoded.append((key, _reencode(value, key, spec)))
                    except BlockTooLargeError:
                        continue
                    except KVShelfError as exc:  # served from the lower tier all the same
                        log.warning("tier %s: block %s not promoted: %s", spec.tier.name, key.hex(), exc)
                        continue
                    spec_owners.append(owners[i])
                if not encoded:
                    continue
            try:
                stored = spec.tier.put_many(encoded)
            except StoreFullError:
                continue
            except TierUnavailableError as exc:
                self._unavailable(spec, exc)
                continue
            self._count_writes(spec, encoded, spec_owners, stored)

    def _unavailable(self, spec: TierSpec, exc: TierUnavailableError) -> None:
        """An unreachable or damaged tier is skipped (reads miss, writes go to the other tiers) and counted as
        ``unavailable``; a damaged one is logged once (every later call fails fast with the same error)."""
        if not isinstance(exc, TierDamagedError):
            self._log_unavailable(spec.tier.name, exc)
        elif spec.tier.name not in self._damaged_logged:
            self._damaged_logged.add(spec.tier.name)
            log.error("tier %s is damaged, skipped until repaired (the other tiers serve): %s", spec.tier.name, exc)
        self.counters.add(spec.tier.name, UNKNOWN, UNKNOWN, Metric.UNAVAILABLE)

    def _log_unavailable(self, name: str, exc: TierUnavailableError) -> None:
        """One warning per tier every ``UNAVAILABLE_LOG_INTERVAL_S`` while it stays unreachable (a dead Redis under
        load otherwise logs a line per call), naming how many failures went unlogged in between."""
        now = time.monotonic()
        with self._lock:
            last, unlogged = self._unavailable_log.get(name, (-UNAVAILABLE_LOG_INTERVAL_S, 0))
            if now - last < UNAVAILABLE_LOG_INTERVAL_S:
                self._unavailable_log[name] = (last, unlogged + 1)
                return
            self._unavailable_log[name] = (now, 0)
        more = f" ({unlogged} more failures since the last message)" if unlogged else ""
        log.warning("tier %s unavailable: %s%s", name, exc, more)

    # -- management -----------------------------------------------------------------------------------

    def _delete_from(self, spec: TierSpec, keys: list[bytes]) -> list[bytes]:
        """Remove ``keys`` from one tier; return those it held."""
        present = [key for key in keys if spec.tier.contains_many([key])]  # a "removed" event per held value
        removed = spec.tier.delete(present)
        if removed:
            for key in present:
                self._emit(StoreEvent("removed", spec.tier.name, key, 0))
        return present

    def held(self, keys: Iterable[bytes], *, namespace: str | None = None) -> list[bool]:
        """Per key: does some reachable tier hold it. Not counted as a lookup. ``namespace`` is accepted for the
        interface: a block key already names its namespace (keys are hashes over it)."""
        keys = check_keys(keys, scoped=True)
        present = [False] * len(keys)
        for spec in self._lookup_order():
            for i, key in enumerate(keys):
                if present[i]:
                    continue
                try:
                    present[i] = spec.tier.contains_many([key]) == 1
                except TierUnavailableError:
                    break
        return present

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove ``keys`` (and their pins) from every reachable tier; return how many distinct keys were held."""
        keys = check_keys(keys, scoped=True)
        self.unpin(keys)
        removed: set[bytes] = set()
        if self.device_tier is not None:
            removed.update(k for k in keys if self.device_tier.delete([k]))
        for spec in self.specs:
            try:
                removed.update(self._delete_from(spec, keys))
            except TierUnavailableError as exc:
                self._unavailable(spec, exc)
        return len(removed)

    def pin(self, keys: Iterable[bytes]) -> int:
        """Pin the held ones of ``keys`` (never evicted from any tier); return how many distinct keys were pinned.

        Absent keys are not pinned: ``put_many(..., pin=True)`` pins blocks as it writes them.
        """
        keys = check_keys(keys, scoped=True)
        held = list(dict.fromkeys(k for k, h in zip(keys, self.held(keys), strict=True) if h))
        self._pin_all(held)
        return len(held)

    def _pin_all(self, keys: list[bytes]) -> None:
        with self._lock:
            self._pinned.update(keys)
        for spec in self.specs:
            spec.tier.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> int:
        """Unpin ``keys``; return how many distinct keys were pinned."""
        keys = check_keys(keys, scoped=True)
        with self._lock:
            was = self._pinned.intersection(keys)
            self._pinned.difference_update(was)
        for spec in self.specs:
            spec.tier.unpin(keys)
        return len(was)

    def _forget_pins(self, keys: Sequence[bytes]) -> None:
        """Unpin those of ``keys`` that are pinned and that no tier holds any more (evicted where a pin could not
        keep them, refused, dropped as damaged, evicted by Redis), so the pinned set names only held blocks. A tier
        that cannot be asked (unreachable) may hold it: the pin stays."""
        with self._lock:
            pinned = [key for key in dict.fromkeys(keys) if key in self._pinned]
        if not pinned:
            return
        gone = []
        for key in pinned:
            held = False
            for spec in self.specs:
                try:
                    held = spec.tier.contains_many([key]) == 1
                except (TierUnavailableError, TierDamagedError):
                    held = True
                if held:
                    break
            if not held:
                gone.append(key)
        if gone:
            self.unpin(gone)

    def _check_pins_after_losses(self) -> None:
        """Every pin checked again (``_forget_pins``) when a tier says it lost values without reporting each one
        (its ``loss_epoch`` grew: a Redis tier rebuilt its usage registry, which Redis had evicted): rare, and
        then one ``contains`` per pinned key the tiers above do not hold."""
        changed = False
        for spec in self.specs:
            epoch = getattr(spec.tier, "loss_epoch", None)
            if isinstance(epoch, int) and self._loss_epochs.get(spec.tier.name, 0) != epoch:
                self._loss_epochs[spec.tier.name] = epoch
                changed = True
        if changed:
            self._forget_pins(self.pinned_keys())

    def clear_prefix(self, prefix: bytes, length: int | None = None) -> int:
        """Remove every block whose key starts with ``prefix`` (a namespace's scope tag; of ``length`` bytes when
        given) from every reachable tier, and drop every pin of such a key (held or not); return how many distinct
        keys some tier held. Each tier finds the keys its own way (``Tier.delete_prefix``: Redis by a matching
        SCAN, without a round trip per key)."""
        if not prefix:
            raise ConfigError("clear_prefix needs a non-empty prefix")
        with self._lock:
            pins = [k for k in self._pinned if k.startswith(prefix) and (length is None or len(k) == length)]
        self.unpin(pins)
        removed: set[bytes] = set()
        if self.device_tier is not None:
            removed.update(self.device_tier.delete_prefix(prefix, length))
        for spec in self.specs:
            try:
                keys = spec.tier.delete_prefix(prefix, length)
            except TierUnavailableError as exc:
                self._unavailable(spec, exc)
                continue
            for key in keys:
                self._emit(StoreEvent("removed", spec.tier.name, key, 0))
            removed.update(keys)
        return len(removed)

    def is_pinned(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pinned

    def pinned_keys(self) -> list[bytes]:
        """Every pinned key (a snapshot)."""
        with self._lock:
            return list(self._pinned)

    def typed_stats(self) -> StoreStats:
        """A snapshot: usage and counters per tier, and counter rows per namespace and model."""
        tiers = []
        if self.device_tier is not None:
            usage = self.device_tier.usage()
            name = self.device_tier.name
            tiers.append(TierStats(
                name=name, codec=f"decoded on {self.device_tier.device}", available=True, damaged=False,
                blocks=usage.blocks, bytes=usage.bytes, capacity_bytes=usage.capacity_bytes,
                **{m.value: self.counters.total(m, tier=name) for m in TIER_STATS_METRICS},
            ))
        for spec in self.specs:
            name = spec.tier.name
            try:
                usage: TierUsage | None = spec.tier.usage()
            except TierUnavailableError:
                usage = None
            tiers.append(TierStats(
                name=name,
                codec=spec.codec_label,
                available=usage is not None,
                damaged=bool(getattr(spec.tier, "damaged", False)),
                blocks=usage.blocks if usage else None,
                bytes=usage.bytes if usage else None,
                capacity_bytes=usage.capacity_bytes if usage else None,
                **{m.value: self.counters.total(m, tier=name) for m in TIER_STATS_METRICS},
            ))
        self._check_pins_after_losses()

        def rate(hit: Metric, asked: Metric) -> float | None:
            n = self.counters.total(asked, tier=ALL_TIERS)
            return self.counters.total(hit, tier=ALL_TIERS) / n if n else None

        return StoreStats(
            tiers=tuple(tiers),
            lookup_hit_rate=rate(Metric.LOOKUP_HIT_BLOCKS, Metric.LOOKUP_BLOCKS),
            retrieve_hit_rate=rate(Metric.RETRIEVE_HIT_BLOCKS, Metric.RETRIEVE_BLOCKS),
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
        if self.device_tier is not None:
            self.device_tier.close()
        for spec in self.specs:
            spec.tier.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
