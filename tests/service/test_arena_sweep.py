"""Arenas of dead clients (service/arena.py): a SIGKILLed client's /dev/shm arena, holding the plaintext blocks
the server wrote there, is removed by a running ``kvshelf serve`` (at start and every sweep period) without any
new client arriving, and the server keeps no descriptor of it open. Live clients' arenas are never touched."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import REPO_ROOT

from kvshelf.service.arena import (
    ARENA_DIR,
    HEADER_BYTES,
    MAGIC,
    ArenaSweeper,
    ClientArena,
    shared_memory_supported,
    sweep_dead_arenas,
)
from kvshelf.service.serve import ServeConfig, serve

pytestmark = pytest.mark.skipif(not shared_memory_supported(), reason="needs a writable /dev/shm (Linux)")

SWEEP_S = 0.2
SUPPORT = str(Path(REPO_ROOT) / "tests" / "support")

# A same-host client: puts a block, reads it back through its arena (the server pwrites it there), prints the
# arena's name, then waits to be killed.
CLIENT = """
import sys, time
from helpers import FINGERPRINT, key_of, make_block
from kvshelf.service.client import RemoteStore
remote = RemoteStore(sys.argv[1], namespace="tenant-a")
assert remote._arenas is not None
block = make_block(range(64), namespace="tenant-a")
assert remote.put_many([(key_of(block), block)]) == 1
assert remote.get_many([key_of(block)], fingerprint=FINGERPRINT)[0] is not None
print(remote._arenas._all[0].name, flush=True)
time.sleep(600)
"""

# A client that only creates an arena and writes into it itself.
BARE_CLIENT = """
import os, time
from kvshelf.service.arena import HEADER_BYTES, ClientArena
arena = ClientArena(1 << 20)
os.pwrite(arena._fd, b"plaintext block bytes" * 100, HEADER_BYTES)
print(arena.name, flush=True)
time.sleep(600)
"""


def _client(script: str, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-P", "-c", script, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": SUPPORT})
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name.startswith("kvshelf-arena-"), (name, proc.poll())
    return proc, name


def _kill(proc: subprocess.Popen, reap: bool = True) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    if reap:
        proc.wait(30)


def _gone_within(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not path.exists():
            return True
        time.sleep(0.05)
    return not path.exists()


def _open_by_us(name: str) -> list[str]:
    """This process's descriptors (the server runs in it) that point at the arena ``name``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if name in target:
            out.append(target)
    return out


@pytest.fixture
def serving(tmp_path, capsys) -> Iterator[Callable[[], str]]:
    """``start()`` runs ``serve()`` (sweep period SWEEP_S) in a thread and returns its gRPC address."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start() -> str:
        ready = threading.Event()
        config = ServeConfig.from_settings(listen="127.0.0.1:0", data_dir=str(tmp_path / "data"), memory="16MiB",
                                           max_disk="64MiB", grace=0, arena_sweep_interval=SWEEP_S)
        thread = threading.Thread(target=serve, args=(config,), kwargs={"ready": ready, "stop": stop}, daemon=True)
        thread.start()
        threads.append(thread)
        assert ready.wait(60)
        line = [x for x in capsys.readouterr().out.splitlines() if "kvshelf serving on" in x][0]
        return line.split("kvshelf serving on ", 1)[1].split()[0]

    yield start
    stop.set()
    for thread in threads:
        thread.join(60)


def test_killed_clients_arena_is_swept_by_the_running_server(serving):
    address = serving()
    proc, name = _client(CLIENT, address)
    path = ARENA_DIR / name
    try:
        assert path.read_bytes()[HEADER_BYTES:].rstrip(b"\0")  # the server wrote the block there
    finally:
        _kill(proc)
    assert _gone_within(path, 30), f"{path} still there {30} s after its client was killed"
    assert _open_by_us(name) == []  # no descriptor left: tmpfs frees the pages


def test_dead_clients_arena_is_swept_at_server_start(serving):
    proc, name = _client(BARE_CLIENT)
    _kill(proc)
    path = ARENA_DIR / name
    assert path.exists()  # nobody swept it yet
    serving()
    assert not path.exists()  # removed by the start-up sweep, before the server accepted calls


def _crafted_arena(pid: int, start: int, pid_namespace: int) -> Path:
    """An arena file as a client of ``pid`` would leave it, with the given creator start time and namespace."""
    path = ARENA_DIR / f"kvshelf-arena-{pid}-{os.urandom(16).hex()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.pwrite(fd, MAGIC + bytes(16) + struct.pack("<QQ", start, pid_namespace), 0)
    os.ftruncate(fd, 1 << 16)
    os.close(fd)
    return path


def test_zombie_and_reused_pid_count_as_dead_live_and_foreign_arenas_stay():
    our_ns = os.stat("/proc/self/ns/pid").st_ino
    live = ClientArena(1 << 20)  # this process: alive, same start time
    zombie, zombie_name = _client(BARE_CLIENT)
    _kill(zombie, reap=False)  # killed, not yet reaped: its pid still exists
    gone = subprocess.Popen(["true"])  # a pid that is gone (exited and reaped)
    gone.wait(30)
    reused = _crafted_arena(os.getpid(), 1, our_ns)  # names this live process, made by an earlier one
    dead = _crafted_arena(gone.pid, 1, our_ns)
    foreign = _crafted_arena(gone.pid, 1, our_ns + 1)  # another pid namespace: cannot be judged, kept
    try:
        deadline = time.monotonic() + 30
        removed: list[str] = []
        while zombie_name not in removed and time.monotonic() < deadline:  # SIGKILL lands asynchronously
            removed += sweep_dead_arenas()
            time.sleep(0.05)
        assert {zombie_name, reused.name, dead.name} <= set(removed)
        assert live.name not in removed and (ARENA_DIR / live.name).exists()
        assert foreign.name not in removed and foreign.exists()
    finally:
        zombie.wait(30)
        for path in (reused, dead, foreign):
            path.unlink(missing_ok=True)
        live.close()


def test_sweeper_thread_and_period_check():
    with pytest.raises(ValueError, match="interval"):
        ArenaSweeper(0)
    proc, name = _client(BARE_CLIENT)
    sweeper = ArenaSweeper(SWEEP_S).start()
    try:
        assert (ARENA_DIR / name).exists()  # its client still runs
        _kill(proc)
        assert _gone_within(ARENA_DIR / name, 30)
        assert sweeper.removed >= 1
    finally:
        sweeper.stop()
