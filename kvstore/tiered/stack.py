"""The tier stack: ordered tiers (fastest first), the write policy, write-down of evicted values, promotion of
lower hits, prefix lookups across tiers, deletes. What it does it reports to a ``meter.StoreMeter``; the pins it
keeps to held blocks through a ``pins.PinSet``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from kvshelf.kvstore.encoding import read_header
from kvshelf.kvstore.errors import ConfigError, StoreFullError, TierUnavailableError
from kvshelf.kvstore.keys import TierKey, given_back
from kvshelf.kvstore.stats import TIER_STATS_METRICS, Metric, TierStats
from kvshelf.kvstore.tier import TierUsage
from kvshelf.kvstore.tiered.codecs import Encoded, EncodeFor, TierSpec, promotion_values, write_down_value
from kvshelf.kvstore.tiered.meter import StoreMeter
from kvshelf.kvstore.tiered.pins import PinSet

WritePolicy = Literal["through", "back"]


class PrefixHolder(Protocol):
    """What a prefix lookup asks of a tier (the device tier above the stack answers it too)."""

    def prefix_run_length(self, keys: Sequence[TierKey]) -> int: ...


class TierStack:
    """``specs``' tiers in order. ``write_policy``: a put writes through to every tier (``"through"``) or to the
    first only, evicted values moving down one tier (``"back"``). ``max_decoded_bytes`` bounds the decoding a
    re-encode may take (promotion, write-down; None: the target tier's capacity)."""

    def __init__(self, specs: Sequence[TierSpec], write_policy: WritePolicy, meter: StoreMeter, *,
                 other_names: Sequence[str] = ()) -> None:
        if not specs:
            raise ConfigError("a TieredStore needs at least one tier")
        if write_policy not in ("through", "back"):
            raise ConfigError(f"write_policy must be 'through' or 'back', got {write_policy!r}")
        names = [s.tier.name for s in specs] + list(other_names)  # other_names: the layers above (the GPU tier)
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        self.specs = list(specs)
        self.write_policy: WritePolicy = write_policy
        self.meter = meter
        self.max_decoded_bytes: int | None = None
        self.pins = PinSet(self.specs)
        for index, spec in enumerate(self.specs):
            spec.tier.set_eviction_callback(lambda k, v, i=index: self._on_evict(i, k, v))

    def write_targets(self) -> list[TierSpec]:
        """The tiers a put writes: every tier (write-through) or the first (write-back)."""
        return self.specs if self.write_policy == "through" else self.specs[:1]

    # -- writes ---------------------------------------------------------------------------------------

    def write(self, encode_for: EncodeFor, owners: list[tuple[str, str]], keys: list[TierKey], pin: bool) -> int:
        """Store each target tier's values (``encode_for(spec)``), ``owners`` being each key's (namespace,
        model); return how many the first target accepted. ``StoreFullError`` after every tier was written when a
        tier could not take them."""
        if not keys:
            return 0
        if pin:  # before the write, so that making room for these never evicts them
            self.pins.pin(keys)
        accepted, full_error = 0, None
        missed: list[TierKey] = []  # keys some tier did not take: pinned ones no tier holds lose their pin
        for n, spec in enumerate(self.write_targets()):
            encoded = encode_for(spec)
            try:
                stored = spec.tier.put_many(encoded)
            except StoreFullError as exc:
                full_error, stored = exc, 0
            except TierUnavailableError as exc:
                self.meter.unavailable(spec.tier.name, exc)
                continue
            if n == 0:
                accepted = stored
            rejected = self.count_writes(spec, encoded, owners, stored)
            missed += [key for key, _ in rejected]
            if self.write_policy == "back" and rejected and len(self.specs) > 1:
                # what the first tier cannot hold (too large, or room only by evicting pins) goes one tier down
                for key, value in rejected:
                    self._write_down(0, key, value)
        if pin:  # again: an eviction report racing this write may have found the key held nowhere yet
            self.pins.pin(keys)
        if missed or full_error is not None:
            self.pins.forget(missed if full_error is None else keys)
        if full_error is not None:
            raise full_error
        return accepted

    def count_writes(self, spec: TierSpec, encoded: Encoded, owners: Sequence[tuple[str, str]], stored: int) -> Encoded:
        """Count and announce what ``spec``'s tier stored; return the ``(key, value)`` pairs it rejected."""
        name = spec.tier.name
        # a tier that stored fewer than offered rejected the rest (too large, or room only by evicting pins)
        try:
            present = spec.tier.get_many([k for k, _ in encoded]) if stored < len(encoded) else None
        except TierUnavailableError as exc:  # it stopped answering: count none of them stored
            self.meter.unavailable(name, exc)
            present = [None] * len(encoded)
        rejected = []
        for i, ((key, value), (namespace, model)) in enumerate(zip(encoded, owners, strict=True)):
            if present is not None and present[i] is None:
                self.meter.count(name, namespace, model, Metric.REJECTED)
                rejected.append((key, value))
                continue
            self.meter.stored(name, key, value, namespace, model)
        return rejected

    def _on_evict(self, index: int, evicted: bytes, value: bytes) -> None:
        (key,) = given_back([evicted])
        self.meter.evicted(self.specs[index].tier.name, key, value)
        # an empty value: the medium evicted it on its own (Redis's maxmemory) and it is gone: nothing to write down
        if value and self.write_policy == "back" and index + 1 < len(self.specs):
            self._write_down(index, key, value)
        self.pins.forget([key])

    def _write_down(self, index: int, key: TierKey, value: bytes) -> None:
        lower = self.specs[index + 1]
        written = write_down_value(lower, key, value, lower.reencode_bound(self.max_decoded_bytes))
        if written is None:
            return
        try:
            stored = lower.tier.put_many([(key, written)])
        except TierUnavailableError as exc:  # unreachable or damaged: the block leaves the store, counted
            self.meter.unavailable(lower.tier.name, exc)
            return
        if stored:
            header = read_header(written)
            self.meter.stored(lower.tier.name, key, written, header.namespace, header.fingerprint)

    def promote(self, found_in: int, hits: list[tuple[TierKey, bytes]]) -> None:
        """Copy verified ``(key, value)`` hits of tier ``found_in`` into every tier above it."""
        headers = [read_header(v) for _, v in hits]
        owners = [(h.namespace, h.fingerprint) for h in headers]
        for spec in self.specs[:found_in]:
            encoded, kept = promotion_values(spec, hits, headers, spec.reencode_bound(self.max_decoded_bytes))
            if not encoded:
                continue
            try:
                stored = spec.tier.put_many(encoded)
            except StoreFullError:
                continue
            except TierUnavailableError as exc:
                self.meter.unavailable(spec.tier.name, exc)
                continue
            self.count_writes(spec, encoded, [owners[i] for i in kept], stored)

    # -- lookups and management -----------------------------------------------------------------------

    def lookup(self, keys: Sequence[TierKey], above: Sequence[PrefixHolder] = ()) -> int:
        """How many of ``keys``, in order, some tier holds (a prefix may be split across tiers); ``above``: tiers
        asked first (the device tier), which never fail."""
        n, progress = 0, True
        while progress and n < len(keys):
            progress = False
            for holder in [*above, *self.specs]:
                if isinstance(holder, TierSpec):
                    try:
                        found = holder.tier.prefix_run_length(keys[n:])
                    except TierUnavailableError as exc:
                        self.meter.unavailable(holder.tier.name, exc)
                        continue
                else:
                    found = holder.prefix_run_length(keys[n:])
                if found:
                    n += found
                    progress = True
                    if n == len(keys):
                        break
        return n

    def held(self, keys: Sequence[TierKey], present: list[bool]) -> list[bool]:
        """``present`` with each key some reachable tier holds set (not counted as a lookup)."""
        for spec in self.specs:
            for i, key in enumerate(keys):
                if present[i]:
                    continue
                try:
                    present[i] = spec.tier.prefix_run_length([key]) == 1
                except TierUnavailableError:
                    break
        return present

    def delete_from(self, spec: TierSpec, keys: Sequence[TierKey]) -> list[TierKey]:
        """Remove ``keys`` from one tier (``TierUnavailableError`` when it cannot be reached); return those it
        held."""
        present = [key for key in keys if spec.tier.prefix_run_length([key])]  # a "removed" event per held value
        if spec.tier.delete(present):
            self.meter.removed(spec.tier.name, present)
        return present

    def delete(self, keys: Sequence[TierKey]) -> set[TierKey]:
        """Remove ``keys`` from every reachable tier; return those some tier held."""
        removed: set[TierKey] = set()
        for spec in self.specs:
            try:
                removed.update(self.delete_from(spec, keys))
            except TierUnavailableError as exc:
                self.meter.unavailable(spec.tier.name, exc)
        return removed

    def delete_prefix(self, prefix: bytes, length: int | None) -> set[bytes]:
        """Remove every key starting with ``prefix`` (of ``length`` bytes when given) from every reachable tier,
        each finding them its own way (``Tier.delete_prefix``); return the keys removed."""
        removed: set[bytes] = set()
        for spec in self.specs:
            try:
                keys = spec.tier.delete_prefix(prefix, length)
            except TierUnavailableError as exc:
                self.meter.unavailable(spec.tier.name, exc)
                continue
            self.meter.removed(spec.tier.name, keys)
            removed.update(keys)
        return removed

    def tier_stats(self) -> list[TierStats]:
        """Usage and counters of every tier (an unreachable one: ``available=False``, no usage)."""
        out = []
        for spec in self.specs:
            name = spec.tier.name
            try:
                usage: TierUsage | None = spec.tier.usage()
            except TierUnavailableError:
                usage = None
            out.append(TierStats(
                name=name, codec=spec.codec_label, available=usage is not None,
                damaged=bool(getattr(spec.tier, "damaged", False)),
                blocks=usage.blocks if usage else None,
                bytes=usage.bytes if usage else None,
                capacity_bytes=usage.capacity_bytes if usage else None,
                **{m.value: self.meter.counters.total(m, tier=name) for m in TIER_STATS_METRICS},
            ))
        return out

    def close(self) -> None:
        for spec in self.specs:
            spec.tier.close()
