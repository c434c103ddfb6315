"""The ``BlockStore`` contract: one behaviour suite run against every store, and a check that their signatures agree.

Stores under test (the ``store`` fixture's params; a new backend gets the whole suite by adding one):

* ``embedded``: ``open_embedded_store`` (memory over LMDB) in a fresh temporary directory;
* ``remote``: ``RemoteStore`` to a real ``kvshelf serve`` subprocess (memory over LMDB), same-host shared memory on;
* ``remote-wire``: the same server with every byte over gRPC (shared memory off).

The server is one per module; each test works in a namespace of its own, so tests never see each other's blocks.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import FINGERPRINT, assert_same_block, key_of, make_block
from service_helpers import ServeProcess

from kvshelf.kvstore import BlockStore, TieredStore, decode_block, encode_block, open_embedded_store, prefix_block_keys
from kvshelf.kvstore.block import KVBlock, PreparedBlock
from kvshelf.kvstore.errors import ConfigError, KVShelfError
from kvshelf.kvstore.protocol import DEFAULT_NAMESPACE, METHODS, STATS_KEYS, TIER_STATS_KEYS
from kvshelf.service.client import RemoteStore

MEMORY = "512KiB"  # small: a few big blocks fill it, so evictions (and pins) show
MISSING = b"\xfe" * 16
STORES = ["embedded", "remote", "remote-wire"]


# ------------------------------------------------------------------------------------------------------------
# the signatures
# ------------------------------------------------------------------------------------------------------------


def _shape(function: Callable) -> list[tuple[str, str, object, object]]:
    """Parameters (name, kind, default, annotation as written) plus the return annotation."""
    signature = inspect.signature(function)
    params = [(p.name, p.kind.name, p.default, p.annotation) for p in signature.parameters.values()]
    return [*params, ("return", "", None, signature.return_annotation)]


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("cls", [TieredStore, RemoteStore], ids=lambda c: c.__name__)
def test_signatures_match_the_protocol(cls: type, name: str) -> None:
    shape = _shape(getattr(cls, name))
    assert shape == _shape(getattr(BlockStore, name)), f"{cls.__name__}.{name} differs from BlockStore.{name}"
    assert all(isinstance(a, str) for n, *_, a in shape if n != "self"), "annotations compared as written (strings)"


def test_the_protocol_lists_every_method() -> None:
    declared = {n for n, v in vars(BlockStore).items() if callable(v) and (not n.startswith("_") or n in METHODS)}
    assert declared == set(METHODS)


def test_constructor_namespace_defaults_agree() -> None:
    for function in (TieredStore.__init__, RemoteStore.__init__, open_embedded_store):
        param = inspect.signature(function).parameters["namespace"]
        assert (param.kind, param.default, param.annotation) == (param.KEYWORD_ONLY, DEFAULT_NAMESPACE, "str")


# ------------------------------------------------------------------------------------------------------------
# the stores
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A real ``kvshelf serve`` (dev mode: namespaces from the requests) for this module."""
    data = tmp_path_factory.mktemp("contract-server")
    proc = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(data), "--memory", MEMORY,
                        "--max-disk", "256MiB")
    assert proc.proc.stdout is not None
    drain = threading.Thread(target=proc.proc.stdout.read, daemon=True)  # its log never fills the pipe
    drain.start()
    yield proc
    proc.stop()


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlockStore]:
    namespace = f"contract-{os.urandom(4).hex()}"
    if request.param == "embedded":
        opened: BlockStore = open_embedded_store(tmp_path / "data", memory_bytes=MEMORY, max_disk_bytes="256MiB",
                                                 durable=False, namespace=namespace)
    else:
        address = request.getfixturevalue("server").address
        opened = RemoteStore(address, namespace=namespace, shared_memory=request.param == "remote")
    with opened:
        yield opened


def block_of(store: BlockStore, tokens: int | list[int] = 4, **kwargs) -> tuple[bytes, KVBlock]:
    """A block of the store's namespace and its key."""
    block = make_block(tokens, namespace=store.namespace, **kwargs)
    return key_of(block), block


def some_blocks(store: BlockStore, n: int) -> list[tuple[bytes, KVBlock]]:
    return [block_of(store, [100 * i + j for j in range(4)]) for i in range(n)]


def materialize(prepared: PreparedBlock) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.empty(prepared.shape, dtype=prepared.dtype)
    values = torch.empty(prepared.shape, dtype=prepared.dtype)
    prepared.payload.write(keys, values)
    return keys, values


