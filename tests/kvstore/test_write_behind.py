"""``WriteBehind``: blocks stored off the caller's path, in order, bounded, flushed on close and at exit, failures
counted and never silent. Runs against the real embedded store (memory over LMDB)."""

from __future__ import annotations

import logging
import threading

import pytest
from helpers import FINGERPRINT, assert_same_block, key_of, make_block, run_python

from kvshelf.kvstore.embedded import open_embedded_store
from kvshelf.kvstore.errors import ConfigError, WriteBehindError
from kvshelf.kvstore.write_behind import WriteBehind


@pytest.fixture()
def store(tmp_path):
    with open_embedded_store(tmp_path / "store") as s:
        yield s


def blocks(n: int, start: int = 0) -> list:
    return [make_block(list(range(start + 10 * i, start + 10 * i + 4))) for i in range(n)]


def test_flush_makes_every_submitted_block_readable(store) -> None:
    made = blocks(12)
    with WriteBehind(store, max_pending_blocks=4) as writer:
        for block in made:
            assert writer.submit([(key_of(block), block)]) == 1
        stats = writer.flush()
        assert stats["written_blocks"] == 12 and stats["pending_blocks"] == 0 and stats["failed_blocks"] == 0
        got = store.get_many([key_of(b) for b in made], fingerprint=FINGERPRINT)
        for actual, expected in zip(got, made, strict=True):
            assert_same_block(actual, expected)


def test_pin_is_passed_on(store) -> None:
    (block,) = blocks(1)
    with WriteBehind(store) as writer:
        writer.submit([(key_of(block), block)], pin=True)
    assert store.unpin([key_of(block)]) == 1  # it was pinned


class GatedStore:
    """A real store behind a gate: ``put_many`` waits until the test opens it (to observe a full queue)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.gate, self.calls = inner, threading.Event(), 0

    def put_many(self, entries, *, pin=False):  # noqa: ANN001, ANN201
        self.calls += 1
        self.gate.wait(30)
        return self.inner.put_many(entries, pin=pin)


def test_submit_waits_while_the_queue_is_full(store) -> None:
    gated = GatedStore(store)
    writer = WriteBehind(gated, max_pending_blocks=2)
    first, second, third = blocks(3)
    writer.submit([(key_of(first), first), (key_of(second), second)])
    done = threading.Event()
    thread = threading.Thread(target=lambda: (writer.submit([(key_of(third), third)]), done.set()))
    thread.start()
    assert not done.wait(0.3), "submit did not wait while 2 of 2 blocks were pending"
    gated.gate.set()
    assert done.wait(30)
    thread.join()
    assert writer.close()["written_blocks"] == 3
    got = store.get_many([key_of(b) for b in (first, second, third)], fingerprint=FINGERPRINT)
    assert all(b is not None for b in got)


def test_failed_writes_are_counted_logged_and_kept(tmp_path, caplog) -> None:
    closed = open_embedded_store(tmp_path / "closed")
    closed.close()  # every write now raises
    made = blocks(3)
    with caplog.at_level(logging.ERROR, logger="kvshelf.kvstore.write_behind"), WriteBehind(closed) as writer:
        writer.submit([(key_of(b), b) for b in made])
        stats = writer.flush()
    assert stats["failed_blocks"] == 3 and stats["failed_batches"] == 1 and stats["written_blocks"] == 0
    assert stats["last_error"]
    assert any("3 blocks not stored" in r.getMessage() for r in caplog.records)


def test_closed_writer_refuses_new_blocks(store) -> None:
    writer = WriteBehind(store)
    writer.close()
    writer.close()  # idempotent
    (block,) = blocks(1)
    with pytest.raises(ConfigError, match="closed"):
        writer.submit([(key_of(block), block)])


def test_flush_timeout_is_an_error(store) -> None:
    gated = GatedStore(store)
    writer = WriteBehind(gated)
    (block,) = blocks(1)
    writer.submit([(key_of(block), block)])
    with pytest.raises(WriteBehindError, match="1 blocks still pending"):
        writer.flush(timeout_s=0.2)
    gated.gate.set()
    assert writer.close()["written_blocks"] == 1


def test_bad_bound_is_refused(store) -> None:
    with pytest.raises(ConfigError, match="max_pending_blocks"):
        WriteBehind(store, max_pending_blocks=0)


def test_pending_blocks_are_written_at_interpreter_exit(tmp_path) -> None:
    """A writer never closed: the process ends right after submitting, and the blocks are on disk."""
    data = tmp_path / "exit"
    code = f"""
import json, sys
sys.path.insert(0, "tests/support")
from helpers import key_of, make_block
from kvshelf.kvstore.embedded import open_embedded_store
from kvshelf.kvstore.write_behind import WriteBehind
store = open_embedded_store({str(data)!r}, memory_bytes=None)
writer = WriteBehind(store)
made = [make_block(list(range(10 * i, 10 * i + 4))) for i in range(20)]
writer.submit([(key_of(b), b) for b in made])
print(json.dumps([key_of(b).hex() for b in made]))
"""
    keys = [bytes.fromhex(k) for k in run_python(code)]
    with open_embedded_store(data, memory_bytes=None) as store:
        assert all(b is not None for b in store.get_many(keys, fingerprint=FINGERPRINT))


def test_an_idle_priority_writer_runs_at_sched_idle_and_stores_everything(store) -> None:
    import os

    made = blocks(6)
    with WriteBehind(store, max_pending_blocks=2, idle_priority=True) as writer:
        writer.submit([(key_of(b), b) for b in made])
        assert writer.flush()["written_blocks"] == 6
        assert writer.priority == "idle"  # Linux lets a thread lower its own policy without privilege
        assert os.sched_getscheduler(writer._thread.native_id) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller's thread is untouched
    for actual, expected in zip(store.get_many([key_of(b) for b in made], fingerprint=FINGERPRINT), made,
                                strict=True):
        assert_same_block(actual, expected)
