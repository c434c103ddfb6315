"""``kvshelf serve --durability``: fsync (each put flushed before it is acknowledged) and interval (committed to the
OS before it is acknowledged, flushed every --sync-interval seconds). Both keep every acknowledged put across a
SIGKILL of a real server process; the interval mode's flushes are checked on a real LMDB tier."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import assert_same_block, key_of, make_block
from service_helpers import ServeProcess, kvshelf_cli

from kvshelf.kvstore import LMDBTier, encode_block
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.periodic_sync import PeriodicSync
from kvshelf.service.client import RemoteStore
from kvshelf.service.serve import load_config


def test_periodic_sync_flushes_only_what_was_committed():
    flushed = threading.Event()
    calls: list[float] = []

    def flush() -> None:
        calls.append(time.monotonic())
        flushed.set()

    syncer = PeriodicSync(flush, 0.05)
    time.sleep(0.3)
    assert calls == []  # nothing committed: no flush
    syncer.dirty()
    assert flushed.wait(5)
    assert syncer.flushes == 1
    syncer.dirty()
    syncer.close()  # the last commit is flushed at close even before the interval
    assert syncer.flushes == 2


def test_periodic_sync_retries_a_failed_flush():
    attempts: list[int] = []

    def flush() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("disk hiccup")

    syncer = PeriodicSync(flush, 0.05)
    syncer.dirty()
    deadline = time.monotonic() + 5
    while syncer.flushes < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    syncer.close()
    assert len(attempts) >= 2 and syncer.flushes >= 1


def test_lmdb_tier_interval_mode_flushes_its_commits(tmp_path):
    tier = LMDBTier(tmp_path / "lmdb", capacity_bytes=64 << 20, durable=False, sync_interval_s=0.05)
    assert tier._syncer is not None
    block = make_block([1, 2, 3])
    tier.put_many([(key_of(block), encode_block(block, key_of(block)))])
    deadline = time.monotonic() + 5
    while tier._syncer.flushes < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tier._syncer.flushes >= 1
    tier.close()
    durable = LMDBTier(tmp_path / "lmdb2", durable=True, sync_interval_s=0.05)  # fsync mode: no periodic flushes
    assert durable._syncer is None
    durable.close()


@pytest.mark.parametrize("bad", [0, -1, True])
def test_lmdb_tier_refuses_a_bad_sync_interval(tmp_path, bad):
    with pytest.raises(ConfigError, match="sync_interval_s"):
        LMDBTier(tmp_path / "lmdb", durable=False, sync_interval_s=bad)


def test_serve_config_checks_durability():
    assert load_config({}, env={}).store.durability == "fsync"
    assert load_config({"durability": "interval"}, env={}).store.durability == "interval"
    with pytest.raises(ConfigError, match="durability must be one of fsync, interval"):
        load_config({"durability": "sometimes"}, env={})
    with pytest.raises(ConfigError, match="sync_interval must be > 0"):
        load_config({"sync_interval": 0}, env={})


def test_serve_bad_durability_is_one_line():
    result = kvshelf_cli("serve", "--durability", "never", "--listen", "127.0.0.1:0")
    assert result.returncode == 2
    assert "durability must be one of fsync, interval" in result.stderr


def test_acknowledged_puts_survive_a_sigkill_in_interval_mode(tmp_path):
    """Every put acknowledged before a SIGKILL of the server is readable from a new server on the same data, with
    no flush in between (fsync mode: the chaos bench and tests/service/test_service.py)."""
    mode = "interval"
    data = tmp_path / "data"
    args = ("--listen", "127.0.0.1:0", "--data-dir", str(data), "--durability", mode, "--sync-interval", "30")
    server = ServeProcess(*args)
    blocks = [make_block(list(range(i, i + 64)), seed=i) for i in range(20)]
    try:
        with RemoteStore(server.address, shared_memory=False) as remote:
            for block in blocks:  # one call each: each acknowledged before the next
                assert remote.put_many([(key_of(block), block)]) == 1
    finally:
        server.stop()  # SIGKILL: no clean close, no flush of the interval mode (its interval is 30 s)
    server = ServeProcess(*args)
    try:
        with RemoteStore(server.address, shared_memory=False) as remote:
            got = remote.get_many([key_of(b) for b in blocks], fingerprint=blocks[0].fingerprint)
        for block, back in zip(blocks, got, strict=True):
            assert back is not None and back.token_ids == block.token_ids
            assert_same_block(back, block)
    finally:
        server.stop()
