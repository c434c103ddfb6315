"""Same-host fast path for ``GetBlocks``: values handed over through a client-owned shared-memory file.

Over the wire a block is copied by protobuf, by gRPC's HTTP/2 framing, twice by the kernel's loopback TCP and
once more into a Python ``bytes``. When client and server share a machine, the client can instead name a
file it owns in ``/dev/shm`` (an *arena*) in its ``GetBlocks`` request; the server ``pwrite``s each value
into it and streams only ``(offset, length)``; the client ``pread``s the value out: two kernel copies in all.

Safety:
- the client creates the arena ``0600`` under a random name and writes a random 16-byte token into its
  header; the server only writes into a regular file (no symlinks) named like an arena, owned by its own
  user, whose header carries the token the request names: a caller cannot make the server write into a file
  it does not own and know the token of;
- the server offers the path only to loopback or Unix-socket peers and only when enabled
  (``kvshelf serve --no-shared-memory`` turns it off); a value that does not fit, or any error opening or
  writing the arena, falls back to the wire for that value: the path is an optimisation, never a failure;
- ``pwrite``/``pread`` (not ``mmap``) so a full ``/dev/shm`` is an ``OSError`` (fallback), never ``SIGBUS``;
- one request at a time per arena (the client keeps a pool); the server only holds an arena open for the
  request that names it;
- arenas of dead clients (a client SIGKILLed before it could unlink its arena, whose plaintext blocks would
  otherwise stay in ``/dev/shm``) are removed by ``sweep_dead_arenas``: when a client creates an arena, and
  in ``kvshelf serve`` at start and every ``--arena-sweep-interval`` seconds (``ArenaSweeper``). A creator is
  dead when its pid is gone, is a zombie, or now belongs to a newer process (the creator's start time, from
  ``/proc/<pid>/stat``, is kept in the arena header); an arena created in another pid namespace (a client in
  another container sharing ``/dev/shm``) is left alone, as the server cannot check its pid.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from kvshelf.kvstore.errors import ConfigError
from kvshelf.service.errors import ArenaUnavailable

log = logging.getLogger(__name__)

ARENA_DIR = Path("/dev/shm")
MAGIC = b"KVSHARENA1\0\0\0\0\0\0"  # 16 bytes
TOKEN_BYTES = 16
HEADER_BYTES = 64  # magic, token, creator start time and pid namespace, padding: values start here
_START_AT = len(MAGIC) + TOKEN_BYTES  # 8 + 8 bytes: the creator's start time (clock ticks since boot), pid namespace
DEFAULT_SWEEP_INTERVAL_S = 30.0
DEFAULT_ARENA_BYTES = 256 << 20  # sparse: tmpfs pages are only taken as values are written
_NAME = re.compile(r"kvshelf-arena-(\d+)-[0-9a-f]{32}")


def shared_memory_supported() -> bool:
    """Whether this machine has a writable ``/dev/shm`` (Linux)."""
    return ARENA_DIR.is_dir() and os.access(ARENA_DIR, os.W_OK)


def _process_start(pid: int) -> int | None:
    """Start time of the live process ``pid`` (clock ticks since boot; 0 where ``/proc`` cannot tell); None
    when there is no such process or it is a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[-1].split()  # after "pid (comm)": state, ppid, ...
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: fall back on signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except (PermissionError, OverflowError):
            pass
        return 0
    try:
        if fields[0] in (b"Z", b"X"):
            return None
        return int(fields[19])  # field 22 of proc(5): starttime
    except (IndexError, ValueError):  # a format this code does not know: cannot tell
        return 0


