"""The ``Tier`` contract: one behaviour suite run against every tier.

Tiers under test: every scheme of the tier registry (``kvstore.tier_registry.SCHEMES``), each opened by its URL
(``URLS`` below says where a scheme's tier lives in a test; a registered scheme missing there fails
``test_every_registered_scheme_is_tested``): ``memory://``, ``lmdb://`` in a temporary directory, ``redis://`` on a
real standalone ``redis-server`` and ``redis+cluster://`` on a real local 3-node Redis Cluster, ``rediss://`` and
``rediss+cluster://`` on the same speaking only TLS (a self-signed CA made per session, passed in the URL as
``?ssl_ca_certs=``, the certificate verified) (``tests/support/redis_servers.py``; each test under a key prefix
of its own). What only one tier does (eviction policies, LMDB map growth, Redis chunk layout and failures) is
tested in that tier's own file.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis_servers
from helpers import key_of, make_block, run_workers

from kvshelf.kvstore import Tier, encode_block
from kvshelf.kvstore.tier_registry import SCHEMES, lmdb_url, open_tier

# the real Redis servers (session-scoped; tests share them under key prefixes of their own)
redis_server = redis_servers.redis_server
redis_cluster = redis_servers.redis_cluster
tls_files = redis_servers.tls_files  # the TLS servers' certificates
tls_redis_server = redis_servers.tls_redis_server
tls_redis_cluster = redis_servers.tls_redis_cluster

MiB = 1 << 20
CHUNK = 64 << 10  # the Redis tiers' chunk size here, so that the sizes below cross chunk boundaries
SIZES = [0, 1, 100, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 5 * CHUNK + 17]
#: scheme -> (URL of its tier in a test (``{tmp}``: a temporary directory, ``{redis}``: the URL of the server
#: fixture named next), that fixture or None, the options)
URLS: dict[str, tuple[str, str | None, dict[str, object]]] = {
    "memory": ("memory://?capacity=64MiB", None, {}),
    # the CPU tier a GPU reads by DMA: values in buffers of their own (page-locked where CUDA is present)
    "memory+pinned": ("memory://?capacity=64MiB&pinned=true", None, {}),
    "lmdb": ("{tmp}", None, {"initial_map_bytes": MiB, "max_map_bytes": 256 * MiB, "durable": False}),
    "redis": ("{redis}", "redis_server", {"chunk_bytes": CHUNK}),
    "redis+cluster": ("{redis}", "redis_cluster", {"chunk_bytes": CHUNK}),
    "rediss": ("{redis}", "tls_redis_server", {"chunk_bytes": CHUNK}),
    "rediss+cluster": ("{redis}", "tls_redis_cluster", {"chunk_bytes": CHUNK}),
}


def test_every_registered_scheme_is_tested() -> None:
    schemes = {name.removesuffix("+pinned") for name in URLS}
    assert sorted(schemes) == sorted(SCHEMES), "a scheme of kvstore.tier_registry.SCHEMES needs its line in URLS"


@pytest.fixture(params=list(URLS))
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    url, fixture, options = URLS[request.param]
    if fixture is not None:
        url = url.format(redis=request.getfixturevalue(fixture).url)
        options = {**options, "prefix": f"t{os.urandom(6).hex()}:"}
    url = url.format(tmp=lmdb_url(tmp_path / "lmdb"))
    assert url.startswith(request.param.removesuffix("+pinned") + "://")
    made = open_tier(url, **options)
    yield made
    made.close()


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def v(i: int, size: int) -> bytes:
    """A value of ``size`` bytes, distinct per ``i`` (random beyond 1 KB)."""
    return bytes([i % 251]) * size if size < 1000 else os.urandom(size)


def test_is_a_tier(tier: Tier) -> None:
    assert isinstance(tier, Tier)
    assert isinstance(tier.name, str) and tier.name


def test_round_trip_of_every_size(tier: Tier) -> None:
    items = [(k(i), v(i, size)) for i, size in enumerate(SIZES)]
    assert tier.put_many(items) == len(items)
    keys = [key for key, _ in items]
    assert tier.get_many(keys) == [value for _, value in items]
    assert tier.get_many([k(99), k(7), k(98), k(0)]) == [None, items[7][1], None, items[0][1]]
    assert tier.get_many([k(3), k(3)]) == [items[3][1], items[3][1]]
    # a real encoded block
    block = make_block(128, head_dim=64)
    encoded = encode_block(block, key_of(block))
    assert tier.put_many([(key_of(block), encoded)]) == 1
    assert tier.get_many([key_of(block)]) == [encoded]


def test_empty_inputs(tier: Tier) -> None:
    assert tier.put_many([]) == 0
    assert tier.get_many([]) == []
    assert tier.prefix_run_length([]) == 0
    assert tier.delete([]) == 0
    tier.pin([])
    tier.unpin([])
    assert tier.keys() == []
    usage = tier.usage()
    assert (usage.blocks, usage.bytes) == (0, 0)


def test_scoped_keys(tier: Tier) -> None:
    """Keys are opaque bytes: the service's scoped keys (an 8-byte tag before the 16-byte key) work alike."""
    scoped = [b"\x01" * 8 + k(1), b"\x02" * 8 + k(1)]
    assert tier.put_many([(scoped[0], b"one"), (scoped[1], b"two")]) == 2
    assert tier.get_many([*scoped, k(1)]) == [b"one", b"two", None]
    assert sorted(tier.keys()) == sorted(scoped)
    assert tier.delete([scoped[0]]) == 1
    assert tier.get_many(scoped) == [None, b"two"]


