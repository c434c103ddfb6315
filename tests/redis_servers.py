"""Real Redis servers for the Redis tier tests: a standalone server, a 3-node Redis Cluster, and a standalone
server that a test may stop and restart. All on 127.0.0.1, free ports, no persistence, killed at teardown.

Import the fixtures into a test module (``from redis_servers import redis_server, ...``).
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import redis.cluster

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


def free_port() -> int:
    """A TCP port nothing listens on now, whose cluster bus port (+10000) is free too.

    Redis Cluster needs the port to be at most 55535, so this picks from 20000-45000 rather than taking the
    kernel's ephemeral pick.
    """
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free TCP port pair on 127.0.0.1")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(MISSING, pytrace=False)
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
            _binary("redis-server"), "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
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
                pytest.fail(f"redis-server on port {self.port} exited ({self.proc.returncode}): {err}{log}")
            try:
                with self.client() as client:
                    if client.ping():
                        return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"redis-server on port {self.port} did not answer PING within {START_TIMEOUT_S} s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill the server (SIGKILL: like a crash; nothing is saved) and wait for it to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None


@dataclass
class RedisClusterProcesses:
    """Three primaries of a local Redis Cluster (no replicas)."""

    nodes: list[RedisProcess]

    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    def client(self) -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster(host=HOST, port=self.nodes[0].port, socket_timeout=5)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def start(self) -> None:
        """Restart stopped nodes on their ports; they rejoin from their nodes.conf (empty: no persistence)."""
        for node in self.nodes:
            if node.proc is None:
                node.start()
        wait_cluster_ok(self.nodes)


def start_cluster(workdir: Path, size: int = 3) -> RedisClusterProcesses:
    """Start ``size`` cluster-enabled servers, join them with ``redis-cli --cluster create``, wait for ok."""
    redis_cli = _binary("redis-cli")
    nodes = []
    for n in range(size):
        port = free_port()
        nodes.append(RedisProcess(port, workdir / f"node-{n}", [
            "--cluster-enabled", "yes", "--cluster-config-file", str(workdir / f"node-{n}" / f"nodes-{n}.conf"),
            "--cluster-node-timeout", "5000",
        ]))
    cluster = RedisClusterProcesses(nodes)
    try:
        for node in nodes:
            node.start()
        create = subprocess.run(
            [redis_cli, "--cluster", "create", *(f"{HOST}:{node.port}" for node in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )
        if create.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed ({create.returncode}):\n{create.stdout}\n{create.stderr}")
        wait_cluster_ok(nodes)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_cluster_ok(nodes: list[RedisProcess]) -> None:
    """Wait until every node reports ``cluster_state:ok``."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(_cluster_ok(node) for node in nodes):
        if time.monotonic() > deadline:
            pytest.fail(f"Redis Cluster on ports {[n.port for n in nodes]} not ok within {START_TIMEOUT_S} s")
        time.sleep(0.1)


def _cluster_ok(node: RedisProcess) -> bool:
    with node.client() as client:
        info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A standalone ``redis-server`` for the whole session (tests separate themselves by key prefix)."""
    server = RedisProcess(free_port(), tmp_path_factory.mktemp("redis-standalone"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    """A real 3-primary Redis Cluster for the whole session."""
    cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A standalone server of this test alone, which it may ``stop()`` and ``start()`` again on the same port."""
    server = RedisProcess(free_port(), tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def restartable_cluster(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    """A 3-node Redis Cluster of this test alone, which it may ``stop()`` and ``start()`` again."""
    cluster = start_cluster(tmp_path / "cluster")
    yield cluster
    cluster.stop()