def _pid_namespace() -> int:
    """Inode of this process's pid namespace (0 where ``/proc`` cannot tell): pids of another namespace (a
    client in another container sharing ``/dev/shm``) mean nothing here."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _creator_header() -> bytes:
    """What a client records after magic and token: its start time and pid namespace (8 bytes each)."""
    return struct.pack("<QQ", _process_start(os.getpid()) or 0, _pid_namespace())


def _creator_alive(path: Path, pid: int) -> bool:
    """Whether the process that created the arena at ``path`` still runs (unsure: True, the arena is kept)."""
    if pid <= 0 or pid > 1 << 22:  # outside Linux's pid range: not a process of ours, leave the file alone
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return True
    try:
        recorded = os.pread(fd, 16, _START_AT)
    except OSError:
        return True
    finally:
        os.close(fd)
    creator_start, creator_ns = struct.unpack("<QQ", recorded) if len(recorded) == 16 else (0, 0)
    if creator_ns and creator_ns != _pid_namespace():
        return True  # created in another pid namespace: its pid cannot be checked from here
    started = _process_start(pid)
    if started is None:
        return False
    return started == 0 or creator_start in (0, started)  # 0: unknown, or an arena of an older client


def sweep_dead_arenas(directory: Path | None = None) -> list[str]:
    """Remove the arenas (regular files of this user named like an arena) whose creating process is dead;
    return their names. Never raises: a file that cannot be checked or removed is left alone."""
    removed = []
    directory = directory or ARENA_DIR
    try:
        paths = list(directory.glob("kvshelf-arena-*"))
    except OSError:
        return removed
    for path in paths:
        match = _NAME.fullmatch(path.name)
        if match is None:
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            continue
        if _creator_alive(path, int(match.group(1))):
            continue
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    if removed:
        log.info("removed %d arena(s) of dead clients from %s", len(removed), directory)
    return removed


class ArenaSweeper:
    """``sweep_dead_arenas`` now and every ``interval_s`` seconds in a daemon thread, until ``stop``."""

    def __init__(self, interval_s: float = DEFAULT_SWEEP_INTERVAL_S, directory: Path | None = None) -> None:
        if not interval_s > 0:
            raise ConfigError(f"arena sweep interval must be > 0 seconds, got {interval_s!r}")
        self.interval_s = interval_s
        self.directory = directory
        self.removed = 0  # arenas removed so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep(self) -> list[str]:
        names = sweep_dead_arenas(self.directory)
        self.removed += len(names)
        return names

    def start(self) -> ArenaSweeper:
        self.sweep()
        self._thread = threading.Thread(target=self._loop, name="kvshelf-arena-sweep", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 (a sweep must never end the loop)
                log.exception("arena sweep failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class ClientArena:
    """One client-owned arena file: create, ``read`` values the server wrote, ``close`` (unlinks it)."""

    def __init__(self, capacity: int = DEFAULT_ARENA_BYTES) -> None:
        if capacity <= HEADER_BYTES:
            raise ValueError(f"arena capacity must exceed {HEADER_BYTES} bytes, got {capacity}")
        sweep_dead_arenas()
        self.name = f"kvshelf-arena-{os.getpid()}-{secrets.token_hex(16)}"
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.capacity = capacity
        path = ARENA_DIR / self.name
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(self._fd, capacity)  # sparse: no memory taken until written
            os.pwrite(self._fd, MAGIC + self.token + _creator_header(), 0)
        except OSError:
            self.close()
            raise

    def read(self, offset: int, length: int) -> bytes:
        """The ``length`` bytes at ``offset`` (a copy: the arena is reused by the next request)."""
        if offset < HEADER_BYTES or length < 0 or offset + length > self.capacity:
            raise ArenaUnavailable(f"arena range {offset}+{length} outside the arena ({self.capacity} bytes)")
        data = os.pread(self._fd, length, offset)
        if len(data) != length:
            raise ArenaUnavailable(f"arena read short: {len(data)} of {length} bytes")
        return data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        (ARENA_DIR / self.name).unlink(missing_ok=True)


class ArenaPool:
    """Arenas for a multi-threaded client: each request takes one, and gives it back when done."""

    def __init__(self, capacity: int = DEFAULT_ARENA_BYTES) -> None:
        self.capacity = capacity
        self._free: list[ClientArena] = []
        self._all: list[ClientArena] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self) -> ClientArena:
        with self._lock:
            if self._closed:
                raise ArenaUnavailable("arena pool closed")
            if self._free:
                return self._free.pop()
        arena = ClientArena(self.capacity)
        with self._lock:
            self._all.append(arena)
        return arena

    def release(self, arena: ClientArena) -> None:
        with self._lock:
            if self._closed:
                arena.close()
            else:
                self._free.append(arena)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            arenas, self._all, self._free = self._all, [], []
        for arena in arenas:
            arena.close()


@dataclass
class ArenaWriter:
    """Server side of one request's arena: ``write`` returns the offset of a value, or ``None`` (use the wire)."""

    fd: int
    capacity: int
    offset: int = HEADER_BYTES

    @classmethod
    def open(cls, name: str, token: bytes) -> ArenaWriter:
        """Open the arena ``name`` after checking it is a regular arena file of ours carrying ``token``."""
        if _NAME.fullmatch(name) is None:
            raise ArenaUnavailable(f"not an arena name: {name!r}")
        if len(token) != TOKEN_BYTES:
            raise ArenaUnavailable("arena token must be 16 bytes")
        try:
            fd = os.open(ARENA_DIR / name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise ArenaUnavailable(f"cannot open arena {name}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise ArenaUnavailable(f"arena {name} is not a regular file owned by this server's user")
            if os.pread(fd, HEADER_BYTES, 0)[: len(MAGIC) + TOKEN_BYTES] != MAGIC + token:
                raise ArenaUnavailable(f"arena {name}: wrong header or token")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd=fd, capacity=info.st_size)

    def write(self, value: bytes | memoryview) -> int | None:
        """Write ``value`` at the next free offset; ``None`` when it does not fit or the write fails."""
        size = len(value)
        if self.fd < 0 or self.offset + size > self.capacity:
            return None
        try:
            written = os.pwrite(self.fd, value, self.offset)
        except OSError as exc:  # /dev/shm full: the rest goes over the wire
            log.debug("arena write failed (%s): falling back to the wire", exc)
            self.close()
            return None
        if written != size:
            self.close()
            return None
        offset, self.offset = self.offset, self.offset + size
        return offset

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
