"""Real local servers for benchmarks and tests: ``redis-server`` processes (standalone, a local Redis Cluster)
and ``kvshelf serve``.

Everything binds 127.0.0.1 on a free port, keeps nothing on disk (no persistence) and is killed on exit.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import RedisError

from kvshelf.kvstore.errors import ConfigError

HOST = "127.0.0.1"
START_TIMEOUT_S = 20.0
MISSING = "redis-server / redis-cli not found on PATH: run `make redis` (or `make install`) to install Redis"


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (``ip_local_port_range``; 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port nothing listens on now, whose Redis Cluster bus port (+10000) is free too.

    Both lie below the kernel's ephemeral range. A server restarted on its port (the chaos run, the Redis tests)
    must find it free again, and a port in the ephemeral range can be taken in between by a client's outgoing
    socket: a client retrying ``127.0.0.1:port`` while nothing listens can even be handed that very port and
    connect to itself. Redis Cluster also needs the port to be at most 55535.
    """
    rng = random.Random()
    top = min(_ephemeral_low(), 65536) - 10000
    for _ in range(1000):
        port = rng.randrange(10000, max(top, 10001))
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise ConfigError("no free TCP port pair on 127.0.0.1")


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ConfigError(MISSING)
    return path


@dataclass
class RedisProcess:
    """One ``redis-server`` subprocess on ``port``, writing its log and files under ``workdir``."""

    port: int
    workdir: Path
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def log(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            binary("redis-server"), "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
            "--dir", str(self.workdir), "--logfile", str(self.log), "--protected-mode", "no", *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.wait_ready()

    def client(self) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, socket_timeout=5)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
                raise ConfigError(f"redis-server on port {self.port} exited ({self.proc.returncode}): {err}{log}")
            try:
                with self.client() as client:
                    if client.ping():
                        return
            except RedisError:
                pass
            if time.monotonic() > deadline:
                raise ConfigError(f"redis-server on port {self.port} did not answer PING within {START_TIMEOUT_S} s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill the server (SIGKILL: like a crash; nothing is saved) and wait for it to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None


@contextmanager
def redis_server(maxmemory: str = "4gb") -> Iterator[RedisProcess]:
    """A standalone ``redis-server`` (``allkeys-lru`` under ``maxmemory``) for the duration of the block."""
    with tempfile.TemporaryDirectory(prefix="kvshelf-redis-") as workdir:
        server = RedisProcess(free_port(), Path(workdir),
                              ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"])
        server.start()
        try:
            yield server
        finally:
            server.stop()


def cluster_args(workdir: Path) -> list[str]:
    """The arguments that make a ``RedisProcess`` a Redis Cluster node keeping its ``nodes.conf`` in ``workdir``."""
    return ["--cluster-enabled", "yes", "--cluster-config-file", str(workdir / "nodes.conf"),
            "--cluster-node-timeout", "5000"]


def form_cluster(nodes: Sequence[RedisProcess], cli_args: Sequence[str] = ()) -> None:
    """Start the cluster-enabled ``nodes``, join them as primaries without replicas (``redis-cli --cluster create``)
    and wait until every one reports ``cluster_state:ok``; on any failure every node is stopped and the error raised
    (``ConfigError``). ``cli_args``: redis-cli's connection options (``--tls --cacert CA`` for TLS nodes)."""
    try:
        for node in nodes:
            node.start()
        created = subprocess.run(
            [binary("redis-cli"), *cli_args, "--cluster", "create", *(f"{HOST}:{node.port}" for node in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )
        if created.returncode != 0:
            raise ConfigError(f"redis-cli --cluster create failed ({created.returncode}):\n{created.stdout}\n"
                              f"{created.stderr}")
        wait_cluster_ok(nodes)
    except BaseException:
        for node in nodes:
            node.stop()
        raise


def wait_cluster_ok(nodes: Sequence[RedisProcess]) -> None:
    """Wait until every node reports ``cluster_state:ok`` (``ConfigError`` after ``START_TIMEOUT_S``)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(_cluster_ok(node) for node in nodes):
        if time.monotonic() > deadline:
            raise ConfigError(f"Redis Cluster on ports {[n.port for n in nodes]} not ok within {START_TIMEOUT_S} s")
        time.sleep(0.1)


def _cluster_ok(node: RedisProcess) -> bool:
    with node.client() as client:
        info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


class KVShelfProcess:
    """A ``kvshelf serve`` subprocess; ``start()`` again after ``kill()`` restarts it on the same port."""

    def __init__(self, data_dir: str | Path, *extra: str, port: int | None = None) -> None:
        self.data_dir = str(data_dir)
        self.extra = extra
        self.port = port or free_port()
        self.proc: subprocess.Popen[str] | None = None
        self.output: deque[str] = deque(maxlen=200)  # its last lines of output

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def _drain(self, stdout: Any) -> None:
        """Read the server's output to the end: a full pipe would block its threads on their next log line."""
        for line in stdout:
            self.output.append(line)

    def start(self) -> KVShelfProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from kvshelf.cli import main; main()", "serve", "--listen", self.address,
             "--data-dir", self.data_dir, *self.extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        assert self.proc.stdout is not None
        seen = []
        for line in self.proc.stdout:
            seen.append(line)
            if "kvshelf serving on" in line:
                threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()
                return self
        self.proc.wait(timeout=30)
        raise ConfigError(f"kvshelf serve did not start: {''.join(seen)[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: a crash, no draining."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def kvshelf_server(data_dir: str, *extra: str) -> Iterator[str]:
    """A `kvshelf serve` subprocess (4 GiB memory tier) over ``data_dir``; yields ``host:port``."""
    server = KVShelfProcess(data_dir, "--memory", "4GiB", *extra).start()
    try:
        yield server.address
    finally:
        server.terminate()