def test_prefix_run_length_is_a_prefix_length(tier: Tier) -> None:
    tier.put_many([(k(i), v(i, 3 * CHUNK if i % 2 else 50)) for i in (0, 1, 3)])
    assert tier.prefix_run_length([k(0), k(1), k(2), k(3)]) == 2
    assert tier.prefix_run_length([k(0), k(1), k(3)]) == 3
    assert tier.prefix_run_length([k(2), k(0)]) == 0
    assert tier.prefix_run_length([k(3)]) == 1
    assert tier.prefix_run_length([k(0), k(0)]) == 2


def test_overwrite_replaces_the_value(tier: Tier) -> None:
    assert tier.put_many([(k(1), v(1, 4 * CHUNK)), (k(2), v(2, 10))]) == 2
    small = v(3, 10)
    assert tier.put_many([(k(1), small)]) == 1
    assert tier.get_many([k(1)]) == [small]
    large = v(4, 2 * CHUNK)
    tier.put_many([(k(1), large)])
    assert tier.get_many([k(1), k(2)]) == [large, v(2, 10)]
    usage = tier.usage()
    assert (usage.blocks, usage.bytes) == (2, 2 * CHUNK + 10)  # counted once, at the new size


def test_delete_counts_present_keys(tier: Tier) -> None:
    tier.put_many([(k(i), v(i, 4 * CHUNK if i == 1 else 30 + i)) for i in range(3)])
    assert tier.delete([k(0), k(1), k(9)]) == 2
    assert tier.delete([k(0)]) == 0
    assert tier.get_many([k(0), k(1), k(2)]) == [None, None, v(2, 32)]
    assert tier.prefix_run_length([k(2)]) == 1 and tier.prefix_run_length([k(1)]) == 0
    usage = tier.usage()
    assert (usage.blocks, usage.bytes) == (1, 32)
    assert tier.put_many([(k(1), b"again")]) == 1  # a deleted key can be stored again
    assert tier.get_many([k(1)]) == [b"again"]


def test_usage_and_keys(tier: Tier) -> None:
    sizes = {k(i): 100 + 37 * i + (3 * CHUNK if i % 3 == 0 else 0) for i in range(10)}
    assert tier.put_many([(key, v(1, size)) for key, size in sizes.items()]) == 10
    usage = tier.usage()
    assert (usage.blocks, usage.bytes) == (10, sum(sizes.values()))
    assert usage.capacity_bytes is None or usage.capacity_bytes >= usage.bytes
    assert sorted(tier.keys()) == sorted(sizes)
    tier.delete([k(1), k(2)])
    usage = tier.usage()
    assert (usage.blocks, usage.bytes) == (8, sum(sizes.values()) - sizes[k(1)] - sizes[k(2)])
    assert sorted(tier.keys()) == sorted(set(sizes) - {k(1), k(2)})


def test_pins_and_the_eviction_callback_within_capacity(tier: Tier) -> None:
    """Within its capacity a tier evicts nothing: overwrites and deletes are not evictions; pins lose nothing."""
    evicted: list[bytes] = []
    tier.set_eviction_callback(lambda key, value: evicted.append(key))
    tier.pin([k(0), k(42)])  # k(42) is never stored
    values = [v(i, 900 + i) for i in range(5)]
    tier.put_many([(k(i), values[i]) for i in range(5)])
    tier.put_many([(k(1), b"overwritten")])
    tier.delete([k(2)])
    tier.unpin([k(0), k(3)])
    assert evicted == []
    assert tier.get_many([k(0), k(1), k(2), k(3), k(4)]) == [values[0], b"overwritten", None, values[3], values[4]]
    tier.set_eviction_callback(None)


def test_peek_many_reads_what_get_many_reads(tier: Tier) -> None:
    values = [v(i, 700 + i) for i in range(3)]
    tier.put_many([(k(i), values[i]) for i in range(3)])
    assert tier.peek_many([k(2), k(9), k(0)]) == [values[2], None, values[0]] == tier.get_many([k(2), k(9), k(0)])
    assert tier.peek_many([]) == []


def test_threads_sharing_one_tier(tier: Tier) -> None:
    """Concurrent puts, gets and deletes: a read is a miss or the one value of its key; the usage stays exact."""
    value = {i: v(i, 200 + 61 * i) for i in range(24)}

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            i = rng.randrange(24)
            op = rng.random()
            if op < 0.5:
                tier.put_many([(k(i), value[i])])
            elif op < 0.85:
                assert tier.get_many([k(i)]) in ([None], [value[i]])
            else:
                tier.delete([k(i)])

    run_workers(worker, 3)
    held = dict(zip(tier.keys(), tier.get_many(tier.keys()), strict=True))
    assert all(got == value[int.from_bytes(key, "big")] for key, got in held.items())
    usage = tier.usage()
    assert (usage.blocks, usage.bytes) == (len(held), sum(len(got) for got in held.values()))
