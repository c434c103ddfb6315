"""Real Redis servers for the Redis tier tests: a standalone server, a 3-node Redis Cluster, a standalone
server that a test may stop and restart, and TLS ones (a standalone server and a 3-node Cluster speaking only
TLS, with a self-signed CA and server certificate made per session by the ``openssl`` CLI). All on 127.0.0.1, free
ports, no persistence, killed at teardown.

Import the fixtures into a test module (``from redis_servers import redis_server, ...``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
import redis.cluster

from kvshelf.bench.servers import HOST, MISSING, RedisProcess, cluster_args, form_cluster, free_port, wait_cluster_ok
from kvshelf.kvstore.errors import ConfigError

__all__ = ["HOST", "MISSING", "PausableRedis", "RedisProcess", "TLSFiles", "TLSRedisProcess", "free_port"]


@dataclass
class RedisClusterProcesses:
    """Three primaries of a local Redis Cluster (no replicas)."""

    nodes: list[RedisProcess]
    tls: TLSFiles | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss+cluster://{HOST}:{self.nodes[0].port}?ssl_ca_certs={quote(str(self.tls.ca))}"
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    def client(self) -> redis.cluster.RedisCluster:
        tls = {} if self.tls is None else {"ssl": True, "ssl_ca_certs": str(self.tls.ca)}
        return redis.cluster.RedisCluster(host=HOST, port=self.nodes[0].port, socket_timeout=5, **tls)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def start(self) -> None:
        """Restart stopped nodes on their ports; they rejoin from their nodes.conf (empty: no persistence)."""
        for node in self.nodes:
            if node.proc is None:
                node.start()
        try:
            wait_cluster_ok(self.nodes)
        except ConfigError as exc:
            pytest.fail(str(exc), pytrace=False)


def start_cluster(workdir: Path, size: int = 3, tls: TLSFiles | None = None) -> RedisClusterProcesses:
    """Start ``size`` cluster-enabled servers, join them with ``redis-cli --cluster create``, wait for ok.
    ``tls``: the nodes speak only TLS (clients, the cluster bus and replication alike)."""
    nodes: list[RedisProcess] = []
    for n in range(size):
        args = cluster_args(workdir / f"node-{n}")
        if tls is None:
            nodes.append(RedisProcess(free_port(), workdir / f"node-{n}", args))
        else:
            nodes.append(TLSRedisProcess(free_port(), workdir / f"node-{n}", [
                *args, "--tls-cluster", "yes", "--tls-replication", "yes"], tls=tls))
    try:
        form_cluster(nodes, [] if tls is None else ["--tls", "--cacert", str(tls.ca)])
    except ConfigError as exc:
        pytest.fail(str(exc), pytrace=False)
    return RedisClusterProcesses(nodes, tls)


@dataclass(frozen=True)
class TLSFiles:
    """A self-signed CA and a server certificate it signed (subjectAltName ``IP:127.0.0.1``), PEM files. The
    certificate is for client authentication too: Cluster nodes present it to each other on the TLS cluster bus,
    which always verifies the connecting node (``--tls-auth-clients no`` covers only clients)."""

    ca: Path
    cert: Path
    key: Path


def make_tls_files(workdir: Path) -> TLSFiles:
    """A fresh CA and server certificate under ``workdir``, made with the ``openssl`` CLI (RSA 2048, 2 days)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl not found on PATH: the TLS Redis tests need it to make their certificates",
                    pytrace=False)
    workdir.mkdir(parents=True, exist_ok=True)
    files = TLSFiles(workdir / "ca.pem", workdir / "server.pem", workdir / "server.key")
    ca_key, csr, ext = workdir / "ca.key", workdir / "server.csr", workdir / "server.ext"
    ext.write_text("subjectAltName = IP:127.0.0.1\nbasicConstraints = CA:FALSE\n"
                   "keyUsage = digitalSignature, keyEncipherment\nextendedKeyUsage = serverAuth, clientAuth\n")
    for command in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", files.ca, "-days", "2",
         "-subj", "/CN=kvshelf test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", files.key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", files.ca, "-CAkey", ca_key, "-CAcreateserial", "-out", files.cert,
         "-days", "2", "-extfile", ext],
    ):
        done = subprocess.run([openssl, *map(str, command)], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            pytest.fail(f"openssl {' '.join(map(str, command))} failed ({done.returncode}):\n{done.stderr}")
    return files


@dataclass
class TLSRedisProcess(RedisProcess):
    """A ``redis-server`` speaking only TLS on ``port`` (``--port 0 --tls-port PORT``), clients unauthenticated."""

    tls: TLSFiles | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        assert self.tls is not None, "TLSRedisProcess needs its TLSFiles"
        # redis-server applies its arguments in order: this --port 0 overrides RedisProcess.start's --port
        self.extra_args = [
            "--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
            "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
            "--tls-auth-clients", "no", *self.extra_args,
        ]

    @property
    def url(self) -> str:
        assert self.tls is not None
        return f"rediss://{HOST}:{self.port}/0?ssl_ca_certs={quote(str(self.tls.ca))}"

    @property
    def plain_url(self) -> str:
        """A non-TLS URL of the TLS port (which a client cannot use)."""
        return f"redis://{HOST}:{self.port}/0"

    def client(self) -> redis.Redis:
        assert self.tls is not None
        return redis.Redis(host=HOST, port=self.port, socket_timeout=5, ssl=True, ssl_ca_certs=str(self.tls.ca))


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


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """A self-signed CA and a 127.0.0.1 server certificate, made once per session."""
    return make_tls_files(tmp_path_factory.mktemp("redis-tls-certs"))


@pytest.fixture(scope="session")
def tls_redis_server(tmp_path_factory: pytest.TempPathFactory, tls_files: TLSFiles) -> Iterator[TLSRedisProcess]:
    """A standalone ``redis-server`` speaking only TLS, for the whole session; its ``url`` is
    ``rediss://127.0.0.1:PORT/0?ssl_ca_certs=CA`` (the certificate verified, hostname included)."""
    server = TLSRedisProcess(free_port(), tmp_path_factory.mktemp("redis-tls"), tls=tls_files)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tls_redis_cluster(tmp_path_factory: pytest.TempPathFactory, tls_files: TLSFiles) -> Iterator[RedisClusterProcesses]:
    """A real 3-primary Redis Cluster speaking only TLS (``--tls-cluster yes --tls-replication yes``), for the
    whole session; its ``url`` is ``rediss+cluster://127.0.0.1:PORT?ssl_ca_certs=CA``."""
    cluster = start_cluster(tmp_path_factory.mktemp("redis-tls-cluster"), tls=tls_files)
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