# ------------------------------------------------------------------------------------------------------------
# the behaviour
# ------------------------------------------------------------------------------------------------------------


def test_is_a_block_store_with_its_namespace(store: BlockStore) -> None:
    assert isinstance(store, BlockStore)
    assert store.namespace.startswith("contract-")
    assert store.__enter__() is store


def test_put_get_round_trip(store: BlockStore) -> None:
    entries = [
        block_of(store, 4),
        block_of(store, 5, dtype=torch.bfloat16, start_pos=3),
        block_of(store, [7, 8, 9], extra={"note": "kept"}),
        block_of(store, 96, heads=4, head_dim=64),  # ~200 KB encoded
    ]
    assert store.put_many(entries) == len(entries)
    keys = [k for k, _ in entries]
    for copy in (True, False):
        got = store.get_many([keys[0], MISSING, *keys[1:]], fingerprint=FINGERPRINT, copy=copy)
        assert len(got) == len(entries) + 1 and got[1] is None
        for block, (_, expected) in zip([got[0], *got[2:]], entries, strict=True):
            assert_same_block(block, expected)
    # namespace=None is the store's namespace
    explicit = store.get_many(keys, fingerprint=FINGERPRINT, namespace=store.namespace)
    for block, (_, expected) in zip(explicit, entries, strict=True):
        assert_same_block(block, expected)
    # writing again is accepted and changes nothing
    assert store.put_many(entries[:1]) == 1
    assert_same_block(store.get_many(keys[:1], fingerprint=FINGERPRINT)[0], entries[0][1])


def test_misses(store: BlockStore) -> None:
    other = [bytes([i]) * 16 for i in range(3)]
    assert store.get_many(other, fingerprint=FINGERPRINT) == [None, None, None]
    assert store.get_prepared_many(other, fingerprint=FINGERPRINT) == [None, None, None]
    assert store.get_encoded_many(other) == [None, None, None]
    assert store.lookup_prefix(other) == 0


def test_lookup_prefix_counts_the_cached_prefix(store: BlockStore) -> None:
    tokens = list(range(500, 520))
    keys = prefix_block_keys(FINGERPRINT, store.namespace, tokens, 4)  # 5 chained blocks
    blocks = [make_block(tokens[4 * i : 4 * i + 4], start_pos=4 * i, namespace=store.namespace) for i in range(5)]
    assert store.put_many([(keys[i], blocks[i]) for i in (0, 1, 3)]) == 3
    assert store.lookup_prefix(keys) == 2
    assert store.lookup_prefix(keys[:2]) == 2
    assert store.lookup_prefix(keys[3:]) == 1
    assert store.lookup_prefix([keys[2], keys[0]]) == 0
    assert store.lookup_prefix(keys, namespace=store.namespace, model=FINGERPRINT, tokens=[4] * 5) == 2
    stats = store.stats()
    assert stats["lookup_hit_rate"] == pytest.approx((2 + 2 + 1 + 0 + 2) / (5 + 2 + 2 + 2 + 5))
    (row,) = [r for r in stats["rows"] if r["tier"] == "*" and r["model"] == FINGERPRINT]
    assert (row["namespace"], row["lookup_tokens"], row["lookup_hit_tokens"]) == (store.namespace, 20, 8)
    store.put_many([(keys[2], blocks[2])])
    assert store.lookup_prefix(keys) == 4


def test_held_answers_per_key_and_counts_no_lookup(store: BlockStore) -> None:
    tokens = list(range(600, 612))
    keys = prefix_block_keys(FINGERPRINT, store.namespace, tokens, 4)
    assert store.put_many([(keys[i], make_block(tokens[4 * i : 4 * i + 4], start_pos=4 * i,
                                                namespace=store.namespace)) for i in (0, 2)]) == 2
    before = store.stats()
    assert store.held(keys) == [True, False, True]
    assert store.held(keys, namespace=store.namespace) == [True, False, True]
    assert store.held([]) == []
    after = store.stats()
    assert (after["lookup_hit_rate"], after["rows"]) == (before["lookup_hit_rate"], before["rows"])


