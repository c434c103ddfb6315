"""The memory tier's capacity bounds the process memory it holds, per-entry overhead and policy state included.

Small values are where the overhead shows: a 244-byte value under a 40-byte key costs ~0.5-0.9 KB of process
memory in all (key and value objects, dict entries, the policy's structures, ghosts). Before the tier charged it,
100k such values took 273 MiB against a 256 MiB tier; here a fresh interpreter measures (``tracemalloc``) what a
tier holds after a serving-like workload, under every policy.
"""

from __future__ import annotations

import hashlib
import random

import pytest
from helpers import run_python

from kvshelf.kvstore.eviction import POLICIES
from kvshelf.kvstore.memory_tier import EXTRA_SHARE, MemoryTier
from kvshelf.kvstore.replay import open_tier

MiB = 1 << 20
POLICY_NAMES = sorted(POLICIES)

#: A serving-like workload in a fresh interpreter, for each policy named: conversations whose chains grow by 8
#: blocks a turn (at most 32), each request a lookup, a read of the held prefix and a put of the rest (every call
#: with its own key objects, as separate RPCs bring them), with a few overwrites, deletes and pins. 244-byte
#: values, 40-byte keys. Prints, per policy, what ``tracemalloc`` traced from just before the tier was made, once
#: the workload's own objects are gone, and what the tier says.
WORKLOAD = r"""
import gc, json, random, sys, tracemalloc
from kvshelf.kvstore.memory_tier import MemoryTier

policies, capacity, requests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
VALUE, KEY = 244, 40


def key(conv, i):  # a new object at every call
    return (conv << 32 | i).to_bytes(KEY, "big")


def serve(tier):
    rng = random.Random(7)
    convs, next_id, puts = [], 0, 0
    for n in range(requests):
        if not convs or rng.random() < 0.35:
            convs.append([next_id, 0])
            next_id += 1
            del convs[:-300]
        conv = rng.choice(convs)
        conv[1] += 1
        keys = [key(conv[0], i) for i in range(min(8 * conv[1], 32))]
        held = tier.prefix_run_length(keys)
        if held:
            tier.get_many(keys[:held])
        puts += tier.put_many([(key(conv[0], i), bytes(VALUE)) for i in range(held, len(keys))])
        if n % 17 == 0:
            tier.put_many([(key(conv[0], 0), bytes(VALUE + rng.randrange(-100, 100)))])  # an overwrite
        if n % 23 == 0:
            tier.delete([key(rng.choice(convs)[0], 1)])
        if n % 101 == 0:
            tier.pin([key(conv[0], 0)])
        if n % 101 == 50:
            tier.unpin([key(rng.choice(convs)[0], 0)])
    return puts


results = {}
for policy in policies.split(","):
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tier = MemoryTier(capacity, policy=policy)
    puts = serve(tier)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    usage = tier.usage()
    results[policy] = {"traced": traced, "memory": tier.memory_bytes(), "bytes": usage.bytes, "blocks": usage.blocks,
                       "puts": puts, "extra": tier.policy.extra_bytes()}
    del tier
print(json.dumps(results))
"""


CAPACITY = 2 * MiB


@pytest.fixture(scope="module")
def held_after_workload() -> dict[str, dict[str, int]]:
    """``WORKLOAD`` under every policy, in one fresh interpreter (importing kvshelf takes a while)."""
    got = run_python(WORKLOAD, ",".join(POLICY_NAMES), str(CAPACITY), "1500")
    assert isinstance(got, dict)
    return got


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_memory_held_stays_within_the_capacity(policy: str, held_after_workload: dict[str, dict[str, int]]):
    got = held_after_workload[policy]
    assert got["puts"] > 2.5 * got["blocks"] and got["puts"] > 8000, "the workload did not fill the tier many times"
    assert got["traced"] <= CAPACITY * 1.05 + MiB, f"{policy}: {got['traced']} bytes held by a tier of {CAPACITY}"
    # tighter: the tier's own count is within the capacity and bounds what tracemalloc saw (the interpreter's
    # own leftovers of the workload are a few KB), without being a wild overestimate
    assert got["memory"] <= CAPACITY
    assert got["traced"] <= got["memory"] + 64 * 1024
    assert got["memory"] <= got["traced"] * 1.3
    assert got["extra"] <= CAPACITY // EXTRA_SHARE
    # usage() counts the values' bytes: a full tier of small values shows well under its capacity
    assert got["bytes"] <= CAPACITY - got["blocks"] * 200


