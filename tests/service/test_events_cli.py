"""`kvshelf events` in a subprocess against a real server on loopback: live lines, --json, Ctrl-C, bad inputs."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading

import pytest
from helpers import REPO_ROOT, key_of, make_block
from service_helpers import kvshelf_cli, put_with_lineage

from kvshelf.kvstore import MemoryTier, TieredStore, open_embedded_store
from kvshelf.service.client import RemoteStore
from kvshelf.service.server import ServerLimits, start_server

WAIT_S = 60.0  # generous: the subprocess imports torch before it connects


class EventsProcess:
    """``kvshelf events ARGS`` running; its stdout lines arrive in a queue (read with a timeout)."""

    def __init__(self, *args: str, read: bool = True) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", "from kvshelf.cli import main; main()", "events", *args],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
        )
        self.lines: queue.Queue[str] = queue.Queue()
        if read:
            self.read()

    def read(self) -> None:
        """Start reading its output (until then it fills the pipe and blocks: a slow terminal)."""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def line(self) -> str:
        try:
            return self.lines.get(timeout=WAIT_S)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"no line from kvshelf events; stderr: {self.proc.communicate()[1]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path):
    store = open_embedded_store(tmp_path / "data")
    running = start_server(store, events_dir=tmp_path / "data" / "events")
    yield running
    running.stop(0)
    store.close()


def _put(server, tokens: list[int]) -> bytes:
    block = make_block(tokens)
    with RemoteStore(f"127.0.0.1:{server.port}", shared_memory=False) as remote:
        remote.put_many([(key_of(block), block)])
    return key_of(block)


def test_prints_replayed_and_live_events_and_ctrl_c_exits_0(server):
    before = _put(server, [1, 2, 3])
    events = EventsProcess("--server", f"127.0.0.1:{server.port}", "--from-seq", "1")
    try:
        assert events.line().startswith("# subscribed to namespace 'default': next event seq 3")
        replayed = [events.line(), events.line()]
        assert replayed[0].startswith(f"1 BlockStored {before.hex()} medium=memory")
        assert replayed[1].startswith(f"2 BlockStored {before.hex()} medium=disk")
        assert "tokens=3 codec=raw" in replayed[0]
        live = _put(server, [4, 5])
        assert events.line().startswith(f"3 BlockStored {live.hex()} medium=memory")
        assert events.line().startswith(f"4 BlockStored {live.hex()} medium=disk")
        events.proc.send_signal(signal.SIGINT)
        assert events.proc.wait(timeout=WAIT_S) == 0
    finally:
        events.stop()


def test_json_lines_and_the_end_of_the_server(server):
    key = _put(server, [7, 8])
    events = EventsProcess("--server", f"127.0.0.1:{server.port}", "--from-seq", "1", "--json")
    try:
        started = json.loads(events.line())
        assert started == {"type": "started", "namespace": "default", "next_seq": 3, "oldest_seq": 1}
        first = json.loads(events.line())
        assert first["type"] == "BlockStored" and first["seq"] == 1 and first["block_hashes"] == [key.hex()]
        assert first["token_ids"] == [7, 8] and first["medium"] == "memory" and first["bytes"] > 0
        assert json.loads(events.line())["medium"] == "disk"
        server.stop(1)  # the server goes: one error line, the client commands' exit code
        assert events.proc.wait(timeout=WAIT_S) == 2
        err = events.proc.stderr.read().strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and "shutting down" in err[0]
    finally:
        events.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_is_one_error_line():
    result = kvshelf_cli("events", "--server", f"127.0.0.1:{_free_port()}", "--connect-timeout", "1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "unreachable" in lines[0]


@pytest.mark.parametrize("value", ["abc", "-3"])
def test_bad_from_seq_is_refused(value):
    result = kvshelf_cli("events", "--server", "127.0.0.1:1", f"--from-seq={value}")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: --from-seq must be an integer >= 0, got '{value}'"


def test_a_slow_terminal_is_resumed_without_gaps_or_duplicates(tmp_path):
    """Nobody reads the CLI's output for a while (its pipe fills, its prints block): the server cuts the subscription
    off as too slow, and the CLI resumes from where it stopped: every event printed exactly once."""
    store = TieredStore([MemoryTier(1 << 30)])
    running = start_server(store, limits=ServerLimits(subscriber_queue=20))
    events = EventsProcess("--server", f"127.0.0.1:{running.port}", "--from-seq", "1", "--json", read=False)
    try:
        assert json.loads(events.proc.stdout.readline())["type"] == "started"
        blocks = [make_block([i, 7]) for i in range(600)]
        tokens = list(range(8000))  # ~40 KB per JSON line, ~16 KB per event on the wire
        for start in range(0, len(blocks), 50):
            batch = blocks[start : start + 50]
            entries = [(key_of(b), b) for b in batch]
            assert put_with_lineage(running.port, "default", entries, [(None, tokens)] * 50) == 50
        events.read()
        seqs, resumed = [], 0
        while len(seqs) < len(blocks):
            line = json.loads(events.line())
            if line["type"] == "resumed":
                resumed += 1
                assert line["from_seq"] == seqs[-1] + 1 if seqs else 1
            elif line["type"] == "BlockStored":
                seqs.append(line["seq"])
        assert resumed >= 1 and running.servicer.events.ended_slow >= 1
        assert seqs == list(range(1, len(blocks) + 1))
        events.proc.send_signal(signal.SIGINT)
        assert events.proc.wait(timeout=WAIT_S) == 0
    finally:
        events.stop()
        running.stop(0)

