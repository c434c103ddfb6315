"""A memory tier holds its own immutable copies of checked values: a caller's buffer changed after a put does not
reach it, and a store's read of it checks the header and owner but does not hash the bytes again (a disk tier's
reads still do)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FINGERPRINT, key_of, make_block

from kvshelf.kvstore import (
    CorruptBlockError,
    ForeignBlockError,
    LMDBTier,
    MemoryTier,
    TieredStore,
    encode_block,
    encoding,
)
from kvshelf.kvstore.pinned_memory import PinnedMemoryTier

MiB = 1 << 20


@pytest.fixture
def hashed(monkeypatch) -> list[int]:
    """The sizes of the blocks ``verify_block`` hashes, as it hashes them (the real xxh3, observed)."""
    sizes: list[int] = []
    real = encoding.xxhash.xxh3_64_digest

    def observed(data) -> bytes:
        sizes.append(len(data))
        return real(data)

    monkeypatch.setattr(encoding.xxhash, "xxh3_64_digest", observed)
    return sizes


def _store(data_dir: Path, memory: bool = True) -> TieredStore:
    tiers = [MemoryTier(4 * MiB, name="memory")] if memory else []
    return TieredStore([*tiers, LMDBTier(data_dir / "lmdb", initial_map_bytes=MiB, durable=False)])


def test_a_buffer_changed_after_its_put_does_not_reach_the_memory_tier(data_dir: Path) -> None:
    block = make_block(8)
    key = key_of(block)
    encoded = encode_block(block, key)
    buffer = bytearray(encoded)
    tier = MemoryTier(4 * MiB)
    assert tier.put_many([(key, buffer)]) == 1
    buffer[-1] ^= 0xFF  # the caller reuses its buffer
    (held,) = tier.get_many([key])
    assert type(held) is bytes and held == encoded


def test_a_memory_hit_is_not_hashed_again_and_a_disk_hit_is(data_dir: Path, hashed: list[int]) -> None:
    block = make_block(8)
    key = key_of(block)
    encoded = encode_block(block, key)
    store = _store(data_dir)
    try:
        store.put_encoded_many([(key, bytearray(encoded))])
        hashed.clear()
        assert store.get_encoded_many([key], fingerprint=FINGERPRINT) == [encoded]
        assert hashed == []  # the memory tier's copy was checked as it was written
        store.specs[0].tier.delete([key])
        assert store.get_encoded_many([key], fingerprint=FINGERPRINT) == [encoded]  # from LMDB, promoted
        assert hashed == [len(encoded) - 8]
        hashed.clear()
        assert store.get_encoded_many([key], fingerprint=FINGERPRINT) == [encoded]  # the promoted copy
        assert hashed == []
    finally:
        store.close()


def test_a_checked_copy_of_another_owner_is_still_refused(data_dir: Path) -> None:
    store = _store(data_dir)
    try:
        block = make_block(8, namespace="tenant-a")
        key = key_of(block)
        store.put_encoded_many([(key, encode_block(block, key))])
        assert store.get_encoded_many([key], fingerprint=FINGERPRINT, namespace="tenant-b") == [None]
        assert store.get_encoded_many([key], fingerprint="f" * 32, namespace="tenant-a") == [None]
        assert store.get_encoded_many([key], fingerprint=FINGERPRINT, namespace="tenant-a") != [None]
    finally:
        store.close()


def test_checksum_checked_still_checks_the_header_and_the_owner() -> None:
    block = make_block(8)
    key = key_of(block)
    encoded = encode_block(block, key)
    assert encoding.verify_block(encoded, expected_key=key, checksum_checked=True).key == key
    with pytest.raises(ForeignBlockError):
        encoding.verify_block(encoded, expected_key=b"\x00" * len(key), checksum_checked=True)
    with pytest.raises(CorruptBlockError):
        encoding.verify_block(encoded[:40], checksum_checked=True)
    with pytest.raises(CorruptBlockError):  # without the flag, a damaged payload is found
        encoding.verify_block(encoded[:-9] + bytes([encoded[-9] ^ 1]) + encoded[-8:])


def test_a_pinned_memory_tier_hands_out_writable_views_so_its_reads_are_hashed() -> None:
    assert MemoryTier.holds_checked_copies and not PinnedMemoryTier.holds_checked_copies
    assert not LMDBTier.holds_checked_copies
