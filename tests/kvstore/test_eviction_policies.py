"""Every eviction policy under every bounded tier: one behaviour suite, on the real tier classes.

The suite is parametrized over every name in ``kvstore.eviction.POLICIES`` (read at import: a new policy is
covered without touching this file) and over ``TIER_FACTORIES`` (each bounded tier: a new one adds its line).
Properties: the tier's byte usage never exceeds its capacity after a put; pinned keys are never evicted and a
put that fits only by evicting pins is refused with nothing else lost; every key the tier reports held returns
its exact value; every evicted value reaches the eviction callback exactly once; delete, re-put and overwrite
keep the tier and the policy consistent (a seeded random sequence of operations checked against a reference
model); a policy names only held, unpinned keys. Then what each policy is for: S3-FIFO and ARC keep a reused
key through a scan of one-time keys where LRU loses it; ARC's target ``p`` follows the workload and its ghost
hits land in T2; S3-FIFO's ghost hits land in main.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from kvshelf.kvstore.eviction import POLICIES, ARCPolicy, EvictionPolicy, S3FIFOPolicy, make_policy
from kvshelf.kvstore.lmdb_tier import LMDBTier
from kvshelf.kvstore.memory_tier import MemoryTier
from kvshelf.kvstore.tier import Tier

#: (id, factory(directory, capacity_bytes, policy_name) -> a bounded Tier); ``directory`` is fresh per call
TierFactory = Callable[[Path, int, str], Tier]
TIER_FACTORIES: list[tuple[str, TierFactory]] = [
    ("memory", lambda directory, capacity, policy: MemoryTier(capacity, policy=policy, charge_overhead=False)),
    ("lmdb", lambda directory, capacity, policy: LMDBTier(directory / "lmdb", capacity_bytes=capacity, policy=policy,
                                                          durable=False)),
]
POLICY_NAMES = sorted(POLICIES)


def key(i: int | str) -> bytes:
    """A 16-byte key, as the store's block keys are."""
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


