"""The layers ``TieredStore`` composes (``kvstore.tiered``), each on its own: the meter, the pins, the tier stack's
lookups and the per-tier codecs (the store's behaviour through all of them is tests/kvstore/test_store.py)."""

from __future__ import annotations

import pytest
from helpers import FINGERPRINT, key_of, make_block

from kvshelf.kvstore import ConfigError, MemoryTier, encode_block, read_header
from kvshelf.kvstore.keys import given_back
from kvshelf.kvstore.stats import ALL_TIERS, Metric, StoreEvent
from kvshelf.kvstore.tiered.codecs import TierSpec, encode_blocks, promotion_values
from kvshelf.kvstore.tiered.meter import StoreMeter
from kvshelf.kvstore.tiered.stack import TierStack


def test_the_meter_counts_a_retrieval_from_its_answers() -> None:
    meter = StoreMeter()
    meter.retrieved("ns", "m", ["hit", None, "hit"], [4, 4, 2])
    c = meter.counters
    assert (c.total(Metric.RETRIEVE_BLOCKS), c.total(Metric.RETRIEVE_HIT_BLOCKS)) == (3, 2)
    assert (c.total(Metric.RETRIEVE_TOKENS), c.total(Metric.RETRIEVE_HIT_TOKENS)) == (10, 6)
    assert meter.hit_rate(Metric.RETRIEVE_HIT_BLOCKS, Metric.RETRIEVE_BLOCKS) == pytest.approx(2 / 3)
    assert meter.hit_rate(Metric.LOOKUP_HIT_BLOCKS, Metric.LOOKUP_BLOCKS) is None
    assert c.total(Metric.RETRIEVE_BLOCKS, tier=ALL_TIERS) == 3


def test_the_meter_announces_to_subscribers_until_they_leave() -> None:
    meter, heard = StoreMeter(), []
    leave = meter.subscribe(heard.append)
    meter.removed("memory", [b"k" * 16])
    leave()
    meter.removed("memory", [b"j" * 16])
    assert heard == [StoreEvent("removed", "memory", b"k" * 16, 0)]


def test_the_stack_refuses_what_the_store_refuses() -> None:
    meter = StoreMeter()
    with pytest.raises(ConfigError, match="at least one tier"):
        TierStack([], "through", meter)
    with pytest.raises(ConfigError, match="write_policy"):
        TierStack([TierSpec(MemoryTier(1 << 20))], "sideways", meter)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unique"):
        TierStack([TierSpec(MemoryTier(1 << 20, name="gpu"))], "through", meter, other_names=["gpu"])


def test_a_lookup_goes_on_past_an_unreachable_tier_and_counts_it() -> None:
    from service_helpers import UnreachableTier

    blocks = [make_block([i, i + 1], start_pos=2 * i) for i in range(2)]
    keys = given_back([key_of(b) for b in blocks])
    memory = MemoryTier(1 << 20)
    stack = TierStack([TierSpec(UnreachableTier("shared")), TierSpec(memory)], "through", StoreMeter())
    memory.put_many([(k, encode_block(b, k)) for k, b in zip(keys, blocks, strict=True)])
    assert stack.lookup(keys) == 2
    assert stack.meter.counters.total(Metric.UNAVAILABLE, tier="shared") >= 1


def test_pins_stay_while_a_tier_cannot_be_asked() -> None:
    from service_helpers import UnreachableTier

    key = given_back([b"p" * 16])
    memory = MemoryTier(1 << 20)
    pins = TierStack([TierSpec(memory), TierSpec(UnreachableTier("shared"))], "through", StoreMeter()).pins
    pins.pin(key)
    pins.forget(key)  # held nowhere reachable, but the unreachable tier may hold it
    assert pins.is_pinned(key[0])


def test_promotion_re_encodes_for_a_tier_of_another_codec() -> None:
    block = make_block(8)
    key = given_back([key_of(block)])[0]
    raw = encode_block(block, key)
    target = TierSpec(MemoryTier(1 << 20), "int8")
    encoded, kept = promotion_values(target, [(key, raw)], [read_header(raw)], None)
    assert kept == [0] and read_header(encoded[0][1]).codec == "int8"
    assert promotion_values(TierSpec(MemoryTier(1 << 20)), [(key, raw)], [read_header(raw)], None)[0] == [(key, raw)]
    per_tier = encode_blocks([(key, block)])
    assert per_tier(target) is per_tier(TierSpec(MemoryTier(1 << 20), "int8"))  # once per distinct codec
    assert read_header(per_tier(target)[0][1]).fingerprint == FINGERPRINT