def test_get_prepared_many_equals_get_many(store: BlockStore) -> None:
    entries = [block_of(store, 6), block_of(store, 3, dtype=torch.float16, start_pos=9)]
    store.put_many(entries)
    keys = [k for k, _ in entries]
    prepared = store.get_prepared_many([keys[0], MISSING, keys[1]], fingerprint=FINGERPRINT, tokens=[6, 1, 3])
    decoded = store.get_many([keys[0], MISSING, keys[1]], fingerprint=FINGERPRINT)
    assert prepared[1] is None and decoded[1] is None
    for p, d in zip([prepared[0], prepared[2]], [decoded[0], decoded[2]], strict=True):
        assert isinstance(p, PreparedBlock)
        assert (p.token_ids, p.start_pos, p.fingerprint, p.namespace) == (
            d.token_ids, d.start_pos, d.fingerprint, d.namespace)
        assert (p.shape, p.dtype, p.num_tokens) == (tuple(d.keys.shape), d.dtype, d.num_tokens)
        keys_out, values_out = materialize(p)
        assert torch.equal(keys_out, d.keys) and torch.equal(values_out, d.values)


def test_get_encoded_many(store: BlockStore) -> None:
    (key, block), (key2, block2) = some_blocks(store, 2)
    value = encode_block(block, key)
    assert store.put_encoded_many([(key, value)]) == 1
    store.put_many([(key2, block2)])
    got = store.get_encoded_many([key, MISSING, key2])
    assert got[1] is None
    assert bytes(got[0]) == value  # the store's codec here is raw: the very bytes
    assert_same_block(decode_block(got[0], expected_key=key), block)
    assert_same_block(decode_block(got[2], expected_key=key2), block2)
    assert store.get_encoded_many([key], fingerprint=FINGERPRINT, namespace=store.namespace)[0] is not None
    assert store.get_encoded_many([key], fingerprint="another-model") == [None]
    assert store.get_encoded_many([key], namespace="someone-else") == [None]
    # an encoded put then reads as a block
    assert_same_block(store.get_many([key], fingerprint=FINGERPRINT)[0], block)


def test_put_encoded_refuses_damaged_values_and_stores_nothing(store: BlockStore) -> None:
    (key, block), (key2, block2) = some_blocks(store, 2)
    damaged = bytearray(encode_block(block2, key2))
    damaged[-20] ^= 0x10
    with pytest.raises(KVShelfError):
        store.put_encoded_many([(key, encode_block(block, key)), (key2, bytes(damaged))])
    with pytest.raises(KVShelfError):
        store.put_encoded_many([(key2, encode_block(block, key))])  # another key's value
    assert store.lookup_prefix([key]) == 0 and store.lookup_prefix([key2]) == 0


def test_foreign_fingerprint_or_namespace_is_a_miss(store: BlockStore) -> None:
    (key, block), = some_blocks(store, 1)
    store.put_many([(key, block)])
    assert store.get_many([key], fingerprint="another-model") == [None]
    assert store.get_prepared_many([key], fingerprint="another-model") == [None]
    assert store.get_many([key], fingerprint=FINGERPRINT, namespace="someone-else") == [None]
    assert store.get_prepared_many([key], fingerprint=FINGERPRINT, namespace="someone-else") == [None]
    assert_same_block(store.get_many([key], fingerprint=FINGERPRINT)[0], block)  # its owner still gets it


def test_delete_counts_held_keys(store: BlockStore) -> None:
    entries = some_blocks(store, 3)
    (k0, _), (k1, b1), (k2, b2) = entries
    store.put_many(entries)
    assert store.delete([k0, MISSING, k0]) == 1
    assert store.delete([k0]) == 0
    assert store.get_many([k0], fingerprint=FINGERPRINT) == [None]
    assert store.lookup_prefix([k0]) == 0
    got = store.get_many([k1, k2], fingerprint=FINGERPRINT)
    assert_same_block(got[0], b1)
    assert_same_block(got[1], b2)
    assert store.delete([k1, k2]) == 2
    assert store.lookup_prefix([k1]) == 0 and store.lookup_prefix([k2]) == 0


def test_pin_unpin_counts(store: BlockStore) -> None:
    (k0, b0), (k1, b1), (k2, b2) = some_blocks(store, 3)
    assert store.pin([k0]) == 0  # absent keys are never pinned
    store.put_many([(k0, b0), (k1, b1)])
    assert store.stats()["pinned"] == 0
    assert store.pin([k0, MISSING, k0]) == 1
    assert store.pin([k0]) == 1  # already pinned, still held: counted again
    assert store.stats()["pinned"] == 1
    assert store.unpin([k0, k1, MISSING]) == 1
    assert store.unpin([k0]) == 0
    assert store.put_many([(k2, b2)], pin=True) == 1
    assert store.stats()["pinned"] == 1
    assert store.delete([k2]) == 1  # a delete drops the pin
    assert store.stats()["pinned"] == 0
    assert store.unpin([k2]) == 0