class Recorder:
    """The eviction callback: every ``(key, value)`` the tier reports, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[bytes, bytes]] = []

    def __call__(self, k: bytes, v: bytes) -> None:
        self.events.append((k, v))

    def since(self, mark: int) -> list[tuple[bytes, bytes]]:
        return self.events[mark:]


@pytest.fixture(params=POLICY_NAMES)
def policy_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=[factory for _, factory in TIER_FACTORIES], ids=[name for name, _ in TIER_FACTORIES])
def bounded(request: pytest.FixtureRequest, tmp_path: Path, policy_name: str):
    """``bounded(capacity_bytes) -> (tier, recorder)``: a fresh tier of the parametrized kind and policy with its
    eviction callback recording; every tier made is closed at the end."""
    made: list[Tier] = []

    def make(capacity: int) -> tuple[Tier, Recorder]:
        directory = tmp_path / f"tier{len(made)}"
        directory.mkdir()
        tier = request.param(directory, capacity, policy_name)
        recorder = Recorder()
        tier.set_eviction_callback(recorder)
        made.append(tier)
        return tier, recorder

    yield make
    for tier in made:
        tier.close()


def put_one(tier: Tier, k: bytes, v: bytes) -> bool:
    return tier.put_many([(k, v)]) == 1


def held(tier: Tier) -> dict[bytes, bytes]:
    """What the tier says it holds, read back through ``get_many``."""
    keys = tier.keys()
    values = tier.get_many(keys)
    assert None not in values, "a key the tier lists is not readable"
    return dict(zip(keys, values, strict=True))


# ------------------------------------------------------------------------------------------------------------
# The behaviour suite: every policy x every bounded tier


def test_fill_past_capacity_each_eviction_reported_once_with_its_value(bounded):
    tier, rec = bounded(1000)
    values = {key(i): bytes([i]) * 100 for i in range(50)}
    for k, v in values.items():
        assert put_one(tier, k, v)
        assert tier.usage().bytes <= 1000
    evicted = [k for k, _ in rec.events]
    assert len(evicted) == len(set(evicted)), "a key was reported evicted twice"
    assert all(values[k] == v for k, v in rec.events), "an eviction reported the wrong value"
    now = held(tier)
    assert set(now) | set(evicted) == set(values) and not set(now) & set(evicted)
    assert all(values[k] == v for k, v in now.items())
    usage = tier.usage()
    assert usage.blocks == len(now) == 10 and usage.bytes == 1000


def test_pinned_keys_survive_and_a_put_needing_pins_is_refused(bounded):
    tier, rec = bounded(1000)
    a, b, c, d, e, f = (key(x) for x in "abcdef")
    tier.pin([a, f])  # f is pinned before it is ever stored
    for k in (a, b, c):
        assert put_one(tier, k, k[:1] * 300)
    tier.pin([b])
    assert put_one(tier, d, b"d" * 300)  # only c may go
    assert rec.events == [(c, c[:1] * 300)]
    assert put_one(tier, f, b"f" * 100)
    # a, b, f pinned (700 bytes): 400 more fit only by evicting a pin: refused, d (unpinned) not lost either
    assert tier.put_many([(e, b"e" * 400)]) == 0
    assert len(rec.events) == 1
    assert held(tier) == {a: a[:1] * 300, b: b[:1] * 300, d: b"d" * 300, f: b"f" * 100}
    for i in range(30):  # churn: only unpinned keys ever go
        assert put_one(tier, key(f"churn{i}"), b"x" * 250)
        assert tier.usage().bytes <= 1000
    assert not {a, b, f} & {k for k, _ in rec.events}
    now = held(tier)
    assert {a, b, f} <= set(now)
    tier.unpin([a, b, f])
    assert put_one(tier, e, b"E" * 1000), "unpinned keys are evictable again"
    assert {a, b, f} <= {k for k, _ in rec.events} and held(tier) == {e: b"E" * 1000}


def test_value_larger_than_capacity_is_refused_and_nothing_is_lost(bounded):
    tier, rec = bounded(1000)
    for i in range(3):
        assert put_one(tier, key(i), b"v" * 300)
    assert tier.put_many([(key("big"), b"B" * 1001)]) == 0
    assert rec.events == []
    assert held(tier) == {key(i): b"v" * 300 for i in range(3)}


def test_overwrite_delete_and_reput_keep_tier_and_policy_consistent(bounded):
    tier, rec = bounded(1000)
    a, b, c = key("a"), key("b"), key("c")
    assert put_one(tier, a, b"1" * 200) and put_one(tier, b, b"2" * 200) and put_one(tier, c, b"3" * 200)
    assert put_one(tier, a, b"A" * 500)  # overwrite, bigger: 900 bytes, no eviction
    assert tier.usage().bytes == 900 and rec.events == []
    assert tier.delete([b, key("never")]) == 1
    assert tier.usage().bytes == 700
    assert put_one(tier, b, b"B" * 100)  # re-put of a deleted key
    assert put_one(tier, a, b"a" * 50)  # overwrite, smaller
    assert held(tier) == {a: b"a" * 50, b: b"B" * 100, c: b"3" * 200}
    assert tier.delete([a, b, c]) == 3 and tier.usage().bytes == 0 and tier.keys() == []
    # the policy must have forgotten them: churn through a full tier, every victim it names must be held
    expected: dict[bytes, bytes] = {}
    for i in range(40):
        k = key(i % 13)
        v = bytes([i]) * (100 + 37 * (i % 7))
        mark = len(rec.events)
        assert put_one(tier, k, v)
        for ek, ev in rec.since(mark):
            assert expected.pop(ek) == ev
        expected[k] = v
        if i % 5 == 4:
            assert tier.delete([key((i + 3) % 13)]) == int(expected.pop(key((i + 3) % 13), None) is not None)
        assert tier.usage().bytes <= 1000
    assert held(tier) == expected


def _leading(keys: list[bytes], model: dict[bytes, bytes]) -> int:
    for i, k in enumerate(keys):
        if k not in model:
            return i
    return len(keys)


def _chain(rng: random.Random) -> list[bytes]:
    """A prefix of one of six conversations' block chains (chained keys, as a request's blocks are)."""
    conversation = rng.randrange(6)
    return [key(f"c{conversation}.{j}") for j in range(rng.randint(1, 8))]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_match_a_reference_model(bounded, seed: int):
    """A seeded random run of put (single and batched) / get / delete / pin / unpin / prefix_run_length / prefix
    requests (the replay's prefix_run_length -> get_many -> put_many), checked after every step against the model of
    what must be held: what was stored, minus what was deleted and what the callback reported evicted."""
    rng = random.Random(seed)
    capacity = 4000
    tier, rec = bounded(capacity)
    model: dict[bytes, bytes] = {}
    pinned: set[bytes] = set()
    pool = [key(i) for i in range(30)] + [key(f"c{c}.{j}") for c in range(6) for j in range(8)]
    counter = 0
    stored = 0

    def value(size: int) -> bytes:
        nonlocal counter
        counter += 1
        return counter.to_bytes(4, "big") + rng.randbytes(max(0, size - 4))

    def apply_put(items: list[tuple[bytes, bytes]]) -> None:
        nonlocal stored
        mark = len(rec.events)
        before = dict(model)
        n = tier.put_many(items)
        events = rec.since(mark)
        new = dict(items)
        consumed: set[bytes] = set()
        for ek, ev in events:
            assert ek not in pinned, "a pinned key was evicted"
            if ek in model and model[ek] == ev:
                del model[ek]
            elif new.get(ek) == ev and ek not in consumed:
                consumed.add(ek)  # stored by this batch, evicted by a later item of it
            else:
                raise AssertionError(f"eviction of {ek.hex()} reported twice or with a value never held there")
        if len(items) == 1 and n == 0:
            assert events == [], "a refused put evicted something"
        now = set(tier.keys())
        values = dict(zip(items and [k for k, _ in items], tier.get_many([k for k, _ in items]), strict=True))
        stored_here = len(consumed)
        for k, v in items:
            if k in now:
                if values[k] == v:
                    model[k] = v
                    stored_here += 1
                else:  # a refused overwrite may leave the old value (never anything else)
                    assert k in before and values[k] == before[k] == model.get(k)
            else:
                model.pop(k, None)
        assert n == stored_here, f"put_many said {n} stored, the tier shows {stored_here}"
        stored += n

    for step in range(400):
        op = rng.random()
        if op < 0.35:
            size = rng.choice([rng.randint(100, 1400), rng.randint(100, 1400), capacity + 1])
            apply_put([(rng.choice(pool), value(size))])
        elif op < 0.45:
            keys = rng.sample(pool, rng.randint(2, 4))
            apply_put([(k, value(rng.randint(100, 900))) for k in keys])
        elif op < 0.6:  # a prefix request, as the replay makes them
            chain = _chain(rng)
            h = tier.prefix_run_length(chain)
            assert h == _leading(chain, model)
            assert tier.get_many(chain[:h]) == [model[k] for k in chain[:h]]
            apply_put([(k, value(rng.randint(100, 700))) for k in chain[h:]])
        elif op < 0.7:
            keys = rng.sample(pool, rng.randint(1, 6))
            assert tier.get_many(keys) == [model.get(k) for k in keys]
        elif op < 0.77:
            keys = rng.sample(pool, rng.randint(1, 3))
            mark = len(rec.events)
            assert tier.delete(keys) == sum(k in model for k in keys)
            assert rec.since(mark) == [], "a delete was reported as an eviction"
            for k in keys:
                model.pop(k, None)
        elif op < 0.82:
            keys = rng.sample(pool, rng.randint(1, 5))
            assert tier.prefix_run_length(keys) == _leading(keys, model)
        elif op < 0.88:
            if len(pinned) < 2:
                k = rng.choice(list(model) if model and rng.random() < 0.7 else pool)
                tier.pin([k])
                pinned.add(k)
        elif pinned:
            k = rng.choice(sorted(pinned))
            tier.unpin([k])
            pinned.discard(k)
        usage = tier.usage()
        assert usage.bytes <= capacity, f"step {step}: {usage.bytes} bytes held over a capacity of {capacity}"
        assert set(tier.keys()) == set(model), f"step {step}: the tier's keys differ from the reference model"
        assert usage.blocks == len(model) and usage.bytes == sum(map(len, model.values())), f"step {step}"
    assert held(tier) == model
    assert stored > 50 and len(rec.events) > 10, "the run did not exercise eviction"


# ------------------------------------------------------------------------------------------------------------
# Each policy on its own, driven as a tier drives it (keys and sizes only)


@pytest.mark.parametrize("seed", [7, 8])
def test_policy_names_only_held_unpinned_keys(policy_name: str, seed: int):
    """A random life of keys of mixed sizes (insert, hit, delete, pin, lookups, evictions to make room) with
    the tier's bookkeeping done here: every victim is held and unpinned; None only when all held are pinned;
    ghost lists stay within their bounds."""
    rng = random.Random(seed)
    capacity = 5000
    policy: EvictionPolicy = make_policy(policy_name, capacity)
    sizes: dict[bytes, int] = {}
    pinned: set[bytes] = set()
    pool = [key(i) for i in range(60)]
    for _ in range(3000):
        op = rng.random()
        k = rng.choice(pool)
        if op < 0.5:
            size = rng.randint(50, 1500)
            if k in sizes:
                policy.on_hit(k)
                continue
            if not policy.admit(k, size):
                continue
            fits = True
            while sum(sizes.values()) + size > capacity:
                v = policy.victim(pinned | {k})
                if v is None:
                    assert set(sizes) <= pinned | {k}, "victim() gave up while an unpinned key was held"
                    fits = False
                    break
                assert v in sizes, f"{policy_name} named a key that is not held"
                assert v not in pinned and v != k, f"{policy_name} named a pinned key"
                del sizes[v]
                policy.on_remove(v)
            if fits:
                sizes[k] = size
                policy.on_insert(k, size)
        elif op < 0.7:
            if k in sizes:
                policy.on_hit(k)
        elif op < 0.8:
            if k in sizes:
                del sizes[k]
                policy.on_remove(k)
        elif op < 0.87:
            chain = rng.sample(pool, rng.randint(2, 6))
            policy.on_lookup(chain, _leading(chain, sizes))  # type: ignore[arg-type]
        elif op < 0.93:
            if len(pinned) < 4:
                pinned.add(k)
        else:
            pinned.discard(k)
        if isinstance(policy, S3FIFOPolicy):
            assert policy.held_bytes() == sum(sizes.values())
            assert policy.ghost_bytes() <= policy.ghost_limit
        if isinstance(policy, ARCPolicy):
            lists = policy.list_bytes()
            assert lists["T1"] + lists["T2"] == sum(sizes.values())
            directory = policy.ghost_factor * capacity  # ARC's bound c (the prefix policy's is 8c)
            assert lists["T1"] + lists["B1"] <= directory and sum(lists.values()) <= 2 * directory
            assert 0 <= policy.p <= capacity
    # every held key unpinned: the policy gives every one of them up, one by one, and then None
    while sizes:
        v = policy.victim(set())
        assert v in sizes
        del sizes[v]
        policy.on_remove(v)
    assert policy.victim(set()) is None


# ------------------------------------------------------------------------------------------------------------
# What each policy is for


def _reused_key_reads(policy: str) -> tuple[int, int]:
    """A key read every 15 inserts of one-time keys into a tier of 10 blocks (a miss is re-put, as a cache
    does): (reads that hit, reads)."""
    tier = MemoryTier(10 * 100, policy=policy, charge_overhead=False)
    hot = key("hot")
    assert put_one(tier, hot, b"h" * 100)
    tier.get_many([hot, hot])
    hits = reads = 0
    for i in range(300):
        assert put_one(tier, key(f"scan{i}"), b"s" * 100)
        if i % 15 == 14:
            reads += 1
            if tier.get_many([hot]) == [b"h" * 100]:
                hits += 1
            else:
                put_one(tier, hot, b"h" * 100)
    return hits, reads


@pytest.mark.parametrize("policy", ["s3fifo", "arc"])
def test_reused_key_survives_a_scan_that_flushes_lru(policy: str):
    lru_hits, reads = _reused_key_reads("lru")
    assert lru_hits == 0  # LRU: 15 new keys between reads push it out of 10 places every time
    hits, reads = _reused_key_reads(policy)
    assert hits == reads == 20


def test_s3fifo_queues_ghost_hit_goes_to_main_deleted_key_is_forgotten():
    tier = MemoryTier(1000, policy="s3fifo", charge_overhead=False)
    policy = tier.policy
    assert isinstance(policy, S3FIFOPolicy)
    for i in range(10):
        put_one(tier, key(i), b"x" * 100)
    assert all(policy.where(key(i)) == "small" for i in range(10))
    tier.get_many([key(1)])  # read while on probation
    put_one(tier, key(10), b"x" * 100)  # small holds >= its 10%: its head goes (key 0, never read)
    assert policy.where(key(0)) == "ghost" and tier.prefix_run_length([key(0)]) == 0
    put_one(tier, key(11), b"x" * 100)  # key 1 was read: moved to main on the way; key 2 goes
    assert policy.where(key(1)) == "main" and policy.where(key(2)) == "ghost"
    put_one(tier, key(0), b"x" * 100)  # back from the ghost list: straight into main
    assert policy.where(key(0)) == "main"
    tier.delete([key(5)])
    assert policy.where(key(5)) is None  # deleted, not evicted: no ghost
    put_one(tier, key(5), b"x" * 100)
    assert policy.where(key(5)) == "small"


def test_s3fifo_ghost_list_is_bounded_by_main_share():
    policy = S3FIFOPolicy(1000)
    tier = MemoryTier(1000, policy=policy, charge_overhead=False)
    for i in range(500):
        put_one(tier, key(i), b"x" * 100)
    assert policy.ghost_bytes() <= 900 and policy.ghost_limit == 900
    assert sum(policy.where(key(i)) == "ghost" for i in range(500)) == 9


def test_arc_ghost_hits_enter_t2_and_move_p_both_ways():
    block = 100
    tier = MemoryTier(4 * block, policy="arc", charge_overhead=False)
    arc = tier.policy
    assert isinstance(arc, ARCPolicy)

    def request(k: bytes) -> str | None:
        """Read ``k``; on a miss put it (as a cache does): "hit", or the ghost list it came back from."""
        if tier.get_many([k]) != [None]:
            return "hit"
        came_from = arc.where(k)
        assert put_one(tier, k, b"x" * block)
        return came_from

    request(key("warm"))
    request(key("warm"))  # in T2
    for i in range(4):  # T1 holds 3 of them: key 0 is pushed out into B1
        request(key(i))
    assert arc.where(key(0)) == "B1" and arc.p == 0
    assert request(key(0)) == "B1"  # recency was short of room: p grows, the key enters T2
    assert arc.where(key(0)) == "T2" and arc.p == block
    assert request(key(5)) is None and arc.where(key(5)) == "T1"  # a new key enters T1
    # recency-favouring: a loop of 3 keys once each, again soon after -> a B1 hit raises p
    p_before = arc.p
    answers = [request(key(i)) for _ in range(3) for i in range(10, 13)]
    assert "B1" in answers and arc.p > p_before
    # frequency-favouring: a hot set read twice a round, 3 new keys between rounds push it out -> B2 hits
    # lower p (T2 gets the room) until the hot set stays
    p_high = arc.p
    hot = [key(f"hot{i}") for i in range(3)]
    hot_answers: list[list[str | None]] = []
    for rnd in range(8):
        hot_answers.append([request(k) for k in hot])
        for k in hot:
            request(k)
        for j in range(3):
            request(key(f"new{rnd}.{j}"))
    assert "B2" in [a for answers in hot_answers for a in answers]
    assert arc.p < p_high
    assert all(a == "hit" for answers in hot_answers[-5:] for a in answers)
    assert 0 <= arc.p <= 4 * block


def test_arc_deleted_key_is_forgotten_and_t2_victims_go_to_b2():
    tier = MemoryTier(300, policy="arc", charge_overhead=False)
    arc = tier.policy
    assert isinstance(arc, ARCPolicy)
    a, b, c, d = (key(x) for x in "abcd")
    for k in (a, b, c):
        put_one(tier, k, b"x" * 100)
        tier.get_many([k])  # all in T2
    assert {arc.where(k) for k in (a, b, c)} == {"T2"}
    tier.delete([b])
    assert arc.where(b) is None
    put_one(tier, b, b"x" * 100)
    assert arc.where(b) == "T1"  # a fresh key again, not a ghost hit
    tier.delete([b])  # deleted from T1: forgotten too
    assert arc.where(b) is None
    put_one(tier, b, b"x" * 100)
    assert arc.where(b) == "T1"
    put_one(tier, d, b"x" * 100)  # T1 = {b} > p = 0: b goes to B1
    assert arc.where(b) == "B1"
    tier.get_many([d])  # T1 empty now: the next victim comes from T2, the least recent there (a)
    put_one(tier, key("e"), b"x" * 100)
    assert arc.where(a) == "B2"
    put_one(tier, a, b"x" * 100)  # B2 hit: back into T2
    assert arc.where(a) == "T2"
