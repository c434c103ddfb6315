"""Real Redis servers for the Redis tier tests: a standalone server, a 3-node Redis Cluster, and a standalone
server that a test may stop and restart. All on 127.0.0.1, free ports, no persistence, killed at teardown.

Import the fixtures into a test module (``from redis_servers import redis_server, ...``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.cluster

from kvshelf.bench.servers import HOST, MISSING, START_TIMEOUT_S, RedisProcess, binary, free_port
from kvshelf.kvstore.errors import ConfigError

__all__ = ["HOST", "MISSING", "PausableRedis", "RedisProcess", "free_port"]


def _binary(name: str) -> str:
    try:
        return binary(name)
    except ConfigError:
        pytest.fail(MISSING, pytrace=False)


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


#: the memory limit of ``maxmemory_redis``: a few MiB, so that a test fills it with a few dozen values
MAXMEMORY_BYTES = 4 << 20


@pytest.fixture
def maxmemory_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A standalone server of this test alone started with ``--maxmemory 4mb --maxmemory-policy allkeys-lru``:
    Redis evicts on its own once it holds about 4 MiB (the test may change both with CONFIG SET)."""
    server = RedisProcess(free_port(), tmp_path / "redis-maxmemory",
                          ["--maxmemory", str(MAXMEMORY_BYTES), "--maxmemory-policy", "allkeys-lru"])
    server.start()
    yield server
    server.stop()


class PausableRedis:
    """A standalone ``redis-server`` of one test that the test may freeze (SIGSTOP: it accepts connections and
    never answers, like a hung server) and thaw (SIGCONT). The fixture always thaws it before killing it."""

    def __init__(self, server: RedisProcess) -> None:
        self.server = server
        self.paused = False

    @property
    def url(self) -> str:
        return self.server.url

    def client(self) -> redis.Redis:
        return self.server.client()

    def _signal(self, sig: signal.Signals) -> None:
        assert self.server.proc is not None and self.server.proc.poll() is None, "redis-server is not running"
        os.kill(self.server.proc.pid, sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            self._signal(signal.SIGCONT)
            self.paused = False


@pytest.fixture
def pausable_redis(tmp_path: Path) -> Iterator[PausableRedis]:
    """A standalone server of this test alone, which it may ``pause()`` (SIGSTOP) and ``resume()`` (SIGCONT)."""
    server = RedisProcess(free_port(), tmp_path / "redis-pausable")
    server.start()
    handle = PausableRedis(server)
    try:
        yield handle
    finally:
        try:
            handle.resume()
        finally:
            server.stop()