def test_pinned_blocks_survive_eviction(store: BlockStore) -> None:
    def big(i: int) -> tuple[bytes, KVBlock]:  # ~130 KB encoded: four fill the 512 KiB memory tier
        return block_of(store, [1000 * i + j for j in range(64)], head_dim=64)

    pinned_key, pinned = big(0)
    assert store.put_many([(pinned_key, pinned)], pin=True) == 1
    flood = [big(i) for i in range(1, 9)]
    for entry in flood:
        store.put_many([entry])

    def memory() -> dict:
        (tier,) = [t for t in store.stats()["tiers"] if t["name"] == "memory"]
        return tier

    hits = memory()["hits"]
    assert_same_block(store.get_many([pinned_key], fingerprint=FINGERPRINT)[0], pinned)
    assert memory()["hits"] == hits + 1  # served by the memory tier: never evicted
    misses = memory()["misses"]
    assert_same_block(store.get_many([flood[0][0]], fingerprint=FINGERPRINT)[0], flood[0][1])
    assert memory()["misses"] == misses + 1  # an unpinned one was evicted there (and is still on disk)
    assert store.unpin([pinned_key]) == 1


def test_stats_shape(store: BlockStore) -> None:
    stats = store.stats()
    assert set(stats) >= STATS_KEYS
    assert stats["lookup_hit_rate"] is None and stats["retrieve_hit_rate"] is None and stats["pinned"] == 0
    assert [t["name"] for t in stats["tiers"]] == ["memory", "disk"]
    for tier in stats["tiers"]:
        assert set(tier) >= TIER_STATS_KEYS
        # a server's tiers keep blocks as clients sent them (any codec): their stats say so
        assert tier["available"] is True and tier["codec"] in ("raw", "as-sent")
    (key, block), (key2, _) = some_blocks(store, 2)
    store.put_many([(key, block)])
    store.get_many([key, key2], fingerprint=FINGERPRINT)
    store.lookup_prefix([key, key2])
    stats = store.stats()
    assert stats["retrieve_hit_rate"] == pytest.approx(1 / 2)
    assert stats["lookup_hit_rate"] == pytest.approx(1 / 2)
    memory = stats["tiers"][0]
    assert (memory["blocks"], memory["hits"], memory["misses"]) == (1, 1, 1)
    assert memory["bytes"] == memory["bytes_written"] == len(encode_block(block, key))
    assert json.loads(json.dumps(stats)) == stats


def test_empty_inputs(store: BlockStore) -> None:
    assert store.put_many([]) == 0
    assert store.put_encoded_many([]) == 0
    assert store.get_many([], fingerprint=FINGERPRINT) == []
    assert store.get_prepared_many([], fingerprint=FINGERPRINT) == []
    assert store.get_encoded_many([]) == []
    assert store.lookup_prefix([]) == 0
    assert store.delete([]) == 0
    assert store.pin([]) == 0
    assert store.unpin([]) == 0


BAD_KEYS = [b"", b"short", b"k" * 15, b"k" * 17, "a str of 16 char"]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=["empty", "5-bytes", "15-bytes", "17-bytes", "str"])
def test_bad_key_raises_config_error(store: BlockStore, bad: object) -> None:
    (key, block), = some_blocks(store, 1)
    calls: list[Callable[[], object]] = [
        lambda: store.put_many([(key, block), (bad, block)]),
        lambda: store.put_encoded_many([(key, encode_block(block, key)), (bad, encode_block(block, key))]),
        lambda: store.get_many([key, bad], fingerprint=FINGERPRINT),
        lambda: store.get_prepared_many([bad], fingerprint=FINGERPRINT),
        lambda: store.get_encoded_many([bad]),
        lambda: store.lookup_prefix([key, bad]),
        lambda: store.delete([bad]),
        lambda: store.pin([bad]),
        lambda: store.unpin([bad]),
    ]
    for call in calls:
        with pytest.raises(ConfigError, match="16 bytes"):
            call()
    assert store.lookup_prefix([key]) == 0  # nothing of a refused put was stored
    assert store.put_many([(key, block)]) == 1  # and the store goes on