def k(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_value_that_fits_by_its_bytes_but_not_with_its_overhead_is_refused(policy: str):
    capacity = 8192
    tier = MemoryTier(capacity, policy=policy)
    evicted: list[bytes] = []
    tier.set_eviction_callback(lambda key, value: evicted.append(key))
    assert tier.put_many([(k(1), b"a" * 100)]) == 1
    big = b"b" * 8000
    assert len(big) <= capacity < tier.entry_charge(len(k(2)), len(big))
    assert tier.put_many([(k(2), big)]) == 0  # refused as a value larger than the capacity is
    assert evicted == [] and tier.get_many([k(1), k(2)]) == [b"a" * 100, None]
    assert tier.put_many([(k(1), big)]) == 0  # a re-put that cannot be stored leaves the key absent
    assert tier.get_many([k(1)]) == [None] and tier.usage().blocks == 0
    assert tier.put_many([(k(3), b"c" * 1000)]) == 1 and tier.memory_bytes() <= capacity  # a charge that fits
    # counting the values' bytes only (trace replay), the same value is stored
    payload_only = MemoryTier(capacity, policy=policy, charge_overhead=False)
    assert payload_only.put_many([(k(2), big)]) == 1


def test_usage_counts_values_bytes_memory_bytes_is_what_the_capacity_bounds():
    capacity = 256 * 1024
    tier = MemoryTier(capacity, policy="lru")
    values = {k(i): bytes([i % 256]) * 244 for i in range(3000)}
    for key, value in values.items():
        assert tier.put_many([(key, value)]) == 1
        assert tier.memory_bytes() <= capacity
    held = [key for key in values if tier.prefix_run_length([key])]
    usage = tier.usage()
    assert usage.blocks == len(held) and usage.bytes == 244 * len(held)
    assert len(held) * (244 + 150) <= capacity  # each entry costs its value and ~0.2 KB of overhead
    # counting values' bytes only, the same tier holds capacity / 244 of them
    payload_only = MemoryTier(capacity, policy="lru", charge_overhead=False)
    payload_only.put_many(list(values.items()))
    assert payload_only.usage().blocks == capacity // 244


def test_replay_counts_values_bytes_only():
    tier, directory = open_tier("memory", 1000, "lru")
    assert isinstance(tier, MemoryTier) and not tier.charge_overhead and directory is None


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_random_operations_keep_memory_within_capacity(policy: str, seed: int):
    """Puts of mixed sizes, re-puts, reads, deletes, chain lookups, pins: after every call the memory held is
    within the capacity, every evicted value is reported once with the value stored, pins stay, and what the
    tier holds is what was stored."""
    rng = random.Random(seed)
    capacity = 64 * 1024
    tier = MemoryTier(capacity, policy=policy)
    evicted: list[tuple[bytes, bytes]] = []
    tier.set_eviction_callback(lambda key, value: evicted.append((key, value)))
    model: dict[bytes, bytes] = {}
    pinned: set[bytes] = set()
    pool = [k(i) for i in range(400)]
    for step in range(3000):
        op = rng.random()
        key = rng.choice(pool)
        mark = len(evicted)
        if op < 0.5:
            value = bytes([step % 256]) * rng.choice([rng.randint(1, 600), rng.randint(600, 6000)])
            if tier.put_many([(key, value)]) == 1:
                model[key] = value
            else:
                model.pop(key, None)
        elif op < 0.65:
            keys = rng.sample(pool, rng.randint(1, 8))
            assert tier.get_many(keys) == [model.get(x) for x in keys]  # (read before anything it evicts)
        elif op < 0.75:
            tier.delete([key])
            model.pop(key, None)
        elif op < 0.9:
            start = rng.randrange(len(pool) - 12)
            chain = pool[start:start + rng.randint(2, 12)]
            leading = next((i for i, x in enumerate(chain) if x not in model), len(chain))
            assert tier.prefix_run_length(chain) == leading
        elif op < 0.95:
            if len(pinned) < 4:
                pinned.add(key)
                tier.pin([key])
        else:
            pinned.discard(key)
            tier.unpin([key])
        for gone, value in evicted[mark:]:
            assert gone not in pinned, f"step {step}: pinned key evicted"
            assert model.pop(gone) == value, f"step {step}: evicted value not the one stored (or reported twice)"
        assert tier.memory_bytes() <= capacity, f"step {step}: {tier.memory_bytes()} bytes held"
        assert tier.policy.extra_bytes() <= capacity // EXTRA_SHARE
    assert sorted(tier.keys()) == sorted(model)
    assert tier.get_many(list(model)) == list(model.values())
    assert tier.usage().bytes == sum(map(len, model.values()))
    assert len(evicted) > 100, "the run did not exercise eviction"
